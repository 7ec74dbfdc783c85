package coordinator

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// TestRebalanceByPace: an unpinned step-mode job whose planner chose two whole-model replicas, one
// of whose workers reports eight times its compute time (client.FaultFalsePace: a worker claiming
// a slower machine than it has — to the coordinator's reports, exactly a slow one). Once the plan's
// paces are measured the micro-batches follow them: the job shares them again at a step boundary,
// the claimed-slow replica keeping one, every stage keeping its state — no checkpoint, no restore
// — and the run's losses are the single process's bit for bit, as whoever computes a micro-batch
// the step's gradient is the same tree. Whether the coordinator's clock then finds the step faster
// (and keeps the shares) or not (and undoes them, rebalancing off) depends on how busy the machine
// is, and either way the bits are the single process's.
func TestRebalanceByPace(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: trains a job")
	}
	// Steps enough for the change to repay its estimated cost (two steps) four times over with
	// room to spare: a rebalance after about 7 steps saves half a step each step after.
	spec := tinyJob(t, 40)
	spec.MicroBatches = 4
	spec.AuditRate = 0
	log := watch(t, "plan", "work.rebalanced", "work.rebalance_undone", "step.abandoned", "replan.join", "replan.measured")
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		cfg.GFLOPS = 1 // compute, not the gradient exchange, dominates the planner's estimate
		if i == 1 {
			cfg.Fault = client.FaultFalsePace
		}
	})
	c.run(t)
	c.finished(t, spec.Steps)
	plans := log.planList()
	if len(plans) == 0 || plans[0].Replicas != 2 {
		t.Fatalf("first plan %+v: want two replicas chosen by the planner", plans)
	}
	rb := log.of("work.rebalanced")
	if len(rb) == 0 {
		t.Fatalf("no rebalance; plans %+v", plans)
	}
	var ev struct {
		Before [][2]int `json:"micro_batches_before"`
		After  [][2]int `json:"micro_batches"`
	}
	if err := json.Unmarshal([]byte(strings.TrimSpace(strings.TrimPrefix(rb[0], " "))), &ev); err != nil {
		t.Fatalf("event %q: %v", rb[0], err)
	}
	// The replica on w1 (claiming to be slow) computes one micro-batch after the rebalance.
	var slow int = -1
	for _, st := range plans[0].Stages {
		if st.Peer == "w1" {
			slow = st.Replica
		}
	}
	if slow < 0 || len(ev.After) != 2 || ev.After[slow][1]-ev.After[slow][0] != 1 || ev.Before[slow][1]-ev.Before[slow][0] < 2 {
		t.Fatalf("rebalance %s: want the replica of w1 (%d) down to one micro-batch", rb[0], slow)
	}
	for _, p := range plans[1:] {
		if !strings.Contains(p.Choice, "measured pace") && !strings.Contains(p.Choice, "undone") {
			t.Errorf("a plan other than a rebalance: %+v", p)
		}
	}
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	t.Logf("rebalanced: %s; undone: %v", rb[0], log.of("work.rebalance_undone"))
	want, _ := localReports(t, spec)
	sameReports(t, c.reports, want)
}

