package client

import (
	"context"
	"fmt"
	"sort"
	"sync"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// StepTotals combines the shards' reports of one step the way the single process computes them:
// CE is the mean over micro-batches, aux the mean over micro-batches of the sum over MoE blocks in
// block order, and the gradient norm the root of the per-tensor ‖g‖² summed in tensor-name order.
// Every float64 is added in the same order as model.Model.Gradients adds it, so a pipelined step
// reports bitwise the same numbers.
func StepTotals(reports []*proto.StepReport, M int) (ce, aux, norm float64, err error) {
	var auxes []proto.BlockAux
	parts := map[string]float64{}
	var ces []float64
	for _, r := range reports {
		if len(r.CE) > 0 {
			if ces != nil {
				return 0, 0, 0, fmt.Errorf("two shards report cross-entropy")
			}
			ces = r.CE
		}
		auxes = append(auxes, r.Aux...)
		for name, v := range r.GradSq {
			if _, dup := parts[name]; dup {
				return 0, 0, 0, fmt.Errorf("tensor %s reported by two shards", name)
			}
			parts[name] = v
		}
	}
	if len(ces) != M {
		return 0, 0, 0, fmt.Errorf("cross-entropy of %d micro-batches, want %d", len(ces), M)
	}
	sort.Slice(auxes, func(i, j int) bool { return auxes[i].Block < auxes[j].Block })
	for j := 0; j < M; j++ {
		ce += ces[j]
		for _, a := range auxes {
			if len(a.Aux) != M {
				return 0, 0, 0, fmt.Errorf("block %d: aux of %d micro-batches, want %d", a.Block, len(a.Aux), M)
			}
			aux += a.Aux[j]
		}
	}
	return ce / float64(M), aux / float64(M), model.GlobalNorm(parts), nil
}

// LocalPipeline is a whole pipeline in one process: one StageRunner per stage over a MemNetwork,
// each running on its own goroutine during a step, and a driver playing the coordinator's part
// (tokens in, reports back, clip factor out). It is what the equivalence tests and the pipeline
// benchmark run.
type LocalPipeline struct {
	Runners []*StageRunner
	net     *MemNetwork
	driver  Transport
	cfg     model.Config
}

// NewLocalPipeline cuts cfg into stages at cuts (block indices), each stage holding its own
// experts, initialised from seed.
func NewLocalPipeline(cfg model.Config, seed uint64, cuts []int, weightDecay float64) (*LocalPipeline, error) {
	bounds := append(append([]int{0}, cuts...), cfg.NLayer)
	p := &LocalPipeline{net: NewMemNetwork(), cfg: cfg}
	p.driver = p.net.Peer("coordinator")
	S := len(bounds) - 1
	id := func(i int) string {
		if i < 0 || i >= S {
			return ""
		}
		return fmt.Sprintf("stage-%d", i)
	}
	for i := 0; i < S; i++ {
		sh, err := model.NewStageShard(cfg, bounds[i], bounds[i+1], nil)
		if err != nil {
			return nil, err
		}
		sh.Init(seed)
		p.Runners = append(p.Runners, &StageRunner{Shard: sh, Index: i, NumStages: S,
			Prev: id(i - 1), Next: id(i + 1), Net: p.net.Peer(id(i)), WeightDecay: weightDecay})
	}
	return p, nil
}

// Close releases the network.
func (p *LocalPipeline) Close() { p.net.Close() }

// Step trains one step on the batch (B rows of T tokens) with M micro-batches at learning rate lr
// and clip bound clip, returning the step's CE, aux and gradient norm.
func (p *LocalPipeline) Step(ctx context.Context, step uint64, x, y []int32, B, M int, lr, clip float64) (ce, aux, norm float64, err error) {
	T := p.cfg.BlockSize
	st := StepSpec{Step: step, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	n := st.Rows * T
	firstID, lastID := "stage-0", fmt.Sprintf("stage-%d", len(p.Runners)-1)
	for j := 0; j < M; j++ {
		xt, yt, err := TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			return 0, 0, 0, err
		}
		if err := p.driver.Send(ctx, firstID, xt); err != nil {
			return 0, 0, 0, err
		}
		if err := p.driver.Send(ctx, lastID, yt); err != nil {
			return 0, 0, 0, err
		}
	}
	reports := make([]*proto.StepReport, len(p.Runners))
	errs := make([]error, len(p.Runners))
	var wg sync.WaitGroup
	for i, r := range p.Runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = r.RunStep(ctx, st)
		}()
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return 0, 0, 0, e
		}
	}
	ce, aux, norm, err = StepTotals(reports, M)
	if err != nil {
		return 0, 0, 0, err
	}
	f := model.ClipFactor(norm, clip)
	for _, r := range p.Runners {
		r.Apply(step, lr, f)
	}
	return ce, aux, norm, nil
}

// Params returns every tensor of the pipeline by name.
func (p *LocalPipeline) Params() map[string][]float32 {
	out := map[string][]float32{}
	for _, r := range p.Runners {
		for _, t := range r.Shard.P.Tensors {
			out[t.Name] = t.Data
		}
	}
	return out
}

// Eval computes the validation loss through the pipeline after step: the windows (x, y: rows of
// T tokens, a multiple of data.ValRows) go through forward passes of data.ValRows rows each.
func (p *LocalPipeline) Eval(ctx context.Context, step uint64, x, y []int32) (float64, error) {
	T := p.cfg.BlockSize
	rows := len(x) / T
	st := StepSpec{Step: EvalStep(step), PlanVersion: 1, MicroBatches: rows / data.ValRows, Rows: data.ValRows}
	n := st.Rows * T
	lastID := fmt.Sprintf("stage-%d", len(p.Runners)-1)
	for j := 0; j < st.MicroBatches; j++ {
		xt, yt, err := TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			return 0, err
		}
		if err := p.driver.Send(ctx, "stage-0", xt); err != nil {
			return 0, err
		}
		if err := p.driver.Send(ctx, lastID, yt); err != nil {
			return 0, err
		}
	}
	reports := make([]*proto.StepReport, len(p.Runners))
	errs := make([]error, len(p.Runners))
	var wg sync.WaitGroup
	for i, r := range p.Runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = r.RunEval(ctx, st)
		}()
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return 0, e
		}
	}
	return data.ValLoss(reports[len(reports)-1].CE), nil
}
