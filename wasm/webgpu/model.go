//go:build js && wasm

package webgpu

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/model"
)

// ModelDevice is a model.Device on WebGPU: a shard built on it (model.NewStageShardOn,
// NewExpertShardOn) keeps its parameters, gradients, Adam moments and activations in GPU
// buffers between the ops of a step, and only what the shard must send or report is read back.
//
// model.Device has no error results — a CPU cannot fail mid-op — but a GPU can (device lost, a
// validation error). The first error is kept: every later Read fills its destination with NaN,
// which the step's own checks and the coordinator's finiteness checks turn into an abandoned
// step and a dropped peer, and Err reports it so that the worker can leave with a clear reason.
//
// The stage goroutine drives the device, but the shard's experts may be called from the
// goroutines of the expert dispatch: a mutex serialises the ops (in wasm there is one thread, but
// goroutines interleave at every wait for the GPU).
type ModelDevice struct {
	D *Device

	mu     sync.Mutex
	err    error
	losses *Tensor // CrossEntropyForward's per-row losses, grown as needed
	stats  Stats
	adam   adamRun // AdamW calls not yet recorded (see AdamW)
}

// adamRun is a run of AdamW calls over consecutive tensors with the same step, recorded as one
// AdamWSlab dispatch when the run ends.
type adamRun struct {
	w, g, m, v *Tensor // the first tensor's views
	segs       []AdamWSegment
	n          int
	decay      float32 // the decay of the decaying tensors; 1 until one is added
	stepSize   float32
	sqrtBC2    float64
	gradScale  float32
}

// Stats counts the device's waits for the GPU: every Read and CrossEntropyForward submits the
// queued work and waits for it, so their number and time say how much of a step is spent in
// round trips rather than in kernels.
type Stats struct {
	Reads    int
	ReadTime time.Duration
	// Dispatches is the kernels launched (Device.Dispatches), AdamW runs still pending excepted.
	Dispatches int
}

// Stats returns the counts so far.
func (m *ModelDevice) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.Dispatches = m.D.Dispatches()
	return s
}

var _ model.NormDevice = (*ModelDevice)(nil)

// SquaredNorms sums squares on the GPU, chunk by chunk in float32, the chunks in float64 on the
// host: one read of a few floats per tensor instead of the whole gradient. All NaN after an error.
func (m *ModelDevice) SquaredNorms(bufs []model.Buf) []float64 {
	return m.SquaredNormsWith(bufs, nil, nil)
}

// SquaredNormsWith is SquaredNorms reading also into alsoDst in the same wait; after an error
// both are NaN.
func (m *ModelDevice) SquaredNormsWith(bufs []model.Buf, also model.Buf, alsoDst []float32) []float64 {
	defer m.lock()()
	ts := make([]*Tensor, len(bufs))
	for i, b := range bufs {
		ts[i] = t(b)
	}
	var at *Tensor
	if also != nil {
		at = t(also)
	}
	var out []float64
	if m.err == nil {
		t0 := time.Now()
		var err error
		var got []float32
		out, got, err = m.D.SquaredNormsWith(at, ts...)
		m.fail(err)
		if err == nil {
			copy(alsoDst, got)
		}
		m.stats.Reads++
		m.stats.ReadTime += time.Since(t0)
	}
	if m.err != nil {
		out = make([]float64, len(bufs))
		for i := range out {
			out[i] = math.NaN()
		}
		for i := range alsoDst {
			alsoDst[i] = float32(math.NaN())
		}
	}
	return out
}

// NewModelDevice wraps d.
func NewModelDevice(d *Device) *ModelDevice { return &ModelDevice{D: d} }

// Err is the first GPU error the device met, or nil.
func (m *ModelDevice) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

func (m *ModelDevice) fail(err error) {
	if err != nil && m.err == nil {
		m.err = err
	}
}

// t converts a model.Buf made by this device; a nil Buf (no bias) is a nil tensor.
func t(b model.Buf) *Tensor {
	if b == nil {
		return nil
	}
	x, ok := b.(*Tensor)
	if !ok {
		panic(fmt.Sprintf("webgpu: a %T is not a buffer of this device", b))
	}
	return x
}

// lock takes the device for one op, recording any pending AdamW run first so that the op sees
// its updates (see AdamW).
func (m *ModelDevice) lock() func() {
	m.mu.Lock()
	m.flushAdam()
	return m.mu.Unlock
}

func (m *ModelDevice) Alloc(n int) model.Buf { defer m.lock()(); return m.D.Zeros(n) }

