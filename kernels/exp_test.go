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
	// Eight lanes and four where the CPU has AVX-512, four elsewhere; at every offset modulo 8,
	// so that every lane sees every kind of argument.
	widths := []bool{false}
	if expWide {
		widths = append(widths, true)
	}
	defer func(w bool) { expWide = w }(expWide)
	for _, wide := range widths {
		expWide = wide
		for off := range 8 {
			in := xs[off:]
			got := make([]float64, len(in))
			expInto(got, in)
			for i, x := range in {
				want := math.Exp(x)
				if math.Float64bits(got[i]) != math.Float64bits(want) && !(math.IsNaN(got[i]) && math.IsNaN(want)) {
					t.Fatalf("wide %v, offset %d: exp(%v) = %v (%#x), math.Exp %v (%#x)", wide, off, x, got[i], math.Float64bits(got[i]), want, math.Float64bits(want))
				}
			}
		}
	}
}

// BenchmarkExpInto: a softmax chunk's exponentials (expChunk arguments, mostly small and
// negative), the vector loop eight lanes wide where the CPU has AVX-512 ("wide") and four
// ("narrow").
func BenchmarkExpInto(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	x, dst := make([]float64, expChunk), make([]float64, expChunk)
	for i := range x {
		x[i] = -r.ExpFloat64() * 3
	}
	for _, wide := range []bool{true, false} {
		name := "narrow"
		if wide {
			name = "wide"
		}
		b.Run(name, func(b *testing.B) {
			if wide && !expWide {
				b.Skip("no AVX-512 here")
			}
			defer func(w bool) { expWide = w }(expWide)
			expWide = wide
			b.SetBytes(8 * expChunk)
			for b.Loop() {
				expInto(dst, x)
			}
		})
	}
}
