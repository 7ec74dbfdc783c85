package vulkan

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/shoal-ml/shoal/model"
)

// The ops of model.Device, composed from the kernels as wasm/webgpu composes its WGSL ones:
// same arguments, same accumulate-or-overwrite rule as the kernels function of each name, and
// the letters of kernels/layers.go (B batch, T sequence, C channels, V vocab, N rows, H heads,
// E experts). They record commands and return; a wrong shape panics, as an out-of-range slice
// does in the Go kernels.

// bf returns b as this device's buffer, nil for a nil Buf (a Linear without bias), and checks
// that it holds at least n elements of the expected type.
func bf(b model.Buf, n int, i32 bool, what string) *buffer {
	if b == nil {
		return nil
	}
	v, ok := b.(*buffer)
	if !ok {
		panic(fmt.Sprintf("vulkan: %s: a %T is not a buffer of this device", what, b))
	}
	if v.n < n || v.a.i32 != i32 {
		panic(fmt.Sprintf("vulkan: %s: %d elements (int32 %v), want %d (int32 %v)", what, v.n, v.a.i32, n, i32))
	}
	if v.a.freed {
		panic(fmt.Sprintf("vulkan: %s: buffer used after Free", what))
	}
	return v
}

// f32 is a float32's bits for a push constant.
func f32(v float32) uint32 { return math.Float32bits(v) }

// lock takes the device for one op; the returned bool is false when an earlier error has
// disabled it.
func (d *Device) lock() bool {
	d.mu.Lock()
	d.flushAdam() // every op comes after the AdamW calls before it
	return d.err == nil
}

// view returns elements [off, off+n) of b (no lock needed: it touches no device state).
func view(b *buffer, off, n int) *buffer { return &buffer{a: b.a, off: b.off + off, n: n} }

// scratchBuf returns a device-owned buffer of n elements for name, grown when needed. Ops run
// in order and the hazard tracking orders a reuse after the reads of the last use, so one
// scratch per purpose serves every op.
func (d *Device) scratchBuf(name string, n int) *buffer {
	s := d.scratch[name]
	if s == nil || s.n < n {
		if s != nil {
			d.free(s)
		}
		s = d.allocLocked(max(n, 1024), false)
		d.scratch[name] = s
	}
	return view(s, 0, n)
}

// Write copies host src into dst after the ops already queued: src is staged in the mapped
// staging buffer at once (so the caller may reuse it) and copied in the command stream.
func (d *Device) Write(dst model.Buf, src []float32) {
	b := bf(dst, len(src), false, "Write")
	if b.n != len(src) {
		panic(fmt.Sprintf("vulkan: write of %d floats into a buffer of %d", len(src), b.n))
	}
	d.write(b, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(src))), 4*len(src)))
}

// WriteInt32 is Write for an int32 buffer.
func (d *Device) WriteInt32(dst model.Buf, src []int32) {
	b := bf(dst, len(src), true, "WriteInt32")
	if b.n != len(src) {
		panic(fmt.Sprintf("vulkan: write of %d int32 into a buffer of %d", len(src), b.n))
	}
	d.write(b, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(src))), 4*len(src)))
}

func (d *Device) write(b *buffer, src []byte) {
	defer d.mu.Unlock()
	if d.lock() {
		d.writeLocked(b, src)
	}
}

// writeLocked stages src and copies it into b in the command stream; the caller holds d.mu.
func (d *Device) writeLocked(b *buffer, src []byte) {
	if len(src) == 0 {
		return
	}
	off := d.stage(int64(len(src)))
	if off < 0 {
		return
	}
	copy(unsafe.Slice((*byte)(unsafe.Add(d.stagingPtr, off)), len(src)), src)
	r := b.byteRange()
	d.access(nil, []span3{r})
	region := &bufferCopy{srcOffset: uint64(off), dstOffset: uint64(r.lo), size: uint64(len(src))}
	call(d.fn.CmdCopyBuffer, uintptr(d.cmdBuf()), uintptr(d.staging.buf), uintptr(r.buf), 1, uintptr(unsafe.Pointer(region)))
}

