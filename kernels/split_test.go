package kernels

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSplitsKeepBits checks the parallel splits that must not change a bit: bias and LayerNorm
// parameter gradients cut by columns (each column still summed over the rows in order), AdamW
// over a slab of tensors cut in chunks, squared norms by tensor, attention by head. Each is
// compared, bit for bit, with the single-goroutine loop it replaced, at several thread counts.
func TestSplitsKeepBits(t *testing.T) {
	old := Threads()
	defer SetThreads(old)
	r := rand.New(rand.NewPCG(16, 4))
	randv := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		return x
	}
	const N, C = 300, 272 // C not a multiple of the 16-column lines
	inp, dout, w, b := randv(N*C), randv(N*C), randv(C), randv(C)
	mean, rstd, out := make([]float32, N), make([]float32, N), make([]float32, N*C)
	LayerNormForward(out, mean, rstd, inp, w, b, N, C)

	// The loops as they were, on one goroutine.
	wantDW, wantDB, wantBias := randv(C), randv(C), randv(C)
	dw0, db0, bias0 := append([]float32(nil), wantDW...), append([]float32(nil), wantDB...), append([]float32(nil), wantBias...)
	for r := 0; r < N; r++ {
		x, d := inp[r*C:(r+1)*C], dout[r*C:(r+1)*C]
		m, rs := mean[r], rstd[r]
		for i := range x {
			wantDB[i] += d[i]
			wantDW[i] += (x[i] - m) * rs * d[i]
			wantBias[i] += d[i]
		}
	}
	const Bt, T, Ca, H = 4, 64, 68, 4 // attention: heads of 17 channels
	qkv := randv(Bt * T * 3 * Ca)

	var ref struct{ att, out, dqkv []float32 }
	for _, threads := range []int{1, 2, 3, 8} {
		SetThreads(threads)
		dw, db, bias := append([]float32(nil), dw0...), append([]float32(nil), db0...), append([]float32(nil), bias0...)
		LayerNormBackward(make([]float32, N*C), dw, db, dout, inp, w, mean, rstd, N, C)
		LinearBackward(make([]float32, N*C), make([]float32, C*C), bias, dout, inp, make([]float32, C*C), N, C, C, false)
		for i := range dw {
			if !sameFloat(dw[i], wantDW[i]) || !sameFloat(db[i], wantDB[i]) || !sameFloat(bias[i], wantBias[i]) {
				t.Fatalf("threads=%d, column %d: dw %v db %v dbias %v; want %v %v %v", threads, i, dw[i], db[i], bias[i], wantDW[i], wantDB[i], wantBias[i])
			}
		}

		// Attention: the same bits at every thread count.
		att, o, dqkv := make([]float32, Bt*H*T*T), make([]float32, Bt*T*Ca), make([]float32, Bt*T*3*Ca)
		AttentionForward(o, att, qkv, Bt, T, Ca, H)
		AttentionBackward(dqkv, o, qkv, att, Bt, T, Ca, H)
		if ref.att == nil {
			ref.att, ref.out, ref.dqkv = att, o, dqkv
		}
		for _, c := range []struct{ got, want []float32 }{{att, ref.att}, {o, ref.out}, {dqkv, ref.dqkv}} {
			for i := range c.got {
				if !sameFloat(c.got[i], c.want[i]) {
					t.Fatalf("threads=%d: attention element %d: %v, at 1 thread %v", threads, i, c.got[i], c.want[i])
				}
			}
		}

		// AdamW over a slab of tensors of assorted sizes and decays, and their norms.
		sizes := []int{0, 5, 1 << 14, 3, 40000, 17, 1<<14 + 1}
		var ends []int
		var decays []float32
		n := 0
		for i, s := range sizes {
			n += s
			ends = append(ends, n)
			decays = append(decays, 1-float32(i%2)*1e-3)
		}
		pw, g, m, v := randv(n), randv(n), randv(n), make([]float32, n)
		for i := range v {
			v[i] = float32(math.Abs(r.NormFloat64()))
		}
		ws, ms, vs := append([]float32(nil), pw...), append([]float32(nil), m...), append([]float32(nil), v...)
		AdamWTensors(pw, g, m, v, ends, decays, 1e-3, 0.3, 0.7)
		lo := 0
		xs := make([][]float32, len(ends))
		for i, e := range ends {
			AdamW(ws[lo:e], g[lo:e], ms[lo:e], vs[lo:e], decays[i], 1e-3, 0.3, 0.7)
			xs[i] = g[lo:e]
			lo = e
		}
		for i := range pw {
			if !sameFloat(pw[i], ws[i]) || !sameFloat(m[i], ms[i]) || !sameFloat(v[i], vs[i]) {
				t.Fatalf("threads=%d: AdamWTensors element %d: %v %v %v, tensor by tensor %v %v %v", threads, i, pw[i], m[i], v[i], ws[i], ms[i], vs[i])
			}
		}
		sums := make([]float64, len(xs))
		SquaredNorms(sums, xs)
		for i, x := range xs {
			var s float64
			for _, v := range x {
				s += float64(v) * float64(v)
			}
			if math.Float64bits(sums[i]) != math.Float64bits(s) {
				t.Fatalf("threads=%d: tensor %d: Σx² %v, in element order %v", threads, i, sums[i], s)
			}
		}
	}
}

