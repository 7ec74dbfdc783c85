package kernels

import "sync"

// Packing copies the operands into the order the micro-kernels read them. A partial B panel (the
// last nr columns, when n is not a multiple of nr) is padded with zero columns, so that its
// real columns run exactly the arithmetic of a full tile; a partial A panel needs no padding,
// since it is read by the kernel of its own height. Packing only moves floats: however it is
// done (assembly transposes or Go loops) it cannot change a result.

// transposer16 transposes a 16×16 block: src rows r (16 floats, lds apart) become columns, with
// rows 0–7 of column x written to dlo[x·ldd:] and rows 8–15 to dhi[x·ldd:]. It is a pure copy,
// so it changes no result; nil where the CPU has no fast one.
type transposer16 func(dlo, dhi []float32, ldd int, src []float32, lds int)

// transposer8 transposes an 8×8 block: src rows r (8 floats, lds apart) become columns, column x
// written to d[x·ldd:]. A pure copy, like transposer16; for CPUs with AVX but not AVX-512.
type transposer8 func(d []float32, ldd int, src []float32, lds int)

// gatherer8 copies n runs of 8 floats (or of a B panel's nr, as gemmImpl.gb), lds apart in src,
// to consecutive groups in d.
type gatherer8 func(d, src []float32, lds, n int)

// packA writes rows [i0, i1) of A (m×k, or k×m when trans) over K steps [p0, p0+kc) as panels:
// the panel of rows [ir, ir+h) is dst[(ir-i0)·kc:], kc groups of h floats, one per row, where h
// is panelHeight(ir, i1, mr) and the kernel of that height reads it.
func packA(dst, a []float32, trans bool, m, k, i0, i1, p0, kc, mr int, tr transposer16, g8 gatherer8) {
	if trans {
		// a is k×m: the rows of every panel sit side by side in each row of a. Take 16 rows of a
		// at a time (L1-resident) and fill each panel's 16 groups from them: going panel by
		// panel over all kc rows reads 32 bytes from each of kc rows m floats apart, and going
		// row by row writes to all the panels, kc·mr floats apart, at once; either way the
		// streams collide in the same cache sets when those distances are multiples of 4 KiB.
		const pb = 16
		for ps := 0; ps < kc; ps += pb {
			pe := min(kc, ps+pb)
			for ir, h := i0, 0; ir < i1; ir += h {
				h = panelHeight(ir, i1, mr)
				d := dst[(ir-i0)*kc:][:h*kc]
				if h == 8 && g8 != nil {
					g8(d[ps*8:], a[(p0+ps)*m+ir:], m, pe-ps)
					continue
				}
				gatherRuns(d[ps*h:], a[(p0+ps)*m+ir:], m, h, pe-ps)
			}
		}
		return
	}
	for ir, h := i0, 0; ir < i1; ir += h {
		h = panelHeight(ir, i1, mr)
		d := dst[(ir-i0)*kc:][:h*kc]
		if tr != nil && h == 8 && ir+8 < i1 && panelHeight(ir+8, i1, mr) == 8 {
			// Two full 8-row panels at once, 16 k steps at a time.
			d1 := dst[(ir+8-i0)*kc:][:8*kc]
			p := 0
			for ; p+16 <= kc; p += 16 {
				tr(d[p*8:], d1[p*8:], 8, a[ir*k+p0+p:], k)
			}
			if p < kc {
				interleave(d[p*8:], a[ir*k+p0+p:], k, 8, kc-p, 8)
				interleave(d1[p*8:], a[(ir+8)*k+p0+p:], k, 8, kc-p, 8)
			}
			h = 16
			continue
		}
		interleave(d, a[ir*k+p0:], k, h, kc, h)
	}
}

// gatherRuns copies n runs of h floats, lds apart in src, to consecutive groups of h in d.
func gatherRuns(d, src []float32, lds, h, n int) {
	if h == 8 {
		gather8(d, src, lds, n)
		return
	}
	// Element by element: copy would call memmove for every few floats.
	for p := range n {
		dp, sp := d[p*h:][:h], src[p*lds:][:h]
		for r := range dp {
			dp[r] = sp[r]
		}
	}
}

// copyRowsInGo is copyRowsIn in Go.
func copyRowsInGo(d, src []float32, lds, w, n int) {
	for p := range n {
		copy(d[p*w:][:w], src[p*lds:][:w])
	}
}

// copyRowsOutGo is copyRowsOut in Go.
func copyRowsOutGo(d []float32, ldd int, src []float32, w, n int) {
	for p := range n {
		copy(d[p*ldd:][:w], src[p*w:][:w])
	}
}

