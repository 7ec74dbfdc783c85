package model

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
)

// Finite-difference checks. The model is float32, so a derivative is checked along a direction
// rather than per coordinate: for each tensor X with analytic gradient g, the central difference
// (L(X + h·d) − L(X − h·d)) / 2h must match ⟨g, d⟩ for d = g/‖g‖ (where the signal is largest)
// and for a random unit d (which catches a gradient that is right in magnitude but wrong in
// direction). L accumulates in float64; h = 1e-3 keeps float32 rounding and curvature both below
// the tolerance. Routing is piecewise constant: a case whose perturbation changes which experts
// a token picks is not differentiable there, and the check says so rather than passing blindly.

type fdTensor struct {
	name string
	x    []float32 // the tensor, perturbed in place
	g    []float32 // its analytic gradient
}

// fdCheck compares analytic gradients with central differences of loss for every tensor.
// loss returns L and a fingerprint of any discrete choice (the routing) made on the way.
func fdCheck(t *testing.T, tensors []fdTensor, loss func() (float64, string), rtol float64) {
	t.Helper()
	r := rand.New(rand.NewPCG(11, 12))
	l0, route0 := loss()
	for _, tt := range tensors {
		gn := norm(tt.g)
		rnd := make([]float32, len(tt.x))
		for i := range rnd {
			rnd[i] = float32(r.NormFloat64())
		}
		dirs := map[string][]float32{"random": scaled(rnd, 1/norm(rnd))}
		if gn > 0 {
			dirs["gradient"] = scaled(tt.g, 1/gn)
		}
		for dname, d := range dirs {
			orig := slices.Clone(tt.x)
			at := func(h float32) (float64, string) {
				for i := range tt.x {
					tt.x[i] = orig[i] + h*d[i]
				}
				return loss()
			}
			// The largest step whose perturbation keeps the routing: float32 rounding of L
			// (≈ 1e-7·|L| per evaluation) divided by 2h is the noise floor of the estimate.
			var fd, h float64
			ok := false
			central := func(h float64) (float64, bool) {
				lp, rp := at(float32(h))
				lm, rm := at(float32(-h))
				return (lp - lm) / (2 * h), rp == route0 && rm == route0
			}
			for _, h = range []float64{1e-2, 3e-3, 1e-3, 3e-4} {
				d1, ok1 := central(h)
				d2, ok2 := central(h / 2)
				if ok1 && ok2 {
					// Richardson extrapolation cancels the h² term of the central difference.
					fd, ok = (4*d2-d1)/3, true
					break
				}
			}
			copy(tt.x, orig)
			if !ok {
				t.Errorf("%s/%s: every step size changed the routing; pick another seed", tt.name, dname)
				continue
			}
			var an float64
			for i := range d {
				an += float64(tt.g[i]) * float64(d[i])
			}
			// Tolerance relative to ‖g‖ (along a random direction ⟨g,d⟩ can be tiny) plus the
			// rounding floor.
			tol := rtol*math.Max(gn, math.Abs(an)) + 4e-7*math.Max(1, math.Abs(l0))/h
			if math.Abs(fd-an) > tol {
				t.Errorf("%s along %s (h %.0e): finite difference %.6g, analytic %.6g (‖g‖ %.3g, tol %.2g)", tt.name, dname, h, fd, an, gn, tol)
			}
		}
	}
}

func norm(v []float32) float64 {
	var s float64
	for _, x := range v {
		s += float64(x) * float64(x)
	}
	return math.Sqrt(s)
}

func scaled(v []float32, s float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(float64(x) * s)
	}
	return out
}

func randn(r *rand.Rand, n int, std float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64() * std)
	}
	return v
}

// weighted is Σ w_i·out_i in float64: a scalar loss whose gradient with respect to out is w.
func weighted(out, w []float32) float64 {
	var s float64
	for i := range out {
		s += float64(out[i]) * float64(w[i])
	}
	return s
}

func TestGradLayerNorm(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	N, C := 7, 13
	inp, w, b := randn(r, N*C, 1), randn(r, C, 1), randn(r, C, 1)
	out, mean, rstd, rw := make([]float32, N*C), make([]float32, N), make([]float32, N), randn(r, N*C, 1)
	kernels.LayerNormForward(out, mean, rstd, inp, w, b, N, C)
	dinp, dw, db := make([]float32, N*C), make([]float32, C), make([]float32, C)
	kernels.LayerNormBackward(dinp, dw, db, rw, inp, w, mean, rstd, N, C)
	fdCheck(t, []fdTensor{{"inp", inp, dinp}, {"weight", w, dw}, {"bias", b, db}}, func() (float64, string) {
		kernels.LayerNormForward(out, mean, rstd, inp, w, b, N, C)
		return weighted(out, rw), ""
	}, 1e-3)
}

