package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// int8EFDefinition is Int8ErrorFeedback written out with the scalar functions alone: the
// definition the vector loops must reproduce bit for bit.
func int8EFDefinition(x, e []float32, codes []int8) float32 {
	for i := range x {
		x[i] += e[i]
	}
	s := Int8Scale(x)
	for i, u := range x {
		c := Int8Quant(u, s)
		r := Int8Value(c, s)
		e[i] = u - r
		x[i] = r
		codes[i] = c
	}
	return s
}

// TestInt8ErrorFeedbackBits: over chunks of every length up to one outer chunk and more, values
// of every magnitude, ties, signed zeros, subnormals, huge values, infinities and NaNs, the
// vector loops (where the CPU has them) give the definition's scale, codes, values and error
// feedback bit for bit.
func TestInt8ErrorFeedbackBits(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-45, -1e-45, 1e-40, math.MaxFloat32, -math.MaxFloat32,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), math.Float32frombits(0x7fc00001), 0.5, -0.5, 1.5, 2.5, 127, -127}
	gen := func(n, kind int) (x, e []float32) {
		x, e = make([]float32, n), make([]float32, n)
		scale := float32(math.Pow(10, float64(rng.IntN(80)-40)))
		for i := range x {
			x[i] = float32(rng.NormFloat64()) * scale
			e[i] = float32(rng.NormFloat64()) * scale / 100
			switch kind {
			case 1: // exact ties: u/s lands on k + 1/2 when the largest is 127
				x[i], e[i] = float32(rng.IntN(255)-127)+0.5, 0
				if i == 0 {
					x[i] = 127
				}
			case 2:
				if rng.IntN(16) == 0 {
					x[i] = special[rng.IntN(len(special))]
				}
			case 3: // all zeros of either sign
				x[i], e[i] = float32(math.Copysign(0, float64(rng.IntN(2)*2-1))), float32(math.Copysign(0, float64(rng.IntN(2)*2-1)))
			case 4: // so small that the scale underflows to 0, or is subnormal
				x[i], e[i] = float32(rng.NormFloat64())*1e-43, 0
			}
		}
		return x, e
	}
	for trial := range 3000 {
		n := rng.IntN(300) + 1
		if trial%5 == 0 {
			n = 256
		}
		x, e := gen(n, trial%5)
		wx, we := append([]float32(nil), x...), append([]float32(nil), e...)
		wc, gc := make([]int8, n), make([]int8, n)
		ws := int8EFDefinition(wx, we, wc)
		gs := Int8ErrorFeedback(x, e, gc)
		if math.Float32bits(gs) != math.Float32bits(ws) {
			t.Fatalf("trial %d (n %d): scale %v (%08x), want %v (%08x)", trial, n, gs, math.Float32bits(gs), ws, math.Float32bits(ws))
		}
		for i := range n {
			if math.Float32bits(x[i]) != math.Float32bits(wx[i]) || math.Float32bits(e[i]) != math.Float32bits(we[i]) || gc[i] != wc[i] {
				t.Fatalf("trial %d (n %d) element %d: x %v e %v code %d, want x %v e %v code %d", trial, n, i, x[i], e[i], gc[i], wx[i], we[i], wc[i])
			}
		}
		// Without codes: the same values.
		x2, e2 := gen(n, trial%5)
		wx2, we2 := append([]float32(nil), x2...), append([]float32(nil), e2...)
		int8EFDefinition(wx2, we2, make([]int8, n))
		Int8ErrorFeedback(x2, e2, nil)
		for i := range n {
			if math.Float32bits(x2[i]) != math.Float32bits(wx2[i]) || math.Float32bits(e2[i]) != math.Float32bits(we2[i]) {
				t.Fatalf("trial %d (n %d, no codes) element %d: x %v e %v, want %v %v", trial, n, i, x2[i], e2[i], wx2[i], we2[i])
			}
		}
	}
}

func BenchmarkInt8ErrorFeedback(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	x, e, c := make([]float32, 256), make([]float32, 256), make([]int8, 256)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	b.SetBytes(4 * 256)
	for range b.N {
		Int8ErrorFeedback(x, e, c)
	}
}

// TestOuterNesterovBits: the vector loop (where the CPU has it) gives the scalar definition's
// bits over lengths that do and do not fill a vector, and values of every magnitude.
func TestOuterNesterovBits(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 500 {
		n := rng.IntN(70) + 1
		g, v, d := make([]float32, n), make([]float32, n), make([]float64, n)
		for i := range g {
			m := math.Pow(10, float64(rng.IntN(60)-30))
			g[i], v[i], d[i] = float32(rng.NormFloat64()*m), float32(rng.NormFloat64()*m), rng.NormFloat64()*m
		}
		lr, mu := rng.Float64()*1.5, rng.Float64()
		wg, wv := append([]float32(nil), g...), append([]float32(nil), v...)
		for i := range wg {
			nv := float32(float64(mu*float64(wv[i])) + d[i])
			wv[i] = nv
			wg[i] = float32(float64(wg[i]) - float64(lr*(d[i]+float64(mu*float64(nv)))))
		}
		OuterNesterov(g, v, d, lr, mu)
		for i := range g {
			if math.Float32bits(g[i]) != math.Float32bits(wg[i]) || math.Float32bits(v[i]) != math.Float32bits(wv[i]) {
				t.Fatalf("trial %d (n %d) element %d: g %v v %v, want %v %v", trial, n, i, g[i], v[i], wg[i], wv[i])
			}
		}
	}
}