// TestSquaredNormsSideBySide checks SquaredNorms, which sums several tensors' chains side by
// side, against each tensor's Σx² in element order, bit for bit: tensors of many lengths (empty,
// shorter than the others, equal, orders of magnitude apart), so that slots finish, refill and
// repeat another's elements in every pattern, at several thread counts.
func TestSquaredNormsSideBySide(t *testing.T) {
	old := Threads()
	defer SetThreads(old)
	r := rand.New(rand.NewPCG(34, 4))
	lens := []int{0, 1, 3, 3, 3, 17, 0, 256, 1000, 1024, 4096, 5, 65536, 2, 9000, 9000, 1, 0, 70000, 31}
	for range 17 {
		lens = append(lens, r.IntN(3000))
	}
	xs := make([][]float32, len(lens))
	for i, n := range lens {
		xs[i] = make([]float32, n)
		for j := range xs[i] {
			xs[i][j] = float32(r.NormFloat64() * math.Exp(4*r.NormFloat64()))
		}
	}
	for _, threads := range []int{1, 2, 3, 8} {
		SetThreads(threads)
		for _, m := range []int{len(xs), 1, 2, 3, 4, 5, 7} { // also fewer tensors than slots
			sums := make([]float64, m)
			for i := range sums {
				sums[i] = math.NaN()
			}
			SquaredNorms(sums, xs[:m])
			for i, x := range xs[:m] {
				var s float64
				for _, v := range x {
					s += float64(v) * float64(v)
				}
				if math.Float64bits(sums[i]) != math.Float64bits(s) {
					t.Fatalf("threads=%d, %d tensors: tensor %d (%d elements): Σx² %v, in element order %v", threads, m, i, len(x), sums[i], s)
				}
			}
		}
	}
}

// TestNormOrderKept: SquaredNorms sorts a set of tensors once — a second call on tensors of the
// same lengths allocates nothing — and sorts again, largest first, for tensors of other lengths,
// even as many of them.
func TestNormOrderKept(t *testing.T) {
	old := Threads()
	defer SetThreads(old)
	SetThreads(1)
	a := [][]float32{make([]float32, 3), make([]float32, 70), make([]float32, 9), make([]float32, 70)}
	b := [][]float32{make([]float32, 50), make([]float32, 2), make([]float32, 900), make([]float32, 9)}
	sums := make([]float64, 4)
	SquaredNorms(sums, a)
	if n := testing.AllocsPerRun(10, func() { SquaredNorms(sums, a) }); n != 0 {
		t.Errorf("SquaredNorms on the same lengths again: %v allocations a call, want 0", n)
	}
	for _, c := range []struct {
		xs   [][]float32
		want []int
	}{{a, []int{1, 3, 2, 0}}, {b, []int{2, 0, 3, 1}}, {a, []int{1, 3, 2, 0}}} {
		if got := normOrderOf(c.xs); !slices.Equal(got, c.want) {
			t.Fatalf("order of lengths %v: %v, want %v", lensOf(c.xs), got, c.want)
		}
	}
}

func lensOf(xs [][]float32) []int {
	var n []int
	for _, x := range xs {
		n = append(n, len(x))
	}
	return n
}
