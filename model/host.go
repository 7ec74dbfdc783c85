package model

import (
	"fmt"

	"github.com/shoal-ml/shoal/kernels"
)

// Host is the Device over host memory: every op is the kernels function of its name, on the
// fastest instruction set the CPU has (or the portable Go kernels, as in the wasm build). It is
// the reference and the default; its buffers are plain slices, so the Params a shard holds are
// its device tensors and Push, Pull and PullGrads cost nothing.
//
// Packs, when set, keeps the packed form of the linear layers' weights while it is in a span
// (kernels.Packs): Model opens one for each step's micro-batches, during which no weight changes.
type Host struct {
	Packs *kernels.Packs
}

var _ Device = Host{}

// hostBuf is a Host buffer: f for float32 buffers, i for int32 ones.
type hostBuf struct {
	f []float32
	i []int32
}

func (b *hostBuf) Len() int {
	if b.i != nil {
		return len(b.i)
	}
	return len(b.f)
}

// hf returns the float32 memory of b (nil for a nil Buf, as kernels takes a missing bias).
func hf(b Buf) []float32 {
	if b == nil {
		return nil
	}
	return b.(*hostBuf).f
}

func hi32(b Buf) []int32 { return b.(*hostBuf).i }

func (Host) floats(b Buf) []float32 { return hf(b) }
func (Host) wrap(h []float32) Buf   { return &hostBuf{f: h} }

func (Host) Alloc(n int) Buf      { return &hostBuf{f: make([]float32, n)} }
func (Host) Free(Buf)             {} // the Go collector frees host memory
func (Host) Err() error           { return nil }
func (Host) AllocInt32(n int) Buf { return &hostBuf{i: make([]int32, n)} }

func (Host) Slice(b Buf, off, n int) Buf {
	h := b.(*hostBuf)
	if h.i != nil {
		return &hostBuf{i: h.i[off : off+n : off+n]}
	}
	return &hostBuf{f: h.f[off : off+n : off+n]}
}

func (Host) Write(dst Buf, src []float32) { copy(hf(dst), sameLen(src, dst.Len(), "write")) }

func (Host) WriteInt32(dst Buf, src []int32) {
	if len(src) != dst.Len() {
		panic(fmt.Sprintf("model: write of %d int32 into a buffer of %d", len(src), dst.Len()))
	}
	copy(hi32(dst), src)
}

func (Host) Read(dst []float32, src Buf) { copy(sameLen(dst, src.Len(), "read"), hf(src)) }

func sameLen(h []float32, n int, op string) []float32 {
	if len(h) != n {
		panic(fmt.Sprintf("model: %s of %d floats with a buffer of %d", op, len(h), n))
	}
	return h
}

func (Host) Zero(b Buf) { clear(hf(b)) }

func (Host) Copy(dst, src Buf) { copy(hf(dst), sameLen(hf(src), dst.Len(), "copy")) }

func (Host) Add(dst, src Buf) { kernels.AddTo(hf(dst), sameLen(hf(src), dst.Len(), "add")) }

func (Host) EncoderForward(out, inp, wte, wpe Buf, B, T, C int) {
	kernels.EncoderForward(hf(out), hi32(inp), hf(wte), hf(wpe), B, T, C)
}

func (Host) EncoderBackward(dwte, dwpe, dout, inp Buf, B, T, C int) {
	kernels.EncoderBackward(hf(dwte), hf(dwpe), hf(dout), hi32(inp), B, T, C)
}

func (Host) LayerNormForward(out, mean, rstd, inp, w, b Buf, N, C int) {
	kernels.LayerNormForward(hf(out), hf(mean), hf(rstd), hf(inp), hf(w), hf(b), N, C)
}

func (Host) LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd Buf, N, C int) {
	kernels.LayerNormBackward(hf(dinp), hf(dw), hf(db), hf(dout), hf(inp), hf(w), hf(mean), hf(rstd), N, C)
}

func (h Host) LinearForward(out, inp, w, bias Buf, N, IN, OUT int) {
	kernels.LinearForwardPacked(h.Packs, hf(out), hf(inp), hf(w), hf(bias), N, IN, OUT)
}

func (h Host) LinearBackward(dinp, dw, db, dout, inp, w Buf, N, IN, OUT int, accIn bool) {
	kernels.LinearBackwardPacked(h.Packs, hf(dinp), hf(dw), hf(db), hf(dout), hf(inp), hf(w), N, IN, OUT, accIn)
}

func (Host) AttentionForward(out, att, qkv Buf, B, T, C, H int) {
	kernels.AttentionForward(hf(out), hf(att), hf(qkv), B, T, C, H)
}

func (Host) AttentionBackward(dqkv, dout, qkv, att Buf, B, T, C, H int) {
	kernels.AttentionBackward(hf(dqkv), hf(dout), hf(qkv), hf(att), B, T, C, H)
}

func (Host) GELUForward(out, th, inp Buf) { kernels.GELUForward(hf(out), hf(th), hf(inp)) }

func (Host) GELUBackward(dinp, inp, th, dout Buf) {
	kernels.GELUBackward(hf(dinp), hf(inp), hf(th), hf(dout))
}

func (Host) CrossEntropyForward(logits, targets Buf, N, V int) float64 {
	return kernels.CrossEntropyForward(hf(logits), hi32(targets), N, V)
}

func (Host) CrossEntropyBackward(logits, targets Buf, N, V int, scale float32) {
	kernels.CrossEntropyBackward(hf(logits), hi32(targets), N, V, scale)
}

func (Host) SoftmaxRows(x Buf, N, E int) { kernels.SoftmaxRows(hf(x), N, E) }

func (Host) CrossEntropyRows(losses, logits, targets Buf, N, V int) {
	kernels.CrossEntropyRows(hf(losses), hf(logits), hi32(targets), N, V)
}

func (Host) TopKGate(gate, mask, probs Buf, N, E, K int) {
	kernels.TopKGate(hf(gate), hf(mask), hf(probs), N, E, K)
}

func (Host) GateRows(dst, src, gate Buf, e, N, C, E int, acc bool) {
	kernels.GateRows(hf(dst), hf(src), hf(gate), e, N, C, E, acc)
}

func (Host) GateGrad(dgate, dout, y, mask Buf, e, N, C, E int) {
	kernels.GateGrad(hf(dgate), hf(dout), hf(y), hf(mask), e, N, C, E)
}

func (Host) MoEStats(stats, mask, probs Buf, N, E, K int) {
	kernels.MoEStats(hf(stats), hf(mask), hf(probs), N, E, K)
}

func (Host) AuxGrad(dgate, stats Buf, N, E, K int, scale float32) {
	kernels.AuxGrad(hf(dgate), hf(stats), N, E, K, scale)
}

func (Host) SoftmaxBackwardRows(dx, p, dp Buf, N, E int) {
	kernels.SoftmaxBackwardRows(hf(dx), hf(p), hf(dp), N, E)
}

func (Host) AdamW(w, g, m, v Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	kernels.AdamW(hf(w), hf(g), hf(m), hf(v), decay, stepSize, sqrtBC2, gradScale)
}
