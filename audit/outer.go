package audit

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// Outer commitments (sync mode "outer"). At an outer step each replica's stage sends each other
// replica's stage the segment it owns (model.OuterSegment) of what it gives of each tensor — θ_r,
// or its int8 pseudo-gradient — peer to peer, and each owner sends the others its average of its
// segment; the coordinator sees none of it. A receiver refuses a contribution that no honest replica could
// have sent (OuterBound), but its refusal alone proves nothing: the accuser may be the liar, and
// with two replicas there is nobody to outvote it. So the sender signs what it sends:
//
//   - Both the global θ the sender starts from (Base) and what it gives (Given) of the segment are
//     cut into chunks of model.OuterChunk values — the chunks OuterBound judges one by one — and
//     hashed into a Merkle tree each (MerkleRoot).
//   - Each segment of a tensor sent is an entry (OuterEntry: the tensor, the segment's chunks and
//     both roots), and the sender signs a batch of them at once: OuterBatchMessage, over the job,
//     plan, step, replica and the Merkle root of the entries, with the Ed25519 key whose public
//     half it gave in its Hello (an owner its averages as such, checked by every receiver with
//     OuterBound.CheckAverage). The signature and the entries' leaves travel once to the stage
//     the batch goes to (proto.OuterBatchSig), and each segment's place in its batch beside it
//     (proto.OuterSigEntry), both under proto.OuterSigKey.
//   - The receiver verifies the signature with its own global θ's root before it uses anything
//     (once a batch), and each segment's entry against its leaf:
//     an honest receiver holds the same global θ as an honest sender, so a signature that does not
//     verify means a false sender (or replicas that already disagree), and proves nothing either
//     way. One that verifies binds the sender to every chunk.
//   - When a chunk breaks the bound, the receiver shows that chunk of both, their Merkle paths,
//     the entry's path in its batch and the signature (proto.OuterEvidence). CheckOuterEvidence decides: a valid signature over a
//     chunk beyond the bound convicts the sender; anything else — a false signature, a path that
//     does not lead to the signed root, a chunk within the bound — convicts the accuser, since an
//     honest receiver shows only what it verified and refused.
//
// A sender cannot deny what it signed, and a receiver cannot forge what it was not sent.

// outerDomain separates outer-step signatures from anything else a key could sign. Version 2:
// one signature covers a batch of segments (OuterEntry); version 1 signed each segment alone.
const outerDomain = "shoal-outer/2\x00"

// outerAverageDomain separates an owner's averages from contributions.
const outerAverageDomain = "shoal-outer-average/2\x00"

// outerEntryDomain separates a batch's entry from a chunk of what crossed, which is hashed into
// leaves the same way (merkleLeaf) in trees of their own.
const outerEntryDomain = "shoal-outer-entry/1\x00"

// OuterEntry is one segment of one tensor in a batch a sender signs at once: Segment the chunks
// [first, end) of tensor number Tensor that it sends, Base and Given the Merkle roots of those
// chunks of the global θ it started from and of what it sends (OuterBaseLeaves,
// OuterGivenLeaves).
type OuterEntry struct {
	Tensor      int
	Segment     [2]int
	Base, Given [32]byte
}

// Leaf is the entry's leaf in its batch's Merkle tree.
func (e OuterEntry) Leaf() [32]byte {
	b := make([]byte, 0, len(outerEntryDomain)+84)
	b = append(b, outerEntryDomain...)
	b = binary.LittleEndian.AppendUint32(b, uint32(e.Tensor))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.Segment[0]))
	b = binary.LittleEndian.AppendUint64(b, uint64(e.Segment[1]))
	b = append(b, e.Base[:]...)
	b = append(b, e.Given[:]...)
	return merkleLeaf(b)
}

// OuterBatchMessage is what replica's stage signs of a batch of entries (OuterEntry) it sends
// at the outer step after step: root is the Merkle root of the entries' leaves, entries how many
// there are. With average the entries are of the owner's averages in the all-gather, not of
// contributions. A sender signs once for what it hands a partner of a tensor at once — its
// contributions to the segments that partner owns — or for its averages of a tensor, which every
// holder receives alike, so that the signatures an exchange takes do not grow with the segments a
// replica owns.
func OuterBatchMessage(jobID string, plan uint32, step uint64, replica int, compressed, average bool, entries int, root [32]byte) []byte {
	domain := outerDomain
	if average {
		domain = outerAverageDomain
	}
	b := make([]byte, 0, len(domain)+len(jobID)+60)
	b = append(b, domain...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(jobID)))
	b = append(b, jobID...)
	b = binary.LittleEndian.AppendUint32(b, plan)
	b = binary.LittleEndian.AppendUint64(b, step)
	b = binary.LittleEndian.AppendUint32(b, uint32(replica))
	if compressed {
		b = append(b, 1)
	} else {
		b = append(b, 0)
	}
	b = binary.LittleEndian.AppendUint64(b, uint64(entries))
	return append(b, root[:]...)
}

