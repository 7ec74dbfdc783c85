package model

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// The gradient tree: how a step's micro-batch gradients are summed.
//
// A step's gradient of every tensor is a fixed binary tree over its M micro-batches. Leaf j is
// the tensor's gradient from micro-batch j alone, accumulated from zero (in the kernels' own
// order within the micro-batch); node [lo, hi) is node [lo, mid) + node [mid, hi), mid =
// TreeSplit(lo, hi); the gradient is node [0, M). Summing in one chain across micro-batches —
// what the reference did before replicas — could not be split among pipeline replicas without
// changing its rounding: a replica computing micro-batches 2 and 3 would have to wait for the
// running sum of 0 and 1. With the tree, a replica holding any contiguous run [a, b) computes
// the run's few maximal nodes (TreeNodes: at most 2·log2 M) as its micro-batches finish, the
// replicas exchange them, and every holder evaluates the same tree: bit for bit the single
// process's sum, for every number of replicas and every share.
//
// A shard keeps a stack of finished nodes while a step runs (a binary counter: a node merges
// with its left sibling as soon as both are done), so it holds at most ⌊log2 M⌋ node buffers
// beside G, which receives each micro-batch's leaf.
//
// The root's two halves are also the token groups of a replicated expert (GroupEdge): replica r
// is sent the micro-batches of half r, computes that half's node, and the two exchange them.

// TreeSplit is where the gradient tree cuts the micro-batches [lo, hi) (hi − lo ≥ 2): the left
// child takes the larger half.
func TreeSplit(lo, hi int) int { return lo + (hi-lo+1)/2 }

// GroupHalf is the micro-batches [lo, hi) of half r (0 or 1) of the tree's root: the token
// group a replicated expert's replica r computes. With one micro-batch, half 1 is empty.
func GroupHalf(M, r int) [2]int {
	mid := M
	if M >= 2 {
		mid = TreeSplit(0, M)
	}
	if r == 0 {
		return [2]int{0, mid}
	}
	return [2]int{mid, M}
}

// IsTreeNode reports whether [lo, hi) is a node of the tree over [0, M).
func IsTreeNode(M, lo, hi int) bool {
	a, b := 0, M
	for {
		switch {
		case a == lo && b == hi:
			return true
		case b-a < 2 || lo < a || hi > b:
			return false
		}
		mid := TreeSplit(a, b)
		switch {
		case hi <= mid:
			b = mid
		case lo >= mid:
			a = mid
		default:
			return false
		}
	}
}

// TreeNodes are the maximal nodes of the tree over [0, M) that tile the micro-batches [a, b), in
// order: what a holder of that run contributes to the step's gradient.
func TreeNodes(M, a, b int) [][2]int {
	var out [][2]int
	var walk func(lo, hi int)
	walk = func(lo, hi int) {
		switch {
		case hi <= a || lo >= b:
		case a <= lo && hi <= b:
			out = append(out, [2]int{lo, hi})
		default:
			mid := TreeSplit(lo, hi)
			walk(lo, mid)
			walk(mid, hi)
		}
	}
	if 0 <= a && a < b && b <= M {
		walk(0, M)
	}
	return out
}

// GradNode is a node of one tensor's gradient tree: the sum of micro-batches [Lo, Hi)'s gradients.
type GradNode struct {
	Lo, Hi int
	Data   []float32
}

