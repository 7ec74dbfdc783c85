package kernels

// Layers as forward/backward pairs of flat functions over slices, in the manner of llm.c's
// train_gpt2.c. Letters: B batch, T sequence, C channels, V vocab, N = B·T rows, F hidden.
//
// Every backward *accumulates* into parameter gradients (they are summed over micro-batches in
// micro-batch order) and, unless its doc says otherwise, into the input gradient too, because the
// residual stream adds the gradients of its branches. Reductions over rows run in row order, each
// column's on one goroutine, so the result never depends on the number of threads.

import (
	"math"
	"sort"
	"sync/atomic"
)

const lnEps = 1e-5

// EncoderForward: out (B,T,C) = wte[inp] + wpe[t].
func EncoderForward(out []float32, inp []int32, wte, wpe []float32, B, T, C int) {
	for b := 0; b < B; b++ {
		for t := 0; t < T; t++ {
			o := out[(b*T+t)*C : (b*T+t+1)*C]
			ix := int(inp[b*T+t])
			we, pe := wte[ix*C:(ix+1)*C], wpe[t*C:(t+1)*C]
			for i := range o {
				o[i] = we[i] + pe[i]
			}
		}
	}
}

// EncoderBackward accumulates dwte and dwpe from dout (B,T,C), rows in order.
func EncoderBackward(dwte, dwpe, dout []float32, inp []int32, B, T, C int) {
	for b := 0; b < B; b++ {
		for t := 0; t < T; t++ {
			d := dout[(b*T+t)*C : (b*T+t+1)*C]
			ix := int(inp[b*T+t])
			dwe, dpe := dwte[ix*C:(ix+1)*C], dwpe[t*C:(t+1)*C]
			for i, g := range d {
				dwe[i] += g
				dpe[i] += g
			}
		}
	}
}

// LayerNormForward normalises each of N rows of inp (N,C), keeping mean and rstd (N) for backward.
// Statistics are accumulated in float64: cheap, and it keeps agreement with PyTorch tight.
func LayerNormForward(out, mean, rstd, inp, w, b []float32, N, C int) {
	parallelRange(N, 64, func(lo, hi int) {
		r := lo
		// Four rows at a time: each row's sums are chains of float64 additions, each waiting for
		// the one before; four rows' chains side by side keep the adder busy. Every row's chain
		// is still its own, in order.
		for ; r+4 <= hi; r += 4 {
			x0, x1, x2, x3 := inp[r*C:][:C], inp[(r+1)*C:][:C], inp[(r+2)*C:][:C], inp[(r+3)*C:][:C]
			var s0, s1, s2, s3 float64
			for i := range x0 {
				s0 += float64(x0[i])
				s1 += float64(x1[i])
				s2 += float64(x2[i])
				s3 += float64(x3[i])
			}
			m0, m1, m2, m3 := s0/float64(C), s1/float64(C), s2/float64(C), s3/float64(C)
			var v0, v1, v2, v3 float64
			for i := range x0 {
				d0, d1, d2, d3 := float64(x0[i])-m0, float64(x1[i])-m1, float64(x2[i])-m2, float64(x3[i])-m3
				v0 += d0 * d0
				v1 += d1 * d1
				v2 += d2 * d2
				v3 += d3 * d3
			}
			layerNormRow(out[r*C:][:C], x0, w, b, m0, 1/math.Sqrt(v0/float64(C)+lnEps), &mean[r], &rstd[r])
			layerNormRow(out[(r+1)*C:][:C], x1, w, b, m1, 1/math.Sqrt(v1/float64(C)+lnEps), &mean[r+1], &rstd[r+1])
			layerNormRow(out[(r+2)*C:][:C], x2, w, b, m2, 1/math.Sqrt(v2/float64(C)+lnEps), &mean[r+2], &rstd[r+2])
			layerNormRow(out[(r+3)*C:][:C], x3, w, b, m3, 1/math.Sqrt(v3/float64(C)+lnEps), &mean[r+3], &rstd[r+3])
		}
		for ; r < hi; r++ {
			x := inp[r*C : (r+1)*C]
			var s float64
			for _, v := range x {
				s += float64(v)
			}
			m := s / float64(C)
			var vs float64
			for _, v := range x {
				d := float64(v) - m
				vs += d * d
			}
			layerNormRow(out[r*C:][:C], x, w, b, m, 1/math.Sqrt(vs/float64(C)+lnEps), &mean[r], &rstd[r])
		}
	})
}

