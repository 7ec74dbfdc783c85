package coordinator

import (
	"context"
	"encoding/json"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// TestPlanDepth: the coordinator keeps as many micro-batches in flight as every stage's offered
// memory allows (the worker's own estimate, sched.StageShardMemory, remote experts left
// out), up to M−1; a pinned depth is taken as it is.
func TestPlanDepth(t *testing.T) {
	spec := job.Default() // the default model, B 16, M 4
	// Without validation: its pass of 16 sequences would outweigh every depth's micro-batches.
	spec.ValEvery = 0
	cfg, M := spec.Model, spec.MicroBatches
	b := spec.BatchSize / M
	stages := []placement{{peer: "a", begin: 0, end: 2, n: M}, {peer: "b", begin: 2, end: 4, n: M}}
	// Block 1's experts all live on expert host "h": stage 0 does not hold their state.
	hosted := map[[2]int][]string{}
	for e := 0; e < cfg.NExpert; e++ {
		hosted[[2]int{1, e}] = []string{"h"}
	}
	need := func(i, remote, depth int) int64 {
		n, err := sched.StageShardMemory(cfg, b, M, stages[i].begin, stages[i].end, i, len(stages), remote, depth, spec.ShardJob())
		if err != nil {
			t.Fatal(err)
		}
		return int64(math.Ceil(n))
	}
	const ample = 1 << 50
	pin := func(d int) *int { return &d }
	for _, tc := range []struct {
		name       string
		memA, memB int64
		replicas   map[[2]int][]string
		pinned     *int
		want       int
	}{
		{"ample-memory", ample, ample, nil, nil, M - 1},
		{"stage-0-fits-depth-1", need(0, 0, 1), ample, nil, nil, 1},
		{"stage-1-fits-depth-2", ample, need(1, 0, 2), nil, nil, 2},
		{"stage-1-fits-depth-0", ample, need(1, 0, 0), nil, nil, 0},
		{"nothing-fits", need(0, 0, 0) - 1, ample, nil, nil, 0},
		{"remote-experts-make-room", need(0, cfg.NExpert, 1), ample, hosted, nil, 1},
		{"pinned", 1, 1, nil, pin(2), 2},
		{"pinned-0", ample, ample, nil, pin(0), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec
			if tc.pinned != nil {
				s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}, Depth: tc.pinned}
			}
			j := &jobRun{spec: s, peers: map[string]*peer{
				"a": {id: "a", hello: &proto.Hello{MemoryBytes: tc.memA}},
				"b": {id: "b", hello: &proto.Hello{MemoryBytes: tc.memB}},
			}}
			if got := j.planDepth(stages, tc.replicas); got != tc.want {
				t.Errorf("depth %d, want %d", got, tc.want)
			}
		})
	}
}

// TestClusterPinnedDepth: a pinned plan of 3 stages with 2 extra micro-batches in flight, one
// MoE block's experts on an expert host that follows the same schedule: the job computes what the
// single process does bit for bit, and the plan's status and event say the depth.
func TestClusterPinnedDepth(t *testing.T) {
	spec := tinyJob(t, 3)
	depth := 2
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}, Depth: &depth,
		Experts: []job.ExpertShard{{Block: 1, Experts: []int{0, 1, 2, 3}, Host: 0}}}
	want, _ := localReports(t, spec)
	c := startCluster(t, spec, 4, false)
	c.run(t)
	sameReports(t, c.reports, want)
	if st := c.srv.status.Load(); st.Plan == nil || st.Plan.Depth != depth {
		t.Errorf("plan status %+v, want depth %d", st.Plan, depth)
	}
	plans, _ := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "plan"})
	if len(plans) != 1 {
		t.Fatalf("%d plans", len(plans))
	}
	var ev struct {
		Depth *int `json:"depth"`
	}
	if err := json.Unmarshal(plans[0].Message, &ev); err != nil || ev.Depth == nil || *ev.Depth != depth {
		t.Errorf("plan event %s (%v), want depth %d", plans[0].Message, err, depth)
	}
}
