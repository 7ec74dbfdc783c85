package job

import (
	"encoding/json"
	"errors"
	"github.com/shoal-ml/shoal/sched"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

func defaultJSON(t *testing.T) map[string]any {
	t.Helper()
	b, err := json.Marshal(Default())
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestDefaultRoundTrips(t *testing.T) {
	b, _ := json.Marshal(Default())
	s, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	b2, _ := json.Marshal(s)
	if string(b) != string(b2) {
		t.Fatalf("round trip changed the spec:\n%s\n%s", b, b2)
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name   string
		edit   func(m map[string]any)
		wantIn string
	}{
		{"missing field", func(m map[string]any) { delete(m, "clip") }, `"clip"`},
		{"missing model key", func(m map[string]any) { delete(m["model"].(map[string]any), "top_k") }, `"top_k"`},
		{"unknown field", func(m map[string]any) { m["learning_rate"] = 1 }, "learning_rate"},
		{"unknown model key", func(m map[string]any) { m["model"].(map[string]any)["dropout"] = 0.1 }, "dropout"},
		{"micro-batches do not divide", func(m map[string]any) { m["micro_batches"] = 3 }, "micro_batches"},
		{"negative lr", func(m map[string]any) { m["lr"] = -1 }, "lr"},
		{"bad heads", func(m map[string]any) { m["model"].(map[string]any)["n_head"] = 3 }, "n_head"},
		{"top_k above experts", func(m map[string]any) { m["model"].(map[string]any)["top_k"] = 5 }, "top_k"},
		{"plan gap", func(m map[string]any) { m["plan"] = map[string]any{"stages": [][2]int{{0, 1}, {2, 4}}} }, "tile"},
		{"plan expert on dense block", func(m map[string]any) {
			m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}, "experts": []any{map[string]any{"block": 0, "experts": []int{0}, "host": 0}}}
		}, "not an MoE block"},
		{"plan depth negative", func(m map[string]any) { m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}, "depth": -1} }, "depth"},
		{"plan depth at micro_batches", func(m map[string]any) { m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}, "depth": 4} }, "depth"},
		{"plan depth not a number", func(m map[string]any) { m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}, "depth": "deep"} }, "depth"},
		{"wrong type", func(m map[string]any) { m["steps"] = "many" }, "steps"},
		{"replicas and stages", func(m map[string]any) {
			m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}, "replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 4}}}
		}, "not both"},
		{"replica shares short", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 1},
				map[string]any{"stages": [][2]int{{0, 2}, {2, 4}}, "micro_batches": 2}}}
		}, "add up to 3"},
		{"replica without micro-batches", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 4},
				map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 0}}}
		}, "replica 1: micro_batches 0"},
		{"replica gap", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 1}, {2, 4}}, "micro_batches": 4}}}
		}, "replica 0: stage 1"},
		{"sync mode unknown", func(m map[string]any) { m["sync"] = map[string]any{"mode": "gossip"} }, `"gossip"`},
		{"sync step with outer keys", func(m map[string]any) { m["sync"] = map[string]any{"mode": "step", "every": 5} }, "belong to mode"},
		{"sync outer without every", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none"}
		}, "every 0"},
		{"sync outer momentum 1", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 1, "compress": "none"}
		}, "outer_momentum"},
		{"sync outer compress unknown", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "fp4"}
		}, `"fp4"`},
		{"sync outer one pinned pipeline", func(m map[string]any) {
			m["plan"] = map[string]any{"stages": [][2]int{{0, 4}}}
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none"}
		}, "needs replicas"},
		{"replicas with a replicated expert", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 2},
				map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 2}},
				"experts": []any{map[string]any{"block": 1, "host": 0, "experts": []int{0}}, map[string]any{"block": 1, "host": 1, "experts": []int{0}}}}
		}, "on two hosts"},
		{"replicas with an expert of no block", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 4}},
				"experts": []any{map[string]any{"block": 0, "host": 0, "experts": []int{0}}}}
		}, "not an MoE block"},
		{"sync outer with expert hosts", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 2},
				map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 2}},
				"experts": []any{map[string]any{"block": 1, "host": 0, "experts": []int{0, 1}}}}
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none"}
		}, "no expert hosts"},
		{"sync batches unknown", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "batches": "mine"}
		}, `"mine"`},
		{"sync step with batches", func(m map[string]any) { m["sync"] = map[string]any{"mode": "step", "batches": "own"} }, "belong to mode"},
		{"sync step with delay", func(m map[string]any) { m["sync"] = map[string]any{"mode": "step", "delay": 2} }, "belong to mode"},
		{"delay of a whole round", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "delay": 20}
		}, "delay 20 must be in [0, every) = [0, 20)"},
		{"negative delay", func(m map[string]any) {
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "delay": -1}
		}, "delay -1 must be in"},
		{"own batch of no micro-batch", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 4},
				map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 0}}}
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "batches": "own"}
		}, "replica 1: micro_batches 0 must be positive"},
		{"own batch beyond 64·M", func(m map[string]any) {
			m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 4},
				map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 257}}}
			m["sync"] = map[string]any{"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "batches": "own"}
		}, "replica 1 has micro_batches 257; with batches \"own\" a replica trains 1 to 256 micro-batches"},
		{"missing wire", func(m map[string]any) { delete(m, "wire") }, `"wire"`},
		{"wire without gradients", func(m map[string]any) { m["wire"] = map[string]any{"activations": "int8"} }, `"gradients"`},
		{"wire format unknown", func(m map[string]any) { m["wire"] = map[string]any{"activations": "fp8", "gradients": "f32"} }, `"fp8"`},
		{"wire key unknown", func(m map[string]any) {
			m["wire"] = map[string]any{"activations": "f32", "gradients": "f32", "partials": "int8"}
		}, "partials"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := defaultJSON(t)
			tc.edit(m)
			b, _ := json.Marshal(m)
			_, err := Parse(b)
			if !errors.Is(err, ErrSpec) {
				t.Fatalf("got %v, want an ErrSpec", err)
			}
			if !strings.Contains(err.Error(), tc.wantIn) {
				t.Errorf("error %q does not mention %s", err, tc.wantIn)
			}
		})
	}
}