// Read copies src into host dst once every op queued before it has run: it submits the batch
// and waits. After a device error dst is zeroed.
func (d *Device) Read(dst []float32, src model.Buf) {
	b := bf(src, len(dst), false, "Read")
	if b.n != len(dst) {
		panic(fmt.Sprintf("vulkan: read of %d floats from a buffer of %d", len(dst), b.n))
	}
	defer d.mu.Unlock()
	d.lock()
	d.read(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(dst))), 4*len(dst)), b)
}

func (d *Device) read(dst []byte, b *buffer) {
	if d.err != nil {
		clear(dst)
		return
	}
	off := int64(-1)
	if len(dst) > 0 {
		off = d.stage(int64(len(dst)))
	}
	if off >= 0 {
		r := b.byteRange()
		d.access([]span3{r}, nil)
		region := &bufferCopy{srcOffset: uint64(r.lo), dstOffset: uint64(off), size: uint64(len(dst))}
		call(d.fn.CmdCopyBuffer, uintptr(d.cmdBuf()), uintptr(r.buf), uintptr(d.staging.buf), 1, uintptr(unsafe.Pointer(region)))
	}
	d.submit()
	if d.err != nil || off < 0 {
		clear(dst)
		return
	}
	copy(dst, unsafe.Slice((*byte)(unsafe.Add(d.stagingPtr, off)), len(dst)))
}

// Zero clears b (a fill in the command stream).
func (d *Device) Zero(b model.Buf) {
	v := bf(b, 0, b.(*buffer).a.i32, "Zero")
	defer d.mu.Unlock()
	if !d.lock() || v.n == 0 {
		return
	}
	d.zero(v)
}

func (d *Device) zero(v *buffer) {
	r := v.byteRange()
	d.access(nil, []span3{r})
	call(d.fn.CmdFillBuffer, uintptr(d.cmdBuf()), uintptr(r.buf), uintptr(r.lo), uintptr(r.hi-r.lo), 0)
}

// Copy sets dst = src (a copy in the command stream).
func (d *Device) Copy(dst, src model.Buf) {
	o := bf(dst, 0, false, "Copy dst")
	s := bf(src, o.n, false, "Copy src")
	defer d.mu.Unlock()
	if d.lock() {
		d.copyLocked(o, s)
	}
}

// copyLocked copies src into dst (as many elements) in the command stream; the caller holds d.mu.
func (d *Device) copyLocked(dst, src *buffer) {
	if dst.n == 0 {
		return
	}
	ro, rs := dst.byteRange(), src.byteRange()
	d.access([]span3{rs}, []span3{ro})
	region := &bufferCopy{srcOffset: uint64(rs.lo), dstOffset: uint64(ro.lo), size: uint64(ro.hi - ro.lo)}
	call(d.fn.CmdCopyBuffer, uintptr(d.cmdBuf()), uintptr(rs.buf), uintptr(ro.buf), 1, uintptr(unsafe.Pointer(region)))
}

// Add sets dst += src element by element.
func (d *Device) Add(dst, src model.Buf) {
	o := bf(dst, 0, false, "Add dst")
	s := bf(src, o.n, false, "Add src")
	defer d.mu.Unlock()
	if d.lock() {
		d.flat("add_inplace", o.n, []arg{out(o), in(s)}, o.elem(), s.elem(), u32(o.n))
	}
}

func u32(n int) uint32 {
	if n < 0 || n > math.MaxUint32 {
		panic(fmt.Sprintf("vulkan: %d does not fit a kernel's uint", n))
	}
	return uint32(n)
}

// gemm is one (batched, strided) multiply for the matmul kernels: matrix z of the batch,
// z = outer·inner + in, starts s*[0]·outer + s*[1]·in elements into each operand's view.
type gemm struct {
	c, a, b       *buffer
	m, k, n       int
	ldc, lda, ldb int
	acc           bool
	batch, inner  int
	sc, sa, sb    [2]int
}

const tileM, tileN = 64, 64 // matmul.comp's BM, BN

