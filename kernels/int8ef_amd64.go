//go:build !purego

package kernels

import "math"

// Int8ErrorFeedback's vector loops (int8ef_amd64.s), AVX2, eight floats at a time. None of them
// multiplies and adds in one instruction, so, like the elementwise sum's, they are used at every
// GOAMD64 level.

//go:noescape
func int8AddAVX2(x, e *float32, n int)

//go:noescape
func int8AbsMaxAVX2(x *float32, n int, m *[16]float32)

//go:noescape
func int8QuantAVX2(x, e *float32, codes *int8, n int, s float32)

// int8Vector reports whether Int8ErrorFeedback uses the vector loops; tests turn it off to
// compare.
var int8Vector = func() bool { avx2, _ := cpuFeatures(); return avx2 }()

// int8AddVec adds e to the first len(x) &^ 7 elements of x and returns how many it did.
func int8AddVec(x, e []float32) int {
	n := len(x) &^ 7
	if !int8Vector || n == 0 {
		return 0
	}
	_ = e[n-1]
	int8AddAVX2(&x[0], &e[0], n)
	return n
}

// int8ScaleVec is Int8Scale(x) when it is sure to be: false when the vector loop is off or x
// holds a NaN, for which Int8Scale's answer depends on the first NaN's payload.
func int8ScaleVec(x []float32) (float32, bool) {
	n := len(x) &^ 7
	if !int8Vector || n == 0 {
		return 0, false
	}
	var lanes [16]float32 // the lanes' largest |x|, then whether each saw a NaN
	int8AbsMaxAVX2(&x[0], n, &lanes)
	var m float32
	for k, a := range lanes[:8] {
		if math.Float32bits(lanes[8+k]) != 0 {
			return 0, false
		}
		m = max(m, a)
	}
	for _, v := range x[n:] {
		a := float32(math.Abs(float64(v)))
		if a != a {
			return 0, false
		}
		m = max(m, a)
	}
	return float32(m / 127), true
}

// int8QuantVec quantises the first len(x) &^ 7 elements of x (the sums u) at scale s — finite,
// not 0, with 127·s finite, so that no element needs Int8Quant's or Int8Value's special cases —
// and returns how many it did; codes may be nil.
func int8QuantVec(x, e []float32, codes []int8, s float32) int {
	n := len(x) &^ 7
	if !int8Vector || n == 0 {
		return 0
	}
	_ = e[n-1]
	if codes == nil {
		var scratch [256]int8
		for i := 0; i < n; i += len(scratch) {
			k := min(len(scratch), n-i)
			int8QuantAVX2(&x[i], &e[i], &scratch[0], k, s)
		}
		return n
	}
	_ = codes[n-1]
	int8QuantAVX2(&x[0], &e[0], &codes[0], n, s)
	return n
}

//go:noescape
func nesterovAVX2(w, v *float32, d *float64, n int, c *[2]float64)

// nesterovVec updates the first len(g) &^ 3 elements and returns how many it did.
func nesterovVec(g, v []float32, d []float64, lr, mu float64) int {
	n := len(g) &^ 3
	if !int8Vector || n == 0 {
		return 0
	}
	_, _ = v[n-1], d[n-1]
	c := [2]float64{mu, lr}
	nesterovAVX2(&g[0], &v[0], &d[0], n, &c)
	return n
}
