package coordinator

import (
	"slices"
	"strconv"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/proto"
)

// TestPlanSlowPeersStandBy: two native workers and two peers that report the throughput of a
// browser tab on its CPU fallback (client.WorkerConfig.GFLOPS: 1/45 of the natives) join an
// unpinned job. The slow peers get neither a stage nor experts — any share would make them the
// step's bottleneck (sched.ExpertsPay) — and wait as standbys while the natives train.
func TestPlanSlowPeersStandBy(t *testing.T) {
	spec := tinyJob(t, 2)
	const native = 90.0
	c := startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
		cfg.GFLOPS = native
		if i >= 2 {
			cfg.GFLOPS, cfg.Kind = native/45, proto.WorkerBrowser
		}
	})
	c.run(t)
	st := c.srv.status.Load()
	if st.Plan == nil {
		t.Fatal("no plan in the status")
	}
	slow := map[string]bool{}
	for _, w := range c.srv.hub.Workers() {
		if n, _ := strconv.Atoi(w.Hello.Name); n >= 2 {
			slow[w.ID] = true
		}
	}
	if len(slow) != 2 {
		t.Fatalf("%d slow peers connected, want 2", len(slow))
	}
	for _, s := range st.Plan.Stages {
		if slow[s.Peer] {
			t.Errorf("a slow peer holds stage %v", s.Blocks)
		}
	}
	for _, h := range st.Plan.ExpertHosts {
		if slow[h.Peer] {
			t.Errorf("a slow peer hosts experts %v of block %d", h.Experts, h.Block)
		}
	}
	for id := range slow {
		if !slices.Contains(st.Plan.Standby, id) {
			t.Errorf("slow peer %s is not a standby (plan %+v)", id, st.Plan)
		}
	}
}
