package devcheck

import (
	"fmt"
	"math"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
)

func hasPrimitives(d Device) bool  { _, ok := d.(Primitives); return ok }
func hasGridLimiter(d Device) bool { _, ok := d.(GridLimiter); return ok }

// cases returns the validation cases: every op on shapes that include sizes of 1, odd sizes that
// fill no tile or workgroup, sizes past one workgroup's 256 invocations, and more than one chunk
// of rows for the column sums.
func cases() []validationCase {
	var cs []validationCase
	add := func(kernel, shape string, fn func(v *vcase)) {
		cs = append(cs, validationCase{kernel: kernel, shape: shape, fn: fn})
	}
	// addIf adds a case that only a device with the optional interface needs checks can run.
	addIf := func(needs func(Device) bool, kernel, shape string, fn func(v *vcase)) {
		cs = append(cs, validationCase{kernel: kernel, shape: shape, needs: needs, fn: fn})
	}

	// Matrix multiplies: sizes of 1, primes that fill no 32×64 tile, and one full 256 cube.
	type mmShape struct{ m, k, n int }
	shapes := []mmShape{{1, 1, 1}, {1, 7, 33}, {7, 33, 1}, {33, 1, 7}, {7, 64, 127}, {127, 33, 64},
		{64, 127, 7}, {33, 64, 33}, {64, 1, 64}, {37, 53, 29}, {70, 130, 67}, {127, 127, 127}, {256, 256, 256}}
	layouts := []struct {
		name string
		ref  func(c, a, b []float32, m, k, n int, acc bool)
		op   func(d Device) func(c, a, b model.Buf, m, k, n int, acc bool)
	}{
		{"MatMulNN", kernels.MatMulNN, func(d Device) func(c, a, b model.Buf, m, k, n int, acc bool) { return d.MatMulNN }},
		{"MatMulNT", kernels.MatMulNT, func(d Device) func(c, a, b model.Buf, m, k, n int, acc bool) { return d.MatMulNT }},
		{"MatMulTN", kernels.MatMulTN, func(d Device) func(c, a, b model.Buf, m, k, n int, acc bool) { return d.MatMulTN }},
	}
	for _, l := range layouts {
		for _, s := range shapes {
			for _, acc := range []bool{false, true} {
				add(l.name, fmt.Sprintf("m=%d k=%d n=%d acc=%v", s.m, s.k, s.n, acc), func(v *vcase) {
					a, b, c0 := v.randn(s.m*s.k, 1), v.randn(s.k*s.n, 1), v.randn(s.m*s.n, 1)
					ta, tb, tc := v.primary(a), v.in(b), v.in(c0)
					l.op(v.d)(tc, ta, tb, s.m, s.k, s.n, acc)
					want := cp(c0)
					l.ref(want, a, b, s.m, s.k, s.n, acc)
					v.expectFloor("c", tc, want, accFloor(c0, acc), TolMatMul)
				})
			}
		}
	}
	// A weight gradient accumulated over two row ranges of the same tensors (views of rows
	// lo…hi, as a stage does per micro-batch) against one product over all rows.
	add("MatMulTN", "rows 0..50 then 50..127 of k=127, m=33 n=64", func(v *vcase) {
		m, k, n, lo := 33, 127, 64, 50
		a, b := v.randn(k*m, 1), v.randn(k*n, 1)
		ta, tb, tc := v.primary(a), v.in(b), v.in(v.randn(m*n, 1))
		d := v.d
		d.MatMulTN(tc, d.Slice(ta, 0, lo*m), d.Slice(tb, 0, lo*n), m, lo, n, false)
		d.MatMulTN(tc, d.Slice(ta, lo*m, (k-lo)*m), d.Slice(tb, lo*n, (k-lo)*n), m, k-lo, n, true)
		want := make([]float32, m*n)
		kernels.MatMulTN(want, a, b, m, k, n, false)
		v.expect("c", tc, want, TolMatMul)
	})

	for _, s := range [][4]int{{1, 1, 4, 1}, {1, 5, 8, 2}, {2, 13, 12, 3}, {2, 17, 12, 3}, {3, 32, 64, 4}, {1, 70, 32, 2}} {
		B, T, C, H := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("B=%d T=%d C=%d H=%d", B, T, C, H)
		add("AttentionForward", shape, func(v *vcase) {
			qkv := v.randn(B*T*3*C, 1)
			out, att := v.in(v.randn(B*T*C, 1)), v.in(v.randn(B*H*T*T, 1))
			v.d.AttentionForward(out, att, v.primary(qkv), B, T, C, H)
			wo, wa := make([]float32, B*T*C), make([]float32, B*H*T*T)
			kernels.AttentionForward(wo, wa, qkv, B, T, C, H)
			v.expect("out", out, wo, TolAttention)
			v.expect("att", att, wa, TolAttention)
			// The masked upper triangle must be exactly zero, not merely small.
			got, _, err := v.read(att)
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: "att above the diagonal", Tol: 0}
			if err != nil {
				r.Note = err.Error()
			} else {
				for bh := 0; bh < B*H; bh++ {
					for t := 0; t < T; t++ {
						for t2 := t + 1; t2 < T; t2++ {
							r.MaxAbs = math.Max(r.MaxAbs, math.Abs(float64(got[(bh*T+t)*T+t2])))
						}
					}
				}
				r.RelErr = r.MaxAbs
				r.Pass = r.MaxAbs == 0
			}
			v.results = append(v.results, r)
		})
		add("AttentionBackward", shape, func(v *vcase) {
			qkv, dout := v.randn(B*T*3*C, 1), v.randn(B*T*C, 1)
			wo, att := make([]float32, B*T*C), make([]float32, B*H*T*T)
			kernels.AttentionForward(wo, att, qkv, B, T, C, H)
			dqkv := v.in(v.randn(B*T*3*C, 1)) // garbage: the op overwrites
			v.d.AttentionBackward(dqkv, v.primary(dout), v.in(qkv), v.in(att), B, T, C, H)
			want := make([]float32, B*T*3*C)
			kernels.AttentionBackward(want, dout, qkv, att, B, T, C, H)
			v.expect("dqkv", dqkv, want, TolAttention)
		})
	}

	// C=256: two elements per invocation of a row's WebGPU workgroup; C=300: past one workgroup
	// of 256; N=201: 7 chunks of column sums.
	for _, s := range [][2]int{{1, 1}, {13, 7}, {33, 64}, {37, 53}, {64, 127}, {7, 256}, {5, 300}, {20, 300}, {100, 29}, {201, 64}} {
		N, C := s[0], s[1]
		shape := fmt.Sprintf("N=%d C=%d", N, C)
		// Inputs with a mean far from zero and a spread unlike 1, so that centring and scaling
		// both matter.
		lnInput := func(v *vcase) []float32 {
			x := v.randn(N*C, 2)
			for i := range x {
				x[i] += 3
			}
			return x
		}
		add("LayerNormForward", shape, func(v *vcase) {
			x, w, b := lnInput(v), v.randn(C, 1), v.randn(C, 1)
			out, mean, rstd := v.in(v.randn(N*C, 1)), v.in(v.randn(N, 1)), v.in(v.randn(N, 1))
			v.d.LayerNormForward(out, mean, rstd, v.primary(x), v.in(w), v.in(b), N, C)
			wo, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
			kernels.LayerNormForward(wo, wm, wr, x, w, b, N, C)
			v.expect("out", out, wo, TolLayerNorm)
			v.expect("mean", mean, wm, TolLayerNorm)
			v.expect("rstd", rstd, wr, TolLayerNorm)
		})
		add("LayerNormBackward", shape, func(v *vcase) {
			x, w, b, dout := lnInput(v), v.randn(C, 1), v.randn(C, 1), v.randn(N*C, 1)
			o, mean, rstd := make([]float32, N*C), make([]float32, N), make([]float32, N)
			kernels.LayerNormForward(o, mean, rstd, x, w, b, N, C)
			dinp0, dw0, db0 := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
			dinp, dw, db := v.in(dinp0), v.in(dw0), v.in(db0)
			v.d.LayerNormBackward(dinp, dw, db, v.primary(dout), v.in(x), v.in(w), v.in(mean), v.in(rstd), N, C)
			wdi, wdw, wdb := cp(dinp0), cp(dw0), cp(db0)
			kernels.LayerNormBackward(wdi, wdw, wdb, dout, x, w, mean, rstd, N, C)
			v.expect("dinp", dinp, wdi, TolLayerNorm)
			v.expect("dw", dw, wdw, TolLayerNorm)
			v.expect("db", db, wdb, TolLayerNorm)
		})
	}

	// The last five shapes have a bias in every backward case: IN=1 makes the column sum of db
	// (N=31: one chunk of 32 rows; N=71: three) most of what is checked, OUT=300 passes one
	// workgroup.
	for i, s := range [][3]int{{1, 1, 1}, {13, 7, 33}, {64, 127, 33}, {33, 64, 256}, {37, 53, 29}, {20, 33, 300}, {70, 20, 33}, {31, 1, 29}, {71, 1, 29}} {
		N, IN, OUT := s[0], s[1], s[2]
		for _, bias := range []bool{false, true} {
			add("LinearForward", fmt.Sprintf("N=%d IN=%d OUT=%d bias=%v", N, IN, OUT, bias), func(v *vcase) {
				x, w, b := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(OUT, 1)
				out := v.in(v.randn(N*OUT, 1)) // garbage: the op overwrites
				var tb model.Buf
				var rb []float32
				if bias {
					tb, rb = v.in(b), b
				}
				v.d.LinearForward(out, v.primary(x), v.in(w), tb, N, IN, OUT)
				want := make([]float32, N*OUT)
				kernels.LinearForward(want, x, w, rb, N, IN, OUT)
				v.expect("out", out, want, TolMatMul)
			})
		}
		for _, accIn := range []bool{false, true} {
			withBias := i >= 4 || (i+btoi(accIn))%2 == 0
			add("LinearBackward", fmt.Sprintf("N=%d IN=%d OUT=%d accIn=%v bias=%v", N, IN, OUT, accIn, withBias), func(v *vcase) {
				x, w, dout := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(N*OUT, 1)
				dinp0, dw0, db0 := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(OUT, 1)
				dinp, dw := v.in(dinp0), v.in(dw0)
				var db model.Buf
				var wdb []float32
				if withBias {
					db, wdb = v.in(db0), cp(db0)
				}
				v.d.LinearBackward(dinp, dw, db, v.primary(dout), v.in(x), v.in(w), N, IN, OUT, accIn)
				wdi, wdw := cp(dinp0), cp(dw0)
				kernels.LinearBackward(wdi, wdw, wdb, dout, x, w, N, IN, OUT, accIn)
				v.expectFloor("dinp", dinp, wdi, accFloor(dinp0, accIn), TolMatMul)
				v.expectFloor("dw", dw, wdw, accFloor(dw0, true), TolMatMul)
				if withBias {
					v.expect("db", db, wdb, TolSum(N))
				}
			})
		}
	}

	for _, n := range []int{1, 1000, 4099} {
		// Inputs across GELU's range, with the values where Tanh32 switches branches: the
		// clamp at ±7.9 and the linear region below 4e-4. The random ones stay mostly within
		// ±4: beyond, GELU saturates, and a single-element case could not show Perturb's effect.
		geluInput := func(v *vcase) []float32 {
			x := v.randn(n, 1)
			special := []float32{0, 1e-5, -1e-5, 3.9e-4, -3.9e-4, 4.1e-4, 8, -8, 10, -10}
			for i := 0; i < len(special) && i < n-1; i++ {
				x[1+i] = special[i]
			}
			return x
		}
		add("GELUForward", fmt.Sprintf("n=%d", n), func(v *vcase) {
			x := geluInput(v)
			out, th := v.in(v.randn(n, 1)), v.in(v.randn(n, 1))
			v.d.GELUForward(out, th, v.primary(x))
			wo, wt := make([]float32, n), make([]float32, n)
			kernels.GELUForward(wo, wt, x)
			v.expect("out", out, wo, TolGELU)
			v.expect("th", th, wt, TolGELU)
		})
		for _, alias := range []bool{false, true} {
			fn := func(v *vcase) {
				x, dout := geluInput(v), v.randn(n, 1)
				wo, th := make([]float32, n), make([]float32, n)
				kernels.GELUForward(wo, th, x)
				tdout := v.primary(dout)
				dinp := tdout
				if alias {
					v.d.(Primitives).GELUBackwardInPlace(dinp, v.in(x), v.in(th))
				} else {
					dinp = v.in(v.randn(n, 1)) // garbage: the op overwrites
					v.d.GELUBackward(dinp, v.in(x), v.in(th), tdout)
				}
				want := make([]float32, n)
				kernels.GELUBackward(want, x, th, dout)
				v.expect("dinp", dinp, want, TolGELU)
			}
			shape := fmt.Sprintf("n=%d dinp=dout:%v", n, alias)
			if alias {
				addIf(hasPrimitives, "GELUBackward", shape, fn)
			} else {
				add("GELUBackward", shape, fn)
			}
		}
	}

	// V=5 over 132 rows: every token repeats, many times, so encoder_backward's lists are long.
	for _, s := range [][4]int{{1, 1, 1, 1}, {2, 5, 7, 67}, {3, 5, 29, 11}, {3, 17, 64, 256}, {2, 37, 300, 7}, {4, 33, 8, 5}} {
		B, T, C, V := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("B=%d T=%d C=%d V=%d", B, T, C, V)
		tokens := func(v *vcase) []int32 {
			x := make([]int32, B*T)
			for i := range x {
				x[i] = int32(v.rng.IntN(V))
			}
			if B*T > 2 {
				x[1] = x[0] // a repeated token: two rows add into one row of dwte
			}
			return x
		}
		add("EncoderForward", shape, func(v *vcase) {
			inp, wte, wpe := tokens(v), v.randn(V*C, 1), v.randn(T*C, 1)
			out := v.in(v.randn(B*T*C, 1))
			v.d.EncoderForward(out, v.ints(inp), v.primary(wte), v.in(wpe), B, T, C)
			want := make([]float32, B*T*C)
			kernels.EncoderForward(want, inp, wte, wpe, B, T, C)
			v.expect("out", out, want, TolExact)
		})
		add("EncoderBackward", shape, func(v *vcase) {
			inp, dout := tokens(v), v.randn(B*T*C, 1)
			dwte0, dwpe0 := v.randn(V*C, 1), v.randn(T*C, 1)
			dwte, dwpe := v.in(dwte0), v.in(dwpe0)
			v.d.EncoderBackward(dwte, dwpe, v.primary(dout), v.ints(inp), B, T, C)
			wte, wpe := cp(dwte0), cp(dwpe0)
			kernels.EncoderBackward(wte, wpe, dout, inp, B, T, C)
			v.expect("dwte", dwte, wte, TolExact)
			v.expect("dwpe", dwpe, wpe, TolExact)
		})
	}

	for _, s := range [][2]int{{1, 2}, {13, 67}, {37, 29}, {3, 300}, {64, 256}} {
		N, V := s[0], s[1]
		shape := fmt.Sprintf("N=%d V=%d", N, V)
		targets := func(v *vcase) []int32 {
			t := make([]int32, N)
			for i := range t {
				t[i] = int32(v.rng.IntN(V))
			}
			return t
		}
		add("CrossEntropyForward", shape, func(v *vcase) {
			logits, tg := v.randn(N*V, 2), targets(v)
			losses := v.in(v.randn(N, 1))
			tl, tt := v.in(logits), v.primaryTargets(tg, V)
			v.d.CrossEntropyRows(losses, tl, tt, N, V)
			// The per-row losses, from the reference one row at a time, and the norm of the
			// logsumexps they are the difference of (see TolSoftmax).
			want := make([]float32, N)
			var lse2, lseSum float64
			for r := range want {
				loss := kernels.CrossEntropyForward(logits[r*V:(r+1)*V], tg[r:r+1], 1, V)
				want[r] = float32(loss)
				lse := loss + float64(logits[r*V+int(tg[r])])
				lse2 += lse * lse
				lseSum += lse
			}
			v.expectFloor("losses", losses, want, math.Sqrt(lse2), TolSoftmax)
			mean := v.d.CrossEntropyForward(tl, tt, N, V)
			v.expectValues("mean loss", []float64{mean}, []float64{kernels.CrossEntropyForward(logits, tg, N, V)}, math.Abs(lseSum)/float64(N), TolSoftmax)
		})
		for _, scale := range []float32{1, 0.7, 0.25} {
			add("CrossEntropyBackward", fmt.Sprintf("%s scale=%g", shape, scale), func(v *vcase) {
				logits, tg := v.randn(N*V, 2), targets(v)
				tl := v.in(logits)
				v.d.CrossEntropyBackward(tl, v.primaryTargets(tg, V), N, V, scale)
				want := cp(logits)
				kernels.CrossEntropyBackward(want, tg, N, V, scale)
				// ‖onehot·scale/N‖: the term the softmax is subtracted from (see TolSoftmax).
				v.expectFloor("dlogits", tl, want, float64(scale)/math.Sqrt(float64(N)), TolSoftmax)
			})
		}
	}

	for _, s := range [][2]int{{1, 2}, {13, 4}, {37, 5}, {64, 7}, {5, 67}, {3, 300}} {
		N, E := s[0], s[1]
		add("SoftmaxRows", fmt.Sprintf("N=%d E=%d", N, E), func(v *vcase) {
			x := v.randn(N*E, 1) // wider logits saturate a row of 2, which Perturb could not move
			tx := v.primary(x)
			v.d.SoftmaxRows(tx, N, E)
			want := cp(x)
			kernels.SoftmaxRows(want, N, E)
			v.expect("x", tx, want, TolSoftmax)
		})
	}

	// An MoE block's routing on the device (kernels/moe.go). N=37 fills no workgroup of rows,
	// N=201 two, with moe_stats' 128 strided partial sums unequal; C=300 passes one workgroup;
	// E from 2 to 64, K from 1 to E.
	for _, s := range [][4]int{{1, 1, 2, 1}, {1, 1, 2, 2}, {37, 53, 4, 1}, {37, 53, 5, 1}, {37, 53, 4, 2}, {37, 53, 5, 2},
		{37, 53, 8, 2}, {5, 9, 3, 3}, {70, 300, 8, 2}, {33, 29, 64, 3}, {201, 32, 64, 4}} {
		N, C, E, K := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("N=%d C=%d E=%d K=%d", N, C, E, K)
		moeCases(add, shape, N, C, E, K)
	}
	// Ties: probabilities of a few levels, so that most rows hold equal ones, which go to the
	// lower index.
	add("TopKGate", "N=37 E=5 K=2, most rows with ties", func(v *vcase) {
		N, E, K := 37, 5, 2
		probs := make([]float32, N*E)
		for i := range probs {
			probs[i] = float32(1+v.rng.IntN(3)) / 4
		}
		gate, mask := make([]float32, N*E), make([]float32, N*E)
		kernels.TopKGate(gate, mask, probs, N, E, K)
		ts := v.pack(v.randn(N*E, 1), v.randn(N*E, 1)) // garbage: the op overwrites
		v.d.TopKGate(ts[0], ts[1], v.primary(probs), N, E, K)
		v.expect("gate", ts[0], gate, TolExact)
		v.expect("mask", ts[1], mask, TolExact)
	})

	for _, n := range []int{1, 1000, 4099} {
		add("AdamW", fmt.Sprintf("n=%d", n), func(v *vcase) {
			// Weights of a GPT's size (initialised at std 0.02): a float32 w rounds at a few
			// 1e-9, well below the ~1e-3 step, so that comparing steps measures the step's
			// arithmetic, not w's last bit.
			w0, g, m0, v0 := v.randn(n, 0.02), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
			for i := range v0 {
				v0[i] *= v0[i] // second moments are non-negative
			}
			// Step 3 of a job with lr 1e-3 and weight decay 0.1, gradients clipped by 0.7.
			decay, stepSize, sqrtBC2 := adamStep(1e-3, 0.1, 3)
			tw, tm, tv := v.in(w0), v.in(m0), v.in(v0)
			v.d.AdamW(tw, v.primary(g), tm, tv, decay, stepSize, sqrtBC2, 0.7)
			ww, wm, wv := cp(w0), cp(m0), cp(v0)
			kernels.AdamW(ww, g, wm, wv, decay, stepSize, sqrtBC2, 0.7)
			v.expectStep("w − w₀", tw, w0, ww, TolAdamW)
			v.expect("m", tm, wm, TolAdamW)
			v.expect("v", tv, wv, TolAdamW)
		})
	}

	// A run of AdamW calls over adjacent views, as model.Shard.Apply makes them over a shard's
	// slab (vectors undecayed, matrices decayed, sizes that split workgroups): a device may
	// gather them into one dispatch, and must give kernels.AdamW's result per tensor. Twice with
	// the same segments (a device may keep the table) then with others (it must not).
	add("AdamW", "slab of segments 7,1,300,64,4099 decayed F,T,T,F,T, twice; then 5,6 F,T", func(v *vcase) {
		type seg struct {
			n     int
			decay bool
		}
		for _, segs := range [][]seg{
			{{7, false}, {1, true}, {300, true}, {64, false}, {4099, true}},
			{{7, false}, {1, true}, {300, true}, {64, false}, {4099, true}},
			{{5, false}, {6, true}},
		} {
			n := 0
			for _, s := range segs {
				n += s.n
			}
			w0, g, m0, v0 := v.randn(n, 0.02), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
			for i := range v0 {
				v0[i] *= v0[i]
			}
			decay, stepSize, sqrtBC2 := adamStep(1e-3, 0.1, 3)
			tw, tg, tm, tv := v.in(w0), v.primary(g), v.in(m0), v.in(v0)
			ww, wm, wv := cp(w0), cp(m0), cp(v0)
			off := 0
			for _, s := range segs {
				dec := float32(1)
				if s.decay {
					dec = decay
				}
				sl := func(b model.Buf) model.Buf { return v.d.Slice(b, off, s.n) }
				v.d.AdamW(sl(tw), sl(tg), sl(tm), sl(tv), dec, stepSize, sqrtBC2, 0.7)
				e := off + s.n
				kernels.AdamW(ww[off:e], g[off:e], wm[off:e], wv[off:e], dec, stepSize, sqrtBC2, 0.7)
				off = e
			}
			v.expectStep(fmt.Sprintf("w − w₀ (%d segments)", len(segs)), tw, w0, ww, TolAdamW)
			v.expect(fmt.Sprintf("m (%d segments)", len(segs)), tm, wm, TolAdamW)
			v.expect(fmt.Sprintf("v (%d segments)", len(segs)), tv, wv, TolAdamW)
		}
	})

	// Helpers. 70001 elements: several workgroups and a partial last one.
	for _, n := range []int{1, 37, 1000, 1001, 70001} {
		shape := fmt.Sprintf("n=%d", n)
		add("Add", shape, func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			ta := v.in(a)
			v.d.Add(ta, v.primary(b))
			want := cp(a)
			for i := range want {
				want[i] += b[i]
			}
			v.expect("dst", ta, want, TolExact)
		})
		add("Copy", shape, func(v *vcase) {
			a := v.randn(n, 1)
			dst := v.in(v.randn(n, 1))
			v.d.Copy(dst, v.primary(a))
			v.expect("dst", dst, a, TolExact)
		})
		add("Zero", shape+", then Add", func(v *vcase) {
			a := v.randn(n, 1)
			dst := v.in(v.randn(n, 1))
			v.d.Zero(dst)
			v.d.Add(dst, v.primary(a))
			v.expect("dst", dst, a, TolExact)
		})
		addIf(hasPrimitives, "AddOut", shape, func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			out := v.in(v.randn(n, 1))
			v.d.(Primitives).AddOut(out, v.primary(a), v.in(b))
			want := make([]float32, n)
			for i := range want {
				want[i] = a[i] + b[i]
			}
			v.expect("out", out, want, TolExact)
		})
		addIf(hasPrimitives, "AddOut", shape+" out=a", func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			ta := v.primary(a)
			v.d.(Primitives).AddOut(ta, ta, v.in(b))
			want := make([]float32, n)
			for i := range want {
				want[i] = a[i] + b[i]
			}
			v.expect("out", ta, want, TolExact)
		})
		addIf(hasPrimitives, "Fill", shape, func(v *vcase) {
			dst := v.in(v.randn(n, 1))
			v.d.(Primitives).Fill(dst, v.scalar(0.375))
			want := make([]float32, n)
			for i := range want {
				want[i] = 0.375
			}
			v.expect("dst", dst, want, TolExact)
		})
	}
	// 201 rows: 7 chunks of column sums, the last short, an odd one out in the tree.
	for _, s := range [][2]int{{1, 1}, {13, 67}, {64, 256}, {201, 64}} {
		N, C := s[0], s[1]
		shape := fmt.Sprintf("N=%d C=%d", N, C)
		addIf(hasPrimitives, "BiasAdd", shape, func(v *vcase) {
			x, b := v.randn(N*C, 1), v.randn(C, 1)
			tx := v.in(x)
			v.d.(Primitives).BiasAdd(tx, v.primary(b), N, C)
			want := cp(x)
			for r := 0; r < N; r++ {
				for i := 0; i < C; i++ {
					want[r*C+i] += b[i]
				}
			}
			v.expect("out", tx, want, TolExact)
		})
		addIf(hasPrimitives, "BiasGrad", shape, func(v *vcase) {
			dout, db0 := v.randn(N*C, 1), v.randn(C, 1)
			db := v.in(db0)
			v.d.(Primitives).BiasGrad(db, v.primary(dout), N, C)
			want := cp(db0)
			for r := 0; r < N; r++ {
				for i := 0; i < C; i++ {
					want[i] += dout[r*C+i]
				}
			}
			v.expect("db", db, want, TolSum(N))
		})
	}
	sizes := []int{1, 37, 4095, 4096, 4097, 5000, 9000, 70001}
	add("SquaredNorms", "n="+joinInts(sizes), func(v *vcase) {
		var ts []model.Buf
		var want []float64
		for _, n := range sizes {
			x := v.randn(n, 1)
			var s float64
			for _, e := range x {
				s += float64(e) * float64(e)
			}
			want = append(want, s)
			ts = append(ts, v.in(v.perturbedAway(x))) // every one perturbed: each norm must fail on its own
		}
		v.expectValues("‖x‖²", v.d.SquaredNorms(ts), want, 0, TolSumSq)
	})

	// 700 dispatches recorded without a read in between: more than a WebGPU device's parameter
	// arena holds, so the device must submit mid-batch and keep the order.
	add("Add", "700 dispatches in one batch, n=33", func(v *vcase) {
		const n, reps = 33, 700
		a, b := v.randn(n, 1), v.randn(n, 1)
		ta, tb := v.in(a), v.primary(b)
		for i := 0; i < reps; i++ {
			v.d.Add(ta, tb)
		}
		want := cp(a)
		for i := 0; i < reps; i++ {
			for j := range want {
				want[j] += b[j]
			}
		}
		v.expect("dst", ta, want, TolExact)
	})
	// More workgroups than one grid dimension holds (65535 on most adapters): the flat, chunked
	// and row kernels spread them over x and y, and must still visit every element once. The
	// case lowers the device's per-dimension limit to 3 workgroups so that small tensors need a
	// 2-D grid (8.4 M elements would at the adapter's real limit).
	addIf(hasGridLimiter, "2-D grid", "maxComputeWorkgroupsPerDimension lowered to 3", func(v *vcase) {
		flat, chunk, restore := v.d.(GridLimiter).LimitGrid(3)
		defer restore()
		n := 2*3*flat + 77 // 7 workgroups: a 3×3 grid, the last row part-empty
		a := v.randn(n, 1)
		dst := v.in(make([]float32, n))
		v.d.Copy(dst, v.primary(a))
		v.expect("Copy", dst, a, TolExact)

		x := v.randn(n, 1)
		out, th := v.in(make([]float32, n)), v.in(make([]float32, n))
		v.d.GELUForward(out, th, v.primary(x))
		wo, wt := make([]float32, n), make([]float32, n)
		kernels.GELUForward(wo, wt, x)
		v.expect("GELUForward out", out, wo, TolGELU)

		N, C := 7, 3 // 7 workgroups of one row each
		xs, w, b := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
		lo, mean, rstd := v.in(make([]float32, N*C)), v.in(make([]float32, N)), v.in(make([]float32, N))
		v.d.LayerNormForward(lo, mean, rstd, v.primary(xs), v.in(w), v.in(b), N, C)
		wl, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(wl, wm, wr, xs, w, b, N, C)
		v.expect("LayerNormForward out", lo, wl, TolLayerNorm)

		big := v.randn(7*chunk+5, 1) // 8 chunks: a 3×3 grid
		var want float64
		for _, e := range big {
			want += float64(e) * float64(e)
		}
		v.expectValues("SquaredNorms", v.d.SquaredNorms([]model.Buf{v.in(v.perturbedAway(big))}), []float64{want}, 0, TolSumSq)
	})

	// Determinism (docs/design.md, "Determinism"): the same inputs give the same bits, run after
	// run. The kernels reduce in fixed orders and use no atomics; this holds them to it. Perturb
	// changes the second run's input. (Options.Twice does the same for every case.)
	add("Deterministic", "AttentionBackward B=2 T=17 C=12 H=3, LayerNormBackward N=33 C=64, twice", func(v *vcase) {
		B, T, C, H, N, LC := 2, 17, 12, 3, 33, 64
		qkv, dout := v.randn(B*T*3*C, 1), v.randn(B*T*C, 1)
		o, att := make([]float32, B*T*C), make([]float32, B*H*T*T)
		kernels.AttentionForward(o, att, qkv, B, T, C, H)
		x, w, b, dy := v.randn(N*LC, 1), v.randn(LC, 1), v.randn(LC, 1), v.randn(N*LC, 1)
		lo, mean, rstd := make([]float32, N*LC), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(lo, mean, rstd, x, w, b, N, LC)
		tq, tatt, tx, tw, tm, tr := v.in(qkv), v.in(att), v.in(x), v.in(w), v.in(mean), v.in(rstd)
		run := func(dout, dy []float32) (dqkv, dinp, dw []float32) {
			tdqkv, tdinp, tdw, tdb := v.in(make([]float32, B*T*3*C)), v.in(make([]float32, N*LC)), v.in(make([]float32, LC)), v.in(make([]float32, LC))
			v.d.AttentionBackward(tdqkv, v.in(dout), tq, tatt, B, T, C, H)
			v.d.LayerNormBackward(tdinp, tdw, tdb, v.in(dy), tx, tw, tm, tr, N, LC)
			var err error
			if dqkv, _, err = v.read(tdqkv); err == nil {
				if dinp, _, err = v.read(tdinp); err == nil {
					dw, _, err = v.read(tdw)
				}
			}
			if err != nil {
				panic(err)
			}
			return dqkv, dinp, dw
		}
		q1, i1, w1 := run(dout, dy)
		q2, i2, w2 := run(v.perturbed(dout), v.perturbed(dy))
		for _, c := range []struct {
			name       string
			first, sec []float32
		}{{"dqkv", q1, q2}, {"dinp", i1, i2}, {"dw", w1, w2}} {
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: c.name + " run 2 vs run 1", Tol: 0}
			r.RelErr, r.MaxAbs = compare(c.sec, c.first, 0)
			r.Pass = r.RelErr == 0
			v.record(c.sec)
			v.results = append(v.results, r)
		}
	})

	// Tensors that share a buffer: inputs beside outputs (which WebGPU refuses to bind read-only
	// and writable in one dispatch) and outputs within 256 bytes of each other (overlapping
	// writable bindings). The device must give the same results.
	add("LayerNormForward", "N=13 C=7, all six tensors in one buffer", func(v *vcase) {
		N, C := 13, 7
		x, w, b := v.randn(N*C, 2), v.randn(C, 1), v.randn(C, 1)
		ts := v.pack(v.randn(N*C, 1), v.randn(N, 1), v.randn(N, 1), v.perturbed(x), w, b)
		v.d.LayerNormForward(ts[0], ts[1], ts[2], ts[3], ts[4], ts[5], N, C)
		wo, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(wo, wm, wr, x, w, b, N, C)
		v.expect("out", ts[0], wo, TolLayerNorm)
		v.expect("mean", ts[1], wm, TolLayerNorm)
		v.expect("rstd", ts[2], wr, TolLayerNorm)
	})
	add("LayerNormBackward", "N=13 C=7, dw and db adjacent in one buffer", func(v *vcase) {
		N, C := 13, 7
		x, w, b, dout := v.randn(N*C, 2), v.randn(C, 1), v.randn(C, 1), v.randn(N*C, 1)
		o, mean, rstd := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(o, mean, rstd, x, w, b, N, C)
		dinp0, dw0, db0 := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
		grads := v.pack(dw0, db0)
		dinp := v.in(dinp0)
		v.d.LayerNormBackward(dinp, grads[0], grads[1], v.primary(dout), v.in(x), v.in(w), v.in(mean), v.in(rstd), N, C)
		wdi, wdw, wdb := cp(dinp0), cp(dw0), cp(db0)
		kernels.LayerNormBackward(wdi, wdw, wdb, dout, x, w, mean, rstd, N, C)
		v.expect("dinp", dinp, wdi, TolLayerNorm)
		v.expect("dw", grads[0], wdw, TolLayerNorm)
		v.expect("db", grads[1], wdb, TolLayerNorm)
	})
	add("MatMulNN", "m=33 k=7 n=64 acc=true, c a b in one buffer", func(v *vcase) {
		m, k, n := 33, 7, 64
		a, b, c0 := v.randn(m*k, 1), v.randn(k*n, 1), v.randn(m*n, 1)
		ts := v.pack(c0, v.perturbed(a), b)
		v.d.MatMulNN(ts[0], ts[1], ts[2], m, k, n, true)
		want := cp(c0)
		kernels.MatMulNN(want, a, b, m, k, n, true)
		v.expectFloor("c", ts[0], want, accFloor(c0, true), TolMatMul)
	})
	add("Copy", "n=1000 within one buffer", func(v *vcase) {
		a := v.randn(1000, 1)
		ts := v.pack(v.randn(1000, 1), v.perturbed(a))
		v.d.Copy(ts[0], ts[1])
		v.expect("dst", ts[0], a, TolExact)
	})
	add("AdamW", "n=1000, w m v in one buffer", func(v *vcase) {
		n := 1000
		w0, g, m0, v0 := v.randn(n, 1), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
		for i := range v0 {
			v0[i] *= v0[i]
		}
		ts := v.pack(w0, m0, v0)
		v.d.AdamW(ts[0], v.primary(g), ts[1], ts[2], 0.9999, 1e-3, 0.1, 1)
		ww, wm, wv := cp(w0), cp(m0), cp(v0)
		kernels.AdamW(ww, g, wm, wv, 0.9999, 1e-3, 0.1, 1)
		v.expect("w", ts[0], ww, TolAdamW)
		v.expect("m", ts[1], wm, TolAdamW)
		v.expect("v", ts[2], wv, TolAdamW)
	})
	return cs
}

