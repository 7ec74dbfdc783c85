package client

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Expert parallelism: a stage routes each token of an MoE block to its top-k experts; experts may
// live on other peers ("expert hosts"). The stage sends each expert its rows, split into the two
// token groups of model.ExpertGroups — both to a whole expert, group r to replica r of a replicated
// one — and the hosts answer with the expert's outputs; backward mirrors it.
//
// On the wire the two groups of one micro-batch are separate tensors (proto.ExpertKey); an empty
// group is an empty tensor, so an expert routed no tokens still answers and nobody waits for it.

// ExpertRef names expert E of MoE block Block.
type ExpertRef struct{ Block, Expert int }

func expertKey(kind proto.Kind, st proto.StepSpec, ref ExpertRef, mb, group int) proto.TensorKey {
	return proto.ExpertKey{Kind: kind, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: mb, Group: group,
		Block: ref.Block, Expert: ref.Expert}.Key()
}

// partialKey names the gradient of replica group's half of the micro-batches of an expert (its node
// of the gradient tree, model.GroupHalf), exchanged between the replicas after the step's last
// backward.
func partialKey(st proto.StepSpec, ref ExpertRef, group int) proto.TensorKey {
	return proto.ExpertKey{Kind: proto.KindExpertGradOut, PlanVersion: st.PlanVersion, Step: st.Step, Group: group,
		Block: ref.Block, Expert: ref.Expert, Partial: true}.Key()
}

// The wire's token groups (proto.ExpertKey.Group) are the model's.
var _ [proto.ExpertGroups - model.ExpertGroups]struct{}
var _ [model.ExpertGroups - proto.ExpertGroups]struct{}

// rowsTensor is the tensor key carrying x, an expert's rows of C, in format f: the job's wire
// format for the direction they go. A replica's half of a gradient, and a replica's gradient-tree
// node, travel as one float32 row of values (f = F32, C = 1): parameter gradients, not boundary
// tensors, they are never quantised.
func rowsTensor(key proto.TensorKey, f model.Format, x []float32, C int) (proto.Tensor, error) {
	return packRows(key, f, x, C, len(x)/C, C)
}

// recvRows waits for the tensor key, rows of C in format f, and returns its values.
func recvRows(ctx context.Context, net Transport, key proto.TensorKey, f model.Format, C int) ([]float32, error) {
	t, err := net.Recv(ctx, key)
	if err != nil {
		return nil, err
	}
	return unpackRows(t, f, -1, C)
}

// ExpertDispatch is a stage's model.Experts when some experts live on other peers: it computes the
// local ones itself and exchanges rows with the hosts of the others over the stage's Transport.
type ExpertDispatch struct {
	Local *model.LocalExperts
	Hosts map[ExpertRef][]string // remote experts: their hosts in replica order (1 or 2)
	Net   Transport
	C     int

	ctx context.Context
	st  proto.StepSpec
	// waited is the time spent inside the stage's Forward and Backward waiting for remote
	// experts' answers since the runner last took it (takeWait): the stage's compute time
	// excludes it, so that a stage's timings (and the speed the coordinator measures from them)
	// say what it computed, not how long its expert hosts took.
	waited time.Duration
}

// takeWait returns the time waited for remote experts since the last call, and resets it.
func (d *ExpertDispatch) takeWait() time.Duration {
	w := d.waited
	d.waited = 0
	return w
}

// begin sets the step whose tensors Forward and Backward exchange.
func (d *ExpertDispatch) begin(ctx context.Context, st proto.StepSpec) { d.ctx, d.st = ctx, st }

