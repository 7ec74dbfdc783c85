//go:build js && wasm

package webgpu

import (
	"fmt"
	"math"
	"slices"

	"github.com/shoal-ml/shoal/kernels/wgsl"
)

// The ops mirror package kernels one to one: same arguments (tensors for slices), same
// semantics — which ones accumulate and which overwrite — and the same letters: B batch,
// T sequence, C channels, V vocab, N rows, H heads. They record dispatches and return at once.
// A wrong shape panics, as an out-of-range slice does in the Go kernels. Outputs may alias
// inputs only where the Go function allows it.

// gemm describes one (batched, strided) multiply for the matmul kernel: matrix z of the batch,
// z = outer·inner + in, starts s*[0]·outer + s*[1]·in elements into each operand's view.
type gemm struct {
	c, a, b       *Tensor
	bias          *Tensor // added to each row of c after the product (LinearForward), or nil
	m, k, n       int
	ldc, lda, ldb int
	acc           bool
	batch, inner  int
	sc, sa, sb    [2]int
}

// gemm records g on the matmul kernel of the device's variants (see SetGPUKernels); layout is
// "nn", "nt" or "tn".
func (d *Device) gemm(layout string, g gemm) {
	if g.m == 0 || g.n == 0 || g.batch == 0 {
		return
	}
	if g.k == 0 {
		// An empty sum: c = 0, or c unchanged with acc. Only reachable for a plain (batch of
		// one, dense) product, which is all the public API offers with k = 0.
		if !g.acc {
			d.Fill(g.c.Slice(0, g.m*g.n), 0)
		}
		if g.bias != nil {
			d.BiasAdd(g.c, g.bias, g.m, g.n)
		}
		return
	}
	acc := uint32(0)
	if g.acc {
		acc = 1
	}
	name := "matmul_" + layout
	if d.gpuKernels {
		name = "matmul_tiled_" + layout
	}
	// Without a bias, a binding the kernel never reads: a, which the dispatch binds read-only
	// anyway (read-only bindings of one buffer may overlap), so it costs no new bind group
	// entry's worth of aliasing.
	bias, hasBias := g.a, uint32(0)
	if g.bias != nil {
		bias, hasBias = g.bias, 1
	}
	tile := d.pipelineFor(name).kernel.Tile
	gx := (g.n + tile[1] - 1) / tile[1]
	gy := (g.m + tile[0] - 1) / tile[0]
	d.dispatch(name, []*Tensor{g.c, g.a, g.b, bias}, []uint32{
		u32(g.m), u32(g.k), u32(g.n), u32(g.ldc), u32(g.lda), u32(g.ldb), acc, hasBias, u32(g.inner),
		u32(g.sc[0]), u32(g.sc[1]), u32(g.sa[0]), u32(g.sa[1]), u32(g.sb[0]), u32(g.sb[1]),
	}, gx, gy, g.batch)
}

// MatMulNN computes c (m×n) = a (m×k) · b (k×n); with acc it adds to c.
func (d *Device) MatMulNN(c, a, b *Tensor, m, k, n int, acc bool) {
	d.check(c, m*n, wgsl.F32, "MatMulNN c")
	d.check(a, m*k, wgsl.F32, "MatMulNN a")
	d.check(b, k*n, wgsl.F32, "MatMulNN b")
	d.gemm("nn", gemm{c: c, a: a, b: b, m: m, k: k, n: n, ldc: n, lda: k, ldb: n, acc: acc, batch: 1, inner: 1})
}

// MatMulNT computes c (m×n) = a (m×k) · bᵀ where b is (n×k); with acc it adds to c.
func (d *Device) MatMulNT(c, a, b *Tensor, m, k, n int, acc bool) {
	d.check(c, m*n, wgsl.F32, "MatMulNT c")
	d.check(a, m*k, wgsl.F32, "MatMulNT a")
	d.check(b, n*k, wgsl.F32, "MatMulNT b")
	d.gemm("nt", gemm{c: c, a: a, b: b, m: m, k: k, n: n, ldc: n, lda: k, ldb: k, acc: acc, batch: 1, inner: 1})
}

