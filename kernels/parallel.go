package kernels

// parallelRange runs fn over [0, n) cut into contiguous ranges of at least grain items, one per
// thread (Threads), on the pool: the caller runs ranges too, and does all of them when no helper
// is free, so a range runs on the caller's goroutine whenever one thread is asked for (and a
// CPU profile then sees every layer under its caller). Callers only hand it work whose items are
// independent (rows of a LayerNorm, heads of attention, columns of a bias gradient), so the
// result is the same however the range is cut.
func parallelRange(n, grain int, fn func(lo, hi int)) {
	p := Threads()
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
	parallelFor(p, p, func(_ *scratch, i int) { fn(i*n/p, (i+1)*n/p) })
}

// colAlign is the column granularity of parallelCols: 16 float32 are one 64-byte cache line, so
// two goroutines never write the same line of an accumulated row.
const colAlign = 16

// parallelCols runs fn over the columns [0, n) of a sum over rows, cut into ranges of whole cache
// lines, when the rows × n elements summed are enough to share (work ≥ grain). fn sums its
// columns over every row in row order, so each column's chain is the one a single goroutine
// would compute: the bits do not depend on the cut.
func parallelCols(n, rows, grain int, fn func(lo, hi int)) {
	if n*rows < grain || n < 2*colAlign {
		fn(0, n)
		return
	}
	lines := (n + colAlign - 1) / colAlign
	parallelRange(lines, 1, func(lo, hi int) { fn(lo*colAlign, min(hi*colAlign, n)) })
}
