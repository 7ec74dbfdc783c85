package coordinator

import (
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// TestJoinKeepsHolders is make churn's join replan in step mode. One replica of two stages runs
// (its twin replica was dropped); a worker joins, and the planner's plan of two replicas of two
// stages — the same cuts — puts w0, which holds blocks [0,2), on the second replica's [0,2), and
// w1, which holds [2,4), on the first replica's [0,2): no stage has a twin that keeps its blocks,
// so the plan could only be taken from a checkpoint. Moved among its stages so that w0 and w1
// stay on their blocks (keepHolders), it is a grow: the newcomers take their stages from them.
// And a plan that only moved the workers running now keeps the plan.
func TestJoinKeepsHolders(t *testing.T) {
	spec := tinyJob(t, 4)
	def := job.Default()
	spec.Model, spec.BatchSize, spec.MicroBatches = def.Model, def.BatchSize, def.MicroBatches
	M, L := spec.MicroBatches, spec.Model.NLayer
	j := churnJob(t, spec, []float64{150, 150, 150, 150}, 8<<30)
	j.phase = phaseTraining
	j.hosts = nil
	j.stages = []placement{{peer: "w0", begin: 0, end: L / 2, n: M}, {peer: "w1", begin: L / 2, end: L, n: M}}
	j.reps = replicaRuns(j.stages)
	planned := []placement{
		{peer: "w1", begin: 0, end: L / 2, replica: 0, n: M / 2}, {peer: "w2", begin: L / 2, end: L, replica: 0, n: M / 2},
		{peer: "w0", begin: 0, end: L / 2, replica: 1, first: M / 2, n: M / 2}, {peer: "w3", begin: L / 2, end: L, replica: 1, first: M / 2, n: M / 2},
	}
	if j.growable(planned, nil, nil, false) != nil {
		t.Fatal("the planner's plan is growable as it is: the test does not test the move")
	}
	kept, g := stepRule{}.joins(j, []string{"w2", "w3"}, planned, nil, nil, "the planner's")
	if kept || g == nil {
		t.Fatalf("plan kept %v, growth %v: want a grow", kept, g)
	}
	if !strings.Contains(g.choice, "holders stay on their blocks") {
		t.Errorf("choice %q does not say the workers were moved", g.choice)
	}
	for _, st := range g.stages {
		if b, ok := heldBy(j.stages)[st.peer]; ok && b != [2]int{st.begin, st.end} {
			t.Errorf("holder %s moved from %v to [%d,%d)", st.peer, b, st.begin, st.end)
		}
	}
	if from := g.from; len(from) != 2 || len(from["w2"]) == 0 || len(from["w3"]) == 0 {
		t.Errorf("takers %v, want w2 and w3 each from a holder", from)
	}
	shares := 0
	for _, rr := range replicaRuns(g.stages) {
		shares += rr.n
	}
	if shares != M {
		t.Errorf("the grown plan's shares cover %d of %d micro-batches", shares, M)
	}
	t.Log("grown:", slices.Sorted(maps.Keys(g.from)), g.choice)

	// The planner's one pipeline over a standby and w1 (make churn's: the holder of [0,2) left
	// out for a worker a little faster): with w0 kept in its place it is the running plan.
	other := []placement{{peer: "w2", begin: 0, end: L / 2, n: M}, {peer: "w1", begin: L / 2, end: L, n: M}}
	if kept, g := (stepRule{}).joins(j, []string{"w3"}, other, nil, []string{"w0", "w3"}, ""); !kept || g != nil {
		t.Errorf("a plan leaving a holder out for a like worker: kept %v, growth %v; want the plan kept", kept, g)
	}

	// The planner swapped the two holders and placed nobody new: the joiners stand by.
	swapped := []placement{{peer: "w1", begin: 0, end: L / 2, n: M}, {peer: "w0", begin: L / 2, end: L, n: M}}
	if kept, g := (stepRule{}).joins(j, []string{"w2"}, swapped, nil, []string{"w2", "w3"}, ""); !kept || g != nil {
		t.Errorf("a plan of the running workers swapped: kept %v, growth %v; want the plan kept", kept, g)
	}
}

// TestMaxGiveAgrees: the simulator bounds a giver's takers as the wire does (sched.Givers).
func TestMaxGiveAgrees(t *testing.T) {
	if sched.MaxGive != proto.MaxGive {
		t.Errorf("sched.MaxGive %d, proto.MaxGive %d: the simulator and the coordinator would hand over differently", sched.MaxGive, proto.MaxGive)
	}
}