func (d *Device) gemm(kernel string, g gemm) {
	if g.m == 0 || g.n == 0 || g.batch == 0 {
		return
	}
	if g.k == 0 {
		// An empty sum: c = 0, or c unchanged with acc (dense products only reach here).
		if !g.acc {
			d.zero(view(g.c, 0, g.m*g.n))
		}
		return
	}
	if g.batch > maxGroups {
		panic(fmt.Sprintf("vulkan: %s: a batch of %d products, at most %d", kernel, g.batch, maxGroups))
	}
	acc := uint32(0)
	if g.acc {
		acc = 1
	}
	d.dispatch(kernel, []arg{out(g.c), in(g.a), in(g.b)}, []uint32{
		g.c.elem(), g.a.elem(), g.b.elem(), u32(g.m), u32(g.k), u32(g.n), u32(g.ldc), u32(g.lda), u32(g.ldb), acc,
		u32(g.inner), u32(g.sc[0]), u32(g.sc[1]), u32(g.sa[0]), u32(g.sa[1]), u32(g.sb[0]), u32(g.sb[1]),
	}, (g.n+tileN-1)/tileN, (g.m+tileM-1)/tileM, g.batch)
}

// MatMulNN computes c (m×n) = a (m×k) · b (k×n); with acc it adds to c (kernels.MatMulNN).
func (d *Device) MatMulNN(c, a, b model.Buf, m, k, n int, acc bool) {
	g := gemm{c: bf(c, m*n, false, "MatMulNN c"), a: bf(a, m*k, false, "MatMulNN a"), b: bf(b, k*n, false, "MatMulNN b"),
		m: m, k: k, n: n, ldc: n, lda: k, ldb: n, acc: acc, batch: 1, inner: 1}
	defer d.mu.Unlock()
	if d.lock() {
		d.gemm("matmul_nn", g)
	}
}

// MatMulNT computes c (m×n) = a (m×k) · bᵀ where b is (n×k); with acc it adds to c.
func (d *Device) MatMulNT(c, a, b model.Buf, m, k, n int, acc bool) {
	g := gemm{c: bf(c, m*n, false, "MatMulNT c"), a: bf(a, m*k, false, "MatMulNT a"), b: bf(b, n*k, false, "MatMulNT b"),
		m: m, k: k, n: n, ldc: n, lda: k, ldb: k, acc: acc, batch: 1, inner: 1}
	defer d.mu.Unlock()
	if d.lock() {
		d.gemm("matmul_nt", g)
	}
}

// MatMulTN computes c (m×n) = aᵀ · b where a is (k×m) and b (k×n); with acc it adds to c.
func (d *Device) MatMulTN(c, a, b model.Buf, m, k, n int, acc bool) {
	g := gemm{c: bf(c, m*n, false, "MatMulTN c"), a: bf(a, k*m, false, "MatMulTN a"), b: bf(b, k*n, false, "MatMulTN b"),
		m: m, k: k, n: n, ldc: n, lda: m, ldb: n, acc: acc, batch: 1, inner: 1}
	defer d.mu.Unlock()
	if d.lock() {
		d.gemm("matmul_tn", g)
	}
}

// EncoderForward: out (B,T,C) = wte[inp] + wpe[t].
func (d *Device) EncoderForward(out_, inp, wte, wpe model.Buf, B, T, C int) {
	N := B * T
	o, i := bf(out_, N*C, false, "EncoderForward out"), bf(inp, N, true, "EncoderForward inp")
	e, p := bf(wte, C, false, "EncoderForward wte"), bf(wpe, T*C, false, "EncoderForward wpe")
	defer d.mu.Unlock()
	if d.lock() {
		d.flat("encoder_forward", N*C, []arg{out(o), in(i), in(e), in(p)}, o.elem(), i.elem(), e.elem(), p.elem(), u32(N), u32(T), u32(C))
	}
}

// EncoderBackward accumulates dwte and dwpe from dout (B,T,C), rows in order.
func (d *Device) EncoderBackward(dwte, dwpe, dout, inp model.Buf, B, T, C int) {
	N := B * T
	e, p := bf(dwte, C, false, "EncoderBackward dwte"), bf(dwpe, T*C, false, "EncoderBackward dwpe")
	g, i := bf(dout, N*C, false, "EncoderBackward dout"), bf(inp, N, true, "EncoderBackward inp")
	defer d.mu.Unlock()
	if !d.lock() || N == 0 {
		return
	}
	d.flat("encoder_backward_wpe", T*C, []arg{out(p), in(g)}, p.elem(), g.elem(), u32(B), u32(T), u32(C))
	d.flat("encoder_backward_wte", C, []arg{out(e), in(g), in(i)}, e.elem(), g.elem(), i.elem(), u32(N), u32(C))
}

