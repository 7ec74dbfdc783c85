package coordinator

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
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
	c = startCluster(t, spec, 3, false, killMidRound(t, &c, nil, nil))
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
	periods := replayOf(t, log.planList())
	b, _ := json.Marshal(periods)
	if len(periods) != 2 || periods[0].From != 0 || len(periods[1].Replicas) != 3 || periods[1].From != ev.Step || fmt.Sprint(periods[1].Dropped) != "[0]" {
		t.Fatalf("plans %s: want three replicas from step 0, then replica 0 dropped from step %d", b, ev.Step)
	}
	sameAsReplay(t, c, spec, periods)
}
