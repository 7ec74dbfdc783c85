package model

import (
	"errors"
	"fmt"
	"math"

	"github.com/shoal-ml/shoal/kernels"
)

// Shard is the tensors one peer holds, each set in one slab — parameters, gradients and Adam's
// moments — with the code that computes on them: a pipeline stage (with its experts when they stay
// with it) or a group of experts of one block.
//
// The tensors live on the shard's Device, where forward, backward and Apply change them. P, G
// and Opt are their host mirror, for what reads or writes tensors on the host: checkpoints,
// restores, gradient-norm reports. On Host the mirror is the device memory itself and the calls
// below cost nothing; on another device the mirror moves only when asked to:
//
//   - after writing P or Opt on the host (a restored checkpoint), Push (Init pushes by itself);
//   - before reading P or Opt on the host (a checkpoint), Pull;
//   - before reading G on the host (SquaredNorms for the step report), PullGrads;
//   - to clear the gradients for the next step, ZeroGrads — G.Zero clears the mirror only (Reset
//     clears both).
//
// A step's gradient is a tree over its micro-batches (gradtree.go): BeginGradients, then
// MicroBatchDone after each micro-batch's backward, then GradientsComplete — or, when other
// holders computed some micro-batches, GradNodes and ReduceGradients. A shard that computes
// every micro-batch of its step itself, in order, and never shares them (an outer-mode replica's)
// may sum them in one chain instead (BeginChain), which needs no buffer beside G.
type Shard struct {
	Cfg     Config
	P, G    *Params
	Opt     *AdamW
	Stage   *Stage        // nil for an expert shard
	Experts *LocalExperts // the experts held here (a stage's own, or an expert shard's)

	dev            Device
	dp, dg, dm, dv *devParams
	tree           gradTree // the step's gradient tree (gradtree.go)
	treeOn         bool
	chain          chainSum // the step's chain, when it sums in one (BeginChain)
	noLeafInNode   bool     // tests: every leaf in G, copied out at its fold (leafInNode)
}

// NewStageShard allocates the stage of blocks [lo, hi) on Host. With remote == nil its MoE blocks'
// experts live in the shard and are computed here; otherwise remote computes them and the shard
// holds only the stage's own tensors.
func NewStageShard(cfg Config, lo, hi int, remote Experts) (*Shard, error) {
	return NewStageShardOn(Host{}, cfg, lo, hi, remote)
}

// NewStageShardOn is NewStageShard on dev.
func NewStageShardOn(dev Device, cfg Config, lo, hi int, remote Experts) (*Shard, error) {
	if remote == nil {
		return NewStageShardWithOn(dev, cfg, lo, hi, func(int, int) bool { return true }, nil)
	}
	return NewStageShardWithOn(dev, cfg, lo, hi, func(int, int) bool { return false }, func(*LocalExperts) Experts { return remote })
}

// NewStageShardWith allocates the stage of blocks [lo, hi) on Host, holding the experts for which
// local returns true. route, given those local experts, returns what the stage calls to compute
// all of its experts — typically a dispatcher that runs the local ones here and sends the others'
// rows to their hosts; nil means the local experts alone.
func NewStageShardWith(cfg Config, lo, hi int, local func(blk, e int) bool, route func(*LocalExperts) Experts) (*Shard, error) {
	return NewStageShardWithOn(Host{}, cfg, lo, hi, local, route)
}

