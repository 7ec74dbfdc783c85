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

	// Packing helpers in assembly where the CPU has them, nil otherwise (plain Go then). They
	// only move floats, so they change no result.
	tr  transposer16 // 16×16 transpose (AVX-512)
	tr8 transposer8  // 8×8 transpose (AVX)
	g8  gatherer8    // copy of 8-float runs, for 8-row A panels
	gb  gatherer8    // copy of nr-float runs, for full B panels of B stored k×n
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

	// smallWork is the m·n·k below which a multiply runs on the caller's goroutine alone: waking
	// a helper costs some microseconds, about what such a multiply takes (10 µs at 200 GFLOP/s).
	smallWork = 1 << 20
)

func gemm(transA, transB bool, c, a, b []float32, m, k, n int, acc bool) {
	gemmPacked(nil, transA, transB, c, a, b, m, k, n, acc)
}

// gemmPacked is gemm with B's packed form taken from (or left in) pk, when pk is in a span.
func gemmPacked(pk *Packs, transA, transB bool, c, a, b []float32, m, k, n int, acc bool) {
	threads := Threads()
	if m*n*k < smallWork {
		threads = 1
	}
	gemmWith(threads, pk, transA, transB, c, a, b, m, k, n, acc)
}

// gemmOn is gemm on at most threads goroutines, the caller included. A caller that is itself one
// task of a parallel loop (attention's heads) passes 1: its multiplies are the loop's tiles, and
// offering them to the pool from inside the loop would only wake helpers that are busy with the
// loop's other tasks. The result does not depend on threads.
func gemmOn(threads int, transA, transB bool, c, a, b []float32, m, k, n int, acc bool) {
	gemmWith(threads, nil, transA, transB, c, a, b, m, k, n, acc)
}

func gemmWith(threads int, pk *Packs, transA, transB bool, c, a, b []float32, m, k, n int, acc bool) {
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

	// K blocks: nkb blocks of kcb steps, the last one shorter.
	nkb := (k + kcMax - 1) / kcMax
	kcb := (k + nkb - 1) / nkb

	// How B reaches the kernels, in panels of nr columns:
	//   - shared: when many rows of A reuse it, B is packed once for the whole multiply, all
	//     threads packing panels, and every task reads it. For the K block starting at p0 (kc
	//     steps), panel q lives at bp[p0·npad + q·kc·nr:], kc rows of nr floats.
	//   - local: when all of A's rows fit one task, each task packs the columns it alone uses,
	//     so the packed panels never move from the core that wrote them to another.
	//   - in place: when few rows reuse it and B is stored k×n, the kernels read it directly
	//     (ldb = n), and a task packs only a partial last panel.
	mc := (mcMin + mr - 1) / mr * mr
	inPlace := !transB && (m <= 2*mr || m <= directMaxM && n%512 != 0)
	shared := !inPlace && m > mc
	// A B that pk keeps packed is read from there: shared, whatever m (a kept pack costs no
	// pass over B, which is all that reading in place would save).
	var kept []float32
	if pk != nil {
		if kept = pk.get(im, transB, b, k, n, threads); kept != nil {
			inPlace, shared = false, true
		}
	}

	// Tasks of mc×nc blocks of C; smaller ones when there would be too few to keep the threads
	// evenly busy (a 256×256 weight gradient is three 96-row tasks). Block sizes do not touch
	// the results.
	nc := max(ncMax/nr, 1) * nr
	nic, njc := (m+mc-1)/mc, (n+nc-1)/nc
	for threads > 1 && nic*njc < 4*threads {
		if shared && mc >= nc/2 && mc > 2*mr {
			mc = (mc/2 + mr - 1) / mr * mr
		} else if nc > 2*nr {
			nc = (nc/2 + nr - 1) / nr * nr
		} else {
			break
		}
		nic, njc = (m+mc-1)/mc, (n+nc-1)/nc
	}

	npanels := (n + nr - 1) / nr
	g := gemmCall{im: im, transA: transA, transB: transB, c: c, a: a, b: b, m: m, k: k, n: n, acc: acc,
		kcb: kcb, mc: mc, nc: nc, njc: njc, npad: npanels * nr, inPlace: inPlace, shared: shared}
	var bpp *[]float32
	switch {
	case kept != nil:
		g.bp = kept
	case shared:
		bpp = getPacked(k * g.npad)
		g.bp = *bpp
		defer putPacked(bpp)
	}
	if threads <= 1 || nic*njc == 1 {
		// One goroutine: no job, no closure on the heap (attention's per-head multiplies are
		// thousands a step), the same tiles in the same order.
		s := getScratch()
		if shared && kept == nil {
			g.packAll()
		}
		for ic := range nic {
			g.blocks(s, ic, 0, njc)
		}
		putScratch(s)
		return
	}
	gp := new(gemmCall)
	*gp = g
	if shared && kept == nil {
		parallelFor(npanels, threads, gp.packPanel)
	}
	parallelFor(nic*njc, threads, gp.task)
}

