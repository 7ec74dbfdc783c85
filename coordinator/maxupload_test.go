package coordinator

import (
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestMaxUploadCluster: workers whose sends are capped (`shoal worker --max-upload`:
// client.WorkerConfig.MaxUploadBytesPerS) report the cap as their link speed, which the planner
// reads, and train bit for bit as one process over both data planes — WebRTC and the relay —
// with their checkpoint uploads paced through the same bucket.
func TestMaxUploadCluster(t *testing.T) {
	for _, relay := range []bool{false, true} {
		name := "webrtc"
		if relay {
			name = "relay"
		}
		t.Run(name, func(t *testing.T) {
			spec := stopJob(t, 6, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
			spec.CheckpointEvery = 3
			want, ref := localReports(t, spec)
			const capped = 64 << 20 // bytes/s: paced, and still quick on the tiny model
			c := startCluster(t, spec, 2, relay, func(i int, cfg *client.WorkerConfig) {
				cfg.MaxUploadBytesPerS = capped
			})
			seen := 0
			c.onStep = func(local.Report) {
				for _, w := range c.srv.hub.Workers() {
					if w.Hello.LinkBytesPerS != capped {
						t.Errorf("worker %s reports a link of %v bytes/s, want its cap %v", w.ID, w.Hello.LinkBytesPerS, float64(capped))
					}
					seen++
				}
			}
			c.run(t)
			c.mu.Lock()
			sameReports(t, c.reports, want)
			c.mu.Unlock()
			if seen == 0 {
				t.Fatal("no worker seen")
			}
			assertFinalCheckpoint(t, c, ref)
		})
	}
}

// TestAuditEvidenceOutlastsItsStep: a worker uploads an audit's evidence from the memory it lies
// in (client/evidence.go), and writes it out at the next Clip when the upload is still going.
// Here every step is audited and the workers' uplinks are capped so that each upload outlasts
// several steps: every audit passes, nobody is banned or abandons, and the job trains bit for
// bit as one process — the start state kept in memory changed under no upload.
func TestAuditEvidenceOutlastsItsStep(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := stopJob(t, 6, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
	spec.AuditRate = 1
	want, ref := localReports(t, spec)
	log := watch(t, "audit.passed", "audit.abandoned", "audit.error", "peer.banned")
	prev := clusterConfig
	clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.MaxUploadBytesPerS = 4 << 20 // the tiny model's evidence, ~3.5 MB, takes about a second
	})
	// A ban or an abandoned audit leaves the pinned plan short of a worker, and the job would
	// wait for one until the deadline: fail at once.
	stop := log.failFast("audit.abandoned", "audit.error", "peer.banned")
	bad := func() []string {
		return append(append(log.of("audit.abandoned"), log.of("audit.error")...), log.of("peer.banned")...)
	}
	if c.runUntil(t, stop) {
		t.Fatalf("honest workers with slow uplinks: %v", bad())
	}
	c.mu.Lock()
	sameReports(t, c.reports, want)
	c.mu.Unlock()
	assertFinalCheckpoint(t, c, ref)
	if b := bad(); len(b) > 0 {
		t.Fatalf("honest workers with slow uplinks: %v", b)
	}
	if n := len(log.of("audit.passed")); n < 2 {
		t.Fatalf("%d audits passed, want at least one per worker", n)
	}
}
