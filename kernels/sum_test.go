package kernels

import (
	"math"
	"math/rand/v2"
	"slices"
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

// TestLayerNormBackwardVector: LayerNormBackward's vector loops and four-row chains give the Go
// loops' bits, on widths around the eight-float step and row counts around the four-row one.
func TestLayerNormBackwardVector(t *testing.T) {
	if !lnVector {
		t.Skip("no vector loops for LayerNormBackward on this CPU or build")
	}
	r := rand.New(rand.NewPCG(5, 6))
	randn := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		return x
	}
	for _, C := range []int{5, 8, 37, 64, 256} {
		for _, N := range []int{1, 3, 4, 7, 67} {
			inp, dout, w := randn(N*C), randn(N*C), randn(C)
			mean, rstd := make([]float32, N), make([]float32, N)
			LayerNormForward(make([]float32, N*C), mean, rstd, inp, w, randn(C), N, C)
			dinp0 := randn(N * C) // LayerNormBackward adds to dinp: both runs start from these values
			run := func(vector bool) (dinp, dw, db []float32) {
				old := lnVector
				lnVector = vector && old
				defer func() { lnVector = old }()
				dinp, dw, db = slices.Clone(dinp0), make([]float32, C), make([]float32, C)
				LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd, N, C)
				return
			}
			var want [3][]float32
			want[0], want[1], want[2] = run(false)
			var got [3][]float32
			got[0], got[1], got[2] = run(true)
			for k := range got {
				for i := range got[k] {
					if math.Float32bits(got[k][i]) != math.Float32bits(want[k][i]) {
						t.Fatalf("C=%d N=%d: output %d element %d: %v, Go loop %v", C, N, k, i, got[k][i], want[k][i])
					}
				}
			}
		}
	}
}

// TestLayerNormForwardVector: LayerNormForward's vector normalisation gives the Go loop's bits —
// outputs and statistics — on widths around the eight-float step and row counts around the
// four-row one, with zeros of both signs, large values and constant rows among the inputs.
func TestLayerNormForwardVector(t *testing.T) {
	if !lnVector {
		t.Skip("no vector loops for LayerNorm on this CPU or build")
	}
	r := rand.New(rand.NewPCG(7, 8))
	val := func() float32 {
		switch r.IntN(8) {
		case 0:
			return 0
		case 1:
			return float32(math.Copysign(0, -1))
		case 2:
			return float32(r.NormFloat64() * 1e4)
		default:
			return float32(r.NormFloat64() * math.Exp(r.NormFloat64()))
		}
	}
	randv := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = val()
		}
		return x
	}
	for _, C := range []int{5, 8, 16, 37, 64, 256} {
		for _, N := range []int{1, 3, 4, 7, 67} {
			inp, w, b := randv(N*C), randv(C), randv(C)
			for i := range C { // a constant row: its deviations are all zero
				inp[i] = 1.5
			}
			run := func(vector bool) (out, mean, rstd []float32) {
				old := lnVector
				lnVector = vector && old
				defer func() { lnVector = old }()
				out, mean, rstd = make([]float32, N*C), make([]float32, N), make([]float32, N)
				LayerNormForward(out, mean, rstd, inp, w, b, N, C)
				return
			}
			var want, got [3][]float32
			want[0], want[1], want[2] = run(false)
			got[0], got[1], got[2] = run(true)
			for k := range got {
				for i := range got[k] {
					if math.Float32bits(got[k][i]) != math.Float32bits(want[k][i]) {
						t.Fatalf("C=%d N=%d: output %d element %d: %v, Go loop %v", C, N, k, i, got[k][i], want[k][i])
					}
				}
			}
		}
	}
}

// TestAddScaledVector: AddScaled's and ScaleTo's vector loops give the Go loops' bits — each
// product rounded before the sum — at every length around the eight-float step, with zeros of
// both signs, values whose product rounds, and large ones among the inputs.
func TestAddScaledVector(t *testing.T) {
	if !axpyVector {
		t.Skip("no vector loops for AddScaled on this CPU or build")
	}
	r := rand.New(rand.NewPCG(11, 12))
	val := func() float32 {
		switch r.IntN(6) {
		case 0:
			return 0
		case 1:
			return float32(math.Copysign(0, -1))
		case 2:
			return float32(r.NormFloat64() * 1e30)
		default:
			return float32(r.NormFloat64() * math.Exp(4*r.NormFloat64()))
		}
	}
	for n := 0; n <= 41; n++ {
		for range 20 {
			x, dst0 := make([]float32, n), make([]float32, n)
			for i := range x {
				x[i], dst0[i] = val(), val()
			}
			s := val()
			run := func(vector bool) (acc, scaled []float32) {
				old := axpyVector
				axpyVector = vector && old
				defer func() { axpyVector = old }()
				acc, scaled = slices.Clone(dst0), make([]float32, n)
				AddScaled(acc, x, s)
				ScaleTo(scaled, x, s)
				return
			}
			wa, ws := run(false)
			ga, gs := run(true)
			for i := range n {
				if math.Float32bits(ga[i]) != math.Float32bits(wa[i]) || math.Float32bits(gs[i]) != math.Float32bits(ws[i]) {
					t.Fatalf("n=%d s=%v: element %d: AddScaled %v, ScaleTo %v; Go loops %v, %v", n, s, i, ga[i], gs[i], wa[i], ws[i])
				}
			}
		}
	}
}

// TestCausalSoftmaxVector: the vector scale, max and normalisation give the Go loops' softmax bit
// for bit, at every length around the eight-float step, with ties, zeros of both signs and large
// negative scores among the inputs.
func TestCausalSoftmaxVector(t *testing.T) {
	if !sumVector {
		t.Skip("no vector loops for the softmax on this CPU or build")
	}
	r := rand.New(rand.NewPCG(9, 10))
	const T = 131
	for trial := range 50 {
		row := make([]float32, T)
		for i := range row {
			switch r.IntN(6) {
			case 0:
				row[i] = 0
			case 1:
				row[i] = float32(math.Copysign(0, -1))
			case 2:
				row[i] = -1e4
			default:
				row[i] = float32(r.NormFloat64() * 4)
			}
		}
		for tt := 0; tt < T; tt++ {
			a, b := append([]float32(nil), row...), append([]float32(nil), row...)
			old := sumVector
			sumVector = false
			causalSoftmax(a, tt, 0.125)
			sumVector = old
			causalSoftmax(b, tt, 0.125)
			for i := range a {
				if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
					t.Fatalf("trial %d, t=%d: element %d: vector %v, Go loop %v", trial, tt, i, b[i], a[i])
				}
			}
		}
	}
}
