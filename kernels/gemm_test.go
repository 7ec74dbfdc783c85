package kernels

import (
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"testing"
	"time"
)

var seed = flag.Uint64("seed", 0, "random seed for the test matrices (0: pick one and print it)")

func TestMain(m *testing.M) {
	flag.Parse()
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	fmt.Printf("kernels: -seed=%d\n", *seed)
	os.Exit(m.Run())
}

// layout is one of the three multiplies with its reference and operand shapes.
type layout struct {
	name string
	fn   func(c, a, b []float32, m, k, n int, acc bool)
	ref  func(c, a, b []float32, m, k, n int, acc bool)
	// transA/transB say whether a is stored k×m and b n×k.
	transA, transB bool
}

var layouts = []layout{
	{"NN", MatMulNN, RefMatMulNN, false, false},
	{"NT", MatMulNT, RefMatMulNT, false, true},
	{"TN", MatMulTN, RefMatMulTN, true, false},
}

func randMat(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x
}

// withISA runs f once per instruction set usable here, switching the package to it.
func withISA(t *testing.T, f func(t *testing.T)) {
	t.Helper()
	old := ISA()
	defer SetISA(old)
	for _, name := range ISAs() {
		if err := SetISA(name); err != nil {
			t.Fatal(err)
		}
		t.Run(name, f)
	}
}

func withThreads(n int, f func()) {
	old := Threads()
	defer SetThreads(old)
	SetThreads(n)
	f()
}

// aElem and bElem read A(i,p) and B(p,j) whatever the layout stores.
func (l layout) aElem(a []float32, m, k, i, p int) float32 {
	if l.transA {
		return a[p*m+i]
	}
	return a[i*k+p]
}

func (l layout) bElem(b []float32, k, n, p, j int) float32 {
	if l.transB {
		return b[j*k+p]
	}
	return b[p*n+j]
}

// validate compares got with the reference want element by element against a float32
// tolerance: a sum of k rounded terms is off by a few ulps of Σ|a||b| (plus |c| when
// accumulating), which is what the bound scales with.
func validate(t *testing.T, l layout, got, want, a, b, c0 []float32, m, k, n int, acc bool) {
	t.Helper()
	bad := 0
	for i := range m {
		for j := range n {
			var mag float64
			for p := range k {
				mag += math.Abs(float64(l.aElem(a, m, k, i, p)) * float64(l.bElem(b, k, n, p, j)))
			}
			if acc {
				mag += math.Abs(float64(c0[i*n+j]))
			}
			d := math.Abs(float64(got[i*n+j]) - float64(want[i*n+j]))
			if !(d <= 1e-5*mag+1e-30) {
				if bad < 5 {
					t.Errorf("%s m=%d k=%d n=%d acc=%v: c[%d,%d] = %g, want %g (|Δ| %.3g > tol %.3g)",
						l.name, m, k, n, acc, i, j, got[i*n+j], want[i*n+j], d, 1e-5*mag)
				}
				bad++
			}
		}
	}
	if bad > 0 {
		t.Errorf("%s m=%d k=%d n=%d acc=%v: %d of %d elements out of tolerance", l.name, m, k, n, acc, bad, m*n)
	}
}

func TestMatMulAgainstReference(t *testing.T) {
	sizes := []int{1, 2, 7, 17, 33, 65, 129}
	if testing.Short() {
		sizes = []int{1, 7, 33, 65}
	}
	r := rand.New(rand.NewPCG(*seed, 1))
	withISA(t, func(t *testing.T) {
		for _, l := range layouts {
			for _, m := range sizes {
				for _, k := range sizes {
					for _, n := range sizes {
						for _, acc := range []bool{false, true} {
							checkOne(t, r, l, m, k, n, acc)
						}
					}
				}
			}
			// Larger shapes: several K blocks, several tasks, threads at work, odd edges.
			for _, s := range [][3]int{{300, 513, 97}, {37, 768, 257}, {130, 1, 1000}, {5, 1100, 40}, {64, 600, 96}, {24, 300, 64}} {
				for _, acc := range []bool{false, true} {
					checkOne(t, r, l, s[0], s[1], s[2], acc)
				}
			}
		}
	})
}

func checkOne(t *testing.T, r *rand.Rand, l layout, m, k, n int, acc bool) {
	t.Helper()
	a, b := randMat(r, m*k), randMat(r, k*n)
	c0 := randMat(r, m*n)
	got := append([]float32(nil), c0...)
	want := append([]float32(nil), c0...)
	l.fn(got, a, b, m, k, n, acc)
	l.ref(want, a, b, m, k, n, acc)
	validate(t, l, got, want, a, b, c0, m, k, n, acc)
}

