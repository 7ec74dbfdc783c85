package proto

import "fmt"

// Binary messages on the /ws control WebSocket carry tensor frames, in the two cases where tensors
// cross it at all (docs/design.md, "Wire"): the coordinator feeding a micro-batch's tokens and targets
// to the end stages, and the relay fallback between two workers whose WebRTC connection could not
// be established. Each binary message is one frame behind a one-byte envelope:
//
//	BinDirect: [0x01][frame]
//	BinRelay:  [0x02][id length n, 1..64][peer id, n bytes][frame]
//
// From a worker, BinRelay's peer is the worker the frame is for; from the coordinator it is the
// worker the frame came from (the coordinator writes it from the connection the frame arrived on,
// so a worker cannot pose as another). A worker never sends BinDirect: it has nothing to tell the
// coordinator in tensors.
//
// The envelope, and not a frame field, carries the peer because a frame must be byte-for-byte
// the same whichever path it travels, and the data-channel path has no use for an id.

// BinKind is the first byte of a binary /ws message.
type BinKind uint8

const (
	// BinDirect is a frame for the receiver itself.
	BinDirect BinKind = 1
	// BinRelay is a frame relayed between two workers through the coordinator.
	BinRelay BinKind = 2
)

func (k BinKind) String() string {
	switch k {
	case BinDirect:
		return "direct"
	case BinRelay:
		return "relay"
	}
	return fmt.Sprintf("binkind(%d)", uint8(k))
}

// MaxBinarySize is the largest binary /ws message: a relayed frame of MaxFrameSize with the
// longest peer id. Readers of binary messages use it as their read limit.
const MaxBinarySize = 2 + maxID + MaxFrameSize

// AppendDirect appends a BinDirect message carrying frame to dst.
func AppendDirect(dst, frame []byte) ([]byte, error) {
	if err := checkFrameLen(frame); err != nil {
		return dst, fmt.Errorf("encode direct message: %w", err)
	}
	dst = append(dst, byte(BinDirect))
	return append(dst, frame...), nil
}

// AppendRelay appends a BinRelay message carrying frame for (or from) worker peer to dst.
func AppendRelay(dst []byte, peer string, frame []byte) ([]byte, error) {
	if err := checkPeer(peer); err != nil {
		return dst, fmt.Errorf("encode relay message: %w", err)
	}
	if err := checkFrameLen(frame); err != nil {
		return dst, fmt.Errorf("encode relay message for %s: %w", peer, err)
	}
	dst = append(dst, byte(BinRelay), byte(len(peer)))
	dst = append(dst, peer...)
	return append(dst, frame...), nil
}

// DecodeBinary splits a binary /ws message into its kind, peer id ("" for BinDirect) and frame.
// It checks the envelope, the peer id (the rules of worker ids: 1 to 64 of [A-Za-z0-9._-]) and
// that the frame's length is that of a possible frame; the only thing it allocates is the id's
// string, after checking its length. It does not decode the frame: the receiver does, with
// DecodeFrame or a Reassembler. The returned frame aliases b. Errors wrap ErrShortFrame,
// ErrFrameTooLarge, ErrFrameVersion (unknown kind) or ErrBadHeader (bad id).
func DecodeBinary(b []byte) (kind BinKind, peer string, frame []byte, err error) {
	if len(b) == 0 {
		return 0, "", nil, fmt.Errorf("decode binary message: %w: empty message", ErrShortFrame)
	}
	if len(b) > MaxBinarySize {
		return 0, "", nil, fmt.Errorf("decode binary message: %w: %d bytes, limit %d", ErrFrameTooLarge, len(b), MaxBinarySize)
	}
	kind = BinKind(b[0])
	switch kind {
	case BinDirect:
		frame = b[1:]
	case BinRelay:
		if len(b) < 2 {
			return 0, "", nil, fmt.Errorf("decode relay message: %w: no peer id length", ErrShortFrame)
		}
		n := int(b[1])
		if n == 0 || n > maxID {
			return 0, "", nil, fmt.Errorf("decode relay message: %w: peer id length %d, want 1 to %d", ErrBadHeader, n, maxID)
		}
		if len(b) < 2+n {
			return 0, "", nil, fmt.Errorf("decode relay message: %w: peer id of %d bytes cut at %d", ErrShortFrame, n, len(b)-2)
		}
		// The id's length is bounded above, so this copy is the only allocation, and small.
		peer = string(b[2 : 2+n])
		if err := checkPeer(peer); err != nil {
			return 0, "", nil, fmt.Errorf("decode relay message: %w", err)
		}
		frame = b[2+n:]
	default:
		return 0, "", nil, fmt.Errorf("decode binary message: %w: envelope kind %d (this build knows %d and %d): run the same Shoal version on coordinator and workers",
			ErrFrameVersion, b[0], BinDirect, BinRelay)
	}
	if err := checkFrameLen(frame); err != nil {
		return 0, "", nil, fmt.Errorf("decode %v message: %w", kind, err)
	}
	return kind, peer, frame, nil
}

// checkFrameLen refuses what cannot be a frame by its length alone.
func checkFrameLen(frame []byte) error {
	if len(frame) < HeaderSize {
		return fmt.Errorf("%w: %d bytes, header is %d", ErrShortFrame, len(frame), HeaderSize)
	}
	if len(frame) > MaxFrameSize {
		return fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, len(frame))
	}
	return nil
}

// checkPeer is checkID for the envelope: the same rules, reported as a header error because the
// envelope is a binary header, not a control message.
func checkPeer(peer string) error {
	if len(peer) == 0 || len(peer) > maxID {
		return fmt.Errorf("%w: peer id %s must be 1 to %d characters", ErrBadHeader, quote(peer), maxID)
	}
	if checkID("peer", peer) != nil {
		return fmt.Errorf("%w: peer id %s may only use letters, digits, '.', '_' and '-'", ErrBadHeader, quote(peer))
	}
	return nil
}
