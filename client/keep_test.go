//go:build !js

package client

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// onePlan places the whole tiny model on worker w under plan version.
func onePlan(t *testing.T, p *testPlan, w string, version uint32) *proto.Assign {
	t.Helper()
	raw, err := json.Marshal(p.spec)
	if err != nil {
		t.Fatal(err)
	}
	return &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: version, ExpertHosts: []proto.ExpertHost{},
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}}}
}

// TestSessionKeepsItsShard: a worker trains two steps under plan 1, then is told to keep its
// shard into plan 2 (proto.Keep) — as the survivors of a reshare are — and trains on: the losses
// are the single process's, as if the plan had never changed. A keep it cannot honour — from a
// plan older than the one it holds, at a step its shard is not at, another shard — is refused with an error for
// that plan, the worker staying connected and its shard untouched: a coordinator's mistake (or a
// hostile one's) never makes it train from a state it does not have. Nor does an assignment
// superseded halfway, which must leave the step the held shard is at as it was.
func TestSessionKeepsItsShard(t *testing.T) {
	h := newTestHub(t)
	w := h.join("w-0")
	spec := testJobSpec(5)
	p := &testPlan{spec: spec, version: 1, stages: []string{"w-0"}, assigns: map[string]*proto.Assign{}}
	p.assigns["w-0"] = onePlan(t, p, "w-0", 1)
	h.start(p)
	want := referenceLosses(t, spec, nil, nil, 4)
	step := func(s int) {
		t.Helper()
		x, y := testBatch(t, s, spec.BatchSize, spec.Model.BlockSize)
		ce, err := h.trainStep(p, uint64(s), x, y)
		if err != nil {
			t.Fatal(err)
		}
		if ce != want[s] {
			t.Fatalf("step %d under plan %d: loss %v, one process %v", s, p.version, ce, want[s])
		}
	}
	step(0)
	step(1)
	refused := func(name string, a *proto.Assign, says string) {
		t.Helper()
		h.send("w-0", a)
		m := h.next()
		e, ok := m.m.(*proto.Error)
		if !ok || e.PlanVersion != a.PlanVersion || !strings.Contains(e.Message, says) {
			t.Fatalf("%s: answered %s %v, want an error for plan %d saying %q", name, m.m.Type(), m.m, a.PlanVersion, says)
		}
	}
	wrongStep := onePlan(t, p, "w-0", 2)
	wrongStep.Keep = &proto.Keep{FromPlan: 1, Step: 3}
	refused("another step", wrongStep, "has 2 updates, not 3")
	half := onePlan(t, p, "w-0", 4)
	half.Keep = &proto.Keep{FromPlan: 1, Step: 2}
	half.Shard.Stage.End, half.Shard.Stage.Count, half.Shard.Stage.Last, half.Next = 2, 2, false, "w-1"
	refused("another shard", half, "blocks [0,4), not [0,2)")
	keep := onePlan(t, p, "w-0", 5)
	keep.Keep = &proto.Keep{FromPlan: 1, Step: 2}
	h.send("w-0", keep)
	if m := h.next(); m.m.Type() != proto.TypeReady {
		t.Fatalf("the keep answered with %s %v, want ready", m.m.Type(), m.m)
	}
	p.version = 5
	step(2)
	stale := onePlan(t, p, "w-0", 6)
	stale.Keep = &proto.Keep{FromPlan: 1, Step: 3}
	refused("an older plan", stale, "under plan 5")
	step(3)
	// An assignment superseded halfway — initialised from the seed, then waiting for a neighbour
	// that never comes — leaves the shard held at the step it was: a keep that names the seed's
	// step is refused, not taken for the shard at step 4.
	half = twoStagePlan(t, spec, "w-0", "w-1", false).assigns["w-0"]
	half.PlanVersion = 7
	h.send("w-0", half)
	waitFor(t, "plan 7's data plane", func() bool { // opened once its shard is initialised
		return w.plane.Load().version == 7
	})
	seed := onePlan(t, p, "w-0", 8)
	seed.Keep = &proto.Keep{FromPlan: 7, Step: 0}
	refused("the superseded plan's step", seed, "has 4 updates, not 0")
}

// TestSessionAssignSupersedesConnect: a worker whose assignment waits to connect to a neighbour
// that never comes (it left while the plan loaded) takes the next plan as soon as it arrives,
// rather than after its ICE timeout (ten minutes here), and says nothing of the plan abandoned.
func TestSessionAssignSupersedesConnect(t *testing.T) {
	h := newTestHub(t)
	h.joinWith("w-0", func(cfg *WorkerConfig, _ *proto.Hello) { cfg.ICETimeout = 10 * time.Minute })
	p := twoStagePlan(t, testJobSpec(1), "w-0", "w-1", false)
	h.send("w-0", p.assigns["w-0"]) // w-1 never joins
	next := onePlan(t, p, "w-0", 2)
	h.send("w-0", next)
	m := h.next()
	if r, ok := m.m.(*proto.Ready); !ok || r.PlanVersion != 2 {
		t.Fatalf("answered %s %v, want ready for plan 2", m.m.Type(), m.m)
	}
}

