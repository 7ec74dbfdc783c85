package model

import "fmt"

// Buf is a buffer on a Device: float32 or int32 elements, as it was allocated. It is a handle,
// usable only with the device that made it; Len is its length in elements.
type Buf interface {
	Len() int
}

// Device is what a Stage, an Expert and a Shard's optimizer compute with: buffers that stay on
// the device between the ops of a step, and one method per layer of package kernels. Host runs
// them on the CPU (package kernels itself, the reference); a WebGPU device queues shaders that
// compute the same things. A shard's tensors — parameters, gradients, Adam's moments,
// activations — live in Bufs; only what a peer must send or report crosses to the host, through
// Read.
//
// Ops run in the order they are called, each seeing the results of the ones before, as on one GPU
// queue; a device may return before an op has run. Every op has the semantics, argument order,
// shapes (letters as in kernels/layers.go) and accumulate-or-overwrite rule of the kernels
// function of the same name: where a kernels function takes a nil slice (a Linear without bias),
// the method takes a nil Buf. A device that gives the kernels' bits agrees with every other
// shard bit for bit; one that does not (WebGPU's arithmetic differs) is compared with a tolerance
// (docs/design.md, "Equivalence, defined").
//
// The Bufs given to one op never overlap (kernels.GELUBackward allows dinp to alias dout; the
// model does not ask it of a Device, since WebGPU cannot bind one buffer both ways in a dispatch).
// The in-place ops, CrossEntropyBackward and SoftmaxRows, take one Buf.
type Device interface {
	// Alloc returns a buffer of n zeroed float32; AllocInt32 one of n zeroed int32.
	Alloc(n int) Buf
	AllocInt32(n int) Buf
	// Slice is a view of b's elements [off, off+n): ops on the view read and change b's memory.
	Slice(b Buf, off, n int) Buf
	// Free gives back the memory of b, which Alloc or AllocInt32 returned (not a view): b and
	// its views are not used again. Ops already queued still see b; the memory is reused only by
	// ops queued after. A GPU's memory is not collected with the Go values that name it, so
	// whatever replaces a buffer frees the old one (scratch). Host does nothing: Go collects it.
	Free(b Buf)
	// Err is the first error the device met running queued work — a lost device, a refused
	// dispatch, memory it could not allocate — or nil. Ops after an error do nothing and reads
	// return NaN, so a step cannot end well unnoticed; Err names the cause. Host never fails.
	Err() error

	// Write copies host src into dst (len(src) == dst.Len()), after the ops already queued; src
	// may be reused as soon as Write returns.
	Write(dst Buf, src []float32)
	WriteInt32(dst Buf, src []int32)
	// Read copies src into host dst (len(dst) == src.Len()) once every op queued before it has
	// run. It is the one call that waits for the device, with CrossEntropyForward, whose result
	// is a number on the host.
	Read(dst []float32, src Buf)

	// Zero clears b; Copy sets dst = src; Add sets dst += src, element by element.
	Zero(b Buf)
	Copy(dst, src Buf)
	Add(dst, src Buf)

	// The layers: see the kernels function of each name.
	EncoderForward(out, inp, wte, wpe Buf, B, T, C int)
	EncoderBackward(dwte, dwpe, dout, inp Buf, B, T, C int)
	LayerNormForward(out, mean, rstd, inp, w, b Buf, N, C int)
	LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd Buf, N, C int)
	LinearForward(out, inp, w, bias Buf, N, IN, OUT int)
	LinearBackward(dinp, dw, db, dout, inp, w Buf, N, IN, OUT int, accIn bool)
	AttentionForward(out, att, qkv Buf, B, T, C, H int)
	AttentionBackward(dqkv, dout, qkv, att Buf, B, T, C, H int)
	GELUForward(out, th, inp Buf)
	GELUBackward(dinp, inp, th, dout Buf)
	// CrossEntropyForward returns the mean loss on the host, so it waits like Read.
	CrossEntropyForward(logits, targets Buf, N, V int) float64
	// CrossEntropyRows writes each row's loss to losses (N) without waiting: a GPU stage's
	// training loss stays on the device until the step's one read (Stage.TakeStats), summed then
	// in float64 in row order — CrossEntropyForward's value on a device that sums the same rows.
	CrossEntropyRows(losses, logits, targets Buf, N, V int)
	CrossEntropyBackward(logits, targets Buf, N, V int, scale float32)
	SoftmaxRows(x Buf, N, E int)
	// An MoE block's routing where its tensors are (moe.go's dense path; kernels/moe.go): the
	// gate and mask of the top-k experts, gate-weighted rows, the gate's gradient, the block's
	// assignment counts and balancing loss (stats, E+1 floats), the balancing loss's gradient and
	// the router softmax's backward.
	TopKGate(gate, mask, probs Buf, N, E, K int)
	GateRows(dst, src, gate Buf, e, N, C, E int, acc bool)
	GateGrad(dgate, dout, y, mask Buf, e, N, C, E int)
	MoEStats(stats, mask, probs Buf, N, E, K int)
	AuxGrad(dgate, stats Buf, N, E, K int, scale float32)
	SoftmaxBackwardRows(dx, p, dp Buf, N, E int)
	AdamW(w, g, m, v Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32)
}