// SumTree evaluates the gradient tree over [0, M) from nodes that tile it exactly (in any order),
// writing the root to dst. It is how the holders of a tensor, each with the nodes of its own
// micro-batches, arrive at the same gradient.
func SumTree(dst []float32, M int, nodes []GradNode) error {
	ns := slices.Clone(nodes)
	slices.SortFunc(ns, func(x, y GradNode) int { return x.Lo - y.Lo })
	next := 0
	for _, n := range ns {
		switch {
		case n.Lo != next || n.Hi <= n.Lo:
			return fmt.Errorf("%w: gradient nodes do not tile micro-batches [0,%d): [%d,%d) after %d", ErrInput, M, n.Lo, n.Hi, next)
		case !IsTreeNode(M, n.Lo, n.Hi):
			return fmt.Errorf("%w: [%d,%d) is not a node of the gradient tree over %d micro-batches", ErrInput, n.Lo, n.Hi, M)
		case len(n.Data) != len(dst):
			return fmt.Errorf("%w: gradient node [%d,%d) of %d values, want %d", ErrInput, n.Lo, n.Hi, len(n.Data), len(dst))
		}
		next = n.Hi
	}
	if next != M {
		return fmt.Errorf("%w: gradient nodes end at micro-batch %d of %d", ErrInput, next, M)
	}
	var eval func(lo, hi int, out []float32)
	eval = func(lo, hi int, out []float32) {
		for _, n := range ns {
			if n.Lo == lo && n.Hi == hi {
				copy(out, n.Data)
				return
			}
		}
		// Not given: its children are (the nodes tile [0, M) with tree nodes, so a node
		// absent here is covered by nodes below it).
		mid := TreeSplit(lo, hi)
		right := make([]float32, len(out))
		eval(lo, mid, out)
		eval(mid, hi, right)
		for i, v := range right {
			out[i] += v
		}
	}
	eval(0, M, dst)
	return nil
}

// gradTree is a shard's gradient tree during a step: one part per run of tensors that shares a
// range of micro-batches.
type gradTree struct {
	M     int
	parts []*treePart
	// keep leaves each part's last node — the one of all its micro-batches — in G, like the root,
	// instead of in a node buffer: Model's first lane, to whose node in G joinLane adds the second
	// lane's. Only joinLane knows such a node; BeginGradients turns it off.
	keep bool
}

// treePart is a run of the gradient slab, tensors [t0, t1) at elements [off, off+n), whose
// leaves are micro-batches [lo, hi): the shard's (or its replica's) micro-batches, or for a
// replicated expert their intersection with the expert's half.
type treePart struct {
	t0, t1  int
	group   int // TensorGroup of its tensors
	off, n  int
	lo, hi  int
	runs    []treeRun  // runs of micro-batches, each finishing in order, that tile [lo, hi)
	stack   []treeNode // finished nodes, in micro-batch order
	free    []Buf
	tensOff []int // each tensor's offset within the part
	// leaf, when not nil, is the node buffer micro-batch leafMB's backward accumulates the
	// part's gradient in instead of G (leafInNode): the fold takes it as the leaf's node.
	leaf   Buf
	leafMB int
}

// treeRun is micro-batches [lo, hi) that finish in order, one after another: a pipeline
// replica's share. An expert host serving several replicas has one run per replica, and their
// micro-batches interleave.
type treeRun struct {
	lo, hi, next int
}

type treeNode struct {
	lo, hi int
	buf    Buf // nil: the node is the leaf in G itself
}

// BeginGradients starts a step's gradient tree: the step has M micro-batches and this shard
// computes [lo, hi) of them (a pipeline replica's share; [0, M) for one pipeline). A replicated
// expert (Expert.Replica r) computes only those in half r of the tree's root. G must be zero.
func (sh *Shard) BeginGradients(M, lo, hi int) error {
	return sh.BeginGradientsRuns(M, [][2]int{{lo, hi}})
}

