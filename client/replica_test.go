//go:build !js

package client

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// replicaRig is a plan of pipeline replicas in one process: every stage built from its Assign as
// a worker builds it (buildShard), over a MemNetwork, each on its own goroutine during a step, and
// a driver playing the coordinator.
type replicaRig struct {
	net     *MemNetwork
	driver  Transport
	ids     []string
	runners []*StageRunner
	assigns []*proto.Assign // by runner
	reps    [][2]int        // per replica: its stages [lo, hi) of runners
	shares  [][2]int        // per replica: micro-batches [first, first+n)
	hosts   []*ExpertRunner
}

// newReplicaRig staffs replicas (each a list of stage cuts [begin, end)) with shares micro-batches
// each, of a job of spec.
func newReplicaRig(t *testing.T, specJSON []byte, M int, cfg model.Config, seed uint64, replicas [][][2]int, shares []int) *replicaRig {
	t.Helper()
	return newReplicaRigHosts(t, specJSON, M, cfg, seed, replicas, shares, nil)
}

// newReplicaRigHosts is newReplicaRig with expert hosts serving every replica: hosted maps an MoE
// block to the experts of it that one host ("host-<block>") holds.
func newReplicaRigHosts(t *testing.T, specJSON []byte, M int, cfg model.Config, seed uint64, replicas [][][2]int, shares []int, hosted map[int][]int) *replicaRig {
	t.Helper()
	spec, err := job.Parse(specJSON)
	if err != nil {
		t.Fatal(err)
	}
	hostOf := func(blk int) string { return fmt.Sprintf("host-%d", blk) }
	g := &replicaRig{net: NewMemNetwork()}
	g.driver = g.net.Peer("coordinator")
	type stage struct {
		id              string
		replica, first  int
		n, begin, end   int
		index, count    int
		firstSt, lastSt bool
		prev, next      string
	}
	var all []stage
	first := 0
	for r, cuts := range replicas {
		lo := len(all)
		for i, c := range cuts {
			all = append(all, stage{id: fmt.Sprintf("r%d-s%d", r, i), replica: r, first: first, n: shares[r], begin: c[0], end: c[1],
				index: i, count: len(cuts), firstSt: i == 0, lastSt: i == len(cuts)-1})
		}
		for i := lo; i < len(all); i++ {
			if i > lo {
				all[i].prev = all[i-1].id
			}
			if i+1 < len(all) && all[i+1].replica == r {
				all[i].next = all[i+1].id
			}
		}
		g.reps = append(g.reps, [2]int{lo, len(all)})
		g.shares = append(g.shares, [2]int{first, shares[r]})
		first += shares[r]
	}
	for _, st := range all {
		a := &proto.Assign{Job: "j", Spec: specJSON, PlanVersion: 1, Prev: st.prev, Next: st.next, ExpertHosts: []proto.ExpertHost{},
			Shard:   proto.Shard{Stage: &proto.StageShard{Index: st.index, Count: st.count, Begin: st.begin, End: st.end, First: st.firstSt, Last: st.lastSt}},
			Replica: &proto.ReplicaAssign{Index: st.replica, Count: len(replicas), First: st.first, MicroBatches: st.n}}
		for _, o := range all {
			shares := o.begin < st.end && st.begin < o.end || o.firstSt && st.firstSt || o.lastSt && st.lastSt
			if o.replica != st.replica && shares {
				a.Replica.Peers = append(a.Replica.Peers, proto.ReducePeer{Worker: o.id, Replica: o.replica, First: o.first,
					MicroBatches: o.n, Begin: o.begin, End: o.end})
			}
		}
		for blk := st.begin; blk < st.end; blk++ {
			for _, e := range hosted[blk] {
				a.ExpertHosts = append(a.ExpertHosts, proto.ExpertHost{Block: blk, Expert: e, Workers: []string{hostOf(blk)}})
			}
		}
		if err := a.Validate(); err != nil {
			t.Fatal(err)
		}
		b, err := buildShard(model.Host{}, spec, a, st.id)
		if err != nil {
			t.Fatal(err)
		}
		b.sh.Init(seed)
		r := b.runner.(*StageRunner)
		r.setNet(g.net.Peer(st.id))
		g.ids = append(g.ids, st.id)
		g.runners = append(g.runners, r)
		g.assigns = append(g.assigns, a)
	}
	// The hosts, as the coordinator assigns them: the stage of their block in every replica.
	for blk, es := range hosted {
		a := &proto.Assign{Job: "j", Spec: specJSON, PlanVersion: 1, ExpertHosts: []proto.ExpertHost{},
			Shard: proto.Shard{Experts: &proto.ExpertShard{Block: blk, Experts: es, StageIndex: 0, StageCount: 1}}}
		for _, st := range all {
			if blk >= st.begin && blk < st.end {
				a.Routers = append(a.Routers, proto.ExpertRouter{Worker: st.id, Replica: st.replica, StageIndex: st.index,
					StageCount: st.count, First: st.first, MicroBatches: st.n})
			}
		}
		if err := a.Validate(); err != nil {
			t.Fatal(err)
		}
		b, err := buildShard(model.Host{}, spec, a, hostOf(blk))
		if err != nil {
			t.Fatal(err)
		}
		b.sh.Init(seed)
		h := b.runner.(*ExpertRunner)
		h.setNet(g.net.Peer(hostOf(blk)))
		g.hosts = append(g.hosts, h)
	}
	return g
}