// gather8 is gatherRuns for 8-row panels.
func gather8(d, src []float32, lds, n int) {
	// Element by element: an array assignment through pointers compiles to a memmove call.
	d = d[:n*8]
	for p := 0; p < len(d); p += 8 {
		g, s := (*[8]float32)(d[p:]), (*[8]float32)(src[p/8*lds:])
		g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7] = s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]
	}
}

// interleave writes d[p·ldd+r] = src[r·lds+p] for r < h, p < kc: h rows of a row-major matrix,
// read across, become kc groups of h floats, ldd apart.
func interleave(d, src []float32, lds, h, kc, ldd int) {
	for ; h >= 8; h -= 8 {
		// Eight rows at a time, so that each group is one run of stores.
		r0, r1, r2, r3 := src[:kc], src[lds:][:kc], src[2*lds:][:kc], src[3*lds:][:kc]
		r4, r5, r6, r7 := src[4*lds:][:kc], src[5*lds:][:kc], src[6*lds:][:kc], src[7*lds:][:kc]
		for p := range r0 {
			g := (*[8]float32)(d[p*ldd:])
			g[0], g[1], g[2], g[3] = r0[p], r1[p], r2[p], r3[p]
			g[4], g[5], g[6], g[7] = r4[p], r5[p], r6[p], r7[p]
		}
		if h == 8 {
			return
		}
		d, src = d[8:], src[8*lds:]
	}
	for r := range h {
		for p, v := range src[r*lds:][:kc] {
			d[p*ldd+r] = v
		}
	}
}

// packB writes columns [j0, j0+nr) of B (k×n, or n×k when trans) over K steps [p0, p0+kc) into
// dst: kc groups of nr floats, one per column, columns past n zero.
func packB(dst, b []float32, trans bool, k, n, p0, kc, j0, nr int, tr transposer16, tr8 transposer8, gb gatherer8) {
	cols := min(nr, n-j0)
	if !trans && cols == nr && gb != nil {
		gb(dst, b[p0*n+j0:], n, kc)
		return
	}
	if !trans {
		for p := range kc {
			dp := dst[p*nr:][:nr]
			copy(dp, b[(p0+p)*n+j0:][:cols])
			clear(dp[cols:])
		}
		return
	}
	// b is n×k: column j of the panel is row j of b, read across.
	c0 := 0
	if tr != nil {
		for ; c0+16 <= cols; c0 += 16 {
			src := b[(j0+c0)*k+p0:]
			p := 0
			for ; p+16 <= kc; p += 16 {
				tr(dst[p*nr+c0:], dst[p*nr+c0+8:], nr, src[p:], k)
			}
			if p < kc {
				interleave(dst[p*nr+c0:], src[p:], k, 16, kc-p, nr)
			}
		}
	}
	if tr8 != nil {
		for ; c0+8 <= cols; c0 += 8 {
			src := b[(j0+c0)*k+p0:]
			p := 0
			for ; p+8 <= kc; p += 8 {
				tr8(dst[p*nr+c0:], nr, src[p:], k)
			}
			if p < kc {
				interleave(dst[p*nr+c0:], src[p:], k, 8, kc-p, nr)
			}
		}
	}
	if c0 < cols {
		interleave(dst[c0:], b[(j0+c0)*k+p0:], k, cols-c0, kc, nr)
	}
	for c := cols; c < nr; c++ {
		for p := range kc {
			dst[p*nr+c] = 0
		}
	}
}

// packed recycles packed-B buffers between multiplies (they reach several MiB). Unlike a
// sync.Pool, the garbage collector does not empty it: buffers sized once stay sized, so multiplies
// of shapes seen before allocate nothing. It holds at most as many as were ever in use at once.
var packed struct {
	mu   sync.Mutex
	free []*[]float32
}

// getPacked returns a buffer of n floats: the smallest free one that holds n, else the largest
// free one grown, else a new one.
func getPacked(n int) *[]float32 {
	packed.mu.Lock()
	best := -1
	for i, p := range packed.free {
		fits, bestFits := cap(*p) >= n, best >= 0 && cap(*packed.free[best]) >= n
		switch {
		case best < 0,
			fits && !bestFits,
			fits && cap(*p) < cap(*packed.free[best]),
			!fits && !bestFits && cap(*p) > cap(*packed.free[best]):
			best = i
		}
	}
	var p *[]float32
	if best >= 0 {
		last := len(packed.free) - 1
		p = packed.free[best]
		packed.free[best] = packed.free[last]
		packed.free = packed.free[:last]
	}
	packed.mu.Unlock()
	if p == nil {
		p = new([]float32)
	}
	*p = grow(*p, n)
	return p
}

func putPacked(p *[]float32) {
	packed.mu.Lock()
	packed.free = append(packed.free, p)
	packed.mu.Unlock()
}