// BeginGradientsRuns is BeginGradients for a shard computing several runs of micro-batches whose
// completions interleave: an expert host serving the stages of several pipeline replicas, each
// sending the micro-batches of its share in its own order. The runs must be ascending and
// contiguous; each finishes its micro-batches in order, and the tree is the same whatever the
// interleaving (a node is the sum of its two children, whichever finishes last). Replicated
// experts (Expert.Replica) take one run only.
func (sh *Shard) BeginGradientsRuns(M int, runs [][2]int) error {
	if len(runs) == 0 {
		return fmt.Errorf("%w: no micro-batches", ErrInput)
	}
	for i, r := range runs {
		if M < 1 || r[0] < 0 || r[1] > M || r[0] >= r[1] || (i > 0 && r[0] != runs[i-1][1]) {
			return fmt.Errorf("%w: micro-batches [%d,%d) of %d (run %d of %d)", ErrInput, r[0], r[1], M, i, len(runs))
		}
	}
	lo, hi := runs[0][0], runs[len(runs)-1][1]
	sh.resetTree()
	sh.tree.M = M
	// A part is a run of tensors of one group (TensorGroup: a block, the embedding, the head) —
	// so that a block's gradient can be folded, and its final nodes sent, as soon as its
	// backward is done (FoldGroup) — and, within a block, a replicated expert's four tensors,
	// which compute only their half's micro-batches.
	replica := map[int]int{} // first tensor index → replica
	width := map[int]int{}
	if sh.Experts != nil {
		for _, x := range sh.Experts.All() {
			if x.Replica < 0 {
				continue
			}
			i := sh.G.index[x.G.Tensors[0].Name]
			replica[i], width[i] = x.Replica, len(x.G.Tensors)
		}
	}
	off := 0
	add := func(t0, t1, lo, hi int) {
		p := sh.tree.part(t0, t1)
		p.off, p.n, p.lo, p.hi = off, 0, lo, hi
		p.runs = p.runs[:0]
		if len(runs) == 1 || lo == hi {
			p.runs = append(p.runs, treeRun{lo, hi, lo})
		} else {
			for _, r := range runs {
				p.runs = append(p.runs, treeRun{r[0], r[1], r[0]})
			}
		}
		p.group = TensorGroup(sh.G.Tensors[t0].Name, sh.Cfg.NLayer)
		p.tensOff = p.tensOff[:0]
		for i := t0; i < t1; i++ {
			p.tensOff = append(p.tensOff, p.n)
			p.n += len(sh.G.Tensors[i].Data)
		}
		off += p.n
	}
	start := 0
	for i := 0; i <= len(sh.G.Tensors); i++ {
		r, rep := replica[i]
		end := i == len(sh.G.Tensors)
		newGroup := !end && i > start && TensorGroup(sh.G.Tensors[i].Name, sh.Cfg.NLayer) != TensorGroup(sh.G.Tensors[start].Name, sh.Cfg.NLayer)
		if (end || rep || newGroup) && i > start {
			add(start, i, lo, hi)
			start = i
		}
		if rep {
			if len(runs) > 1 {
				return fmt.Errorf("%w: a replicated expert's gradient over %d runs of micro-batches", ErrInput, len(runs))
			}
			h := GroupHalf(M, r)
			a, b := max(lo, h[0]), min(hi, h[1])
			add(i, i+width[i], a, max(a, b))
			start = i + width[i]
			i = start - 1
		}
	}
	sh.treeOn = true
	return nil
}

// ExtendGradients widens, mid-step, the micro-batches this shard's tree sums to [lo, hi), which
// must contain the ones it has: the survivors beside a pipeline replica lost during a step compute
// its micro-batches as well as their own (client's reroute), the left neighbour a run after its
// own, the right one a run before. Each new run finishes in order, like the others; the nodes
// already made are kept and merge with the new ones as the tree says, so the shard ends with the
// nodes of [lo, hi) (FinalGradNodes) whatever it had sent before. G is cleared for the new
// leaves: it may hold a gradient already reduced with the other holders' nodes (ReduceGradients),
// which the new micro-batches change.
func (sh *Shard) ExtendGradients(lo, hi int) error {
	if sh.chain.on || !sh.treeOn {
		return fmt.Errorf("%w: micro-batches added outside a step's gradient tree", ErrInput)
	}
	M := sh.tree.M
	cur := [2]int{-1, -1}
	for _, p := range sh.tree.parts {
		if p.lo < 0 || p.n == 0 {
			continue
		}
		if cur[0] >= 0 && (p.lo != cur[0] || p.hi != cur[1]) {
			return fmt.Errorf("%w: a shard whose tensors sum different micro-batches (a replicated expert) cannot add any", ErrInput)
		}
		cur = [2]int{p.lo, p.hi}
	}
	switch {
	case cur[0] < 0:
		return fmt.Errorf("%w: no gradient tree to add micro-batches to", ErrInput)
	case lo < 0 || hi > M || lo > cur[0] || hi < cur[1]:
		return fmt.Errorf("%w: micro-batches [%d,%d) of %d do not contain the shard's [%d,%d)", ErrInput, lo, hi, M, cur[0], cur[1])
	}
	for _, p := range sh.tree.parts {
		if p.lo < 0 || p.n == 0 {
			continue
		}
		if lo < p.lo {
			p.runs = slices.Insert(p.runs, 0, treeRun{lo, p.lo, lo})
		}
		if hi > p.hi {
			p.runs = append(p.runs, treeRun{p.hi, hi, p.hi})
		}
		p.lo, p.hi = lo, hi
	}
	sh.ZeroGrads()
	return nil
}

