package stagecheck

import (
	"math/rand/v2"

	"github.com/shoal-ml/shoal/model"
)

// The run's settings. A large learning rate and weight decay (docs/design.md, "Equivalence, defined": a tiny learning rate
// cannot tell a missing weight decay from noise).
const (
	LR    = 1e-2
	WD    = 1.0
	Micro = 2 // micro-batches per step
	Rows  = 2 // sequences per micro-batch
)

// Run is one stage's training on one device.
type Run struct {
	Shard   *model.Shard
	Initial *model.Params // the parameters before the first step
	CE      []float64     // the mean loss of each step, on the last stage
	Norms   []float64     // each step's global gradient norm
	// Out and DX are every micro-batch's activations sent forward (not on the last stage) and
	// input gradients sent back (not on the first), step after step.
	Out, DX [][]float32
}

// Hooks let a caller time or count a step's phases; any may be nil.
type Hooks struct {
	StepStart  func() // before the step's forwards
	MicroDone  func() // after its last backward, before the norms
	ApplyStart func() // before the update
	ApplyDone  func() // after the update, before the step's Pull
	StepDone   func() // after the Pull: the step's time includes the update
}

func call(f func()) {
	if f != nil {
		f()
	}
}

// Train trains blocks [lo, hi) of cfg, with their experts local, for steps steps on dev, from
// seed 1, on fixed pseudo-random tokens (and, for a middle stage, inputs and output gradients):
// the same data on every device.
func Train(cfg model.Config, dev model.Device, lo, hi, steps int, h Hooks) (*Run, error) {
	sh, err := model.NewStageShardOn(dev, cfg, lo, hi, nil)
	if err != nil {
		return nil, err
	}
	sh.Init(1)
	sh.Pull()
	run := &Run{Shard: sh, Initial: model.NewParams(sh.P.Specs())}
	for i, t := range sh.P.Tensors {
		copy(run.Initial.Tensors[i].Data, t.Data)
	}
	st := sh.Stage
	st.Defer = true // as a worker's GPU stage: the losses and statistics with the norms
	T, C, V := cfg.BlockSize, cfg.NEmbd, cfg.VocabSize
	N := Rows * T
	r := rand.New(rand.NewPCG(7, 11))
	for step := range steps {
		ins := make([]model.StageInput, Micro)
		douts := make([][]float32, Micro)
		for mb := range ins {
			in := model.StageInput{B: Rows, T: T, Micro: Micro}
			if st.First() {
				in.Tokens = RandTokens(r, N, V)
			} else {
				in.X = RandFloats(r, N*C, 1)
			}
			if st.Last() {
				in.Targets = RandTokens(r, N, V)
			} else {
				douts[mb] = RandFloats(r, N*C, 1e-2)
			}
			ins[mb] = in
		}
		call(h.StepStart)
		ces := make([]float64, Micro)
		for mb := range ins {
			o, err := st.Forward(mb, ins[mb])
			if err != nil {
				return nil, err
			}
			ces[mb] = o.CE // NaN when it waits on the device for TakeStats
			if !st.Last() {
				run.Out = append(run.Out, append([]float32(nil), o.X...))
			}
		}
		for mb := Micro - 1; mb >= 0; mb-- {
			dx, err := st.Backward(mb, douts[mb], 1/float32(Micro))
			if err != nil {
				return nil, err
			}
			if !st.First() {
				run.DX = append(run.DX, append([]float32(nil), dx...))
			}
		}
		call(h.MicroDone)
		norm := model.GlobalNorm(sh.GradSquaredNorms()) // and the losses and MoE statistics, in one read
		for _, d := range st.TakeStats() {
			if d.Block == -1 {
				ces[d.MB] = d.CE
			}
		}
		var ce float64
		for _, c := range ces {
			ce += c / Micro
		}
		call(h.ApplyStart)
		sh.Apply(step+1, LR, WD, model.ClipFactor(norm, 1))
		sh.ZeroGrads() // takes the device, which records a pending AdamW run first
		call(h.ApplyDone)
		sh.Pull()
		call(h.StepDone)
		if st.Last() {
			run.CE = append(run.CE, ce)
		}
		run.Norms = append(run.Norms, norm)
	}
	return run, nil
}

// RandTokens is n tokens below V from r.
func RandTokens(r *rand.Rand, n, V int) []int32 {
	x := make([]int32, n)
	for i := range x {
		x[i] = int32(r.IntN(V))
	}
	return x
}

// RandFloats is n normal values of standard deviation scale from r.
func RandFloats(r *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * scale)
	}
	return x
}
