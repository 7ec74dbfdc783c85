package model

import (
	"fmt"
	"math"
	"sort"

	"github.com/shoal-ml/shoal/kernels"
)

// Experts computes the expert MLPs of a stage's MoE blocks. The stage routes, gathers each expert's
// tokens and calls Forward with xs[e] = the rows (n_e×C) routed to expert e, in token order; an
// expert that got no tokens gets an empty slice and returns one. Backward mirrors it with the
// output gradients and returns the input gradients. Calls for one (block, micro-batch) come in
// pairs, Forward before Backward; several micro-batches may be in flight (1F1B).
//
// LocalExperts computes them in this process; a remote implementation sends the rows to the peers
// that hold the experts. Both run the same Expert code on the same rows, so they agree bit for bit.
//
// The rows are the callee's for the duration of the call: it may round them in place to the job's
// wire format (LocalExperts does, see wire.go), as the boundary between a stage and its experts
// asks, and must copy what it keeps after returning (the stage reuses their memory). What a
// callee returns the caller may read — Forward's rows until the micro-batch's Backward, which
// reads them, Backward's until the block's next Backward — and must not keep longer:
// LocalExperts returns its experts' own memory (Expert.Forward, Expert.Backward).
type Experts interface {
	Forward(block, mb int, xs [][]float32, splits []int) ([][]float32, error)
	// Backward's splits[e] is how many of expert e's rows (the first ones) belong to token
	// group 0 (see ExpertGroups).
	Backward(block, mb int, dys [][]float32, splits []int) ([][]float32, error)
}

// ExpertGroups is the number of token groups a replicated expert's rows are split into: group r
// is the micro-batches of half r of the gradient tree's root (GroupHalf), so replica r of the
// expert computes that half's node of the tree and the two replicas exchange theirs — the same
// sum as the single process's, bit for bit (gradtree.go). A whole expert gets both groups; in a
// training micro-batch one of them is always empty.
const ExpertGroups = 2

// GroupEdge is how many of micro-batch mb's n token rows (of M micro-batches) fall in token group
// 0: all of them in the first half of the micro-batches (GroupHalf), none in the second. M < 1
// (evaluation, sampling: no gradient) splits the micro-batch itself in half, sharing a
// replicated expert's work.
func GroupEdge(mb, M, n int) int {
	if M < 1 {
		return n / 2
	}
	if mb < GroupHalf(M, 0)[1] {
		return n
	}
	return 0
}

// Expert is one expert MLP (c_fc, GELU, c_proj) of one MoE block: the smallest shard. It runs
// forward, backward and (through its Shard) the optimizer on its own four tensors, on a Device;
// its rows come and go as host slices, because routing happens on the host of the stage.
type Expert struct {
	cfg          Config
	Block, Index int
	P, G         *Params // the host mirror off Host (see Shard.Pull)
	// Replica is -1 for a whole expert (it holds both token groups); r ∈ {0, 1} for replica r of
	// a replicated expert, which is sent only group r's rows.
	Replica int

	dev                        Device
	wfc, bfc, wproj, bproj     Buf
	g                          *devParams // G's buffers, where backward accumulates
	dwfc, dbfc, dwproj, dbproj Buf
	acts                       map[int]*expertActs // by micro-batch
	free                       []*expertActs
	own                        expertScratch // Backward's, when called alone (not by LocalExperts)
	y                          scratch
}

// expertScratch is the working memory of an expert's backward, one operation at a time: its own
// (Expert.Backward) or one that LocalExperts shares between the experts it runs.
type expertScratch struct {
	dy, dg, dh, dx scratch
	dxHost         []float32 // the input gradient returned, when the caller gives no memory for it
	// capRows, when set, is the most rows one expert can get (N of the micro-batch: one slot
	// per token at most): dg and dh are allocated for that many at once, so that they never
	// grow. Unset, they grow with slack (scratch.atSlack).
	capRows int
}

func (sc *expertScratch) at(d Device, s *scratch, rows, width int) Buf {
	if sc.capRows > 0 {
		return s.sized(d, rows*width, max(sc.capRows-rows, 0)*width, false)
	}
	return s.atSlack(d, rows*width)
}

type expertActs struct {
	n           int
	x, h, g, th Buf       // input (n,C), pre-GELU (n,F), GELU output (n,F), its tanh (n,F)
	out         []float32 // the output rows Forward returned (n,C), kept until Backward
	// The expert's own memory for the above, when it is not given views of a blockRows.
	mem [4]scratch
	y   []float32
	// The dense path's (forwardDense): the output rows stay on the device, in yd (its memory
	// ymem), and x is the block's input itself.
	yd   Buf
	ymem scratch
}

// blockRows is the memory of one micro-batch's forward through the local experts of one MoE
// block (LocalExperts.Forward): every expert's activations and output rows, cut in expert order
// from buffers of R = N·k rows, the micro-batch's token-expert assignments. R is the same for
// every micro-batch of a step while each expert's share follows the routing, so these buffers
// are sized once; an expert's own would grow whenever it got more rows than ever before.
type blockRows struct {
	mem [4]scratch // x (R,C), h, g, th (R,F)
	y   []float32  // output rows (R,C), on the host
}