func TestGradLinear(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	N, IN, OUT := 9, 7, 5
	inp, w, b, rw := randn(r, N*IN, 1), randn(r, OUT*IN, 1), randn(r, OUT, 1), randn(r, N*OUT, 1)
	out := make([]float32, N*OUT)
	dinp, dw, db := make([]float32, N*IN), make([]float32, OUT*IN), make([]float32, OUT)
	kernels.LinearBackward(dinp, dw, db, rw, inp, w, N, IN, OUT, false)
	fdCheck(t, []fdTensor{{"inp", inp, dinp}, {"weight", w, dw}, {"bias", b, db}}, func() (float64, string) {
		kernels.LinearForward(out, inp, w, b, N, IN, OUT)
		return weighted(out, rw), ""
	}, 1e-3)
}

func TestGradAttention(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 3))
	B, T, C, H := 2, 5, 8, 2
	qkv, rw := randn(r, B*T*3*C, 1), randn(r, B*T*C, 1)
	out, att := make([]float32, B*T*C), make([]float32, B*H*T*T)
	kernels.AttentionForward(out, att, qkv, B, T, C, H)
	dqkv := make([]float32, B*T*3*C)
	kernels.AttentionBackward(dqkv, rw, qkv, att, B, T, C, H)
	fdCheck(t, []fdTensor{{"qkv", qkv, dqkv}}, func() (float64, string) {
		kernels.AttentionForward(out, att, qkv, B, T, C, H)
		return weighted(out, rw), ""
	}, 1e-3)
}

func TestGradGELU(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 4))
	inp, rw := randn(r, 50, 2), randn(r, 50, 1)
	out, th, dinp := make([]float32, 50), make([]float32, 50), make([]float32, 50)
	kernels.GELUForward(out, th, inp)
	kernels.GELUBackward(dinp, inp, th, rw)
	fdCheck(t, []fdTensor{{"inp", inp, dinp}}, func() (float64, string) {
		kernels.GELUForward(out, th, inp)
		return weighted(out, rw), ""
	}, 1e-3)
}

func TestGradCrossEntropy(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 5))
	N, V := 6, 11
	logits := randn(r, N*V, 2)
	targets := make([]int32, N)
	for i := range targets {
		targets[i] = int32(r.IntN(V))
	}
	g := slices.Clone(logits)
	kernels.CrossEntropyBackward(g, targets, N, V, 1)
	fdCheck(t, []fdTensor{{"logits", logits, g}}, func() (float64, string) {
		return kernels.CrossEntropyForward(logits, targets, N, V), ""
	}, 1e-3)
}

func TestGradEncoder(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 6))
	B, T, C, V := 2, 4, 3, 5
	wte, wpe, rw := randn(r, V*C, 1), randn(r, T*C, 1), randn(r, B*T*C, 1)
	inp := []int32{0, 1, 1, 4, 3, 3, 3, 0}
	out := make([]float32, B*T*C)
	dwte, dwpe := make([]float32, V*C), make([]float32, T*C)
	kernels.EncoderBackward(dwte, dwpe, rw, inp, B, T, C)
	fdCheck(t, []fdTensor{{"wte", wte, dwte}, {"wpe", wpe, dwpe}}, func() (float64, string) {
		kernels.EncoderForward(out, inp, wte, wpe, B, T, C)
		return weighted(out, rw), ""
	}, 1e-3)
}

