package model

import (
	"fmt"
	"strings"
)

// Shard is the tensors one peer holds, each set in one slab — parameters, gradients and Adam's
// moments — with the code that computes on them: a pipeline stage (with its experts when they stay
// with it) or a group of experts of one block.
type Shard struct {
	Cfg     Config
	P, G    *Params
	Opt     *AdamW
	Stage   *Stage        // nil for an expert shard
	Experts *LocalExperts // the experts held here (a stage's own, or an expert shard's)
}

// NewStageShard allocates the stage of blocks [lo, hi). With remote == nil its MoE blocks' experts
// live in the shard and are computed here; otherwise remote computes them and the shard holds only
// the stage's own tensors.
func NewStageShard(cfg Config, lo, hi int, remote Experts) (*Shard, error) {
	if remote == nil {
		return NewStageShardWith(cfg, lo, hi, func(int, int) bool { return true }, nil)
	}
	return NewStageShardWith(cfg, lo, hi, func(int, int) bool { return false }, func(*LocalExperts) Experts { return remote })
}

// NewStageShardWith allocates the stage of blocks [lo, hi) holding the experts for which local
// returns true. route, given those local experts, returns what the stage calls to compute all of
// its experts — typically a dispatcher that runs the local ones here and sends the others' rows to
// their hosts; nil means the local experts alone.
func NewStageShardWith(cfg Config, lo, hi int, local func(blk, e int) bool, route func(*LocalExperts) Experts) (*Shard, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if lo < 0 || hi > cfg.NLayer || lo >= hi {
		return nil, fmt.Errorf("stage blocks [%d,%d) outside [0,%d)", lo, hi, cfg.NLayer)
	}
	var specs []Spec
	keep := map[int][]int{}
	var blocks []int
	for _, sp := range cfg.StageSpecs(lo, hi, false) {
		specs = append(specs, sp)
		var blk int
		if n, _ := fmt.Sscanf(sp.Name, "transformer.h.%d.mlp.router.weight", &blk); n == 1 && strings.HasSuffix(sp.Name, "mlp.router.weight") {
			blocks = append(blocks, blk)
			for e := 0; e < cfg.NExpert; e++ {
				if local(blk, e) {
					keep[blk] = append(keep[blk], e)
					specs = append(specs, cfg.ExpertSpecs(blk, e)...)
				}
			}
		}
	}
	sh := &Shard{Cfg: cfg, P: NewParams(specs), G: NewParams(specs), Opt: NewAdamW(specs)}
	var experts []*Expert
	for _, blk := range blocks {
		for _, e := range keep[blk] {
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
	st, err := NewStage(cfg, lo, hi, sh.P, sh.G, ex)
	if err != nil {
		return nil, err
	}
	sh.Stage = st
	return sh, nil
}

// NewExpertShard allocates experts es of MoE block blk.
func NewExpertShard(cfg Config, blk int, es []int) (*Shard, error) {
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
	sh := &Shard{Cfg: cfg, P: NewParams(specs), G: NewParams(specs), Opt: NewAdamW(specs)}
	if err := sh.bindExperts([]int{blk}, es); err != nil {
		return nil, err
	}
	return sh, nil
}

// bindExperts builds Expert views over the shard's slabs: every expert of blocks, or es of the one block.
func (sh *Shard) bindExperts(blocks, es []int) error {
	var experts []*Expert
	for _, blk := range blocks {
		list := es
		if list == nil {
			for e := 0; e < sh.Cfg.NExpert; e++ {
				list = append(list, e)
			}
		}
		for _, e := range list {
			x, err := sh.bindExpert(blk, e)
			if err != nil {
				return err
			}
			experts = append(experts, x)
		}
	}
	sh.Experts = NewLocalExperts(experts...)
	return nil
}

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
	return NewExpert(sh.Cfg, blk, e, p, g), nil
}

// Init initialises the shard's parameters from (seed, tensor name) and clears the optimizer.
func (sh *Shard) Init(seed uint64) {
	sh.P.Init(sh.Cfg, seed)
	sh.Opt.M.Zero()
	sh.Opt.V.Zero()
}

// Apply finishes a step on the shard's own tensors: AdamW with gradients scaled by the clip
// factor, t the 1-based step count. Gradients are left for the caller to clear.
func (sh *Shard) Apply(t int, lr, weightDecay float64, clip float32) {
	sh.Opt.Update(sh.P, sh.G, t, lr, weightDecay, clip)
}

// Reset drops in-flight activations: a step abandoned after a failure. Gradients are cleared.
func (sh *Shard) Reset() {
	if sh.Stage != nil {
		sh.Stage.Reset()
	}
	if sh.Experts != nil {
		sh.Experts.Reset()
	}
	sh.G.Zero()
}

// Model is the whole network in one process: the stage [0, L) with every expert local, all in one
// slab (and one each for gradients and Adam's moments). It is the single-process reference that
// every split run is checked against.
type Model struct {
	*Shard
	Step int // steps completed
}

// NewModel allocates a zeroed model; call Init or load a checkpoint into P.
func NewModel(cfg Config) (*Model, error) {
	sh, err := NewStageShard(cfg, 0, cfg.NLayer, nil)
	if err != nil {
		return nil, err
	}
	return &Model{Shard: sh}, nil
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
// M micro-batches, leaving (1/M)·Σ_j ∇(CE_j + coef·aux_j) in G, accumulated in micro-batch order.
func (m *Model) Gradients(tokens, targets []int32, B, M int) (StepResult, error) {
	T := m.Cfg.BlockSize
	if M < 1 || B%M != 0 {
		return StepResult{}, fmt.Errorf("batch of %d rows does not split into %d micro-batches", B, M)
	}
	if len(tokens) != B*T || len(targets) != B*T {
		return StepResult{}, fmt.Errorf("batch: %d tokens and %d targets, want %d×%d", len(tokens), len(targets), B, T)
	}
	m.G.Zero()
	mb := B / M
	n := mb * T
	var r StepResult
	scale := 1 / float32(M)
	for j := 0; j < M; j++ {
		out, err := m.Stage.Forward(j, StageInput{B: mb, T: T, Micro: M, Tokens: tokens[j*n : (j+1)*n], Targets: targets[j*n : (j+1)*n]})
		if err != nil {
			m.Stage.Reset()
			return StepResult{}, err
		}
		r.CE += out.CE
		for _, a := range out.Aux {
			r.Aux += a
		}
		if _, err := m.Stage.Backward(j, nil, scale); err != nil {
			m.Stage.Reset()
			return StepResult{}, err
		}
	}
	m.Experts.FinishGradients()
	r.CE /= float64(M)
	r.Aux /= float64(M)
	r.GradNorm = GlobalNorm(SquaredNorms(m.G))
	return r, nil
}

// TrainStep computes the gradients, clips them by the global norm and applies AdamW.
func (m *Model) TrainStep(tokens, targets []int32, B int, h Hyper) (StepResult, error) {
	r, err := m.Gradients(tokens, targets, B, h.MicroBatches)
	if err != nil {
		return r, err
	}
	m.Opt.Update(m.P, m.G, m.Step+1, h.LR, h.WeightDecay, ClipFactor(r.GradNorm, h.Clip))
	m.Step++
	return r, nil
}

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
