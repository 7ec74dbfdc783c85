package model

import "math"

// How far an honest replica can move a parameter in one round of outer mode, so that a stage can
// refuse a pseudo-gradient no honest replica could have sent (client/outer.go) before it touches
// the global θ: a peer that sends NaN, or a pseudo-gradient of 1e30, would otherwise poison
// every replica's parameters at once.
//
// AdamW moves a parameter, at step t (1-based) with learning rate lr, by
// lr·m̂/(√v̂ + eps) + lr·wd·|θ| at most (Update: decay, then the Adam step), m̂ = m/(1 − β1^t),
// v̂ = v/(1 − β2^t). Whatever the gradients g_i (clipped or not, zero before the replica joined),
// Cauchy–Schwarz bounds the first term: with m = (1−β1)·Σ β1^(t−i)·g_i and
// v = (1−β2)·Σ β2^(t−i)·g_i²,
//
//	|m| ≤ (1−β1)/√(1−β2) · √(Σ_{k<t} (β1²/β2)^k) · √v,
//
// so |m̂|/√v̂ ≤ A(t) = (1−β1)/√(1−β2) · √(Σ_{k<t} (β1²/β2)^k) · √(1−β2^t)/(1−β1^t): 1 at t = 1
// (one gradient moves a parameter by lr exactly), about 1.17 for large t with β1 = 0.9 and
// β2 = 0.95. The eps only lowers it. Over a round's steps the Adam terms add up to at most
// P = Σ lr_s·A(t_s); the parameter stays within |θ0| + P of zero, θ0 the global value it started
// the round from (decay only shrinks it), so the whole round moves it by at most
// OuterDeltaLimit = P + wd·L·(|θ0| + P), L = Σ lr_s.

// AdamWMovement returns P = Σ lr_s·A(t_s) and L = Σ lr_s over AdamW steps with learning rates
// lrs, the first of them the optimizer's step t0 (1-based; see above).
func AdamWMovement(lrs []float64, t0 int) (p, l float64) {
	r := Beta1 * Beta1 / Beta2 // < 1 for the betas Shoal uses
	c := (1 - Beta1) / math.Sqrt(1-Beta2)
	for i, lr := range lrs {
		t := float64(t0 + i)
		sum := (1 - math.Pow(r, t)) / (1 - r) // Σ_{k<t} r^k
		a := c * math.Sqrt(sum) * math.Sqrt(1-math.Pow(Beta2, t)) / (1 - math.Pow(Beta1, t))
		p += math.Abs(lr) * a
		l += math.Abs(lr)
	}
	return p, l
}

// OuterDeltaLimit bounds |θ0 − θ_r| for a parameter whose global value at the round's start was
// theta0, after the round's AdamW steps of movement p and learning-rate sum l (AdamWMovement) with
// weight decay wd.
func OuterDeltaLimit(theta0, p, l, wd float64) float64 {
	return p + math.Abs(wd)*l*(math.Abs(theta0)+p)
}