// step runs one training step: tokens to each replica's first stage, targets to its last, every
// stage on its own goroutine, then the clip from the merged reports.
func (g *replicaRig) step(t *testing.T, s uint64, x, y []int32, B, M, T int, lr, clip float64) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := proto.StepSpec{Step: s, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	for r, sh := range g.shares {
		g.inputs(ctx, t, st, x, y, T, r, sh[0], sh[0]+sh[1])
	}
	reports := make([]*proto.StepReport, len(g.runners)+len(g.hosts))
	errs := make([]error, len(reports))
	var wg sync.WaitGroup
	for i, r := range g.runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = r.RunStep(ctx, st)
		}()
	}
	for k, h := range g.hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[len(g.runners)+k], errs[len(g.runners)+k] = h.RunStep(ctx, st)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("participant %d: %v", i, err)
		}
	}
	// As the coordinator merges them (coordinator.mergeReplicas): losses in micro-batch order,
	// each replica's norms as a report of their own, which must agree.
	merged := &proto.StepReport{}
	blocks := map[int]int{}
	var out []*proto.StepReport
	for _, rr := range g.reps {
		for _, rep := range reports[rr[0]:rr[1]] {
			merged.CE = append(merged.CE, rep.CE...)
			for _, a := range rep.Aux {
				k, ok := blocks[a.Block]
				if !ok {
					k = len(merged.Aux)
					blocks[a.Block] = k
					merged.Aux = append(merged.Aux, proto.BlockAux{Block: a.Block})
				}
				merged.Aux[k].Aux = append(merged.Aux[k].Aux, a.Aux...)
			}
			out = append(out, &proto.StepReport{GradSq: rep.GradSq})
		}
	}
	out = append(out, reports[len(g.runners):]...) // the hosts' norms, once for every replica
	ce, _, norm, err := proto.StepTotals(append(out, merged), M)
	if err != nil {
		t.Fatal(err)
	}
	f := model.ClipFactor(norm, clip)
	for _, r := range g.runners {
		r.Apply(s, lr, f)
	}
	for _, h := range g.hosts {
		h.Apply(s, lr, float32(f))
	}
	return ce
}

// inputs sends micro-batches [lo, hi) of step st's batch (x, y) to replica r, as the coordinator
// does: tokens to its first stage, targets to its last.
func (g *replicaRig) inputs(ctx context.Context, t *testing.T, st proto.StepSpec, x, y []int32, T, r, lo, hi int) {
	t.Helper()
	n := st.Rows * T
	for j := lo; j < hi; j++ {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			t.Fatal(err)
		}
		if err := g.driver.Send(ctx, g.ids[g.reps[r][0]], xt); err != nil {
			t.Fatal(err)
		}
		if err := g.driver.Send(ctx, g.ids[g.reps[r][1]-1], yt); err != nil {
			t.Fatal(err)
		}
	}
}

// sameParams checks every parameter of the runners given (all when none) against ref's, bit for
// bit.
func (g *replicaRig) sameParams(t *testing.T, ref *model.Model, runners ...int) {
	t.Helper()
	if len(runners) == 0 {
		for i := range g.runners {
			runners = append(runners, i)
		}
	}
	for _, i := range runners {
		for _, tt := range g.runners[i].Shard.P.Tensors {
			w := ref.P.Get(tt.Name)
			for k := range w {
				if math.Float32bits(tt.Data[k]) != math.Float32bits(w[k]) {
					t.Fatalf("%s: %s[%d] = %v, one process %v", g.ids[i], tt.Name, k, tt.Data[k], w[k])
				}
			}
		}
	}
}

