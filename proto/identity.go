package proto

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
)

// A volunteer's identity is its worker's Ed25519 key (Hello.SigningKey), kept across restarts
// (shoal worker --identity, a browser's IndexedDB), so that credit accumulates per volunteer and
// a ban follows the volunteer rather than a worker id. A key is only a claim until its holder
// proves it has the private half: a coordinator that receives a Hello with a SigningKey answers
// with a Challenge of fresh random bytes, the worker answers with a Proof, a signature over
// ProofMessage, and only then is it welcomed. A worker that claims someone else's public key
// cannot sign, and is refused before anything about it is recorded.

// ChallengeBytes is the size of Challenge.Nonce.
const ChallengeBytes = 32

// IdentityDomain separates identity proofs from every other use of the key (the outer-step
// commitments of package audit sign other messages with it): no signature made for one can be
// replayed as the other.
const IdentityDomain = "shoal identity proof v1\x00"

// Challenge asks a joining worker to prove that it holds the private key of its
// Hello.SigningKey; it comes before the Welcome.
type Challenge struct {
	Nonce []byte `json:"nonce"`
}

func (*Challenge) Type() MessageType { return TypeChallenge }

func (m *Challenge) Validate() error {
	if len(m.Nonce) != ChallengeBytes {
		return invalid("nonce", "%d bytes, want %d", len(m.Nonce), ChallengeBytes)
	}
	return nil
}

// Proof answers a Challenge: the Ed25519 signature of ProofMessage(nonce, key).
type Proof struct {
	Signature []byte `json:"signature"`
}

func (*Proof) Type() MessageType { return TypeProof }

func (m *Proof) Validate() error {
	if len(m.Signature) != ed25519.SignatureSize {
		return invalid("signature", "%d bytes, want %d", len(m.Signature), ed25519.SignatureSize)
	}
	return nil
}

// ProofMessage is what a worker signs to prove its identity: the domain, the coordinator's
// nonce (fresh for every connection, so that no proof is worth anything twice) and the public
// key itself.
func ProofMessage(nonce, key []byte) []byte {
	m := make([]byte, 0, len(IdentityDomain)+len(nonce)+len(key))
	m = append(m, IdentityDomain...)
	m = append(m, nonce...)
	return append(m, key...)
}

// Fingerprint names the volunteer that holds key: "id:" and the first 128 bits of its sha256, in
// hex. It is what credit and bans are kept under; a worker id cannot contain ':', so no worker
// id is ever mistaken for one.
func Fingerprint(key []byte) string {
	if len(key) == 0 {
		return ""
	}
	sum := sha256.Sum256(key)
	return "id:" + hex.EncodeToString(sum[:16])
}