// The chunks of a tensor at an outer step. The global θ's (Base) are model.OuterChunk float32s
// each, little-endian, the last one shorter when the tensor is. What a stage gives (Given) is cut
// as it crosses, from the payloads of the tensor's parts (model.OuterLayout.AppendChunk): without
// compression a chunk is model.OuterChunk float32s of θ_r; with int8 its row's scale (4 bytes)
// and codes. Leaves are hashed a chunk at a time, so that a tensor is never copied whole.

// OuterBaseChunk is chunk c of global θ g, appended to buf.
func OuterBaseChunk(buf []byte, g []float32, c int) []byte {
	a := c * model.OuterChunk
	return proto.AppendFloat32s(buf, g[a:min(a+model.OuterChunk, len(g))])
}

// OuterBaseLeaves are the Merkle leaves of global θ g's chunks.
func OuterBaseLeaves(g []float32) [][32]byte {
	n := model.OuterLayout{N: len(g)}.Chunks()
	out := make([][32]byte, n)
	var buf []byte
	for c := range n {
		buf = OuterBaseChunk(buf[:0], g, c)
		out[c] = merkleLeaf(buf)
	}
	return out
}

// OuterGivenChunk is chunk c of what a stage gives of a tensor of n values (parts, checked by
// OuterGivenLeaves), appended to buf.
func OuterGivenChunk(buf []byte, n int, parts [2][]byte, compressed bool, c int) []byte {
	return model.OuterLayout{N: n, Int8: compressed}.AppendChunk(buf, parts, c)
}

// OuterGivenLeaves are the Merkle leaves of what a stage gives of a tensor of n values; it fails
// when parts are not of such a tensor.
func OuterGivenLeaves(n int, parts [2][]byte, compressed bool) ([][32]byte, error) {
	l := model.OuterLayout{N: n, Int8: compressed}
	if err := l.CheckParts(parts); err != nil {
		return nil, err
	}
	out := make([][32]byte, l.Chunks())
	var buf []byte
	for c := range out {
		buf = l.AppendChunk(buf[:0], parts, c)
		out[c] = merkleLeaf(buf)
	}
	return out, nil
}

// Merkle trees over chunks: a leaf is SHA-256(0x00 ‖ chunk), a node SHA-256(0x01 ‖ left ‖
// right); a level's last node without a partner goes up unchanged. The prefixes keep a leaf from
// passing for a node.

func merkleLeaf(chunk []byte) [32]byte {
	h := sha256.New()
	h.Write([]byte{0})
	h.Write(chunk)
	var out [32]byte
	h.Sum(out[:0])
	return out
}

func merkleNode(l, r [32]byte) [32]byte {
	var b [65]byte
	b[0] = 1
	copy(b[1:], l[:])
	copy(b[33:], r[:])
	return sha256.Sum256(b[:])
}

// MerkleRoot is the root of leaves; the zero hash of none.
func MerkleRoot(leaves [][32]byte) [32]byte {
	if len(leaves) == 0 {
		return [32]byte{}
	}
	level := append([][32]byte(nil), leaves...)
	for len(level) > 1 {
		next := level[:0]
		for i := 0; i < len(level); i += 2 {
			if i+1 < len(level) {
				next = append(next, merkleNode(level[i], level[i+1]))
			} else {
				next = append(next, level[i])
			}
		}
		level = next
	}
	return level[0]
}

// MerklePath is the path of leaf i to the root: its partner's hash at every level that has one.
func MerklePath(leaves [][32]byte, i int) [][]byte {
	var path [][]byte
	level := append([][32]byte(nil), leaves...)
	for len(level) > 1 {
		if j := i ^ 1; j < len(level) {
			path = append(path, append([]byte(nil), level[j][:]...))
		}
		next := make([][32]byte, 0, (len(level)+1)/2)
		for k := 0; k < len(level); k += 2 {
			if k+1 < len(level) {
				next = append(next, merkleNode(level[k], level[k+1]))
			} else {
				next = append(next, level[k])
			}
		}
		level, i = next, i/2
	}
	return path
}

// MerkleVerify reports whether path leads leaf, number i of n, to root.
func MerkleVerify(root, leaf [32]byte, i, n int, path [][]byte) bool {
	h, ok := rootOf(leaf, i, n, path)
	return ok && h == root
}