// exchange sends the remote experts' rows, computes the local ones, and collects the remote
// answers, all in format f: the rows cross the expert boundary whether or not they leave this
// peer (local rounds them as sending would, model.LocalExperts.ForwardExpert).
//
// The local experts run as one block (model.LocalExperts.Forward and Backward): their rows are cut
// from one arena of the micro-batch's assignments, sized once, as the memory model counts them.
// Run one by one, each expert's own buffers grew to the most rows it had ever been sent, with
// slack: a stage's memory crept up step after step (a large-model stage by 620 MB in 8 steps).
func (d *ExpertDispatch) exchange(kinds [2]proto.Kind, f model.Format, block, mb int, xs [][]float32, splits []int,
	local func(xs [][]float32, splits []int) ([][]float32, error)) ([][]float32, error) {
	out := make([][]float32, len(xs))
	C := d.C
	// Send every remote expert its rows first, so that the hosts work while the stage computes
	// its local experts.
	for e := range xs {
		hosts := d.Hosts[ExpertRef{block, e}]
		if len(hosts) == 0 {
			continue
		}
		s := splits[e] * C
		for g, part := range [2][]float32{xs[e][:s], xs[e][s:]} {
			t, err := rowsTensor(expertKey(kinds[0], d.st, ExpertRef{block, e}, mb, g), f, part, C)
			if err != nil {
				return nil, err
			}
			if err := d.Net.Send(d.ctx, hosts[min(g, len(hosts)-1)], t); err != nil {
				return nil, err
			}
		}
	}
	var here []int // the local experts, ascending: LocalExperts' order within the block
	var lxs [][]float32
	var lsplits []int
	for e := range xs {
		if d.Local.Get(block, e) != nil {
			here, lxs, lsplits = append(here, e), append(lxs, xs[e]), append(lsplits, splits[e])
		}
	}
	if len(here) > 0 {
		ys, err := local(lxs, lsplits)
		if err != nil {
			return nil, err
		}
		for i, e := range here {
			out[e] = ys[i]
		}
	}
	for e := range xs {
		if len(d.Hosts[ExpertRef{block, e}]) == 0 {
			if out[e] == nil {
				return nil, fmt.Errorf("block %d expert %d: neither local nor hosted", block, e)
			}
			continue
		}
		var y []float32
		for g := 0; g < model.ExpertGroups; g++ {
			t0 := time.Now()
			part, err := recvRows(d.ctx, d.Net, expertKey(kinds[1], d.st, ExpertRef{block, e}, mb, g), f, C)
			d.waited += time.Since(t0)
			if err != nil {
				return nil, err
			}
			y = append(y, part...)
		}
		if len(y) != len(xs[e]) {
			return nil, fmt.Errorf("block %d expert %d: %d values back for %d sent", block, e, len(y), len(xs[e]))
		}
		out[e] = y
	}
	return out, nil
}

// Forward implements model.Experts.
func (d *ExpertDispatch) Forward(block, mb int, xs [][]float32, splits []int) ([][]float32, error) {
	return d.exchange([2]proto.Kind{proto.KindExpertIn, proto.KindExpertOut}, d.Local.Wire.Activations, block, mb, xs, splits,
		func(xs [][]float32, splits []int) ([][]float32, error) { return d.Local.Forward(block, mb, xs, splits) })
}

// Backward implements model.Experts.
func (d *ExpertDispatch) Backward(block, mb int, dys [][]float32, splits []int) ([][]float32, error) {
	return d.exchange([2]proto.Kind{proto.KindExpertGradIn, proto.KindExpertGradOut}, d.Local.Wire.Gradients, block, mb, dys, splits,
		func(dys [][]float32, splits []int) ([][]float32, error) {
			return d.Local.Backward(block, mb, dys, splits)
		})
}

// ExpertRunner runs an expert host's part of each step: it serves the experts of one MoE block for
// the stage that routes to them, in the order that stage's 1F1B schedule asks for them, and
// exchanges partial gradients with the other replica of a replicated expert.
type ExpertRunner struct {
	Shard      *model.Shard // an expert shard: Shard.Experts holds the experts, replicas marked
	Stage      string       // the worker holding the block's stage
	StageIndex int          // that stage's position, and the pipeline's length: the schedule to follow
	NumStages  int
	Depth      int // the plan's pipeline depth, as the stage's (StageRunner.Depth)
	// Routers, in a plan of several pipeline replicas, are the block's stage in each replica:
	// the host serves them all (Stage, StageIndex, NumStages and Depth are unused then).
	Routers     []proto.ExpertRouter
	Siblings    map[ExpertRef]string // for a replicated expert, the worker holding the other replica
	Net         Transport
	WeightDecay float64
}

func (r *ExpertRunner) experts() []*model.Expert { return r.Shard.Experts.All() }

