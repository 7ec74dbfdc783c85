package model

import (
	"fmt"
	"maps"
	"math"
	"testing"
)

// shard is a piece of the model with its own slabs, as a peer holds it.
type shard struct {
	p, g *Params
	opt  *AdamW
}

func newShard(cfg Config, specs []Spec, seed uint64) *shard {
	s := &shard{p: NewParams(specs), g: NewParams(specs), opt: NewAdamW(specs)}
	s.p.Init(cfg, seed)
	return s
}

// pipeline is the model cut into stages at cuts, every expert on a shard of its own.
type pipeline struct {
	stages  []*Stage
	shards  []*shard // stage shards, then expert shards
	experts []*Expert
}

func newPipeline(t *testing.T, cfg Config, seed uint64, cuts []int) *pipeline {
	t.Helper()
	pl := &pipeline{}
	bounds := append(append([]int{0}, cuts...), cfg.NLayer)
	for i := 0; i+1 < len(bounds); i++ {
		lo, hi := bounds[i], bounds[i+1]
		var local []*Expert
		for blk := lo; blk < hi; blk++ {
			if !cfg.IsMoE(blk) {
				continue
			}
			for e := 0; e < cfg.NExpert; e++ {
				es := newShard(cfg, cfg.ExpertSpecs(blk, e), seed)
				pl.shards = append(pl.shards, es)
				x := NewExpert(cfg, blk, e, es.p, es.g)
				pl.experts = append(pl.experts, x)
				local = append(local, x)
			}
		}
		ss := newShard(cfg, cfg.StageSpecs(lo, hi, false), seed)
		st, err := NewStage(cfg, lo, hi, ss.p, ss.g, NewLocalExperts(local...))
		if err != nil {
			t.Fatal(err)
		}
		pl.shards = append(pl.shards, ss)
		pl.stages = append(pl.stages, st)
	}
	return pl
}

// step runs every micro-batch forward through the stages, then backward (GPipe order), sums each
// shard's micro-batch gradients by the gradient tree (SumTree over every leaf), then clips by the
// global norm summed from per-shard, per-tensor partial sums, and applies AdamW shard by shard.
func (pl *pipeline) step(t *testing.T, x, y []int32, B, M, stepNo int, lr float64) (ce, aux float64) {
	t.Helper()
	leaves := make([][]GradNode, len(pl.shards)) // by shard: the whole slab's leaf per micro-batch
	for _, s := range pl.shards {
		s.g.Zero()
	}
	ce, aux = gpipe(t, pl.stages, x, y, B, M, func(j int) {
		for i, s := range pl.shards {
			leaves[i] = append(leaves[i], GradNode{Lo: j, Hi: j + 1, Data: append([]float32(nil), s.g.Slab...)})
			s.g.Zero()
		}
	})
	for i, s := range pl.shards {
		if err := SumTree(s.g.Slab, M, leaves[i]); err != nil {
			t.Fatal(err)
		}
	}
	parts := map[string]float64{}
	for _, s := range pl.shards {
		maps.Copy(parts, SquaredNorms(s.g))
	}
	scale := ClipFactor(GlobalNorm(parts), 1)
	for _, s := range pl.shards {
		s.opt.Update(s.p, s.g, stepNo+1, lr, 0.1, scale)
	}
	return ce, aux
}

