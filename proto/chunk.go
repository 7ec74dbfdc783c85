package proto

import (
	"encoding/binary"
	"fmt"
	"sync/atomic"
)

// Tensor is a whole tensor as it travels between peers: its identity, dtype, shape and
// little-endian payload (see AppendFloat32s and Float32s).
type Tensor struct {
	Key   TensorKey
	DType DType
	Shape Shape
	Data  []byte
}

// NumChunks is the number of frames t takes on the wire.
func (t Tensor) NumChunks() int { return numChunks(len(t.Data)) }

// check validates t's identity, dtype and size before any frame of it is written.
func (t Tensor) check(lim Limits) error {
	if err := t.Key.check(); err != nil {
		return err
	}
	if t.DType.Size() == 0 {
		return fmt.Errorf("%w: %v tensor with dtype %v", ErrBadHeader, t.Key.Kind, t.DType)
	}
	if err := t.Key.Kind.checkTensor(t.DType, t.Shape); err != nil {
		return err
	}
	total, err := t.Shape.Bytes(t.DType, lim.MaxTensorBytes)
	if err != nil {
		return err
	}
	if total != len(t.Data) {
		return fmt.Errorf("%w: shape %v of %v needs %d bytes, tensor has %d", ErrPayloadLength, t.Shape, t.DType, total, len(t.Data))
	}
	return nil
}

// AppendChunk appends frame i of t to dst: for senders that reuse one buffer and wait for the data
// channel's buffered amount to drain between frames. Chunk 0 checks the whole tensor's values
// (checkValues: finiteness, and for I8 what one chunk cannot show), so that a sender going in
// order never puts half of a diverged or malformed tensor on the wire.
func AppendChunk(dst []byte, t Tensor, i int, lim Limits) ([]byte, error) {
	lim = lim.withDefaults()
	if err := t.check(lim); err != nil {
		return dst, fmt.Errorf("split tensor %v: %w", t.Key, err)
	}
	n := t.NumChunks()
	if i < 0 || i >= n {
		return dst, fmt.Errorf("split tensor %v: %w: chunk %d of %d", t.Key, ErrBadHeader, i, n)
	}
	if i == 0 {
		if err := t.checkValues(); err != nil {
			return dst, fmt.Errorf("split tensor %v: %w", t.Key, err)
		}
	}
	end := min((i+1)*MaxChunkPayload, len(t.Data))
	h := FrameHeader{TensorKey: t.Key, DType: t.DType, Shape: t.Shape, ChunkIndex: uint32(i), ChunkCount: uint32(n)}
	return AppendFrame(dst, h, t.Data[i*MaxChunkPayload:end], lim)
}

// SplitTensor returns the frames of t in chunk order, each at most MaxFrameSize bytes.
func SplitTensor(t Tensor, lim Limits) ([][]byte, error) {
	lim = lim.withDefaults()
	if err := t.check(lim); err != nil {
		return nil, fmt.Errorf("split tensor %v: %w", t.Key, err)
	}
	frames := make([][]byte, t.NumChunks())
	for i := range frames {
		size := HeaderSize + min(MaxChunkPayload, len(t.Data)-i*MaxChunkPayload)
		f, err := AppendChunk(make([]byte, 0, size), t, i, lim)
		if err != nil {
			return nil, err
		}
		frames[i] = f
	}
	return frames, nil
}

// checkValues checks the values of a whole tensor whose size check has passed: what checkChunk
// checks of every chunk, and that each row of an I8 tensor (group of an I4 tensor) with scale 0
// has only zero codes (checkZeros).
func (t Tensor) checkValues() error {
	h := FrameHeader{TensorKey: t.Key, DType: t.DType, Shape: t.Shape}
	if err := h.checkChunk(t.Data); err != nil {
		return err
	}
	return checkZeros(t)
}

// checkZeros reports a row of an I8 tensor (a group of an I4 tensor) of scale 0 with a non-zero
// code: a row of zeros has one encoding, so equal tensors have equal bytes and digests. Other
// dtypes pass.
func checkZeros(t Tensor) error {
	if len(t.Data) == 0 {
		return nil
	}
	switch t.DType {
	case I8:
		return checkZeroRows(t.Data, int(t.Shape[0]), int(t.Shape[1]))
	case I4:
		return checkZeroGroups(t.Data, int(t.Shape[0]), int(t.Shape[1]))
	}
	return nil
}