// serve runs forward (or backward) for micro-batch mb on every expert held, in block order
// (reversed for backward, as the stage walks its blocks), sends the results to the stage to, and
// after a backward folds the micro-batch's gradient leaf into the tree; it adds where the time
// went to tm. With mu set (a host serving several replicas' stages at once) it first receives
// every expert's rows, then computes and folds holding mu, and sends after releasing it: a pass
// waiting on the network while holding the host would let two pipelines deadlock (each stage
// waiting for the host, the host waiting for the other stage).
func (r *ExpertRunner) serve(ctx context.Context, st proto.StepSpec, to string, mb int, backward bool, tm *proto.Timings, mu *sync.Mutex) error {
	xs := r.experts()
	if backward {
		sort.SliceStable(xs, func(i, j int) bool { return xs[i].Block > xs[j].Block })
	}
	C := r.Shard.Cfg.NEmbd
	// The rows arrive and leave in the job's wire format: the host computes on the values the
	// stage's model rounded them to, and the stage gets the rounding of what the host computed.
	kin, kout, f := proto.KindExpertIn, proto.KindExpertOut, r.Shard.Experts.Wire.Activations
	if backward {
		kin, kout, f = proto.KindExpertGradIn, proto.KindExpertGradOut, r.Shard.Experts.Wire.Gradients
	}
	type pass struct {
		x      *model.Expert
		groups []int
		in     []float32
		split  int // group 0's rows
	}
	recv := func(x *model.Expert) (pass, error) {
		p := pass{x: x, groups: []int{0, 1}}
		if x.Replica >= 0 {
			p.groups = []int{x.Replica}
		}
		for _, g := range p.groups {
			t0 := time.Now()
			part, err := recvRows(ctx, r.Net, expertKey(kin, st, ExpertRef{x.Block, x.Index}, mb, g), f, C)
			tm.WaitNS += int64(time.Since(t0))
			if err != nil {
				return p, err
			}
			if g == 0 {
				p.split = len(part) / C
			}
			p.in = append(p.in, part...)
		}
		return p, nil
	}
	// compute runs one expert's pass and returns what goes back, encoded (a copy: the expert's
	// output buffer is reused by its next pass).
	compute := func(p pass) ([]proto.Tensor, error) {
		x, ref := p.x, ExpertRef{p.x.Block, p.x.Index}
		var out []float32
		var err error
		t0 := time.Now()
		if backward {
			out, err = x.Backward(mb, p.in, p.split)
			tm.BackwardNS += int64(time.Since(t0))
		} else {
			out, err = x.Forward(mb, p.in)
			tm.ForwardNS += int64(time.Since(t0))
		}
		if err != nil {
			return nil, err
		}
		parts := [][]float32{out}
		if len(p.groups) == 2 {
			parts = [][]float32{out[:p.split*C], out[p.split*C:]}
		}
		ts := make([]proto.Tensor, len(parts))
		for k := range parts {
			if ts[k], err = rowsTensor(expertKey(kout, st, ref, mb, p.groups[k]), f, parts[k], C); err != nil {
				return nil, err
			}
		}
		return ts, nil
	}
	sendAll := func(ts []proto.Tensor) error {
		for _, t := range ts {
			if err := r.send(ctx, to, t, tm); err != nil {
				return err
			}
		}
		return nil
	}
	fold := func() error {
		if backward {
			return r.Shard.MicroBatchDone(mb)
		}
		return nil
	}
	if mu == nil {
		// One stage: each expert's result leaves as soon as it is computed.
		for _, x := range xs {
			p, err := recv(x)
			if err != nil {
				return err
			}
			ts, err := compute(p)
			if err != nil {
				return err
			}
			if err := sendAll(ts); err != nil {
				return err
			}
		}
		return fold()
	}
	passes := make([]pass, len(xs))
	for i, x := range xs {
		var err error
		if passes[i], err = recv(x); err != nil {
			return err
		}
	}
	out, err := func() ([]proto.Tensor, error) {
		mu.Lock()
		defer mu.Unlock()
		var out []proto.Tensor
		for _, p := range passes {
			ts, err := compute(p)
			if err != nil {
				return nil, err
			}
			out = append(out, ts...)
		}
		return out, fold()
	}()
	if err != nil {
		return err
	}
	return sendAll(out)
}

