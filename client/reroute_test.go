//go:build !js

package client

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestRerouteEqualsModel: three step-mode replicas — two stages, one, two — share a step 2:1:1;
// the middle one is lost and the two beside it take its micro-batch (proto.StepReroute). The
// survivors end the step with the single process's loss and parameters, bit for bit, whether the
// reroute reaches them before their step, while they wait for the lost replica's gradient nodes
// (it never ran), or after they reported the step with its nodes (it ran, then left before the
// clip: they take the reroute up again, StageRunner.Reroute); and a recomputation of a rerouted stage's step from
// what it received (proto.StepSpec.Reroutes) sends and reports what it did.
func TestRerouteEqualsModel(t *testing.T) {
	for _, when := range []string{"before the step", "while it waits", "after the report", "after it sent its nodes"} {
		t.Run(when, func(t *testing.T) { testReroute(t, when) })
	}
}

func testReroute(t *testing.T, when string) {
	g := newRerouteRig(t, 43, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 1}, {1, 4}}}, []int{2, 1, 1})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The survivors: replicas 0 and 2, whose stages are runners 0, 1 and 3, 4.
	survivors := []int{0, 1, 3, 4}
	lost := 2
	m := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 1,
		Shares: []proto.ReplicaShare{{Replica: 0, First: 0, MicroBatches: 3}, {Replica: 2, First: 3, MicroBatches: 1}}}
	for _, i := range survivors {
		g.runners[i].reroutes = newRerouteBox(1)
		g.runners[i].reroutes.begin(0)
	}
	// Recorded as a worker records a step's traffic when its job audits (stepNet).
	recs := map[int]*stepNet{}
	for _, i := range survivors {
		inner := g.runners[i].Net
		if when == "after it sent its nodes" {
			// The lost replica computes its micro-batch and sends its nodes, then is gone
			// before it takes the survivors': every send to it fails.
			inner = &sendsFail{Transport: inner, to: g.ids[lost]}
		}
		recs[i] = &stepNet{inner: inner}
		g.runners[i].setNet(recs[i])
		recs[i].begin()
	}
	g.send(ctx, t, 0, 0, 2)
	g.send(ctx, t, 2, 3, 4)
	var reports []*proto.StepReport
	if when == "after the report" {
		g.send(ctx, t, 1, 2, 3)
		reports = g.run(t, append(survivors, lost), func(i int) (*proto.StepReport, error) { return g.runners[i].RunStep(ctx, g.st) })
		for _, i := range survivors {
			if reports[i].Reroutes != 0 {
				t.Fatalf("%s reported %d reroutes before any", g.ids[i], reports[i].Reroutes)
			}
			g.runners[i].reroutes.end()
		}
		g.send(ctx, t, 0, 2, 3)
		again := g.run(t, survivors, func(i int) (*proto.StepReport, error) { return g.runners[i].Reroute(ctx, m) })
		for _, i := range survivors {
			reports[i] = again[i]
		}
	} else {
		g.send(ctx, t, 0, 2, 3)
		if when == "after it sent its nodes" {
			g.send(ctx, t, 1, 2, 3)
			lctx, lcancel := context.WithCancel(ctx)
			defer lcancel()
			go g.runners[lost].RunStep(lctx, g.st) // waits for the survivors' nodes until the end
		}
		offer := func() {
			for _, i := range survivors {
				if !g.runners[i].reroutes.offer(m) {
					t.Errorf("%s's step took no reroute", g.ids[i])
				}
			}
		}
		if when == "before the step" {
			offer()
		} else {
			// Once every survivor has sent the lost replica a gradient node: each has then
			// finished its own micro-batches and waits for the lost replica's nodes, which never
			// come (it never runs), until the reroute interrupts the wait. After it sent its
			// nodes, the reroute comes a while later: a survivor that has its gradient by then
			// would report its failed sends as the step's failure, but waits for the reroute
			// (reducer.unanswered); one that is slower takes it up while it waits for nodes.
			var settle time.Duration
			if when == "after it sent its nodes" {
				settle = 300 * time.Millisecond
			}
			go func() {
				for !g.sentTo(recs, survivors, g.ids[lost], proto.KindGradReduce) {
					select {
					case <-ctx.Done():
						return
					case <-time.After(5 * time.Millisecond):
					}
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(settle):
				}
				offer()
			}()
		}
		reports = g.run(t, survivors, func(i int) (*proto.StepReport, error) { return g.runners[i].RunStep(ctx, g.st) })
	}
	// What a recomputation of a survivor's step does from what it received: the same sends, the
	// same report.
	for _, i := range survivors {
		recv, sent := recs[i].end()
		b, err := buildShard(model.Host{}, g.spec, g.assigns[i], g.ids[i])
		if err != nil {
			t.Fatal(err)
		}
		b.sh.Init(g.spec.Seed)
		net := newReplayNet(recv)
		b.runner.setNet(net)
		rst := g.st
		rst.Reroutes = [][]proto.ReplicaShare{m.Shares}
		rep, err := b.runner.RunStep(ctx, rst)
		if err != nil {
			t.Fatalf("%s recomputed: %v", g.ids[i], err)
		}
		if len(net.sent) != len(sent) {
			t.Fatalf("%s: the recomputation sent %d tensors, the stage %d", g.ids[i], len(net.sent), len(sent))
		}
		have := map[[2]string]bool{}
		for _, s := range sent {
			have[[2]string{s.To, proto.KeyID(s.T.Key) + audit.TensorDigest(s.T)}] = true
		}
		for _, s := range net.sent {
			if !have[[2]string{s.To, proto.KeyID(s.T.Key) + audit.TensorDigest(s.T)}] {
				t.Fatalf("%s: the recomputation sent %v to %s, which the stage did not", g.ids[i], s.T.Key, s.To)
			}
		}
		if rep.Reroutes != 1 || len(rep.CE) != len(reports[i].CE) {
			t.Fatalf("%s: recomputed report %+v, the stage's %+v", g.ids[i], rep, reports[i])
		}
	}
	g.finish(t, survivors, reports, 1)
}