// MatMulTN computes c (m×n) = aᵀ · b where a is (k×m) and b (k×n); with acc it adds to c. A
// weight gradient over rows lo…hi of a micro-batch is MatMulTN over a.Slice(lo·m, (hi−lo)·m)
// and b.Slice(lo·n, (hi−lo)·n) with acc.
func (d *Device) MatMulTN(c, a, b *Tensor, m, k, n int, acc bool) {
	d.check(c, m*n, wgsl.F32, "MatMulTN c")
	d.check(a, k*m, wgsl.F32, "MatMulTN a")
	d.check(b, k*n, wgsl.F32, "MatMulTN b")
	d.gemm("tn", gemm{c: c, a: a, b: b, m: m, k: k, n: n, ldc: n, lda: m, ldb: n, acc: acc, batch: 1, inner: 1})
}

// EncoderForward: out (B,T,C) = wte[inp] + wpe[t]; inp is an int32 tensor of B·T token ids.
func (d *Device) EncoderForward(out, inp, wte, wpe *Tensor, B, T, C int) {
	N := B * T
	d.check(out, N*C, wgsl.F32, "EncoderForward out")
	d.check(inp, N, wgsl.I32, "EncoderForward inp")
	d.check(wte, C, wgsl.F32, "EncoderForward wte")
	d.check(wpe, T*C, wgsl.F32, "EncoderForward wpe")
	d.flat("encoder_forward", N*C, []*Tensor{out, inp, wte, wpe}, u32(N), u32(T), u32(C))
}

// EncoderBackward accumulates dwte and dwpe from dout (B,T,C), rows in order: encoder_links
// lists each token's rows in a device-owned scratch, then encoder_backward adds each list.
func (d *Device) EncoderBackward(dwte, dwpe, dout, inp *Tensor, B, T, C int) {
	N := B * T
	d.check(dwte, C, wgsl.F32, "EncoderBackward dwte")
	d.check(dwpe, T*C, wgsl.F32, "EncoderBackward dwpe")
	d.check(dout, N*C, wgsl.F32, "EncoderBackward dout")
	d.check(inp, N, wgsl.I32, "EncoderBackward inp")
	if N == 0 || C == 0 {
		return
	}
	links := d.scratchInt32(&d.scratchLinks, 2*N)
	d.flat("encoder_links", N, []*Tensor{links, inp}, u32(N))
	d.flat("encoder_backward", N*C, []*Tensor{dwte, dwpe, dout, inp, links}, u32(N), u32(T), u32(C))
}

// LayerNormForward normalises each of N rows of inp (N,C), keeping mean and rstd (N).
func (d *Device) LayerNormForward(out, mean, rstd, inp, w, b *Tensor, N, C int) {
	d.check(out, N*C, wgsl.F32, "LayerNormForward out")
	d.check(mean, N, wgsl.F32, "LayerNormForward mean")
	d.check(rstd, N, wgsl.F32, "LayerNormForward rstd")
	d.check(inp, N*C, wgsl.F32, "LayerNormForward inp")
	d.check(w, C, wgsl.F32, "LayerNormForward w")
	d.check(b, C, wgsl.F32, "LayerNormForward b")
	d.rows("layernorm_forward", N, []*Tensor{out, mean, rstd, inp, w, b}, u32(N), u32(C))
}