// LayerNormForward normalises each of N rows of inp (N,C), keeping mean and rstd (N).
func (d *Device) LayerNormForward(out_, mean, rstd, inp, w, b model.Buf, N, C int) {
	o, m, r := bf(out_, N*C, false, "LayerNormForward out"), bf(mean, N, false, "LayerNormForward mean"), bf(rstd, N, false, "LayerNormForward rstd")
	x, wt, bs := bf(inp, N*C, false, "LayerNormForward inp"), bf(w, C, false, "LayerNormForward w"), bf(b, C, false, "LayerNormForward b")
	defer d.mu.Unlock()
	if d.lock() {
		d.rows("layernorm_forward", N, []arg{out(o), out(m), out(r), in(x), in(wt), in(bs)},
			o.elem(), m.elem(), r.elem(), x.elem(), wt.elem(), bs.elem(), u32(N), u32(C))
	}
}

// rowsChunk is colsum_partial's and layernorm_params_partial's ROWS_CHUNK.
const rowsChunk = 32

// LayerNormBackward accumulates dinp, dw and db.
func (d *Device) LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd model.Buf, N, C int) {
	di, gw, gb := bf(dinp, N*C, false, "LayerNormBackward dinp"), bf(dw, C, false, "LayerNormBackward dw"), bf(db, C, false, "LayerNormBackward db")
	g, x, wt := bf(dout, N*C, false, "LayerNormBackward dout"), bf(inp, N*C, false, "LayerNormBackward inp"), bf(w, C, false, "LayerNormBackward w")
	m, r := bf(mean, N, false, "LayerNormBackward mean"), bf(rstd, N, false, "LayerNormBackward rstd")
	defer d.mu.Unlock()
	if !d.lock() || N == 0 || C == 0 {
		return
	}
	d.rows("layernorm_backward_input", N, []arg{out(di), in(g), in(x), in(wt), in(m), in(r)},
		di.elem(), g.elem(), x.elem(), wt.elem(), m.elem(), r.elem(), u32(N), u32(C))
	chunks := (N + rowsChunk - 1) / rowsChunk
	part := gw // unused with one chunk: the kernel writes dw and db directly
	if chunks > 1 {
		part = d.scratchBuf("colsum", 2*chunks*C)
	}
	pw, pb := part.elem(), part.elem()+u32(chunks*C)
	d.flat("layernorm_params_partial", chunks*C, []arg{out(gw), out(gb), out(part), in(g), in(x), in(m), in(r)},
		gw.elem(), gb.elem(), pw, pb, g.elem(), x.elem(), m.elem(), r.elem(), u32(N), u32(C), u32(chunks))
	if chunks > 1 {
		d.flat("colsum_combine", C, []arg{out(gw), in(view(part, 0, chunks*C))}, gw.elem(), pw, u32(C), u32(chunks))
		d.flat("colsum_combine", C, []arg{out(gb), in(view(part, chunks*C, chunks*C))}, gb.elem(), pb, u32(C), u32(chunks))
	}
}

// LinearForward: out (N,OUT) = inp (N,IN) · wᵀ + bias, w (OUT,IN); bias may be nil.
func (d *Device) LinearForward(out_, inp, w, bias model.Buf, N, IN, OUT int) {
	o := bf(out_, N*OUT, false, "LinearForward out")
	g := gemm{c: o, a: bf(inp, N*IN, false, "LinearForward inp"), b: bf(w, OUT*IN, false, "LinearForward w"),
		m: N, k: IN, n: OUT, ldc: OUT, lda: IN, ldb: IN, batch: 1, inner: 1}
	bs := bf(bias, OUT, false, "LinearForward bias")
	defer d.mu.Unlock()
	if !d.lock() {
		return
	}
	d.gemm("matmul_nt", g)
	if bs != nil && N*OUT > 0 {
		d.flat("bias_add", N*OUT, []arg{out(o), in(bs)}, o.elem(), bs.elem(), u32(N), u32(OUT))
	}
}

