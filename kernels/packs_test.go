package kernels

import (
	"math"
	"math/rand/v2"
	"sync"
	"testing"
)

// TestPacksKeepBits: a linear layer whose weight's packed form a Packs keeps gives the bits of
// one that packs it itself, forward and backward, for row counts that would read the weight in
// place, share it or pack it per task, and widths with a partial last panel; outside a span
// nothing is kept; a weight changed between spans is packed anew; the limit is kept.
func TestPacksKeepBits(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	var pk Packs
	for _, shape := range [][3]int{{5, 64, 96}, {16, 256, 768}, {200, 256, 1024}, {512, 256, 256}, {37, 100, 45}} {
		N, IN, OUT := shape[0], shape[1], shape[2]
		inp, w, dout := exactMat(r, N*IN), exactMat(r, OUT*IN), exactMat(r, N*OUT)
		for span := range 2 {
			if span == 1 {
				w[7] += 0.5 // the weight changes between spans: its pack must not be reused
			}
			pk.Begin()
			for pass := range 2 { // the second pass reads the packs the first one kept
				got, want := make([]float32, N*OUT), make([]float32, N*OUT)
				LinearForwardPacked(&pk, got, inp, w, nil, N, IN, OUT)
				LinearForward(want, inp, w, nil, N, IN, OUT)
				requireBits(t, got, want, "forward", shape, pass)
				gi, wi := make([]float32, N*IN), make([]float32, N*IN)
				gw, ww := make([]float32, OUT*IN), make([]float32, OUT*IN)
				LinearBackwardPacked(&pk, gi, gw, nil, dout, inp, w, N, IN, OUT, false)
				LinearBackward(wi, ww, nil, dout, inp, w, N, IN, OUT, false)
				requireBits(t, gi, wi, "input gradient", shape, pass)
				requireBits(t, gw, ww, "weight gradient", shape, pass)
			}
			if len(pk.entries) != 2 {
				t.Fatalf("%v: %d packs kept in a span, want 2 (the weight in both layouts)", shape, len(pk.entries))
			}
			pk.End()
			if len(pk.entries) != 0 || pk.used != 0 {
				t.Fatalf("%v: End left %d packs (%d floats)", shape, len(pk.entries), pk.used)
			}
		}
	}
	// Outside a span, and past the limit, nothing is kept.
	w := exactMat(r, 64*64)
	if got := pk.get(isa.Load(), true, w, 64, 64, 1); got != nil {
		t.Fatal("a pack kept outside a span")
	}
	small := Packs{Limit: 100}
	small.Begin()
	if got := small.get(isa.Load(), true, w, 64, 64, 1); got != nil || len(small.entries) != 0 {
		t.Fatal("a pack kept past the limit")
	}
	small.End()
}

// TestPacksPackedTogether: goroutines that ask a Packs for one weight at once (a step's lanes)
// pack chunks of it side by side, and every one of them, and every later multiply, reads the
// pack a single goroutine would have made — in both layouts, with a partial last panel, and with
// several K blocks.
func TestPacksPackedTogether(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 13))
	for _, shape := range [][3]int{{64, 256, 768}, {40, 600, 300}, {96, 1024, 256}} {
		N, IN, OUT := shape[0], shape[1], shape[2]
		inp, w, dout := exactMat(r, N*IN), exactMat(r, OUT*IN), exactMat(r, N*OUT)
		want, wantIn := make([]float32, N*OUT), make([]float32, N*IN)
		LinearForward(want, inp, w, nil, N, IN, OUT)
		MatMulNN(wantIn, dout, w, N, OUT, IN, false)
		for _, threads := range []int{1, 2} { // 2: the pool's helpers pack chunks too
			withThreads(threads, func() {
				var pk Packs
				pk.Begin()
				defer pk.End()
				const goroutines = 4
				gots, gotIns := make([][]float32, goroutines), make([][]float32, goroutines)
				var wg sync.WaitGroup
				for i := range goroutines {
					wg.Add(1)
					go func() {
						defer wg.Done()
						gots[i], gotIns[i] = make([]float32, N*OUT), make([]float32, N*IN)
						LinearForwardPacked(&pk, gots[i], inp, w, nil, N, IN, OUT)
						gemmPacked(&pk, false, false, gotIns[i], dout, w, N, OUT, IN, false)
					}()
				}
				wg.Wait()
				for i := range goroutines {
					requireBits(t, gots[i], want, "forward", shape, i)
					requireBits(t, gotIns[i], wantIn, "input gradient", shape, i)
				}
			})
		}
	}
}

func requireBits(t *testing.T, got, want []float32, what string, shape [3]int, pass int) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%v pass %d: %s element %d: %v with kept packs, %v without", shape, pass, what, i, got[i], want[i])
		}
	}
}

// TestCopyRows checks copyRowsIn and copyRowsOut (assembly moves where the CPU has them) against
// their Go loops, for run widths the assembly takes and widths it leaves to Go, and that neither
// writes outside its runs.
func TestCopyRows(t *testing.T) {
	r := rand.New(rand.NewPCG(34, 6))
	for _, w := range []int{1, 7, 8, 16, 17, 24, 32, 64, 96} {
		for _, n := range []int{0, 1, 3, 32} {
			ld := w + 5
			src := randMat(r, n*ld+w)
			got, want := randMat(r, n*w+3), make([]float32, n*w+3)
			copy(want, got)
			copyRowsIn(got, src, ld, w, n)
			copyRowsInGo(want, src, ld, w, n)
			if i, ok := equalBits(got, want); !ok {
				t.Fatalf("copyRowsIn w=%d n=%d: element %d: %v, want %v", w, n, i, got[i], want[i])
			}
			packed := randMat(r, n*w+1)
			got, want = randMat(r, n*ld+w), make([]float32, n*ld+w)
			copy(want, got)
			copyRowsOut(got, ld, packed, w, n)
			copyRowsOutGo(want, ld, packed, w, n)
			if i, ok := equalBits(got, want); !ok {
				t.Fatalf("copyRowsOut w=%d n=%d: element %d: %v, want %v", w, n, i, got[i], want[i])
			}
		}
	}
}