// NewExpert binds expert e of block blk to its parameters and gradients (views or own slabs) on
// Host, as a whole expert; SetReplica makes it one replica of two.
func NewExpert(cfg Config, blk, e int, p, g *Params) *Expert {
	return newExpert(Host{}, cfg, blk, e, p, g, newDevParams(Host{}, p), newDevParams(Host{}, g))
}

func newExpert(dev Device, cfg Config, blk, e int, p, g *Params, dp, dg *devParams) *Expert {
	pre := ExpertPrefix(blk, e)
	x := &Expert{cfg: cfg, Block: blk, Index: e, P: p, G: g, Replica: -1, dev: dev, g: dg,
		wfc: dp.get(pre + "c_fc.weight"), bfc: dp.get(pre + "c_fc.bias"),
		wproj: dp.get(pre + "c_proj.weight"), bproj: dp.get(pre + "c_proj.bias"),
		dwfc: dg.get(pre + "c_fc.weight"), dbfc: dg.get(pre + "c_fc.bias"),
		dwproj: dg.get(pre + "c_proj.weight"), dbproj: dg.get(pre + "c_proj.bias"),
		acts: map[int]*expertActs{}}
	return x
}

// SetReplica makes x replica r (0 or 1) of a replicated expert: it is sent only token group r's
// rows — the micro-batches of half r (GroupHalf) — so its shard's gradient tree computes that
// half's node, which the replicas exchange (Shard.GradNodes, ReduceGradients) before the
// optimizer. Set it before the shard's BeginGradients.
func (x *Expert) SetReplica(r int) { x.Replica = r }

// Forward computes the expert on x (n×C) for micro-batch mb and keeps what backward needs. The
// rows it returns are the expert's memory, valid until mb's Backward (or Reset).
func (x *Expert) Forward(mb int, in []float32) ([]float32, error) { return x.forward(mb, in, nil, 0) }

// forward is Forward in the expert's own memory (br nil) or in br's rows from row off on.
func (x *Expert) forward(mb int, in []float32, br *blockRows, off int) ([]float32, error) {
	C, F := x.cfg.NEmbd, x.cfg.Hidden()
	if len(in)%C != 0 {
		return nil, fmt.Errorf("expert %d/%d: input of %d floats is not rows of %d", x.Block, x.Index, len(in), C)
	}
	if _, busy := x.acts[mb]; busy {
		return nil, fmt.Errorf("expert %d/%d: micro-batch %d forwarded twice", x.Block, x.Index, mb)
	}
	n := len(in) / C
	a := x.alloc(n, br, off)
	out := a.out
	if n > 0 {
		d := x.dev
		d.Write(a.x, in)
		d.LinearForward(a.h, a.x, x.wfc, x.bfc, n, C, F)
		d.GELUForward(a.g, a.th, a.h)
		y := sink(d, out, &x.y)
		d.LinearForward(y, a.g, x.wproj, x.bproj, n, F, C)
		collect(d, out, y)
	}
	x.acts[mb] = a
	return out, nil
}

// Backward takes the output gradient (n×C) of micro-batch mb, accumulates the expert's parameter
// gradients in G — one chain over the rows, in token order — and returns the input gradient, the
// expert's memory until its next Backward. split (the rows of token group 0) only routes rows.
func (x *Expert) Backward(mb int, dy []float32, split int) ([]float32, error) {
	return x.backward(mb, dy, split, &x.own, nil)
}

// backward is Backward with working memory sc, writing the input gradient to dx (len(dy)) when
// given, else to sc's.
func (x *Expert) backward(mb int, dy []float32, split int, sc *expertScratch, dx []float32) ([]float32, error) {
	C, F := x.cfg.NEmbd, x.cfg.Hidden()
	a, ok := x.acts[mb]
	if !ok {
		return nil, fmt.Errorf("expert %d/%d: backward of micro-batch %d without its forward", x.Block, x.Index, mb)
	}
	if len(dy) != a.n*C {
		return nil, fmt.Errorf("expert %d/%d: gradient of %d floats, want %d", x.Block, x.Index, len(dy), a.n*C)
	}
	delete(x.acts, mb)
	defer func() { x.free = append(x.free, a) }()
	n := a.n
	if dx == nil {
		sc.dxHost = growSlack(sc.dxHost, n*C)
		dx = sc.dxHost[: n*C : n*C]
	}
	if n == 0 {
		return dx, nil
	}
	d := x.dev
	dyb, dxb := upload(d, dy, &sc.dy), sink(d, dx, &sc.dx)
	dgb, dhb := sc.at(d, &sc.dg, n, F), sc.at(d, &sc.dh, n, F)
	d.LinearBackward(dgb, x.dwproj, x.dbproj, dyb, a.g, x.wproj, n, F, C, false)
	d.GELUBackward(dhb, a.h, a.th, dgb)
	d.LinearBackward(dxb, x.dwfc, x.dbfc, dhb, a.x, x.wfc, n, C, F, false)
	collect(d, dx, dxb)
	return dx, nil
}