// TensorGroup is the group of the model's tensor name, in the order backward finishes them on a
// stage of L blocks: L for the head (ln_f, lm_head), the block's index for a block's tensors (its
// experts' included), -1 for the embedding (wte, wpe).
func TensorGroup(name string, L int) int {
	const blockPrefix = "transformer.h."
	if rest, ok := strings.CutPrefix(name, blockPrefix); ok {
		if k := strings.IndexByte(rest, '.'); k > 0 {
			if b, err := strconv.Atoi(rest[:k]); err == nil {
				return b
			}
		}
	}
	if strings.HasPrefix(name, "transformer.wte.") || strings.HasPrefix(name, "transformer.wpe.") {
		return -1
	}
	return L
}

// part returns a part for tensors [t0, t1), reusing the buffers of a part that had the same
// tensors in an earlier step.
func (t *gradTree) part(t0, t1 int) *treePart {
	for _, p := range t.parts {
		if p.t0 == t0 && p.t1 == t1 && p.lo == -1 {
			p.lo = 0
			return p
		}
	}
	p := &treePart{t0: t0, t1: t1}
	t.parts = append(t.parts, p)
	return p
}

// The chain: a step summed in micro-batch order, for a shard whose micro-batches nobody shares.
//
// The tree exists so that holders of different runs of a step's micro-batches reach the same
// bits. An outer-mode replica's inner step is its own: no other replica computes any of its
// micro-batches, and the single process (local's outer loop) trains each replica as a model of its
// own. Such a shard needs no tree: each micro-batch's backward accumulates into G where the
// previous one left it (the kernels accumulate parameter gradients: kernels.LinearBackward, and
// every Device must too; the GPU families' whole-stage checks, internal/stagecheck, train their
// micro-batches this way against Host), so the gradient is ((leaf 0 + micro-batch 1's terms) +
// micro-batch 2's terms) + … in micro-batch order — as deterministic as the tree, and with no node buffer beside G: ⌊log2 M⌋ buffers of the
// gradient's size fewer (40 bytes a parameter at M = 1,024). Its bits are not the tree's, so the
// reference must chain too (Model.Chain), and nothing can be split: no lanes, no shared runs, no
// replicated experts — and no FoldGroup, whose purpose is sending final nodes.

// chainSum is a step's chain: M micro-batches, next the one whose backward comes next.
type chainSum struct {
	on      bool
	M, next int
}

// BeginChain starts a step whose gradient is the chain over micro-batches [0, M), all computed
// here in order. G must be zero.
func (sh *Shard) BeginChain(M int) error {
	if M < 1 {
		return fmt.Errorf("%w: %d micro-batches", ErrInput, M)
	}
	sh.resetTree()
	sh.chain = chainSum{on: true, M: M}
	return nil
}

// resetTree drops the step's nodes, keeping their buffers for the next step.
func (sh *Shard) resetTree() {
	sh.chain = chainSum{}
	sh.tree.keep = false
	for _, p := range sh.tree.parts {
		if p.leaf != nil { // a failed micro-batch's: point the gradient back at G
			p.free = append(p.free, p.leaf)
			sh.bindGrads(p, nil)
		}
		for _, n := range p.stack {
			if n.buf != nil {
				p.free = append(p.free, n.buf)
			}
		}
		p.stack, p.lo, p.hi = p.stack[:0], -1, -1
	}
	sh.treeOn = false
}

