package proto

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Frame layout, little-endian, HeaderSize bytes followed by the payload:
//
//	off len field
//	  0   2 magic "SH"
//	  2   1 format version (FrameVersion)
//	  3   1 kind
//	  4   1 dtype
//	  5   3 reserved, zero
//	  8   4 plan version
//	 12   4 micro-batch *
//	 16   8 step
//	 24   4 block *
//	 28   4 expert *
//	 32  16 shape[4]
//	 48   4 chunk index
//	 52   4 chunk count
//	 56   4 payload bytes in this chunk
//	 60   4 reserved, zero
//
// The fields marked * are named for an activation's key; each kind's typed key (keys.go) says
// what they hold for it.
//
// The payload length is redundant with the message length on a data channel, but it lets frames
// be concatenated (relay, files) and gives the decoder one more consistency check.
//
// A tensor's payload (all its chunks, in order) is its elements, little-endian: 4 bytes each for
// F32 and I32, 2 for BF16; an I8 tensor, a matrix, is its rows' float32 scales and then its
// int8 codes (see I8), an I4 tensor its groups' bfloat16 scales and then its int4 codes (I4).
// Chunks cut the payload at multiples of MaxChunkPayload whatever the dtype, so a chunk can be
// checked on its own (finite values, valid scales) before the tensor is whole.
const (
	// FrameVersion is the format version this build writes and the only one it reads.
	FrameVersion = 1
	// HeaderSize is the size of a frame header in bytes.
	HeaderSize = 64
	// MaxFrameSize is the largest frame, header included: browsers reject data-channel messages
	// over 64 KiB (the SCTP max-message-size default of RFC 8841).
	MaxFrameSize = 64 << 10
	// MaxChunkPayload is the payload of every chunk but a tensor's last. It is fixed by the format
	// (not negotiated) so that chunk i's offset is i·MaxChunkPayload on both sides, and it is a
	// multiple of every dtype's size, and of an I8 or I4 scale's, so no element straddles two
	// chunks.
	MaxChunkPayload = MaxFrameSize - HeaderSize
)

var frameMagic = [2]byte{'S', 'H'}

// NoBlock and NoExpert fill the block and expert fields of frames that have none (TokenKey,
// StageKey).
const (
	NoBlock  = ^uint32(0)
	NoExpert = ^uint32(0)
)

// Kind says what a frame carries and so how the receiver routes it.
type Kind uint8

const (
	// KindActivation is a stage's output, sent forward (StageKey).
	KindActivation Kind = 1 + iota
	// KindActivationGrad is the gradient of the loss with respect to a stage's input, sent
	// backward (StageKey).
	KindActivationGrad
	// KindExpertIn is the rows routed to one expert (tokens × C), stage to expert host (ExpertKey).
	KindExpertIn
	// KindExpertOut is the expert's output for those rows, expert host to stage (ExpertKey).
	KindExpertOut
	// KindExpertGradIn is the gradient with respect to the expert's output, stage to expert host
	// (ExpertKey).
	KindExpertGradIn
	// KindExpertGradOut is the gradient with respect to the expert's input, expert host to stage;
	// or a replicated expert's partial parameter gradient, between its replicas (ExpertKey).
	KindExpertGradOut
	// KindTokens is a micro-batch's input token ids (int32), coordinator to the first stage
	// (TokenKey).
	KindTokens
	// KindTargets is a micro-batch's target token ids (int32), coordinator to the last stage
	// (TokenKey).
	KindTargets
	// KindGradReduce is a node of one tensor's gradient tree, from a stage of another pipeline
	// replica holding the same tensor (GradReduceKey).
	KindGradReduce
	// KindOuterDelta is what a replica's stage sends of a tensor at an outer step
	// (OuterDeltaKey): θ_r as float32, or its int8 pseudo-gradient with a scale per chunk.
	KindOuterDelta
	// KindOuterSig is the sender's signature of what it sent of a tensor at an outer step
	// (OuterSigKey): an OuterSigEntry or an OuterBatchSig, as int32s.
	KindOuterSig
	// KindState is one tensor of a stage shard's state (its parameters, then AdamW's moments, in
	// model.CheckpointTensors' order), handed from a worker that keeps the shard to one that takes
	// it up in a new plan (StateKey; Assign.From, Assign.Give).
	KindState
	kindEnd
)