// gpipe runs the step's M micro-batches of B/M sequences forward through stages, in order, then
// backward (each stage accumulates its gradients in micro-batch order), and returns the mean
// cross-entropy and the mean summed balancing loss. What passes between two stages crosses in the
// stages' wire formats, as it would over the network: a stage's output rounded to its
// activations format, an input gradient to its gradients format.
//
// after, when given, is called once each micro-batch's backward has run through every stage: the
// moment its gradients are complete, when a shard folds them into its gradient tree.
func gpipe(t *testing.T, stages []*Stage, x, y []int32, B, M int, after ...func(j int)) (ce, aux float64) {
	t.Helper()
	T := stages[0].Cfg.BlockSize
	n := B / M * T
	for j := 0; j < M; j++ {
		in := StageInput{B: B / M, T: T, Micro: M, Tokens: x[j*n : (j+1)*n]}
		for i, st := range stages {
			if st.Last() {
				in.Targets = y[j*n : (j+1)*n]
			}
			out, err := st.Forward(j, in)
			if err != nil {
				t.Fatal(err)
			}
			ce += out.CE
			for _, a := range out.Aux {
				aux += a
			}
			if i+1 < len(stages) {
				x := append([]float32(nil), out.X...)
				st.Wire.Activations.Round(x, st.Cfg.NEmbd)
				in = StageInput{B: B / M, T: T, Micro: M, X: x}
			}
		}
	}
	for j := 0; j < M; j++ {
		var d []float32
		for i := len(stages) - 1; i >= 0; i-- {
			var err error
			if d, err = stages[i].Backward(j, d, 1/float32(M)); err != nil {
				t.Fatal(err)
			}
			if d != nil {
				d = append([]float32(nil), d...)
				stages[i].Wire.Gradients.Round(d, stages[i].Cfg.NEmbd)
			}
		}
		for _, f := range after {
			f(j)
		}
	}
	return ce / float64(M), aux / float64(M)
}

func (pl *pipeline) lookup(name string) []float32 {
	for _, s := range pl.shards {
		if t, ok := s.p.Lookup(name); ok {
			return t.Data
		}
	}
	return nil
}

func TestShardInitEqualsWhole(t *testing.T) {
	cfg := TinyConfig()
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(42)
	pl := newPipeline(t, cfg, 42, []int{1, 3})
	n := 0
	for _, tt := range m.P.Tensors {
		got := pl.lookup(tt.Name)
		if got == nil {
			t.Fatalf("%s: in no shard", tt.Name)
		}
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(tt.Data[i]) {
				t.Fatalf("%s[%d]: shard %v, whole %v", tt.Name, i, got[i], tt.Data[i])
			}
		}
		n += len(got)
	}
	total := 0
	for _, s := range pl.shards {
		total += s.p.NumElements()
	}
	if n != total || n != m.P.NumElements() {
		t.Fatalf("shards hold %d parameters, the model %d", total, m.P.NumElements())
	}
}

// TestStagesEqualWhole trains the tiny model split into stages with every expert on its own shard
// and checks losses and parameters against the single-process model, bit for bit.
func TestStagesEqualWhole(t *testing.T) {
	for _, tc := range []struct {
		name string
		cuts []int
		k    int
	}{
		{"2 stages top-2", []int{2}, 2},
		{"4 stages top-2", []int{1, 2, 3}, 2},
		{"3 stages top-1", []int{1, 3}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := TinyConfig()
			cfg.TopK = tc.k
			const B, M, steps, lr = 8, 4, 3, 1e-2
			whole, err := NewModel(cfg)
			if err != nil {
				t.Fatal(err)
			}
			whole.Init(9)
			pl := newPipeline(t, cfg, 9, tc.cuts)
			text := testText(t, 4096)
			for s := 0; s < steps; s++ {
				x, y := windows(text[s*300:], B, cfg.BlockSize)
				r, err := whole.TrainStep(x, y, B, Hyper{MicroBatches: M, LR: lr, WeightDecay: 0.1, Clip: 1})
				if err != nil {
					t.Fatal(err)
				}
				ce, aux := pl.step(t, x, y, B, M, s, lr)
				if ce != r.CE || aux != r.Aux {
					t.Fatalf("step %d: pipeline loss %v aux %v, whole %v aux %v", s, ce, aux, r.CE, r.Aux)
				}
			}
			for _, tt := range whole.P.Tensors {
				got := pl.lookup(tt.Name)
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(tt.Data[i]) {
						t.Fatalf("%s[%d]: pipeline %v, whole %v", tt.Name, i, got[i], tt.Data[i])
					}
				}
			}
		})
	}
}

