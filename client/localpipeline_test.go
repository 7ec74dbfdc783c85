package client

import (
	"context"
	"fmt"
	"sync"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// LocalPipeline is a whole pipeline in one process, for the equivalence tests: one StageRunner per
// stage (and one ExpertRunner per expert host) over a MemNetwork, each on its own goroutine during
// a step, and a driver playing the coordinator's part (tokens in, reports back, clip factor out).
type LocalPipeline struct {
	Runners []*StageRunner
	Hosts   []*ExpertRunner
	net     *MemNetwork
	driver  Transport
	cfg     model.Config
}

// NewLocalPipeline cuts cfg into stages at cuts (block indices), each stage holding its own
// experts, initialised from seed.
func NewLocalPipeline(cfg model.Config, seed uint64, cuts []int, weightDecay float64) (*LocalPipeline, error) {
	return NewLocalExpertPipeline(cfg, seed, cuts, weightDecay, nil)
}

// NewLocalExpertPipeline is NewLocalPipeline with experts placed on expert hosts: hosts[i] lists
// the experts host i holds, all of one MoE block; an expert listed by two hosts is replicated,
// the first listed being replica 0. Experts on no host stay with their stage.
func NewLocalExpertPipeline(cfg model.Config, seed uint64, cuts []int, weightDecay float64, hosts [][]ExpertRef) (*LocalPipeline, error) {
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
	placed := map[ExpertRef][]string{} // replica order
	for h, refs := range hosts {
		for _, ref := range refs {
			placed[ref] = append(placed[ref], fmt.Sprintf("expert-%d", h))
		}
	}
	stageOf := func(blk int) int {
		for i := 0; i < S; i++ {
			if blk >= bounds[i] && blk < bounds[i+1] {
				return i
			}
		}
		return -1
	}
	for i := 0; i < S; i++ {
		var disp *ExpertDispatch
		net := p.net.Peer(id(i))
		sh, err := model.NewStageShardWith(cfg, bounds[i], bounds[i+1],
			func(blk, e int) bool { return len(placed[ExpertRef{blk, e}]) == 0 },
			func(local *model.LocalExperts) model.Experts {
				disp = &ExpertDispatch{Local: local, Hosts: placed, Net: net, C: cfg.NEmbd}
				return disp
			})
		if err != nil {
			return nil, err
		}
		sh.Init(seed)
		r := &StageRunner{Shard: sh, Index: i, NumStages: S, Prev: id(i - 1), Next: id(i + 1), Net: net, WeightDecay: weightDecay}
		if len(placed) > 0 {
			r.Dispatch = disp
		}
		p.Runners = append(p.Runners, r)
	}
	for h, refs := range hosts {
		if len(refs) == 0 {
			continue
		}
		blk := refs[0].Block
		var es []int
		for _, ref := range refs {
			if ref.Block != blk {
				return nil, fmt.Errorf("expert host %d holds experts of blocks %d and %d", h, blk, ref.Block)
			}
			es = append(es, ref.Expert)
		}
		sh, err := model.NewExpertShard(cfg, blk, es)
		if err != nil {
			return nil, err
		}
		sh.Init(seed)
		me := fmt.Sprintf("expert-%d", h)
		sib := map[ExpertRef]string{}
		for _, ref := range refs {
			if reps := placed[ref]; len(reps) == 2 {
				x := sh.Experts.Get(ref.Block, ref.Expert)
				if reps[0] == me {
					x.SetReplica(0)
					sib[ref] = reps[1]
				} else {
					x.SetReplica(1)
					sib[ref] = reps[0]
				}
			}
		}
		si := stageOf(blk)
		p.Hosts = append(p.Hosts, &ExpertRunner{Shard: sh, Stage: id(si), StageIndex: si, NumStages: S,
			Siblings: sib, Net: p.net.Peer(me), WeightDecay: weightDecay})
	}
	return p, nil
}

// Close releases the network.
func (p *LocalPipeline) Close() { p.net.Close() }

// Step trains one step on the batch (B rows of T tokens) with M micro-batches at learning rate lr
// and clip bound clip, returning the step's CE, aux and gradient norm.
func (p *LocalPipeline) Step(ctx context.Context, step uint64, x, y []int32, B, M int, lr, clip float64) (ce, aux, norm float64, err error) {
	T := p.cfg.BlockSize
	st := proto.StepSpec{Step: step, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	n := st.Rows * T
	firstID, lastID := "stage-0", fmt.Sprintf("stage-%d", len(p.Runners)-1)
	for j := 0; j < M; j++ {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
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
	reports, err := p.runAll(func(r *StageRunner) (*proto.StepReport, error) { return r.RunStep(ctx, st) },
		func(h *ExpertRunner) (*proto.StepReport, error) { return h.RunStep(ctx, st) })
	if err != nil {
		return 0, 0, 0, err
	}
	ce, aux, norm, err = proto.StepTotals(reports, M)
	if err != nil {
		return 0, 0, 0, err
	}
	f := model.ClipFactor(norm, clip)
	for _, r := range p.Runners {
		r.Apply(step, lr, f)
	}
	for _, h := range p.Hosts {
		h.Apply(step, lr, f)
	}
	return ce, aux, norm, nil
}

// runAll runs every stage and expert host on its own goroutine; reports come back stages first.
func (p *LocalPipeline) runAll(stage func(*StageRunner) (*proto.StepReport, error), host func(*ExpertRunner) (*proto.StepReport, error)) ([]*proto.StepReport, error) {
	n := len(p.Runners)
	reports := make([]*proto.StepReport, n+len(p.Hosts))
	errs := make([]error, len(reports))
	var wg sync.WaitGroup
	for i, r := range p.Runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = stage(r)
		}()
	}
	for i, h := range p.Hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[n+i], errs[n+i] = host(h)
		}()
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return nil, e
		}
	}
	return reports, nil
}

// Params returns every tensor of the pipeline by name (for a replicated expert, replica 0's).
func (p *LocalPipeline) Params() map[string][]float32 {
	out := map[string][]float32{}
	var shards []*model.Shard
	for _, r := range p.Runners {
		shards = append(shards, r.Shard)
	}
	for _, h := range p.Hosts {
		shards = append(shards, h.Shard)
	}
	for _, sh := range shards {
		for _, t := range sh.P.Tensors {
			if _, ok := out[t.Name]; !ok {
				out[t.Name] = t.Data
			}
		}
	}
	return out
}

// Eval computes the validation loss through the pipeline after step: the windows (x, y: rows of
// T tokens, a multiple of data.ValRows) go through forward passes of data.ValRows rows each.
func (p *LocalPipeline) Eval(ctx context.Context, step uint64, x, y []int32) (float64, error) {
	T := p.cfg.BlockSize
	rows := len(x) / T
	st := proto.StepSpec{Step: proto.EvalStep(step), PlanVersion: 1, MicroBatches: rows / data.ValRows, Rows: data.ValRows}
	n := st.Rows * T
	lastID := fmt.Sprintf("stage-%d", len(p.Runners)-1)
	for j := 0; j < st.MicroBatches; j++ {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
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
	reports, err := p.runAll(func(r *StageRunner) (*proto.StepReport, error) { return r.RunEval(ctx, st) },
		func(h *ExpertRunner) (*proto.StepReport, error) { return h.RunEval(ctx, st) })
	if err != nil {
		return 0, err
	}
	return data.ValLoss(reports[len(p.Runners)-1].CE, data.ValRows), nil
}