// alloc returns an activation record for n rows, reusing a released one. Its buffers are views
// of br's rows from row off on when br is given; otherwise the record's own, which grow with some
// slack (scratch.atSlack), since the rows an expert gets vary from one micro-batch to the next.
func (x *Expert) alloc(n int, br *blockRows, off int) *expertActs {
	var a *expertActs
	if k := len(x.free); k > 0 {
		a, x.free = x.free[k-1], x.free[:k-1]
	} else {
		a = &expertActs{}
	}
	a.n = n
	C, F, d := x.cfg.NEmbd, x.cfg.Hidden(), x.dev
	if br != nil {
		a.out = br.y[off*C : (off+n)*C : (off+n)*C]
		if a.out == nil {
			a.out = []float32{}
		}
		if n > 0 {
			a.x = d.Slice(br.mem[0].view, off*C, n*C)
			a.h = d.Slice(br.mem[1].view, off*F, n*F)
			a.g = d.Slice(br.mem[2].view, off*F, n*F)
			a.th = d.Slice(br.mem[3].view, off*F, n*F)
		}
		return a
	}
	a.y = growSlack(a.y, n*C)
	a.out = a.y[: n*C : n*C]
	if n > 0 {
		a.x, a.h, a.g, a.th = a.mem[0].atSlack(d, n*C), a.mem[1].atSlack(d, n*F), a.mem[2].atSlack(d, n*F), a.mem[3].atSlack(d, n*F)
	}
	return a
}

// Reset drops activations of abandoned micro-batches (the gradients are the shard's to clear).
func (x *Expert) Reset() {
	for mb := range x.acts {
		x.drop(mb)
	}
}

// LocalExperts computes experts in this process.
type LocalExperts struct {
	// Wire is the job's boundary formats: the rows of the experts computed here are rounded to
	// them on their way in and out (ForwardExpert, BackwardExpert), as a remote expert's are by
	// being sent.
	Wire    Wire
	byBlock map[int][]*Expert

	// Memory of Forward and Backward, which run a whole block's experts: the rows of each
	// micro-batch in flight, by (block, micro-batch), and the backward's, shared by the experts.
	rows     map[[2]int]*blockRows
	freeRows []*blockRows
	bw       expertScratch
	dxbuf    []float32 // (R,C): the input gradients Backward returns, cut in expert order
}

// NewLocalExperts holds the given experts; each block's list must have all E of them in order.
func NewLocalExperts(experts ...*Expert) *LocalExperts {
	l := &LocalExperts{byBlock: map[int][]*Expert{}, rows: map[[2]int]*blockRows{}}
	for _, e := range experts {
		l.byBlock[e.Block] = append(l.byBlock[e.Block], e)
	}
	for _, list := range l.byBlock {
		sort.Slice(list, func(i, j int) bool { return list[i].Index < list[j].Index })
	}
	return l
}

// Get returns expert e of block blk, or nil when it is not held here.
func (l *LocalExperts) Get(blk, e int) *Expert {
	for _, x := range l.byBlock[blk] {
		if x.Index == e {
			return x
		}
	}
	return nil
}

// All lists the experts held, by block then index.
func (l *LocalExperts) All() []*Expert {
	var blocks []int
	for b := range l.byBlock {
		blocks = append(blocks, b)
	}
	sort.Ints(blocks)
	var out []*Expert
	for _, b := range blocks {
		out = append(out, l.byBlock[b]...)
	}
	return out
}

// Forward implements Experts.
func (l *LocalExperts) Forward(block, mb int, xs [][]float32, splits []int) ([][]float32, error) {
	list := l.byBlock[block]
	if len(list) != len(xs) {
		return nil, fmt.Errorf("block %d: %d experts here, %d inputs", block, len(list), len(xs))
	}
	out := make([][]float32, len(xs))
	if len(list) == 0 {
		return out, nil
	}
	key := [2]int{block, mb}
	if _, busy := l.rows[key]; busy {
		return nil, fmt.Errorf("block %d: micro-batch %d forwarded twice", block, mb)
	}
	C, F, d := list[0].cfg.NEmbd, list[0].cfg.Hidden(), list[0].dev
	R := 0
	for _, x := range xs {
		R += len(x) / C
	}
	var br *blockRows
	if k := len(l.freeRows); k > 0 {
		br, l.freeRows = l.freeRows[k-1], l.freeRows[:k-1]
	} else {
		br = &blockRows{}
	}
	br.mem[0].at(d, R*C)
	for i := 1; i < 4; i++ {
		br.mem[i].at(d, R*F)
	}
	br.y = grow(br.y, R*C)
	l.rows[key] = br
	off := 0
	for e, x := range list {
		y, err := l.forwardExpert(x, mb, xs[e], br, off)
		if err != nil {
			return nil, err
		}
		out[e] = y
		off += len(xs[e]) / C
	}
	return out, nil
}

