package coordinator

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
)

// TestOuterWarmup: an outer-mode job with a synchronous warm-up (job.Sync.Warmup) of 4 steps of 10,
// two whole-model replicas. Steps 0–3 run in step mode — one plan whose replicas share the
// step's batch, their gradients reduced every step — and at step 4 the job checkpoints, replans
// once ("replan.warmup"), and every replica's stage keeps the state it holds — the warm-up's, the
// same in every replica — into outer mode, nothing restored (proto.Keep; client warmingOut): θ_r
// and the global θ the warm-up's parameters, AdamW's moments carried over, the outer state zero;
// outer steps after steps 6 and 9 (every 3, counted from 4). The losses and final parameters are
// one process's (local: step mode, then outer mode from the same state), bit for bit. With
// audits, every shard's state after the switch is the one custody expects from the warm-up's
// checkpoint, and honest workers pass the audits of both phases. No step is abandoned.
func TestOuterWarmup(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		name    string
		batches string
		audit   float64
	}{{"own", job.BatchesOwn, 0}, {"shared-audited", job.BatchesShared, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := outerJob(t, 10, job.Sync{Every: 3, Compress: "int8", Batches: tc.batches}, 2, 2)
			w := 4
			spec.Sync.Warmup = &w
			spec.CheckpointEvery, spec.ValEvery, spec.AuditRate = 3, 4, tc.audit
			log := watch(t, "plan", "replan.warmup", "step.abandoned", "peer.banned", "audit.passed", "state.disputed", "custody.error", "audit.error")
			more := log
			watched := clusterConfig
			clusterConfig = func(cfg *Config) {
				watched(cfg)
				cfg.Recompute = recomputeHere
			}
			c := startCluster(t, spec, 2, false, slowWorkers)
			c.run(t)
			c.finished(t, spec.Steps)
			if a := more.of("step.abandoned"); len(a) > 0 {
				t.Fatalf("steps abandoned: %v", a)
			}
			if r := more.of("replan.warmup"); len(r) != 1 || !strings.Contains(r[0], `"step":4`) {
				t.Fatalf("replan.warmup events %v: want one, at step 4", r)
			}
			plans := more.planList()
			first, last := plans[0], plans[len(plans)-1]
			if first.Sync != job.SyncStep || first.FromStep != 0 || first.WarmupUntil != 4 || last.Sync != job.SyncOuter || last.FromStep != 4 || last.WarmupUntil != 0 || last.KeptFrom != first.Version {
				b, _ := json.Marshal(plans)
				t.Fatalf("plans %s: want step mode from step 0 (the warm-up, until 4), outer mode from step 4 keeping its shards", b)
			}
			if b := log.of("peer.banned"); len(b) > 0 {
				t.Fatalf("honest workers banned: %v", b)
			}
			for _, k := range []string{"state.disputed", "custody.error", "audit.error"} {
				if e := log.of(k); len(e) > 0 {
					t.Errorf("%s: %v", k, e)
				}
			}
			if tc.audit > 0 {
				passed := log.of("audit.passed")
				t.Logf("%d audits passed", len(passed))
				if len(passed) < 4 {
					t.Fatalf("%d audits passed: %v", len(passed), passed)
				}
			}
			sameAsReplay(t, c, spec, replayOf(t, plans))
		})
	}
}