// LinearBackward accumulates dw (and db when non-nil) and writes dinp (overwriting it unless
// accIn).
func (d *Device) LinearBackward(dinp, dw, db, dout, inp, w model.Buf, N, IN, OUT int, accIn bool) {
	g := bf(dout, N*OUT, false, "LinearBackward dout")
	x, wt := bf(inp, N*IN, false, "LinearBackward inp"), bf(w, OUT*IN, false, "LinearBackward w")
	gw := bf(dw, OUT*IN, false, "LinearBackward dw")
	gb := bf(db, OUT, false, "LinearBackward db")
	di := bf(dinp, N*IN, false, "LinearBackward dinp")
	defer d.mu.Unlock()
	if !d.lock() {
		return
	}
	if di != nil {
		d.gemm("matmul_nn", gemm{c: di, a: g, b: wt, m: N, k: OUT, n: IN, ldc: IN, lda: OUT, ldb: IN, acc: accIn, batch: 1, inner: 1})
	}
	d.gemm("matmul_tn", gemm{c: gw, a: g, b: x, m: OUT, k: N, n: IN, ldc: IN, lda: OUT, ldb: IN, acc: true, batch: 1, inner: 1})
	if gb != nil && N > 0 && OUT > 0 {
		d.colsum(gb, g, N, OUT)
	}
}

// colsum accumulates the column sums of x (N,C) into db (C): colsum_partial over fixed chunks
// of rows, then colsum_combine in chunk order when there is more than one.
func (d *Device) colsum(db, x *buffer, N, C int) {
	chunks := (N + rowsChunk - 1) / rowsChunk
	part := db
	if chunks > 1 {
		part = d.scratchBuf("colsum", chunks*C)
	}
	d.flat("colsum_partial", chunks*C, []arg{out(db), out(part), in(x)}, db.elem(), part.elem(), x.elem(), u32(N), u32(C), u32(chunks))
	if chunks > 1 {
		d.flat("colsum_combine", C, []arg{out(db), in(part)}, db.elem(), part.elem(), u32(C), u32(chunks))
	}
}

func attentionShapes(what string, B, T, C, H int) (hs int, scale float32) {
	if H <= 0 || C%H != 0 {
		panic(fmt.Sprintf("vulkan: %s: %d channels do not split into %d heads", what, C, H))
	}
	hs = C / H
	return hs, float32(1 / math.Sqrt(float64(hs)))
}

// AttentionForward: causal multi-head attention over qkv (B,T,3C) laid out q|k|v, writing the
// head outputs to out (B,T,C) and the softmax probabilities to att (B,H,T,T), whose masked upper
// triangle is exactly zero. As in the Go reference each (batch, head) is S = Q·Kᵀ,
// P = causal softmax(S/√hs), O = P·V; the batched multiplies read q, k and v where they lie in
// qkv, so nothing is gathered.
func (d *Device) AttentionForward(out_, att, qkv model.Buf, B, T, C, H int) {
	hs, scale := attentionShapes("AttentionForward", B, T, C, H)
	o, p, x := bf(out_, B*T*C, false, "AttentionForward out"), bf(att, B*H*T*T, false, "AttentionForward att"), bf(qkv, B*T*3*C, false, "AttentionForward qkv")
	defer d.mu.Unlock()
	if !d.lock() || B*T == 0 || C == 0 {
		return
	}
	n := B * T * 3 * C
	q, k, v := view(x, 0, n), view(x, C, n-C), view(x, 2*C, n-2*C)
	p = view(p, 0, B*H*T*T)
	head := [2]int{T * 3 * C, hs} // (batch, head) strides of q, k, v in qkv
	d.gemm("matmul_nt", gemm{c: p, a: q, b: k, m: T, k: hs, n: T, ldc: T, lda: 3 * C, ldb: 3 * C,
		batch: B * H, inner: H, sc: [2]int{H * T * T, T * T}, sa: head, sb: head})
	d.rows("attention_softmax", B*H*T, []arg{out(p)}, p.elem(), u32(B*H*T), u32(T), f32(scale))
	d.gemm("matmul_nn", gemm{c: view(o, 0, B*T*C), a: p, b: v, m: T, k: T, n: hs, ldc: C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: [2]int{T * C, hs}, sa: [2]int{H * T * T, T * T}, sb: head})
}

