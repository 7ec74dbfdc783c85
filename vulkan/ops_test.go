package vulkan

import (
	"flag"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
)

var seed = flag.Uint64("vulkan.seed", 1, "seed of the kernel validation inputs")

// Tolerances on the relative L2 error ‖vulkan − host‖/‖host‖ of each output, per kernel, after
// wasm/webgpu/validate.go: the device computes in float32 like the Go kernels, and each says
// where it may differ from them.
const (
	// The same float32 operations in the same order as the Go reference, so the bits must
	// match: a single add (Add, bias, encoder), copies and fills, sums over rows that one
	// invocation walks in row order (EncoderBackward; a bias or LayerNorm parameter gradient
	// of at most 32 rows, one chunk).
	tolExact = 0
	// Each element of a product is the Go kernel's chain over k, each step an explicit fma as in
	// the AVX2/AVX-512 micro-kernels; where Go does not fuse (the pure-Go kernels) a step may
	// differ by half an ulp of the partial sum: ~1e-7 on these shapes.
	tolMatMul = 1e-6
	// A column sum over more than 32 rows adds per-chunk partial sums in chunk order, where Go
	// adds row by row: a different rounding of positive and negative terms, ~1e-7.
	tolColSum = 1e-6
	// The same tanh polynomial and formula, unfused; only the division (2.5 ulp in Vulkan's
	// precision rules) may differ.
	tolGELU = 1e-6
	// Go accumulates LayerNorm's statistics in float64 and takes the square root in float64; the
	// device sums in float32 through a tree and takes a float32 sqrt.
	tolLayerNorm = 1e-5
	// exp and log: Go's are float64; Vulkan's float32 exp and log are within 3 + 2·|x| ulp, and
	// the sums of exponentials are float32 trees where Go sums in float64. Cross-entropy's
	// gradient is the difference softmax − onehot, both rounded at their own ulp, so its error
	// is measured against ‖onehot·scale/N‖ when that is larger than the output's norm (a
	// confident row's gradient is tiny and its relative error large though both sides are right
	// to float32 precision).
	tolSoftmax = 1e-5
	// Attention adds the softmax's error to two float32 products over T and hs.
	tolAttention = 2e-5
	// Squared norms: float32 partial sums over chunks of 4096 in a fixed tree, added in float64,
	// against a float64 sum; all terms are positive, so nothing cancels.
	tolSumSq = 1e-6
	// MoE routing (kernels/moe.go). GateRows with acc and SoftmaxBackwardRows are Go's float32
	// operations in Go's order (one invocation per row for the softmax's sum over E experts),
	// precise so that nothing is fused: the bits of Go on amd64. Go may fuse a multiply and an add
	// where the target has an fma (arm64), which moves a result by up to half an ulp of the
	// product, ~6e-8 relative. TopKGate (comparisons and copies), GateRows without acc (one
	// correctly rounded multiply) and MoEStats's counts (sums of 0s and 1s below 2^24) are
	// tolExact.
	tolGate = 1e-6
	// GateGrad's dot product over C, one workgroup per row: strided partials and reduce.glsl's
	// tree, where Go adds in c order. Each order's rounding error is a few ulp of Σ|dout·y|, which
	// for these inputs is ~√C times |Σ dout·y|: ~1e-7 on C = 53, ~3e-7 on C = 300.
	tolGateGrad = 1e-5
	// MoEStats's balancing loss: P_e summed in float32 (strided partials, a tree), two float32
	// divisions (2.5 ulp in Vulkan) per expert and the E experts' terms added in float32 in
	// expert order, where Go does all of it in float64. All terms are positive, so nothing
	// cancels: ~2e-7 on E = 64, up to ~E ulp in the worst case. Checked on the loss alone (the
	// "host value"), since the counts dominate stats's norm.
	tolMoEStats = 1e-5
	// AuxGrad: Go's float32 operations in its order, but its two divisions are correctly rounded
	// and Vulkan's within 2.5 ulp: ~3e-7 of the added gradient at most.
	tolAuxGrad = 1e-6
	// AdamW takes √v in float32 (Go: float64) and divides in float32. Compared on the step
	// w − w₀, not on w, so an error is measured against the step; weights are drawn at a GPT's
	// scale (0.02) so that w's own rounding stays far below it.
	tolAdamW = 1e-5
)

