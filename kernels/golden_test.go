package kernels

import (
	"hash/fnv"
	"math"
	"math/rand/v2"
	"testing"
)

// exactMat returns n multiples of 2⁻¹⁹ in (-1, 1) drawn from a seeded stream: inputs that
// every platform builds bit for bit alike (no transcendental functions involved), with 20
// significant bits so that products are inexact and a fused multiply-add would show.
func exactMat(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(int(r.Uint32()%(1<<20))-1<<19) / (1 << 19)
	}
	return x
}

// TestPureGoGolden pins the bits of the portable kernel: run natively and under
// GOOS=js GOARCH=wasm, it checks that a browser's CPU fallback computes exactly what a native
// worker in purego mode does.
func TestPureGoGolden(t *testing.T) {
	old := ISA()
	defer SetISA(old)
	if err := SetISA(PureGo); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(7, 7))
	const m, k, n = 37, 300, 29
	a, b, c0 := exactMat(r, m*k), exactMat(r, k*n), exactMat(r, m*n)
	h := fnv.New64a()
	for _, l := range layouts {
		for _, acc := range []bool{false, true} {
			for _, v := range l.run(c0, a, b, m, k, n, acc) {
				u := math.Float32bits(v)
				h.Write([]byte{byte(u), byte(u >> 8), byte(u >> 16), byte(u >> 24)})
			}
		}
	}
	const want uint64 = 0x50af393b0a56ae4f
	if got := h.Sum64(); got != want {
		t.Errorf("pure-Go products hash to %#x, want %#x", got, want)
	}
}