// AttentionBackward writes dqkv (B,T,3C) (overwriting it) from dout (B,T,C):
// dP = dO·Vᵀ, dV = Pᵀ·dO, dS = P∘(dP − rowsum(P∘dP))·scale, dQ = dS·K, dK = dSᵀ·Q,
// with dP and dS in a device-owned scratch of B·H·T·T.
func (d *Device) AttentionBackward(dqkv, dout, qkv, att model.Buf, B, T, C, H int) {
	hs, scale := attentionShapes("AttentionBackward", B, T, C, H)
	dx, g := bf(dqkv, B*T*3*C, false, "AttentionBackward dqkv"), bf(dout, B*T*C, false, "AttentionBackward dout")
	x, p := bf(qkv, B*T*3*C, false, "AttentionBackward qkv"), bf(att, B*H*T*T, false, "AttentionBackward att")
	defer d.mu.Unlock()
	if !d.lock() || B*T == 0 || C == 0 {
		return
	}
	n := B * T * 3 * C
	ds := d.scratchBuf("attention", B*H*T*T)
	p, g = view(p, 0, B*H*T*T), view(g, 0, B*T*C)
	q, k, v := view(x, 0, n), view(x, C, n-C), view(x, 2*C, n-2*C)
	dq, dk, dv := view(dx, 0, n), view(dx, C, n-C), view(dx, 2*C, n-2*C)
	head := [2]int{T * 3 * C, hs}
	outHead := [2]int{T * C, hs}
	square := [2]int{H * T * T, T * T}
	d.gemm("matmul_nt", gemm{c: ds, a: g, b: v, m: T, k: hs, n: T, ldc: T, lda: C, ldb: 3 * C,
		batch: B * H, inner: H, sc: square, sa: outHead, sb: head})
	d.gemm("matmul_tn", gemm{c: dv, a: p, b: g, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: C,
		batch: B * H, inner: H, sc: head, sa: square, sb: outHead})
	d.rows("attention_softmax_backward", B*H*T, []arg{out(ds), in(p)}, ds.elem(), p.elem(), u32(B*H*T), u32(T), f32(scale))
	d.gemm("matmul_nn", gemm{c: dq, a: ds, b: k, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: head, sa: square, sb: head})
	d.gemm("matmul_tn", gemm{c: dk, a: ds, b: q, m: T, k: T, n: hs, ldc: 3 * C, lda: T, ldb: 3 * C,
		batch: B * H, inner: H, sc: head, sa: square, sb: head})
}

// GELUForward writes GELU(inp) to out and the tanh of each input to th.
func (d *Device) GELUForward(out_, th, inp model.Buf) {
	x := bf(inp, 0, false, "GELUForward inp")
	o, t := bf(out_, x.n, false, "GELUForward out"), bf(th, x.n, false, "GELUForward th")
	defer d.mu.Unlock()
	if d.lock() {
		d.flat("gelu_forward", x.n, []arg{out(o), out(t), in(x)}, o.elem(), t.elem(), x.elem(), u32(x.n))
	}
}

// GELUBackward writes dinp (overwriting it) from the forward's inputs and tanh.
func (d *Device) GELUBackward(dinp, inp, th, dout model.Buf) {
	x := bf(inp, 0, false, "GELUBackward inp")
	di, t, g := bf(dinp, x.n, false, "GELUBackward dinp"), bf(th, x.n, false, "GELUBackward th"), bf(dout, x.n, false, "GELUBackward dout")
	defer d.mu.Unlock()
	if d.lock() {
		d.flat("gelu_backward", x.n, []arg{out(di), in(x), in(t), in(g)}, di.elem(), x.elem(), t.elem(), g.elem(), u32(x.n))
	}
}

// CrossEntropyForward returns the mean over N rows of −log softmax(logits)[target]: the rows'
// losses on the device, then one read and their mean in float64 in row order, as the Go
// reference. It waits like Read.
func (d *Device) CrossEntropyForward(logits, targets model.Buf, N, V int) float64 {
	l, t := bf(logits, N*V, false, "CrossEntropyForward logits"), bf(targets, N, true, "CrossEntropyForward targets")
	defer d.mu.Unlock()
	if !d.lock() || N == 0 {
		return 0
	}
	losses := d.scratchBuf("losses", N)
	d.rows("crossentropy_forward", N, []arg{out(losses), in(l), in(t)}, losses.elem(), l.elem(), t.elem(), u32(N), u32(V))
	h := make([]float32, N)
	d.read(unsafe.Slice((*byte)(unsafe.Pointer(&h[0])), 4*N), losses)
	var s float64
	for _, v := range h {
		s += float64(v)
	}
	return s / float64(N)
}

