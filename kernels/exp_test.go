package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestExpVector: expInto is math.Exp bit for bit — the vector loop where the CPU has it — over
// random arguments across and beyond its range, the edges of the range, and values it must hand
// to math.Exp (NaN, infinities, overflow, underflow), at every offset within a group of four.
func TestExpVector(t *testing.T) {
	if !expVector {
		t.Log("no vector loop on this CPU or build: expInto is math.Exp itself")
	}
	r := rand.New(rand.NewPCG(7, 8))
	xs := []float64{0, math.Copysign(0, -1), -700, 700, math.Nextafter(-700, -800), math.Nextafter(700, 800),
		-745.2, -708, 709.7, 710, math.Inf(-1), math.Inf(1), math.NaN(), 1e-300, -1e-300, 0.5, -0.5, 1, -1}
	for range 1 << 20 {
		switch r.IntN(4) {
		case 0:
			xs = append(xs, r.Float64()*1500-750)
		case 1:
			xs = append(xs, -r.ExpFloat64()*3) // a softmax's arguments: mostly small and negative
		case 2:
			xs = append(xs, float64(float32(r.NormFloat64()*10)))
		default:
			xs = append(xs, r.NormFloat64()*1e-6)
		}
	}
	for off := range 4 {
		in := xs[off:]
		got := make([]float64, len(in))
		expInto(got, in)
		for i, x := range in {
			want := math.Exp(x)
			if math.Float64bits(got[i]) != math.Float64bits(want) && !(math.IsNaN(got[i]) && math.IsNaN(want)) {
				t.Fatalf("offset %d: exp(%v) = %v (%#x), math.Exp %v (%#x)", off, x, got[i], math.Float64bits(got[i]), want, math.Float64bits(want))
			}
		}
	}
}