// NewStageShardWithOn is NewStageShardWith on dev; the local experts compute on dev too.
func NewStageShardWithOn(dev Device, cfg Config, lo, hi int, local func(blk, e int) bool, route func(*LocalExperts) Experts) (*Shard, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if lo < 0 || hi > cfg.NLayer || lo >= hi {
		return nil, fmt.Errorf("stage blocks [%d,%d) outside [0,%d)", lo, hi, cfg.NLayer)
	}
	sh := allocShard(dev, cfg, cfg.StageShardSpecs(lo, hi, local))
	var experts []*Expert
	for blk := lo; blk < hi; blk++ {
		for e := 0; e < cfg.NExpert && cfg.IsMoE(blk); e++ {
			if !local(blk, e) {
				continue
			}
			x, err := sh.bindExpert(blk, e)
			if err != nil {
				return nil, err
			}
			experts = append(experts, x)
		}
	}
	sh.Experts = NewLocalExperts(experts...)
	var ex Experts = sh.Experts
	if route != nil {
		ex = route(sh.Experts)
	}
	st, err := newStage(dev, cfg, lo, hi, sh.P, sh.G, sh.dp, sh.dg, ex)
	if err != nil {
		return nil, err
	}
	sh.Stage = st
	return sh, nil
}

// NewExpertShard allocates experts es of MoE block blk on Host.
func NewExpertShard(cfg Config, blk int, es []int) (*Shard, error) {
	return NewExpertShardOn(Host{}, cfg, blk, es)
}

// NewExpertShardOn is NewExpertShard on dev.
func NewExpertShardOn(dev Device, cfg Config, blk int, es []int) (*Shard, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if blk < 0 || blk >= cfg.NLayer || !cfg.IsMoE(blk) {
		return nil, fmt.Errorf("block %d is not an MoE block", blk)
	}
	var specs []Spec
	for _, e := range es {
		if e < 0 || e >= cfg.NExpert {
			return nil, fmt.Errorf("block %d has no expert %d", blk, e)
		}
		specs = append(specs, cfg.ExpertSpecs(blk, e)...)
	}
	sh := allocShard(dev, cfg, specs)
	var experts []*Expert
	for _, e := range es {
		x, err := sh.bindExpert(blk, e)
		if err != nil {
			return nil, err
		}
		experts = append(experts, x)
	}
	sh.Experts = NewLocalExperts(experts...)
	return sh, nil
}

// allocShard allocates the slabs of specs on the host and on dev, all zero.
func allocShard(dev Device, cfg Config, specs []Spec) *Shard {
	sh := &Shard{Cfg: cfg, P: NewParams(specs), G: NewParams(specs), Opt: NewAdamW(specs), dev: dev}
	sh.dp, sh.dg = newDevParams(dev, sh.P), newDevParams(dev, sh.G)
	sh.dm, sh.dv = newDevParams(dev, sh.Opt.M), newDevParams(dev, sh.Opt.V)
	return sh
}

// bindExpert builds an Expert over views of the shard's slabs, on the host and on the device.
func (sh *Shard) bindExpert(blk, e int) (*Expert, error) {
	specs := sh.Cfg.ExpertSpecs(blk, e)
	p, err := sh.P.Sub(specs)
	if err != nil {
		return nil, err
	}
	g, err := sh.G.Sub(specs)
	if err != nil {
		return nil, err
	}
	dp, err := sh.dp.sub(p)
	if err != nil {
		return nil, err
	}
	dg, err := sh.dg.sub(g)
	if err != nil {
		return nil, err
	}
	return newExpert(sh.dev, sh.Cfg, blk, e, p, g, dp, dg), nil
}

// Device is the device the shard computes on.
func (sh *Shard) Device() Device { return sh.dev }

// Init initialises the shard's parameters from (seed, tensor name), clears the optimizer and
// pushes both to the device.
func (sh *Shard) Init(seed uint64) {
	sh.P.Init(sh.Cfg, seed)
	sh.Opt.M.Zero()
	sh.Opt.V.Zero()
	sh.Push()
}

// Push copies the host mirror's parameters and Adam moments to the device: after a restore (or
// any other write to P or Opt on the host). Gradients are not pushed; they are a step's, cleared
// by ZeroGrads. Free on Host.
func (sh *Shard) Push() {
	sh.dp.push(sh.dev)
	sh.dm.push(sh.dev)
	sh.dv.push(sh.dev)
}