// Backward implements Experts.
func (l *LocalExperts) Backward(block, mb int, dys [][]float32, splits []int) ([][]float32, error) {
	list := l.byBlock[block]
	if len(list) != len(dys) {
		return nil, fmt.Errorf("block %d: %d experts here, %d gradients", block, len(list), len(dys))
	}
	out := make([][]float32, len(dys))
	if len(list) == 0 {
		return out, nil
	}
	R := 0
	for _, dy := range dys {
		R += len(dy)
	}
	l.dxbuf = grow(l.dxbuf, R)
	// At most one of a token's k slots reaches an expert: no expert gets more than R/k rows.
	cfg := list[0].cfg
	l.bw.capRows = R / cfg.NEmbd / max(cfg.TopK, 1)
	off := 0
	for e, x := range list {
		n := len(dys[e])
		dx, err := l.backwardExpert(x, mb, dys[e], splits[e], &l.bw, l.dxbuf[off:off+n:off+n])
		if err != nil {
			return nil, err
		}
		out[e] = dx
		off += n
	}
	if br, ok := l.rows[[2]int{block, mb}]; ok {
		delete(l.rows, [2]int{block, mb})
		l.freeRows = append(l.freeRows, br)
	}
	return out, nil
}

// moeActs is what an MoE block's routing keeps for backward.
type moeActs struct {
	probsBuf  scratch   // (N,E) router softmax on the device
	probs     []float32 // the same on the host
	probsHost []float32 // probs' memory off Host
	idx       []int32   // (N,k) chosen experts, by descending probability
	w         []float32 // (N,k) their probabilities: the combine weights
	tokens    [][]int32 // per expert: the rows routed to it, ascending
	slots     [][]int32 // per expert: which of the token's k slots chose it
	xs        [][]float32
	xbuf      []float32 // (N·k, C): the experts' input rows, xs[e] cut from it in expert order
	ys        [][]float32
	splits    []int     // per expert: how many of its rows are in token group 0
	frac      []float32 // per expert: share f_e of the N·k assignments
	aux       float64
	counts    []int // per expert: its assignments, for the router statistics (both paths)

	// The dense path's (moeForwardDense): the routing on the device.
	dense                      []*Expert // the block's experts, when this micro-batch took it
	gateBuf, maskBuf, statsBuf scratch   // (N,E), (N,E), (E+1)
	statsHost                  []float32
}

// moeStaging is host memory in which an MoE block's routing reads device buffers and computes
// their new contents, off Host; a stage runs one block at a time, so it has one.
type moeStaging struct {
	ln, out, dout, dln []float32
	dprobs             []float32 // (N,E), on every device: the router's gradient starts here
	dprobsBuf          scratch
	dys                [][]float32
	dybuf              []float32 // (N·k, C): the experts' output gradients, dys[e] cut from it
	// The dense path's backward, on the device: the gate's gradient (N,E), the router's logits'
	// (N,E), one expert's output and input gradients (N,C) at a time.
	dgate, dlogits, dy, dx scratch
}