// MicroBatchDone folds micro-batch mb's leaf — what its backward accumulated in G, from zero —
// into the tree, and clears G for the next micro-batch. Micro-batches finish in order within a
// run (1F1B runs backwards in micro-batch order; BeginGradientsRuns lets runs interleave); parts
// whose range excludes mb are left alone.
func (sh *Shard) MicroBatchDone(mb int) error { return sh.fold(mb, nil) }

// FoldGroup is MicroBatchDone for the tensors of one group (TensorGroup) only: a stage calls it
// as soon as the group's backward for micro-batch mb is done (Stage.AfterGroup), so that nodes
// that are final can leave while the backward goes on (FinalGradNodes). MicroBatchDone then folds
// the rest; a part is never folded twice.
func (sh *Shard) FoldGroup(mb, group int) error { return sh.fold(mb, &group) }

func (sh *Shard) fold(mb int, group *int) error {
	if c := &sh.chain; c.on {
		switch {
		case group != nil:
			return fmt.Errorf("%w: a group of micro-batch %d folded in a chain (only a tree has nodes to send early)", ErrInput, mb)
		case mb != c.next || mb >= c.M:
			return fmt.Errorf("%w: micro-batch %d finished, expected %d of %d", ErrInput, mb, c.next, c.M)
		}
		c.next++ // G holds the chain so far: nothing to move, nothing to clear
		return nil
	}
	if !sh.treeOn {
		return fmt.Errorf("%w: micro-batch %d finished outside a step's gradient tree", ErrInput, mb)
	}
	d, M := sh.dev, sh.tree.M
	for _, p := range sh.tree.parts {
		if p.lo < 0 || mb < p.lo || mb >= p.hi || p.n == 0 || (group != nil && p.group != *group) {
			continue
		}
		run := p.run(mb)
		if mb < run.next {
			continue // folded already, by FoldGroup
		}
		if mb != run.next {
			return fmt.Errorf("%w: micro-batch %d finished, expected %d", ErrInput, mb, run.next)
		}
		run.next++
		leaf := d.Slice(sh.dg.slab, p.off, p.n)
		node := treeNode{lo: mb, hi: mb + 1}
		inG := true
		if p.leaf != nil && p.leafMB == mb {
			// The backward accumulated the leaf in a node buffer of its own (leafInNode): it is
			// the node, and G, untouched, is still clear. Merges below add it as they would add
			// G (a + b is b + a, bit for bit).
			node.buf, inG = p.leaf, false
			sh.bindGrads(p, nil)
		}
		if chain := siblingChain(p.stack, M, node); inG && len(chain) > 0 && sh.endsInG(p, chainEnd(chain, p.stack, node)) {
			// The leaf completes the root (or, with keep, the part's last node): sum the chain into
			// the leaf itself, nearest sibling first as the tree does (a + b is b + a, bit for
			// bit), so that the node is left in G, with no node buffer to fill, no G to clear and
			// nothing for GradientsComplete to copy back.
			for _, k := range chain {
				d.Add(leaf, p.stack[k].buf)
				p.free = append(p.free, p.stack[k].buf)
			}
			p.stack = append(p.stack[:0], chainEnd(chain, p.stack, node))
			continue
		}
		// Merge with each finished sibling, bottom-up: a node is its two children's sum,
		// whichever of them finished last.
		for {
			chain := siblingChain(p.stack, M, node)
			if len(chain) == 0 {
				break
			}
			k := chain[0]
			sib := p.stack[k]
			if node.buf == nil {
				d.Add(sib.buf, leaf)
			} else {
				d.Add(sib.buf, node.buf)
				p.free = append(p.free, node.buf)
			}
			node = treeNode{lo: min(sib.lo, node.lo), hi: max(sib.hi, node.hi), buf: sib.buf}
			p.stack = slices.Delete(p.stack, k, k+1)
		}
		if node.buf == nil && sh.endsInG(p, node) {
			// M = 1: the leaf is the root (or, with keep, the part's only micro-batch); it stays in
			// G.
			p.stack = append(p.stack, node)
			continue
		}
		if node.buf == nil {
			if k := len(p.free); k > 0 {
				node.buf, p.free = p.free[k-1], p.free[:k-1]
			} else {
				node.buf = d.Alloc(p.n)
			}
			d.Copy(node.buf, leaf)
		}
		at, _ := slices.BinarySearchFunc(p.stack, node.lo, func(n treeNode, lo int) int { return n.lo - lo })
		p.stack = slices.Insert(p.stack, at, node)
		if inG {
			d.Zero(leaf)
		}
	}
	return nil
}

