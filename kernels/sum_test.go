package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestSum: the vector loop adds exactly as the Go loop does, on every length around its 32- and
// 8-float steps, in place (dst = a) as well, and Sum's cut among threads changes nothing.
func TestSum(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 100, 1000, 1 << 17} {
		a, b := make([]float32, n), make([]float32, n)
		for i := range a {
			a[i], b[i] = float32(r.NormFloat64()), float32(r.NormFloat64()*1e-3)
		}
		want := make([]float32, n)
		for i := range want {
			want[i] = a[i] + b[i]
		}
		got := make([]float32, n)
		Sum(got, a, b)
		inPlace := append([]float32(nil), a...)
		AddTo(inPlace, b)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) || math.Float32bits(inPlace[i]) != math.Float32bits(want[i]) {
				t.Fatalf("n=%d: element %d: Sum %v, AddTo %v, want %v (vector loop: %v)", n, i, got[i], inPlace[i], want[i], sumVector)
			}
		}
	}
}
