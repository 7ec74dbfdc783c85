package model

import (
	"fmt"
)

// Model is the whole network in one process: one slab of parameters (and one each for gradients
// and Adam's moments), the stage [0, L) over views of it, and every expert computed locally. It is
// the single-process reference that every split run is checked against.
type Model struct {
	Cfg     Config
	P, G    *Params
	Opt     *AdamW
	Stage   *Stage
	Experts *LocalExperts
	Step    int // steps completed
}

// NewModel allocates a zeroed model; call Init or load a checkpoint into P.
func NewModel(cfg Config) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	specs := cfg.Specs()
	m := &Model{Cfg: cfg, P: NewParams(specs), G: NewParams(specs), Opt: NewAdamW(specs)}
	var experts []*Expert
	for blk := 0; blk < cfg.NLayer; blk++ {
		if !cfg.IsMoE(blk) {
			continue
		}
		for e := 0; e < cfg.NExpert; e++ {
			es := cfg.ExpertSpecs(blk, e)
			p, err := m.P.Sub(es)
			if err != nil {
				return nil, err
			}
			g, err := m.G.Sub(es)
			if err != nil {
				return nil, err
			}
			experts = append(experts, NewExpert(cfg, blk, e, p, g))
		}
	}
	m.Experts = NewLocalExperts(experts...)
	stage, err := NewStage(cfg, 0, cfg.NLayer, m.P, m.G, m.Experts)
	if err != nil {
		return nil, err
	}
	m.Stage = stage
	return m, nil
}

// Init initialises every parameter from (seed, tensor name) and clears the optimizer.
func (m *Model) Init(seed uint64) {
	m.P.Init(m.Cfg, seed)
	m.Opt.M.Zero()
	m.Opt.V.Zero()
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
		out, err := m.Stage.Forward(j, StageInput{B: mb, T: T, Tokens: tokens[j*n : (j+1)*n], Targets: targets[j*n : (j+1)*n]})
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