// accFloor is the floor of the reference norm for a product accumulated into c0 (see TolMatMul):
// ‖c0‖ when the op accumulates, else 0.
func accFloor(c0 []float32, acc bool) float64 {
	if !acc {
		return 0
	}
	var ss float64
	for _, x := range c0 {
		ss += float64(x) * float64(x)
	}
	return math.Sqrt(ss)
}

// adamStep returns AdamW's per-step factors at step (from 1) of a job with learning rate lr and
// weight decay wd, as model's optimizer computes them.
func adamStep(lr, wd, step float64) (decay, stepSize float32, sqrtBC2 float64) {
	return float32(1 - lr*wd), float32(lr / (1 - math.Pow(kernels.Beta1, step))), math.Sqrt(1 - math.Pow(kernels.Beta2, step))
}

// moeRouting returns router probabilities (N,E) — the softmax of random logits, with row 0 all
// ties (1/E each) and row 1's largest probability repeated at the next expert, so that ties to
// the lower index matter — and the gate and mask kernels.TopKGate makes of them.
func moeRouting(v *vcase, N, E, K int) (probs, gate, mask []float32) {
	probs = v.randn(N*E, 1)
	kernels.SoftmaxRows(probs, N, E)
	for e := 0; e < E; e++ {
		probs[e] = 1 / float32(E)
	}
	if N > 1 {
		row := probs[E : 2*E]
		m := 0
		for e, x := range row {
			if x > row[m] {
				m = e
			}
		}
		row[(m+1)%E] = row[m]
	}
	gate, mask = make([]float32, N*E), make([]float32, N*E)
	kernels.TopKGate(gate, mask, probs, N, E, K)
	return probs, gate, mask
}