func TestStageRejectsBadInput(t *testing.T) {
	cfg := TinyConfig()
	pl := newPipeline(t, cfg, 1, []int{2})
	T := cfg.BlockSize
	tests := []struct {
		name  string
		stage int
		in    StageInput
	}{
		{"wrong token count", 0, StageInput{B: 1, T: T, Tokens: make([]int32, T-1)}},
		{"token outside vocab", 0, StageInput{B: 1, T: T, Tokens: append(make([]int32, T-1), 256)}},
		{"negative token", 0, StageInput{B: 1, T: T, Tokens: append(make([]int32, T-1), -1)}},
		{"T beyond block size", 0, StageInput{B: 1, T: T + 1, Tokens: make([]int32, T+1)}},
		{"short activations", 1, StageInput{B: 2, T: T, X: make([]float32, T*cfg.NEmbd)}},
		{"target outside vocab", 1, StageInput{B: 1, T: T, X: make([]float32, T*cfg.NEmbd), Targets: append(make([]int32, T-1), 256)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := pl.stages[tc.stage].Forward(0, tc.in); err == nil {
				t.Fatal("accepted")
			}
			if n := pl.stages[tc.stage].InFlight(); n != 0 {
				t.Fatalf("%d micro-batches left in flight", n)
			}
		})
	}
	if _, err := pl.stages[1].Backward(5, nil, 1); err == nil {
		t.Fatal("backward without forward accepted")
	}
}

func ExampleConfig_StageSpecs() {
	cfg := TinyConfig()
	for _, s := range cfg.StageSpecs(3, 4, false) {
		fmt.Println(s.Name, s.Shape)
	}
	// Output:
	// transformer.h.3.ln_1.weight [64]
	// transformer.h.3.ln_1.bias [64]
	// transformer.h.3.attn.c_attn.weight [192 64]
	// transformer.h.3.attn.c_attn.bias [192]
	// transformer.h.3.attn.c_proj.weight [64 64]
	// transformer.h.3.attn.c_proj.bias [64]
	// transformer.h.3.ln_2.weight [64]
	// transformer.h.3.ln_2.bias [64]
	// transformer.h.3.mlp.router.weight [4 64]
	// transformer.ln_f.weight [64]
	// transformer.ln_f.bias [64]
	// lm_head.weight [256 64]
}

// TestMicroBatchesOnlyRound: with the balancing loss off, M = 4 and M = 1 optimise the same
// objective; their updates θ_T − θ_0 agree per tensor to float32 rounding (docs/design.md, "Equivalence, defined": runs with
// different M differ by the aux term only). The bound is rounding amplified by Adam: M = 4 sums
// its micro-batches by the gradient tree, M = 1 in one chain, and Adam divides each element by
// its own √v, so an element whose gradient is mostly rounding noise — c_attn's key bias, whose
// true gradient is zero (softmax ignores a shift) — moves by ±lr either way and differs at
// 1e-4. A wrong 1/M or a lost micro-batch differs at 1e-1.
func TestMicroBatchesOnlyRound(t *testing.T) {
	cfg := TinyConfig()
	cfg.AuxLossCoef = 0
	text := testText(t, 8192)
	run := func(M int) (*Model, *Params) {
		m, _ := NewModel(cfg)
		m.Init(4)
		theta0 := NewParams(cfg.Specs())
		theta0.CopyFrom(m.P)
		for s := 0; s < 3; s++ {
			x, y := windows(text[s*300:], 8, cfg.BlockSize)
			if _, err := m.TrainStep(x, y, 8, Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: 0.1, Clip: 1}); err != nil {
				t.Fatal(err)
			}
		}
		return m, theta0
	}
	m4, t0 := run(4)
	m1, _ := run(1)
	worst := 0.0
	for i, tt := range m1.P.Tensors {
		d1, d4 := make([]float32, len(tt.Data)), make([]float32, len(tt.Data))
		for j := range d1 {
			d1[j] = tt.Data[j] - t0.Tensors[i].Data[j]
			d4[j] = m4.P.Tensors[i].Data[j] - t0.Tensors[i].Data[j]
		}
		e := relDiff(d4, d1)
		worst = max(worst, e)
		if e > 5e-4 {
			t.Errorf("%s: ‖Δθ(M=4) − Δθ(M=1)‖/‖Δθ(M=1)‖ = %.3g", tt.Name, e)
		}
	}
	t.Logf("worst per-tensor relative difference of the updates: %.3g", worst)
}
