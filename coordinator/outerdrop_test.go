package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestOuterReplicaDropped: three whole-model replicas train own batches in outer mode (an outer
// step every 6 steps, a checkpoint every 6). Replica 0's worker dies mid-round, as it finishes
// step 7 and before it reports it — once the others are past the outer step after step 5 (they
// have finished step 6), whose exchange needed its contribution. The rule book drops the replica at once: the other two carry
// on under the same plan — no replan, no shard restored from the checkpoint after step 6, no step
// abandoned — the dropped replica's round is left out of the outer step after step 11, and
// replica 2 keeps its own data (its index). Replica 1 uploads the global θ in replica 0's stead.
// The losses and the final parameters are those of one process replaying the recorded
// membership (local.Options.Replay, as `shoal train --replay` does), bit for bit.
func TestOuterReplicaDropped(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 12, job.Sync{Every: 6, Compress: "int8", Batches: job.BatchesOwn}, 2, 2, 2)
	spec.CheckpointEvery, spec.ValEvery = 6, 4 // evaluations through the first replica left
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left")
	var c *cluster
	var once sync.Once
	var past sync.WaitGroup // w1 and w2 finished step 6
	past.Add(2)
	pastOnce := []*sync.Once{{}, {}, {}}
	c = startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		cfg.OnStatus = func(s client.Status) {
			if s.LastStep == nil || s.PlanVersion != 1 {
				return
			}
			if i > 0 && s.LastStep.Step >= 6 {
				pastOnce[i].Do(past.Done)
			}
			if i == 0 && s.LastStep.Step == 7 {
				once.Do(func() {
					done := make(chan struct{})
					go func() { past.Wait(); close(done) }()
					select {
					case <-done:
					case <-time.After(time.Minute):
						t.Error("the other replicas never finished step 6")
					}
					c.kill[0]()
				})
			}
		}
	})
	c.run(t)
	c.finished(t, spec.Steps)
	if left := log.of("worker.left"); len(left) != 1 || !strings.HasPrefix(left[0], "w0 ") {
		t.Fatalf("workers left: %v, want w0", left)
	}
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	if plans := log.of("plan"); len(plans) != 1 {
		t.Errorf("plans: %v, want the first only: a replan restores every shard", plans)
	}
	dropped := log.of("replica.dropped")
	if len(dropped) != 1 {
		t.Fatalf("replica.dropped events: %v, want one", dropped)
	}
	var ev struct{ Replica, Step, Replicas int }
	if err := json.Unmarshal([]byte(strings.TrimPrefix(dropped[0], "w0 ")), &ev); err != nil || ev.Replica != 0 || ev.Replicas != 2 || ev.Step < 6 || ev.Step > 11 {
		// The step the drop is recorded at is where the job stands when the departure is heard:
		// 6 or 7 on a quiet machine, later when the survivors run ahead first; the replay below
		// is what pins it.
		t.Fatalf("replica.dropped %s (%v): want replica 0 of w0 dropped within the round (steps 6 to 11), two left", dropped[0], err)
	}
	var periods []local.Period
	for _, p := range log.planList() {
		periods = p.Period().Then(periods)
	}
	b, _ := json.Marshal(periods)
	t.Logf("plans %s", b)
	if len(periods) != 2 || periods[0].From != 0 || len(periods[1].Replicas) != 3 || periods[1].From != ev.Step || fmt.Sprint(periods[1].Dropped) != "[0]" {
		t.Fatalf("plans %s: want three replicas from step 0, then replica 0 dropped from step %d", b, ev.Step)
	}
	var want []local.Report
	res, err := local.Run(context.Background(), spec, local.Options{Replay: periods, OnStep: func(r local.Report) { want = append(want, r) }})
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	sameReports(t, c.reports, want)
	c.mu.Unlock()
	m, _, err := model.LoadModel(filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(spec.Steps)))
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range res.Model.P.Tensors {
		for k, v := range m.P.Tensors[i].Data {
			if v != tt.Data[k] {
				t.Fatalf("final checkpoint %s[%d] = %v, the replay %v", tt.Name, k, v, tt.Data[k])
			}
		}
	}
}
