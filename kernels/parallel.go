package kernels

import (
	"runtime"
	"sync"
)

// parallelRange runs fn over [0, n) cut into contiguous ranges of at least grain items, one per
// available CPU. Callers only hand it work whose items are independent (rows of a LayerNorm,
// heads of attention), so the result is the same however the range is cut.
func parallelRange(n, grain int, fn func(lo, hi int)) {
	p := runtime.GOMAXPROCS(0)
	if grain < 1 {
		grain = 1
	}
	if m := (n + grain - 1) / grain; m < p {
		p = m
	}
	if p <= 1 {
		if n > 0 {
			fn(0, n)
		}
		return
	}
	var wg sync.WaitGroup
	for i := 1; i < p; i++ {
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			fn(lo, hi)
		}(i*n/p, (i+1)*n/p)
	}
	fn(0, n/p)
	wg.Wait()
}
