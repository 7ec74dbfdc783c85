package sched

import (
	"fmt"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// TestShardMemoryMatchesPlanner: what a worker checks its assignment against is what the planner
// budgeted, so a planned shard always passes the worker's check (client.checkMemory).
func TestShardMemoryMatchesPlanner(t *testing.T) {
	cfg, b, M := model.DefaultConfig(), 4, 4
	prof, err := NewProfile(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	// Peers without room for the whole model, so that the plan has several stages.
	mem := int64(prof.StageMemory(0, cfg.NLayer, 0, 1, M)*3/4) + 1
	var peers []Peer
	for i := range 6 {
		peers = append(peers, Peer{ID: fmt.Sprintf("p%d", i), GFLOPS: 10, MemoryBytes: mem, LinkBytesPerS: 1e9})
	}
	plan, err := Partition(prof, peers, Options{MicroBatches: M})
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.Stages) < 2 {
		t.Fatalf("%d stages; the test wants several", len(plan.Stages))
	}
	for i, st := range plan.Stages {
		got, err := StageShardMemory(cfg, b, M, st.Begin, st.End, i, len(plan.Stages), 0, 0, ShardJob{})
		if err != nil {
			t.Fatal(err)
		}
		if got != st.MemoryBytes || got > float64(mem) {
			t.Errorf("stage %d: StageShardMemory %v, planned %v, peer offers %d", i, got, st.MemoryBytes, mem)
		}
	}

	eprof, err := NewExpertProfile(cfg, b, M)
	if err != nil {
		t.Fatal(err)
	}
	per, err := ExpertShardMemory(cfg, b, M, 1, ShardJob{})
	if err != nil {
		t.Fatal(err)
	}
	hostMem := int64(2*per) + 1 // two experts a host
	var hosts []Peer
	for i := range 4 {
		hosts = append(hosts, Peer{ID: fmt.Sprintf("h%d", i), GFLOPS: 10, MemoryBytes: hostMem, LinkBytesPerS: 1e9})
	}
	pl, err := PlaceExperts(eprof, nil, hosts, ExpertOptions{OneBlockPerHost: true})
	if err != nil {
		t.Fatal(err)
	}
	for host, specs := range ExpertShards(pl) {
		for _, s := range specs {
			if n := float64(len(s.Experts)); n > math.Floor(float64(hostMem)/per) {
				t.Errorf("host %s holds %v experts of block %d; ExpertShardMemory says %v fit", host, n, s.Block, math.Floor(float64(hostMem)/per))
			}
		}
	}
	if got, want := per, (&layout{prof: eprof}).shardMem(); got != want {
		t.Errorf("ExpertShardMemory of one expert %v, the planner's shard memory %v", got, want)
	}
}

// TestShardJobOuterBytes: what outer mode keeps in memory beside a shard's state (an audited
// job's evidence: ShardJob.OuterBytesPerParam) is counted per parameter of a stage, as the worker
// checks its assignment.
func TestShardJobOuterBytes(t *testing.T) {
	cfg := model.TinyConfig()
	prof, err := NewProfile(cfg, 2)
	if err != nil {
		t.Fatal(err)
	}
	params := float64(prof.StageParams(0, 2))
	base, err := StageShardMemory(cfg, 2, 4, 0, 2, 0, 2, 0, 0, ShardJob{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := StageShardMemory(cfg, 2, 4, 0, 2, 0, 2, 0, 0, ShardJob{OuterBytesPerParam: 4})
	if err != nil {
		t.Fatal(err)
	}
	if got-base != 4*params {
		t.Errorf("%v bytes beside the state, want 4 per parameter × %v", got-base, params)
	}
}

// TestHeapOuterOffer: a browser tab keeps its outer state on its heap, and is offered to the
// planner at memory·16/(16+outer). Every stage of the tiny and default models, planned into that
// offer, fits the tab's memory with its outer state beside it — because each keeps at least 16
// bytes a parameter — and the offer is the whole memory in step mode.
func TestHeapOuterOffer(t *testing.T) {
	if got := HeapOuterOffer(1<<30, ReplicaOptions{MicroBatches: 4}); got != 1<<30 {
		t.Errorf("step mode: offered %d of %d", got, 1<<30)
	}
	checked := 0
	for _, cfg := range []model.Config{model.TinyConfig(), model.DefaultConfig()} {
		prof, err := NewProfile(cfg, 2)
		if err != nil {
			t.Fatal(err)
		}
		L := prof.NumBlocks()
		for _, opt := range []ReplicaOptions{
			{MicroBatches: 4, Sync: SyncOuter, Every: 5},
			{MicroBatches: 4, Sync: SyncOuter, Every: 5, Int8: true, Delay: 2, OwnBatches: true},
		} {
			outer := opt.OuterStateBytes()
			for a := 0; a < L; a++ {
				for b := a + 1; b <= L; b++ {
					need := ReplicaStageMemory(prof, a, b, 0, 1, 0, 1, 0, opt)
					memory := int64(math.Ceil(need*(StateBytesPerParam+outer)/StateBytesPerParam)) + 1
					if offer := HeapOuterOffer(memory, opt); float64(offer) < need {
						continue // the offer's rounding: the planner would not place it
					}
					checked++
					if total := need + outer*float64(prof.StageParams(a, b)); total > float64(memory) {
						t.Errorf("%d blocks, blocks [%d,%d), outer %v B/param: %v bytes with the outer state on the heap, the tab has %d", L, a, b, outer, total, memory)
					}
				}
			}
		}
	}
	if checked == 0 {
		t.Fatal("no stage was checked")
	}
}

// TestReplicaShardMemory: a replica's stage is checked with the replica planner's own formula.
// In step mode its gradient tree is its run of the step's tree, which for micro-batches [1,3) of
// 4 takes two buffers where a tree of 2 micro-batches from 0 takes one: checking it as a pipeline
// of 2 micro-batches under-counted. In outer mode each replica's inner step is a tree of its own,
// and the outer state is counted once.
func TestReplicaShardMemory(t *testing.T) {
	cfg, b, M := model.DefaultConfig(), 4, 4
	L := cfg.NLayer
	step := ReplicaOptions{MicroBatches: M}
	got, err := ReplicaShardMemory(cfg, b, 0, L, 0, 1, 1, 2, 1, ShardJob{}, step)
	if err != nil {
		t.Fatal(err)
	}
	prof, _ := NewProfile(cfg, b)
	if want := ReplicaStageMemory(prof, 0, L, 0, 1, 1, 2, 1, step); got != want {
		t.Errorf("step mode: %v bytes, the planner budgets %v", got, want)
	}
	asPipeline, err := StageShardMemory(cfg, b, 2, 0, L, 0, 1, 0, 1, ShardJob{})
	if err != nil {
		t.Fatal(err)
	}
	if extra := got - asPipeline; extra != 4*float64(prof.StageParams(0, L)) {
		t.Errorf("step mode, micro-batches [1,3) of 4: %v bytes more than a pipeline of 2, want one gradient buffer (%d parameters)", extra, prof.StageParams(0, L))
	}
	outer := ReplicaOptions{MicroBatches: M, Sync: SyncOuter, Every: 5, Int8: true}
	sj := ShardJob{} // the outer state is on disk
	got, err = ReplicaShardMemory(cfg, b, 0, L, 0, 1, 1, 2, 1, sj, outer)
	if err != nil {
		t.Fatal(err)
	}
	// Outer mode: a pipeline of 2 micro-batches without its one tree buffer (the inner step sums
	// in a chain), and without the outer state, which is on disk.
	if want, _ := StageShardMemory(cfg, b, 2, 0, L, 0, 1, 0, 1, sj); got != want-4*float64(prof.StageParams(0, L)) {
		t.Errorf("outer mode: %v bytes, want %v (a pipeline of 2 without its tree buffer)", got, want-4*float64(prof.StageParams(0, L)))
	}
	// What outer mode keeps in memory — an audited job's evidence of the step before an outer
	// step, ShardJob.OuterBytesPerParam — counts.
	const evidence = 4
	audited := sj
	audited.OuterBytesPerParam += evidence
	withEvidence, err := ReplicaShardMemory(cfg, b, 0, L, 0, 1, 1, 2, 1, audited, outer)
	if err != nil {
		t.Fatal(err)
	}
	if extra := withEvidence - got; extra != evidence*float64(prof.StageParams(0, L)) {
		t.Errorf("outer mode, audited: %v bytes more, want %v a parameter", extra, evidence)
	}
	if _, err := ReplicaShardMemory(cfg, b, 0, L, 0, 1, 3, 2, 0, ShardJob{}, step); err == nil {
		t.Error("micro-batches [3,5) of 4 accepted")
	}
	// Own batches: a replica's batch is [0, n), n up to MaxOwnMicroBatches, more than M for a
	// fast replica, budgeted by the planner's formula; beyond the bound, or not from 0, refused.
	own := outer
	own.OwnBatches = true
	most := MaxOwnMicroBatches(M, b*cfg.BlockSize)
	got, err = ReplicaShardMemory(cfg, b, 0, L, 0, 1, 0, 3*M, 1, sj, own)
	if err != nil {
		t.Fatalf("own batch of %d micro-batches (M %d): %v", 3*M, M, err)
	}
	if want := ReplicaStageMemory(prof, 0, L, 0, 1, 0, 3*M, 1, own); got != want {
		t.Errorf("own batch of %d: %v bytes, the planner budgets %v", 3*M, got, want)
	}
	for _, c := range [][2]int{{0, most + 1}, {1, 2}, {0, 0}} {
		if _, err := ReplicaShardMemory(cfg, b, 0, L, 0, 1, c[0], c[1], 0, sj, own); err == nil {
			t.Errorf("own batch micro-batches [%d,%d) accepted (at most %d from 0)", c[0], c[0]+c[1], most)
		}
	}
	if _, err := ReplicaShardMemory(cfg, b, 0, L, 0, 1, 1, 2, 2, ShardJob{}, step); err == nil {
		t.Error("depth 2 for a share of 2 accepted")
	}
}

// TestExpertShardMemoryRuns: a host serving several replicas' runs of micro-batches budgets the
// node buffers of every run at once, beyond one run's from micro-batch 0; one run is
// ExpertShardMemory itself.
func TestExpertShardMemoryRuns(t *testing.T) {
	cfg := model.TinyConfig()
	var j ShardJob
	one, err := ExpertShardMemory(cfg, 2, 4, 2, j)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := ExpertShardMemoryRuns(cfg, 2, 4, 2, [][2]int{{0, 4}}, j); err != nil || got != one {
		t.Errorf("one run: %v, %v; want %v", got, err, one)
	}
	_, prof, err := j.Profiles(cfg, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	// [0,3) holds 2 buffers at most and [3,4) 1, where [0,4) holds 2: one more per expert.
	got, err := ExpertShardMemoryRuns(cfg, 2, 4, 2, [][2]int{{0, 3}, {3, 4}}, j)
	if want := one + 2*4*float64(prof.Params); err != nil || got != want {
		t.Errorf("runs [0,3) and [3,4): %v, %v; want %v", got, err, want)
	}
	if _, err := ExpertShardMemoryRuns(cfg, 2, 4, 2, [][2]int{{0, 3}, {3, 5}}, j); err == nil {
		t.Error("a run past the step's micro-batches accepted")
	}
}

// TestReplicaStageMemoryRouteLog: a step-mode stage of a pipeline replica keeps, for a step, the
// boundary tensors it sends (a pool mate taking its neighbour over is sent them all again), and
// the planner and the worker's check count them: n activations and n gradients as the wire carries
// them, for every stage of two or more (the planner cannot know which will be pooled). A
// whole-model replica sends nothing, and outer mode takes no stage over.
func TestReplicaStageMemoryRouteLog(t *testing.T) {
	cfg, b, M := model.DefaultConfig(), 4, 8
	L := cfg.NLayer
	prof, err := NewProfile(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	step := ReplicaOptions{MicroBatches: M}
	outer := ReplicaOptions{MicroBatches: M, Sync: SyncOuter, Every: 5}
	per := prof.BoundaryBytes + prof.GradBoundaryBytes
	for _, tc := range []struct {
		name  string
		S, n  int
		opt   ReplicaOptions
		route float64
	}{
		{"step, 2 stages, 3 micro-batches", 2, 3, step, 3 * per},
		{"step, 4 stages, 8 micro-batches", 4, 8, step, 8 * per},
		{"step, whole model", 1, 3, step, 0},
		{"outer, 2 stages", 2, 3, outer, 0},
	} {
		got := ReplicaStageMemory(prof, 0, L/tc.S, 0, tc.S, 0, tc.n, 0, tc.opt)
		c := prof.stageCost(0, L/tc.S)
		without := c.StateBytes + tc.opt.treeBytesPerParam(0, tc.n)*float64(c.Params) +
			max(float64(InFlight(0, tc.S, tc.n, 0))*c.ActBytes, c.EvalActBytes)
		if got-without != tc.route {
			t.Errorf("%s: %v bytes beyond the rest, want a route log of %v", tc.name, got-without, tc.route)
		}
		// The worker checks its assignment by the same formula.
		w, err := ReplicaShardMemory(cfg, b, 0, L/tc.S, 0, tc.S, 0, tc.n, 0, ShardJob{}, tc.opt)
		if err != nil {
			t.Fatal(err)
		}
		if w != got {
			t.Errorf("%s: the worker counts %v bytes, the planner %v", tc.name, w, got)
		}
	}
	// With int8 boundaries the log is of what the wire carries.
	p8 := prof.WithWire(model.Wire{Activations: model.Int8, Gradients: model.Int8})
	if p8.BoundaryBytes >= prof.BoundaryBytes {
		t.Fatalf("int8 wire: %v bytes a boundary, f32 %v", p8.BoundaryBytes, prof.BoundaryBytes)
	}
	if got := step.routeBytes(p8, 2, 3); got != 3*(p8.BoundaryBytes+p8.GradBoundaryBytes) {
		t.Errorf("int8 wire: route log %v", got)
	}
}
