package kernels

// Int8 with error feedback, the round trip that outer mode's pseudo-gradients take (model/outer.go,
// Int8EF): the scalar definition here, with a vector loop for the bulk where the CPU has one
// (int8ef_amd64.s). An outer step rounds every parameter twice (each replica's pseudo-gradient,
// then their average), so on a CPU worker these loops are most of the step's arithmetic.

// Int8ErrorFeedback replaces x, one chunk of a tensor, by its round trip through int8 with error
// feedback e (len(x)): u = x + e (float32) is quantised at one scale s = Int8Scale(u); x becomes
// round(u) = Int8Value(Int8Quant(u, s), s) and e the part left behind, u − round(u). The codes go
// to codes when it is not nil (len(x)). It returns s: codes and s are what crosses the network,
// from which the receiver decodes x exactly.
//
// The vector loop does each element's operations in the scalar code's order — a float32 sum, a
// float32 division, rounding to even, a clamp, a float32 product and a difference — so its bits
// are the scalar code's; chunks whose scale is 0 or whose values or products are not all finite
// take the scalar code throughout.
func Int8ErrorFeedback(x, e []float32, codes []int8) float32 {
	e = e[:len(x)]
	if codes != nil {
		codes = codes[:len(x)]
	}
	i := int8AddVec(x, e)
	for ; i < len(x); i++ {
		x[i] += e[i]
	}
	s, ok := int8ScaleVec(x)
	if !ok {
		s = Int8Scale(x)
	}
	i = 0
	if s != 0 && finite32(s) && finite32(127*s) {
		i = int8QuantVec(x, e, codes, s)
	}
	for ; i < len(x); i++ {
		u := x[i]
		c := Int8Quant(u, s)
		r := Int8Value(c, s)
		e[i] = u - r
		x[i] = r
		if codes != nil {
			codes[i] = c
		}
	}
	return s
}

// OuterNesterov is the outer step's Nesterov update with momentum mu and learning rate lr on
// parameters g and momentum v (float32) by pseudo-gradient d (float64, len(g)), element by
// element as torch.optim.SGD(nesterov=True) computes it: v = float32(μ·v + d);
// g = float32(g − lr·(d + μ·v)), each right side in float64 and rounded once. Every product is
// rounded on its own, never fused into a multiply-add, so the bits are the same on every
// architecture, and the vector loop's are the scalar loop's.
func OuterNesterov(g, v []float32, d []float64, lr, mu float64) {
	v, d = v[:len(g)], d[:len(g)]
	for i := nesterovVec(g, v, d, lr, mu); i < len(g); i++ {
		// The explicit conversions round every product, so that no compiler fuses one into a
		// multiply-add (the Go spec allows it elsewhere).
		nv := float32(float64(mu*float64(v[i])) + d[i])
		v[i] = nv
		g[i] = float32(float64(g[i]) - float64(lr*(d[i]+float64(mu*float64(nv)))))
	}
}