// layerNormRow writes one normalised row and its statistics: the vector loop where the CPU has
// one, with the Go loop's operations in its order.
func layerNormRow(o, x, w, b []float32, m, rs float64, mean, rstd *float32) {
	w, b, o = w[:len(x)], b[:len(x)], o[:len(x)]
	for i := lnRowVector(o, x, w, b, m, rs); i < len(x); i++ {
		o[i] = float32((float64(x[i])-m)*rs)*w[i] + b[i]
	}
	*mean, *rstd = float32(m), float32(rs)
}

// LayerNormBackward accumulates dinp, dw and db.
func LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd []float32, N, C int) {
	w = w[:C]
	parallelRange(N, 64, func(lo, hi int) {
		r := lo
		// Four rows at a time: each row's two sums are chains of float64 additions, and four
		// rows' chains side by side keep the adder busy; every chain is still its row's, in order.
		for ; r+4 <= hi; r += 4 {
			var x, d [4][]float32
			var m, rs [4]float32
			for k := range 4 {
				x[k], d[k] = inp[(r+k)*C:][:C], dout[(r+k)*C:][:C]
				m[k], rs[k] = mean[r+k], rstd[r+k]
			}
			x0, x1, x2, x3 := x[0], x[1][:C], x[2][:C], x[3][:C]
			d0, d1, d2, d3 := d[0][:C], d[1][:C], d[2][:C], d[3][:C]
			var dm0, dm1, dm2, dm3, dn0, dn1, dn2, dn3 float64
			for i := range x0 {
				wi := w[i]
				g0, g1, g2, g3 := wi*d0[i], wi*d1[i], wi*d2[i], wi*d3[i]
				dm0 += float64(g0)
				dm1 += float64(g1)
				dm2 += float64(g2)
				dm3 += float64(g3)
				dn0 += float64(g0 * ((x0[i] - m[0]) * rs[0]))
				dn1 += float64(g1 * ((x1[i] - m[1]) * rs[1]))
				dn2 += float64(g2 * ((x2[i] - m[2]) * rs[2]))
				dn3 += float64(g3 * ((x3[i] - m[3]) * rs[3]))
			}
			dms := [4]float64{dm0, dm1, dm2, dm3}
			dns := [4]float64{dn0, dn1, dn2, dn3}
			for k := range 4 {
				layerNormDx(dinp[(r+k)*C:][:C], x[k], w, d[k], m[k], rs[k], float32(dms[k]/float64(C)), float32(dns[k]/float64(C)))
			}
		}
		for ; r < hi; r++ {
			x, d := inp[r*C:(r+1)*C], dout[r*C:(r+1)*C]
			m, rs := mean[r], rstd[r]
			var dm, dnm float64
			for i := range x {
				n := (x[i] - m) * rs
				g := w[i] * d[i]
				dm += float64(g)
				dnm += float64(g * n)
			}
			layerNormDx(dinp[r*C:][:C], x, w, d, m, rs, float32(dm/float64(C)), float32(dnm/float64(C)))
		}
	})
	// Parameter gradients sum over rows, in row order: each goroutine takes whole columns.
	parallelCols(C, N, paramGradGrain, func(lo, hi int) {
		dbc, dwc := db[lo:hi], dw[lo:hi]
		for r := 0; r < N; r++ {
			x, d := inp[r*C+lo:r*C+hi], dout[r*C+lo:r*C+hi]
			m, rs := mean[r], rstd[r]
			for i := lnParamsVector(dbc, dwc, x, d, m, rs); i < len(x); i++ {
				dbc[i] += d[i]
				dwc[i] += (x[i] - m) * rs * d[i]
			}
		}
	})
}

// layerNormDx adds one row's input gradient to di: the vector loop where the CPU has one, with
// the Go loop's operations in its order.
func layerNormDx(di, x, w, d []float32, m, rs, dmf, dnmf float32) {
	di, w, d = di[:len(x)], w[:len(x)], d[:len(x)]
	for i := lnDxVector(di, x, w, d, m, rs, dmf, dnmf); i < len(x); i++ {
		n := (x[i] - m) * rs
		di[i] += (w[i]*d[i] - dmf - n*dnmf) * rs
	}
}

// paramGradGrain is the rows × columns below which a parameter gradient's sum over rows stays on
// one goroutine: some tens of microseconds of work.
const paramGradGrain = 1 << 16

