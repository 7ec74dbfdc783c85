package coordinator

import (
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// outerSpec is the default job in outer mode over the tiny model: int8, M micro-batches.
func outerSpec(M int) job.Spec {
	s := job.Default()
	s.Model = model.TinyConfig()
	s.BatchSize, s.MicroBatches = 2*M, M
	s.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	return s
}

// TestPlannedMemory: a peer's memory, as every plan check reads it, is what it offered, except
// in outer mode for a worker that keeps the outer state on its heap — a browser tab, or one that
// says so (a Windows worker) — which is offered at what that state leaves. A native worker maps
// the state from a file and offers all of it.
func TestPlannedMemory(t *testing.T) {
	const mem = 4 << 30
	native := &peer{hello: &proto.Hello{Kind: proto.WorkerNative, MemoryBytes: mem}}
	heap := &peer{hello: &proto.Hello{Kind: proto.WorkerNative, MemoryBytes: mem, OuterOnHeap: true}}
	tab := &peer{hello: &proto.Hello{Kind: proto.WorkerBrowser, MemoryBytes: mem}}
	outer := &jobRun{spec: outerSpec(4)}
	step := &jobRun{spec: job.Default()}
	want := sched.HeapOuterOffer(mem, outer.spec.ReplicaOptions())
	if want >= mem || want <= 0 {
		t.Fatalf("HeapOuterOffer(%d) = %d", int64(mem), want)
	}
	for _, tc := range []struct {
		name string
		j    *jobRun
		p    *peer
		want int64
	}{
		{"native, outer", outer, native, mem},
		{"tab, outer", outer, tab, want},
		{"native with its state on the heap, outer", outer, heap, want},
		{"tab, step", step, tab, mem},
		{"native with its state on the heap, step", step, heap, mem},
		{"no hello", outer, &peer{}, 1},
	} {
		if got := tc.j.plannedMemory(tc.p); got != tc.want {
			t.Errorf("%s: planned at %d bytes, want %d", tc.name, got, tc.want)
		}
	}
}

// TestPlanDepthReplicas: the depth of a plan of replicas is chosen by the formula its workers
// check their Assigns with (sched.ReplicaShardMemory), not the pipeline's: in outer mode the
// pipeline's counts a gradient tree of M micro-batches the replica never keeps, and kept a
// whole replica that fits at depth 1 at depth 0.
func TestPlanDepthReplicas(t *testing.T) {
	const M = 4
	spec := outerSpec(M)
	spec.AuditRate, spec.ValEvery = 0, 0
	L := spec.Model.NLayer
	b := spec.BatchSize / M
	asReplica, err := sched.ReplicaShardMemory(spec.Model, b, 0, L, 0, 1, 0, M, 1, spec.ShardJob(), spec.ReplicaOptions())
	if err != nil {
		t.Fatal(err)
	}
	asPipeline, err := sched.StageShardMemory(spec.Model, b, M, 0, L, 0, 1, 0, 1, spec.ShardJob())
	if err != nil {
		t.Fatal(err)
	}
	if asPipeline <= asReplica {
		t.Fatalf("the pipeline formula (%v) is not above the replica's (%v): the test shows nothing", asPipeline, asReplica)
	}
	deeper, err := sched.ReplicaShardMemory(spec.Model, b, 0, L, 0, 1, 0, M, 2, spec.ShardJob(), spec.ReplicaOptions())
	if err != nil {
		t.Fatal(err)
	}
	mem := int64(asReplica) + 1
	if float64(mem) >= deeper {
		t.Fatalf("depth 2 (%v bytes) fits %d too: the test cannot tell the depth", deeper, mem)
	}
	j := &jobRun{spec: spec, peers: map[string]*peer{
		"a": {id: "a", hello: &proto.Hello{Kind: proto.WorkerNative, MemoryBytes: mem}},
		"b": {id: "b", hello: &proto.Hello{Kind: proto.WorkerNative, MemoryBytes: mem}},
	}}
	stages := []placement{{peer: "a", begin: 0, end: L, replica: 0, n: M}, {peer: "b", begin: 0, end: L, replica: 1, n: M}}
	if got := j.planDepth(stages, nil); got != 1 {
		t.Errorf("two whole replicas offered %d bytes (the replica formula's at depth 1): depth %d, want 1", mem, got)
	}
}
