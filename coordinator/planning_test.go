package coordinator

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
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

// TestPlannerChoosesReplicas: on an unpinned job the coordinator plans pipeline replicas itself
// when it estimates them faster, and says why either way. Two equal workers on the tiny job: in
// outer mode (replicas talk every 3 steps) two one-stage replicas win and the run equals the
// single process given the same replicas; in step mode, where replicas exchange the whole
// gradient every step through data channels of bounded speed, one pipeline wins. (The
// estimates' inputs are the workers' claimed GFLOP/s and the data plane's bound, not timings, so
// the choice does not depend on how busy the machine is.)
func TestPlannerChoosesReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: trains two jobs")
	}
	t.Run("outer", func(t *testing.T) {
		spec := tinyJob(t, 6)
		spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 3, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
		// Workers that claim a browser tab's CPU speed, so that compute, not the 3-step sync, dominates.
		c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) { cfg.GFLOPS = 1 })
		c.run(t)
		p := c.srv.status.Load().Plan
		if p == nil || p.Replicas != 2 || !strings.HasPrefix(p.Choice, "2 replicas, outer sync: estimated") {
			t.Fatalf("plan %+v: want 2 replicas chosen by the planner", p)
		}
		// The single process, told the replicas the planner chose, computes the same steps.
		pinned := &job.Plan{}
		for k, st := range p.Stages {
			if k == 0 || st.Replica != p.Stages[k-1].Replica {
				pinned.Replicas = append(pinned.Replicas, job.ReplicaPlan{MicroBatches: st.MicroBatches[1] - st.MicroBatches[0]})
			}
			r := &pinned.Replicas[len(pinned.Replicas)-1]
			r.Stages = append(r.Stages, st.Blocks)
		}
		spec.Plan = pinned
		want, _ := localReports(t, spec)
		sameReports(t, c.reports, want)
	})
	t.Run("outer-own", func(t *testing.T) {
		// Own batches: three workers form three replicas of a job of two micro-batches, each
		// training a batch of its own — more replicas than micro-batches.
		spec := tinyJob(t, 4)
		spec.MicroBatches = 2
		spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 2, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Batches: job.BatchesOwn}
		c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) { cfg.GFLOPS = 1 })
		c.run(t)
		p := c.srv.status.Load().Plan
		if p == nil || p.Replicas != 3 || spec.MicroBatches >= 3 || !strings.HasPrefix(p.Choice, "3 replicas, outer sync: estimated") {
			t.Fatalf("plan %+v: want 3 replicas of own batches chosen by the planner (M %d)", p, spec.MicroBatches)
		}
		pinned := &job.Plan{}
		for k, st := range p.Stages {
			if st.MicroBatches != [2]int{0, spec.MicroBatches} {
				t.Fatalf("stage %+v: want every micro-batch of its own batch", st)
			}
			if k == 0 || st.Replica != p.Stages[k-1].Replica {
				pinned.Replicas = append(pinned.Replicas, job.ReplicaPlan{MicroBatches: spec.MicroBatches})
			}
			r := &pinned.Replicas[len(pinned.Replicas)-1]
			r.Stages = append(r.Stages, st.Blocks)
		}
		spec.Plan = pinned
		want, _ := localReports(t, spec)
		sameReports(t, c.reports, want)
	})
	t.Run("step", func(t *testing.T) {
		spec := tinyJob(t, 2)
		c := startCluster(t, spec, 2, false)
		c.run(t)
		p := c.srv.status.Load().Plan
		if p == nil || p.Replicas != 1 || !strings.HasPrefix(p.Choice, "one pipeline: ") {
			t.Fatalf("plan %+v: want one pipeline, with the planner's reason", p)
		}
		t.Log(p.Choice)
	})
}