func TestWire(t *testing.T) {
	if w := Default().Wire; w != (model.Wire{Activations: model.F32, Gradients: model.F32}) {
		t.Errorf("default wire %v, want float32 both ways", w)
	}
	m := defaultJSON(t)
	if got, _ := json.Marshal(m["wire"]); string(got) != `{"activations":"f32","gradients":"f32"}` {
		t.Errorf("default wire JSON %s", got)
	}
	m["wire"] = map[string]any{"activations": "int8", "gradients": "bf16"}
	b, _ := json.Marshal(m)
	s, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if s.Wire != (model.Wire{Activations: model.Int8, Gradients: model.BF16}) {
		t.Errorf("parsed wire %v", s.Wire)
	}
	s.Wire.Gradients = 7
	if err := s.Validate(); !errors.Is(err, ErrSpec) || !strings.Contains(err.Error(), "wire") {
		t.Errorf("Validate of a bad format: %v", err)
	}
}

func TestPinnedPlan(t *testing.T) {
	m := defaultJSON(t)
	m["plan"] = map[string]any{"stages": [][2]int{{0, 2}, {2, 4}},
		"experts": []any{map[string]any{"block": 1, "experts": []int{0, 1}, "host": 0}, map[string]any{"block": 1, "experts": []int{1}, "host": 1}}}
	b, _ := json.Marshal(m)
	s, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Plan.Stages) != 2 || len(s.Plan.Experts) != 2 {
		t.Fatalf("plan %+v", s.Plan)
	}
}

func TestLRSchedule(t *testing.T) {
	s := Default()
	// The anchor: 1e-3 * min(1, (s+1)/100) * (0.1 + 0.45 * (1 + cos(pi * s / 600))).
	for _, step := range []int{0, 1, 50, 99, 100, 300, 599} {
		want := 1e-3 * math.Min(1, float64(step+1)/100) * (0.1 + 0.45*(1+math.Cos(math.Pi*float64(step)/600)))
		if got := s.LRAt(step); math.Abs(got-want) > 1e-18 {
			t.Errorf("step %d: lr %g, want %g", step, got, want)
		}
	}
	s.Warmup = 0
	if got := s.LRAt(0); got != s.LR {
		t.Errorf("no warm-up: step 0 lr %g, want %g", got, s.LR)
	}
}

