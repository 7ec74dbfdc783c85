package kernels

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestPoolSharesWork checks that helpers really join a multiply's tiles (each participant has
// its own scratch) and that every tile runs exactly once.
func TestPoolSharesWork(t *testing.T) {
	withThreads(3, func() {
		for range 3 { // also right after a previous job, when helpers are just coming back
			var mu sync.Mutex
			seen := map[*scratch]int{}
			done := make([]int, 300)
			parallelFor(len(done), Threads(), func(s *scratch, i int) {
				time.Sleep(50 * time.Microsecond)
				mu.Lock()
				seen[s]++
				done[i]++
				mu.Unlock()
			})
			for i, d := range done {
				if d != 1 {
					t.Fatalf("tile %d ran %d times", i, d)
				}
			}
			if len(seen) < 2 {
				t.Errorf("only %d goroutine(s) worked on 300 tiles with 3 threads", len(seen))
			}
		}
	})
}

func TestSetThreads(t *testing.T) {
	old := Threads()
	defer SetThreads(old)
	for _, n := range []int{1, 4, 2} {
		SetThreads(n)
		if got := Threads(); got != n {
			t.Errorf("after SetThreads(%d), Threads() = %d", n, got)
		}
	}
	SetThreads(0)
	if Threads() < 1 {
		t.Errorf("SetThreads(0) left Threads() = %d", Threads())
	}
}

// TestConcurrentCallers runs multiplies from several goroutines at once, as pipeline stages and
// experts in one process do: each must get the bits it gets alone.
func TestConcurrentCallers(t *testing.T) {
	r := rand.New(rand.NewPCG(*seed, 6))
	const m, k, n = 150, 200, 130
	a, b := randMat(r, m*k), randMat(r, k*n)
	want := make([]float32, m*n)
	MatMulNT(want, a, b, m, k, n, false)
	withThreads(2, func() {
		var wg sync.WaitGroup
		for g := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got := make([]float32, m*n)
				for range 5 {
					MatMulNT(got, a, b, m, k, n, false)
					if i, ok := equalBits(got, want); !ok {
						t.Errorf("goroutine %d: element %d = %g, want %g", g, i, got[i], want[i])
						return
					}
				}
			}()
		}
		wg.Wait()
	})
}