// Free destroys b's GPU buffer once the work recorded so far is submitted (Device.Release).
func (m *ModelDevice) Free(b model.Buf) {
	defer m.lock()()
	m.D.Release(t(b))
}
func (m *ModelDevice) AllocInt32(n int) model.Buf {
	defer m.lock()()
	return m.D.ZerosInt32(n)
}
func (m *ModelDevice) Slice(b model.Buf, off, n int) model.Buf { return t(b).Slice(off, n) }
func (m *ModelDevice) Write(dst model.Buf, src []float32) {
	defer m.lock()()
	m.D.Write(t(dst), src)
}
func (m *ModelDevice) WriteInt32(dst model.Buf, src []int32) {
	defer m.lock()()
	m.D.WriteInt32(t(dst), src)
}

// Read waits for the queued work and copies src to dst; after an error dst is all NaN.
func (m *ModelDevice) Read(dst []float32, src model.Buf) {
	defer m.lock()()
	if m.err == nil {
		t0 := time.Now()
		m.fail(m.D.ReadInto(dst, t(src)))
		m.stats.Reads++
		m.stats.ReadTime += time.Since(t0)
	}
	if m.err != nil {
		nan := float32(math.NaN())
		for i := range dst {
			dst[i] = nan
		}
	}
}

func (m *ModelDevice) Zero(b model.Buf)        { defer m.lock()(); m.D.Zero(t(b)) }
func (m *ModelDevice) Copy(dst, src model.Buf) { defer m.lock()(); m.D.Copy(t(dst), t(src)) }
func (m *ModelDevice) Add(dst, src model.Buf)  { defer m.lock()(); m.D.AddInPlace(t(dst), t(src)) }
func (m *ModelDevice) SoftmaxRows(x model.Buf, N, E int) {
	defer m.lock()()
	m.D.SoftmaxRows(t(x), N, E)
}

func (m *ModelDevice) EncoderForward(out, inp, wte, wpe model.Buf, B, T, C int) {
	defer m.lock()()
	m.D.EncoderForward(t(out), t(inp), t(wte), t(wpe), B, T, C)
}

func (m *ModelDevice) EncoderBackward(dwte, dwpe, dout, inp model.Buf, B, T, C int) {
	defer m.lock()()
	m.D.EncoderBackward(t(dwte), t(dwpe), t(dout), t(inp), B, T, C)
}

func (m *ModelDevice) LayerNormForward(out, mean, rstd, inp, w, b model.Buf, N, C int) {
	defer m.lock()()
	m.D.LayerNormForward(t(out), t(mean), t(rstd), t(inp), t(w), t(b), N, C)
}

func (m *ModelDevice) LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd model.Buf, N, C int) {
	defer m.lock()()
	m.D.LayerNormBackward(t(dinp), t(dw), t(db), t(dout), t(inp), t(w), t(mean), t(rstd), N, C)
}

func (m *ModelDevice) LinearForward(out, inp, w, bias model.Buf, N, IN, OUT int) {
	defer m.lock()()
	m.D.LinearForward(t(out), t(inp), t(w), t(bias), N, IN, OUT)
}

func (m *ModelDevice) LinearBackward(dinp, dw, db, dout, inp, w model.Buf, N, IN, OUT int, accIn bool) {
	defer m.lock()()
	m.D.LinearBackward(t(dinp), t(dw), t(db), t(dout), t(inp), t(w), N, IN, OUT, accIn)
}

func (m *ModelDevice) AttentionForward(out, att, qkv model.Buf, B, T, C, H int) {
	defer m.lock()()
	m.D.AttentionForward(t(out), t(att), t(qkv), B, T, C, H)
}

func (m *ModelDevice) AttentionBackward(dqkv, dout, qkv, att model.Buf, B, T, C, H int) {
	defer m.lock()()
	m.D.AttentionBackward(t(dqkv), t(dout), t(qkv), t(att), B, T, C, H)
}

func (m *ModelDevice) GELUForward(out, th, inp model.Buf) {
	defer m.lock()()
	m.D.GELUForward(t(out), t(th), t(inp))
}

func (m *ModelDevice) GELUBackward(dinp, inp, th, dout model.Buf) {
	defer m.lock()()
	m.D.GELUBackward(t(dinp), t(inp), t(th), t(dout))
}

// CrossEntropyForward computes the per-row losses on the GPU and their mean on the host, in
// float64 in row order as the Go reference sums them; it waits like Read (NaN after an error).
func (m *ModelDevice) CrossEntropyForward(logits, targets model.Buf, N, V int) float64 {
	defer m.lock()()
	if m.losses == nil || m.losses.Len() < N {
		if m.losses != nil {
			m.D.Release(m.losses)
		}
		m.losses = m.D.Zeros(N)
	}
	m.D.CrossEntropyForward(m.losses.Slice(0, N), t(logits), t(targets), N, V)
	if m.err == nil {
		t0 := time.Now()
		ce, err := m.D.CrossEntropyMean(m.losses, N)
		m.stats.Reads++
		m.stats.ReadTime += time.Since(t0)
		m.fail(err)
		if err == nil {
			return ce
		}
	}
	return math.NaN()
}

