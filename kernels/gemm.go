package kernels

import "fmt"

// MatMulNN computes c (m×n) = a (m×k) · b (k×n), all row-major; with acc it adds to c instead.
func MatMulNN(c, a, b []float32, m, k, n int, acc bool) { gemm(false, false, c, a, b, m, k, n, acc) }

// MatMulNT computes c (m×n) = a (m×k) · bᵀ where b is (n×k): a Linear layer's forward, x·Wᵀ.
func MatMulNT(c, a, b []float32, m, k, n int, acc bool) { gemm(false, true, c, a, b, m, k, n, acc) }

// MatMulTN computes c (m×n) = aᵀ · b where a is (k×m) and b is (k×n): a weight gradient, dYᵀ·X.
func MatMulTN(c, a, b []float32, m, k, n int, acc bool) { gemm(true, false, c, a, b, m, k, n, acc) }

// gemmImpl is one instruction set's micro-kernels, for tiles of up to mr×nr.
type gemmImpl struct {
	name   string
	mr, nr int
	kerns  []microKernel // kerns[r] computes a tile of r rows, 1 ≤ r ≤ mr
	tr     transposer16  // fast packing transpose, or nil
	g8     gatherer8     // packing copy of 8-float runs (used when mr is 8)
}

// microKernel computes one tile of C, nr columns wide, over kc steps of K, from a packed A
// micro-panel (kc groups of one float per tile row) and B micro-panel (kc groups of nr floats,
// ldb apart). Each element starts from C (load) or zero and takes one multiply-add per k step,
// in k order; internal/asmgen spells the contract out.
type microKernel func(kc int, a, b, c []float32, ldb, ldc int, load bool)

// Blocking, after BLIS (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
// Functionality", 2015), transposed to row-major C: the micro-kernel broadcasts A and loads B
// vectors, so the packed A micro-panel (kc×mr) is the operand that stays in L1 while the kernel
// sweeps the B micro-panels (kc×nr) of the task's kc×nc block, which stays in L2.
//
// K is cut into blocks of at most kcMax steps, the cut depending on K alone. The partial sums of
// a block pass through C as float32, and the next block continues the same chain from there, so
// the K blocking changes nothing in the result: it is there for the caches. With acc, the chain
// starts from the old C (c = fma(a_k-1, b_k-1, … fma(a_0, b_0, c))) rather than adding C at the
// end. That is one fixed place for the add, and it also means that accumulating a product over
// K tokens in two calls (first acc=false, then acc=true) is bit for bit the product over the
// concatenated tokens: micro-batched weight gradients equal the whole-batch one.
const (
	kcMax = 256 // K steps per block: the kc×nr B micro-panel (32 KiB at nr=32) streams from L2
	mcMin = 96  // rows of C per task, rounded up to a multiple of the kernel's mr
	ncMax = 256 // columns of C per task: the kc×nc B block (256 KiB) stays in L2

	// smallWork is the m·n·k below which a multiply runs on the caller's goroutine alone: handing
	// out tiles costs a few microseconds, which such a multiply would not win back.
	smallWork = 1 << 19
)

func gemm(transA, transB bool, c, a, b []float32, m, k, n int, acc bool) {
	if m < 0 || k < 0 || n < 0 {
		panic(fmt.Sprintf("kernels: negative matrix size m=%d k=%d n=%d", m, k, n))
	}
	if len(a) < m*k || len(b) < k*n || len(c) < m*n {
		panic(fmt.Sprintf("kernels: slices too short for m=%d k=%d n=%d: len(a)=%d (want %d), len(b)=%d (want %d), len(c)=%d (want %d)",
			m, k, n, len(a), m*k, len(b), k*n, len(c), m*n))
	}
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if !acc {
			clear(c[:m*n])
		}
		return
	}
	im := isa.Load()
	mr, nr := im.mr, im.nr
	threads := Threads()
	if m*n*k < smallWork {
		threads = 1
	}

	// K blocks: nkb blocks of kcb steps, the last one shorter.
	nkb := (k + kcMax - 1) / kcMax
	kcb := (k + nkb - 1) / nkb

	// B panels of nr columns: packed once for the whole multiply (in parallel over panels; for
	// the K block starting at p0, of kc steps, panel q lives at bp[p0·npad + q·kc·nr:], kc rows
	// of nr floats), or, when few rows of A will reuse them and B is stored k×n, read in place
	// (ldb = n) and only a partial last panel packed.
	npanels := (n + nr - 1) / nr
	direct := !transB && m <= directMaxM
	npad, first := npanels*nr, 0
	if direct {
		npad, first = nr, npanels-1
		if n%nr == 0 {
			first = npanels
		}
	}
	bpp := getPacked(k * npad)
	bp := *bpp
	parallelFor(npanels-first, threads, func(_ *scratch, q int) {
		q += first
		for p0 := 0; p0 < k; p0 += kcb {
			kc := min(kcb, k-p0)
			packB(bp[p0*npad+(q-first)*kc*nr:][:kc*nr], b, transB, k, n, p0, kc, q*nr, nr, im.tr)
		}
	})

	mc := (mcMin + mr - 1) / mr * mr
	nc := max(ncMax/nr, 1) * nr
	nic := (m + mc - 1) / mc
	njc := (n + nc - 1) / nc
	parallelFor(nic*njc, threads, func(s *scratch, t int) {
		i0, j0 := t/njc*mc, t%njc*nc
		i1, j1 := min(m, i0+mc), min(n, j0+nc)
		s.ap = grow(s.ap, (i1-i0)*kcb)
		s.tile = grow(s.tile, mr*nr)
		for p0 := 0; p0 < k; p0 += kcb {
			kc := min(kcb, k-p0)
			load := acc || p0 > 0
			packA(s.ap[:(i1-i0)*kc], a, transA, m, k, i0, i1, p0, kc, mr, im.tr, im.g8)
			bblk := bp[p0*npad:]
			for ir := i0; ir < i1; ir += mr {
				rows := min(mr, i1-ir)
				kern := im.kerns[rows]
				ap := s.ap[(ir-i0)*kc:][:rows*kc]
				for jr := j0; jr < j1; jr += nr {
					cols := min(nr, n-jr)
					var bq []float32
					ldb := nr
					switch q := jr / nr; {
					case q < first:
						bq, ldb = b[p0*n+jr:], n
					default:
						bq = bblk[(q-first)*kc*nr:][:kc*nr]
					}
					if cols == nr {
						kern(kc, ap, bq, c[ir*n+jr:], ldb, n, load)
						continue
					}
					// A partial column panel: the kernel runs the full width on a copy, so that
					// the columns that exist get exactly the arithmetic they would get in a full
					// tile (the missing ones are zero padding in the packed panel).
					tile := s.tile[:rows*nr]
					if load {
						clear(tile)
						for r := range rows {
							copy(tile[r*nr:][:cols], c[(ir+r)*n+jr:])
						}
					}
					kern(kc, ap, bq, tile, ldb, nr, load)
					for r := range rows {
						copy(c[(ir+r)*n+jr:][:cols], tile[r*nr:])
					}
				}
			}
		}
	})
	putPacked(bpp)
}

// directMaxM is the largest M for which a k×n B is read in place rather than packed: packing
// costs a pass over B, which only pays when enough rows of A reuse each packed panel.
var directMaxM = 64