// CrossEntropyRows writes each row's loss to losses (N) without waiting: CrossEntropyForward's
// rows, which the caller sums in float64 in row order after the step's one read.
func (d *Device) CrossEntropyRows(losses, logits, targets model.Buf, N, V int) {
	o := bf(losses, N, false, "CrossEntropyRows losses")
	l, t := bf(logits, N*V, false, "CrossEntropyRows logits"), bf(targets, N, true, "CrossEntropyRows targets")
	defer d.mu.Unlock()
	if d.lock() && N > 0 {
		d.rows("crossentropy_forward", N, []arg{out(o), in(l), in(t)}, o.elem(), l.elem(), t.elem(), u32(N), u32(V))
	}
}

// CrossEntropyBackward turns logits (N,V) into their gradient in place: scale·(softmax − onehot)/N.
func (d *Device) CrossEntropyBackward(logits, targets model.Buf, N, V int, scale float32) {
	l, t := bf(logits, N*V, false, "CrossEntropyBackward logits"), bf(targets, N, true, "CrossEntropyBackward targets")
	defer d.mu.Unlock()
	if d.lock() {
		d.rows("crossentropy_backward", N, []arg{out(l), in(t)}, l.elem(), t.elem(), u32(N), u32(V), f32(scale))
	}
}

// SoftmaxRows normalises each row of x (N,E) in place.
func (d *Device) SoftmaxRows(x model.Buf, N, E int) {
	v := bf(x, N*E, false, "SoftmaxRows")
	defer d.mu.Unlock()
	if d.lock() && E > 0 {
		d.rows("softmax_rows", N, []arg{out(v)}, v.elem(), u32(N), u32(E))
	}
}

// AdamW applies one AdamW update to w (all its elements) in place, as kernels.AdamW, in one
// dispatch however long w is: a caller that passes a shard's slab updates it all at once.
// sqrtBC2 is rounded to float32 on the device.
//
// A shard's update is one AdamW call per tensor (model.Shard.Apply), over consecutive views of its
// four slabs: calls that continue the pending run — the same slabs, the next elements, the same
// step — join it, and the run is dispatched as one (adamw_slab.comp) when anything else touches
// the device: one dispatch per shard, as issue 15 asks, with each element's adamw bits.
func (d *Device) AdamW(w, g, m, v model.Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	ww := bf(w, 0, false, "AdamW w")
	gg, mm, vv := bf(g, ww.n, false, "AdamW g"), bf(m, ww.n, false, "AdamW m"), bf(v, ww.n, false, "AdamW v")
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		return
	}
	a := &d.adam
	if a.n > 0 && !(follows(a.w, a.n, ww) && follows(a.g, a.n, gg) && follows(a.m, a.n, mm) && follows(a.v, a.n, vv) &&
		a.stepSize == stepSize && a.sqrtBC2 == sqrtBC2 && a.gradScale == gradScale && (decay == 1 || a.decay == 1 || a.decay == decay)) {
		d.flushAdam()
	}
	if a.n == 0 {
		*a = adamRun{w: ww, g: gg, m: mm, v: vv, segs: a.segs[:0], decay: 1, stepSize: stepSize, sqrtBC2: sqrtBC2, gradScale: gradScale}
	}
	if decay != 1 {
		a.decay = decay
	}
	a.segs = append(a.segs, adamSeg{n: ww.n, decays: decay != 1})
	a.n += ww.n
}

// adamRun is AdamW calls over consecutive views of the same four buffers, waiting to be
// dispatched as one: segs are the tensors in order, decay the decay of those that decay.
type adamRun struct {
	w, g, m, v                 *buffer // the first call's views
	n                          int     // elements so far
	segs                       []adamSeg
	decay, stepSize, gradScale float32
	sqrtBC2                    float64
}

type adamSeg struct {
	n      int
	decays bool
}

