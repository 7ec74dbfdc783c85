package model

// Layers as forward/backward pairs of flat functions over slices, in the manner of llm.c's
// train_gpt2.c. Letters: B batch, T sequence, C channels, V vocab, N = B·T rows, F hidden.
//
// Every backward *accumulates* into parameter gradients (they are summed over micro-batches in
// micro-batch order) and, unless its doc says otherwise, into the input gradient too, because the
// residual stream adds the gradients of its branches. Reductions over rows run in row order on
// one goroutine, so the result never depends on the number of threads.

import (
	"math"

	"github.com/shoal-ml/shoal/kernels"
)

const lnEps = 1e-5

// encoderForward: out (B,T,C) = wte[inp] + wpe[t].
func encoderForward(out []float32, inp []int32, wte, wpe []float32, B, T, C int) {
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

// encoderBackward accumulates dwte and dwpe from dout (B,T,C), rows in order.
func encoderBackward(dwte, dwpe, dout []float32, inp []int32, B, T, C int) {
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

// layernormForward normalises each of N rows of inp (N,C), keeping mean and rstd (N) for backward.
// Statistics are accumulated in float64: cheap, and it keeps agreement with PyTorch tight.
func layernormForward(out, mean, rstd, inp, w, b []float32, N, C int) {
	parallelFor(N, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
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
			rs := 1 / math.Sqrt(vs/float64(C)+lnEps)
			o := out[r*C : (r+1)*C]
			for i, v := range x {
				o[i] = float32((float64(v)-m)*rs)*w[i] + b[i]
			}
			mean[r], rstd[r] = float32(m), float32(rs)
		}
	})
}

// layernormBackward accumulates dinp, dw and db.
func layernormBackward(dinp, dw, db, dout, inp, w, mean, rstd []float32, N, C int) {
	parallelFor(N, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			x, d, di := inp[r*C:(r+1)*C], dout[r*C:(r+1)*C], dinp[r*C:(r+1)*C]
			m, rs := mean[r], rstd[r]
			var dm, dnm float64
			for i := range x {
				n := (x[i] - m) * rs
				g := w[i] * d[i]
				dm += float64(g)
				dnm += float64(g * n)
			}
			dmf, dnmf := float32(dm/float64(C)), float32(dnm/float64(C))
			for i := range x {
				n := (x[i] - m) * rs
				di[i] += (w[i]*d[i] - dmf - n*dnmf) * rs
			}
		}
	})
	// Parameter gradients sum over rows: one goroutine, row order.
	for r := 0; r < N; r++ {
		x, d := inp[r*C:(r+1)*C], dout[r*C:(r+1)*C]
		m, rs := mean[r], rstd[r]
		for i := range x {
			db[i] += d[i]
			dw[i] += (x[i] - m) * rs * d[i]
		}
	}
}

// linearForward: out (N,OUT) = inp (N,IN) · wᵀ + bias, w (OUT,IN); bias may be nil.
func linearForward(out, inp, w, bias []float32, N, IN, OUT int) {
	kernels.MatMulNT(out, inp, w, N, IN, OUT, false)
	if bias != nil {
		for r := 0; r < N; r++ {
			o := out[r*OUT : (r+1)*OUT]
			for i := range o {
				o[i] += bias[i]
			}
		}
	}
}

// linearBackward accumulates dw (and db when non-nil) and writes dinp (overwriting it unless accIn).
func linearBackward(dinp, dw, db, dout, inp, w []float32, N, IN, OUT int, accIn bool) {
	kernels.MatMulNN(dinp, dout, w, N, OUT, IN, accIn)
	kernels.MatMulTN(dw, dout, inp, OUT, N, IN, true)
	if db != nil {
		for r := 0; r < N; r++ {
			d := dout[r*OUT : (r+1)*OUT]
			for i, g := range d {
				db[i] += g
			}
		}
	}
}

// attentionForward: causal multi-head attention over qkv (B,T,3C) laid out q|k|v, writing the
// head outputs to out (B,T,C) and the softmax probabilities to att (B,H,T,T) for backward.
func attentionForward(out, att, qkv []float32, B, T, C, H int) {
	hs := C / H
	scale := float32(1 / math.Sqrt(float64(hs)))
	C3 := 3 * C
	parallelFor(B*H, 1, func(lo, hi int) {
		for bh := lo; bh < hi; bh++ {
			b, h := bh/H, bh%H
			for t := 0; t < T; t++ {
				q := qkv[(b*T+t)*C3+h*hs : (b*T+t)*C3+h*hs+hs]
				a := att[(bh*T+t)*T : (bh*T+t+1)*T]
				maxv := float32(math.Inf(-1))
				for t2 := 0; t2 <= t; t2++ {
					k := qkv[(b*T+t2)*C3+C+h*hs : (b*T+t2)*C3+C+h*hs+hs]
					var s float32
					for i := range q {
						s += q[i] * k[i]
					}
					s *= scale
					a[t2] = s
					if s > maxv {
						maxv = s
					}
				}
				var sum float64
				for t2 := 0; t2 <= t; t2++ {
					e := float32(math.Exp(float64(a[t2] - maxv)))
					a[t2] = e
					sum += float64(e)
				}
				inv := float32(1 / sum)
				for t2 := 0; t2 <= t; t2++ {
					a[t2] *= inv
				}
				clear(a[t+1:])
				o := out[(b*T+t)*C+h*hs : (b*T+t)*C+h*hs+hs]
				clear(o)
				for t2 := 0; t2 <= t; t2++ {
					v := qkv[(b*T+t2)*C3+2*C+h*hs : (b*T+t2)*C3+2*C+h*hs+hs]
					p := a[t2]
					for i := range o {
						o[i] += p * v[i]
					}
				}
			}
		}
	})
}

