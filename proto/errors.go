package proto

import "errors"

// Control messages. Every error DecodeMessage and EncodeMessage return wraps one of these.
var (
	// ErrMessageTooLarge is returned for a control message over MaxMessageSize, before it is parsed.
	ErrMessageTooLarge = errors.New("control message too large")
	// ErrProtocolVersion is returned when the peer speaks another protocol version; the error that
	// wraps it is a *VersionError, whose text says which side to upgrade.
	ErrProtocolVersion = errors.New("protocol version mismatch")
	// ErrUnknownType is returned for a message whose type this build does not know.
	ErrUnknownType = errors.New("unknown message type")
	// ErrUnexpectedMessage is returned for a known message that the sending side never sends
	// (a worker sending welcome, say): a confused or hostile peer.
	ErrUnexpectedMessage = errors.New("unexpected message")
	// ErrBadMessage is returned for malformed JSON, unknown or missing fields and invalid values.
	ErrBadMessage = errors.New("malformed control message")
)

// Tensor frames. Every error DecodeFrame, AppendFrame, SplitTensor and the Reassembler return
// wraps one of these.
var (
	// ErrShortFrame is returned for a frame shorter than HeaderSize.
	ErrShortFrame = errors.New("frame shorter than its header")
	// ErrFrameTooLarge is returned for a frame over MaxFrameSize, the largest message browsers
	// accept on a data channel.
	ErrFrameTooLarge = errors.New("frame larger than 64 KiB")
	// ErrFrameVersion is returned for a frame of another format version (or with the wrong magic).
	ErrFrameVersion = errors.New("unknown frame format")
	// ErrBadHeader is returned for an invalid kind, dtype, reserved byte, block/expert for the kind,
	// or chunk index/count.
	ErrBadHeader = errors.New("invalid frame header")
	// ErrBadShape is returned for a shape with a negative dimension or more than four dimensions.
	ErrBadShape = errors.New("invalid tensor shape")
	// ErrTensorTooLarge is returned for a tensor whose size exceeds Limits.MaxTensorBytes.
	ErrTensorTooLarge = errors.New("tensor larger than the configured maximum")
	// ErrPayloadLength is returned when the payload length does not match the header's shape,
	// dtype and chunk index.
	ErrPayloadLength = errors.New("payload length does not match the header")
	// ErrNonFinite is returned for NaN or ±Inf in a float32 or bfloat16 payload, or in an I8 or
	// I4 payload's scales: a diverged step must be reported, never propagated to another peer.
	ErrNonFinite = errors.New("non-finite value in float32 payload")
	// ErrBadQuantization is returned for an I8 or I4 payload that is not what quantisation
	// produces: a negative scale, a code of -128 (I4: -8), a non-zero code in a row (I4: group) of
	// scale 0, an I4 row's padding nibble other than 0.
	ErrBadQuantization = errors.New("invalid quantised payload")
	// ErrDuplicateChunk is returned when a chunk of a tensor arrives a second time.
	ErrDuplicateChunk = errors.New("chunk arrived twice")
	// ErrChunkMismatch is returned when chunks of one tensor disagree on dtype, shape or count.
	ErrChunkMismatch = errors.New("chunks of one tensor disagree")
	// ErrReplicasDiverged is returned by StepTotals when two shards report one tensor's ‖g‖²
	// differently, although every holder of a tensor sums the same gradient tree: one of them
	// computed or reported falsely, or sent its peers other than it used.
	ErrReplicasDiverged = errors.New("replicas diverged")
	// ErrInFlight is returned when starting a tensor would exceed Limits.MaxInFlightBytes.
	ErrInFlight = errors.New("too many tensor bytes in flight")
	// ErrStalePlan is returned for a frame from a plan version older than the current one; such
	// frames are dropped (docs/design.md, "Wire"), so callers usually ignore this error.
	ErrStalePlan = errors.New("frame from an old plan version")
)