// LayerNormBackward accumulates dinp, dw and db.
func (d *Device) LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd *Tensor, N, C int) {
	d.check(dinp, N*C, wgsl.F32, "LayerNormBackward dinp")
	d.check(dw, C, wgsl.F32, "LayerNormBackward dw")
	d.check(db, C, wgsl.F32, "LayerNormBackward db")
	d.check(dout, N*C, wgsl.F32, "LayerNormBackward dout")
	d.check(inp, N*C, wgsl.F32, "LayerNormBackward inp")
	d.check(w, C, wgsl.F32, "LayerNormBackward w")
	d.check(mean, N, wgsl.F32, "LayerNormBackward mean")
	d.check(rstd, N, wgsl.F32, "LayerNormBackward rstd")
	if N == 0 || C == 0 {
		return
	}
	d.rows("layernorm_backward_input", N, []*Tensor{dinp, dout, inp, w, mean, rstd}, u32(N), u32(C))
	chunks := columnChunks(N)
	parts := d.scratchTensor(&d.scratchCols, 2*chunks*C)
	d.flat("layernorm_backward_params", chunks*C, []*Tensor{parts, dout, inp, mean, rstd}, u32(N), u32(C))
	d.flat("colsum_tree", C, []*Tensor{dw, parts.Slice(0, chunks*C)}, u32(chunks), u32(C))
	d.flat("colsum_tree", C, []*Tensor{db, parts.Slice(chunks*C, chunks*C)}, u32(chunks), u32(C))
}

// columnChunks is the number of chunk sums of a column reduction over N rows.
func columnChunks(N int) int { return (N + wgsl.ColumnChunk - 1) / wgsl.ColumnChunk }

// LinearForward: out (N,OUT) = inp (N,IN) · wᵀ + bias, w (OUT,IN); bias may be nil. The bias is
// added in the matmul's epilogue, after each element's whole chain, as the Go reference adds it
// after MatMulNT: the same roundings, without a second pass over out.
func (d *Device) LinearForward(out, inp, w, bias *Tensor, N, IN, OUT int) {
	d.check(out, N*OUT, wgsl.F32, "LinearForward out")
	d.check(inp, N*IN, wgsl.F32, "LinearForward inp")
	d.check(w, OUT*IN, wgsl.F32, "LinearForward w")
	if bias != nil {
		d.check(bias, OUT, wgsl.F32, "LinearForward bias")
	}
	d.gemm("nt", gemm{c: out, a: inp, b: w, bias: bias, m: N, k: IN, n: OUT, ldc: OUT, lda: IN, ldb: IN, batch: 1, inner: 1})
}

// LinearBackward accumulates dw (and db when non-nil) and writes dinp (overwriting it unless
// accIn).
func (d *Device) LinearBackward(dinp, dw, db, dout, inp, w *Tensor, N, IN, OUT int, accIn bool) {
	d.MatMulNN(dinp, dout, w, N, OUT, IN, accIn)
	d.MatMulTN(dw, dout, inp, OUT, N, IN, true)
	if db != nil {
		d.BiasGrad(db, dout, N, OUT)
	}
}

func (d *Device) attentionShapes(what string, B, T, C, H int) (hs int, scale float32) {
	if H <= 0 || C%H != 0 {
		panic(fmt.Sprintf("webgpu: %s: %d channels do not split into %d heads", what, C, H))
	}
	if B*H > d.maxGroups {
		panic(fmt.Sprintf("webgpu: %s: %d (batch, head) pairs, the adapter dispatches at most %d", what, B*H, d.maxGroups))
	}
	hs = C / H
	return hs, float32(1 / math.Sqrt(float64(hs)))
}

// AttentionForward: causal multi-head attention over qkv (B,T,3C) laid out q|k|v, writing the
// head outputs to out (B,T,C) and the softmax probabilities to att (B,H,T,T), whose masked
// upper triangle is exactly zero. As in the Go reference each (batch, head) is S = Q·Kᵀ,
// P = causal softmax(S/√hs), O = P·V; the multiplies read q, k and v where they lie in qkv.
func (d *Device) AttentionForward(out, att, qkv *Tensor, B, T, C, H int) {
	hs, scale := d.attentionShapes("AttentionForward", B, T, C, H)
	d.check(out, B*T*C, wgsl.F32, "AttentionForward out")
	d.check(att, B*H*T*T, wgsl.F32, "AttentionForward att")
	d.check(qkv, B*T*3*C, wgsl.F32, "AttentionForward qkv")
	if B*T == 0 || C == 0 {
		return
	}
	q, k, v := qkv, qkv.Slice(C, qkv.n-C), qkv.Slice(2*C, qkv.n-2*C)
	head := [2]int{T * 3 * C, hs} // (batch, head) strides of q, k, v in qkv
	d.gemm("nt", gemm{c: att, a: q, b: k, m: T, k: hs, n: T, ldc: T, lda: 3 * C, ldb: 3 * C,
		batch: B * H, inner: H, sc: [2]int{H * T * T, T * T}, sa: head, sb: head})
	d.rows("attention_softmax", B*H*T, []*Tensor{att}, u32(B*H*T), u32(T), f32bits(scale))
	d.gemm("nn", gemm{c: out, a: att, b: v, m: T, k: T, n: hs, ldc: C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: [2]int{T * C, hs}, sa: [2]int{H * T * T, T * T}, sb: head})
}