// follows reports whether x starts where the n elements from start end, in the same allocation.
func follows(start *buffer, n int, x *buffer) bool { return x.a == start.a && x.off == start.off+n }

// flushAdam dispatches the pending AdamW run, if any: adamw for one tensor, else adamw_slab with
// its segment table (staged like a Write, in the command stream). The caller holds d.mu.
func (d *Device) flushAdam() {
	a := &d.adam
	if a.n == 0 {
		return
	}
	defer func() { a.n, a.segs = 0, a.segs[:0] }()
	if d.err != nil {
		return
	}
	d.adamDispatch++
	if len(a.segs) == 1 {
		d.flat("adamw", a.n, []arg{out(a.w), in(a.g), out(a.m), out(a.v)}, a.w.elem(), a.g.elem(), a.m.elem(), a.v.elem(), u32(a.n),
			f32(a.decay), f32(a.stepSize), f32(float32(a.sqrtBC2)), f32(a.gradScale))
		return
	}
	table := make([]float32, 0, 2*len(a.segs))
	end := 0
	for _, s := range a.segs {
		end += s.n
		dec := uint32(0)
		if s.decays {
			dec = 1
		}
		table = append(table, math.Float32frombits(uint32(end)), math.Float32frombits(dec))
	}
	segs := d.scratchBuf("adamw_segs", len(table))
	d.writeLocked(segs, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(table))), 4*len(table)))
	if d.err != nil {
		return
	}
	w, g, m, v := view(a.w, 0, a.n), view(a.g, 0, a.n), view(a.m, 0, a.n), view(a.v, 0, a.n)
	d.flat("adamw_slab", a.n, []arg{out(w), in(g), out(m), out(v), in(segs)}, w.elem(), g.elem(), m.elem(), v.elem(), segs.elem(),
		u32(a.n), u32(len(a.segs)), f32(a.decay), f32(a.stepSize), f32(float32(a.sqrtBC2)), f32(a.gradScale))
}

// sumsqChunk is sumsq.comp's SUMSQ_CHUNK.
const sumsqChunk = 4096

// SquaredNorms returns Σx² of each buffer in float64: per tensor, float32 partial sums over fixed
// chunks (one dispatch per tensor, all independent, into one scratch), then one read and the
// partials added in float64 in order. It waits like Read.
func (d *Device) SquaredNorms(bufs []model.Buf) []float64 { return d.SquaredNormsWith(bufs, nil, nil) }

// SquaredNormsWith is SquaredNorms that also reads also into alsoDst in the same wait: also is
// copied behind the partial sums, and the one read brings both back.
func (d *Device) SquaredNormsWith(bufs []model.Buf, also model.Buf, alsoDst []float32) []float64 {
	xs := make([]*buffer, len(bufs))
	total := 0
	for i, b := range bufs {
		xs[i] = bf(b, 0, false, "SquaredNorms")
		total += (xs[i].n + sumsqChunk - 1) / sumsqChunk
	}
	var ab *buffer
	if also != nil {
		ab = bf(also, len(alsoDst), false, "SquaredNormsWith also")
	}
	res := make([]float64, len(bufs))
	extra := len(alsoDst)
	defer d.mu.Unlock()
	if !d.lock() || total+extra == 0 {
		return res
	}
	parts := d.scratchBuf("norms", total+extra)
	off := 0
	for _, x := range xs {
		c := (x.n + sumsqChunk - 1) / sumsqChunk
		if c == 0 {
			continue
		}
		pv := view(parts, off, c)
		gx, gy := grid(c)
		d.dispatch("sumsq", []arg{out(pv), in(x)}, []uint32{pv.elem(), x.elem(), u32(x.n)}, gx, gy, 1)
		off += c
	}
	if extra > 0 {
		d.copyLocked(view(parts, total, extra), ab)
	}
	h := make([]float32, total+extra)
	d.read(unsafe.Slice((*byte)(unsafe.Pointer(&h[0])), 4*(total+extra)), view(parts, 0, total+extra))
	copy(alsoDst, h[total:])
	off = 0
	for i, x := range xs {
		c := (x.n + sumsqChunk - 1) / sumsqChunk
		for _, v := range h[off : off+c] {
			res[i] += float64(v)
		}
		off += c
	}
	return res
}
