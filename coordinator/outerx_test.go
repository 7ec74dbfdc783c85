package coordinator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
)

// TestOuterFalseAveraged: a worker that exchanges honestly but says it averaged a segment its
// replica does not own (client.FaultFalseAveraged) would have the job record a step its replay
// could not take (proto.OuterDone.Averaged, local.Period.Segments). The coordinator refuses the
// record, bans the worker (else it would be planned again, and lie again) and replans; the others
// finish the job, and their losses are one process's replaying what they ran, bit for bit.
func TestOuterFalseAveraged(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 10, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn})
	spec.CheckpointEvery, spec.ValEvery = 2, 0
	log := watch(t, "plan", "outer.averaged", "peer.banned")
	c := startCluster(t, spec, 3, false, faulty(2, client.FaultFalseAveraged))
	c.run(t)
	c.finished(t, spec.Steps)
	lied := log.of("outer.averaged")
	if len(lied) == 0 || !strings.HasPrefix(lied[0], "w2 ") {
		t.Fatalf("outer.averaged events %v, want w2's", lied)
	}
	for _, l := range lied {
		if !strings.HasPrefix(l, "w2 ") {
			t.Errorf("an honest worker's record refused: %s", l)
		}
	}
	if b := log.of("peer.banned"); len(b) != 1 || !strings.HasPrefix(b[0], "w2 ") {
		t.Errorf("peer.banned events %v, want w2's", b)
	}
	sameAsReplay(t, c, spec, replayOf(t, log.planList()))
}

// TestOuterExchangeSurvivesDeparture: the exchange of an outer step goes on when a replica
// leaves in the middle of it (client/outerx.go) — 3 and 5 replicas, int8 and float32. The
// replica's worker (client.FaultLeaveInExchange) sends its contributions, then its average to
// one other replica only, and vanishes. The others take the step's next attempt without it: the
// same segments, its own reassigned to survivors, whatever was averaged before standing. No
// restore, one redo, and the run is one process's replaying the record — each segment averaged
// over the participants its owner had (local.Period.Segments) — bit for bit.
func TestOuterExchangeSurvivesDeparture(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs and their replays")
	}
	for _, tc := range []struct {
		replicas int
		compress string
	}{{3, "none"}, {5, "int8"}, {5, "none"}} {
		t.Run(fmt.Sprintf("%d replicas %s", tc.replicas, map[string]string{"none": "float32", "int8": "int8"}[tc.compress]), func(t *testing.T) {
			shares := slices.Repeat([]int{2}, tc.replicas)
			spec := outerJob(t, 8, job.Sync{Every: 4, Compress: tc.compress, Batches: job.BatchesOwn}, shares...)
			spec.CheckpointEvery, spec.ValEvery = 0, 0
			log := watch(t, "plan", "replica.dropped", "step.abandoned", "outer.redo", "outer.averaged", "worker.left")
			leaver := tc.replicas - 1
			c := startCluster(t, spec, tc.replicas, false, faulty(leaver, client.FaultLeaveInExchange))
			c.run(t)
			c.finished(t, spec.Steps)
			noRestore(t, log, fmt.Sprintf("w%d", leaver), 1)
			if redo := log.of("outer.redo"); len(redo) != 1 {
				t.Errorf("outer.redo events: %v, want one", redo)
			}
			if e := log.of("outer.averaged"); len(e) > 0 {
				t.Errorf("an honest record refused: %v", e)
			}
			periods := replayOf(t, log.planList())
			sameAsReplay(t, c, spec, periods)
		})
	}
}

// TestOuterExchangeSurvivesTwoDepartures: two of five replicas leave in the middle of the same
// exchange (client.FaultLeaveInExchange), so that segments are reassigned after a reassignment
// when the coordinator notices them apart (model.OuterReassign attempt by attempt, as the replay
// applies it), or both at once when it notices them together. Either way the three left take the
// step without a restore, and the run is one process's replaying the record bit for bit.
func TestOuterExchangeSurvivesTwoDepartures(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs and their replays")
	}
	for _, compress := range []string{"int8", "none"} {
		t.Run(compress, func(t *testing.T) {
			spec := outerJob(t, 8, job.Sync{Every: 4, Compress: compress, Batches: job.BatchesOwn}, 2, 2, 2, 2, 2)
			spec.CheckpointEvery, spec.ValEvery = 0, 0
			log := watch(t, "plan", "replica.dropped", "step.abandoned", "outer.redo", "outer.averaged", "worker.left")
			c := startCluster(t, spec, 5, false, func(k int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", k)
				if k >= 3 {
					cfg.Fault = client.FaultLeaveInExchange
				}
			})
			c.run(t)
			c.finished(t, spec.Steps)
			left := log.of("worker.left")
			slices.Sort(left)
			if len(left) != 2 || !strings.HasPrefix(left[0], "w3 ") || !strings.HasPrefix(left[1], "w4 ") {
				t.Fatalf("workers left: %v, want w3 and w4", left)
			}
			if ab := log.of("step.abandoned"); len(ab) > 0 {
				t.Errorf("steps abandoned: %v", ab)
			}
			if ps := log.of("plan"); len(ps) != 1 {
				t.Errorf("plans: %v, want 1: a restore would add one", ps)
			}
			if redo := log.of("outer.redo"); len(redo) < 1 || len(redo) > 2 {
				t.Errorf("outer.redo events: %v, want one or two", redo)
			}
			if e := log.of("outer.averaged"); len(e) > 0 {
				t.Errorf("an honest record refused: %v", e)
			}
			t.Logf("redos: %v", log.of("outer.redo"))
			sameAsReplay(t, c, spec, replayOf(t, log.planList()))
		})
	}
}
