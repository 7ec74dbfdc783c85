//go:build !purego && !amd64.v3

package kernels

// Vector loops for the elementwise layers that cost most once the multiplies are fast:
// GELUForward (gelu_amd64.s, Tanh32 on every hidden activation) and AdamW (adamw_amd64.s, every
// parameter). AVX2, eight floats at a time, each doing the Go loop's operations in the Go loop's
// order, so that its bits are the Go loop's; the Go loop finishes the last few elements. Only
// below GOAMD64=v3: from v3 on the compiler may fuse the Go loops' multiply-adds, which the
// assembly does not.

//go:noescape
func geluForwardAVX2(out, th, inp *float32, n int, c *[geluConsts * 8]float32)

// geluVector reports whether GELUForward uses the vector loop; tests turn it off to compare.
var geluVector = func() bool { avx2, _ := cpuFeatures(); return avx2 }()

var geluConstsAVX2 = geluConstants()

//go:noescape
func geluForwardAVX512(out, th, inp *float32, n int, c *[geluConsts * 8]float32)

//go:noescape
func geluBackwardAVX512(dinp, inp, th, dout *float32, n int, c *[4]float32)

// gelu512 reports whether the GELU loops take sixteen at a time where they can (AVX-512); tests
// turn it off to compare.
var gelu512 = func() bool { _, avx512 := cpuFeatures(); return avx512 }()

// geluForwardVector computes the first n &^ 7 elements and returns how many it did: sixteen at a
// time while it can, where the CPU has AVX-512, then eight (the same operations either way).
func geluForwardVector(out, th, inp []float32) int {
	n := len(inp) &^ 7
	if !geluVector || n == 0 {
		return 0
	}
	_, _ = out[n-1], th[n-1]
	i := 0
	if n16 := n &^ 15; gelu512 && n16 > 0 {
		geluForwardAVX512(&out[0], &th[0], &inp[0], n16, &geluConstsAVX2)
		i = n16
	}
	if i < n {
		geluForwardAVX2(&out[i], &th[i], &inp[i], n-i, &geluConstsAVX2)
	}
	return n
}

// The optimizer's vector loop (adamw_amd64.s), on the same terms as GELUForward's.

//go:noescape
func adamwAVX2(w, grad, m, v *float32, n int, c *[8]float32, sqrtBC2 float64)

// adamVector reports whether adamwRange uses the vector loop; tests turn it off to compare.
var adamVector = geluVector

// adamwVector updates the first len(w) &^ 7 elements and returns how many it did.
func adamwVector(w, g, m, v []float32, decay, stepSize float32, sqrtBC2 float64, gradScale float32) int {
	n := len(w) &^ 7
	if !adamVector || n == 0 {
		return 0
	}
	_, _, _ = g[n-1], m[n-1], v[n-1]
	c := [8]float32{Beta1, 1 - Beta1, Beta2, 1 - Beta2, AdamEps, decay, stepSize, gradScale}
	adamwAVX2(&w[0], &g[0], &m[0], &v[0], n, &c, sqrtBC2)
	return n
}

//go:noescape
func geluBackwardAVX2(dinp, inp, th, dout *float32, n int, c *[4]float32)

// geluBackwardVector computes the first len(inp) &^ 7 elements and returns how many it did.
func geluBackwardVector(dinp, inp, th, dout []float32) int {
	n := len(inp) &^ 7
	if !geluVector || n == 0 {
		return 0
	}
	_, _, _ = dinp[n-1], th[n-1], dout[n-1]
	c := [4]float32{0.5, 1, geluScale, 3 * geluCubic}
	i := 0
	if n16 := n &^ 15; gelu512 && n16 > 0 {
		geluBackwardAVX512(&dinp[0], &inp[0], &th[0], &dout[0], n16, &c)
		i = n16
	}
	if i < n {
		geluBackwardAVX2(&dinp[i], &inp[i], &th[i], &dout[i], n-i, &c)
	}
	return n
}

// LayerNormBackward's elementwise loops (layernorm_amd64.s), on the same terms.

//go:noescape
func lnDxAVX2(di, x, w, d *float32, n int, c *[4]float32)

//go:noescape
func lnParamsAVX2(db, dw, x, d *float32, n int, c *[2]float32)

//go:noescape
func lnRowAVX2(o, x, w, b *float32, n int, c *[2]float64)

// lnVector reports whether LayerNorm uses the vector loops; tests turn it off to compare.
var lnVector = geluVector

// lnRowVector does the first len(x) &^ 7 elements of a row's normalisation (LayerNormForward)
// and returns how many.
func lnRowVector(o, x, w, b []float32, m, rs float64) int {
	n := len(x) &^ 7
	if !lnVector || n == 0 {
		return 0
	}
	_, _, _ = o[n-1], w[n-1], b[n-1]
	c := [2]float64{m, rs}
	lnRowAVX2(&o[0], &x[0], &w[0], &b[0], n, &c)
	return n
}

// lnDxVector does the first len(x) &^ 7 elements of a row's input gradient and returns how many.
func lnDxVector(di, x, w, d []float32, m, rs, dm, dnm float32) int {
	n := len(x) &^ 7
	if !lnVector || n == 0 {
		return 0
	}
	_, _, _ = di[n-1], w[n-1], d[n-1]
	c := [4]float32{m, rs, dm, dnm}
	lnDxAVX2(&di[0], &x[0], &w[0], &d[0], n, &c)
	return n
}

// lnParamsVector does the first len(x) &^ 7 columns of a row's parameter gradients and returns
// how many.
func lnParamsVector(db, dw, x, d []float32, m, rs float32) int {
	n := len(x) &^ 7
	if !lnVector || n == 0 {
		return 0
	}
	_, _, _ = db[n-1], dw[n-1], d[n-1]
	c := [2]float32{m, rs}
	lnParamsAVX2(&db[0], &dw[0], &x[0], &d[0], n, &c)
	return n
}

// The scaled row operations of the MoE combine (axpy_amd64.s), on the same terms as GELU's.

//go:noescape
func axpyAVX2(dst, x *float32, n int, s float32)

//go:noescape
func scaleToAVX2(dst, x *float32, n int, s float32)

// axpyVector reports whether AddScaled and ScaleTo use the vector loops; tests turn it off to
// compare.
var axpyVector = geluVector

// addScaledVec does the first len(dst) &^ 7 elements of AddScaled and returns how many.
func addScaledVec(dst, x []float32, s float32) int {
	n := len(dst) &^ 7
	if !axpyVector || n == 0 {
		return 0
	}
	_ = x[n-1]
	axpyAVX2(&dst[0], &x[0], n, s)
	return n
}

// scaleToVec does the first len(dst) &^ 7 elements of ScaleTo and returns how many.
func scaleToVec(dst, x []float32, s float32) int {
	n := len(dst) &^ 7
	if !axpyVector || n == 0 {
		return 0
	}
	_ = x[n-1]
	scaleToAVX2(&dst[0], &x[0], n, s)
	return n
}