// Pull copies the device's parameters and Adam moments to the host mirror: before a checkpoint
// (CheckpointTensors(sh.P, sh.Opt)). It waits for the device. Free on Host.
func (sh *Shard) Pull() {
	sh.dp.pull(sh.dev)
	sh.dm.pull(sh.dev)
	sh.dv.pull(sh.dev)
}

// PullGrads copies the device's gradients to the host mirror G: before SquaredNorms(sh.G) or any
// other read of G after a backward. It waits for the device. Free on Host.
func (sh *Shard) PullGrads() { sh.dg.pull(sh.dev) }

// GradSquaredNorms returns Σg² of every gradient tensor by name, what a shard reports for the
// global clip. On a NormDevice the sums are taken where the gradients are, with one small read
// (the device's own summation order: within rounding of the host's); otherwise they are
// SquaredNorms of the host mirror, after PullGrads — on Host exactly SquaredNorms(sh.G).
func (sh *Shard) GradSquaredNorms() map[string]float64 {
	if nd, ok := sh.dev.(NormDevice); ok {
		var sums []float64
		if sh.Stage != nil && sh.Stage.ledger.pending() {
			// The stage's MoE statistics come back with the norms: one read for the step.
			l := &sh.Stage.ledger
			sums = nd.SquaredNormsWith(sh.dg.bufs, l.view(sh.dev), l.prefetch())
		} else {
			sums = nd.SquaredNorms(sh.dg.bufs)
		}
		out := make(map[string]float64, len(sums))
		for i, t := range sh.G.Tensors {
			out[t.Name] = sums[i]
		}
		return out
	}
	sh.PullGrads()
	return SquaredNorms(sh.G)
}

// ZeroGrads clears the gradients on the device and in the host mirror, for the next step.
func (sh *Shard) ZeroGrads() { sh.dg.zero(sh.dev) }

// Apply finishes a step on the shard's own tensors, on the device: AdamW with gradients scaled by
// the clip factor, t the 1-based step count. Gradients are left for the caller to clear
// (ZeroGrads); the host mirror of P and Opt is left as it was until Pull.
func (sh *Shard) Apply(t int, lr, weightDecay float64, clip float32) {
	if _, ok := sh.dev.(Host); ok {
		// On Host the device tensors are the host mirror: Update's one pass over the slabs
		// (tensor by tensor when they are views), the same arithmetic on every element.
		sh.Opt.Update(sh.P, sh.G, t, lr, weightDecay, clip)
		return
	}
	stepSize, sqrtBC2 := adamwStep(t, lr)
	for i, pt := range sh.P.Tensors {
		sh.dev.AdamW(sh.dp.bufs[i], sh.dg.bufs[i], sh.dm.bufs[i], sh.dv.bufs[i],
			adamwDecay(pt.Spec, lr, weightDecay), stepSize, sqrtBC2, clip)
	}
}

// Reset drops in-flight activations: a step abandoned after a failure. Gradients are cleared.
func (sh *Shard) Reset() {
	if sh.Stage != nil {
		sh.Stage.Reset()
	}
	if sh.Experts != nil {
		sh.Experts.Reset()
	}
	sh.resetTree()
	sh.ZeroGrads()
}

// Model is the whole network in one process, on Host: the stage [0, L) with every expert local,
// all in one slab (and one each for gradients and Adam's moments). It is the single-process
// reference that every split run is checked against.
type Model struct {
	*Shard
	Step int // steps completed
	// Serial keeps a step's micro-batches in one lane even with several threads (lanes.go): the
	// same bits, without the lane's memory.
	Serial bool
	// Chain sums a step's micro-batch gradients in one chain (BeginChain) instead of the tree:
	// outer mode's inner steps, which no other replica shares. It runs in one lane (the second
	// lane's half would be a second chain).
	Chain bool

	lane  *Shard         // the second lane, once a step has used it
	packs *kernels.Packs // the weights' packed forms, kept while Gradients runs
	outs  []mbLoss       // a step's losses by micro-batch
}

// mbLoss is one micro-batch's losses: its cross-entropy and its MoE blocks' balancing losses.
type mbLoss struct {
	ce  float64
	aux []float64
}

