package coordinator

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
)

// killAtEvaluation names the workers w0, w1, … and, as worker `at` finishes its part of the job's
// nth validation pass and before its report can leave (OnStatus runs on its executor), kills
// worker `victim` and waits until the job loop has heard it leave: the coordinator is then
// waiting for that pass (phaseEvaluating), which at's report has not reached.
func killAtEvaluation(t *testing.T, c **cluster, log *clusterLog, at, victim, nth int) func(i int, cfg *client.WorkerConfig) {
	var once sync.Once
	return func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i != at {
			return
		}
		cfg.OnStatus = func(s client.Status) {
			if s.Evaluations < nth {
				return
			}
			once.Do(func() {
				(*c).kill[victim]()
				id := fmt.Sprintf("w%d ", victim)
				for deadline := time.Now().Add(time.Minute); !slices.ContainsFunc(log.of("worker.left"), func(e string) bool { return strings.HasPrefix(e, id) }); {
					if time.Now().After(deadline) {
						t.Errorf("w%d's departure not heard within a minute", victim)
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
			})
		}
	}
}

// TestOuterReplicaLostInEvaluation: three whole-model replicas in outer mode evaluate after step 4
// (val_every 4), on the first replica; its worker w0 dies with its part of the pass done and its
// report unsent (killAtEvaluation: the second pass, the first being after step 0). Before, the rule book saw a boundary and every shard was restored. Now the pass
// starts again on the next replica — the same global θ, the same loss — w0's replica is dropped
// from step 5 and the others go on: no restore, no step abandoned, one plan, and the run is one
// process's replaying that membership, bit for bit.
func TestOuterReplicaLostInEvaluation(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 10, job.Sync{Every: 4, Compress: "int8"}, 2, 1, 1)
	spec.ValEvery = 4
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left")
	var c *cluster
	c = startCluster(t, spec, 3, false, killAtEvaluation(t, &c, log, 0, 0, 2))
	c.run(t)
	c.finished(t, spec.Steps)
	noRestore(t, log, "w0", 1)
	dropped := log.of("replica.dropped")
	var ev struct{ Replica, Step, Replicas int }
	if len(dropped) != 1 || json.Unmarshal([]byte(strings.TrimPrefix(dropped[0], "w0 ")), &ev) != nil || ev.Replica != 0 || ev.Step != 5 || ev.Replicas != 2 {
		t.Fatalf("replica.dropped %v: want replica 0 dropped from step 5, two left", dropped)
	}
	c.mu.Lock()
	var val []float64
	for _, r := range c.reports {
		if !math.IsNaN(r.ValLoss) {
			val = append(val, r.ValLoss)
		}
	}
	c.mu.Unlock()
	if len(val) < 2 {
		t.Fatalf("validation losses %v: want the one after step 4 and the last", val)
	}
	sameAsReplay(t, c, spec, replayOf(t, log.planList()))
}

// TestStepReplicaLostInEvaluation: three whole-model replicas in step mode evaluate after step 4 on
// the first replica (w0), and w1, of another replica, dies meanwhile: the pass goes on, the step
// is recorded with its validation loss, and the survivors reshare from step 5 keeping their shards
// — where before the evaluation failed, the reshare came from step 4, which their shards had
// passed, and every shard was restored. Losses, validation losses and
// final parameters are the single process's, bit for bit.
func TestStepReplicaLostInEvaluation(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 10)
	spec.ValEvery, spec.AuditRate = 4, 0
	spec.Plan = &job.Plan{}
	for _, n := range []int{2, 1, 1} {
		spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, spec.Model.NLayer}}, MicroBatches: n})
	}
	log := watch(t, "plan", "work.rerouted", "step.abandoned", "worker.left")
	var c *cluster
	c = startCluster(t, spec, 3, false, killAtEvaluation(t, &c, log, 0, 1, 2))
	c.run(t)
	c.finished(t, spec.Steps)
	c.sameAsLocal(t, spec)
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	plans := log.planList()
	if len(plans) != 2 || plans[1].FromStep != 5 || plans[1].KeptFrom != plans[0].Version {
		t.Errorf("plans %+v: want the first and one kept from it at step 5", plans)
	}
	if r := log.of("work.rerouted"); len(r) != 1 {
		t.Errorf("work.rerouted %v: want one", r)
	}
}