// A leaf in its node buffer.
//
// A leaf that no finished sibling waits for becomes a node of its own: fold copied it out of G
// into a node buffer and cleared G — two passes over the gradient for nothing, about 5 ms a lane
// a step on the default model. On Host the shard can instead point its gradient tensors at a
// cleared node buffer before the micro-batch's backward, which then accumulates the leaf there,
// from zero, with the same kernels in the same order as it would in G: the same bits, with one
// clear of the buffer instead of a copy and a clear. G, untouched, stays clear for the next leaf.
//
// The gradient tensors are reached through their device buffers (devParams.bufs): on Host each
// is one *hostBuf that the stage's layers and the experts (devParams.sub) share, so pointing it
// elsewhere moves all of them, and nothing else writes a gradient during a backward. The host
// views — G's Tensors, the experts' G — still name G: they are read only between steps, after
// the fold has pointed the buffers back. Other devices (their views of the gradient slab) keep
// the copy.

// LeafInNode is leafInNode for a pipeline stage (client.StageRunner), called before micro-batch
// mb's backward: its micro-batches' backwards and their MicroBatchDone run one after another
// too, forwards between them writing no gradient. Not while the stage's groups fold during the
// backward (Stage.AfterGroup: step-mode replicas send nodes from a goroutine of their own as
// they become final), where the leaves stay in G.
func (sh *Shard) LeafInNode(mb int) {
	if sh.Stage != nil && sh.Stage.AfterGroup != nil {
		return
	}
	sh.leafInNode(mb)
}

// leafInNode, called before micro-batch mb's backward, points the gradient tensors of each part
// whose leaf mb will become a node buffer at its fold at a cleared node buffer. Model calls it
// (its micro-batches run forward, backward and MicroBatchDone one after another), and a pipeline
// stage through LeafInNode: nothing else reads the gradient while the buffers point away from G.
func (sh *Shard) leafInNode(mb int) {
	if _, ok := sh.dev.(Host); !ok || !sh.treeOn || sh.noLeafInNode {
		return
	}
	d, M := sh.dev, sh.tree.M
	for _, p := range sh.tree.parts {
		if p.lo < 0 || mb < p.lo || mb >= p.hi || p.n == 0 || p.leaf != nil || p.run(mb).next != mb {
			continue
		}
		node := treeNode{lo: mb, hi: mb + 1}
		if sh.endsInG(p, node) || len(siblingChain(p.stack, M, node)) > 0 {
			continue // the root stays in G; a leaf with a finished sibling is added to it
		}
		if k := len(p.free); k > 0 {
			p.leaf, p.free = p.free[k-1], p.free[:k-1]
			d.Zero(p.leaf)
		} else {
			p.leaf = d.Alloc(p.n) // cleared
		}
		p.leafMB = mb
		sh.bindGrads(p, p.leaf)
	}
}

// bindGrads points the gradient buffers of p's tensors at node buffer buf, or back at G for nil.
func (sh *Shard) bindGrads(p *treePart, buf Buf) {
	for j := range p.t1 - p.t0 {
		i := p.t0 + j
		hb := sh.dg.bufs[i].(*hostBuf)
		if buf == nil {
			hb.f = sh.G.Tensors[i].Data
			continue
		}
		o, n := p.tensOff[j], len(sh.G.Tensors[i].Data)
		hb.f = hf(buf)[o : o+n : o+n]
	}
	if buf == nil {
		p.leaf = nil
	}
}