// TestKeepableOuter: an outer-mode stage keeps its shard (a grow: grow.go's outerGrowable) only
// as the same replica, at the step it holds, with no delayed outer step left to take up, and never
// after its last outer exchange failed or was refused part-way — its parameters then hold the new
// global θ in some segments and the old one in others.
func TestKeepableOuter(t *testing.T) {
	spec := testJobSpec(36)
	spec.BatchSize, spec.MicroBatches = 8, 4
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 2, OuterLR: 0.7, OuterMomentum: 0.9}
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	L := spec.Model.NLayer
	a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, ExpertHosts: []proto.ExpertHost{},
		Replica: &proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, Peers: []proto.ReducePeer{
			{Worker: "b", Replica: 1, First: 2, MicroBatches: 2, Begin: 0, End: L}}},
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: L, First: true, Last: true}}}
	b, err := buildShard(model.Host{}, spec, a, "a")
	if err != nil {
		t.Fatal(err)
	}
	s := &session{assign: a, runner: b.runner, next: 6}
	keep := func(index int) *proto.Assign {
		k := *a
		k.PlanVersion, k.Keep = 4, &proto.Keep{FromPlan: 3, Step: 6}
		r := *a.Replica
		r.Index = index
		k.Replica = &r
		return &k
	}
	if _, err := s.keepable(spec, keep(0)); err != nil {
		t.Fatalf("the same replica at its step: %v", err)
	}
	if _, err := s.keepable(spec, keep(1)); err == nil || !strings.Contains(err.Error(), "replica 0's, not 1's") {
		t.Errorf("another replica's place: %v", err)
	}
	r := b.runner.(*StageRunner)
	r.Outer.pending = &pendingOuter{step: 5, takeUp: 6}
	if _, err := s.keepable(spec, keep(0)); err == nil || !strings.Contains(err.Error(), "pending") {
		t.Errorf("a delayed outer step pending: %v", err)
	}
	r.Outer.pending = nil
	s.outerBroken = 3
	if _, err := s.keepable(spec, keep(0)); err == nil || !strings.Contains(err.Error(), "did not complete") {
		t.Errorf("after a failed outer exchange: %v", err)
	}
}

// TestKeepableWarmingOut: at the end of an outer-mode job's synchronous warm-up a step-mode
// replica's stage keeps its shard into outer mode — the assignment's spec the job's, the held
// one its warm-up phase (job.Spec.Phase), at step W exactly. A coordinator cannot use that to
// carry a shard across any other change of spec: another learning rate, another step, or a
// job without a warm-up are refused.
func TestKeepableWarmingOut(t *testing.T) {
	spec := testJobSpec(36)
	spec.BatchSize, spec.MicroBatches = 8, 4
	w := 6
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 2, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Warmup: &w}
	warm := spec.Phase(0)
	raw := func(s job.Spec) json.RawMessage {
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	L := spec.Model.NLayer
	a := &proto.Assign{Job: "j", Spec: raw(warm), PlanVersion: 3, ExpertHosts: []proto.ExpertHost{},
		Replica: &proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, Peers: []proto.ReducePeer{
			{Worker: "b", Replica: 1, First: 2, MicroBatches: 2, Begin: 0, End: L}}},
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: L, First: true, Last: true}}}
	b, err := buildShard(model.Host{}, warm, a, "a")
	if err != nil {
		t.Fatal(err)
	}
	s := &session{assign: a, runner: b.runner, next: 6}
	keep := func(to job.Spec, step uint64) *proto.Assign {
		k := *a
		k.Spec, k.PlanVersion, k.Keep = raw(to), 4, &proto.Keep{FromPlan: 3, Step: step}
		return &k
	}
	if _, err := s.keepable(spec, keep(spec, 6)); err != nil {
		t.Fatalf("the warm-up's end: %v", err)
	}
	other := spec
	other.LR *= 2
	if _, err := s.keepable(other, keep(other, 6)); err == nil {
		t.Error("kept across a change of learning rate")
	}
	s.next = 5
	if _, err := s.keepable(spec, keep(spec, 5)); err == nil {
		t.Error("kept into outer mode before the warm-up's end")
	}
	s.next = 6
	none := spec
	y := *spec.Sync
	y.Warmup = new(int)
	none.Sync = &y
	if _, err := s.keepable(none, keep(none, 6)); err == nil {
		t.Error("kept into a job without a warm-up")
	}
}