var kindNames = [...]string{"", "activation", "activation-grad", "expert-in", "expert-out",
	"expert-grad-in", "expert-grad-out", "tokens", "targets", "grad-reduce", "outer-delta", "outer-sig", "state"}

func (k Kind) String() string {
	if k > 0 && k < kindEnd {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// isExpert reports whether frames of kind k belong to one expert.
func (k Kind) isExpert() bool { return k >= KindExpertIn && k <= KindExpertGradOut }

// checkTensor checks that a tensor of kind k may have dtype d and shape s: token ids are int32; the
// tensors that cross a boundary (activations, expert rows, their gradients) float32, or compressed
// in the job's wire format as BF16, I8 or I4 (docs/design.md, "Compressed boundaries"), which of
// the four the job's business, checked by its receiver; a gradient-tree node float32, a parameter
// gradient never quantised; an outer step's tensor float32 or I8; its signature an
// OuterSigEntry's or an OuterBatchSig's int32s.
func (k Kind) checkTensor(d DType, s Shape) error {
	var ok bool
	switch k {
	case KindTokens, KindTargets:
		ok = d == I32
	case KindGradReduce, KindState:
		ok = d == F32
	case KindOuterDelta:
		ok = d == F32 || d == I8
	case KindOuterSig:
		if w := s[0]; d == I32 && (s != (Shape{w, 1, 1, 1}) || w != OuterSigEntryWords && (w < 24 || w > OuterBatchSigMaxWords || w%8 != 0)) {
			return fmt.Errorf("%w: %v tensor of shape %v, want (%d), or (16 + 8 a leaf) up to %d", ErrBadShape, k, s, OuterSigEntryWords, OuterBatchSigMaxWords)
		}
		ok = d == I32
	default:
		ok = d == F32 || d == BF16 || d == I8 || d == I4
	}
	if !ok {
		return fmt.Errorf("%w: %v tensor with dtype %v", ErrBadHeader, k, d)
	}
	return nil
}

// DType is a payload's element type; payloads are little-endian.
type DType uint8

const (
	F32 DType = 1 // float32, IEEE 754, finite
	I32 DType = 2 // int32, for token ids
	// BF16 is bfloat16, finite: the top 16 bits of a float32, 2 bytes an element.
	BF16 DType = 3
	// I8 is a matrix of int8 codes with a float32 scale per row: Shape is (rows, cols, 1, 1), and
	// the payload is the rows' scales (float32, finite, not negative; 0 for a row of zeros),
	// then the rows·cols codes in row-major order (two's complement, in [-127, 127]; all 0 in a
	// row of scale 0). Element (r, c) stands for code·scale[r], computed as one float32 product.
	I8 DType = 4
	// I4 is a matrix of int4 codes with a bfloat16 scale per group of I4Group values of a row
	// (a row's last group may be shorter): Shape is (rows, cols, 1, 1), and the payload is the
	// scales, rows·⌈cols/I4Group⌉ bfloat16s (finite, not negative; 0 for a group of zeros), row by
	// row, then each row's codes in ⌈cols/2⌉ bytes: code c in the low nibble of byte c/2 when c is
	// even, in the high nibble when odd, two's complement in [-7, 7] (all 0 in a group of scale 0;
	// the last high nibble of an odd row 0). Element (r, c) stands for code·scale, computed as one
	// float32 product (kernels.QuantizeInt4).
	I4 DType = 5
)

// I4Group is how many values of a row one I4 scale covers (kernels.Int4Group).
const I4Group = 32

// i4Layout is where an I4 payload of rows×cols keeps what: the scales' bytes first, each row's
// groups, then rowBytes of codes a row.
func i4Layout(rows, cols int) (scaleBytes, groups, rowBytes int) {
	groups = (cols + I4Group - 1) / I4Group
	return 2 * rows * groups, groups, (cols + 1) / 2
}

// Size is the size of one element in bytes, or 0 for an unknown dtype. An I8 payload holds a
// 4-byte scale per row besides its elements, and an I4 payload two codes a byte and a 2-byte scale
// per group: Shape.Bytes counts a whole payload.
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case BF16:
		return 2
	case I8, I4:
		return 1
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case I32:
		return "i32"
	case BF16:
		return "bf16"
	case I8:
		return "i8"
	case I4:
		return "i4"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Shape is a tensor's dimensions. Tensors of lower rank pad with trailing 1s (ShapeOf does), so
// that the element count is always the product of all four. A dimension may be 0: an expert that
// was routed no tokens still gets (and answers) a frame, so that nobody waits for it forever.
type Shape [4]uint32

// ShapeOf returns the Shape of a tensor with the given dimensions (at most four, none negative).
func ShapeOf(dims ...int) (Shape, error) {
	s := Shape{1, 1, 1, 1}
	if len(dims) > len(s) {
		return Shape{}, fmt.Errorf("shape %v: %w: %d dimensions, at most %d", dims, ErrBadShape, len(dims), len(s))
	}
	for i, d := range dims {
		if d < 0 || uint64(d) > math.MaxUint32 {
			return Shape{}, fmt.Errorf("shape %v: %w: dimension %d is %d", dims, ErrBadShape, i, d)
		}
		s[i] = uint32(d)
	}
	return s, nil
}

// Bytes returns the payload size of a tensor of shape s and dtype d: for I8, rows·(4 + cols); for
// I4, rows·(2·⌈cols/I4Group⌉ + ⌈cols/2⌉). It returns an error wrapping ErrTensorTooLarge when the
// size exceeds max, ErrBadShape for an I8 or I4 shape that is not a matrix (rows, cols, 1, 1),
// ErrBadHeader for an unknown dtype. It never overflows: each partial product is checked against
// max before the next multiplication.
func (s Shape) Bytes(d DType, max int) (int, error) {
	if d.Size() == 0 {
		return 0, fmt.Errorf("%w: unknown dtype %d", ErrBadHeader, uint8(d))
	}
	if (d == I8 || d == I4) && (s[2] != 1 || s[3] != 1) {
		return 0, fmt.Errorf("shape %v of %v: %w: an %v tensor is a matrix (rows, cols, 1, 1)", s, d, ErrBadShape, d)
	}
	for _, x := range s {
		if x == 0 {
			return 0, nil
		}
	}
	dims := s
	n := uint64(d.Size())
	switch d {
	case I8:
		// Each row is its scale and its codes: the row size takes the element's place.
		n, dims = 4+uint64(s[1]), Shape{s[0], 1, 1, 1}
	case I4:
		c := uint64(s[1])
		n, dims = 2*((c+I4Group-1)/I4Group)+(c+1)/2, Shape{s[0], 1, 1, 1}
	}
	if n > uint64(max) {
		return 0, fmt.Errorf("shape %v of %v: %w (limit %d bytes)", s, d, ErrTensorTooLarge, max)
	}
	for _, x := range dims {
		if n > uint64(max)/uint64(x) {
			return 0, fmt.Errorf("shape %v of %v: %w (limit %d bytes)", s, d, ErrTensorTooLarge, max)
		}
		n *= uint64(x)
	}
	return int(n), nil
}

// TensorKey names a tensor in flight: the receiver matches frames to the tensor it waits for,
// and the Reassembler joins chunks, by this key. It is the header's fields as they travel; what
// MicroBatch, Block and Expert hold depends on Kind, and each kind's typed key (keys.go: StageKey,
// ExpertKey, GradReduceKey, …) says it and packs and parses them.
type TensorKey struct {
	Kind        Kind
	PlanVersion uint32
	Step        uint64
	MicroBatch  uint32
	Block       uint32
	Expert      uint32
}

// String names k's fields by what its kind means by them (ParseKey); a key that does not parse
// shows its raw fields.
func (k TensorKey) String() string {
	if t, err := ParseKey(k); err == nil {
		return t.String()
	}
	return fmt.Sprintf("%v plan %d step %d mb %d block %d expert %d (invalid)", k.Kind, k.PlanVersion, k.Step, k.MicroBatch, k.Block, k.Expert)
}

// check is ParseKey without its result, which would cost DecodeFrame an allocation.
func (k TensorKey) check() error {
	var err error
	switch k.Kind {
	case KindActivation, KindActivationGrad:
		_, err = ParseStageKey(k)
	case KindTokens, KindTargets:
		_, err = ParseTokenKey(k)
	case KindExpertIn, KindExpertOut, KindExpertGradIn, KindExpertGradOut:
		_, err = ParseExpertKey(k)
	case KindGradReduce:
		_, err = ParseGradReduceKey(k)
	case KindOuterDelta:
		_, err = ParseOuterDeltaKey(k)
	case KindOuterSig:
		_, err = ParseOuterSigKey(k)
	case KindState:
		_, err = ParseStateKey(k)
	default:
		err = fmt.Errorf("%w: unknown kind %d", ErrBadHeader, uint8(k.Kind))
	}
	return err
}

// FrameHeader is a decoded frame header: the tensor's identity, dtype and shape, and which chunk
// of it the frame holds.
type FrameHeader struct {
	TensorKey
	DType      DType
	Shape      Shape
	ChunkIndex uint32
	ChunkCount uint32
}

// Frame is one decoded chunk. Payload aliases the buffer it was decoded from.
type Frame struct {
	Header  FrameHeader
	Payload []byte
}

// Limits bound what a decoder accepts. A zero field means its default (DefaultLimits).
type Limits struct {
	// MaxTensorBytes bounds one tensor's payload (all chunks). A frame that announces more is
	// rejected before anything is allocated for it. A worker sets it to the largest tensor its
	// assignment can legitimately receive.
	MaxTensorBytes int
	// MaxInFlightBytes bounds the bytes a Reassembler holds for tensors still missing chunks.
	MaxInFlightBytes int
	// Budget, when set, is shared by every Reassembler made with these limits, and bounds the bytes
	// they hold together for incomplete tensors, besides each one's MaxInFlightBytes: a worker
	// reassembles each sender's frames separately (a data channel per neighbour, the relay per
	// sending worker), and without a shared bound n senders could make it hold n times the limit.
	// nil: each Reassembler is bounded on its own. Only Reassemblers use it.
	Budget *Budget
}

// DefaultLimits are generous for the default job (an activation of B 16, T 128, C 256 is 2 MiB)
// and small enough that a browser tab survives a hostile peer.
func DefaultLimits() Limits {
	return Limits{MaxTensorBytes: 256 << 20, MaxInFlightBytes: 512 << 20}
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits()
	if l.MaxTensorBytes <= 0 {
		l.MaxTensorBytes = d.MaxTensorBytes
	}
	if l.MaxInFlightBytes <= 0 {
		l.MaxInFlightBytes = d.MaxInFlightBytes
	}
	return l
}

// numChunks is the chunk count of a tensor of total payload bytes; an empty tensor still takes
// one frame, so that its receiver learns it is empty.
func numChunks(total int) int {
	if total == 0 {
		return 1
	}
	return (total + MaxChunkPayload - 1) / MaxChunkPayload
}

// TensorBytes is the payload size of the whole tensor that h's frame is a chunk of, for a header
// DecodeFrame returned (which checked it against its limits); math.MaxInt for a shape too large to
// count.
func (h FrameHeader) TensorBytes() int {
	n, err := h.Shape.Bytes(h.DType, math.MaxInt)
	if err != nil || h.DType.Size() == 0 {
		return math.MaxInt
	}
	return n
}

// check validates h against lim and returns the tensor's total payload size and the payload size
// of the chunk h describes.
func (h FrameHeader) check(lim Limits) (total, chunk int, err error) {
	if err := h.TensorKey.check(); err != nil {
		return 0, 0, err
	}
	if h.DType.Size() == 0 {
		return 0, 0, fmt.Errorf("%w: unknown dtype %d", ErrBadHeader, uint8(h.DType))
	}
	if err := h.Kind.checkTensor(h.DType, h.Shape); err != nil {
		return 0, 0, err
	}
	total, err = h.Shape.Bytes(h.DType, lim.MaxTensorBytes)
	if err != nil {
		return 0, 0, err
	}
	n := numChunks(total)
	if uint64(h.ChunkCount) != uint64(n) {
		return 0, 0, fmt.Errorf("%w: chunk count %d, but a %d-byte tensor takes %d", ErrBadHeader, h.ChunkCount, total, n)
	}
	if h.ChunkIndex >= h.ChunkCount {
		return 0, 0, fmt.Errorf("%w: chunk index %d of %d", ErrBadHeader, h.ChunkIndex, h.ChunkCount)
	}
	chunk = MaxChunkPayload
	if int(h.ChunkIndex) == n-1 {
		chunk = total - (n-1)*MaxChunkPayload
	}
	return total, chunk, nil
}

// AppendFrame appends the frame with header h and payload to dst. It refuses what DecodeFrame
// would refuse, so that a bad tensor is caught by its sender.
func AppendFrame(dst []byte, h FrameHeader, payload []byte, lim Limits) ([]byte, error) {
	_, chunk, err := h.check(lim.withDefaults())
	if err != nil {
		return dst, fmt.Errorf("encode frame %v: %w", h.TensorKey, err)
	}
	if len(payload) != chunk {
		return dst, fmt.Errorf("encode frame %v chunk %d/%d: %w: %d bytes, want %d", h.TensorKey, h.ChunkIndex, h.ChunkCount, ErrPayloadLength, len(payload), chunk)
	}
	if err := h.checkChunk(payload); err != nil {
		return dst, fmt.Errorf("encode frame %v chunk %d/%d: %w", h.TensorKey, h.ChunkIndex, h.ChunkCount, err)
	}
	var hdr [HeaderSize]byte
	le := binary.LittleEndian
	hdr[0], hdr[1] = frameMagic[0], frameMagic[1]
	hdr[2] = FrameVersion
	hdr[3] = byte(h.Kind)
	hdr[4] = byte(h.DType)
	le.PutUint32(hdr[8:], h.PlanVersion)
	le.PutUint32(hdr[12:], h.MicroBatch)
	le.PutUint64(hdr[16:], h.Step)
	le.PutUint32(hdr[24:], h.Block)
	le.PutUint32(hdr[28:], h.Expert)
	for i, d := range h.Shape {
		le.PutUint32(hdr[32+4*i:], d)
	}
	le.PutUint32(hdr[48:], h.ChunkIndex)
	le.PutUint32(hdr[52:], h.ChunkCount)
	le.PutUint32(hdr[56:], uint32(len(payload)))
	dst = append(dst, hdr[:]...)
	return append(dst, payload...), nil
}

// DecodeFrame decodes one frame. It checks the header, the payload length against the header's
// shape, dtype and chunk index, and the values a chunk holds (checkChunk); it allocates nothing,
// and the returned Payload aliases b.
func DecodeFrame(b []byte, lim Limits) (Frame, error) {
	lim = lim.withDefaults()
	if len(b) < HeaderSize {
		return Frame{}, fmt.Errorf("decode frame: %w: %d bytes, header is %d", ErrShortFrame, len(b), HeaderSize)
	}
	if len(b) > MaxFrameSize {
		return Frame{}, fmt.Errorf("decode frame: %w: %d bytes", ErrFrameTooLarge, len(b))
	}
	if b[0] != frameMagic[0] || b[1] != frameMagic[1] {
		return Frame{}, fmt.Errorf("decode frame: %w: magic %q is not a Shoal frame's %q", ErrFrameVersion, b[:2], frameMagic[:])
	}
	if b[2] != FrameVersion {
		return Frame{}, fmt.Errorf("decode frame: %w: the peer writes frame format %d, this build reads %d: run the same Shoal version on both peers", ErrFrameVersion, b[2], FrameVersion)
	}
	if b[5]|b[6]|b[7]|b[60]|b[61]|b[62]|b[63] != 0 {
		return Frame{}, fmt.Errorf("decode frame: %w: reserved bytes are not zero", ErrBadHeader)
	}
	le := binary.LittleEndian
	h := FrameHeader{
		TensorKey: TensorKey{
			Kind:        Kind(b[3]),
			PlanVersion: le.Uint32(b[8:]),
			MicroBatch:  le.Uint32(b[12:]),
			Step:        le.Uint64(b[16:]),
			Block:       le.Uint32(b[24:]),
			Expert:      le.Uint32(b[28:]),
		},
		DType:      DType(b[4]),
		ChunkIndex: le.Uint32(b[48:]),
		ChunkCount: le.Uint32(b[52:]),
	}
	for i := range h.Shape {
		h.Shape[i] = le.Uint32(b[32+4*i:])
	}
	_, chunk, err := h.check(lim)
	if err != nil {
		return Frame{}, fmt.Errorf("decode frame: %w", err)
	}
	payload := b[HeaderSize:]
	if n := le.Uint32(b[56:]); uint64(n) != uint64(len(payload)) || len(payload) != chunk {
		return Frame{}, fmt.Errorf("decode frame %v chunk %d/%d: %w: header says %d bytes, frame has %d, shape %v needs %d",
			h.TensorKey, h.ChunkIndex, h.ChunkCount, ErrPayloadLength, n, len(payload), h.Shape, chunk)
	}
	if err := h.checkChunk(payload); err != nil {
		return Frame{}, fmt.Errorf("decode frame %v chunk %d/%d: %w", h.TensorKey, h.ChunkIndex, h.ChunkCount, err)
	}
	return Frame{Header: h, Payload: payload}, nil
}

// checkChunk checks the values in the payload of the chunk h describes, as far as one chunk can
// tell: float32 and bfloat16 values are finite; an I8 chunk's scales (the part of the tensor's
// leading rows·4 bytes it holds) are finite and not negative, and its codes are not -128; an I4
// chunk's likewise, with no code -8 and an odd row's padding nibble 0. That an I8 row (I4 group)
// of scale 0 has only zero codes needs the whole tensor: Tensor.checkValues.
func (h FrameHeader) checkChunk(payload []byte) error {
	switch h.DType {
	case F32:
		return checkFinite(payload)
	case BF16:
		return checkFiniteBF16(payload)
	case I8:
		off := int(h.ChunkIndex) * MaxChunkPayload
		return checkI8(payload, off, 4*int(h.Shape[0]))
	case I4:
		return checkI4(payload, int(h.ChunkIndex)*MaxChunkPayload, int(h.Shape[0]), int(h.Shape[1]))
	}
	return nil
}

// CheckFinite reports the first NaN or ±Inf in a little-endian float32 payload (ErrNonFinite),
// as a frame's check does: for payloads that arrive otherwise (an audit's evidence).
func CheckFinite(b []byte) error { return checkFinite(b) }

// checkFinite reports the first NaN or ±Inf in a little-endian float32 payload. It tests the
// exponent bits rather than converting, which is exact and does not depend on the FPU: two values
// a 64-bit word, without a branch, a run of 256 bytes at a time — an exponent of all ones plus
// one in its lowest bit carries into the sign bit, a smaller one does not, and neither carries
// past its own 32 bits — and the loop below finds the value in a run that has one.
func checkFinite(b []byte) error {
	const run = 256
	start := 0
	for ; start+run <= len(b); start += run {
		var acc uint64
		for i := start; i < start+run; i += 8 {
			acc |= (binary.LittleEndian.Uint64(b[i:])&0x7f8000007f800000 + 0x0080000000800000) & 0x8000000080000000
		}
		if acc != 0 {
			break
		}
	}
	for i := start; i+4 <= len(b); i += 4 {
		if binary.LittleEndian.Uint32(b[i:])&0x7f800000 == 0x7f800000 {
			return fmt.Errorf("%w: element %d is %v", ErrNonFinite, i/4,
				math.Float32frombits(binary.LittleEndian.Uint32(b[i:])))
		}
	}
	return nil
}

// checkFiniteBF16 reports the first NaN or ±Inf in a little-endian bfloat16 payload.
func checkFiniteBF16(b []byte) error {
	for i := 0; i+2 <= len(b); i += 2 {
		if binary.LittleEndian.Uint16(b[i:])&0x7f80 == 0x7f80 {
			return fmt.Errorf("%w: bfloat16 element %d is %v", ErrNonFinite, i/2,
				math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[i:]))<<16))
		}
	}
	return nil
}