// moeForward routes ln (N,C) through the router and the experts and writes the combined expert
// output to out (N,C). Following the anchor: probs = softmax(ln·routerᵀ), top-k by probability
// (ties to the lower index) weighted by their un-renormalised probabilities, dropless, and the
// Switch Transformer balancing loss aux = E·Σ_e f_e·P_e (Fedus et al. 2021, eq. 4).
//
// The router runs on the device, beside its weight and gradient, and only its probabilities
// (N·E floats, E ≪ C) come back: top-k, the gathering of each expert's rows and the combination
// of their outputs happen on the host, because Experts moves host rows. So ln is read once and
// out written once.
func moeForward(dev Device, st *moeStaging, a *moeActs, out, ln, router Buf, experts Experts, blk, mb, N, edge int, cfg Config, ledger *statsLedger) error {
	C, E, K := cfg.NEmbd, cfg.NExpert, cfg.TopK
	a.dense = denseExperts(dev, experts, blk, cfg)
	if a.dense != nil {
		return moeForwardDense(dev, a, out, ln, router, mb, N, cfg, ledger)
	}
	probs := a.probsBuf.at(dev, N*E)
	dev.LinearForward(probs, ln, router, nil, N, C, E)
	dev.SoftmaxRows(probs, N, E)
	a.probs = readView(dev, probs, &a.probsHost)
	lnh := readView(dev, ln, &st.ln)
	a.idx = growI(a.idx, N*K)
	a.w = grow(a.w, N*K)
	// An expert gets at most one slot of each row, so N rows of capacity never grow.
	a.tokens, a.slots = rowLists(a.tokens, E, N), rowLists(a.slots, E, N)
	for r := 0; r < N; r++ {
		p := a.probs[r*E : (r+1)*E]
		topK(p, a.idx[r*K:(r+1)*K])
		for s := 0; s < K; s++ {
			e := a.idx[r*K+s]
			a.w[r*K+s] = p[e]
			a.tokens[e] = append(a.tokens[e], int32(r))
			a.slots[e] = append(a.slots[e], int32(s))
		}
	}
	if cap(a.splits) < E {
		a.splits = make([]int, E)
	}
	a.splits = a.splits[:E]
	clear(a.splits)
	a.xbuf = grow(a.xbuf, N*K*C)
	xs := cutRows(&a.xs, a.xbuf, a.tokens, C)
	for e := 0; e < E; e++ {
		for _, r := range a.tokens[e] {
			if int(r) < edge {
				a.splits[e]++
			}
		}
		x := xs[e]
		for i, r := range a.tokens[e] {
			copy(x[i*C:(i+1)*C], lnh[int(r)*C:(int(r)+1)*C])
		}
	}
	ys, err := experts.Forward(blk, mb, xs, a.splits)
	if err != nil {
		return fmt.Errorf("block %d experts forward: %w", blk, err)
	}
	for e := range ys {
		if len(ys[e]) != len(xs[e]) {
			return fmt.Errorf("block %d expert %d: %d outputs for %d inputs", blk, e, len(ys[e]), len(xs[e]))
		}
	}
	a.ys = append(a.ys[:0], ys...)
	// Combine in expert order, as the anchor's index_add loop does. kernels.AddScaled is the loop
	// o[c] += w·y[c] with a vector loop: the same rounded product and sum for each element.
	oh := fillView(dev, out, &st.out)
	clear(oh)
	for e := 0; e < E; e++ {
		for i, r := range a.tokens[e] {
			w := a.w[int(r)*K+int(a.slots[e][i])]
			kernels.AddScaled(oh[int(r)*C:(int(r)+1)*C], ys[e][i*C:(i+1)*C], w) // o[c] += w·y[c]
		}
	}
	publish(dev, out, oh)
	a.frac = grow(a.frac, E)
	var aux float64
	for e := 0; e < E; e++ {
		var pm float64
		for r := 0; r < N; r++ {
			pm += float64(a.probs[r*E+e])
		}
		f := float64(len(a.tokens[e])) / float64(N*K)
		a.frac[e] = float32(f)
		aux += f * pm / float64(N)
	}
	a.aux = float64(E) * aux
	a.counts = growInts(a.counts, E)
	for e := range a.counts {
		a.counts[e] = len(a.tokens[e])
	}
	return nil
}

// moeBackward takes dout (N,C), the gradient of the block's MoE output, and writes dln (N,C)
// (overwriting it), accumulating the router's gradient. auxScale is d(loss)/d(aux) for this block.
// Mirroring forward, dout is read once, the experts' input gradients are combined on the host
// and written to dln once, and the router's backward runs on the device.
func moeBackward(dev Device, st *moeStaging, a *moeActs, dln, drouter, dout, ln, router Buf, experts Experts, blk, mb, N int, cfg Config, auxScale float32) error {
	C, E, K := cfg.NEmbd, cfg.NExpert, cfg.TopK
	if a.dense != nil {
		return moeBackwardDense(dev, st, a, dln, drouter, dout, ln, router, mb, N, cfg, auxScale)
	}
	douth := readView(dev, dout, &st.dout)
	st.dprobs = grow(st.dprobs, N*E)
	dprobs := st.dprobs
	clear(dprobs)
	st.dybuf = grow(st.dybuf, N*K*C)
	dys := cutRows(&st.dys, st.dybuf, a.tokens, C)
	for e := 0; e < E; e++ {
		dy := dys[e]
		for i, r := range a.tokens[e] {
			s := int(a.slots[e][i])
			w := a.w[int(r)*K+s]
			d, y := douth[int(r)*C:(int(r)+1)*C], a.ys[e][i*C:(i+1)*C]
			kernels.ScaleTo(dy[i*C:(i+1)*C], d, w) // dy[c] = w·d[c]
			var dw float32
			for c := range d {
				dw += d[c] * y[c]
			}
			dprobs[int(r)*E+e] += dw
		}
	}
	dxs, err := experts.Backward(blk, mb, dys, a.splits)
	if err != nil {
		return fmt.Errorf("block %d experts backward: %w", blk, err)
	}
	dl := fillView(dev, dln, &st.dln)
	clear(dl)
	for e := 0; e < E; e++ {
		if len(dxs[e]) != len(dys[e]) {
			return fmt.Errorf("block %d expert %d: %d input gradients for %d rows", blk, e, len(dxs[e]), len(a.tokens[e]))
		}
		for i, r := range a.tokens[e] {
			kernels.AddTo(dl[int(r)*C:(int(r)+1)*C], dxs[e][i*C:(i+1)*C])
		}
	}
	publish(dev, dln, dl)
	// The balancing loss: d aux / d p[r,e] = E·f_e/N; f is a count and has no gradient.
	for e := 0; e < E; e++ {
		g := auxScale * float32(E) * a.frac[e] / float32(N)
		for r := 0; r < N; r++ {
			dprobs[r*E+e] += g
		}
	}
	// Softmax backward: dlogit = p·(dp − Σ p·dp).
	for r := 0; r < N; r++ {
		p, dp := a.probs[r*E:(r+1)*E], dprobs[r*E:(r+1)*E]
		var s float32
		for e := range p {
			s += p[e] * dp[e]
		}
		for e := range p {
			dp[e] = p[e] * (dp[e] - s)
		}
	}
	dev.LinearBackward(dln, drouter, nil, upload(dev, dprobs, &st.dprobsBuf), ln, router, N, C, E, true)
	return nil
}

