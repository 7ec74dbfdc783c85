//go:build !purego

package kernels

import "math"

// The elementwise sum's vector loop (sum_amd64.s): additions are exact to reorder across lanes,
// so unlike GELU's and AdamW's loops it is used at every GOAMD64 level.

//go:noescape
func sumAVX2(dst, a, b *float32, n int)

// sumVector reports whether sumRange uses the vector loop; tests turn it off to compare.
var sumVector = func() bool { avx2, _ := cpuFeatures(); return avx2 }()

// sumVec computes the first len(dst) &^ 7 elements and returns how many it did.
func sumVec(dst, a, b []float32) int {
	n := len(dst) &^ 7
	if !sumVector || n == 0 {
		return 0
	}
	_, _ = a[n-1], b[n-1]
	sumAVX2(&dst[0], &a[0], &b[0], n)
	return n
}

//go:noescape
func scaleMaxAVX2(x *float32, n int, s float32, m *[8]float32)

//go:noescape
func scaleAVX2(x *float32, n int, s float32)

// scaleMaxVec multiplies the first len(x) &^ 7 elements by s and returns how many it did and
// their maximum (−Inf when none).
func scaleMaxVec(x []float32, s float32) (int, float32) {
	n := len(x) &^ 7
	m := float32(math.Inf(-1))
	if !sumVector || n == 0 {
		return 0, m
	}
	lanes := [8]float32{m, m, m, m, m, m, m, m}
	scaleMaxAVX2(&x[0], n, s, &lanes)
	for _, v := range lanes {
		m = max(m, v)
	}
	return n, m
}

// scaleVec multiplies the first len(x) &^ 7 elements by s and returns how many it did.
func scaleVec(x []float32, s float32) int {
	n := len(x) &^ 7
	if !sumVector || n == 0 {
		return 0
	}
	scaleAVX2(&x[0], n, s)
	return n
}