func TestMatMulZeroSizes(t *testing.T) {
	for _, l := range layouts {
		c := []float32{1, 2, 3, 4}
		l.fn(c, nil, nil, 2, 0, 2, true)
		if c[0] != 1 || c[3] != 4 {
			t.Errorf("%s k=0 acc: c changed to %v", l.name, c)
		}
		l.fn(c, nil, nil, 2, 0, 2, false)
		if c[0] != 0 || c[3] != 0 {
			t.Errorf("%s k=0: c = %v, want zeros", l.name, c)
		}
		l.fn(nil, nil, nil, 0, 5, 0, false)
	}
}

func TestMatMulShortSlicePanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("MatMulNN with a short c did not panic")
		}
	}()
	MatMulNN(make([]float32, 3), make([]float32, 4), make([]float32, 4), 2, 2, 2, false)
}

func TestSetISA(t *testing.T) {
	if err := SetISA("vax"); err == nil {
		t.Error(`SetISA("vax") succeeded`)
	}
	if got, want := ISAs()[0], PureGo; got != want {
		t.Errorf("ISAs()[0] = %q, want %q", got, want)
	}
}

// run computes one product on a fresh copy of c0.
func (l layout) run(c0, a, b []float32, m, k, n int, acc bool) []float32 {
	c := append([]float32(nil), c0...)
	l.fn(c, a, b, m, k, n, acc)
	return c
}

func equalBits(x, y []float32) (int, bool) {
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) {
			return i, false
		}
	}
	return -1, len(x) == len(y)
}

func TestDeterministicAcrossThreads(t *testing.T) {
	r := rand.New(rand.NewPCG(*seed, 2))
	const m, k, n = 301, 517, 333
	a, b, c0 := randMat(r, m*k), randMat(r, k*n), randMat(r, m*n)
	withISA(t, func(t *testing.T) {
		for _, l := range layouts {
			for _, acc := range []bool{false, true} {
				var want []float32
				for _, th := range []int{1, 2, 3, 8} {
					var got []float32
					withThreads(th, func() { got = l.run(c0, a, b, m, k, n, acc) })
					if want == nil {
						want = got
						continue
					}
					if i, ok := equalBits(got, want); !ok {
						t.Errorf("%s acc=%v: %d threads differ from 1 thread at element %d: %g vs %g",
							l.name, acc, th, i, got[i], want[i])
					}
				}
			}
		}
	})
}

// subRows returns the operand A restricted to rows [i0, i1) of the product (for TN, columns of
// the stored k×m matrix).
func (l layout) subRows(a []float32, m, k, i0, i1 int) []float32 {
	if !l.transA {
		return a[i0*k : i1*k]
	}
	s := make([]float32, 0, k*(i1-i0))
	for p := range k {
		s = append(s, a[p*m+i0:p*m+i1]...)
	}
	return s
}

// subCols returns the operand B restricted to columns [j0, j1) of the product.
func (l layout) subCols(b []float32, k, n, j0, j1 int) []float32 {
	if l.transB {
		return b[j0*k : j1*k]
	}
	s := make([]float32, 0, k*(j1-j0))
	for p := range k {
		s = append(s, b[p*n+j0:p*n+j1]...)
	}
	return s
}

// TestDeterministicAcrossPartitions checks that an element depends only on its row of A, its
// column of B and K: computing a band of rows (or columns) alone gives the same bits as
// computing it inside the whole product, whatever tile the element fell in either time.
func TestDeterministicAcrossPartitions(t *testing.T) {
	r := rand.New(rand.NewPCG(*seed, 3))
	const m, k, n = 203, 300, 150
	a, b, c0 := randMat(r, m*k), randMat(r, k*n), randMat(r, m*n)
	withISA(t, func(t *testing.T) {
		for _, l := range layouts {
			for _, acc := range []bool{false, true} {
				full := l.run(c0, a, b, m, k, n, acc)
				for _, band := range [][2]int{{5, 41}, {0, 1}, {13, 14}, {100, 203}, {1, 200}} {
					i0, i1 := band[0], band[1]
					got := l.run(c0[i0*n:i1*n], l.subRows(a, m, k, i0, i1), b, i1-i0, k, n, acc)
					if i, ok := equalBits(got, full[i0*n:i1*n]); !ok {
						t.Errorf("%s acc=%v: rows %d..%d alone differ from the full product at row %d col %d: %g vs %g",
							l.name, acc, i0, i1, i0+i/n, i%n, got[i], full[i0*n+i])
					}
				}
				for _, band := range [][2]int{{3, 70}, {0, 1}, {31, 64}, {149, 150}} {
					j0, j1 := band[0], band[1]
					w := j1 - j0
					cs := make([]float32, 0, m*w)
					for i := range m {
						cs = append(cs, c0[i*n+j0:i*n+j1]...)
					}
					got := l.run(cs, a, l.subCols(b, k, n, j0, j1), m, k, w, acc)
					for i := range m {
						if p, ok := equalBits(got[i*w:(i+1)*w], full[i*n+j0:i*n+j1]); !ok {
							t.Errorf("%s acc=%v: columns %d..%d alone differ from the full product at row %d col %d",
								l.name, acc, j0, j1, i, j0+p)
							break
						}
					}
				}
			}
		}
	})
}

