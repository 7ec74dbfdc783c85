package coordinator

import (
	"maps"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
)

// TestClusterQUICEqualsLocal: two native workers in a pinned 2-stage pipeline open their link
// over WebRTC and move their frames on QUIC on the pair ICE selected (issue 34); every step's
// loss and the final checkpoint equal the single process's bit for bit.
func TestClusterQUICEqualsLocal(t *testing.T) {
	spec := tinyJob(t, 4)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	want, ref := localReports(t, spec)
	var mu sync.Mutex
	links := map[int]map[string]string{} // the last step's links, by worker
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.OnStatus = func(s client.Status) {
			if s.LastStep != nil {
				mu.Lock()
				links[i] = maps.Clone(s.LastStep.Links)
				mu.Unlock()
			}
		}
	})
	c.run(t)
	sameReports(t, c.reports, want)
	assertFinalCheckpoint(t, c, ref)
	if c.relayed != 0 {
		t.Errorf("%d bytes relayed", c.relayed)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range 2 {
		l := links[i]
		for _, path := range l {
			if path != "quic" {
				t.Errorf("worker %d's links at its last step: %v, want its neighbour on quic", i, l)
			}
		}
		if len(l) != 1 {
			t.Errorf("worker %d's links at its last step: %v, want one neighbour", i, l)
		}
	}
}