// busiest returns the expert with the most rows routed to it (the lowest such index), so that
// a case on one expert has routed rows for Perturb to move.
func busiest(mask []float32, N, E int) int {
	best, most := 0, -1
	for e := 0; e < E; e++ {
		n := 0
		for r := 0; r < N; r++ {
			if mask[r*E+e] != 0 {
				n++
			}
		}
		if n > most {
			best, most = e, n
		}
	}
	return best
}

// moeCases adds the validation cases of the MoE routing ops on one shape.
func moeCases(add func(kernel, shape string, fn func(v *vcase)), shape string, N, C, E, K int) {
	add("TopKGate", shape+", gate and mask in one buffer", func(v *vcase) {
		probs, gate, mask := moeRouting(v, N, E, K)
		ts := v.pack(v.randn(N*E, 1), v.randn(N*E, 1)) // garbage: the op overwrites
		v.d.TopKGate(ts[0], ts[1], v.primary(probs), N, E, K)
		v.expect("gate", ts[0], gate, TolExact)
		v.expect("mask", ts[1], mask, TolExact)
	})
	add("GateRows", shape+" acc=false, the busiest expert", func(v *vcase) {
		_, gate, mask := moeRouting(v, N, E, K)
		e := busiest(mask, N, E)
		src := v.randn(N*C, 1)
		dst := v.in(v.randn(N*C, 1)) // garbage: the op overwrites
		v.d.GateRows(dst, v.primary(src), v.in(gate), e, N, C, E, false)
		want := make([]float32, N*C)
		kernels.GateRows(want, src, gate, e, N, C, E, false)
		v.expect("dst", dst, want, TolExact)
	})
	add("GateRows", shape+" acc=true, every expert in order", func(v *vcase) {
		_, gate, _ := moeRouting(v, N, E, K)
		dst0 := v.randn(N*C, 1)
		dst, tg := v.in(dst0), v.in(gate)
		want := cp(dst0)
		for e := 0; e < E; e++ {
			src := v.randn(N*C, 1)
			v.d.GateRows(dst, v.primary(src), tg, e, N, C, E, true)
			kernels.GateRows(want, src, gate, e, N, C, E, true)
		}
		v.expect("dst", dst, want, TolGate)
	})
	add("GateGrad", shape+", every expert in order", func(v *vcase) {
		_, _, mask := moeRouting(v, N, E, K)
		dgate0, dout := v.randn(N*E, 1), v.randn(N*C, 1) // garbage: each column is overwritten
		dgate, tdout, tmask := v.in(dgate0), v.primary(dout), v.in(mask)
		want := cp(dgate0)
		for e := 0; e < E; e++ {
			y := v.randn(N*C, 1)
			v.d.GateGrad(dgate, tdout, v.in(y), tmask, e, N, C, E)
			kernels.GateGrad(want, dout, y, mask, e, N, C, E)
		}
		v.expect("dgate", dgate, want, TolSum(C))
	})
	add("MoEStats", shape, func(v *vcase) {
		probs, _, mask := moeRouting(v, N, E, K)
		stats := v.in(v.randn(E+1, 1)) // garbage: the op overwrites
		// Every probability moved up (they are positive): each P_e grows, and so does the loss,
		// where alternating shifts could cancel over the experts.
		v.d.MoEStats(stats, v.in(mask), v.in(v.perturbedAway(probs)), N, E, K)
		want := make([]float32, E+1)
		kernels.MoEStats(want, mask, probs, N, E, K)
		got, intact, err := v.read(stats)
		if err == nil {
			v.compareOutput("counts", got[:E], intact, nil, want[:E], 0, TolExact)
			v.compareOutput("balancing loss", got[E:], intact, nil, want[E:], 0, TolMoEStats)
		} else {
			v.compareOutput("stats", nil, false, err, want, 0, TolMoEStats)
		}
	})
	for _, scale := range []float32{1, 0.7, 0.01} {
		add("AuxGrad", fmt.Sprintf("%s scale=%g", shape, scale), func(v *vcase) {
			probs, _, mask := moeRouting(v, N, E, K)
			stats := make([]float32, E+1)
			kernels.MoEStats(stats, mask, probs, N, E, K)
			// dgate at the size of the term added (scale·E·f_e/N ≈ scale/N), so that the
			// comparison sees the term and not mostly dgate's own values.
			dgate0 := v.randn(N*E, float64(scale)/float64(N))
			dgate := v.in(dgate0)
			v.d.AuxGrad(dgate, v.primary(stats), N, E, K, scale)
			want := cp(dgate0)
			kernels.AuxGrad(want, stats, N, E, K, scale)
			v.expect("dgate", dgate, want, TolAuxGrad)
		})
	}
	add("SoftmaxBackwardRows", shape, func(v *vcase) {
		probs, _, _ := moeRouting(v, N, E, K)
		dp := v.randn(N*E, 1)
		dx := v.in(v.randn(N*E, 1)) // garbage: the op overwrites
		v.d.SoftmaxBackwardRows(dx, v.in(probs), v.primary(dp), N, E)
		want := make([]float32, N*E)
		kernels.SoftmaxBackwardRows(want, probs, dp, N, E)
		v.expect("dx", dx, want, TolGate)
	})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// joinInts joins ns with commas.
func joinInts(ns []int) string {
	s := ""
	for i, n := range ns {
		if i > 0 {
			s += ","
		}
		s += fmt.Sprint(n)
	}
	return s
}