// checkI4 checks the bytes b of an I4 payload of rows×cols that start at offset off in the
// tensor's payload: bfloat16 scales (2-byte aligned, as every chunk's offset is even) finite and
// with the sign bit clear, no code -8 (nibble 1000), and in a row of an odd number of codes its
// last byte's high nibble 0 — so that each tensor has one encoding.
func checkI4(b []byte, off, rows, cols int) error {
	scaleBytes, groups, rowBytes := i4Layout(rows, cols)
	i := 0
	for ; i+2 <= len(b) && off+i < scaleBytes; i += 2 {
		v := binary.LittleEndian.Uint16(b[i:])
		r, g := (off+i)/2/groups, (off+i)/2%groups
		if v&0x7f80 == 0x7f80 {
			return fmt.Errorf("%w: the scale of row %d, group %d is %v", ErrNonFinite, r, g, math.Float32frombits(uint32(v)<<16))
		}
		if v&0x8000 != 0 {
			return fmt.Errorf("%w: the scale of row %d, group %d is %v, scales are not negative", ErrBadQuantization, r, g, math.Float32frombits(uint32(v)<<16))
		}
	}
	for ; i < len(b); i++ {
		c := b[i]
		if c&0xf == 0x8 || c>>4 == 0x8 {
			return fmt.Errorf("%w: code -8 at byte %d (codes are in [-7, 7])", ErrBadQuantization, off+i)
		}
		if cols%2 == 1 && (off+i-scaleBytes)%rowBytes == rowBytes-1 && c>>4 != 0 {
			return fmt.Errorf("%w: row %d of %d codes has %#x in its last byte's padding", ErrBadQuantization, (off+i-scaleBytes)/rowBytes, cols, c>>4)
		}
	}
	return nil
}

// checkI8 checks the bytes b of an I8 payload that start at offset off in the tensor's payload,
// whose first scaleBytes bytes are the scales: scales (4-byte aligned, as every chunk's offset is
// a multiple of MaxChunkPayload) finite and with the sign bit clear — no negative scale, no -0 —
// and codes other than -128.
func checkI8(b []byte, off, scaleBytes int) error {
	i := 0
	for ; i+4 <= len(b) && off+i < scaleBytes; i += 4 {
		v := binary.LittleEndian.Uint32(b[i:])
		if v&0x7f800000 == 0x7f800000 {
			return fmt.Errorf("%w: the scale of row %d is %v", ErrNonFinite, (off+i)/4, math.Float32frombits(v))
		}
		if v&0x80000000 != 0 {
			return fmt.Errorf("%w: the scale of row %d is %v, scales are not negative", ErrBadQuantization, (off+i)/4, math.Float32frombits(v))
		}
	}
	for ; i < len(b); i++ {
		if b[i] == 0x80 {
			return fmt.Errorf("%w: code -128 at byte %d (codes are in [-127, 127])", ErrBadQuantization, off+i)
		}
	}
	return nil
}