// AttentionBackward writes dqkv (B,T,3C) (overwriting it) from dout (B,T,C):
// dP = dO·Vᵀ, dV = Pᵀ·dO, dS = P∘(dP − rowsum(P∘dP))·scale, dQ = dS·K, dK = dSᵀ·Q.
// dP and dS live in a scratch tensor of B·H·T·T elements that the device keeps.
func (d *Device) AttentionBackward(dqkv, dout, qkv, att *Tensor, B, T, C, H int) {
	hs, scale := d.attentionShapes("AttentionBackward", B, T, C, H)
	d.check(dqkv, B*T*3*C, wgsl.F32, "AttentionBackward dqkv")
	d.check(dout, B*T*C, wgsl.F32, "AttentionBackward dout")
	d.check(qkv, B*T*3*C, wgsl.F32, "AttentionBackward qkv")
	d.check(att, B*H*T*T, wgsl.F32, "AttentionBackward att")
	if B*T == 0 || C == 0 {
		return
	}
	ds := d.scratchTensor(&d.scratch, B*H*T*T)
	q, k, v := qkv, qkv.Slice(C, qkv.n-C), qkv.Slice(2*C, qkv.n-2*C)
	dq, dk, dv := dqkv, dqkv.Slice(C, dqkv.n-C), dqkv.Slice(2*C, dqkv.n-2*C)
	head := [2]int{T * 3 * C, hs}
	outHead := [2]int{T * C, hs}
	square := [2]int{H * T * T, T * T}
	d.gemm("nt", gemm{c: ds, a: dout, b: v, m: T, k: hs, n: T, ldc: T, lda: C, ldb: 3 * C,
		batch: B * H, inner: H, sc: square, sa: outHead, sb: head})
	d.gemm("tn", gemm{c: dv, a: att, b: dout, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: C,
		batch: B * H, inner: H, sc: head, sa: square, sb: outHead})
	d.rows("attention_softmax_backward", B*H*T, []*Tensor{ds, att}, u32(B*H*T), u32(T), f32bits(scale))
	d.gemm("nn", gemm{c: dq, a: ds, b: k, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: head, sa: square, sb: head})
	d.gemm("tn", gemm{c: dk, a: ds, b: q, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: head, sa: square, sb: head})
}

// scratchTensor returns a device-owned float32 tensor of at least n elements in *slot, growing
// it when needed. Ops run in the order they are recorded, so one scratch serves every op.
func (d *Device) scratchTensor(slot **Tensor, n int) *Tensor {
	return d.scratchOf(slot, n, wgsl.F32)
}

// scratchInt32 is scratchTensor for int32 tensors.
func (d *Device) scratchInt32(slot **Tensor, n int) *Tensor {
	return d.scratchOf(slot, n, wgsl.I32)
}

func (d *Device) scratchOf(slot **Tensor, n int, e wgsl.Elem) *Tensor {
	if *slot == nil || (*slot).n < n {
		if *slot != nil {
			d.Release(*slot)
		}
		*slot = d.alloc(max(n, 1024), e)
	}
	return (*slot).Slice(0, n)
}

// GELUForward writes GELU(inp) to out and the tanh of each input to th (len(inp) elements).
func (d *Device) GELUForward(out, th, inp *Tensor) {
	n := inp.Len()
	d.check(out, n, wgsl.F32, "GELUForward out")
	d.check(th, n, wgsl.F32, "GELUForward th")
	d.check(inp, n, wgsl.F32, "GELUForward inp")
	d.flat("gelu_forward", n, []*Tensor{out, th, inp}, u32(n))
}