// NormDevice is a Device that sums squares where the tensors are, so that a shard's gradient
// norms — what a peer reports every step — cost one small read rather than the whole gradient
// (Shard.GradSquaredNorms).
type NormDevice interface {
	Device
	// SquaredNorms returns Σx² of each buffer, on the host in float64; it waits like Read.
	SquaredNorms(bufs []Buf) []float64
	// SquaredNormsWith is SquaredNorms that also reads also (float32) into alsoDst in the same
	// wait: a step's other results left on the device (a stage's MoE statistics, Stage.TakeStats)
	// come back with its norms, in the step's one read.
	SquaredNormsWith(bufs []Buf, also Buf, alsoDst []float32) []float64
}

// hostMemory is implemented by devices whose buffers are host memory: Host. The model reads and
// fills such buffers in place where another device needs a Read or a Write, and wraps host
// slices it already has instead of uploading them, so Host copies nothing that calling package
// kernels directly would not. Unexported: a device that merely claimed it would be bypassed.
type hostMemory interface {
	floats(b Buf) []float32 // b's memory
	wrap(h []float32) Buf   // a buffer whose memory is h
}

// readView returns b's contents on the host: b's own memory on Host, otherwise a copy read into
// *stage (grown as needed). It is valid until b or *stage next change.
func readView(dev Device, b Buf, stage *[]float32) []float32 {
	if hm, ok := dev.(hostMemory); ok {
		return hm.floats(b)
	}
	*stage = grow(*stage, b.Len())
	dev.Read(*stage, b)
	return *stage
}

// fillView returns host memory in which to compute b's new contents — b's own on Host, otherwise
// *stage — and publish makes them b's.
func fillView(dev Device, b Buf, stage *[]float32) []float32 {
	if hm, ok := dev.(hostMemory); ok {
		return hm.floats(b)
	}
	*stage = grow(*stage, b.Len())
	return *stage
}

func publish(dev Device, b Buf, h []float32) {
	if _, ok := dev.(hostMemory); !ok {
		dev.Write(b, h)
	}
}

// upload returns a buffer holding host h: h itself on Host, otherwise s's buffer written from h.
func upload(dev Device, h []float32, s *scratch) Buf {
	if hm, ok := dev.(hostMemory); ok {
		if s.view == nil || s.view.Len() != len(h) || len(h) > 0 && &hm.floats(s.view)[0] != &h[0] {
			s.view = hm.wrap(h)
		}
		return s.view
	}
	b := s.at(dev, len(h))
	dev.Write(b, h)
	return b
}

// sink returns a buffer for an op to write into when the result is wanted in host h: h itself on
// Host, otherwise s's buffer, which collect then reads into h.
func sink(dev Device, h []float32, s *scratch) Buf {
	if hm, ok := dev.(hostMemory); ok {
		return hm.wrap(h)
	}
	return s.at(dev, len(h))
}

func collect(dev Device, h []float32, b Buf) {
	if _, ok := dev.(hostMemory); !ok {
		dev.Read(h, b)
	}
}

// scratch is a device buffer that grows to the largest size asked of it and hands out a view of
// the size asked, the same view while the size stays: steps of one shape allocate nothing. Like
// grow, it keeps old contents, which no caller relies on.
type scratch struct {
	base, view Buf
}