// attentionBackward writes dqkv (B,T,3C) (overwriting it) from dout (B,T,C).
func attentionBackward(dqkv, dout, qkv, att []float32, B, T, C, H int) {
	hs := C / H
	scale := float32(1 / math.Sqrt(float64(hs)))
	C3 := 3 * C
	clear(dqkv[:B*T*C3])
	parallelFor(B*H, 1, func(lo, hi int) {
		datt := make([]float32, T)
		for bh := lo; bh < hi; bh++ {
			b, h := bh/H, bh%H
			for t := 0; t < T; t++ {
				a := att[(bh*T+t)*T : (bh*T+t+1)*T]
				d := dout[(b*T+t)*C+h*hs : (b*T+t)*C+h*hs+hs]
				// Through the weighted sum of values.
				var dot float32
				for t2 := 0; t2 <= t; t2++ {
					v := qkv[(b*T+t2)*C3+2*C+h*hs : (b*T+t2)*C3+2*C+h*hs+hs]
					dv := dqkv[(b*T+t2)*C3+2*C+h*hs : (b*T+t2)*C3+2*C+h*hs+hs]
					var s float32
					p := a[t2]
					for i := range v {
						s += v[i] * d[i]
						dv[i] += p * d[i]
					}
					datt[t2] = s
					dot += p * s
				}
				// Through the softmax, then the scaled dot products.
				q := qkv[(b*T+t)*C3+h*hs : (b*T+t)*C3+h*hs+hs]
				dq := dqkv[(b*T+t)*C3+h*hs : (b*T+t)*C3+h*hs+hs]
				for t2 := 0; t2 <= t; t2++ {
					g := a[t2] * (datt[t2] - dot) * scale
					k := qkv[(b*T+t2)*C3+C+h*hs : (b*T+t2)*C3+C+h*hs+hs]
					dk := dqkv[(b*T+t2)*C3+C+h*hs : (b*T+t2)*C3+C+h*hs+hs]
					for i := range q {
						dq[i] += g * k[i]
						dk[i] += g * q[i]
					}
				}
			}
		}
	})
}

// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
var geluScale = float32(math.Sqrt(2 / math.Pi))

func geluForward(out, inp []float32) {
	parallelFor(len(inp), 4096, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			x := inp[i]
			u := geluScale * (x + 0.044715*x*x*x)
			out[i] = 0.5 * x * (1 + float32(math.Tanh(float64(u))))
		}
	})
}

// geluBackward writes dinp (overwriting it).
func geluBackward(dinp, inp, dout []float32) {
	parallelFor(len(inp), 4096, func(lo, hi int) {
		for i := lo; i < hi; i++ {
			x := inp[i]
			u := geluScale * (x + 0.044715*x*x*x)
			th := float32(math.Tanh(float64(u)))
			sech2 := 1 - th*th
			g := 0.5*(1+th) + 0.5*x*sech2*geluScale*(1+3*0.044715*x*x)
			dinp[i] = g * dout[i]
		}
	})
}

// crossEntropyForward returns the mean over N rows of −log softmax(logits)[target], in float64.
func crossEntropyForward(logits []float32, targets []int32, N, V int) float64 {
	losses := make([]float64, N)
	parallelFor(N, 16, func(lo, hi int) {
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

// crossEntropyBackward turns logits (N,V) into their gradient in place: scale·(softmax − onehot)/N.
func crossEntropyBackward(logits []float32, targets []int32, N, V int, scale float32) {
	parallelFor(N, 16, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			l := logits[r*V : (r+1)*V]
			lse := logSumExp(l)
			k := scale / float32(N)
			for i, v := range l {
				l[i] = float32(math.Exp(float64(v)-lse)) * k
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
	for _, v := range l {
		s += math.Exp(float64(v - m))
	}
	return float64(m) + math.Log(s)
}

// softmaxRows normalises each row of x (N,E) in place.
func softmaxRows(x []float32, N, E int) {
	for r := 0; r < N; r++ {
		row := x[r*E : (r+1)*E]
		m := row[0]
		for _, v := range row {
			if v > m {
				m = v
			}
		}
		var s float64
		for i, v := range row {
			e := float32(math.Exp(float64(v - m)))
			row[i] = e
			s += float64(e)
		}
		inv := float32(1 / s)
		for i := range row {
			row[i] *= inv
		}
	}
}