// GELUBackward writes dinp (overwriting it; dinp may be dout) from the forward's inputs and tanh.
func (d *Device) GELUBackward(dinp, inp, th, dout *Tensor) {
	n := inp.Len()
	d.check(dinp, n, wgsl.F32, "GELUBackward dinp")
	d.check(inp, n, wgsl.F32, "GELUBackward inp")
	d.check(th, n, wgsl.F32, "GELUBackward th")
	d.check(dout, n, wgsl.F32, "GELUBackward dout")
	d.flat("gelu_backward", n, []*Tensor{dinp, inp, th, dout}, u32(n))
}

// CrossEntropyForward writes each row's −log softmax(logits)[target] to losses (N): the GPU half
// of kernels.CrossEntropyForward. CrossEntropyMean reads them back and takes the mean in float64
// in row order, as the Go reference does.
func (d *Device) CrossEntropyForward(losses, logits, targets *Tensor, N, V int) {
	d.check(losses, N, wgsl.F32, "CrossEntropyForward losses")
	d.check(logits, N*V, wgsl.F32, "CrossEntropyForward logits")
	d.check(targets, N, wgsl.I32, "CrossEntropyForward targets")
	d.rows("crossentropy_forward", N, []*Tensor{losses, logits, targets}, u32(N), u32(V))
}

// CrossEntropyMean reads the first N per-row losses written by CrossEntropyForward and returns
// their mean, summed in float64 in row order. It waits for the GPU (see the package doc).
func (d *Device) CrossEntropyMean(losses *Tensor, N int) (float64, error) {
	if N == 0 {
		return 0, nil
	}
	l, err := d.Read(losses.Slice(0, N))
	if err != nil {
		return 0, err
	}
	var s float64
	for _, v := range l {
		s += float64(v)
	}
	return s / float64(N), nil
}

// CrossEntropyBackward turns logits (N,V) into their gradient in place: scale·(softmax − onehot)/N.
func (d *Device) CrossEntropyBackward(logits, targets *Tensor, N, V int, scale float32) {
	d.check(logits, N*V, wgsl.F32, "CrossEntropyBackward logits")
	d.check(targets, N, wgsl.I32, "CrossEntropyBackward targets")
	d.rows("crossentropy_backward", N, []*Tensor{logits, targets}, u32(N), u32(V), f32bits(scale))
}

// SoftmaxRows normalises each row of x (N,E) in place.
func (d *Device) SoftmaxRows(x *Tensor, N, E int) {
	d.check(x, N*E, wgsl.F32, "SoftmaxRows")
	d.rows("softmax_rows", N, []*Tensor{x}, u32(N), u32(E))
}

// AdamW applies one AdamW update to w (len(w) elements) in place, as kernels.AdamW: gradients g
// scaled by gradScale, moments m and v updated in place; decay is 1 − lr·weight_decay, stepSize
// lr/bc1 and sqrtBC2 √bc2 (rounded to float32 on the GPU).
func (d *Device) AdamW(w, g, m, v *Tensor, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	n := w.Len()
	d.check(w, n, wgsl.F32, "AdamW w")
	d.check(g, n, wgsl.F32, "AdamW g")
	d.check(m, n, wgsl.F32, "AdamW m")
	d.check(v, n, wgsl.F32, "AdamW v")
	d.flat("adamw", n, []*Tensor{w, g, m, v}, u32(n), f32bits(decay), f32bits(stepSize), f32bits(float32(sqrtBC2)), f32bits(gradScale))
}

// AdamWSegment is one tensor of a run that AdamWSlab updates: N elements, decayed by the run's
// decay when Decay (a tensor of 2+ dims), else by 1.
type AdamWSegment struct {
	N     int
	Decay bool
}

