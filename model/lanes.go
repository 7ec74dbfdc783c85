package model

import (
	"fmt"

	"github.com/shoal-ml/shoal/kernels"
)

// Lanes: the single process on several cores, one half of the step's micro-batches on each.
//
// Splitting every multiply and loop of a step across the cores (what the kernels' pool does for
// one caller) costs a fork and a join per kernel, and leaves a core idle wherever a loop is too
// small to split or runs alone (the tree's folds, a LayerNorm's parameter gradients): on two
// cores it gained 1.37× over one. The gradient tree gives a better cut. Its root is the sum of
// two nodes, [0, mid) and [mid, M), and nothing in a micro-batch's forward and backward depends
// on another micro-batch: so a second copy of the stage — the same parameters, gradients and
// activations of its own (a lane) — computes [mid, M) while the model computes [0, mid), each
// with its share of the threads (kernels.Lanes), and one pass adds the two nodes into G. Every
// leaf is computed by the same kernels in the same order, whatever the threads, and the root is
// the same addition, so the step's bits are the one-lane step's: the lanes are a schedule, like
// the replicas of a pipeline, not a change to what is computed.
//
// The cost is memory: the lane's gradient slab and its activations (and the tree buffer that the
// right half needed anyway now belongs to the lane). For the default model that is 26 MB more;
// Model.Serial turns lanes off.

// newLane allocates a lane of the shard: the same parameters (shared, read-only during a step),
// a gradient slab and activations of its own. Only a whole stage on Host with all its experts
// local has one (Model's).
func (sh *Shard) newLane() (*Shard, error) {
	if _, ok := sh.dev.(Host); !ok || sh.Stage == nil {
		return nil, fmt.Errorf("model: lanes are for a stage on the host")
	}
	if _, ok := sh.Stage.Experts.(*LocalExperts); sh.Stage.Experts != nil && !ok {
		return nil, fmt.Errorf("model: lanes need every expert local")
	}
	specs := make([]Spec, len(sh.G.Tensors))
	for i, t := range sh.G.Tensors {
		specs[i] = t.Spec
	}
	ln := &Shard{Cfg: sh.Cfg, P: sh.P, G: NewParams(specs), dev: sh.dev, dp: sh.dp, noLeafInNode: sh.noLeafInNode}
	ln.dg = newDevParams(sh.dev, ln.G)
	var experts []*Expert
	if sh.Experts != nil {
		for _, x := range sh.Experts.All() {
			y, err := ln.bindExpert(x.Block, x.Index)
			if err != nil {
				return nil, err
			}
			y.Replica = x.Replica
			experts = append(experts, y)
		}
	}
	ln.Experts = NewLocalExperts(experts...)
	var ex Experts
	if sh.Stage.Experts != nil {
		ex = ln.Experts
	}
	st, err := newStage(sh.dev, sh.Cfg, sh.Stage.Lo, sh.Stage.Hi, ln.P, ln.G, ln.dp, ln.dg, ex)
	if err != nil {
		return nil, err
	}
	ln.Stage = st
	ln.SetWire(sh.Stage.Wire)
	return ln, nil
}

// joinLane finishes a step computed in two lanes: sh holds node [0, mid) of every part's tree
// (in G itself when its tree keeps it there, gradTree.keep) and ln node [mid, M); G becomes
// their sum, the root, and both trees are left complete and cleared as GradientsComplete leaves
// them.
func (sh *Shard) joinLane(ln *Shard) error {
	M := sh.tree.M
	mid := TreeSplit(0, M)
	if len(sh.tree.parts) != len(ln.tree.parts) {
		return fmt.Errorf("model: lane trees differ: %d parts and %d", len(sh.tree.parts), len(ln.tree.parts))
	}
	for i, p := range sh.tree.parts {
		q := ln.tree.parts[i]
		if p.lo < 0 || p.n == 0 {
			continue
		}
		if q.t0 != p.t0 || q.t1 != p.t1 || len(p.stack) != 1 || len(q.stack) != 1 ||
			p.stack[0] != (treeNode{0, mid, p.stack[0].buf}) || q.stack[0] != (treeNode{mid, M, q.stack[0].buf}) ||
			(p.stack[0].buf == nil && !sh.tree.keep) || q.stack[0].buf == nil {
			return fmt.Errorf("model: lane trees are not the two halves of the root (part %d)", i)
		}
	}
	for i, p := range sh.tree.parts {
		if p.lo >= 0 && p.n > 0 {
			// The root is [0, mid) + [mid, M), wherever [0, mid) is (Sum's dst may be an operand).
			g := sh.G.Slab[p.off : p.off+p.n]
			left := g
			if b := p.stack[0].buf; b != nil {
				left = hf(b)
			}
			kernels.Sum(g, left, hf(ln.tree.parts[i].stack[0].buf))
		}
	}
	for _, t := range []*Shard{sh, ln} {
		for _, p := range t.tree.parts {
			if p.lo < 0 || p.n == 0 {
				continue
			}
			if b := p.stack[0].buf; b != nil {
				p.free = append(p.free, b)
			}
			p.stack[0] = treeNode{lo: 0, hi: M}
		}
	}
	return nil
}
