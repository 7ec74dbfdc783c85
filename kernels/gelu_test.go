package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestGELUForwardVectorBits checks that GELUForward's vector loop gives the Go loop's bits on
// every kind of input: random values at every scale, random bit patterns (subnormals, huge
// values), and the edges of Tanh32's branches. NaNs must stay NaN (their payloads are the
// CPU's business: a NaN anywhere fails the step).
func TestGELUForwardVectorBits(t *testing.T) {
	if !geluVector {
		t.Skip("no vector loop for GELUForward on this CPU or build")
	}
	r := rand.New(rand.NewPCG(16, 1))
	var in []float32
	up := func(v float32) float32 { return math.Nextafter32(v, float32(math.Inf(1))) }
	down := func(v float32) float32 { return math.Nextafter32(v, float32(math.Inf(-1))) }
	for _, v := range []float32{0, float32(math.Copysign(0, -1)), 1, -1, 1e-45, -1e-45, 1e-38, -1e-38,
		float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), math.MaxFloat32, -math.MaxFloat32,
		tanhSmall, -tanhSmall, tanhClamp, -tanhClamp, 3, -3, 5.5, -5.5, 9, -9, 100, -100, 1e20, -1e20} {
		in = append(in, v, up(v), down(v))
	}
	// Inputs whose tanh argument sits at the branch points: u = geluScale·(x + 0.044715x³).
	for _, u := range []float32{tanhSmall, -tanhSmall, tanhClamp, -tanhClamp} {
		x := u / geluScale
		for range 64 {
			in = append(in, x)
			x = up(x)
		}
	}
	for _, scale := range []float64{1e-6, 1e-3, 0.1, 1, 3, 10, 1e3} {
		for range 4096 {
			in = append(in, float32(r.NormFloat64()*scale))
		}
	}
	for range 1 << 16 {
		in = append(in, math.Float32frombits(r.Uint32()))
	}
	for _, n := range []int{len(in), len(in) - 3, 8, 7, 1} {
		x := in[len(in)-n:]
		want, wantTh := make([]float32, n), make([]float32, n)
		for i, v := range x {
			tv := Tanh32(geluScale * (v + geluCubic*v*v*v))
			wantTh[i], want[i] = tv, 0.5*v*(1+tv)
		}
		got, gotTh := make([]float32, n), make([]float32, n)
		GELUForward(got, gotTh, x)
		for i := range x {
			if !sameFloat(got[i], want[i]) || !sameFloat(gotTh[i], wantTh[i]) {
				t.Fatalf("n=%d, GELU(%v) (bits %#08x): got %v, tanh %v; want %v, tanh %v",
					n, x[i], math.Float32bits(x[i]), got[i], gotTh[i], want[i], wantTh[i])
			}
		}
	}
}

// sameFloat reports whether a and b are the same float32, bit for bit, or both NaN.
func sameFloat(a, b float32) bool {
	if a != a || b != b {
		return a != a && b != b
	}
	return math.Float32bits(a) == math.Float32bits(b)
}

// TestAdamWVectorBits checks that AdamW's vector loop gives the Go loop's bits: parameters,
// gradients and moments at every scale (and random bit patterns), with and without decay,
// clipping and early bias corrections.
func TestAdamWVectorBits(t *testing.T) {
	if !adamVector {
		t.Skip("no vector loop for AdamW on this CPU or build")
	}
	r := rand.New(rand.NewPCG(16, 2))
	const n = 1<<12 + 5
	val := func(i int) float32 {
		switch i % 5 {
		case 0:
			return math.Float32frombits(r.Uint32())
		case 1:
			return 0
		}
		return float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(12)-8)))
	}
	for _, tc := range []struct {
		decay, stepSize, gradScale float32
		sqrtBC2                    float64
	}{
		{1, 3e-4, 1, 0.22360679774997896},
		{1 - 1e-2*0.1, 1e-2 / 0.1, 0.37, math.Sqrt(1 - math.Pow(0.95, 1))},
		{0.99, 1e-3, 1e-3, math.Sqrt(1 - math.Pow(0.95, 1000))},
	} {
		w, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range w {
			w[i], g[i], m[i], v[i] = val(i), val(i+1), val(i+2), float32(math.Abs(float64(val(i+3))))
		}
		ws, ms, vs := append([]float32(nil), w...), append([]float32(nil), m...), append([]float32(nil), v...)
		AdamW(w, g, m, v, tc.decay, tc.stepSize, tc.sqrtBC2, tc.gradScale)
		adamVector = false
		AdamW(ws, g, ms, vs, tc.decay, tc.stepSize, tc.sqrtBC2, tc.gradScale)
		adamVector = true
		for i := range w {
			if !sameFloat(w[i], ws[i]) || !sameFloat(m[i], ms[i]) || !sameFloat(v[i], vs[i]) {
				t.Fatalf("%+v, element %d (g %v): vector w %v m %v v %v; Go w %v m %v v %v",
					tc, i, g[i], w[i], m[i], v[i], ws[i], ms[i], vs[i])
			}
		}
	}
}

// TestGELUBackwardVectorBits checks GELUBackward's vector loop against the Go loop, on the tanh
// values forward keeps and on arbitrary ones, in place (dinp = dout) and not.
func TestGELUBackwardVectorBits(t *testing.T) {
	if !geluVector {
		t.Skip("no vector loop for GELUBackward on this CPU or build")
	}
	r := rand.New(rand.NewPCG(16, 3))
	const n = 1<<13 + 3
	x, th, dout := make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(8)-4)))
		dout[i] = float32(r.NormFloat64())
		if i%7 == 0 {
			x[i], dout[i] = math.Float32frombits(r.Uint32()), math.Float32frombits(r.Uint32())
		}
	}
	GELUForward(make([]float32, n), th, x)
	for i := 0; i < n; i += 3 {
		th[i] = float32(r.Float64()*2 - 1)
	}
	want := make([]float32, n)
	for i := range x {
		xv, tv := x[i], th[i]
		want[i] = (0.5*(1+tv) + 0.5*xv*(1-tv*tv)*geluScale*(1+3*geluCubic*xv*xv)) * dout[i]
	}
	got := make([]float32, n)
	GELUBackward(got, x, th, dout)
	inPlace := append([]float32(nil), dout...)
	GELUBackward(inPlace, x, th, inPlace)
	for i := range want {
		if !sameFloat(got[i], want[i]) || !sameFloat(inPlace[i], want[i]) {
			t.Fatalf("element %d (x %v, t %v, dout %v): got %v (in place %v), want %v", i, x[i], th[i], dout[i], got[i], inPlace[i], want[i])
		}
	}
}