// gemmCall is one multiply's operands and blocking, shared by its tasks.
type gemmCall struct {
	im             *gemmImpl
	transA, transB bool
	c, a, b        []float32
	m, k, n        int
	acc            bool
	kcb            int // K steps per block
	mc, nc, njc    int // task block of C and the number of column blocks
	npad           int // n rounded up to whole panels
	inPlace        bool
	shared         bool
	bp             []float32 // B packed once for all tasks, when shared
}

// packPanel packs column panel q of B, every K block, into the shared bp: for the K block
// starting at p0 (kc steps), panel q lives at bp[p0·npad + q·kc·nr:], kc rows of nr floats.
func (g *gemmCall) packPanel(_ *scratch, q int) {
	nr, kcb, k := g.im.nr, g.kcb, g.k
	for p0 := 0; p0 < k; p0 += kcb {
		kc := min(kcb, k-p0)
		packB(g.bp[p0*g.npad+q*kc*nr:][:kc*nr], g.b, g.transB, k, g.n, p0, kc, q*nr, nr, g.im.tr, g.im.tr8, g.im.gb)
	}
}

// packAll packs every column panel of B, every K block, into the shared bp on the caller's
// goroutine: packChunk over all of packChunks. Packing only moves floats: the order changes no
// result.
func (g *gemmCall) packAll() {
	for c := range g.packChunks() {
		g.packChunk(c)
	}
}

// packRowChunk is the rows of a k×n B that one chunk of its packing copies.
const packRowChunk = 32

// packChunks is how many pieces of work packing B into the shared bp is cut into, for
// packChunk: B's column panels where B is n×k (each a transpose of nr of its rows), and runs of
// packRowChunk rows where B is stored k×n, plus a partial last panel. A panel of a k×n B is a
// column strip of it, nr floats wide: packing it panel after panel reads B's rows again for
// each panel, nr floats of each, which at n = 1,024 (rows 4 KiB apart, in the same few cache
// sets) ran at half the speed of reading each row once, in order, and copying its runs to their
// panels.
func (g *gemmCall) packChunks() int {
	nr, npanels := g.im.nr, g.npad/g.im.nr
	full := g.n / nr // panels without padding
	if g.transB || full == 0 {
		return npanels
	}
	c := (g.k + packRowChunk - 1) / packRowChunk
	if full < npanels {
		c++ // the partial last panel
	}
	return c
}

// packChunk packs chunk c of packChunks. Chunks write disjoint parts of bp, so any goroutines
// may pack any of them at once.
func (g *gemmCall) packChunk(c int) {
	nr := g.im.nr
	full := g.n / nr
	rowChunks := (g.k + packRowChunk - 1) / packRowChunk
	if g.transB || full == 0 || c >= rowChunks {
		if !g.transB && full > 0 {
			c = full // the partial last panel, zero padded
		}
		g.packPanel(nil, c)
		return
	}
	for p := c * packRowChunk; p < min(g.k, (c+1)*packRowChunk); p++ {
		p0 := p / g.kcb * g.kcb // the K block of row p
		kc := min(g.kcb, g.k-p0)
		d := g.bp[p0*g.npad+(p-p0)*nr:]
		row := g.b[p*g.n:]
		for q := range full {
			copy(d[q*kc*nr:][:nr], row[q*nr:])
		}
	}
}

// task computes block t of C (mc×nc), row-major over the blocks.
func (g *gemmCall) task(s *scratch, t int) { g.blocks(s, t/g.njc, t%g.njc, t%g.njc+1) }

// blocks computes the blocks [jc0, jc1) of row block ic of C. Their rows of A are packed once
// for all of them, K block by K block: a goroutine that computes a whole row of blocks (the
// multiply on one goroutine) packs A once instead of once per column block — a quarter of the
// packing for C 1,024 columns wide. Each K block still ends on every column block before the next
// begins, so every element's chain is the same, and in the same order, as task by task.
func (g *gemmCall) blocks(s *scratch, ic, jc0, jc1 int) {
	im, m, k, n, kcb := g.im, g.m, g.k, g.n, g.kcb
	mr, nr := im.mr, im.nr
	i0 := ic * g.mc
	i1 := min(m, i0+g.mc)
	if !g.shared {
		s.bp = grow(s.bp, g.nc*kcb)
	}
	s.ap = grow(s.ap, (i1-i0)*kcb)
	s.tile = grow(s.tile, mr*nr)
	for p0 := 0; p0 < k; p0 += kcb {
		kc := min(kcb, k-p0)
		load := g.acc || p0 > 0
		packA(s.ap[:(i1-i0)*kc], g.a, g.transA, m, k, i0, i1, p0, kc, mr, im.tr, im.g8)
		for jc := jc0; jc < jc1; jc++ {
			g.block(s, i0, i1, jc*g.nc, min(n, (jc+1)*g.nc), p0, kc, load)
		}
	}
}