// LinearForward: out (N,OUT) = inp (N,IN) · wᵀ + bias, w (OUT,IN); bias may be nil.
func LinearForward(out, inp, w, bias []float32, N, IN, OUT int) {
	LinearForwardPacked(nil, out, inp, w, bias, N, IN, OUT)
}

// linearBias adds bias (nil: none) to each of the N rows of out (N,OUT).
func linearBias(out, bias []float32, N, OUT int) {
	if bias != nil {
		parallelRange(N, max(1, paramGradGrain/max(OUT, 1)), func(lo, hi int) {
			for r := lo; r < hi; r++ {
				AddTo(out[r*OUT:(r+1)*OUT], bias)
			}
		})
	}
}

// LinearBackward accumulates dw (and db when non-nil) and writes dinp (overwriting it unless accIn).
func LinearBackward(dinp, dw, db, dout, inp, w []float32, N, IN, OUT int, accIn bool) {
	LinearBackwardPacked(nil, dinp, dw, db, dout, inp, w, N, IN, OUT, accIn)
}

// linearBiasGrad adds dout's column sums to db (nil: none).
func linearBiasGrad(db, dout []float32, N, OUT int) {
	if db != nil {
		// Row order within each column, whatever goroutine sums it.
		parallelCols(OUT, N, paramGradGrain, func(lo, hi int) {
			dbc := db[lo:hi]
			for r := 0; r < N; r++ {
				AddTo(dbc, dout[r*OUT+lo:r*OUT+hi])
			}
		})
	}
}

// AttentionForward: causal multi-head attention over qkv (B,T,3C) laid out q|k|v, writing the
// head outputs to out (B,T,C) and the softmax probabilities to att (B,H,T,T) for backward. Each
// (batch, head) is three small matrix multiplies — S = Q·Kᵀ, P = causal softmax(S/√hs),
// O = P·V — on contiguous copies of its q, k, v; the masked upper triangle of P is exactly zero,
// so computing it costs time but changes no value.
func AttentionForward(out, att, qkv []float32, B, T, C, H int) {
	hs := C / H
	scale := float32(1 / math.Sqrt(float64(hs)))
	n := T * hs
	// One task per (batch, head) on the pool; each head's multiplies run on its task's goroutine
	// (gemmOn 1), so the pool is not asked for helpers from inside its own loop.
	parallelFor(B*H, Threads(), func(s *scratch, bh int) {
		s.head = grow(s.head, 4*n)
		q, k, v, o := s.head[:n], s.head[n:2*n], s.head[2*n:3*n], s.head[3*n:4*n]
		b, h := bh/H, bh%H
		gatherHead(q, qkv, b, h, 0, T, C, 3*C, hs)
		gatherHead(k, qkv, b, h, C, T, C, 3*C, hs)
		gatherHead(v, qkv, b, h, 2*C, T, C, 3*C, hs)
		p := att[bh*T*T : (bh+1)*T*T]
		s.causal = causalNT(p, q, k, T, hs, s.causal) // S = Q·Kᵀ, on and below the diagonal's blocks
		for t := 0; t < T; t++ {
			causalSoftmax(p[t*T:(t+1)*T], t, scale)
		}
		gemmOn(1, false, false, o, p, v, T, T, hs, false) // O = P·V
		scatterHead(out, o, b, h, 0, T, C, C, hs)
	})
}

// The causal mask in the attention's multiplies. Row t of P = softmax(S) is zero past column t,
// and so is row t of dS; what the multiplies compute under the mask is thrown away (S, dP: the
// softmaxes read columns 0..t only and clear the rest) or adds exact zeros (Pᵀ·dO, dSᵀ·Q). So
// those products are computed by blocks of causalBlock rows, each only as far as it needs:
//
//   - S = Q·Kᵀ and dP = dO·Vᵀ: row block [i0, i1) takes columns [0, i1) — each element the same
//     chain over the head's channels as in the whole product, the rest left to the softmax;
//   - dV = Pᵀ·dO and dK = dSᵀ·Q: key block [j0, j1) sums over queries [j0, T) — the queries
//     before j0 have exact zeros in its columns, which start the whole product's chains: each
//     adds ±0 to a sum that starts at +0 and so stays +0, and dropping them changes no bit.
//
// Where the zeros would end a chain instead (O = P·V, dQ = dS·K) a sum could in principle be −0
// before them and +0 after, so those products stay whole. About 3/8 of the four products'
// multiply-adds are skipped at T = 128.
const causalBlock = 32

