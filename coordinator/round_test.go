package coordinator

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestOuterReplicasRunFree: in outer mode a fast replica does not wait for a slow one between
// outer steps. Replica workers w0 and w1 each hold a whole model; w1 is a straggler (its status
// callback, which runs before each step's report goes out, holds it 100 ms a step). The fast
// worker finishes steps ahead of the slow one within a round — in lockstep it could never be
// more than one step ahead — but never crosses a round's end: at an outer step (and an
// evaluation or checkpoint) everyone stands still. The losses are the single process's bit for
// bit: only the waiting changed.
func TestOuterReplicasRunFree(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run of a few seconds")
	}
	spec := tinyJob(t, 12)
	spec.AuditRate = 0 // outer mode is not audited
	spec.CheckpointEvery, spec.ValEvery = 6, 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 6, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}}
	type done struct {
		worker string
		step   int
	}
	var mu sync.Mutex
	var order []done // steps finished, in the order the workers finished them
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		id := fmt.Sprintf("w%d", i)
		cfg.WorkerID = id
		steps := 0
		cfg.OnStatus = func(s client.Status) {
			if s.Steps == steps || s.LastStep == nil {
				return
			}
			steps = s.Steps
			if id == "w1" {
				time.Sleep(100 * time.Millisecond)
			}
			mu.Lock()
			order = append(order, done{id, int(s.LastStep.Step)})
			mu.Unlock()
		}
	})
	c.run(t)
	want, _ := localReports(t, spec)
	c.mu.Lock()
	sameReports(t, c.reports, want)
	c.mu.Unlock()

	mu.Lock()
	defer mu.Unlock()
	finished := map[string]int{"w0": -1, "w1": -1} // each worker's last step finished so far
	ahead := 0                                     // the most steps w0 was ahead of w1
	for _, d := range order {
		if d.step != finished[d.worker]+1 {
			t.Fatalf("%s finished step %d after step %d: order %v", d.worker, d.step, finished[d.worker], order)
		}
		// No one starts a step past an outer step before everyone finished the step before it.
		for w, f := range finished {
			if w != d.worker && d.step > 0 && local.OuterStepAfter(spec, d.step-1) && f < d.step-1 {
				t.Errorf("%s finished step %d, after the outer step of step %d, while %s had finished only %d", d.worker, d.step, d.step-1, w, f)
			}
		}
		finished[d.worker] = d.step
		ahead = max(ahead, finished["w0"]-finished["w1"])
	}
	t.Logf("the fast replica ran up to %d steps ahead of the slow one", ahead)
	if ahead < 3 {
		t.Errorf("the fast replica was at most %d steps ahead of the straggler: the replicas ran in lockstep (order %v)", ahead, order)
	}
}