// CrossEntropyRows writes each row's loss to losses without waiting (Device.CrossEntropyForward's
// rows; the caller sums them after the step's one read).
func (m *ModelDevice) CrossEntropyRows(losses, logits, targets model.Buf, N, V int) {
	defer m.lock()()
	m.D.CrossEntropyForward(t(losses), t(logits), t(targets), N, V)
}

func (m *ModelDevice) CrossEntropyBackward(logits, targets model.Buf, N, V int, scale float32) {
	defer m.lock()()
	m.D.CrossEntropyBackward(t(logits), t(targets), N, V, scale)
}

// AdamW queues one tensor's update. model.Shard.Apply calls it once per tensor, in slab order, and
// a tensor's decay depends on its shape (1 for vectors), so a dispatch per call would be one per
// tensor; instead consecutive calls over adjacent views of the same slabs, with the same step,
// gather into one run that the next other op (or Read, which takes the lock) records as a single
// AdamWSlab dispatch — each element's arithmetic unchanged. A shard whose tensors are one slab
// thus updates in one dispatch; a shard whose tensors are views of another's (an expert host's
// replicas) in one per adjacent run.
func (m *ModelDevice) AdamW(w, g, mm, v model.Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	tw, tg, tm, tv := t(w), t(g), t(mm), t(v)
	a := &m.adam
	if a.n > 0 && !(next(a.w, a.n, tw) && next(a.g, a.n, tg) && next(a.m, a.n, tm) && next(a.v, a.n, tv) &&
		a.stepSize == stepSize && a.sqrtBC2 == sqrtBC2 && a.gradScale == gradScale &&
		(decay == 1 || a.decay == 1 || a.decay == decay)) {
		m.flushAdam()
	}
	if a.n == 0 {
		*a = adamRun{w: tw, g: tg, m: tm, v: tv, segs: a.segs[:0], decay: 1, stepSize: stepSize, sqrtBC2: sqrtBC2, gradScale: gradScale}
	}
	if decay != 1 {
		a.decay = decay
	}
	a.segs = append(a.segs, AdamWSegment{N: tw.Len(), Decay: decay != 1})
	a.n += tw.Len()
}

// next reports whether x starts where the n elements from start end, in the same buffer.
func next(start *Tensor, n int, x *Tensor) bool {
	return x.buf == start.buf && x.off == start.off+n
}

// flushAdam records the pending AdamW run, if any: as AdamW for a single tensor, else AdamWSlab.
// The caller holds m.mu.
func (m *ModelDevice) flushAdam() {
	a := &m.adam
	if a.n == 0 {
		return
	}
	if len(a.segs) == 1 {
		m.D.AdamW(a.w, a.g, a.m, a.v, a.decay, a.stepSize, a.sqrtBC2, a.gradScale)
	} else {
		m.D.AdamWSlab(a.w.grow(a.n), a.g.grow(a.n), a.m.grow(a.n), a.v.grow(a.n),
			a.segs, a.decay, a.stepSize, a.sqrtBC2, a.gradScale)
	}
	a.n = 0
	a.segs = a.segs[:0]
}

func (m *ModelDevice) TopKGate(gate, mask, probs model.Buf, N, E, K int) {
	defer m.lock()()
	m.D.TopKGate(t(gate), t(mask), t(probs), N, E, K)
}

func (m *ModelDevice) GateRows(dst, src, gate model.Buf, e, N, C, E int, acc bool) {
	defer m.lock()()
	m.D.GateRows(t(dst), t(src), t(gate), e, N, C, E, acc)
}

func (m *ModelDevice) GateGrad(dgate, dout, y, mask model.Buf, e, N, C, E int) {
	defer m.lock()()
	m.D.GateGrad(t(dgate), t(dout), t(y), t(mask), e, N, C, E)
}

func (m *ModelDevice) MoEStats(stats, mask, probs model.Buf, N, E, K int) {
	defer m.lock()()
	m.D.MoEStats(t(stats), t(mask), t(probs), N, E, K)
}

func (m *ModelDevice) AuxGrad(dgate, stats model.Buf, N, E, K int, scale float32) {
	defer m.lock()()
	m.D.AuxGrad(t(dgate), t(stats), N, E, K, scale)
}

func (m *ModelDevice) SoftmaxBackwardRows(dx, p, dp model.Buf, N, E int) {
	defer m.lock()()
	m.D.SoftmaxBackwardRows(t(dx), t(p), t(dp), N, E)
}
