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

// TestShardJobOuterState: outer mode's state — the global θ and its momentum, and with int8 the
// two error feedbacks — is counted per parameter of a stage, as the worker checks its assignment.
func TestShardJobOuterState(t *testing.T) {
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
	for _, q8 := range []bool{false, true} {
		got, err := StageShardMemory(cfg, 2, 4, 0, 2, 0, 2, 0, 0, ShardJob{OuterBytesPerParam: OuterStateBytesPerParam(q8)})
		if err != nil {
			t.Fatal(err)
		}
		want := map[bool]float64{false: 8, true: 16}[q8]
		if got-base != want*params {
			t.Errorf("int8 %v: outer state %v bytes, want %v per parameter × %v", q8, got-base, want, params)
		}
	}
}