// TestRerouteRefused: a reroute the coordinator could not have meant — one that takes micro-batches
// away from this stage's replica, leaves it out, or skips an attempt — fails the step here with
// what was wrong, rather than computing something no other stage computes.
func TestRerouteRefused(t *testing.T) {
	share := func(r, first, n int) proto.ReplicaShare {
		return proto.ReplicaShare{Replica: r, First: first, MicroBatches: n}
	}
	for _, tc := range []struct {
		name    string
		attempt int
		shares  []proto.ReplicaShare
		want    string
	}{
		{"takes micro-batches away", 1, []proto.ReplicaShare{share(0, 0, 1), share(2, 1, 3)}, "fewer than its"},
		{"leaves the replica out", 1, []proto.ReplicaShare{share(2, 0, 4)}, "leaves this stage's replica 0 out"},
		{"skips an attempt", 2, []proto.ReplicaShare{share(0, 0, 3), share(2, 3, 1)}, "reroute 2 after 0"},
		{"tiles another step", 1, []proto.ReplicaShare{share(0, 0, 3), share(2, 3, 2)}, "end at 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newRerouteRig(t, 43, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 1}, {1, 4}}}, []int{2, 1, 1})
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			g.send(ctx, t, 0, 0, 2)
			m := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: tc.attempt, Shares: tc.shares}
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for i := range 2 {
				r := g.runners[i]
				r.reroutes = newRerouteBox(1)
				r.reroutes.begin(0)
				r.reroutes.offer(m)
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[i] = r.RunStep(ctx, g.st)
				}()
			}
			wg.Wait()
			for i, err := range errs {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("%s: %v, want an error saying %q", g.ids[i], err, tc.want)
				}
			}
		})
	}
}