// TestRebalanceUndone: the pace tracker's account of a rebalance, driven with measured steps given
// by hand on a job run of a real coordinator. Two replicas of two micro-batches each, one of them
// three times slower: a rebalance is due (3 and 1). A rebalanced plan whose steps are then no
// faster on the coordinator's clock than before is undone at the next boundary and rebalancing
// turns off — what bounds a worker that falsifies its timings (client.FaultFalsePace) to one
// rebalance's worth of slower steps; one whose steps got faster keeps its shares and may follow
// the paces again.
func TestRebalanceUndone(t *testing.T) {
	for _, faster := range []bool{false, true} {
		t.Run(fmt.Sprintf("faster=%v", faster), func(t *testing.T) {
			spec := tinyJob(t, 100)
			j := churnJob(t, spec, []float64{10, 10}, 1<<30)
			j.sync, j.phase, j.hosts = stepRule{}, phaseTraining, nil
			j.stages = []placement{{peer: "w0", begin: 0, end: 4, replica: 0, first: 0, n: 2}, {peer: "w1", begin: 0, end: 4, replica: 1, first: 2, n: 2}}
			j.reps = replicaRuns(j.stages)
			j.pace = paceTrack{}
			// step runs a timed step: replica r computing pace[r] seconds a micro-batch, the step
			// taking wall seconds on the coordinator's clock.
			s := 0
			step := func(pace []float64, wall float64) {
				reports := make([]*proto.StepReport, len(j.stages))
				elapsed := make([]time.Duration, len(j.stages))
				for k, st := range j.stages {
					c := time.Duration(pace[k] * float64(st.n) * float64(time.Second))
					reports[k] = &proto.StepReport{Timings: proto.Timings{ForwardNS: int64(c) / 3, BackwardNS: int64(c) - int64(c)/3}}
					elapsed[k] = time.Duration(wall * float64(time.Second))
				}
				j.planSteps++
				j.samplePace(s, reports, elapsed)
				s++
			}
			for range warmupSteps + paceWindow - 1 {
				step([]float64{0.1, 0.3}, 0.65)
				if j.rebalanceDue() != nil {
					t.Fatalf("a rebalance after %d timed steps, before %d", j.planSteps-warmupSteps, paceWindow)
				}
			}
			step([]float64{0.1, 0.3}, 0.65)
			v := j.rebalanceDue()
			if v == nil || fmt.Sprint(v.Shares) != "[3 1]" {
				t.Fatalf("rebalance %+v: want shares [3 1]", v)
			}
			// What rebalance does around adopt: the new plan's shares, its paces measured afresh,
			// the plan before's shares and median step kept to hold it to account.
			j.pace = paceTrack{rebalanced: true, wallBefore: medianOf(j.pace.walls), undo: []int{2, 2}, cost: 50 * time.Millisecond}
			j.stages[0].n, j.stages[1].first, j.stages[1].n = 3, 3, 1
			j.reps = replicaRuns(j.stages)
			j.planSteps = 0
			wall := 0.7 // no faster: the paces were not the replicas'
			if faster {
				wall = 0.4
			}
			for range warmupSteps + paceWindow {
				step([]float64{0.1, 0.3}, wall)
			}
			if faster {
				if j.pace.off || j.pace.undoDue || j.pace.rebalanced {
					t.Fatalf("a rebalance that made the step faster: %+v", j.pace)
				}
				if v := j.rebalanceDue(); v != nil {
					t.Fatalf("shares that follow the paces already changed again: %+v", v)
				}
				return
			}
			if !j.pace.off {
				t.Fatalf("a rebalance that made nothing faster left rebalancing on: %+v", j.pace)
			}
			v = j.rebalanceDue()
			if v == nil || fmt.Sprint(v.Shares) != "[2 2]" {
				t.Fatalf("undo %+v: want the shares before, [2 2]", v)
			}
			// The undo's plan: its paces measured afresh, rebalancing still off.
			j.pace = paceTrack{off: j.pace.off, cost: j.pace.cost}
			j.stages[0].n, j.stages[1].first, j.stages[1].n = 2, 2, 2
			j.reps = replicaRuns(j.stages)
			j.planSteps = 0
			for range warmupSteps + paceWindow {
				step([]float64{0.1, 0.3}, 0.65)
			}
			if v := j.rebalanceDue(); v != nil {
				t.Fatalf("a rebalance with rebalancing off: %+v", v)
			}
		})
	}
}

// TestShareCaps: a rebalance offers no replica more micro-batches than its workers' offered
// memory holds (shareCaps, from the same formula as the plan's depth): a worker with room for
// only a little more than its share is capped there, and the pace's split stays within it.
func TestShareCaps(t *testing.T) {
	spec := tinyJob(t, 100)
	j := churnJob(t, spec, []float64{10, 10}, 1<<30)
	j.sync, j.phase, j.hosts = stepRule{}, phaseTraining, nil
	j.stages = []placement{{peer: "w0", begin: 0, end: 4, replica: 0, first: 0, n: 2}, {peer: "w1", begin: 0, end: 4, replica: 1, first: 2, n: 2}}
	j.reps = replicaRuns(j.stages)
	if caps := j.shareCaps(); fmt.Sprint(caps) != "[4 4]" {
		t.Fatalf("caps %v with a gigabyte each, want [4 4]", caps)
	}
	b := spec.BatchSize / spec.MicroBatches
	need, err := sched.StageShardMemory(spec.Model, b, 2, 0, 4, 0, 1, 0, 0, spec.ShardJob())
	if err != nil {
		t.Fatal(err)
	}
	j.peers["w0"].hello.MemoryBytes = int64(need) // its share of 2 at depth 0, and no more than that needs
	want := 2                                     // the largest share w0's memory holds
	for n := 3; n <= spec.MicroBatches; n++ {
		m, err := sched.StageShardMemory(spec.Model, b, n, 0, 4, 0, 1, 0, 0, spec.ShardJob())
		if err != nil || m > need {
			break
		}
		want = n
	}
	if want == spec.MicroBatches {
		t.Fatal("the memory model does not grow with the share: nothing to cap")
	}
	if caps := j.shareCaps(); caps[0] != want || caps[1] != 4 {
		t.Fatalf("caps %v with w0 holding %d micro-batches, want [%d 4]", caps, want, want)
	}
	if v := sched.WeighRebalance([]int{2, 2}, []float64{0.1, 0.3}, j.shareCaps(), 100, 0.01); v.Pays && v.Shares[0] > want {
		t.Fatalf("a rebalance past w0's memory: %+v", v)
	}
}
