package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/sched"
)

// TestJoinHandsBack: a worker much faster than the holders joins a one-pipeline step-mode job,
// and the planner puts it in place of a holder (each peer holds one of the two blocks at most,
// so the pipeline keeps its cut and one holder is left out). No twin holds that stage, so before
// it took a checkpoint and a replan of everyone. Now the holder left out hands its stage over to
// the joiner, peer to peer, and stands by (proto.Assign.Standby): a grow, no checkpoint, no step
// replayed, the losses and final parameters the single process's bit for bit. Audited, the
// joiner's state is held to the giver's Ready (custody) and the giver's last step may be drawn
// against it: nobody is banned and no state is disputed. And when the giver leaves as it is to
// hand over, its taker has no other source: the job restores from the checkpoint.
func TestJoinHandsBack(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		name      string
		audit     float64
		loseGiver bool
	}{{"plain", 0, false}, {"audited", 1, false}, {"giver-lost", 0, true}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 14)
			spec.Model.NLayer, spec.Model.MoEEvery = 2, 2
			spec.AuditRate = tc.audit
			spec.CheckpointEvery = 4
			// Room for one block and the embedding or the head, not for two blocks.
			one, two := blockMemories(t, spec)
			mem := int64((one*1.05 + two) / 2)
			log := watch(t, "plan", "pool.joined", "step.abandoned", "peer.banned", "audit.abandoned", "audit.passed", "state.disputed", "checkpoint.restored")
			if tc.audit > 0 {
				prev := clusterConfig
				clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			}
			var joinOnce sync.Once
			var c *cluster
			c = startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				cfg.MemoryBytes, cfg.GFLOPS = mem, 10
				if i == 2 {
					cfg.GFLOPS = 25
				}
				if tc.loseGiver && i < 2 {
					cfg.Fault = client.FaultLeaveOnGive
				}
			})
			// Once the hand-back's plan has stepped, the hub links its giver and taker no more.
			var linkedAfter atomic.Int32
			c.onStep = func(r local.Report) {
				if r.Step == 5 {
					joinOnce.Do(func() { c.startWorker(2) })
				}
				plans := log.planList()
				if g := slices.IndexFunc(plans, func(p PlanStatus) bool { return p.TookFrom["w2"] != "" }); g >= 0 && g == len(plans)-1 && r.Step >= plans[g].FromStep {
					if _, ok := c.srv.hub.linked(plans[g].TookFrom["w2"], "w2"); ok {
						linkedAfter.Store(1)
					} else if linkedAfter.Load() == 0 {
						linkedAfter.Store(-1)
					}
				}
			}
			c.run(t)
			c.finished(t, spec.Steps)
			plans := log.planList()
			for _, k := range []string{"peer.banned", "step.abandoned", "state.disputed", "audit.abandoned"} {
				if e := log.of(k); len(e) > 0 && !(tc.loseGiver && k == "step.abandoned") {
					t.Errorf("%s: %v (plans %+v)", k, e, plans)
				}
			}
			if tc.loseGiver {
				// The steps since the checkpoint are computed again: the last of each counts.
				want, ref := localReports(t, spec)
				c.mu.Lock()
				sameReports(t, lastOfEachStep(c.reports), want)
				c.mu.Unlock()
				assertFinalCheckpoint(t, c, ref)
			} else {
				c.sameAsLocal(t, spec)
			}
			grow := slices.IndexFunc(plans, func(p PlanStatus) bool { return p.TookFrom["w2"] != "" })
			if grow < 1 {
				t.Fatalf("plans %+v: want w2 to take its stage from a holder", plans)
			}
			giver, p := plans[grow].TookFrom["w2"], plans[grow]
			if !slices.Contains(p.Standby, giver) || slices.Contains(p.peers(), giver) || p.KeptFrom != plans[grow-1].Version || p.FromStep < plans[grow-1].FromStep {
				t.Errorf("plan %+v after %+v: want %s standing by, the plan kept from the one before", p, plans[grow-1], giver)
			}
			if tc.loseGiver {
				// The giver left before it sent a tensor: the next plan restores from the
				// checkpoint, and w2 runs the stage.
				if len(plans) <= grow+1 || plans[grow+1].KeptFrom != 0 || !slices.Contains(plans[grow+1].peers(), "w2") {
					t.Errorf("plans %+v: want a restore after the grow, w2 in it", plans)
				}
				return
			}
			if j := log.of("pool.joined"); len(j) != 1 || !strings.Contains(j[0], `"takers":[["w2","`+giver+`"]]`) ||
				!strings.Contains(j[0], `"handed_back":["`+giver+`"]`) {
				t.Errorf("pool.joined %v: want w2 taking from %s, which handed its stage back", j, giver)
			}
			if v := linkedAfter.Load(); v != -1 {
				t.Errorf("after the hand-back's plan stepped, the hub linked the giver and w2 (%d; 0: never checked)", v)
			}
			if len(plans) != grow+1 {
				t.Errorf("plans %+v: want the grow to be the last", plans)
			}
			if tc.audit > 0 && !slices.ContainsFunc(log.of("audit.passed"), func(e string) bool { return strings.HasPrefix(e, "w2 ") }) {
				t.Errorf("no audit of w2 passed: %v", log.of("audit.passed"))
			}
		})
	}
}