// rootOf is the root that path leads leaf i of n to; false when the path is not one of a leaf
// of n.
func rootOf(leaf [32]byte, i, n int, path [][]byte) ([32]byte, bool) {
	if i < 0 || i >= n {
		return [32]byte{}, false
	}
	h := leaf
	for n > 1 {
		if j := i ^ 1; j < n {
			if len(path) == 0 || len(path[0]) != 32 {
				return [32]byte{}, false
			}
			var p [32]byte
			copy(p[:], path[0])
			path = path[1:]
			if i&1 == 0 {
				h = merkleNode(h, p)
			} else {
				h = merkleNode(p, h)
			}
		}
		i, n = i/2, (n+1)/2
	}
	return h, len(path) == 0
}

// OuterBound is the bound a receiver holds a contribution to at the outer step after a training
// step (see model/outerbound.go): what the round's AdamW steps can move a parameter from the
// global θ, chunk by chunk at the chunk's largest |θ|. Receiver and coordinator compute it alike
// from the job, so the coordinator can judge a refusal from one chunk.
type OuterBound struct {
	steps      int     // the round's training steps so far
	p, l       float64 // their AdamW movement and learning-rate sum
	pmax, lmax float64 // the largest round's so far, which int8's carried error feedback is of
	wd         float64
	compressed bool
}

// NewOuterBound is the bound at the outer step after step of spec: with int8 (compressed) what
// crosses is the pseudo-gradient plus its sender's error feedback, rounded — the feedback carried
// from earlier rounds is at most half a code of their chunks (at most 1/254 of their largest
// value, and what it carried decays as fast), which the largest round's limit over 100 covers,
// and rounding adds at most half a code of this round's chunk.
func NewOuterBound(spec job.Spec, step int, compressed bool) OuterBound {
	H, w := spec.Sync.Every, spec.SyncWarmup()
	// The round's first step: after the outer step that ended the last, rounds counted from the
	// synchronous warm-up's end (job.Spec.OuterStepAfter).
	s0 := w + max(step-w, 0)/H*H
	lrs := make([]float64, step+1-s0)
	for k := range lrs {
		lrs[k] = spec.LRAt(s0 + k)
	}
	b := OuterBound{steps: len(lrs), wd: spec.WeightDecay, compressed: compressed}
	b.p, b.l = model.AdamWMovement(lrs, s0+1)
	for seen := w; seen <= s0; seen += H {
		rl := make([]float64, min(H, spec.Steps-seen))
		for k := range rl {
			rl[k] = spec.LRAt(seen + k)
		}
		rp, rs := model.AdamWMovement(rl, seen+1)
		b.pmax, b.lmax = max(b.pmax, rp), max(b.lmax, rs)
	}
	return b
}

// Limit is the largest |pseudo-gradient| of a chunk whose largest global |θ| is theta0.
func (b OuterBound) Limit(theta0 float64) float64 {
	limit := model.OuterDeltaLimit(theta0, b.p, b.l, b.wd)
	if b.compressed {
		limit = (limit + model.OuterDeltaLimit(theta0, b.pmax, b.lmax, b.wd)/100) * (1 + 1.0/127)
	}
	// float32 rounding of every step's update: a few ulps of the parameter a step.
	return limit + float64(b.steps)*(theta0+limit)*0x1p-20
}

// Check checks one chunk: g is the global θ's, x what was given — θ_q, or the decoded int8
// pseudo-gradient. It returns the first value beyond the limit.
func (b OuterBound) Check(g, x []float32) (i int, d, limit float64, ok bool) {
	var theta0 float64
	for _, v := range g {
		theta0 = max(theta0, math.Abs(float64(v)))
	}
	limit = b.Limit(theta0)
	for i, v := range x {
		d := float64(v)
		if !b.compressed {
			d = float64(g[i]) - float64(v)
		}
		if !(math.Abs(d) <= limit) {
			return i, d, limit, false
		}
	}
	return 0, 0, limit, true
}

// CheckAverage checks one chunk of a segment's average as its owner sends it back in the
// all-gather (a pseudo-gradient, float32 or decoded int8), g the global θ's: the mean of
// contributions each within the limit, plus with int8 the average's own rounding and carried
// error feedback, which a contribution's allowance covers once more — twice the limit. It
// returns the first value beyond it.
func (b OuterBound) CheckAverage(g, avg []float32) (i int, d, limit float64, ok bool) {
	var theta0 float64
	for _, v := range g {
		theta0 = max(theta0, math.Abs(float64(v)))
	}
	limit = 2 * b.Limit(theta0)
	for i, v := range avg {
		if d := float64(v); !(math.Abs(d) <= limit) {
			return i, d, limit, false
		}
	}
	return 0, 0, limit, true
}