// AdamWSlab is AdamW over consecutive tensors — w, g, m and v each the run of the tensors' views,
// laid end to end as segs says — in one dispatch: for each tensor, what AdamW does with decay
// when its segment decays and 1 when not. The segment table lives on the device and is uploaded
// again only when it changes (once per shard layout).
func (d *Device) AdamWSlab(w, g, m, v *Tensor, segs []AdamWSegment, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	n := 0
	for _, s := range segs {
		n += s.N
	}
	d.check(w, n, wgsl.F32, "AdamWSlab w")
	d.check(g, n, wgsl.F32, "AdamWSlab g")
	d.check(m, n, wgsl.F32, "AdamWSlab m")
	d.check(v, n, wgsl.F32, "AdamWSlab v")
	if n == 0 {
		return
	}
	table := make([]int32, 0, 2*len(segs))
	end := 0
	for _, s := range segs {
		end += s.N
		if end > math.MaxInt32 {
			panic(fmt.Sprintf("webgpu: AdamWSlab over %d elements", end))
		}
		table = append(table, int32(end), int32(btoi(s.Decay)))
	}
	if !slices.Equal(table, d.segsHost) {
		t := d.scratchInt32(&d.scratchSegs, len(table))
		d.WriteInt32(t, table)
		d.segsHost = table
	}
	t := d.scratchSegs.Slice(0, len(table))
	d.flat("adamw_slab", n, []*Tensor{w, g, m, v, t}, u32(n), u32(len(segs)), f32bits(decay), f32bits(stepSize), f32bits(float32(sqrtBC2)), f32bits(gradScale))
}

// Add writes out = a + b elementwise over len(out) elements; out may be a or b.
func (d *Device) Add(out, a, b *Tensor) {
	n := out.Len()
	d.check(out, n, wgsl.F32, "Add out")
	d.check(a, n, wgsl.F32, "Add a")
	d.check(b, n, wgsl.F32, "Add b")
	switch {
	case same(out, a, n):
		d.AddInPlace(out, b) // the same float32 add, without a copy to unalias a from out
	case same(out, b, n):
		d.AddInPlace(out, a)
	default:
		d.flat("add", n, []*Tensor{out, a, b}, u32(n))
	}
}

// same reports whether the first n elements of x and y are the same elements.
func same(x, y *Tensor, n int) bool { return x.buf == y.buf && x.off == y.off && n <= min(x.n, y.n) }

// AddInPlace adds src to dst elementwise over len(dst) elements.
func (d *Device) AddInPlace(dst, src *Tensor) {
	n := dst.Len()
	d.check(dst, n, wgsl.F32, "AddInPlace dst")
	d.check(src, n, wgsl.F32, "AddInPlace src")
	d.flat("add_inplace", n, []*Tensor{dst, src}, u32(n))
}

// Copy copies len(dst) elements of src to dst.
func (d *Device) Copy(dst, src *Tensor) {
	n := dst.Len()
	d.check(dst, n, wgsl.F32, "Copy dst")
	d.check(src, n, wgsl.F32, "Copy src")
	d.flat("copy", n, []*Tensor{dst, src}, u32(n))
}

// Fill sets every element of dst to v.
func (d *Device) Fill(dst *Tensor, v float32) {
	d.check(dst, dst.Len(), wgsl.F32, "Fill")
	d.flat("fill", dst.Len(), []*Tensor{dst}, u32(dst.Len()), f32bits(v))
}

// Zero sets every element of dst to 0 (gradients before a step).
func (d *Device) Zero(dst *Tensor) { d.Fill(dst, 0) }

// BiasAdd adds bias (C) to every row of out (N,C): the bias half of LinearForward.
func (d *Device) BiasAdd(out, bias *Tensor, N, C int) {
	d.check(out, N*C, wgsl.F32, "BiasAdd out")
	d.check(bias, C, wgsl.F32, "BiasAdd bias")
	d.flat("bias_add", N*C, []*Tensor{out, bias}, u32(N), u32(C))
}