// The dense path. On a device other than the host's memory (a GPU), an MoE block whose experts
// are all here — local, whole (no replicas), with f32 boundaries, on the stage's device — runs
// without its routing coming back to the host, which the host path needs for every micro-batch
// (the router's probabilities and the rows of each expert, then each expert's output): every
// expert computes every row of the micro-batch, and the gate (kernels.TopKGate: the router
// probability of a routed expert, 0 for the others) weights what it returns. An unrouted row
// adds exact zeros — to the combined output, to the input gradient, to the experts' parameter
// gradients (whose chains over the rows are the host path's with zero terms between) — so on a
// device with the kernels' arithmetic the results are the host path's bit for bit
// (TestDeviceEqualsHost), save the balancing loss reported, which comes back rounded to float32.
// The block's one wait is the read of its statistics (the assignments per expert and the
// balancing loss: E+1 floats), for the step's report and the router statistics. The price is
// E/K times the experts' compute and activation memory of the host path, which a GPU has
// to spare at the E ≤ denseMaxRatio·K this path takes.

// denseMaxRatio bounds E/K for the dense path: beyond it the experts' extra compute (E/K times the
// routed rows) costs more than the waits it saves.
const denseMaxRatio = 4

// statsLedger keeps what a training step's forwards on a GPU would otherwise read at once — each
// dense MoE block's statistics (E+1 floats), the last stage's per-row losses — on the device, in
// one buffer, so that the step reads them all with its norms (Shard.GradSquaredNorms,
// Stage.TakeStats) instead of waiting for each block and loss of each micro-batch.
type statsLedger struct {
	buf     scratch
	size    int        // the buffer's capacity in floats
	used    int        // floats filled
	entries []deferred // what the filled part holds, in order
	host    []float32
	fetched bool     // host holds the entries already (prefetch)
	next    deferred // the entry the stage is filling: set by Forward before each block
}

// deferred is what one entry of the ledger holds: micro-batch MB's MoE block number Block of the
// stage (counting its MoE blocks from 0), or its loss (Block lossEntry); n floats from off.
type deferred struct{ MB, Block, off, n int }

// lossEntry marks a ledger entry holding a micro-batch's per-row losses.
const lossEntry = -1

// reserve makes room for size floats, keeping none: it does nothing while entries are pending.
func (l *statsLedger) reserve(dev Device, size int) {
	if len(l.entries) > 0 {
		return
	}
	l.size, l.used = size, 0
	l.buf.at(dev, size)
}

// pending reports whether entries wait on the device, not read yet.
func (l *statsLedger) pending() bool { return len(l.entries) > 0 && !l.fetched }

// view is the filled part of the ledger's buffer.
func (l *statsLedger) view(dev Device) Buf { return dev.Slice(l.buf.base, 0, l.used) }

// prefetch returns host memory for the filled part, which the caller reads the device into
// (NormDevice.SquaredNormsWith); TakeStats then returns it without a read of its own.
func (l *statsLedger) prefetch() []float32 {
	l.host = grow(l.host, l.used)
	l.fetched = true
	return l.host
}

// take returns the next n floats of the buffer for entry e (its MB and Block), or nil when they do
// not fit or the ledger was read already.
func (l *statsLedger) take(dev Device, e deferred, n int) Buf {
	if l.fetched || l.used+n > l.size || n == 0 {
		return nil
	}
	e.off, e.n = l.used, n
	l.entries = append(l.entries, e)
	l.used += n
	return dev.Slice(l.buf.base, e.off, n)
}

// takeLoss is take for micro-batch mb's per-row losses (N); nil on a nil ledger.
func (l *statsLedger) takeLoss(dev Device, mb, N int) Buf {
	if l == nil {
		return nil
	}
	return l.take(dev, deferred{MB: mb, Block: lossEntry}, N)
}

// keep copies stats into the next entry (l.next) and reports whether there was room.
func (l *statsLedger) keep(dev Device, stats Buf) bool {
	slot := l.take(dev, l.next, stats.Len())
	if slot == nil {
		return false
	}
	dev.Copy(slot, stats)
	return true
}

// DeferredStats is one MoE block's statistics, or one micro-batch's loss, from Stage.TakeStats.
type DeferredStats struct {
	MB int // the micro-batch
	// Block is which of the stage's MoE blocks (from 0), or -1 for the micro-batch's loss (CE).
	Block  int
	Aux    float64 // the block's balancing loss
	Routed []int   // its assignments per expert
	CE     float64 // the micro-batch's mean cross-entropy, for Block -1
}