// causalNT writes c (T×T) = a (T×hs) · bᵀ (b T×hs) on and below the diagonal's blocks of
// causalBlock rows, leaving c's entries right of each block's end as they were; tmp is scratch,
// returned grown.
func causalNT(c, a, b []float32, T, hs int, tmp []float32) []float32 {
	for i0 := 0; i0 < T; i0 += causalBlock {
		i1 := min(i0+causalBlock, T)
		if i1 == T {
			gemmOn(1, false, true, c[i0*T:], a[i0*hs:], b, T-i0, hs, T, false)
			break
		}
		tmp = grow(tmp, (i1-i0)*i1)
		gemmOn(1, false, true, tmp, a[i0*hs:], b, i1-i0, hs, i1, false)
		copyRowsOut(c[i0*T:], T, tmp, i1, i1-i0)
	}
	return tmp
}

// causalTN writes c (T×hs) = aᵀ · b for a (T×T) zero above the diagonal (a[t][u] = 0 for u > t)
// and b (T×hs): key block [j0, j1) of c from rows [j0, T) of a and b only; tmp is scratch,
// returned grown.
func causalTN(c, a, b []float32, T, hs int, tmp []float32) []float32 {
	for j0 := 0; j0 < T; j0 += causalBlock {
		j1 := min(j0+causalBlock, T)
		w, k := j1-j0, T-j0
		tmp = grow(tmp, k*w)
		copyRowsIn(tmp, a[j0*T+j0:], T, w, k)
		gemmOn(1, true, false, c[j0*hs:], tmp, b[j0*hs:], w, k, hs, false)
	}
	return tmp
}

// causalSoftmax turns row (scores of query t) into softmax(scale·row[:t+1]) followed by zeros.
func causalSoftmax(row []float32, t int, scale float32) {
	r := row[:t+1]
	i, maxv := scaleMaxVec(r, scale)
	for ; i < len(r); i++ {
		r[i] *= scale
		maxv = max(maxv, r[i])
	}
	sum := expRound(r, maxv)
	inv := float32(1 / sum)
	for i := scaleVec(r, inv); i < len(r); i++ {
		r[i] *= inv
	}
	clear(row[t+1:])
}

// gatherHead copies head h of batch row b — columns [off+h·hs, off+(h+1)·hs) of a (B,T,stride)
// tensor — into dst (T,hs).
func gatherHead(dst, src []float32, b, h, off, T, C, stride, hs int) {
	copyRowsIn(dst, src[b*T*stride+off+h*hs:], stride, hs, T)
}

// scatterHead is gatherHead's inverse.
func scatterHead(dst, src []float32, b, h, off, T, C, stride, hs int) {
	copyRowsOut(dst[b*T*stride+off+h*hs:], stride, src, hs, T)
}

// AttentionBackward writes dqkv (B,T,3C) (overwriting it) from dout (B,T,C):
// dP = dO·Vᵀ, dV = Pᵀ·dO, dS = P∘(dP − rowsum(P∘dP))·scale, dQ = dS·K, dK = dSᵀ·Q.
func AttentionBackward(dqkv, dout, qkv, att []float32, B, T, C, H int) {
	hs := C / H
	scale := float32(1 / math.Sqrt(float64(hs)))
	n := T * hs
	parallelFor(B*H, Threads(), func(s *scratch, bh int) {
		s.head = grow(s.head, 7*n+T*T)
		buf := s.head
		q, k, v, do := buf[:n], buf[n:2*n], buf[2*n:3*n], buf[3*n:4*n]
		dq, dk, dv, ds := buf[4*n:5*n], buf[5*n:6*n], buf[6*n:7*n], buf[7*n:7*n+T*T]
		b, h := bh/H, bh%H
		gatherHead(q, qkv, b, h, 0, T, C, 3*C, hs)
		gatherHead(k, qkv, b, h, C, T, C, 3*C, hs)
		gatherHead(v, qkv, b, h, 2*C, T, C, 3*C, hs)
		gatherHead(do, dout, b, h, 0, T, C, C, hs)
		p := att[bh*T*T : (bh+1)*T*T]
		s.causal = causalNT(ds, do, v, T, hs, s.causal) // dP = dO·Vᵀ, on and below the diagonal's blocks
		s.causal = causalTN(dv, p, do, T, hs, s.causal) // dV = Pᵀ·dO
		for t := 0; t < T; t++ {
			pr, dr := p[t*T:(t+1)*T], ds[t*T:(t+1)*T]
			var dot float32
			for t2 := 0; t2 <= t; t2++ {
				dot += pr[t2] * dr[t2]
			}
			for t2 := 0; t2 <= t; t2++ {
				dr[t2] = pr[t2] * (dr[t2] - dot) * scale
			}
			clear(dr[t+1:])
		}
		gemmOn(1, false, false, dq, ds, k, T, T, hs, false) // dQ = dS·K
		s.causal = causalTN(dk, ds, q, T, hs, s.causal)     // dK = dSᵀ·Q
		scatterHead(dqkv, dq, b, h, 0, T, C, 3*C, hs)
		scatterHead(dqkv, dk, b, h, C, T, C, 3*C, hs)
		scatterHead(dqkv, dv, b, h, 2*C, T, C, 3*C, hs)
	})
}

// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
const geluScale = float32(0.7978845608028654) // √(2/π)

// GELUForward writes GELU(inp) to out and keeps the tanh of each input in th for backward, which
// would otherwise compute it again.
func GELUForward(out, th, inp []float32) {
	parallelRange(len(inp), 4096, func(lo, hi int) {
		// The vector loop (where the CPU has one) does the same operations in the same order
		// as the loop below, which finishes the last few.
		lo += geluForwardVector(out[lo:hi], th[lo:hi], inp[lo:hi])
		for i := lo; i < hi; i++ {
			x := inp[i]
			t := Tanh32(geluScale * (x + geluCubic*x*x*x))
			th[i] = t
			out[i] = 0.5 * x * (1 + t)
		}
	})
}

// GELUBackward writes dinp (overwriting it; dinp may alias dout) from the forward's inputs and tanh.
func GELUBackward(dinp, inp, th, dout []float32) {
	parallelRange(len(inp), 4096, func(lo, hi int) {
		lo += geluBackwardVector(dinp[lo:hi], inp[lo:hi], th[lo:hi], dout[lo:hi]) // as the loop below
		for i := lo; i < hi; i++ {
			x, t := inp[i], th[i]
			g := 0.5*(1+t) + 0.5*x*(1-t*t)*geluScale*(1+3*geluCubic*x*x)
			dinp[i] = g * dout[i]
		}
	})
}

// Tanh32 is a float32 tanh: Eigen's rational approximation (generic_fast_tanh_float), within a
// few ulp of the true value, and several times faster than math.Tanh's float64 path — GELU runs
// on every hidden activation twice per step. The same polynomial ports to WGSL unchanged.
func Tanh32(x float32) float32 {
	if x > tanhClamp {
		x = tanhClamp
	} else if x < -tanhClamp {
		x = -tanhClamp
	}
	if x < tanhSmall && x > -tanhSmall {
		return x
	}
	x2 := x * x
	p := x2*tanhP0 + tanhP1
	p = p*x2 + tanhP2
	p = p*x2 + tanhP3
	p = p*x2 + tanhP4
	p = p*x2 + tanhP5
	p = p*x2 + tanhP6
	p *= x
	q := x2*tanhQ0 + tanhQ1
	q = q*x2 + tanhQ2
	q = q*x2 + tanhQ3
	return p / q
}

// Tanh32's constants (untyped: each is rounded to float32 where it meets one), shared with the
// vector loops of GELUForward (geluConstants).
const (
	tanhClamp = 7.90531110763549805 // beyond it, tanh is 1 in float32
	tanhSmall = 0.0004              // below it in magnitude, tanh x is x in float32
	tanhP0    = -2.76076847742355e-16
	tanhP1    = 2.00018790482477e-13
	tanhP2    = -8.60467152213735e-11
	tanhP3    = 5.12229709037114e-08
	tanhP4    = 1.48572235717979e-05
	tanhP5    = 6.37261928875436e-04
	tanhP6    = 4.89352455891786e-03
	tanhQ0    = 1.19825839466702e-06
	tanhQ1    = 1.18534705686654e-04
	tanhQ2    = 2.26843463243900e-03
	tanhQ3    = 4.89352518554385e-03
	geluCubic = 0.044715
)

// CrossEntropyForward returns the mean over N rows of −log softmax(logits)[target], in float64.
func CrossEntropyForward(logits []float32, targets []int32, N, V int) float64 {
	losses := make([]float64, N)
	parallelRange(N, 16, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			l := logits[r*V : (r+1)*V]
			losses[r] = logSumExp(l) - float64(l[targets[r]])
		}
	})
	var s float64
	for _, v := range losses {
		s += v
	}
	return s / float64(N)
}