// TestAccumulateEqualsConcatenatedK checks the documented acc semantics: the chain starts from
// the old c, so a weight gradient accumulated over two token groups equals, bit for bit, the one
// over all tokens at once.
func TestAccumulateEqualsConcatenatedK(t *testing.T) {
	r := rand.New(rand.NewPCG(*seed, 4))
	const m, k1, k2, n = 70, 300, 77, 90
	k := k1 + k2
	a, b := randMat(r, k*m), randMat(r, k*n) // TN operands: tokens × features
	withISA(t, func(t *testing.T) {
		whole := make([]float32, m*n)
		MatMulTN(whole, a, b, m, k, n, false)
		parts := make([]float32, m*n)
		MatMulTN(parts, a[:k1*m], b[:k1*n], m, k1, n, false)
		MatMulTN(parts, a[k1*m:], b[k1*n:], m, k2, n, true)
		if i, ok := equalBits(parts, whole); !ok {
			t.Errorf("two accumulated token groups differ from one at element %d: %g vs %g", i, parts[i], whole[i])
		}
	})
}

// TestVectorISAsAgree checks that AVX2 and AVX-512 give identical bits: both run the same fused
// multiply-add chain per element, only the tile shape differs.
func TestVectorISAsAgree(t *testing.T) {
	has := map[string]bool{}
	for _, name := range ISAs() {
		has[name] = true
	}
	if !has[AVX2] || !has[AVX512] {
		t.Skip("needs both AVX2 and AVX-512")
	}
	old := ISA()
	defer SetISA(old)
	r := rand.New(rand.NewPCG(*seed, 5))
	const m, k, n = 77, 600, 130
	a, b, c0 := randMat(r, m*k), randMat(r, k*n), randMat(r, m*n)
	for _, l := range layouts {
		SetISA(AVX2)
		x := l.run(c0, a, b, m, k, n, true)
		SetISA(AVX512)
		y := l.run(c0, a, b, m, k, n, true)
		if i, ok := equalBits(x, y); !ok {
			t.Errorf("%s: AVX2 and AVX-512 differ at element %d: %g vs %g", l.name, i, x[i], y[i])
		}
	}
}

// BenchmarkGEMM reports GFLOP/s per layout, instruction set, shape (m×k×n) and thread count:
// BenchmarkGEMM/<layout>/<isa>/<shape>/threads=<n>. Select with e.g.
// -bench 'GEMM/NT/avx512/1024x1024x1024/threads=2'.
func BenchmarkGEMM(b *testing.B) {
	benchGEMM(b, [][3]int{{1024, 1024, 1024}, {2048, 256, 1024}, {512, 256, 1024}, {37, 256, 1024}, {7, 1024, 1024}})
}

// benchGEMM runs every layout × instruction set × shape × thread count (1 and GOMAXPROCS) as a
// sub-benchmark named <layout>/<isa>/<m>x<k>x<n>/threads=<t>, reporting GFLOP/s.
func benchGEMM(b *testing.B, shapes [][3]int) {
	threads := []int{1}
	if p := runtime.GOMAXPROCS(0); p > 1 {
		threads = append(threads, p)
	}
	old := ISA()
	defer SetISA(old)
	for _, l := range layouts {
		for _, name := range ISAs() {
			for _, s := range shapes {
				m, k, n := s[0], s[1], s[2]
				for _, th := range threads {
					b.Run(fmt.Sprintf("%s/%s/%dx%dx%d/threads=%d", l.name, name, m, k, n, th), func(b *testing.B) {
						SetISA(name)
						withThreads(th, func() {
							r := rand.New(rand.NewPCG(1, 1))
							x, y, c := randMat(r, m*k), randMat(r, k*n), make([]float32, m*n)
							l.fn(c, x, y, m, k, n, false)
							for b.Loop() {
								l.fn(c, x, y, m, k, n, false)
							}
							b.ReportMetric(2*float64(m*k*n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
						})
					})
				}
			}
		}
	}
}