// run is the run of p holding micro-batch mb (p.lo <= mb < p.hi).
func (p *treePart) run(mb int) *treeRun {
	for i := range p.runs {
		if mb < p.runs[i].hi {
			return &p.runs[i]
		}
	}
	return &p.runs[len(p.runs)-1]
}

// siblingChain is where on the stack the finished siblings of node, its parent, its grandparent
// … are, bottom-up, as far as they go without a gap: the merges node starts.
func siblingChain(stack []treeNode, M int, node treeNode) []int {
	var chain []int
	lo, hi := node.lo, node.hi
	for {
		plo, phi, ok := treeParent(M, lo, hi)
		if !ok {
			return chain
		}
		slo, shi := plo, lo // the left sibling
		if lo == plo {
			slo, shi = hi, phi
		}
		k := slices.IndexFunc(stack, func(n treeNode) bool { return n.lo == slo && n.hi == shi })
		if k < 0 {
			return chain
		}
		chain = append(chain, k)
		lo, hi = plo, phi
	}
}

// chainEnd is the node that the merges chain (siblingChain of node) end at, without a buffer.
func chainEnd(chain []int, stack []treeNode, node treeNode) treeNode {
	lo, hi := node.lo, node.hi
	for _, k := range chain {
		lo, hi = min(lo, stack[k].lo), max(hi, stack[k].hi)
	}
	return treeNode{lo: lo, hi: hi}
}

// endsInG reports whether node, made of a leaf in G, stays there: the root, or with keep the
// part's last node.
func (sh *Shard) endsInG(p *treePart, node treeNode) bool {
	return (node.lo == 0 && node.hi == sh.tree.M) || (sh.tree.keep && node.lo == p.lo && node.hi == p.hi)
}

// treeParent is the parent of node [lo, hi) of the tree over [0, M); ok is false for the root and
// for what is no node.
func treeParent(M, lo, hi int) (plo, phi int, ok bool) {
	a, b := 0, M
	for b-a >= 2 {
		mid := TreeSplit(a, b)
		if (lo == a && hi == mid) || (lo == mid && hi == b) {
			return a, b, true
		}
		switch {
		case hi <= mid:
			b = mid
		case lo >= mid:
			a = mid
		default:
			return 0, 0, false
		}
	}
	return 0, 0, false
}

// GradientsComplete moves the roots of the parts that computed every micro-batch into G and
// reports whether all did: then G is the step's gradient. Otherwise the other holders' nodes are
// still to come (GradNodes, ReduceGradients); the complete parts' tensors are final already.
func (sh *Shard) GradientsComplete() bool {
	if sh.chain.on {
		return sh.chain.next == sh.chain.M
	}
	all := true
	for _, p := range sh.tree.parts {
		if p.lo < 0 || p.n == 0 {
			continue
		}
		if len(p.stack) == 1 && p.stack[0].lo == 0 && p.stack[0].hi == sh.tree.M {
			if b := p.stack[0].buf; b != nil {
				sh.dev.Copy(sh.dev.Slice(sh.dg.slab, p.off, p.n), b)
				p.free = append(p.free, b)
				p.stack[0].buf = nil
			}
			continue
		}
		all = false
	}
	return all
}

// GradNodes are this shard's finished nodes of tensor name's gradient tree (GradientsComplete
// first), read from the device: what it sends the other holders of the tensor. Data is the
// shard's memory on Host; it is valid until ReduceGradients or the next step.
func (sh *Shard) GradNodes(name string) ([]GradNode, error) {
	p, j, err := sh.treePartOf(name)
	if err != nil {
		return nil, err
	}
	if len(p.stack) == 1 && p.stack[0].buf == nil && p.stack[0].lo == 0 && p.stack[0].hi == sh.tree.M {
		return nil, fmt.Errorf("tensor %s: its gradient is complete here", name)
	}
	size := len(sh.G.Tensors[p.t0+j].Data)
	var out []GradNode
	for _, n := range p.stack {
		b := sh.dev.Slice(n.buf, p.tensOff[j], size)
		out = append(out, GradNode{Lo: n.lo, Hi: n.hi, Data: readNode(sh.dev, b)})
	}
	return out, nil
}

