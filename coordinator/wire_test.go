package coordinator

import (
	"context"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/storage"
)

// Compressed boundaries (issues 17 and 31): the job's wire formats are part of the model — every
// block boundary and every expert dispatch is quantised in every plan, the single process
// included — so a cluster moving bfloat16, int8 or int4 tensors between its peers computes bit for
// bit what one process computes with the same wire.

// TestClusterWireEqualsLocal: the tiny job with compressed boundaries on three workers — int8 and
// int4 on a 3-stage pipeline; int8, and int4 forward with int8 backward, on 2 stages with an
// expert host; int8 gradients only, through the coordinator's relay; and bfloat16 on 2 stages and
// two expert hosts sharing a replicated expert: every step's loss, aux, gradient norm and
// validation loss, and the final checkpoint, equal the single process's; every step is audited
// and passes; and what the workers sent is the compressed form, to the byte where it can be
// counted.
func TestClusterWireEqualsLocal(t *testing.T) {
	int8s := model.Wire{Activations: model.Int8, Gradients: model.Int8}
	tests := []struct {
		name    string
		wire    model.Wire
		workers int
		relay   bool // through the coordinator's relay instead of WebRTC
		plan    job.Plan
		// perStep is the tensor bytes the workers send in a training step, when the test can
		// count them (no remote experts, whose rows depend on the routing): 0 otherwise.
		perStep func(spec job.Spec) int64
	}{
		{"int8 three stages", int8s, 3, false, job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}},
			func(spec job.Spec) int64 {
				// Two stage boundaries, each crossed by every micro-batch's activation forward and
				// its gradient backward: rows of C codes and a 4-byte scale.
				rows := spec.BatchSize / spec.MicroBatches * spec.Model.BlockSize
				return 2 * int64(spec.MicroBatches) * 2 * int64(rows*(spec.Model.NEmbd+4))
			}},
		{"int8 expert host", int8s, 3, false, job.Plan{Stages: [][2]int{{0, 2}, {2, 4}},
			Experts: []job.ExpertShard{{Block: 1, Experts: []int{0, 2}, Host: 0}}}, nil},
		{"int8 gradients relayed", model.Wire{Activations: model.F32, Gradients: model.Int8}, 3, true, job.Plan{Stages: [][2]int{{0, 2}, {2, 4}},
			Experts: []job.ExpertShard{{Block: 3, Experts: []int{3}, Host: 0}}}, nil},
		{"int4 three stages", model.Wire{Activations: model.Int4, Gradients: model.Int4}, 3, false, job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}},
			func(spec job.Spec) int64 {
				// As int8's, with rows of a bfloat16 scale per 32 values and two codes a byte.
				rows := spec.BatchSize / spec.MicroBatches * spec.Model.BlockSize
				return 2 * int64(spec.MicroBatches) * 2 * int64(rows*kernels.Int4RowBytes(spec.Model.NEmbd))
			}},
		{"int4 activations, int8 gradients, expert host", model.Wire{Activations: model.Int4, Gradients: model.Int8}, 3, false, job.Plan{Stages: [][2]int{{0, 2}, {2, 4}},
			Experts: []job.ExpertShard{{Block: 3, Experts: []int{0, 3}, Host: 0}}}, nil},
		{"bf16 replicated expert", model.Wire{Activations: model.BF16, Gradients: model.BF16}, 4, false, job.Plan{Stages: [][2]int{{0, 2}, {2, 4}},
			Experts: []job.ExpertShard{{Block: 3, Experts: []int{1, 2}, Host: 0}, {Block: 3, Experts: []int{1}, Host: 1}}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := tinyJob(t, 6)
			// Every shard-step audited: the evidence of compressed steps reads, and recomputes
			// bit for bit.
			spec.Wire, spec.Plan, spec.AuditRate = tt.wire, &tt.plan, 1
			want, ref := localReports(t, spec)
			clusterConfig = func(cfg *Config) { cfg.Recompute = recomputeHere }
			defer func() { clusterConfig = nil }()
			c := startCluster(t, spec, tt.workers, tt.relay)
			c.run(t)
			if a := c.srv.status.Load().Audit; a == nil || a.Failed != 0 || a.Inconclusive != 0 || a.Passed < int64(spec.Steps) {
				t.Errorf("audits %+v, want every one passed", a)
			}
			sameReports(t, c.reports, want)
			assertFinalCheckpoint(t, c, ref)
			if relayed := c.relayed != 0; relayed != tt.relay {
				t.Errorf("%d bytes relayed, relay mode %v", c.relayed, tt.relay)
			}
			if st := c.srv.status.Load(); st.Plan == nil || len(st.Plan.ExpertHosts) != tt.workers-len(tt.plan.Stages) {
				t.Errorf("final plan %+v, want the pinned one's %d expert hosts", st.Plan, tt.workers-len(tt.plan.Stages))
			}
			if tt.perStep != nil {
				for _, r := range c.reports {
					if n := tt.perStep(spec); r.BytesSent != n {
						t.Errorf("step %d: the workers sent %d bytes, want %d", r.Step, r.BytesSent, n)
					}
				}
			}
			// The wire is part of the computation: float32 boundaries give other numbers — from
			// the first loss, or the second when only gradients are compressed.
			plain := spec
			plain.Wire = model.Wire{}
			s := 0
			if tt.wire.Activations == model.F32 {
				s = 1
			}
			if p, _ := localReports(t, plain); p[s].CE == want[s].CE {
				t.Errorf("step %d loss %v with %v and with float32 boundaries", s, p[s].CE, tt.wire)
			}
		})
	}
}

// TestClusterWireReplan: with int8 boundaries, a worker leaves mid-job; the coordinator replans
// over the two left — other stage cuts, experts elsewhere — restores every shard from the last
// checkpoint and replays. The job still ends on the single process's parameters, because every
// plan quantises at the same boundaries.
func TestClusterWireReplan(t *testing.T) {
	spec := tinyJob(t, 10)
	spec.Wire, spec.AuditRate = model.Wire{Activations: model.Int8, Gradients: model.Int8}, 0
	want, ref := localReports(t, spec)
	c := startCluster(t, spec, 3, false)
	c.killHolderAfter(t, 5, 1)
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	events, err := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "plan"})
	if err != nil {
		t.Fatal(err)
	}
	if len(events) < 2 {
		t.Fatalf("%d plans recorded, want a replan after the loss", len(events))
	}
	// The steps reported last (the replayed ones among them) are the single process's.
	last := map[int]local.Report{}
	for _, r := range c.reports {
		last[r.Step] = r
	}
	for _, w := range want {
		g, ok := last[w.Step]
		if !ok || g.CE != w.CE || g.GradNorm != w.GradNorm || math.IsNaN(g.ValLoss) != math.IsNaN(w.ValLoss) {
			t.Errorf("step %d: cluster %+v, one process %+v", w.Step, g, w)
		}
	}
}
