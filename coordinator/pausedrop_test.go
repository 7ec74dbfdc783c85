package coordinator

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestReplicaLostWhilePaused: the admin pauses a job of replicas, and while it stands paused at a
// step boundary a worker of one replica dies. The rule book answers it there as at any boundary
// (sched.Decide, PhaseBoundary) — in step mode the others reshare its micro-batches, in outer mode
// its replica is dropped from that step — and the job, resumed, goes on from the step it paused
// at: no shard is restored from a checkpoint, no step is replayed. (Before, a departure while
// paused abandoned the plan, and the job restored every shard from the newest checkpoint once
// resumed.) The losses and final parameters are the single process's (step mode) or one process
// replaying the recorded membership (outer mode), bit for bit.
func TestReplicaLostWhilePaused(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, mode := range []string{"step", "outer"} {
		t.Run(mode, func(t *testing.T) {
			var spec job.Spec
			if mode == "step" {
				spec = tinyJob(t, 10)
				spec.AuditRate = 0
				spec.Plan = &job.Plan{}
				for _, n := range []int{2, 1, 1} {
					spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, spec.Model.NLayer}}, MicroBatches: n})
				}
			} else {
				// An outer step every 4 steps and a checkpoint every 3: rounds end after steps 2,
				// 3 and 5, so the pause taken after step 4's report stands at step 6, inside
				// the outer period of steps 4–7, whose work the dropped replica loses.
				spec = outerJob(t, 10, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn}, 2, 2, 2)
				spec.CheckpointEvery, spec.ValEvery = 3, 0
			}
			log := watch(t, "plan", "replica.dropped", "work.rerouted", "step.abandoned", "worker.left", "admin.pause", "admin.resume")
			c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) { cfg.WorkerID = fmt.Sprintf("w%d", i) })
			var once sync.Once
			done := make(chan error, 1)
			c.onStep = func(r local.Report) {
				if r.Step != 4 {
					return
				}
				// On the job loop's goroutine: the admin acts from another.
				once.Do(func() { go func() { done <- pauseKillResume(c, log, mode) }() })
			}
			c.run(t)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			c.finished(t, spec.Steps)
			if mode == "step" {
				noRestore(t, log, "w0", 2) // the first plan and the reshared one, which keeps every shard
				plans := log.of("plan")
				if !strings.Contains(plans[1], `"kept":true`) {
					t.Errorf("the plan after the departure %s: want every shard kept", plans[1])
				}
				c.sameAsLocal(t, spec)
				return
			}
			noRestore(t, log, "w0", 1)
			dropped := log.of("replica.dropped")
			if len(dropped) != 1 {
				t.Fatalf("replica.dropped events: %v, want one", dropped)
			}
			var ev struct{ Replica, Step, Replicas int }
			if err := json.Unmarshal([]byte(strings.TrimPrefix(dropped[0], "w0 ")), &ev); err != nil || ev.Replica != 0 || ev.Replicas != 2 {
				t.Fatalf("replica.dropped %s (%v): want replica 0 of w0 dropped, two left", dropped[0], err)
			}
			sameAsReplay(t, c, spec, replayOf(t, log.planList()))
		})
	}
}

// pauseKillResume pauses c's job, kills w0 once the job stands paused, waits until the job loop
// has answered its departure (mode "outer": the replica dropped; "step": the reshared plan), and
// resumes the job.
func pauseKillResume(c *cluster, log *clusterLog, mode string) error {
	act := func(kind string) error {
		cmd := command{kind: kind, done: make(chan error, 1)}
		select {
		case c.srv.commands <- cmd:
		case <-time.After(time.Minute):
			return fmt.Errorf("%s: the job loop took no command for a minute", kind)
		}
		return <-cmd.done
	}
	waitFor := func(what string, ok func() bool) error {
		for deadline := time.Now().Add(30 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				return fmt.Errorf("no %s within 30 s", what)
			}
		}
		return nil
	}
	if err := act("pause"); err != nil {
		return err
	}
	if err := waitFor("pause", func() bool { return c.srv.status.Load().Job.State == "paused" }); err != nil {
		return err
	}
	paused := c.srv.status.Load().Job.Step
	c.kill[0]()
	answered := func() bool { return len(log.of("replica.dropped")) > 0 }
	if mode == "step" {
		answered = func() bool { return len(log.of("plan")) > 1 }
	}
	err := waitFor("answer to the departure while paused", answered)
	if now := c.srv.status.Load().Job.Step; err == nil && now != paused {
		err = fmt.Errorf("the job moved from step %d to %d while paused", paused, now)
	}
	if rerr := act("resume"); err == nil {
		err = rerr
	}
	return err
}

