package model

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestOuterDeltaLimitHoldsForAdamW runs the real AdamW (Update) for rounds of H steps from
// optimizer steps t0 early and late, after histories of gradients of every kind — random, of one
// sign (Adam's largest steps), spikes after calm, vanishing, clipped by tiny factors — and checks
// that no parameter moves further than OuterDeltaLimit allows, while the limit stays within a
// small factor of the largest movement seen (a limit that allows anything protects nothing).
func TestOuterDeltaLimitHoldsForAdamW(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 512
	specs := []Spec{{Name: "w", Shape: []int{16, n / 16}}} // 2-D: weight decay applies
	worst := 0.0                                           // the largest movement / limit seen
	for trial := range 60 {
		H := 1 + rng.IntN(30)
		t0 := 1 + rng.IntN(2000)
		if trial%3 == 0 {
			t0 = 1 + rng.IntN(3)
		}
		wd := []float64{0, 0.1, 1}[trial%3]
		p, g, opt := NewParams(specs), NewParams(specs), NewAdamW(specs)
		w, gr := p.Tensors[0].Data, g.Tensors[0].Data
		for i := range w {
			w[i] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(5)-3)))
		}
		kind := trial % 5
		grad := func(s int) {
			for i := range gr {
				switch kind {
				case 0:
					gr[i] = float32(rng.NormFloat64())
				case 1: // one sign, constant: Adam's steps approach lr each
					gr[i] = 1
				case 2: // calm, then spikes in the round
					gr[i] = 1e-6
					if s >= t0-1 && rng.IntN(4) == 0 {
						gr[i] = float32(rng.NormFloat64() * 1e3)
					}
				case 3: // vanishing
					gr[i] = float32(rng.NormFloat64() * math.Pow(10, -float64(rng.IntN(30))))
				case 4: // one sign after a history of the other
					gr[i] = -1
					if s >= t0-1 {
						gr[i] = 1
					}
				}
			}
		}
		// The history: the optimizer's steps before the round, on the same parameters.
		for s := 1; s < t0 && s < 200; s++ {
			grad(s)
			opt.Update(p, g, s, 1e-3, wd, 1)
		}
		theta0 := append([]float32(nil), w...)
		lrs := make([]float64, H)
		for k := range lrs {
			lrs[k] = 1e-3 * (0.1 + rng.Float64())
			grad(t0 + k)
			clip := float32(1)
			if rng.IntN(3) == 0 {
				clip = float32(rng.Float64())
			}
			opt.Update(p, g, t0+k, lrs[k], wd, clip)
		}
		pm, l := AdamWMovement(lrs, t0)
		for i := range w {
			moved := math.Abs(float64(theta0[i]) - float64(w[i]))
			limit := OuterDeltaLimit(float64(theta0[i]), pm, l, wd)
			// float32 rounding of each step's update, a few ulps of the parameter a step
			if slack := float64(H) * (math.Abs(float64(theta0[i])) + limit) * 0x1p-21; moved > limit+slack {
				t.Fatalf("trial %d (kind %d, t0 %d, H %d, wd %g) element %d moved %g, beyond the limit %g", trial, kind, t0, H, wd, i, moved, limit)
			}
			worst = max(worst, moved/limit)
		}
	}
	if worst < 0.5 {
		t.Errorf("the largest movement was %.2f of the limit: the limit is far from tight", worst)
	}
	t.Logf("largest movement: %.3f of the limit", worst)
}

// TestAdamWMovementFirstStep: one step from fresh moments moves by lr exactly (A(1) = 1), so P is
// lr; later steps allow a little more (A(t) → (1−β1)/√(1−β2)/√(1−β1²/β2), about 1.165).
func TestAdamWMovementFirstStep(t *testing.T) {
	if p, l := AdamWMovement([]float64{2e-3}, 1); math.Abs(p-2e-3) > 1e-15 || l != 2e-3 {
		t.Fatalf("one step at t 1: P %g, L %g; want 2e-3 and 2e-3", p, l)
	}
	p, _ := AdamWMovement([]float64{1}, 100000)
	want := (1 - Beta1) / math.Sqrt(1-Beta2) / math.Sqrt(1-Beta1*Beta1/Beta2)
	if math.Abs(p-want) > 1e-9 {
		t.Fatalf("A(large t) = %g, want %g", p, want)
	}
}