// TestRerouteTwice: four replicas share a step 1:1:1:1 and the two in the middle are lost one
// after the other: the survivors take the first reroute's widened runs, then the second's, each
// after the legs the one before added (attempts 1 and 2), and end the step with the single
// process's loss and parameters, bit for bit.
func TestRerouteTwice(t *testing.T) {
	g := newRerouteRig(t, 47, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 4}}, {{0, 3}, {3, 4}}}, []int{1, 1, 1, 1})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	share := func(r, first, n int) proto.ReplicaShare {
		return proto.ReplicaShare{Replica: r, First: first, MicroBatches: n}
	}
	// Replica 1 goes first, its micro-batch to replica 0; then replica 2, whose micro-batch goes
	// to replica 3.
	first := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 1, Shares: []proto.ReplicaShare{share(0, 0, 2), share(2, 2, 1), share(3, 3, 1)}}
	second := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 2, Shares: []proto.ReplicaShare{share(0, 0, 2), share(3, 2, 2)}}
	survivors := []int{0, 1, 4, 5} // replica 0's two stages, replica 3's two
	for _, i := range survivors {
		g.runners[i].reroutes = newRerouteBox(1)
		g.runners[i].reroutes.begin(0)
		g.runners[i].reroutes.offer(first)
		g.runners[i].reroutes.offer(second)
	}
	g.send(ctx, t, 0, 0, 2)
	g.send(ctx, t, 3, 2, 4)
	reports := g.run(t, survivors, func(i int) (*proto.StepReport, error) { return g.runners[i].RunStep(ctx, g.st) })
	g.finish(t, survivors, reports, 2)
}

// rerouteRig is a replicaRig for one step of a job of seed, and that step's single-process
// result (ref after it, want its report): replicas and shares as newReplicaRig's, B 8, M 4.
type rerouteRig struct {
	*replicaRig
	spec job.Spec
	ref  *model.Model
	want model.StepResult
	x, y []int32
	st   proto.StepSpec
}

func newRerouteRig(t *testing.T, seed uint64, replicas [][][2]int, shares []int) *rerouteRig {
	t.Helper()
	spec := testJobSpec(seed)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	g := &rerouteRig{replicaRig: newReplicaRig(t, raw, M, cfg, spec.Seed, replicas, shares), spec: spec,
		st: proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: M, Rows: B / M}}
	t.Cleanup(g.net.Close)
	if g.ref, err = model.NewModel(cfg); err != nil {
		t.Fatal(err)
	}
	g.ref.Init(spec.Seed)
	g.x, g.y = testBatch(t, 0, B, T)
	if g.want, err = g.ref.TrainStep(g.x, g.y, B, model.Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: spec.WeightDecay, Clip: 1}); err != nil {
		t.Fatal(err)
	}
	return g
}

// send sends micro-batches [lo, hi) of the step's batch to replica r.
func (g *rerouteRig) send(ctx context.Context, t *testing.T, r, lo, hi int) {
	t.Helper()
	g.inputs(ctx, t, g.st, g.x, g.y, g.spec.Model.BlockSize, r, lo, hi)
}

// run runs f for the runners idx at once, each on its own goroutine, and returns their reports;
// any error fails the test.
func (g *rerouteRig) run(t *testing.T, idx []int, f func(i int) (*proto.StepReport, error)) []*proto.StepReport {
	t.Helper()
	reports := make([]*proto.StepReport, len(g.runners))
	errs := make([]error, len(g.runners))
	var wg sync.WaitGroup
	for _, i := range idx {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = f(i)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", g.ids[i], err)
		}
	}
	return reports
}

// finish totals the survivors' reports (each including reroutes reroutes) as the coordinator
// does, checks the loss against the single process's, applies the clip factor and checks every
// parameter, bit for bit.
func (g *rerouteRig) finish(t *testing.T, survivors []int, reports []*proto.StepReport, reroutes int) {
	t.Helper()
	var ces []float64
	var out []*proto.StepReport
	for _, i := range survivors {
		rep := reports[i]
		if rep.Reroutes != reroutes {
			t.Errorf("%s reported %d reroutes, want %d", g.ids[i], rep.Reroutes, reroutes)
		}
		ces = append(ces, rep.CE...)
		out = append(out, &proto.StepReport{GradSq: rep.GradSq})
	}
	ce, _, norm, err := proto.StepTotals(append(out, &proto.StepReport{CE: ces}), g.st.MicroBatches)
	if err != nil {
		t.Fatal(err)
	}
	if ce != g.want.CE {
		t.Fatalf("loss %v, one process %v", ce, g.want.CE)
	}
	f := model.ClipFactor(norm, 1)
	for _, i := range survivors {
		g.runners[i].Apply(0, 1e-2, f)
	}
	g.sameParams(t, g.ref, survivors...)
}