// checkZeroGroups reports a group of scale 0 with a non-zero code in an I4 payload of rows×cols.
func checkZeroGroups(b []byte, rows, cols int) error {
	scaleBytes, groups, rowBytes := i4Layout(rows, cols)
	for r := 0; r < rows; r++ {
		for g := 0; g < groups; g++ {
			if binary.LittleEndian.Uint16(b[2*(r*groups+g):]) != 0 {
				continue
			}
			codes := b[scaleBytes+r*rowBytes:]
			for c := g * I4Group; c < min((g+1)*I4Group, cols); c++ {
				if q := codes[c/2] >> (4 * (c & 1)) & 0xf; q != 0 {
					return fmt.Errorf("%w: row %d, group %d has scale 0 but code %d in column %d", ErrBadQuantization, r, g, int8(q<<4)>>4, c)
				}
			}
		}
	}
	return nil
}

// checkZeroRows reports a row of scale 0 with a non-zero code in an I8 payload of rows×cols.
func checkZeroRows(b []byte, rows, cols int) error {
	codes := b[4*rows:]
	for r := 0; r < rows; r++ {
		if binary.LittleEndian.Uint32(b[4*r:]) != 0 {
			continue
		}
		for c, q := range codes[r*cols : (r+1)*cols] {
			if q != 0 {
				return fmt.Errorf("%w: row %d has scale 0 but code %d in column %d", ErrBadQuantization, r, int8(q), c)
			}
		}
	}
	return nil
}

// Budget is a bound on the bytes that several Reassemblers hold together for tensors still missing
// chunks (Limits.Budget). It is safe for concurrent use: the Reassemblers that share it belong to
// different goroutines (one per data channel, and the control connection's reader).
type Budget struct {
	max  int64
	used atomic.Int64
}

// NewBudget returns a Budget of max bytes.
func NewBudget(max int) *Budget { return &Budget{max: int64(max)} }

// Max is the bound.
func (b *Budget) Max() int { return int(b.max) }

// InUse is the number of bytes reserved now, by all the Reassemblers that share b.
func (b *Budget) InUse() int { return int(b.used.Load()) }

// reserve takes n bytes if they fit, and reports whether they did.
func (b *Budget) reserve(n int) bool {
	for {
		u := b.used.Load()
		if int64(n) > b.max-u {
			return false
		}
		if b.used.CompareAndSwap(u, u+int64(n)) {
			return true
		}
	}
}

func (b *Budget) release(n int) { b.used.Add(-int64(n)) }

// Reassembler joins the chunks of tensors arriving in any order, from any number of senders
// interleaved, into whole tensors. It checks that the chunks of a tensor agree on dtype, shape
// and count and that each arrives once, and bounds the bytes held for incomplete tensors: its own
// Limits.MaxInFlightBytes, and the Limits.Budget it shares with other Reassemblers, if any. The
// buffer of a tensor is allocated when its first chunk arrives, once both bounds have room for it;
// a Reassembler that is dropped with incomplete tensors must Discard them, to give their bytes
// back to the shared Budget.
//
// A Reassembler is not safe for concurrent use: it belongs to the goroutine that reads a peer's
// data channel.
type Reassembler struct {
	lim      Limits
	minPlan  uint32
	inFlight int
	parts    map[TensorKey]*partial
}

// partial is a tensor with some chunks missing.
type partial struct {
	dtype    DType
	shape    Shape
	count    uint32
	received uint32
	got      []bool
	data     []byte
}

// NewReassembler returns an empty Reassembler bounded by lim.
func NewReassembler(lim Limits) *Reassembler {
	return &Reassembler{lim: lim.withDefaults(), parts: make(map[TensorKey]*partial)}
}

// Add decodes one frame (as DecodeFrame does) and files its chunk. When the chunk completes its
// tensor, Add returns the tensor and true; the tensor's Data is the Reassembler's own copy, b may
// be reused. A frame that contradicts earlier chunks of its tensor (ErrChunkMismatch,
// ErrDuplicateChunk) discards the whole partial tensor: the sender is broken and its other chunks
// cannot be trusted either.
func (r *Reassembler) Add(b []byte) (Tensor, bool, error) {
	f, err := DecodeFrame(b, r.lim)
	if err != nil {
		return Tensor{}, false, err
	}
	return r.AddFrame(f)
}

