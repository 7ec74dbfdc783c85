//go:build !purego

package kernels

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