// NewModel allocates a zeroed model; call Init or load a checkpoint into P.
func NewModel(cfg Config) (*Model, error) {
	// The weights' packed forms are kept for the micro-batches of a step (Gradients' span).
	packs := &kernels.Packs{}
	sh, err := NewStageShardOn(Host{Packs: packs}, cfg, 0, cfg.NLayer, nil)
	if err != nil {
		return nil, err
	}
	return &Model{Shard: sh, packs: packs}, nil
}

// Init initialises every parameter from (seed, tensor name) and clears the optimizer.
func (m *Model) Init(seed uint64) {
	m.Shard.Init(seed)
	m.Step = 0
}

// Hyper are the per-step settings of a training step.
type Hyper struct {
	MicroBatches int     // M: the batch is cut into M micro-batches of B/M rows
	LR           float64 // this step's learning rate (the schedule is the job's)
	WeightDecay  float64
	Clip         float64 // global gradient-norm bound; 0 disables clipping
}

// StepResult is what a training step measured.
type StepResult struct {
	CE       float64 // mean cross-entropy over micro-batches
	Aux      float64 // mean over micro-batches of the sum of the MoE blocks' balancing losses
	GradNorm float64 // before clipping
}

// Loss is the optimised objective CE + coef·aux.
func (r StepResult) Loss(cfg Config) float64 { return r.CE + cfg.AuxLossCoef*r.Aux }

// Gradients runs forward and backward over the batch (B rows of T tokens, targets alike) cut into
// M micro-batches, leaving (1/M)·Σ_j ∇(CE_j + coef·aux_j) in G, summed over the micro-batches by
// the gradient tree (gradtree.go).
func (m *Model) Gradients(tokens, targets []int32, B, M int) (StepResult, error) {
	T := m.Cfg.BlockSize
	if M < 1 || B%M != 0 {
		return StepResult{}, fmt.Errorf("batch of %d rows does not split into %d micro-batches", B, M)
	}
	if len(tokens) != B*T || len(targets) != B*T {
		return StepResult{}, fmt.Errorf("batch: %d tokens and %d targets, want %d×%d", len(tokens), len(targets), B, T)
	}
	ln, err := m.laneFor(M)
	if err != nil {
		return StepResult{}, err
	}
	if ln == nil {
		m.ZeroGrads()
	} // else the first lane clears G itself (run), beside the second lane's work
	// No parameter changes until Gradients returns: the weights' packed forms can be kept
	// for all the micro-batches (both lanes share them).
	m.packs.Begin()
	defer m.packs.End()
	mb := B / M
	n := mb * T
	// run computes micro-batches [lo, hi) on sh, recording their losses in outs.
	for len(m.outs) < M {
		m.outs = append(m.outs, mbLoss{})
	}
	outs := m.outs[:M]
	scale := 1 / float32(M)
	run := func(sh *Shard, lo, hi int) error {
		var err error
		if m.Chain { // one lane: [lo, hi) is [0, M)
			err = sh.BeginChain(M)
		} else {
			if ln != nil && sh == m.Shard {
				// The first lane's G held the last step's gradient; the second lane's folds
				// left its own clear. Clearing here, not before the lanes start, keeps the
				// clear off the step's one-thread path, and with the lane's last node left in
				// G (keep) the lanes do the same work: each clears two leaves' memory and adds
				// once.
				sh.ZeroGrads()
			}
			err = sh.BeginGradients(M, lo, hi)
			sh.tree.keep = ln != nil && sh == m.Shard
		}
		if err != nil {
			return err
		}
		for j := lo; j < hi; j++ {
			out, err := sh.Stage.Forward(j, StageInput{B: mb, T: T, Micro: M, Tokens: tokens[j*n : (j+1)*n], Targets: targets[j*n : (j+1)*n]})
			if err != nil {
				return err
			}
			outs[j].ce, outs[j].aux = out.CE, append(outs[j].aux[:0], out.Aux...)
			sh.leafInNode(j)
			if _, err := sh.Stage.Backward(j, nil, scale); err != nil {
				return err
			}
			if err := sh.MicroBatchDone(j); err != nil {
				return err
			}
		}
		return nil
	}
	if ln == nil {
		err = run(m.Shard, 0, M)
	} else {
		mid := TreeSplit(0, M)
		var errs [2]error
		kernels.Lanes(2, func(i int) {
			if i == 0 {
				errs[0] = run(m.Shard, 0, mid)
			} else {
				errs[1] = run(ln, mid, M)
			}
		})
		err = errors.Join(errs[0], errs[1])
		if err == nil {
			err = m.joinLane(ln)
		}
	}
	if err != nil {
		m.abandon()
		return StepResult{}, err
	}
	if !m.GradientsComplete() {
		m.abandon()
		return StepResult{}, errors.New("model: the gradient tree is incomplete after every micro-batch")
	}
	var r StepResult
	for _, o := range outs { // in micro-batch order, whichever lane computed each
		r.CE += o.ce
		for _, a := range o.aux {
			r.Aux += a
		}
	}
	r.CE /= float64(M)
	r.Aux /= float64(M)
	r.GradNorm = GlobalNorm(SquaredNorms(m.G))
	return r, nil
}