// OuterGivenValues decodes a chunk as it crossed (OuterGivenChunk) into its n values: θ_q, or
// the int8 pseudo-gradient. It fails on a chunk that is not of n values or not valid on the wire
// (an int8 scale that is negative or not finite, a code of -128).
func OuterGivenValues(chunk []byte, n int, compressed bool) ([]float32, error) {
	if !compressed {
		if len(chunk) != 4*n {
			return nil, fmt.Errorf("%d bytes, want float32 × %d", len(chunk), n)
		}
		return proto.Float32s(chunk)
	}
	if len(chunk) != 4+n {
		return nil, fmt.Errorf("%d bytes, want an int8 row of %d", len(chunk), n)
	}
	s := math.Float32frombits(binary.LittleEndian.Uint32(chunk))
	if !(s >= 0) || math.IsInf(float64(s), 0) || math.Signbit(float64(s)) {
		return nil, fmt.Errorf("int8 scale %v", s)
	}
	codes := make([]int8, n)
	for i, c := range chunk[4:] {
		if c == 0x80 {
			return nil, errors.New("an int8 code of -128")
		}
		codes[i] = int8(c)
	}
	x := make([]float32, n)
	model.Int8Decode(x, codes, s)
	return x, nil
}

// Outer evidence verdicts (CheckOuterEvidence).
var (
	// ErrOuterSenderFalse: the sender signed a chunk beyond the bound.
	ErrOuterSenderFalse = errors.New("the sender signed a contribution beyond what honest training sends")
	// ErrOuterAccuserFalse: the evidence does not show what the accusation says — a signature or
	// path that does not verify, or a chunk within the bound.
	ErrOuterAccuserFalse = errors.New("the evidence does not prove the refusal")
)

// CheckOuterEvidence judges a refusal of replica's contribution to the outer step after step (or
// with e.Average of its average of the segment it owns, against OuterBound.CheckAverage):
// e is the receiver's evidence, key the sender's signing key, size the tensor's values. It
// returns an error wrapping ErrOuterSenderFalse when the evidence convicts the sender, and one
// wrapping ErrOuterAccuserFalse when it convicts the accuser; nothing else.
func CheckOuterEvidence(spec job.Spec, jobID string, plan uint32, step uint64, replica int, e *proto.OuterEvidence, key []byte, size int) error {
	compressed := spec.Sync.Compress == "int8"
	chunks := model.OuterLayout{N: size}.Chunks()
	seg := e.Segment
	check, what := OuterBound.Check, "value"
	if e.Average {
		check, what = OuterBound.CheckAverage, "averaged value"
	}
	if seg[0] < 0 || seg[0] > e.Chunk || e.Chunk >= seg[1] || seg[1] > chunks {
		return fmt.Errorf("%w: chunk %d of chunks [%d,%d) of a tensor of %d", ErrOuterAccuserFalse, e.Chunk, seg[0], seg[1], chunks)
	}
	vals := min(model.OuterChunk, size-e.Chunk*model.OuterChunk)
	if len(e.Base) != 4*vals {
		return fmt.Errorf("%w: a base chunk of %d bytes, want %d", ErrOuterAccuserFalse, len(e.Base), 4*vals)
	}
	i, n := e.Chunk-seg[0], seg[1]-seg[0]
	base, okb := rootOf(merkleLeaf(e.Base), i, n, e.BasePath)
	given, okg := rootOf(merkleLeaf(e.Given), i, n, e.GivenPath)
	root, okr := rootOf(OuterEntry{Tensor: e.Tensor, Segment: seg, Base: base, Given: given}.Leaf(), e.Entry, e.Entries, e.EntryPath)
	if len(key) != ed25519.PublicKeySize || !okb || !okg || !okr ||
		!ed25519.Verify(key, OuterBatchMessage(jobID, plan, step, replica, compressed, e.Average, e.Entries, root), e.Signature) {
		return fmt.Errorf("%w: the sender's signature does not cover the chunks shown", ErrOuterAccuserFalse)
	}
	g, err := proto.Float32s(e.Base)
	if err != nil {
		return fmt.Errorf("%w: base: %v", ErrOuterAccuserFalse, err)
	}
	x, err := OuterGivenValues(e.Given, vals, compressed)
	if err != nil {
		return fmt.Errorf("%w: it signed %v", ErrOuterSenderFalse, err)
	}
	if i, d, limit, ok := check(NewOuterBound(spec, int(step), compressed), g, x); !ok {
		return fmt.Errorf("%w: %s %d of chunk %d of tensor %d: %g, where the round's AdamW steps move a parameter by %g at most", ErrOuterSenderFalse, what, e.Chunk*model.OuterChunk+i, e.Chunk, e.Tensor, d, limit)
	}
	return fmt.Errorf("%w: chunk %d of tensor %d is within the bound", ErrOuterAccuserFalse, e.Chunk, e.Tensor)
}