// tensor is one argument of a validation case: host data (float32 or int32), whether the op
// writes it (it is then compared), and for AdamW whether to compare the change from its start.
type tensor struct {
	f    []float32
	i    []int32
	out  bool
	step bool
	// norm, when non-zero, is a floor for the reference norm the error is divided by.
	norm float64
}

// vcase is one op on one shape: its tensors, the op (on any model.Device, so that the same code
// runs on Host for the reference and on the Vulkan device), its tolerance and the index of the
// tensor that the perturbation check moves.
type vcase struct {
	name    string
	tol     float64
	tensors []*tensor
	perturb int
	op      func(d model.Device, b []model.Buf) []float64 // returns host scalars (loss, norms)
}

func randn(r *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * scale)
	}
	return x
}

func randTokens(r *rand.Rand, n, V int) []int32 {
	x := make([]int32, n)
	for i := range x {
		x[i] = int32(r.IntN(V))
	}
	return x
}

func fin(x []float32) *tensor   { return &tensor{f: x} }
func fout(x []float32) *tensor  { return &tensor{f: x, out: true} }
func iin(x []int32) *tensor     { return &tensor{i: x} }
func fstep(x []float32) *tensor { return &tensor{f: x, out: true, step: true} }

// cases returns the validation cases: every op of model.Device (and the products it is built
// from) on odd shapes that fill no tile, sizes past one workgroup's 256, and more than one chunk
// of rows for the column sums. Accumulated outputs start non-zero, overwritten ones with noise.
func cases(r *rand.Rand) []vcase {
	var cs []vcase
	mm := func(name string, m, k, n int, acc bool) {
		a, b := randn(r, m*k, 1), randn(r, k*n, 1)
		cs = append(cs, vcase{name: fmt.Sprintf("%s m=%d k=%d n=%d acc=%v", name, m, k, n, acc), tol: tolMatMul,
			tensors: []*tensor{fout(randn(r, m*n, 1)), fin(a), fin(b)}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 {
				if h, ok := d.(model.Host); ok {
					hostMatMul(h, name, x, m, k, n, acc)
				} else {
					v := d.(*Device)
					map[string]func(c, a, b model.Buf, m, k, n int, acc bool){"NN": v.MatMulNN, "NT": v.MatMulNT, "TN": v.MatMulTN}[name](x[0], x[1], x[2], m, k, n, acc)
				}
				return nil
			}})
	}
	for _, s := range [][3]int{{37, 53, 29}, {70, 130, 67}, {1, 1, 1}} {
		for _, acc := range []bool{false, true} {
			mm("NN", s[0], s[1], s[2], acc)
			mm("NT", s[0], s[1], s[2], acc)
			mm("TN", s[0], s[1], s[2], acc)
		}
	}
	cs = append(cs,
		vcase{name: "Add n=1000", tol: tolExact, tensors: []*tensor{fout(randn(r, 1000, 1)), fin(randn(r, 1000, 1))}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 { d.Add(x[0], x[1]); return nil }},
		vcase{name: "Copy n=1001", tol: tolExact, tensors: []*tensor{fout(randn(r, 1001, 1)), fin(randn(r, 1001, 1))}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 { d.Copy(x[0], x[1]); return nil }},
		vcase{name: "Zero then Add n=37", tol: tolExact, tensors: []*tensor{fout(randn(r, 37, 1)), fin(randn(r, 37, 1))}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 { d.Zero(x[0]); d.Add(x[0], x[1]); return nil }},
	)
	for _, s := range [][4]int{{3, 5, 29, 11}, {2, 37, 300, 7}} {
		B, T, C, V := s[0], s[1], s[2], s[3]
		N := B * T
		tok := randTokens(r, N, V)
		cs = append(cs,
			vcase{name: fmt.Sprintf("EncoderForward B=%d T=%d C=%d", B, T, C), tol: tolExact,
				tensors: []*tensor{fout(randn(r, N*C, 1)), iin(tok), fin(randn(r, V*C, 1)), fin(randn(r, T*C, 1))}, perturb: 2,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.EncoderForward(x[0], x[1], x[2], x[3], B, T, C)
					return nil
				}},
			vcase{name: fmt.Sprintf("EncoderBackward B=%d T=%d C=%d", B, T, C), tol: tolExact,
				tensors: []*tensor{fout(randn(r, V*C, 1)), fout(randn(r, T*C, 1)), fin(randn(r, N*C, 1)), iin(tok)}, perturb: 2,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.EncoderBackward(x[0], x[1], x[2], x[3], B, T, C)
					return nil
				}},
		)
	}
	for _, s := range [][2]int{{37, 53}, {5, 300}, {1, 1}} {
		N, C := s[0], s[1]
		cs = append(cs, vcase{name: fmt.Sprintf("LayerNormForward N=%d C=%d", N, C), tol: tolLayerNorm,
			tensors: []*tensor{fout(randn(r, N*C, 1)), fout(randn(r, N, 1)), fout(randn(r, N, 1)), fin(randn(r, N*C, 2)), fin(randn(r, C, 1)), fin(randn(r, C, 1))}, perturb: 3,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.LayerNormForward(x[0], x[1], x[2], x[3], x[4], x[5], N, C)
				return nil
			}})
	}
	for _, s := range [][2]int{{37, 53}, {20, 300}, {100, 29}} {
		N, C := s[0], s[1]
		inp, w := randn(r, N*C, 2), randn(r, C, 1)
		mean, rstd := make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(make([]float32, N*C), mean, rstd, inp, w, randn(r, C, 1), N, C)
		tol := tolLayerNorm
		cs = append(cs, vcase{name: fmt.Sprintf("LayerNormBackward N=%d C=%d", N, C), tol: tol,
			tensors: []*tensor{fout(randn(r, N*C, 1)), fout(randn(r, C, 1)), fout(randn(r, C, 1)), fin(randn(r, N*C, 1)), fin(inp), fin(w), fin(mean), fin(rstd)}, perturb: 3,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.LayerNormBackward(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], N, C)
				return nil
			}})
	}
	for _, s := range [][3]int{{37, 53, 29}, {20, 33, 300}} {
		N, IN, OUT := s[0], s[1], s[2]
		for _, bias := range []bool{false, true} {
			ts := []*tensor{fout(randn(r, N*OUT, 1)), fin(randn(r, N*IN, 1)), fin(randn(r, OUT*IN, 1)), fin(randn(r, OUT, 1))}
			cs = append(cs, vcase{name: fmt.Sprintf("LinearForward N=%d IN=%d OUT=%d bias=%v", N, IN, OUT, bias), tol: tolMatMul,
				tensors: ts, perturb: 1,
				op: func(d model.Device, x []model.Buf) []float64 {
					var b model.Buf
					if bias {
						b = x[3]
					}
					d.LinearForward(x[0], x[1], x[2], b, N, IN, OUT)
					return nil
				}})
		}
	}
	// BiasGrad on its own, where it must be exact (N ≤ 32: one chunk) or within tolColSum.
	for _, N := range []int{31, 71} { // odd: the alternating perturbation must not cancel in a column
		OUT := 29
		cs = append(cs, vcase{name: fmt.Sprintf("LinearBackward db only N=%d OUT=%d", N, OUT), tol: map[bool]float64{true: tolExact, false: tolColSum}[N <= 32],
			tensors: []*tensor{fout(randn(r, OUT, 1)), fin(randn(r, N*OUT, 1))}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 {
				// k = 1: dw += dout[:, :]ᵀ·inp and dinp = dout·w are plain products; only db is compared.
				one, dw, dinp := d.Alloc(N), d.Alloc(OUT), d.Alloc(N)
				d.LinearBackward(dinp, dw, x[0], x[1], one, d.Alloc(OUT), N, 1, OUT, false)
				return nil
			}})
	}
	for _, s := range [][3]int{{37, 53, 29}, {70, 20, 33}} {
		N, IN, OUT := s[0], s[1], s[2]
		for _, accIn := range []bool{false, true} {
			cs = append(cs, vcase{name: fmt.Sprintf("LinearBackward N=%d IN=%d OUT=%d accIn=%v", N, IN, OUT, accIn), tol: tolColSum,
				tensors: []*tensor{fout(randn(r, N*IN, 1)), fout(randn(r, OUT*IN, 1)), fout(randn(r, OUT, 1)), fin(randn(r, N*OUT, 1)), fin(randn(r, N*IN, 1)), fin(randn(r, OUT*IN, 1))}, perturb: 3,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.LinearBackward(x[0], x[1], x[2], x[3], x[4], x[5], N, IN, OUT, accIn)
					return nil
				}})
		}
	}
	for _, s := range [][4]int{{2, 13, 12, 3}, {1, 70, 32, 2}, {1, 1, 4, 1}} {
		B, T, C, H := s[0], s[1], s[2], s[3]
		qkv := randn(r, B*T*3*C, 1)
		att := make([]float32, B*H*T*T)
		kernels.AttentionForward(make([]float32, B*T*C), att, qkv, B, T, C, H)
		cs = append(cs,
			vcase{name: fmt.Sprintf("AttentionForward B=%d T=%d C=%d H=%d", B, T, C, H), tol: tolAttention,
				tensors: []*tensor{fout(randn(r, B*T*C, 1)), fout(randn(r, B*H*T*T, 1)), fin(qkv)}, perturb: 2,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.AttentionForward(x[0], x[1], x[2], B, T, C, H)
					return nil
				}},
			vcase{name: fmt.Sprintf("AttentionBackward B=%d T=%d C=%d H=%d", B, T, C, H), tol: tolAttention,
				tensors: []*tensor{fout(randn(r, B*T*3*C, 1)), fin(randn(r, B*T*C, 1)), fin(qkv), fin(att)}, perturb: 1,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.AttentionBackward(x[0], x[1], x[2], x[3], B, T, C, H)
					return nil
				}},
		)
	}
	for _, n := range []int{1, 1000} {
		inp := randn(r, n, 2)
		th := make([]float32, n)
		kernels.GELUForward(make([]float32, n), th, inp)
		cs = append(cs,
			vcase{name: fmt.Sprintf("GELUForward n=%d", n), tol: tolGELU,
				tensors: []*tensor{fout(randn(r, n, 1)), fout(randn(r, n, 1)), fin(inp)}, perturb: 2,
				op: func(d model.Device, x []model.Buf) []float64 { d.GELUForward(x[0], x[1], x[2]); return nil }},
			vcase{name: fmt.Sprintf("GELUBackward n=%d", n), tol: tolGELU,
				tensors: []*tensor{fout(randn(r, n, 1)), fin(inp), fin(th), fin(randn(r, n, 1))}, perturb: 3,
				op: func(d model.Device, x []model.Buf) []float64 { d.GELUBackward(x[0], x[1], x[2], x[3]); return nil }},
		)
	}
	for _, s := range [][2]int{{37, 29}, {3, 300}, {1, 2}} {
		N, V := s[0], s[1]
		tg := randTokens(r, N, V)
		k := 0.7 / float64(N)
		cs = append(cs,
			vcase{name: fmt.Sprintf("CrossEntropyForward N=%d V=%d", N, V), tol: tolSoftmax,
				tensors: []*tensor{fin(randn(r, N*V, 2)), iin(tg)}, perturb: 0,
				op: func(d model.Device, x []model.Buf) []float64 {
					return []float64{d.CrossEntropyForward(x[0], x[1], N, V)}
				}},
			vcase{name: fmt.Sprintf("CrossEntropyBackward N=%d V=%d", N, V), tol: tolSoftmax,
				tensors: []*tensor{{f: randn(r, N*V, 2), out: true, norm: k * math.Sqrt(float64(N))}, iin(tg)}, perturb: 0,
				op: func(d model.Device, x []model.Buf) []float64 {
					d.CrossEntropyBackward(x[0], x[1], N, V, 0.7)
					return nil
				}},
		)
	}
	for _, s := range [][2]int{{37, 5}, {3, 300}} {
		N, E := s[0], s[1]
		cs = append(cs, vcase{name: fmt.Sprintf("SoftmaxRows N=%d E=%d", N, E), tol: tolSoftmax,
			tensors: []*tensor{fout(randn(r, N*E, 2))}, perturb: 0,
			op: func(d model.Device, x []model.Buf) []float64 { d.SoftmaxRows(x[0], N, E); return nil }})
	}
	// MoE routing on shapes that fill no workgroup, C past one workgroup's 256, K from 1 to E,
	// and E up to 64; the router's probabilities are softmax rows, its gate and mask their top K.
	for _, s := range [][4]int{{37, 53, 5, 1}, {37, 53, 4, 2}, {70, 300, 8, 2}, {33, 29, 64, 3}, {1, 1, 2, 2}} {
		N, C, E, K := s[0], s[1], s[2], s[3]
		cs = append(cs, moeCases(r, N, C, E, K)...)
	}
	{
		// Ties: probabilities of a few levels, so that most rows hold equal ones, which go to the
		// lower index.
		N, E, K := 37, 5, 2
		probs := make([]float32, N*E)
		for i := range probs {
			probs[i] = float32(r.IntN(3)) / 4
		}
		cs = append(cs, vcase{name: fmt.Sprintf("TopKGate ties N=%d E=%d K=%d", N, E, K), tol: tolExact,
			tensors: []*tensor{fout(randn(r, N*E, 1)), fout(randn(r, N*E, 1)), fin(probs)}, perturb: 2,
			op: func(d model.Device, x []model.Buf) []float64 { d.TopKGate(x[0], x[1], x[2], N, E, K); return nil }})
	}
	for _, n := range []int{1, 1000} {
		v := randn(r, n, 1e-3)
		for i := range v {
			v[i] *= v[i] // a second moment is positive
		}
		cs = append(cs, vcase{name: fmt.Sprintf("AdamW n=%d", n), tol: tolAdamW,
			tensors: []*tensor{fstep(randn(r, n, 0.02)), fin(randn(r, n, 1e-2)), fout(randn(r, n, 1e-3)), fout(v)}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.AdamW(x[0], x[1], x[2], x[3], 0.99, 1e-2/0.1, math.Sqrt(0.05), 0.8)
				return nil
			}})
	}
	cs = append(cs, vcase{name: "SquaredNorms n=1,37,5000,9000", tol: tolSumSq,
		tensors: []*tensor{fin(randn(r, 1, 1)), fin(randn(r, 37, 1)), fin(randn(r, 5000, 1)), fin(randn(r, 9000, 1))}, perturb: 3,
		op: func(d model.Device, x []model.Buf) []float64 {
			if nd, ok := d.(model.NormDevice); ok {
				return nd.SquaredNorms(x)
			}
			out := make([]float64, len(x)) // Host: kernels' float64 sums in element order
			for i, b := range x {
				h := make([]float32, b.Len())
				d.Read(h, b)
				for _, v := range h {
					out[i] += float64(v) * float64(v)
				}
			}
			return out
		}})
	return cs
}