func (s *scratch) at(dev Device, n int) Buf { return s.sized(dev, n, 0, false) }

func (s *scratch) atInt32(dev Device, n int) Buf { return s.sized(dev, n, 0, true) }

// atSlack is at for sizes that vary from call to call (an expert's rows, which drift with the
// routing): it allocates twice the first size asked and, when a later one is larger still, half
// as much again, so that it grows once or twice rather than at every new largest size.
func (s *scratch) atSlack(dev Device, n int) Buf {
	extra := n / 2
	if s.base == nil {
		extra = n
	}
	return s.sized(dev, n, extra, false)
}

func (s *scratch) sized(dev Device, n, extra int, int32s bool) Buf {
	switch {
	case s.view != nil && s.view.Len() == n:
	case s.base == nil || s.base.Len() < n:
		if s.base != nil {
			dev.Free(s.base) // its queued ops still see it
		}
		if int32s {
			s.base = dev.AllocInt32(n + extra)
		} else {
			s.base = dev.Alloc(n + extra)
		}
		s.view = s.base
		if extra > 0 {
			s.view = dev.Slice(s.base, 0, n)
		}
	default:
		s.view = dev.Slice(s.base, 0, n)
	}
	return s.view
}

// devParams are the device buffers of a Params' tensors, in its order. When the Params owns a
// slab they are views of one device slab, so that a push or a pull is one transfer; on Host they
// are the Params' own memory and pushes and pulls cost nothing.
type devParams struct {
	host *Params
	slab Buf // nil when the tensors are views of another devParams
	bufs []Buf
}

func newDevParams(dev Device, p *Params) *devParams {
	d := &devParams{host: p, bufs: make([]Buf, len(p.Tensors))}
	if hm, ok := dev.(hostMemory); ok {
		if p.Slab != nil {
			d.slab = hm.wrap(p.Slab)
		}
		for i, t := range p.Tensors {
			d.bufs[i] = hm.wrap(t.Data)
		}
		return d
	}
	d.slab = dev.Alloc(p.NumElements())
	off := 0
	for i, t := range p.Tensors {
		d.bufs[i] = dev.Slice(d.slab, off, len(t.Data))
		off += len(t.Data)
	}
	return d
}

// sub returns the buffers of q, a Sub of d.host: views of d's, so both see the same memory.
func (d *devParams) sub(q *Params) (*devParams, error) {
	s := &devParams{host: q, bufs: make([]Buf, len(q.Tensors))}
	for i, t := range q.Tensors {
		j, ok := d.host.index[t.Name]
		if !ok {
			return nil, fmt.Errorf("tensor %s: not in this parameter set", t.Name)
		}
		s.bufs[i] = d.bufs[j]
	}
	return s, nil
}

// get returns the buffer of the tensor called name; a missing name is a programming error.
func (d *devParams) get(name string) Buf {
	i, ok := d.host.index[name]
	if !ok {
		panic("model: no tensor " + name)
	}
	return d.bufs[i]
}

// whole reports whether the host slab and the device slab are the same tensors in the same
// order, so that one transfer moves them all.
func (d *devParams) whole() bool { return d.slab != nil && d.host.Slab != nil }

// push copies the host tensors to the device.
func (d *devParams) push(dev Device) {
	if _, ok := dev.(hostMemory); ok {
		return
	}
	if d.whole() {
		dev.Write(d.slab, d.host.Slab)
		return
	}
	for i, t := range d.host.Tensors {
		dev.Write(d.bufs[i], t.Data)
	}
}

// pull copies the device tensors to the host.
func (d *devParams) pull(dev Device) {
	if _, ok := dev.(hostMemory); ok {
		return
	}
	if d.whole() {
		dev.Read(d.host.Slab, d.slab)
		return
	}
	for i, t := range d.host.Tensors {
		dev.Read(t.Data, d.bufs[i])
	}
}

// zero clears the tensors on the device and on the host.
func (d *devParams) zero(dev Device) {
	if d.slab != nil {
		dev.Zero(d.slab)
	} else {
		for _, b := range d.bufs {
			dev.Zero(b)
		}
	}
	if _, ok := dev.(hostMemory); !ok {
		d.host.Zero()
	}
}