// block computes the columns [j0, j1) of rows [i0, i1) of C over the K block [p0, p0+kc), from
// the rows' A panels that blocks packed in s.ap.
func (g *gemmCall) block(s *scratch, i0, i1, j0, j1, p0, kc int, load bool) {
	im, c, b := g.im, g.c, g.b
	k, n := g.k, g.n
	mr, nr := im.mr, im.nr
	// Panels [qa, qb) are packed by this task (local, or a partial last panel in place).
	qa, qb := j0/nr, (j1+nr-1)/nr
	if g.inPlace {
		qa = qb
		if j1 == n && n%nr != 0 {
			qa = qb - 1
		}
	}
	var bblk []float32
	if g.shared {
		bblk, qa = g.bp[p0*g.npad:], 0
	} else {
		bblk = s.bp
		for q := qa; q < qb; q++ {
			packB(bblk[(q-qa)*kc*nr:][:kc*nr], b, g.transB, k, n, p0, kc, q*nr, nr, im.tr, im.tr8, im.gb)
		}
	}
	tile := func(ir, jr int) {
		rows, cols := panelHeight(ir, i1, mr), min(nr, n-jr)
		kern := im.kerns[rows]
		ap := s.ap[(ir-i0)*kc:][:rows*kc]
		var bq []float32
		ldb := nr
		if q := jr / nr; q < qa {
			bq, ldb = b[p0*n+jr:], n // in place
		} else {
			bq = bblk[(q-qa)*kc*nr:][:kc*nr]
		}
		if cols == nr {
			kern(kc, ap, bq, c[ir*n+jr:], ldb, n, load)
			return
		}
		// A partial column panel: the kernel runs the full width on a copy, so that the
		// columns that exist get exactly the arithmetic they would get in a full tile (the
		// missing ones are zero padding in the packed panel).
		t := s.tile[:rows*nr]
		if load {
			clear(t)
			for r := range rows {
				copy(t[r*nr:][:cols], c[(ir+r)*n+jr:])
			}
		}
		kern(kc, ap, bq, t, ldb, nr, load)
		for r := range rows {
			copy(c[(ir+r)*n+jr:][:cols], t[r*nr:])
		}
	}
	if !g.shared {
		// Few rows: sweep them all under each B micro-panel, which then stays in L1.
		// (An unpacked B block would not stay in L2 for the other order.)
		for jr := j0; jr < j1; jr += nr {
			for ir, h := i0, 0; ir < i1; ir += h {
				h = panelHeight(ir, i1, mr)
				tile(ir, jr)
			}
		}
		return
	}
	// The A micro-panel stays in L1 while the kernel sweeps the packed B block in L2.
	for ir, h := i0, 0; ir < i1; ir += h {
		h = panelHeight(ir, i1, mr)
		for jr := j0; jr < j1; jr += nr {
			tile(ir, jr)
		}
	}
}

// panelHeight returns the height of the row panel that starts at ir, in a block of rows ending
// at i1: mr, except that the last two panels share their rows evenly when the last one would be
// under mr/2 high, because a kernel of one or two rows has too few accumulators to cover the
// FMA latency (7 rows on AVX2 run as 4+3, not 6+1). Heights only choose kernels: an element's
// chain is the same in any of them.
func panelHeight(ir, i1, mr int) int {
	left := i1 - ir
	if left <= mr || left >= 2*mr || left-mr >= mr/2 {
		return min(mr, left)
	}
	return (left + 1) / 2
}

// directMaxM bounds the M for which a k×n B is read in place rather than packed. Packing costs a
// pass over B, which only pays when enough row panels of A reuse each packed panel, and when B's
// rows are not a multiple of 2 KiB apart: at such strides the kc rows of an unpacked block fall
// into a few cache sets and the block cannot stay in L2 (measured on Zen 5 at M=300, N=1024: 195
// GFLOP/s in place, 251 packed; at M=128, N=768: 269 in place, 234 packed). With at most two row
// panels there is too little reuse for that to matter.
var directMaxM = 128