// TestJoinSplitsAStage: one worker holds the whole model (two blocks) of a step-mode job; two
// workers join, each much faster but with room for one block only, and the planner cuts the model
// in two on them, leaving the holder out. No holder has either new stage's blocks as its own
// stage, so before covering givers it took a checkpoint and a replan of everyone. Now the holder
// hands each joiner its block, peer to peer (sched.Cover: parts of its stage), and stands by: no
// checkpoint, no step replayed, the losses and final parameters the single process's bit for bit.
// Audited, each joiner's state is held to what the coordinator composes from the giver's hashes
// (proto.Ready.Sums), themselves held to the giver's word: nothing is disputed.
func TestJoinSplitsAStage(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 14)
	spec.Model.NLayer, spec.Model.MoEEvery = 2, 2
	spec.AuditRate = 1
	spec.CheckpointEvery = 100
	one, two := blockMemories(t, spec)
	log := watch(t, "plan", "pool.joined", "step.abandoned", "peer.banned", "audit.abandoned", "state.disputed", "checkpoint.restored", "replan.join")
	prev := clusterConfig // watch's
	clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
	var joinOnce sync.Once
	var c *cluster
	c = startCluster(t, spec, 1, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		cfg.MemoryBytes, cfg.GFLOPS = int64(two*1.5), 10
		if i > 0 {
			cfg.MemoryBytes, cfg.GFLOPS = int64((one*1.05+two)/2), 40
		}
	})
	c.onStep = func(r local.Report) {
		if r.Step == 4 {
			joinOnce.Do(func() {
				c.startWorker(1)
				c.startWorker(2)
				// Both connected before the job loop goes on (this runs in it), so that the next
				// boundary weighs the two together: one alone would be placed in a plan that
				// moves w0, which only a checkpoint and replan can take up.
				deadline := time.Now().Add(time.Minute)
				for !(c.srv.hub.Connected("w1") && c.srv.hub.Connected("w2")) && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
			})
		}
	}
	c.run(t)
	c.finished(t, spec.Steps)
	plans := log.planList()
	for _, k := range []string{"peer.banned", "step.abandoned", "state.disputed", "audit.abandoned", "checkpoint.restored"} {
		if e := log.of(k); len(e) > 0 {
			t.Errorf("%s: %v (plans %+v)", k, e, plans)
		}
	}
	c.sameAsLocal(t, spec)
	last := plans[len(plans)-1]
	if r := log.of("replan.join"); len(r) > 0 || last.TookFrom["w1"] != "w0" || last.TookFrom["w2"] != "w0" || !slices.Contains(last.Standby, "w0") {
		t.Fatalf("plans %+v, join replans %v: want w1 and w2 each taking a block from w0, which stands by", plans, r)
	}
	if j := log.of("pool.joined"); len(j) != 1 || !strings.Contains(j[0], `"handed_back":["w0"]`) {
		t.Errorf("pool.joined %v: want w0 handing its stage back in two parts", j)
	}
}

// blockMemories are the memory a stage of one block of spec's two-block model needs (the larger
// of the two, with the embedding or the head) and a stage of both.
func blockMemories(t *testing.T, spec job.Spec) (one, two float64) {
	t.Helper()
	sj := spec.ShardJob()
	for k := range 2 {
		m, err := sched.StageShardMemory(spec.Model, spec.BatchSize/spec.MicroBatches, spec.MicroBatches, k, k+1, k, 2, 0, 0, sj)
		if err != nil {
			t.Fatal(err)
		}
		one = max(one, m)
	}
	two, err := sched.StageShardMemory(spec.Model, spec.BatchSize/spec.MicroBatches, spec.MicroBatches, 0, 2, 0, 1, 0, 0, sj)
	if err != nil {
		t.Fatal(err)
	}
	if two <= one*1.05 {
		t.Fatalf("a whole-model stage %.0f bytes against a block's %.0f: no memory tells them apart", two, one)
	}
	return one, two
}