func (r *ExpertRunner) send(ctx context.Context, to string, t proto.Tensor, tm *proto.Timings) error {
	t0 := time.Now()
	err := r.Net.Send(ctx, to, t)
	tm.TransferNS += int64(time.Since(t0))
	return err
}

// RunStep serves one training step and returns the host's report: the ‖g‖² of its experts'
// tensors. A replicated expert's two replicas exchange their partial gradients first and add them
// in group order, so both hold the same gradient; both report it, and the coordinator counts each
// tensor once (proto.StepTotals checks that the replicas agree).
func (r *ExpertRunner) RunStep(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	rep, err := r.runStep(ctx, st)
	if err != nil {
		r.Shard.Reset()
		return nil, fmt.Errorf("expert host step %d: %w", st.Step, err)
	}
	return rep, nil
}

func (r *ExpertRunner) runStep(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	start := time.Now()
	var tm proto.Timings
	if st.MicroBatches < 1 || r.Depth < 0 {
		return nil, fmt.Errorf("step with %d micro-batches at depth %d", st.MicroBatches, r.Depth)
	}
	M := st.MicroBatches
	routers := r.routers(M)
	runs := make([][2]int, len(routers))
	for i, rt := range routers {
		runs[i] = [2]int{rt.First, rt.First + rt.MicroBatches}
	}
	if err := r.Shard.BeginGradientsRuns(M, runs); err != nil {
		return nil, err
	}
	if len(routers) == 1 {
		if err := r.follow(ctx, st, routers[0], nil, &tm); err != nil {
			return nil, err
		}
	} else if err := r.followAll(ctx, st, routers, &tm); err != nil {
		return nil, err
	}
	if !r.Shard.GradientsComplete() {
		if err := r.exchangeHalves(ctx, st, &tm); err != nil {
			return nil, err
		}
	}
	gradSq := r.Shard.GradSquaredNorms()
	if err := deviceErr(r.Shard.Device()); err != nil {
		return nil, err
	}
	tm.TotalNS = int64(time.Since(start))
	return &proto.StepReport{Step: st.Step, PlanVersion: st.PlanVersion, GradSq: gradSq, Timings: tm}, nil
}

// routers are the stages the host serves in a step of M micro-batches: Routers, or for a plan of
// one pipeline its one stage with all of them.
func (r *ExpertRunner) routers(M int) []proto.ExpertRouter {
	if len(r.Routers) > 0 {
		return r.Routers
	}
	return []proto.ExpertRouter{{Worker: r.Stage, StageIndex: r.StageIndex, StageCount: r.NumStages, MicroBatches: M, Depth: r.Depth}}
}

// follow serves one router's micro-batches in the order of its stage's 1F1B schedule. With mu
// set (several routers), each micro-batch's compute — and for backward the fold of its gradient
// leaf, which accumulates in the shard's one G — holds mu (serve): the shard computes one pass at
// a time, and which router's comes first changes no bit (model.BeginGradientsRuns).
func (r *ExpertRunner) follow(ctx context.Context, st proto.StepSpec, rt proto.ExpertRouter, mu *sync.Mutex, tm *proto.Timings) error {
	if rt.First+rt.MicroBatches > st.MicroBatches {
		return fmt.Errorf("router %s: micro-batches [%d,%d) of a step of %d", rt.Worker, rt.First, rt.First+rt.MicroBatches, st.MicroBatches)
	}
	for _, ins := range sched.OneFOneBDepth(rt.StageIndex, rt.StageCount, rt.MicroBatches, rt.Depth) {
		if ins.Op != sched.OpForward && ins.Op != sched.OpBackward {
			continue
		}
		if err := r.serve(ctx, st, rt.Worker, rt.First+ins.MicroBatch, ins.Op == sched.OpBackward, tm, mu); err != nil {
			return err
		}
	}
	return nil
}