// TestPinnedPlanDepth: a pinned plan may state the pipeline depth (0 ≤ depth < micro_batches);
// without the key the coordinator chooses, which is not the same as a pinned 0.
func TestPinnedPlanDepth(t *testing.T) {
	for _, tc := range []struct {
		plan map[string]any
		want *int
	}{
		{map[string]any{"stages": [][2]int{{0, 2}, {2, 4}}}, nil},
		{map[string]any{"stages": [][2]int{{0, 2}, {2, 4}}, "depth": 0}, new(int)},
		{map[string]any{"stages": [][2]int{{0, 2}, {2, 4}}, "depth": 3}, func() *int { d := 3; return &d }()},
	} {
		m := defaultJSON(t)
		m["plan"] = tc.plan
		b, _ := json.Marshal(m)
		s, err := Parse(b)
		if err != nil {
			t.Fatalf("%v: %v", tc.plan, err)
		}
		if got := s.Plan.Depth; (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("%v: depth %v, want %v", tc.plan, got, tc.want)
		}
		b2, _ := json.Marshal(s)
		if s2, err := Parse(b2); err != nil || (s2.Plan.Depth == nil) != (tc.want == nil) {
			t.Errorf("%v: round trip %s: %v", tc.plan, b2, err)
		}
	}
}

// TestPinnedReplicas: a pinned plan's replicas take the step's micro-batches in replica order, and
// a plain "stages" plan is the one replica computing all of them.
func TestPinnedReplicas(t *testing.T) {
	m := defaultJSON(t)
	m["plan"] = map[string]any{"replicas": []any{map[string]any{"stages": [][2]int{{0, 2}, {2, 4}}, "micro_batches": 3},
		map[string]any{"stages": [][2]int{{0, 4}}, "micro_batches": 1}}}
	m["sync"] = map[string]any{"mode": "step"}
	b, _ := json.Marshal(m)
	s, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	got := s.PinnedReplicas()
	want := []Replica{{Stages: [][2]int{{0, 2}, {2, 4}}, First: 0, MicroBatches: 3}, {Stages: [][2]int{{0, 4}}, First: 3, MicroBatches: 1}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("replicas %+v, want %+v", got, want)
	}
	if s.Outer() {
		t.Fatal("step mode reported as outer")
	}
	s.Plan = &Plan{Stages: [][2]int{{0, 4}}}
	if got := s.PinnedReplicas(); len(got) != 1 || got[0].First != 0 || got[0].MicroBatches != s.MicroBatches {
		t.Fatalf("a stages plan gave replicas %+v", got)
	}
	s.Plan = nil
	if s.PinnedReplicas() != nil {
		t.Fatal("no pinned plan gave replicas")
	}
}