// abandon drops what a failed step left in flight: the stage's micro-batches and the local
// experts' (which the stage does not own), so that the next step starts clean.
func (m *Model) abandon() {
	for _, sh := range []*Shard{m.Shard, m.lane} {
		if sh != nil {
			sh.Stage.Reset()
			sh.Experts.Reset()
			sh.resetTree()
			sh.ZeroGrads()
		}
	}
}

// laneFor returns the lane a step of M micro-batches runs its second half on, allocating it the
// first time, or nil when the step runs in one lane: M = 1, one thread, or Serial.
func (m *Model) laneFor(M int) (*Shard, error) {
	if m.Serial || m.Chain || M < 2 || kernels.Threads() < 2 {
		return nil, nil
	}
	if m.lane == nil {
		ln, err := m.newLane()
		if err != nil {
			return nil, err
		}
		m.lane = ln
	}
	return m.lane, nil
}

// ErrNonFinite means a step's loss or gradient norm is NaN or infinite: the step is not applied.
var ErrNonFinite = errors.New("non-finite loss or gradient")

// TrainStep computes the gradients, clips them by the global norm and applies AdamW. A step whose
// loss or gradient norm is not finite is not applied (ErrNonFinite): the update would turn every
// parameter into NaN, and the coordinator refuses such a step the same way.
func (m *Model) TrainStep(tokens, targets []int32, B int, h Hyper) (StepResult, error) {
	r, err := m.Gradients(tokens, targets, B, h.MicroBatches)
	if err != nil {
		return r, err
	}
	if !finite(r.CE) || !finite(r.Aux) || !finite(r.GradNorm) {
		return r, fmt.Errorf("%w: loss %v, aux %v, gradient norm %v: the step is not applied (lower the learning rate, or resume from an earlier checkpoint)",
			ErrNonFinite, r.CE, r.Aux, r.GradNorm)
	}
	m.Opt.Update(m.P, m.G, m.Step+1, h.LR, h.WeightDecay, ClipFactor(r.GradNorm, h.Clip))
	m.Step++
	return r, nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// Evaluate returns the mean cross-entropy and summed balancing loss of one forward pass over the
// batch as a single micro-batch, changing nothing.
func (m *Model) Evaluate(tokens, targets []int32, B, T int) (ce, aux float64, err error) {
	out, err := m.Stage.Forward(0, StageInput{B: B, T: T, Tokens: tokens, Targets: targets})
	if err != nil {
		return 0, 0, err
	}
	m.Stage.Release(0)
	m.Experts.Reset()
	for _, a := range out.Aux {
		aux += a
	}
	return out.CE, aux, nil
}
