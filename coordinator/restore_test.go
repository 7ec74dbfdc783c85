package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// TestRestoreReadsItsShard: a replan from a checkpoint has each stage download the checkpoint's
// shard of its own blocks, not the whole model. A pinned pipeline of two stages over three
// workers loses the holder of its second stage after step 5; the next plan, the standby in its
// place, restores both stages from the checkpoint after step 4. The coordinator serves exactly
// that checkpoint's two shards, each once — where each stage used to download the whole-model
// file, twice the bytes here and, in a plan of S stages and R outer-mode replicas, S·R times —
// and the job ends with the single process's parameters.
func TestRestoreReadsItsShard(t *testing.T) {
	spec := tinyJob(t, 12)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	_, ref := localReports(t, spec)
	var mu sync.Mutex
	restoredFrom := -1
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, _, detail string) {
			if kind != "plan" {
				return
			}
			var d map[string]any
			json.Unmarshal([]byte(detail), &d)
			if kept, _ := d["kept"].(bool); !kept {
				mu.Lock()
				restoredFrom = int(d["from_step"].(float64))
				mu.Unlock()
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	c := startCluster(t, spec, 3, false)
	c.killHolderAfter(t, 5, 1)
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	mu.Lock()
	from := restoredFrom
	mu.Unlock()
	if from <= 0 {
		t.Fatalf("the last plan that loaded its shards started at step %d: want a restore from a checkpoint", from)
	}
	cks, err := c.srv.db.ListCheckpoints(context.Background(), mustJobID(t, c.srv))
	if err != nil {
		t.Fatal(err)
	}
	var shards []storage.Shard
	for _, ck := range cks {
		if int(ck.Step) == from {
			shards = ck.Shards
		}
	}
	if len(shards) != 2 {
		t.Fatalf("the checkpoint after step %d has shards %+v, want the two stages'", from, shards)
	}
	var want int64
	for _, sh := range shards {
		want += sh.Bytes
	}
	if got := c.srv.metrics.blobBytes.Load(); got != want {
		t.Fatalf("the coordinator served %d bytes of blobs, want %d: the checkpoint's two shards, each once", got, want)
	}
	t.Logf("restored from step %d: %d bytes served, the two stages' shards", from, want)
}

// TestLoadWait: a plan waits for Ready as long as its slowest worker's load takes at loadSafety
// times its measured uplink (the fleet mix's slowest, untimed), within the floor and the ceiling:
// not a fixed three minutes, which a 1B stage's restore over a home link overran every time.
func TestLoadWait(t *testing.T) {
	s := &Server{}
	const mb = 1 << 20
	if got := s.loadWait(nil); got != loadFloor {
		t.Errorf("nothing to load: %v, want the floor %v", got, loadFloor)
	}
	if got := s.loadWait(map[string]int64{"w": mb}); got != loadFloor {
		t.Errorf("1 MiB: %v, want the floor %v", got, loadFloor)
	}
	if got, want := s.loadWait(map[string]int64{"w": 100 * mb}), time.Duration(loadSafety*100*mb/assumedUplink*float64(time.Second)); got != want {
		t.Errorf("untimed worker, 100 MiB: %v, want %v (at 10 Mb/s)", got, want)
	}
	s.uplinks.record("w", 8*mb, 4*time.Second) // 2 MiB/s
	s.uplinks.record("v", 64*mb, time.Second)  // 64 MiB/s
	if got, want := s.loadWait(map[string]int64{"w": 1 << 30, "v": 1 << 30}), loadSafety*512*time.Second; got != want {
		t.Errorf("1 GiB each at 2 and 64 MiB/s: %v, want %v (the slower's)", got, want)
	}
	if got := s.loadWait(map[string]int64{"w": 1 << 40}); got != loadCeiling {
		t.Errorf("1 TiB: %v, want the ceiling %v", got, loadCeiling)
	}
	// A worker that trickled its uploads (here at 16 KiB/s) holds every other worker's load no
	// longer than one at the fleet's slowest link would.
	s.uplinks.record("slow", 1<<20, 64*time.Second)
	if got, want := s.loadWait(map[string]int64{"slow": 100 * mb}), time.Duration(loadSafety*100*mb/assumedUplink*float64(time.Second)); got != want {
		t.Errorf("100 MiB from a worker that uploaded at 16 KiB/s: %v, want %v (as at 10 Mb/s)", got, want)
	}
}

// TestHandoverBytes: what a taker receives before it is Ready — in step mode its blocks'
// parameters and AdamW's two moments, in outer mode their global θ alone.
func TestHandoverBytes(t *testing.T) {
	spec := tinyJob(t, 4)
	params := 0
	for _, sp := range spec.Model.StageShardSpecs(1, 3, func(int, int) bool { return true }) {
		params += sp.Size()
	}
	j := &jobRun{spec: spec}
	if got := j.handoverBytes(1, 3); got != 12*int64(params) {
		t.Errorf("step mode: %d bytes, want %d", got, 12*params)
	}
	j.spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4}
	if got := j.handoverBytes(1, 3); got != 4*int64(params) {
		t.Errorf("outer mode: %d bytes, want %d", got, 4*params)
	}
	if got := j.handoverBytes(3, 1); got != 0 {
		t.Errorf("no blocks: %d bytes", got)
	}
}