// moeCases returns the cases of the MoE routing ops on one shape: N rows of C channels, E
// experts, K per row.
func moeCases(r *rand.Rand, N, C, E, K int) []vcase {
	// A router that favours expert 0, as the balancing loss is there to correct: with balanced
	// counts the loss hardly moves when the probabilities of alternate experts move by ±1%, and
	// its perturbation check could not fail.
	probs := randn(r, N*E, 1)
	for i := 0; i < N*E; i += E {
		probs[i] += 1.5
	}
	kernels.SoftmaxRows(probs, N, E)
	gate, mask := make([]float32, N*E), make([]float32, N*E)
	kernels.TopKGate(gate, mask, probs, N, E, K)
	stats := make([]float32, E+1)
	kernels.MoEStats(stats, mask, probs, N, E, K)
	// The experts GateRows and GateGrad run for: the first and the last that some row is routed
	// to, so that what they compute is not all zeros.
	e0, e1 := -1, 0
	for e := range E {
		if stats[e] > 0 {
			if e0 < 0 {
				e0 = e
			}
			e1 = e
		}
	}
	shape := fmt.Sprintf("N=%d C=%d E=%d K=%d", N, C, E, K)
	var cs []vcase
	cs = append(cs, vcase{name: "TopKGate " + shape, tol: tolExact,
		tensors: []*tensor{fout(randn(r, N*E, 1)), fout(randn(r, N*E, 1)), fin(probs)}, perturb: 2,
		op: func(d model.Device, x []model.Buf) []float64 { d.TopKGate(x[0], x[1], x[2], N, E, K); return nil }})
	for _, acc := range []bool{false, true} {
		e, tol, perturb := e0, float64(tolExact), 1
		if acc {
			e, tol, perturb = e1, tolGate, 2
		}
		cs = append(cs, vcase{name: fmt.Sprintf("GateRows %s e=%d acc=%v", shape, e, acc), tol: tol,
			tensors: []*tensor{fout(randn(r, N*C, 1)), fin(randn(r, N*C, 1)), fin(gate)}, perturb: perturb,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.GateRows(x[0], x[1], x[2], e, N, C, E, acc)
				return nil
			}})
	}
	for _, e := range []int{e0, e1} {
		cs = append(cs, vcase{name: fmt.Sprintf("GateGrad %s e=%d", shape, e), tol: tolGateGrad,
			tensors: []*tensor{fout(randn(r, N*E, 1)), fin(randn(r, N*C, 1)), fin(randn(r, N*C, 1)), fin(mask)}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.GateGrad(x[0], x[1], x[2], x[3], e, N, C, E)
				return nil
			}})
	}
	cs = append(cs,
		// The counts alone, bit for bit: copied out of stats, whose loss has its own tolerance.
		vcase{name: "MoEStats counts " + shape, tol: tolExact,
			tensors: []*tensor{fout(randn(r, E, 1)), fin(mask), fin(probs)}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 {
				s := d.Alloc(E + 1)
				d.MoEStats(s, x[1], x[2], N, E, K)
				d.Copy(x[0], d.Slice(s, 0, E))
				d.Free(s)
				return nil
			}},
		// With K = E every row goes to every expert and the loss is Σ_e P_e whatever the
		// probabilities: the check moves the mask instead.
		vcase{name: "MoEStats " + shape, tol: tolMoEStats,
			tensors: []*tensor{fout(randn(r, E+1, 1)), fin(mask), fin(probs)}, perturb: map[bool]int{true: 1, false: 2}[K == E],
			op: func(d model.Device, x []model.Buf) []float64 {
				d.MoEStats(x[0], x[1], x[2], N, E, K)
				s := make([]float32, E+1)
				d.Read(s, x[0])
				return []float64{float64(s[E])} // the loss, compared on its own
			}},
		// dgate at the scale of the gradient added, so that a 1% error in it shows.
		vcase{name: "AuxGrad " + shape, tol: tolAuxGrad,
			tensors: []*tensor{fout(randn(r, N*E, 1e-2)), fin(stats)}, perturb: 1,
			op: func(d model.Device, x []model.Buf) []float64 { d.AuxGrad(x[0], x[1], N, E, K, 0.7); return nil }},
		vcase{name: fmt.Sprintf("SoftmaxBackwardRows N=%d E=%d", N, E), tol: tolGate,
			tensors: []*tensor{fout(randn(r, N*E, 1)), fin(probs), fin(randn(r, N*E, 1))}, perturb: 2,
			op: func(d model.Device, x []model.Buf) []float64 {
				d.SoftmaxBackwardRows(x[0], x[1], x[2], N, E)
				return nil
			}},
	)
	return cs
}

func hostMatMul(h model.Host, layout string, x []model.Buf, m, k, n int, acc bool) {
	// Host has no matmul op of its own (LinearForward and LinearBackward are its products):
	// read the operands and multiply with package kernels, which Host's ops call.
	c, a, b := make([]float32, m*n), make([]float32, x[1].Len()), make([]float32, x[2].Len())
	h.Read(c, x[0])
	h.Read(a, x[1])
	h.Read(b, x[2])
	map[string]func(c, a, b []float32, m, k, n int, acc bool){"NN": kernels.MatMulNN, "NT": kernels.MatMulNT, "TN": kernels.MatMulTN}[layout](c, a, b, m, k, n, acc)
	h.Write(x[0], c)
}