// denseExperts returns the experts of block blk when the block can take the dense path on dev.
func denseExperts(dev Device, experts Experts, blk int, cfg Config) []*Expert {
	if _, host := dev.(hostMemory); host {
		return nil
	}
	l, ok := experts.(*LocalExperts)
	if !ok || l.Wire != (Wire{}) || cfg.NExpert > denseMaxRatio*max(cfg.TopK, 1) {
		return nil
	}
	list := l.byBlock[blk]
	if len(list) != cfg.NExpert {
		return nil
	}
	for e, x := range list {
		if x.Index != e || x.Replica >= 0 || x.dev != dev {
			return nil
		}
	}
	return list
}

// moeForwardDense is moeForward's dense path: the router, the gate, every expert on every row and
// their gated sum, all on the device. The block's statistics go to ledger's next slot, read with
// the step's others (Stage.TakeStats), or, without a ledger (an evaluation), are read at once.
func moeForwardDense(dev Device, a *moeActs, out, ln, router Buf, mb, N int, cfg Config, ledger *statsLedger) error {
	C, E, K := cfg.NEmbd, cfg.NExpert, cfg.TopK
	probs := a.probsBuf.at(dev, N*E)
	dev.LinearForward(probs, ln, router, nil, N, C, E)
	dev.SoftmaxRows(probs, N, E)
	gate, mask := a.gateBuf.at(dev, N*E), a.maskBuf.at(dev, N*E)
	dev.TopKGate(gate, mask, probs, N, E, K)
	dev.Zero(out)
	for e, x := range a.dense {
		y, err := x.forwardDense(mb, ln, N)
		if err != nil {
			for _, done := range a.dense[:e] {
				done.drop(mb)
			}
			return err
		}
		dev.GateRows(out, y, gate, e, N, C, E, true)
	}
	stats := a.statsBuf.at(dev, E+1)
	dev.MoEStats(stats, mask, probs, N, E, K)
	a.counts = a.counts[:0]
	if ledger != nil && ledger.keep(dev, stats) {
		a.aux = math.NaN() // Stage.TakeStats has it
		return nil
	}
	a.statsHost = grow(a.statsHost, E+1)
	dev.Read(a.statsHost, stats)
	a.counts = growInts(a.counts, E)
	for e := range a.counts {
		a.counts[e] = int(a.statsHost[e])
	}
	a.aux = float64(a.statsHost[E])
	return nil
}

// moeBackwardDense is moeBackward's dense path: the gate's gradient from each expert's output,
// each expert's backward on its gated output gradient, their input gradients summed in expert
// order, the balancing loss's gradient and the router's backward, all on the device.
func moeBackwardDense(dev Device, st *moeStaging, a *moeActs, dln, drouter, dout, ln, router Buf, mb, N int, cfg Config, auxScale float32) error {
	C, E, K := cfg.NEmbd, cfg.NExpert, cfg.TopK
	gate, mask, stats, probs := a.gateBuf.view, a.maskBuf.view, a.statsBuf.view, a.probsBuf.view
	dgate := st.dgate.at(dev, N*E)
	for e, x := range a.dense {
		ea, ok := x.acts[mb]
		if !ok || ea.yd == nil {
			return fmt.Errorf("expert %d/%d: backward of micro-batch %d without its dense forward", x.Block, x.Index, mb)
		}
		dev.GateGrad(dgate, dout, ea.yd, mask, e, N, C, E)
	}
	dev.Zero(dln)
	dy, dx := st.dy.at(dev, N*C), st.dx.at(dev, N*C)
	for e, x := range a.dense {
		dev.GateRows(dy, dout, gate, e, N, C, E, false)
		if err := x.backwardDense(mb, dy, dx); err != nil {
			return err
		}
		dev.Add(dln, dx)
	}
	dev.AuxGrad(dgate, stats, N, E, K, auxScale)
	dlogits := st.dlogits.at(dev, N*E)
	dev.SoftmaxBackwardRows(dlogits, probs, dgate, N, E)
	dev.LinearBackward(dln, drouter, nil, dlogits, ln, router, N, C, E, true)
	a.dense = nil
	return nil
}

// forwardDense computes the expert on every row of in (n,C), a device buffer that stays unchanged
// until backward (the block's normalised input), and returns its output rows on the device,
// kept for backward.
func (x *Expert) forwardDense(mb int, in Buf, n int) (Buf, error) {
	C, F := x.cfg.NEmbd, x.cfg.Hidden()
	if _, busy := x.acts[mb]; busy {
		return nil, fmt.Errorf("expert %d/%d: micro-batch %d forwarded twice", x.Block, x.Index, mb)
	}
	var a *expertActs
	if k := len(x.free); k > 0 {
		a, x.free = x.free[k-1], x.free[:k-1]
	} else {
		a = &expertActs{}
	}
	d := x.dev
	a.n, a.out, a.x = n, nil, in
	a.h, a.g, a.th = a.mem[1].at(d, n*F), a.mem[2].at(d, n*F), a.mem[3].at(d, n*F)
	a.yd = a.ymem.at(d, n*C)
	d.LinearForward(a.h, in, x.wfc, x.bfc, n, C, F)
	d.GELUForward(a.g, a.th, a.h)
	d.LinearForward(a.yd, a.g, x.wproj, x.bproj, n, F, C)
	x.acts[mb] = a
	return a.yd, nil
}