// AddFrame is Add for a frame the caller has decoded already, to look at its header (who may send
// such a tensor, how large it may be) before anything is allocated for it. The header is checked
// again against the Reassembler's own limits, which may be tighter than those it was decoded with.
func (r *Reassembler) AddFrame(f Frame) (Tensor, bool, error) {
	h := f.Header
	total, chunk, err := h.check(r.lim)
	if err != nil {
		return Tensor{}, false, fmt.Errorf("reassemble %v: %w", h.TensorKey, err)
	}
	if len(f.Payload) != chunk {
		return Tensor{}, false, fmt.Errorf("reassemble %v chunk %d/%d: %w: %d bytes, want %d",
			h.TensorKey, h.ChunkIndex, h.ChunkCount, ErrPayloadLength, len(f.Payload), chunk)
	}
	if h.PlanVersion < r.minPlan {
		return Tensor{}, false, fmt.Errorf("reassemble %v: %w (current plan %d)", h.TensorKey, ErrStalePlan, r.minPlan)
	}
	p := r.parts[h.TensorKey]
	if p == nil {
		if total > r.lim.MaxInFlightBytes-r.inFlight {
			return Tensor{}, false, fmt.Errorf("reassemble %v: %w: %d held, %d more would pass the limit of %d bytes",
				h.TensorKey, ErrInFlight, r.inFlight, total, r.lim.MaxInFlightBytes)
		}
		if b := r.lim.Budget; b != nil && !b.reserve(total) {
			return Tensor{}, false, fmt.Errorf("reassemble %v: %w: %d held with the other senders, %d more would pass the shared budget of %d bytes",
				h.TensorKey, ErrInFlight, b.InUse(), total, b.Max())
		}
		p = &partial{dtype: h.DType, shape: h.Shape, count: h.ChunkCount,
			got: make([]bool, h.ChunkCount), data: make([]byte, total)}
		r.parts[h.TensorKey] = p
		r.inFlight += total
	} else if p.dtype != h.DType || p.shape != h.Shape || p.count != h.ChunkCount {
		r.discard(h.TensorKey)
		return Tensor{}, false, fmt.Errorf("reassemble %v: %w: chunk %d says %v %v in %d chunks, earlier chunks said %v %v in %d",
			h.TensorKey, ErrChunkMismatch, h.ChunkIndex, h.DType, h.Shape, h.ChunkCount, p.dtype, p.shape, p.count)
	}
	if p.got[h.ChunkIndex] {
		r.discard(h.TensorKey)
		return Tensor{}, false, fmt.Errorf("reassemble %v: %w: chunk %d of %d", h.TensorKey, ErrDuplicateChunk, h.ChunkIndex, h.ChunkCount)
	}
	copy(p.data[int(h.ChunkIndex)*MaxChunkPayload:], f.Payload)
	p.got[h.ChunkIndex] = true
	p.received++
	if p.received < p.count {
		return Tensor{}, false, nil
	}
	delete(r.parts, h.TensorKey)
	r.release(total)
	t := Tensor{Key: h.TensorKey, DType: p.dtype, Shape: p.shape, Data: p.data}
	// The chunks were checked one by one; only a zero row's (group's) codes need the whole tensor.
	if err := checkZeros(t); err != nil {
		return Tensor{}, false, fmt.Errorf("reassemble %v: %w", h.TensorKey, err)
	}
	return t, true, nil
}

// release gives back n bytes of a tensor no longer held.
func (r *Reassembler) release(n int) {
	r.inFlight -= n
	if b := r.lim.Budget; b != nil {
		b.release(n)
	}
}

func (r *Reassembler) discard(k TensorKey) {
	if p, ok := r.parts[k]; ok {
		r.release(len(p.data))
		delete(r.parts, k)
	}
}

// SetPlanVersion makes v the current plan version: frames of older plans are refused with
// ErrStalePlan from now on, and the tensors of older plans still missing chunks are discarded.
// Versions only move forward; a smaller v is ignored.
func (r *Reassembler) SetPlanVersion(v uint32) {
	if v <= r.minPlan {
		return
	}
	r.minPlan = v
	r.Discard(func(k TensorKey) bool { return k.PlanVersion < v })
}

// Discard drops the incomplete tensors whose key matches, and returns how many it dropped. A step
// that is abandoned, or finished with chunks of a broken peer still pending, is cleaned up this way.
func (r *Reassembler) Discard(match func(TensorKey) bool) int {
	n := 0
	for k := range r.parts {
		if match(k) {
			r.discard(k)
			n++
		}
	}
	return n
}

// InFlight is the number of payload bytes held for incomplete tensors.
func (r *Reassembler) InFlight() int { return r.inFlight }

// Pending is the number of incomplete tensors.
func (r *Reassembler) Pending() int { return len(r.parts) }
