//go:build !amd64 || purego

package kernels

// Without amd64 assembly (other architectures, wasm, or the purego build tag) only the portable
// kernel exists.
func availableImpls() []*gemmImpl { return []*gemmImpl{&goImpl} }

// copyRowsIn copies n runs of w floats, lds apart in src, to consecutive runs in d.
func copyRowsIn(d, src []float32, lds, w, n int) { copyRowsInGo(d, src, lds, w, n) }

// copyRowsOut copies n runs of w floats, consecutive in src, to runs ldd apart in d.
func copyRowsOut(d []float32, ldd int, src []float32, w, n int) { copyRowsOutGo(d, ldd, src, w, n) }