// TestShardJobOuter: the memory a worker checks its shard against counts, in outer mode, only
// what it keeps in memory beside its state — audited, as the default job is, the parameters kept
// for the evidence across an outer step. The outer state itself is on disk (client/outerstore.go),
// whatever its compression or delay.
func TestShardJobOuter(t *testing.T) {
	s := Default()
	if s.ShardJob().OuterBytesPerParam != 0 {
		t.Fatal("step mode counted outer state")
	}
	s.Sync = &Sync{Mode: SyncOuter, Every: 20, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	if got := s.ShardJob().OuterBytesPerParam; got != OuterEvidenceBytesPerParam {
		t.Fatalf("outer int8, audited: %v bytes per parameter, want the evidence's %v", got, float64(OuterEvidenceBytesPerParam))
	}
	s.Sync.Delay = 5
	if got := s.ShardJob().OuterBytesPerParam; got != OuterEvidenceBytesPerParam {
		t.Fatalf("outer int8, delay 5: %v bytes per parameter, want %v (the snapshot is on disk)", got, float64(OuterEvidenceBytesPerParam))
	}
	if o := s.ReplicaOptions().OuterStateBytes(); o != sched.OuterStateBytesPerParam(true, true) || o < 12 {
		t.Errorf("the outer state on disk: %v bytes per parameter", o)
	}
}

// TestOuterKeepsEvidenceWhenAudited: outer mode's inner steps are audited, so with an audit rate
// its workers commit to them and keep their evidence — and the parameters an outer step changes
// after a step, for that step's audit — which the planner counts; without one they keep nothing.
func TestOuterKeepsEvidenceWhenAudited(t *testing.T) {
	s := Default()
	if !s.Audits() || !s.ShardJob().Audited {
		t.Fatal("the default job (step mode, audit_rate 0.1) does not audit")
	}
	s.Sync = &Sync{Mode: SyncOuter, Every: 20, OuterLR: 0.7, OuterMomentum: 0.9}
	if !s.Audits() || !s.ShardJob().Audited {
		t.Fatal("outer mode with audit_rate 0.1 keeps no evidence for its audits")
	}
	audited := s.ShardJob().OuterBytesPerParam
	s.AuditRate = 0
	if s.Audits() || s.ShardJob().Audited {
		t.Fatal("outer mode without an audit rate keeps audit evidence nobody asks for")
	}
	if got := s.ShardJob().OuterBytesPerParam; audited != got+OuterEvidenceBytesPerParam {
		t.Errorf("outer state %v bytes per parameter audited, %v not: want %v more", audited, got, OuterEvidenceBytesPerParam)
	}
}

// TestReplicaSeed: replica 0's own batches are the plain run's; the others' seeds differ from it
// and from each other.
func TestReplicaSeed(t *testing.T) {
	for _, seed := range []uint64{0, 1, 1 << 63} {
		if got := ReplicaSeed(seed, 0); got != seed {
			t.Errorf("ReplicaSeed(%d, 0) = %d", seed, got)
		}
		seen := map[uint64]int{seed: 0}
		for r := 1; r < 1000; r++ {
			s := ReplicaSeed(seed, r)
			if q, dup := seen[s]; dup {
				t.Fatalf("seed %d: replicas %d and %d draw from seed %d", seed, q, r, s)
			}
			seen[s] = r
		}
	}
}

// TestOwnBatchesOfTheirOwnSize: with own batches a replica's micro_batches is its own batch's, any
// n_r from 1 to MaxOwnMicroBatches (64·M within a bound on its tokens), not a share of M.
func TestOwnBatchesOfTheirOwnSize(t *testing.T) {
	s := Default() // M = 4 micro-batches of 4 rows of 128 tokens
	s.Sync = &Sync{Mode: SyncOuter, Every: 20, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none", Batches: BatchesOwn}
	if got, want := s.MaxOwnMicroBatches(), 64*s.MicroBatches; got != want {
		t.Fatalf("MaxOwnMicroBatches %d, want %d", got, want)
	}
	for _, ns := range [][]int{{4, 4}, {1, 3}, {4, 9, 256}} {
		s.Plan = &Plan{}
		for _, n := range ns {
			s.Plan.Replicas = append(s.Plan.Replicas, ReplicaPlan{Stages: [][2]int{{0, 4}}, MicroBatches: n})
		}
		if err := s.Validate(); err != nil {
			t.Errorf("replicas of %v micro-batches: %v", ns, err)
		}
		for r, rp := range s.PinnedReplicas() {
			if rp.First != 0 || rp.MicroBatches != ns[r] {
				t.Errorf("%v: replica %d pinned to [%d, %d)", ns, r, rp.First, rp.First+rp.MicroBatches)
			}
		}
	}
	// Long sequences: at most 4 Mi tokens of its own a step, unless M micro-batches are more.
	s.Model.BlockSize, s.BatchSize, s.MicroBatches = 1<<16, 64, 2
	if got, want := s.MaxOwnMicroBatches(), 2; got != want {
		t.Errorf("MaxOwnMicroBatches of micro-batches of 32 rows of 65,536 tokens: %d, want M = %d", got, want)
	}
}

// TestPhaseWarmup: an outer-mode job's warm-up runs by a step-mode spec — before step W, not from
// it — whose pinned own-batch replicas share the step's micro-batches in proportion to theirs,
// and which validates as a step-mode job does; the outer spec itself is left as it was.
func TestPhaseWarmup(t *testing.T) {
	s := Default()
	w := 10
	s.Sync = &Sync{Mode: SyncOuter, Every: 5, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Batches: BatchesOwn, Warmup: &w}
	L := s.Model.NLayer
	s.Plan = &Plan{Replicas: []ReplicaPlan{{Stages: [][2]int{{0, L}}, MicroBatches: 6}, {Stages: [][2]int{{0, L}}, MicroBatches: 2}}}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	p := s.Phase(9)
	if p.Outer() || p.Plan.Replicas[0].MicroBatches != 3 || p.Plan.Replicas[1].MicroBatches != 1 {
		t.Fatalf("warm-up phase: sync %+v, replicas %+v; want step mode sharing 4 micro-batches 3:1", p.Sync, p.Plan.Replicas)
	}
	if err := p.Validate(); err != nil {
		t.Fatalf("the warm-up phase does not validate: %v", err)
	}
	if s.Plan.Replicas[0].MicroBatches != 6 || !s.Outer() {
		t.Fatal("Phase changed the job's own spec")
	}
	if q := s.Phase(10); !q.Outer() || q.Plan != s.Plan {
		t.Fatal("from step W the phase is not the job's spec")
	}
	if s.StatePhase(10).Outer() || !s.StatePhase(11).Outer() {
		t.Fatal("the checkpoint after W steps is the warm-up's (step mode), after W+1 outer mode's")
	}
}