// TestGradMoE checks the router, the top-k combine, the experts and the balancing loss together.
func TestGradMoE(t *testing.T) {
	for _, k := range []int{1, 2} {
		t.Run(fmt.Sprintf("top%d", k), func(t *testing.T) {
			cfg := Config{VocabSize: 8, BlockSize: 8, NLayer: 2, NHead: 1, NEmbd: 6, MLPRatio: 2,
				MoEEvery: 2, NExpert: 4, TopK: k, AuxLossCoef: 0.5}
			r := rand.New(rand.NewPCG(2, uint64(k)))
			N, C := 12, cfg.NEmbd
			var experts []*Expert
			var tensors []fdTensor
			for e := 0; e < cfg.NExpert; e++ {
				p, g := NewParams(cfg.ExpertSpecs(1, e)), NewParams(cfg.ExpertSpecs(1, e))
				for i, tt := range p.Tensors {
					copy(tt.Data, randn(r, len(tt.Data), 0.5))
					tensors = append(tensors, fdTensor{tt.Name, tt.Data, g.Tensors[i].Data})
				}
				experts = append(experts, NewExpert(cfg, 1, e, p, g))
			}
			local := NewLocalExperts(experts...)
			ln, router, rw := randn(r, N*C, 1), randn(r, cfg.NExpert*C, 1), randn(r, N*C, 1)
			out, dln, drouter := make([]float32, N*C), make([]float32, N*C), make([]float32, cfg.NExpert*C)
			coef := float32(cfg.AuxLossCoef)
			var a moeActs
			var st moeStaging
			h := Host{}
			if err := moeForward(h, &st, &a, h.wrap(out), h.wrap(ln), h.wrap(router), local, 1, 0, N, N/2, cfg, nil); err != nil {
				t.Fatal(err)
			}
			if err := moeBackward(h, &st, &a, h.wrap(dln), h.wrap(drouter), h.wrap(rw), h.wrap(ln), h.wrap(router), local, 1, 0, N, cfg, coef); err != nil {
				t.Fatal(err)
			}
			tensors = append(tensors, fdTensor{"ln", ln, dln}, fdTensor{"router", router, drouter})
			fdCheck(t, tensors, func() (float64, string) {
				var a moeActs
				if err := moeForward(h, &st, &a, h.wrap(out), h.wrap(ln), h.wrap(router), local, 1, 0, N, N/2, cfg, nil); err != nil {
					t.Fatal(err)
				}
				local.Reset()
				return weighted(out, rw) + float64(coef)*a.aux, fmt.Sprint(a.idx)
			}, 1e-3)
		})
	}
}

// TestGradModel checks d(CE + coef·aux)/dθ of the whole tiny model for every tensor.
func TestGradModel(t *testing.T) {
	for _, k := range []int{1, 2} {
		t.Run(fmt.Sprintf("top%d", k), func(t *testing.T) {
			cfg := Config{VocabSize: 32, BlockSize: 8, NLayer: 4, NHead: 2, NEmbd: 16, MLPRatio: 2,
				MoEEvery: 2, NExpert: 4, TopK: k, AuxLossCoef: 0.1}
			m := perturbedModel(t, cfg, 5)
			// Larger weights than GPT-2's init give gradients well above float32 noise.
			for _, tt := range m.P.Tensors {
				for i := range tt.Data {
					tt.Data[i] *= 4
				}
			}
			r := rand.New(rand.NewPCG(5, 5))
			B, T := 3, cfg.BlockSize
			x, y := make([]int32, B*T), make([]int32, B*T)
			for i := range x {
				x[i], y[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
			}
			if _, err := m.Gradients(x, y, B, 1); err != nil {
				t.Fatal(err)
			}
			var tensors []fdTensor
			for i, tt := range m.P.Tensors {
				tensors = append(tensors, fdTensor{tt.Name, tt.Data, m.G.Tensors[i].Data})
			}
			fdCheck(t, tensors, func() (float64, string) {
				out, err := m.Stage.Forward(0, StageInput{B: B, T: T, Tokens: x, Targets: y})
				if err != nil {
					t.Fatal(err)
				}
				var route string
				for i := range m.Stage.blocks {
					if m.Stage.blocks[i].moe {
						route += fmt.Sprint(m.Stage.acts[0].blocks[i].moe.idx)
					}
				}
				m.Stage.Release(0)
				m.Experts.Reset()
				l := out.CE
				for _, a := range out.Aux {
					l += cfg.AuxLossCoef * a
				}
				return l, route
			}, 2e-3)
		})
	}
}

func TestTanh32(t *testing.T) {
	worst := 0.0
	for x := -12.0; x <= 12; x += 1e-4 {
		got, want := float64(kernels.Tanh32(float32(x))), math.Tanh(float64(float32(x)))
		e := math.Abs(got - want)
		if want != 0 {
			e /= math.Abs(want)
		}
		worst = max(worst, e)
	}
	if worst > 1e-6 {
		t.Fatalf("Tanh32 worst relative error %.3g", worst)
	}
}