// CrossEntropyRows writes each row's loss (N), rounded to float32: what a device keeps of a
// micro-batch's loss until the step's one read, summed then in float64 in row order as
// CrossEntropyForward sums it (model.Device.CrossEntropyRows).
func CrossEntropyRows(losses, logits []float32, targets []int32, N, V int) {
	parallelRange(N, 16, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			l := logits[r*V : (r+1)*V]
			losses[r] = float32(logSumExp(l) - float64(l[targets[r]]))
		}
	})
}

// CrossEntropyBackward turns logits (N,V) into their gradient in place: scale·(softmax − onehot)/N.
func CrossEntropyBackward(logits []float32, targets []int32, N, V int, scale float32) {
	parallelRange(N, 16, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			l := logits[r*V : (r+1)*V]
			lse := logSumExp(l)
			k := scale / float32(N)
			var xs, es [expChunk]float64
			for base := 0; base < len(l); base += expChunk {
				c := l[base:min(base+expChunk, len(l))]
				for i, v := range c {
					xs[i] = float64(v) - lse
				}
				expInto(es[:len(c)], xs[:len(c)])
				for i, e := range es[:len(c)] {
					c[i] = float32(e) * k
				}
			}
			l[targets[r]] -= k
		}
	})
}

func logSumExp(l []float32) float64 {
	m := l[0]
	for _, v := range l {
		if v > m {
			m = v
		}
	}
	var s float64
	var es [expChunk]float64
	for base := 0; base < len(l); base += expChunk {
		for _, e := range expShifted(&es, l[base:min(base+expChunk, len(l))], m) {
			s += e
		}
	}
	return float64(m) + math.Log(s)
}

// SoftmaxRows normalises each row of x (N,E) in place.
func SoftmaxRows(x []float32, N, E int) {
	for r := 0; r < N; r++ {
		row := x[r*E : (r+1)*E]
		m := row[0]
		for _, v := range row {
			if v > m {
				m = v
			}
		}
		s := expRound(row, m)
		inv := float32(1 / s)
		for i := range row {
			row[i] *= inv
		}
	}
}

// AdamW's fixed hyperparameters, as docs/design.md ("A training step") and the anchor (nanoGPT) set them.
const (
	Beta1   = 0.9
	Beta2   = 0.95
	AdamEps = 1e-8
)

// AdamW applies one AdamW update to the parameters w in place, with gradients g scaled by
// gradScale (the clip factor) and moments m, v updated in place. decay is 1 − lr·weight_decay
// (1 for tensors that are not decayed), stepSize lr/bc1 and sqrtBC2 √bc2 for the step's bias
// corrections. The order of operations is torch.optim.AdamW's single-tensor path.
func AdamW(w, g, m, v []float32, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	parallelRange(len(w), adamChunk, func(lo, hi int) {
		adamwRange(w[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], decay, stepSize, sqrtBC2, gradScale)
	})
}

// adamChunk is the elements of one task of the optimizer's and the norms' parallel loops.
const adamChunk = 1 << 14

// AdamWTensors is AdamW over consecutive tensors laid out one after another in w, g, m, v (a
// shard's slabs): tensor i is [ends[i-1], ends[i]) (from 0 for the first) with decay factor
// decays[i]. Every element gets AdamW's arithmetic with its tensor's decay, so the result is
// AdamW's on each tensor; the work is cut into chunks of the whole slab, not tensor by tensor,
// so that the threads share the many small tensors too.
func AdamWTensors(w, g, m, v []float32, ends []int, decays []float32, stepSize float32, sqrtBC2 float64, gradScale float32) {
	n := 0
	if len(ends) > 0 {
		n = ends[len(ends)-1]
	}
	if len(ends) != len(decays) || len(w) < n || len(g) < n || len(m) < n || len(v) < n {
		panic("kernels: AdamWTensors: tensors and slabs disagree")
	}
	parallelRange((n+adamChunk-1)/adamChunk, 1, func(clo, chi int) {
		lo, hi := clo*adamChunk, min(chi*adamChunk, n)
		i := sort.SearchInts(ends, lo+1) // the tensor holding element lo
		for lo < hi {
			e := min(ends[i], hi)
			adamwRange(w[lo:e], g[lo:e], m[lo:e], v[lo:e], decays[i], stepSize, sqrtBC2, gradScale)
			lo = e
			i++
		}
	})
}

