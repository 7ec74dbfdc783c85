package coordinator

import (
	"context"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// TestClusterMemoryRefusal: a pinned plan puts stage 0 on a worker offering 1 MiB (`--memory`),
// less than the stage needs. The worker refuses it (proto.ErrCodeMemory) instead of allocating;
// the coordinator leaves it out of the next plan, which the two others hold, and the job computes
// what the single process does: one failed plan, not a loop of them.
func TestClusterMemoryRefusal(t *testing.T) {
	spec := tinyJob(t, 4)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	want, _ := localReports(t, spec)
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = []string{"w-a", "w-b", "w-c"}[i] // w-a sorts first: the pinned plan's stage 0
		if i == 0 {
			cfg.MemoryBytes = 1 << 20
		}
	})
	c.run(t)
	sameReports(t, c.reports, want)
	ctx := context.Background()
	errs, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{Kind: "worker.error"})
	failed, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{Kind: "plan.failed"})
	plans, _ := c.srv.db.ListEvents(ctx, storage.EventFilter{Kind: "plan"})
	if len(errs) != 1 || len(failed) != 1 || len(plans) != 2 {
		t.Fatalf("%d worker errors, %d failed plans, %d plans; want 1, 1, 2", len(errs), len(failed), len(plans))
	}
	if e := errs[0]; e.WorkerID != "w-a" || !strings.Contains(string(e.Message), `"code":"memory"`) {
		t.Errorf("error event %s from %s, want a memory error from w-a", e.Message, e.WorkerID)
	}
}