// FinalGradNodes are the nodes of tensor name's gradient tree that no later micro-batch changes
// — those among model.TreeNodes of the shard's micro-batches — in order; the caller remembers
// which it has sent. Data as GradNodes. It may be called between micro-batches, while the shard
// computes nothing.
func (sh *Shard) FinalGradNodes(name string) ([]GradNode, error) {
	p, j, err := sh.treePartOf(name)
	if err != nil {
		return nil, err
	}
	size := len(sh.G.Tensors[p.t0+j].Data)
	final := TreeNodes(sh.tree.M, p.lo, p.hi)
	var out []GradNode
	for _, n := range p.stack {
		if n.buf == nil || !slices.Contains(final, [2]int{n.lo, n.hi}) {
			continue
		}
		out = append(out, GradNode{Lo: n.lo, Hi: n.hi, Data: readNode(sh.dev, sh.dev.Slice(n.buf, p.tensOff[j], size))})
	}
	return out, nil
}

// ReduceGradients writes tensor name's gradient to G: the tree over this shard's nodes and
// theirs, the other holders' (SumTree), which together must tile the step's micro-batches.
func (sh *Shard) ReduceGradients(name string, theirs []GradNode) error {
	p, j, err := sh.treePartOf(name)
	if err != nil {
		return err
	}
	size := len(sh.G.Tensors[p.t0+j].Data)
	nodes := slices.Clone(theirs)
	for _, n := range p.stack {
		if n.buf == nil {
			return fmt.Errorf("tensor %s: its gradient is complete here", name)
		}
		nodes = append(nodes, GradNode{Lo: n.lo, Hi: n.hi, Data: readNode(sh.dev, sh.dev.Slice(n.buf, p.tensOff[j], size))})
	}
	out := make([]float32, size)
	if err := SumTree(out, sh.tree.M, nodes); err != nil {
		return fmt.Errorf("tensor %s: %w", name, err)
	}
	sh.dev.Write(sh.dg.bufs[p.t0+j], out)
	return nil
}

// treePartOf finds the part holding tensor name and the tensor's position in it.
func (sh *Shard) treePartOf(name string) (*treePart, int, error) {
	i, ok := sh.G.index[name]
	if !ok {
		return nil, 0, fmt.Errorf("%w: no tensor %s here", ErrInput, name)
	}
	for _, p := range sh.tree.parts {
		if p.lo >= 0 && i >= p.t0 && i < p.t1 {
			return p, i - p.t0, nil
		}
	}
	return nil, 0, fmt.Errorf("tensor %s: no gradient tree this step", name)
}

// readNode is b's values: its memory on Host, a copy read from any other device.
func readNode(d Device, b Buf) []float32 {
	var host []float32
	return readView(d, b, &host)
}

// TreeBuffers is how many node buffers, each the size of the gradient, a shard computing
// micro-batches [lo, hi) of M holds at most beside G while it folds them (MicroBatchDone): the
// memory the gradient tree costs, for the planner's memory model.
func TreeBuffers(M, lo, hi int) int {
	var stack [][2]int
	most := 0
	for mb := lo; mb < hi; mb++ {
		node := [2]int{mb, mb + 1}
		inG := true
		for k := len(stack) - 1; k >= 0; k-- {
			top := stack[k]
			if top[1] != node[0] || !IsTreeNode(M, top[0], node[1]) || TreeSplit(top[0], node[1]) != top[1] {
				break
			}
			node, inG = [2]int{top[0], node[1]}, false
			stack = stack[:k]
		}
		if inG && node[0] == 0 && node[1] == M {
			continue // M = 1: the leaf stays in G
		}
		stack = append(stack, node)
		most = max(most, len(stack))
	}
	return most
}