// BiasGrad accumulates the column sums of dout (N,C) into db (C): the bias half of
// LinearBackward. Each column is summed in chunks of wgsl.ColumnChunk rows, in row order, and the
// chunk sums in a fixed pairwise tree (bias_grad, colsum_tree): deterministic, but not the Go
// reference's order (see devcheck.TolSum).
func (d *Device) BiasGrad(db, dout *Tensor, N, C int) {
	d.check(db, C, wgsl.F32, "BiasGrad db")
	d.check(dout, N*C, wgsl.F32, "BiasGrad dout")
	if N == 0 || C == 0 {
		return
	}
	chunks := columnChunks(N)
	parts := d.scratchTensor(&d.scratchCols, chunks*C)
	d.flat("bias_grad", chunks*C, []*Tensor{parts, dout}, u32(N), u32(C))
	d.flat("colsum_tree", C, []*Tensor{db, parts}, u32(chunks), u32(C))
}

// SumSquaresPartials is the number of partial sums SumSquares writes for n elements.
func SumSquaresPartials(n int) int { return (n + wgsl.SumSquaresChunk - 1) / wgsl.SumSquaresChunk }

// SumSquares writes the partial sums of squares of x to partials (SumSquaresPartials(len(x))
// elements), one per chunk of wgsl.SumSquaresChunk elements in a fixed reduction order. Add them
// in float64 in order for ‖x‖²; SquaredNorms does it for a list of tensors with one read.
func (d *Device) SumSquares(partials, x *Tensor) {
	n := x.Len()
	chunks := SumSquaresPartials(n)
	d.check(partials, chunks, wgsl.F32, "SumSquares partials")
	d.check(x, n, wgsl.F32, "SumSquares x")
	gx, gy := d.grid(chunks)
	d.dispatch("sumsq", []*Tensor{partials, x}, []uint32{u32(n)}, gx, gy, 1)
}

// SquaredNorms returns ‖x‖² of each tensor, in float64 (the per-tensor ‖g‖² partial sums of
// docs/design.md, "A training step"): one dispatch per tensor into a device-owned scratch and one read for all of them. It
// waits for the GPU (see the package doc).
func (d *Device) SquaredNorms(xs ...*Tensor) ([]float64, error) {
	out, _, err := d.SquaredNormsWith(nil, xs...)
	return out, err
}

// SquaredNormsWith is SquaredNorms that also returns also's contents, read in the same wait: also
// is copied behind the partial sums, and one read brings both back.
func (d *Device) SquaredNormsWith(also *Tensor, xs ...*Tensor) ([]float64, []float32, error) {
	total := 0
	for _, x := range xs {
		total += SumSquaresPartials(x.Len())
	}
	extra := 0
	if also != nil {
		extra = also.Len()
	}
	out := make([]float64, len(xs))
	if total+extra == 0 {
		return out, nil, nil
	}
	parts := d.scratchTensor(&d.scratchNorms, total+extra)
	off := 0
	for _, x := range xs {
		c := SumSquaresPartials(x.Len())
		d.SumSquares(parts.Slice(off, c), x)
		off += c
	}
	if extra > 0 {
		d.Copy(parts.Slice(total, extra), also)
	}
	p, err := d.Read(parts)
	if err != nil {
		return nil, nil, err
	}
	off = 0
	for i, x := range xs {
		c := SumSquaresPartials(x.Len())
		for _, v := range p[off : off+c] {
			out[i] += float64(v)
		}
		off += c
	}
	return out, p[total : total+extra], nil
}

// An MoE block's routing where its tensors are (kernels/moe.go): E experts per row, E small.

// TopKGate writes gate and mask (N,E) from the router probabilities probs (N,E): for each row,
// the probability and a 1 for its K most probable experts (ties to the lower index), 0 for the
// others. Exact: comparisons and copies.
func (d *Device) TopKGate(gate, mask, probs *Tensor, N, E, K int) {
	d.check(gate, N*E, wgsl.F32, "TopKGate gate")
	d.check(mask, N*E, wgsl.F32, "TopKGate mask")
	d.check(probs, N*E, wgsl.F32, "TopKGate probs")
	if K < 0 || K > E {
		panic(fmt.Sprintf("webgpu: TopKGate: top %d of %d experts", K, E))
	}
	d.flat("topk_gate", N, []*Tensor{gate, mask, probs}, u32(N), u32(E), u32(K))
}