// backwardDense is forwardDense's backward: it accumulates the expert's parameter gradients — one
// chain over all the rows, whose unrouted rows bring zeros — and writes the input gradient to dx.
func (x *Expert) backwardDense(mb int, dy, dx Buf) error {
	C, F := x.cfg.NEmbd, x.cfg.Hidden()
	a, ok := x.acts[mb]
	if !ok || a.yd == nil {
		return fmt.Errorf("expert %d/%d: backward of micro-batch %d without its dense forward", x.Block, x.Index, mb)
	}
	defer x.drop(mb)
	n, d, sc := a.n, x.dev, &x.own
	dgb, dhb := sc.at(d, &sc.dg, n, F), sc.at(d, &sc.dh, n, F)
	d.LinearBackward(dgb, x.dwproj, x.dbproj, dy, a.g, x.wproj, n, F, C, false)
	d.GELUBackward(dhb, a.h, a.th, dgb)
	d.LinearBackward(dx, x.dwfc, x.dbfc, dhb, a.x, x.wfc, n, C, F, false)
	return nil
}

// drop releases micro-batch mb's activations (dense or not) for reuse.
func (x *Expert) drop(mb int) {
	if a, ok := x.acts[mb]; ok {
		delete(x.acts, mb)
		a.yd, a.x = nil, nil
		x.free = append(x.free, a)
	}
}

func growInts(b []int, n int) []int {
	if cap(b) < n {
		return make([]int, n)
	}
	return b[:n]
}

// topK writes the indices of the len(idx) largest values of p, largest first, ties to the lower
// index (a strict > keeps the earlier one).
func topK(p []float32, idx []int32) {
	for s := range idx {
		best := -1
		for e, v := range p {
			taken := false
			for _, j := range idx[:s] {
				if int(j) == e {
					taken = true
					break
				}
			}
			if !taken && (best < 0 || v > p[best]) {
				best = e
			}
		}
		idx[s] = int32(best)
	}
}

func grow(b []float32, n int) []float32 {
	if cap(b) < n {
		return make([]float32, n)
	}
	return b[:n]
}

func growI(b []int32, n int) []int32 {
	if cap(b) < n {
		return make([]int32, n)
	}
	return b[:n]
}

// growSlack is grow for buffers whose size varies from call to call (an expert's rows), with
// scratch.atSlack's policy: twice the first size, then half as much again as a larger one.
func growSlack(b []float32, n int) []float32 {
	switch {
	case b == nil && n == 0:
		return []float32{} // empty, not nil: an expert's answer to no rows is still an answer
	case cap(b) == 0 && n > 0:
		return make([]float32, n, 2*n)
	case cap(b) < n:
		return make([]float32, n, n+n/2)
	}
	return b[:n]
}

// rowLists returns ls resized to e empty lists, each with room for n entries.
func rowLists(ls [][]int32, e, n int) [][]int32 {
	if cap(ls) < e {
		ls = make([][]int32, e)
	}
	ls = ls[:e]
	for i := range ls {
		if cap(ls[i]) < n {
			ls[i] = make([]int32, 0, n)
		}
		ls[i] = ls[i][:0]
	}
	return ls
}

// cutRows cuts buf into one run of len(tokens[e]) rows of C per expert, in expert order, into
// *dst (reused), and returns them. Each run's capacity ends where the next begins.
func cutRows(dst *[][]float32, buf []float32, tokens [][]int32, C int) [][]float32 {
	out := (*dst)[:0]
	off := 0
	for _, t := range tokens {
		n := len(t) * C
		out = append(out, buf[off:off+n:off+n])
		off += n
	}
	*dst = out
	return out
}

// Reset drops every expert's in-flight activations.
// Trim is Stage.Trim for the local experts: the row arenas kept for reuse go (Reset first).
func (l *LocalExperts) Trim() {
	for _, list := range l.byBlock {
		for _, e := range list {
			if _, ok := e.dev.(hostMemory); !ok {
				return
			}
		}
	}
	l.freeRows = nil
	for _, list := range l.byBlock {
		for _, e := range list {
			e.free = nil // an expert's own records: an expert host's, and ForwardExpert's
		}
	}
}

func (l *LocalExperts) Reset() {
	for _, list := range l.byBlock {
		for _, e := range list {
			e.Reset()
		}
	}
	for key, br := range l.rows {
		delete(l.rows, key)
		l.freeRows = append(l.freeRows, br)
	}
}