// TestCheckpointWait: a checkpoint waits for its shards as long as the largest takes to upload at
// loadSafety times its worker's uplink — a whole-model replica of the default job in outer mode
// with int8 holds 28 bytes a parameter, 181 MB, about 10 minutes at the fleet's slowest 10 Mb/s —
// and never less than the step's deadline.
func TestCheckpointWait(t *testing.T) {
	spec := job.Default()
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 20, Compress: "int8"}
	L := spec.Model.NLayer
	j := &jobRun{s: &Server{}, spec: spec, stepTimes: []time.Duration{time.Second},
		stages: []placement{{peer: "w0", begin: 0, end: L}, {peer: "w1", begin: 0, end: L, replica: 1}}}
	params := 0
	for _, sp := range spec.Model.Specs() {
		params += sp.Size()
	}
	want := time.Duration(loadSafety * 28 * float64(params) / assumedUplink * float64(time.Second))
	if got := j.checkpointWait(); got != want {
		t.Errorf("two whole-model replicas, untimed: %v, want %v (%d parameters, 28 bytes each, at 10 Mb/s)", got, want, params)
	}
	j.spec = tinyJob(t, 4)
	j.stages = []placement{{peer: "w0", begin: 0, end: j.spec.Model.NLayer}}
	if got := j.checkpointWait(); got != j.deadline() {
		t.Errorf("the tiny model: %v, want the step's deadline %v", got, j.deadline())
	}
}

// TestRestoreFor: which of a checkpoint's shards each Assign is sent, over a made-up checkpoint
// of the tiny model. In step mode a stage cut as a shard reads that shard, and one of another cut
// the shards its blocks are in; in outer mode a replica's stage reads its own replica's shard
// (which holds the global part too), and a replica new to the checkpoint one shard that holds
// the global part; an expert host, the shard of its experts.
func TestRestoreFor(t *testing.T) {
	cfg := tinyJob(t, 4).Model
	L := cfg.NLayer
	all := func(int, int) bool { return true }
	// shard makes a blob (named by its label) holding blocks [b, e)'s tensors under prefixes.
	type shard struct {
		label      string
		b, e       int
		prefixes   []string
		expertsOf  int // an expert shard's block, -1 for a stage
		expertList []int
	}
	index := func(j *jobRun, shards []shard) *proto.CheckpointRef {
		ref := &proto.CheckpointRef{Step: 8}
		j.blobNames, j.blobHolders = map[string][]string{}, map[string][]string{}
		for _, sh := range shards {
			var specs []model.Spec
			if sh.expertsOf >= 0 {
				for _, e := range sh.expertList {
					specs = append(specs, cfg.ExpertSpecs(sh.expertsOf, e)...)
				}
			} else {
				specs = cfg.StageShardSpecs(sh.b, sh.e, all)
			}
			for _, p := range sh.prefixes {
				for _, sp := range specs {
					j.blobNames[sh.label] = append(j.blobNames[sh.label], p+sp.Name)
					j.blobHolders[p+sp.Name] = append(j.blobHolders[p+sp.Name], sh.label)
				}
			}
			ref.Blobs = append(ref.Blobs, sh.label)
		}
		return ref
	}
	stage := func(b, e int) proto.Shard {
		return proto.Shard{Stage: &proto.StageShard{Begin: b, End: e, First: b == 0, Last: e == L}}
	}
	step := append([]string{""}, momentPrefixes...)

	spec := tinyJob(t, 4)
	j := &jobRun{spec: spec}
	ref := index(j, []shard{{"s0", 0, 2, step, -1, nil}, {"s1", 2, 3, step, -1, nil}, {"s2", 3, L, step, -1, nil}})
	for _, c := range []struct {
		b, e int
		want string
	}{{0, 2, "[s0]"}, {2, 3, "[s1]"}, {2, L, "[s1 s2]"}, {1, 3, "[s0 s1]"}, {0, L, "[s0 s1 s2]"}} {
		if got := j.restoreFor(ref, &proto.Assign{Shard: stage(c.b, c.e)}); fmt.Sprint(slices.Sorted(slices.Values(got.Blobs))) != c.want || got.Step != 8 {
			t.Errorf("step mode, blocks [%d,%d): %v, want %s", c.b, c.e, got.Blobs, c.want)
		}
	}
	// Experts on a host: the shard of its experts, not a larger one that holds them too.
	ref = index(j, []shard{{"st", 0, L, step, -1, nil}, {"ex", 0, 0, step, 1, []int{0, 1}}})
	host := &proto.Assign{Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 1, Experts: []int{0, 1}}}}
	if got := j.restoreFor(ref, host); fmt.Sprint(got.Blobs) != "[ex]" {
		t.Errorf("an expert host: %v, want [ex]", got.Blobs)
	}

	j.spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, Compress: "int8"}
	ref = index(j, []shard{
		{"r0", 0, L, outerPrefixes(true, []int{0}, true, false), -1, nil},
		{"r1", 0, L, outerPrefixes(true, []int{1}, true, false), -1, nil},
		{"r2", 0, L, outerPrefixes(true, []int{2}, true, false), -1, nil},
	})
	for _, c := range []struct {
		replica int
		want    string
	}{{0, "[r0]"}, {1, "[r1]"}, {2, "[r2]"}, {7, "[r0]"}} {
		a := &proto.Assign{Shard: stage(0, L), Replica: &proto.ReplicaAssign{Index: c.replica}}
		if got := j.restoreFor(ref, a); fmt.Sprint(got.Blobs) != c.want {
			t.Errorf("outer mode, replica %d: %v, want %s", c.replica, got.Blobs, c.want)
		}
	}
}