// followAll serves several routers at once, each on its own goroutine (a replica's stage must
// not wait for another replica's schedule); the first error cancels the others.
func (r *ExpertRunner) followAll(ctx context.Context, st proto.StepSpec, routers []proto.ExpertRouter, tm *proto.Timings) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	tms := make([]proto.Timings, len(routers))
	errs := make([]error, len(routers))
	var wg sync.WaitGroup
	for i, rt := range routers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[i] = r.follow(ctx, st, rt, &mu, &tms[i]); errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	for i := range routers {
		tm.ForwardNS += tms[i].ForwardNS
		tm.BackwardNS += tms[i].BackwardNS
		tm.WaitNS += tms[i].WaitNS
		tm.TransferNS += tms[i].TransferNS
	}
	// The first failure, not the cancellations it caused in the others.
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return errors.Join(errs...)
}

// exchangeHalves completes the replicated experts' gradients: replica r computed the node of half
// r of the gradient tree (model.GroupHalf), sends it to the other replica as one row of its four
// tensors' values (empty when its half has no micro-batches), and sums the two as the single
// process's tree does.
func (r *ExpertRunner) exchangeHalves(ctx context.Context, st proto.StepSpec, tm *proto.Timings) error {
	M := st.MicroBatches
	for _, x := range r.experts() {
		if x.Replica < 0 {
			continue
		}
		ref := ExpertRef{x.Block, x.Index}
		sib, ok := r.Siblings[ref]
		if !ok {
			return fmt.Errorf("replica %d of block %d expert %d has no sibling", x.Replica, ref.Block, ref.Expert)
		}
		var flat []float32
		for _, t := range x.G.Tensors {
			ns, err := r.Shard.GradNodes(t.Name)
			if err != nil {
				return err
			}
			if len(ns) > 1 {
				return fmt.Errorf("block %d expert %d: %d gradient nodes for one half", ref.Block, ref.Expert, len(ns))
			}
			for _, n := range ns {
				flat = append(flat, n.Data...)
			}
		}
		t, err := rowsTensor(partialKey(st, ref, x.Replica), model.F32, flat, 1)
		if err != nil {
			return err
		}
		if err := r.send(ctx, sib, t, tm); err != nil {
			return err
		}
		t0 := time.Now()
		theirs, err := recvRows(ctx, r.Net, partialKey(st, ref, 1-x.Replica), model.F32, 1)
		tm.WaitNS += int64(time.Since(t0))
		if err != nil {
			return err
		}
		half := model.GroupHalf(M, 1-x.Replica)
		want := 0
		if half[1] > half[0] {
			want = x.G.NumElements()
		}
		if len(theirs) != want {
			return fmt.Errorf("block %d expert %d: the other replica's half of %d values, want %d", ref.Block, ref.Expert, len(theirs), want)
		}
		off := 0
		for _, t := range x.G.Tensors {
			var nodes []model.GradNode
			if want > 0 {
				nodes = []model.GradNode{{Lo: half[0], Hi: half[1], Data: theirs[off : off+len(t.Data)]}}
				off += len(t.Data)
			}
			if err := r.Shard.ReduceGradients(t.Name, nodes); err != nil {
				return err
			}
		}
	}
	return nil
}

// RunEval serves an evaluation: forward passes only, micro-batch after micro-batch.
func (r *ExpertRunner) RunEval(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	defer func() {
		// As StageRunner.RunEval: what the evaluation's larger passes grew goes.
		r.Shard.Experts.Reset()
		r.Shard.Experts.Trim()
	}()
	start := time.Now()
	var tm proto.Timings
	// An evaluation runs through the first replica only (the coordinator's evaluate).
	to := r.routers(st.MicroBatches)[0].Worker
	for mb := 0; mb < st.MicroBatches; mb++ {
		if err := r.serve(ctx, st, to, mb, false, &tm, nil); err != nil {
			return nil, fmt.Errorf("expert host eval: %w", err)
		}
		r.Shard.Experts.Reset()
	}
	tm.TotalNS = int64(time.Since(start))
	return &proto.StepReport{Step: st.Step, PlanVersion: st.PlanVersion, Eval: true, Timings: tm}, nil
}

// Apply finishes a step with the coordinator's clip factor: AdamW on the host's experts.
func (r *ExpertRunner) Apply(step uint64, lr float64, clip float32) {
	r.Shard.Apply(int(step)+1, lr, r.WeightDecay, clip)
	r.Shard.ZeroGrads()
}