// GateRows sets dst (N,C) to src (N,C) with row r scaled by gate[r,e] (gate (N,E)), or adds that
// to dst with acc.
func (d *Device) GateRows(dst, src, gate *Tensor, e, N, C, E int, acc bool) {
	d.check(dst, N*C, wgsl.F32, "GateRows dst")
	d.check(src, N*C, wgsl.F32, "GateRows src")
	d.check(gate, N*E, wgsl.F32, "GateRows gate")
	checkExpert("GateRows", e, E)
	d.flat("gate_rows", N*C, []*Tensor{dst, src, gate}, u32(N), u32(C), u32(e), u32(E), uint32(btoi(acc)))
}

// GateGrad writes column e of dgate (N,E): Σ_c dout[r,c]·y[r,c] (in c order) for the rows routed to
// expert e (mask[r,e] ≠ 0), 0 for the others; the other columns are left unchanged.
func (d *Device) GateGrad(dgate, dout, y, mask *Tensor, e, N, C, E int) {
	d.check(dgate, N*E, wgsl.F32, "GateGrad dgate")
	d.check(dout, N*C, wgsl.F32, "GateGrad dout")
	d.check(y, N*C, wgsl.F32, "GateGrad y")
	d.check(mask, N*E, wgsl.F32, "GateGrad mask")
	checkExpert("GateGrad", e, E)
	d.flat("gate_grad", N, []*Tensor{dgate, dout, y, mask}, u32(N), u32(C), u32(e), u32(E))
}

// MoEStats writes stats (E+1): the assignments to each expert (Σ_r mask[r,e], exact) and the
// balancing loss E·Σ_e f_e·P_e, summed in float32 in a fixed order by one workgroup (moe_stats;
// see tolMoEStats) where the Go reference sums in float64.
func (d *Device) MoEStats(stats, mask, probs *Tensor, N, E, K int) {
	d.check(stats, E+1, wgsl.F32, "MoEStats stats")
	d.check(mask, N*E, wgsl.F32, "MoEStats mask")
	d.check(probs, N*E, wgsl.F32, "MoEStats probs")
	if N*K >= 1<<24 {
		panic(fmt.Sprintf("webgpu: MoEStats: N·K = %d is not exact in float32", N*K))
	}
	d.dispatch("moe_stats", []*Tensor{stats, mask, probs}, []uint32{u32(N), u32(E), u32(K)}, 1, 1, 1)
}

// AuxGrad adds the balancing loss's gradient, scale·E·f_e/N with f_e = stats[e]/(N·K), to every
// row of dgate (N,E).
func (d *Device) AuxGrad(dgate, stats *Tensor, N, E, K int, scale float32) {
	d.check(dgate, N*E, wgsl.F32, "AuxGrad dgate")
	d.check(stats, E, wgsl.F32, "AuxGrad stats")
	d.flat("aux_grad", N*E, []*Tensor{dgate, stats}, u32(N), u32(E), u32(K), f32bits(scale))
}

// SoftmaxBackwardRows writes dx = p·(dp − Σ_e p·dp) for each row of the softmax output p (N,E) and
// its gradient dp, the sum one float32 chain in e order.
func (d *Device) SoftmaxBackwardRows(dx, p, dp *Tensor, N, E int) {
	d.check(dx, N*E, wgsl.F32, "SoftmaxBackwardRows dx")
	d.check(p, N*E, wgsl.F32, "SoftmaxBackwardRows p")
	d.check(dp, N*E, wgsl.F32, "SoftmaxBackwardRows dp")
	d.flat("softmax_backward_rows", N, []*Tensor{dx, p, dp}, u32(N), u32(E))
}

func checkExpert(op string, e, E int) {
	if e < 0 || e >= E {
		panic(fmt.Sprintf("webgpu: %s: expert %d of %d", op, e, E))
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
