//go:build amd64 && !purego && !amd64.v3

package kernels

import "testing"

// TestGELUVectorBitsBothWidths runs the GELU bit tests with the AVX-512 loops off as well as on
// (the other tests run them as the CPU allows): each width must give the Go loops' bits.
func TestGELUVectorBitsBothWidths(t *testing.T) {
	_, avx512 := cpuFeatures()
	old := gelu512
	defer func() { gelu512 = old }()
	for _, wide := range []bool{false, true} {
		if wide && !avx512 {
			t.Log("no AVX-512 on this CPU: the sixteen-wide loops are not run")
			continue
		}
		gelu512 = wide
		t.Run(map[bool]string{false: "avx2", true: "avx512"}[wide], func(t *testing.T) {
			TestGELUForwardVectorBits(t)
			TestGELUBackwardVectorBits(t)
		})
	}
}