// TestOuterRefillGiverLost: three whole-model replicas in outer mode and a fourth worker standing
// by. Replica 0's worker dies mid-round and the replica is dropped; at the next boundary the
// standby refills it, taking the global θ from w1, replica 1's worker — and w1 dies once it has
// loaded the refill's plan, before it says it is ready. The rule book drops w1's replica there
// (outer mode at a boundary: the refill's plan gets ready with the survivors holding their
// state), and with it the refilled replica, whose state was to come from w1: replica 2 goes on
// alone, from the step the refill began at — no checkpoint restored, no step abandoned. The plan's
// record says the refill grew replica 0 and dropped it with replica 1 at its first step, and the
// losses and final parameters are one process's replaying that, bit for bit.
func TestOuterRefillGiverLost(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 18, job.Sync{Every: 6, Compress: "int8", Batches: job.BatchesOwn}, 2, 2, 2)
	spec.CheckpointEvery, spec.ValEvery = 6, 0
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left", "pool.joined")
	var c *cluster
	var killed sync.Once
	tweak := killMidRound(t, &c, nil, nil)
	c = startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		tweak(i, cfg)
		if i != 1 {
			return
		}
		mid, dies := cfg.OnStatus, killBeforeReady(t, &c, &killed, 1, "w1", 2)
		cfg.OnStatus = func(s client.Status) {
			mid(s)
			dies(s)
		}
	})
	c.joinAfterStep1(t, 3)
	c.run(t)
	c.finished(t, spec.Steps)
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	if left := log.of("worker.left"); len(left) != 2 {
		t.Errorf("workers left: %v, want w0 and w1", left)
	}
	if ps := log.of("plan"); len(ps) != 2 || !strings.Contains(ps[1], `"kept":true`) {
		t.Fatalf("plans: %v, want the first and the refill (kept), no restore", ps)
	}
	plans := log.planList()
	last := plans[len(plans)-1]
	if last.Version != 2 || len(last.Stages) != 1 || last.Stages[0].Peer != "w2" {
		t.Fatalf("the last plan: version %d, stages %+v: want the refill's, with w2 alone", last.Version, last.Stages)
	}
	var refilled, giver bool
	for _, d := range last.Dropped {
		refilled = refilled || d.Replica == 0 && d.Refilled && d.Step == last.FromStep
		giver = giver || d.Replica == 1 && !d.Refilled && d.Step == last.FromStep
	}
	if !refilled || !giver {
		t.Fatalf("the refill's plan dropped %+v: want replica 0 (refilled) and replica 1 from its first step %d", last.Dropped, last.FromStep)
	}
	periods := replayOf(t, plans)
	p := periods[len(periods)-1]
	if p.Replan || fmt.Sprint(p.Grown) != "[0]" || fmt.Sprint(p.Dropped) != "[0 1]" {
		t.Fatalf("the last period %+v: want replica 0 grown and replicas 0 and 1 dropped, no restore", p)
	}
	sameAsReplay(t, c, spec, periods)
}

// TestOuterJoinGrows: two whole-model replicas of an outer-mode job of own batches, planned by the
// planner, and a third worker that joins after step 1. The planner would run three replicas, and
// the newcomer becomes the third beside the two that run (outerExtend): it takes the global θ and
// the outer momentum from a holder and starts from them, the others keep their state — no
// checkpoint, no replan, no shard restored (before, every join of an outer-mode job checkpointed
// and restored every replica from it). The losses and final parameters are one process's
// replaying that membership, bit for bit. A newcomer slower than the others (case slower) makes
// the running replicas' own batches larger, as the planner sizes them to the slowest; they keep
// their state all the same.
func TestOuterJoinGrows(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	for _, tc := range []struct {
		name   string
		gflops float64 // the newcomer's; the others' 1
	}{{"equal", 1}, {"slower", 0.5}} {
		t.Run(tc.name, func(t *testing.T) { outerJoinGrows(t, tc.gflops) })
	}
}

func outerJoinGrows(t *testing.T, gflops float64) {
	spec := outerJob(t, 12, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn})
	spec.CheckpointEvery, spec.ValEvery = 6, 0
	log := watch(t, "plan", "pool.joined", "replan.join", "step.abandoned", "worker.left")
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		slowWorkers(i, cfg)
		if i == 2 {
			cfg.GFLOPS = gflops
		}
	})
	c.joinAfterStep1(t, 2)
	c.run(t)
	c.finished(t, spec.Steps)
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	if rj := log.of("replan.join"); len(rj) > 0 {
		t.Errorf("join replans: %v, want the join grown without one", rj)
	}
	ps := log.of("plan")
	if len(ps) != 2 || !strings.Contains(ps[1], `"kept":true`) || !strings.Contains(ps[1], `"replicas":3`) {
		t.Fatalf("plans: %v, want the first and a grown one of three replicas (kept)", ps)
	}
	if pj := log.of("pool.joined"); len(pj) != 1 || !strings.Contains(pj[0], `"w2"`) {
		t.Errorf("pool.joined: %v, want w2's", pj)
	}
	periods := replayOf(t, log.planList())
	if len(periods) != 2 || len(periods[1].Replicas) != 3 || fmt.Sprint(periods[1].Grown) != "[2]" || periods[1].Replan {
		t.Fatalf("plans %+v: want two replicas, then replica 2 grown beside them", periods)
	}
	if gflops < 1 && periods[1].Replicas[0].MicroBatches <= periods[0].Replicas[0].MicroBatches {
		t.Errorf("plans %+v: want the running replicas' own batches larger beside a slower newcomer", periods)
	}
	sameAsReplay(t, c, spec, periods)
}
