package coordinator

import (
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