func adamwRange(w, g, m, v []float32, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	g, m, v = g[:len(w)], m[:len(w)], v[:len(w)]
	// The vector loop (where the CPU has one) does this loop's operations in its order.
	for j := adamwVector(w, g, m, v, decay, stepSize, sqrtBC2, gradScale); j < len(w); j++ {
		gr := g[j] * gradScale
		mj := Beta1*m[j] + (1-Beta1)*gr
		vj := Beta2*v[j] + (1-Beta2)*gr*gr
		m[j], v[j] = mj, vj
		denom := float32(math.Sqrt(float64(vj))/sqrtBC2) + AdamEps
		w[j] = w[j]*decay - stepSize*mj/denom
	}
}

// SquaredNorms writes Σx² of each of xs to out, each summed in element order in float64 — the
// order a shard's gradient-norm report is defined by — with the tensors shared among the threads
// (a tensor's sum is never split, so its bits do not depend on them).
func SquaredNorms(out []float64, xs [][]float32) {
	if len(out) < len(xs) {
		panic("kernels: SquaredNorms: out shorter than xs")
	}
	ids := normOrderOf(xs)
	threads := Threads()
	if threads <= 1 {
		squaredNormsSide(out, xs, ids)
		return
	}
	// Tasks of normLanes tensors, claimed in turn: the sizes differ by orders of magnitude, so
	// a static cut would leave one thread with the largest tensors.
	tasks := (len(ids) + normLanes - 1) / normLanes
	parallelFor(tasks, threads, func(_ *scratch, t int) {
		squaredNormsSide(out, xs, ids[t*normLanes:min((t+1)*normLanes, len(ids))])
	})
}

// normLanes is how many tensors squaredNormsSide sums side by side.
const normLanes = 4

// normOrder is the order SquaredNorms takes a set of tensors in: their indices, largest first
// (stably), so that the tensors summed side by side (squaredNormsSide) are of about one length
// and the threads' last tasks are the small ones; lens are the lengths it was sorted for. It is
// never changed once made, so callers share it.
type normOrder struct {
	lens, ids []int
}

// lastNormOrder is the last call's order: a step takes the norms of the same tensors every time,
// and sorting them again on every call cost an allocation a step. The order decides only which
// tensors share a pass, never a sum's bits (each tensor is one chain of its own), so a call on
// other tensors just sorts them and keeps theirs.
var lastNormOrder atomic.Pointer[normOrder]

// normOrderOf is SquaredNorms' order of xs: lastNormOrder's when it was sorted for the same
// lengths.
func normOrderOf(xs [][]float32) []int {
	if o := lastNormOrder.Load(); o != nil && len(o.lens) == len(xs) {
		same := true
		for i, x := range xs {
			if len(x) != o.lens[i] {
				same = false
				break
			}
		}
		if same {
			return o.ids
		}
	}
	o := &normOrder{lens: make([]int, len(xs)), ids: make([]int, len(xs))}
	for i, x := range xs {
		o.lens[i], o.ids[i] = len(x), i
	}
	sort.SliceStable(o.ids, func(a, b int) bool { return o.lens[o.ids[a]] > o.lens[o.ids[b]] })
	lastNormOrder.Store(o)
	return o.ids
}