// sendsFail is a transport whose sends to one peer fail as to a peer whose link closed.
type sendsFail struct {
	Transport
	to string
}

func (n *sendsFail) Send(ctx context.Context, to string, t proto.Tensor) error {
	if to == n.to {
		return &PeerError{Peer: to, Err: ErrPeerGone}
	}
	return n.Transport.Send(ctx, to, t)
}

// sentTo reports whether each of the runners whose traffic recs records has sent to a tensor of
// kind.
func (g *rerouteRig) sentTo(recs map[int]*stepNet, runners []int, to string, kind proto.Kind) bool {
	for _, i := range runners {
		n := recs[i]
		n.mu.Lock()
		found := slices.ContainsFunc(n.sent, func(s audit.Sent) bool { return s.To == to && s.T.Key.Kind == kind })
		n.mu.Unlock()
		if !found {
			return false
		}
	}
	return true
}

// TestTakeoverRedirect: a stage takeover offered while the step is in flight redirects the
// step's route at once — the neighbour it names is replaced by the taker, which is sent, once
// each, what was sent the lost stage — and the step's report waits for those resends (flush);
// one offered after the step reported is not taken here (the executor re-enters the step, its
// traffic recorded again, and redirects then), nor is one of another step; one naming another
// stage's neighbour changes nothing.
func TestTakeoverRedirect(t *testing.T) {
	net := NewMemNetwork()
	box := newRerouteBox(1)
	box.begin(7)
	rt := &route{prev: "u", next: "lost", log: true, ctx: context.Background(), net: net.Peer("me"), box: box}
	if got := box.attach(7, rt); len(got) != 0 {
		t.Fatalf("takeovers before any: %v", got)
	}
	key := func(mb int) proto.TensorKey { return actKey(proto.StepSpec{Step: 7, PlanVersion: 1}, mb, 2) }
	for mb := range 2 {
		if err := rt.send(context.Background(), net.Peer("me"), true, proto.Tensor{Key: key(mb), DType: proto.F32, Data: make([]byte, 4)}); err != nil {
			t.Fatal(err)
		}
	}
	tk := &proto.StageTakeover{Begin: 2, End: 4, Replica: 1, Lost: "lost", Taker: "taker", Prev: "me", First: 2, MicroBatches: 2}
	other := *tk
	other.Lost, other.Prev = "x", "y"
	m := func(step uint64, tk *proto.StageTakeover) *proto.StepReroute {
		return &proto.StepReroute{Step: step, PlanVersion: 1, Attempt: 1, Shares: []proto.ReplicaShare{{Replica: 0, First: 0, MicroBatches: 4}}, Stage: tk}
	}
	if box.offer(m(8, tk)) || rt.replaced("lost") {
		t.Fatal("a takeover of another step was taken")
	}
	if !box.offer(m(7, &other)) || rt.replaced("lost") || rt.next != "lost" {
		t.Fatal("a takeover of another stage's neighbour changed the route")
	}
	if !box.offer(m(7, tk)) || !rt.replaced("lost") || rt.next != "taker" {
		t.Fatalf("the takeover in flight did not redirect: next %q", rt.next)
	}
	if err := rt.flush(); err != nil {
		t.Fatal(err)
	}
	if err := rt.send(context.Background(), net.Peer("me"), true, proto.Tensor{Key: key(2), DType: proto.F32, Data: make([]byte, 4)}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	taker := net.Peer("taker")
	for mb := range 3 {
		if _, err := taker.Recv(ctx, key(mb)); err != nil {
			t.Fatalf("the taker's micro-batch %d: %v", mb, err)
		}
	}
	// After the report: not taken here.
	box.take()
	if more := box.end(); len(more) != 0 {
		t.Fatalf("end: %v", more)
	}
	rt2 := &route{prev: "u2", next: "lost2", log: true, ctx: context.Background(), net: net.Peer("me"), box: box}
	box.begin(9)
	box.attach(9, rt2)
	box.take()
	box.end()
	tk2 := *tk
	tk2.Lost = "lost2"
	if box.offer(m(9, &tk2)) || rt2.replaced("lost2") {
		t.Fatal("a takeover of a step reported already was taken by the reader")
	}
}