// trainLikeModel trains steps steps of spec on the rig and on one process side by side (lr 1e-2,
// clip 1), checking every step's loss, and returns the one process's model.
func (g *replicaRig) trainLikeModel(t *testing.T, spec job.Spec, steps int) *model.Model {
	t.Helper()
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	ref, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(spec.Seed)
	for s := range steps {
		x, y := testBatch(t, s, B, T)
		want, err := ref.TrainStep(x, y, B, model.Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: spec.WeightDecay, Clip: 1})
		if err != nil {
			t.Fatal(err)
		}
		if got := g.step(t, uint64(s), x, y, B, M, T, 1e-2, 1); got != want.CE {
			t.Fatalf("step %d: loss %v, one process %v", s, got, want.CE)
		}
	}
	return ref
}

// TestReplicaRunnersEqualModel: two pipeline replicas with different cuts, sharing the step's
// micro-batches 3 to 1, reduce their gradients over the data plane and train exactly as one
// process: the same loss every step and every parameter of every replica bit for bit. Run with
// -race, it is the check of the reduction's goroutines.
func TestReplicaRunnersEqualModel(t *testing.T) {
	spec := testJobSpec(41)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, M := spec.Model, spec.MicroBatches
	g := newReplicaRig(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 2}, {2, 4}}, {{0, 1}, {1, 4}}}, []int{3, 1})
	defer g.net.Close()
	ref := g.trainLikeModel(t, spec, 3)
	g.sameParams(t, ref)
}

// TestReplicaRunnersExpertHostEqualModel: two pipeline replicas sharing expert hosts — block 1's
// experts 0 and 3 on one, block 3's expert 2 on another, each serving the stage of its block in
// both replicas, whose micro-batches reach it interleaved — train exactly as one process: every
// loss, and every parameter of every stage and host, bit for bit. Under -race it checks the host's
// goroutines, one per replica's stage.
func TestReplicaRunnersExpertHostEqualModel(t *testing.T) {
	spec := testJobSpec(42)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, M := spec.Model, spec.MicroBatches
	g := newReplicaRigHosts(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 2}, {2, 4}}, {{0, 1}, {1, 4}}}, []int{2, 2},
		map[int][]int{1: {0, 3}, 3: {2}})
	defer g.net.Close()
	ref := g.trainLikeModel(t, spec, 3)
	shards := map[string]*model.Params{}
	for i, r := range g.runners {
		shards[g.ids[i]] = r.Shard.P
	}
	for k, h := range g.hosts {
		shards[fmt.Sprintf("host %d", k)] = h.Shard.P
	}
	for who, p := range shards {
		for _, tt := range p.Tensors {
			w := ref.P.Get(tt.Name)
			for k := range w {
				if math.Float32bits(tt.Data[k]) != math.Float32bits(w[k]) {
					t.Fatalf("%s: %s[%d] = %v, one process %v", who, tt.Name, k, tt.Data[k], w[k])
				}
			}
		}
	}
	if len(g.hosts) != 2 {
		t.Fatalf("%d hosts", len(g.hosts))
	}
}

// gatedNet holds back the tokens of one micro-batch until the stage has sent a given gradient
// node: a stage that sent its nodes only after its last backward would never get them.
type gatedNet struct {
	Transport
	gate proto.TensorKey // the tokens held back
	node [2]int          // the node that opens the gate
	open chan struct{}
	once sync.Once
}

func (g *gatedNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	if k, err := proto.ParseGradReduceKey(t.Key); err == nil && k.Lo == g.node[0] && k.Hi == g.node[1] {
		g.once.Do(func() { close(g.open) })
	}
	return g.Transport.Send(ctx, to, t)
}

func (g *gatedNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	if key == g.gate {
		select {
		case <-g.open:
		case <-ctx.Done():
			return proto.Tensor{}, fmt.Errorf("node %v was not sent before micro-batch %d's tokens were read: the exchange does not overlap the step", g.node, key.MicroBatch)
		}
	}
	return g.Transport.Recv(ctx, key)
}

// TestReplicaExchangeOverlaps: a replica computing micro-batches 0–2 of 4 sends its node [0,2)
// as soon as micro-batch 1's backward is done — before it even reads micro-batch 2's tokens —
// and the step still equals one process's.
func TestReplicaExchangeOverlaps(t *testing.T) {
	spec := testJobSpec(43)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	g := newReplicaRig(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 4}}, {{0, 4}}}, []int{3, 1})
	defer g.net.Close()
	st := proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	g.runners[0].Net = &gatedNet{Transport: g.runners[0].Net, gate: proto.TokensKey(st, 2), node: [2]int{0, 2}, open: make(chan struct{})}
	ref, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(spec.Seed)
	x, y := testBatch(t, 0, B, T)
	want, err := ref.TrainStep(x, y, B, model.Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: spec.WeightDecay, Clip: 1})
	if err != nil {
		t.Fatal(err)
	}
	if got := g.step(t, 0, x, y, B, M, T, 1e-2, 1); got != want.CE {
		t.Fatalf("loss %v, one process %v", got, want.CE)
	}
}