// squaredNormsSide writes Σx² of the tensors xs[ids[…]] to out, normLanes of them side by side:
// each tensor's sum is one chain of float64 additions in element order, each addition waiting
// for the one before, so one chain at a time leaves the adder idle most of the time (the default
// model's 6.5M gradient elements took 6 ms a step so). Each chain is still its tensor's own, in
// order (x² of a float32 is exact in float64, so whether an implementation fuses the multiply
// into the add does not matter). A slot whose tensor is done takes the next; when none is left
// it repeats a busy slot's elements, and its sum is dropped.
func squaredNormsSide(out []float64, xs [][]float32, ids []int) {
	var cur [normLanes][]float32
	var acc [normLanes]float64
	var id [normLanes]int
	for k := range id {
		id[k] = -1
	}
	next := 0
	for {
		for k := range normLanes {
			for id[k] < 0 && next < len(ids) {
				i := ids[next]
				next++
				if len(xs[i]) == 0 {
					out[i] = 0
					continue
				}
				id[k], cur[k], acc[k] = i, xs[i], 0
			}
		}
		// n: the elements every busy slot has left, at least; lead: a busy slot that has n.
		lead, n := -1, 0
		for k := range normLanes {
			if id[k] >= 0 && (lead < 0 || len(cur[k]) < n) {
				lead, n = k, len(cur[k])
			}
		}
		if lead < 0 {
			return
		}
		var x [normLanes][]float32
		for k := range normLanes {
			if id[k] >= 0 {
				x[k] = cur[k][:n]
			} else {
				x[k] = cur[lead][:n]
			}
		}
		x0, x1, x2, x3 := x[0], x[1][:len(x[0])], x[2][:len(x[0])], x[3][:len(x[0])]
		s0, s1, s2, s3 := acc[0], acc[1], acc[2], acc[3]
		for i := range x0 {
			v0, v1, v2, v3 := float64(x0[i]), float64(x1[i]), float64(x2[i]), float64(x3[i])
			s0 += v0 * v0
			s1 += v1 * v1
			s2 += v2 * v2
			s3 += v3 * v3
		}
		acc = [normLanes]float64{s0, s1, s2, s3}
		for k := range normLanes {
			if id[k] < 0 {
				continue
			}
			cur[k] = cur[k][n:]
			if len(cur[k]) == 0 {
				out[id[k]] = acc[k]
				id[k] = -1
			}
		}
	}
}

// sumGrain is the fewest elements a thread takes of an elementwise sum: below it the sum is not
// worth waking a helper for.
const sumGrain = 1 << 15

// Sum writes a + b to dst, element by element (dst may be a or b), the elements cut among the
// threads: each is one addition, whoever computes it.
func Sum(dst, a, b []float32) {
	a, b = a[:len(dst)], b[:len(dst)]
	parallelRange(len(dst), sumGrain, func(lo, hi int) { sumRange(dst[lo:hi], a[lo:hi], b[lo:hi]) })
}

// AddTo adds src to dst, element by element, on the caller's goroutine.
func AddTo(dst, src []float32) { sumRange(dst, dst, src[:len(dst)]) }

// AddScaled adds s·x to dst, element by element — each product rounded to float32, then added,
// as the loop dst[i] += s * x[i] compiles for this build — on the caller's goroutine.
func AddScaled(dst, x []float32, s float32) {
	x = x[:len(dst)]
	for i := addScaledVec(dst, x, s); i < len(dst); i++ {
		dst[i] += s * x[i]
	}
}

// ScaleTo writes s·x to dst, element by element, on the caller's goroutine.
func ScaleTo(dst, x []float32, s float32) {
	x = x[:len(dst)]
	for i := scaleToVec(dst, x, s); i < len(dst); i++ {
		dst[i] = s * x[i]
	}
}

func sumRange(dst, a, b []float32) {
	a, b = a[:len(dst)], b[:len(dst)]
	for i := sumVec(dst, a, b); i < len(dst); i++ {
		dst[i] = a[i] + b[i]
	}
}

// expChunk is how many exponentials expRound and the cross-entropy take at a time, in arrays on
// the stack.
const expChunk = 64

// expInto writes math.Exp(x[i]) to dst[i], bit for bit: the vector loop where it can (exp_amd64.s),
// math.Exp for what it leaves.
func expInto(dst, x []float64) {
	dst = dst[:len(x)]
	for i := 0; i < len(x); {
		i += expVec(dst[i:], x[i:])
		for end := min(i+4, len(x)); i < end; i++ {
			dst[i] = math.Exp(x[i])
		}
	}
}

// expRound replaces each v of row by float32(exp(float64(v − m))) and returns the sum of the new
// values in float64, in order: a softmax's numerators and denominator.
func expRound(row []float32, m float32) float64 {
	var s float64
	var es [expChunk]float64
	for base := 0; base < len(row); base += expChunk {
		c := row[base:min(base+expChunk, len(row))]
		for i, e := range expShifted(&es, c, m) {
			f := float32(e)
			c[i] = f
			s += float64(f)
		}
	}
	return s
}

// expShifted writes exp(float64(v − m)) for each v of c (at most expChunk of them, the
// difference taken in float32) to es and returns those of es it wrote.
func expShifted(es *[expChunk]float64, c []float32, m float32) []float64 {
	var xs [expChunk]float64
	for i, v := range c {
		xs[i] = float64(v - m)
	}
	expInto(es[:len(c)], xs[:len(c)])
	return es[:len(c)]
}
