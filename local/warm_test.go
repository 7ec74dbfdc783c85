package local

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"testing"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
)

// warmJob is tinyOuterJob with a synchronous warm-up of w steps.
func warmJob(t *testing.T, w int, shares []int, every int) job.Spec {
	t.Helper()
	spec := tinyOuterJob(t, shares, every, 0.7, 0.9, "int8")
	spec.Sync.Warmup = &w
	if err := spec.Validate(); err != nil {
		t.Fatal(err)
	}
	return spec
}

// TestWarmupIsStepModeThenOuter: an outer-mode job with a warm-up of 3 steps trains steps 0–2 as
// step mode does (the losses a plain run's, bit for bit), then outer mode from that state: its
// rounds count from step 3 — an outer step after steps 4 and 6 (every 2) and after the last, 7 —
// and its first outer step starts every replica from the warm-up's parameters and moments, so its
// steps differ from those of the same job without a warm-up.
func TestWarmupIsStepModeThenOuter(t *testing.T) {
	spec := warmJob(t, 3, []int{2, 2}, 2)
	got, _ := run(t, spec, Options{})
	plain := spec.Phase(0)
	plain.Plan, plain.CheckpointEvery = nil, 3
	dir := t.TempDir()
	want, _ := run(t, plain, Options{Out: dir})
	sameLosses(t, "warm-up steps", got[:3], want[:3])
	pm, _, err := model.LoadModel(filepath.Join(dir, CheckpointName(3)))
	if err != nil {
		t.Fatal(err)
	}
	for s := range spec.Steps {
		if spec.OuterStepAfter(s) != (s == 4 || s == 6 || s == 7) {
			t.Fatalf("OuterStepAfter(%d) = %v", s, spec.OuterStepAfter(s))
		}
	}
	// Step 3 by hand: each replica is the plain model after step 2 training its share of step
	// 3's batch (micro-batches [0,2) and [2,4)) in one chain; the step's terms are their mean.
	x, y, err := corpusOf(t, spec).Batch(spec.Seed, 3, spec.BatchSize, spec.Model.BlockSize)
	if err != nil {
		t.Fatal(err)
	}
	h := spec.Hyper(3)
	rows, T := spec.BatchSize/spec.MicroBatches, spec.Model.BlockSize
	var ce float64
	for r := range 2 {
		m, err := model.NewModel(spec.Model)
		if err != nil {
			t.Fatal(err)
		}
		if err := warmStart(m, pm); err != nil {
			t.Fatal(err)
		}
		m.Chain = true
		hr := h
		hr.MicroBatches = 2
		lo, hi := r*2*rows*T, (r+1)*2*rows*T
		sr, err := m.TrainStep(x[lo:hi], y[lo:hi], 2*rows, hr)
		if err != nil {
			t.Fatal(err)
		}
		ce += 0.5 * sr.CE
	}
	if got[3].CE != ce {
		t.Fatalf("step 3's loss %v, want the replicas' from the warm-up's state %v", got[3].CE, ce)
	}
	noWarm := spec
	y2 := *spec.Sync
	zero := 0
	y2.Warmup = &zero
	noWarm.Sync = &y2
	other, _ := run(t, noWarm, Options{})
	if other[3].CE == got[3].CE {
		t.Fatal("the warm-up changed nothing")
	}
}

// TestWarmupResume: a warm-up run resumed from its checkpoint at the warm-up's end (a plain one,
// job.Spec.StatePhase) and from one in outer mode computes what the uninterrupted run does, bit
// for bit; and a replay's periods from before the warm-up's end (step mode's) change nothing.
func TestWarmupResume(t *testing.T) {
	spec := warmJob(t, 3, []int{2, 2}, 2)
	spec.CheckpointEvery = 1
	dir := t.TempDir()
	want, wm := run(t, spec, Options{Out: dir})
	for _, at := range []int{2, 3, 5} {
		got, gm := run(t, spec, Options{Resume: filepath.Join(dir, CheckpointName(at))})
		sameLosses(t, "resumed", got, want[at:])
		sameBits(t, "resumed", gm, wm)
	}
	ck, err := model.LoadCheckpoint(filepath.Join(dir, CheckpointName(3)))
	if err != nil {
		t.Fatal(err)
	}
	if !ck.HasOptimizer(wm.P) {
		t.Fatal("the checkpoint at the warm-up's end is not a plain one")
	}
	reps := []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}
	replay := []Period{{From: 0, Replicas: reps[:1]}, {From: 1, Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 4}}}, {From: 3, Replicas: reps}}
	got, gm := run(t, spec, Options{Replay: replay})
	sameLosses(t, "replayed", got, want)
	sameBits(t, "replayed", gm, wm)
	if _, err := Run(t.Context(), spec, Options{Replay: replay[:2]}); err == nil {
		t.Fatal("a replay with no plan from the warm-up's end ran")
	}
	// A replay of a run that stopped before the warm-up's end (its plans all step mode's, as
	// the churn soak replays a run to its last checkpoint) runs as far as it goes.
	ctx, cancel := context.WithCancel(t.Context())
	var got2 []Report
	_, err = Run(ctx, spec, Options{Replay: replay[:2], OnStep: func(r Report) {
		got2 = append(got2, r)
		if r.Step == 2 {
			cancel()
		}
	}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("a replay stopped before the warm-up's end: %v", err)
	}
	sameLosses(t, "replayed before the warm-up's end", got2, want[:3])
}

// TestWarmupSpec: the warm-up in a job file — absent, a third of the steps (none with own
// batches); 0, none; past the
// job, refused — and its encoding, which parses back to the same steps.
func TestWarmupSpec(t *testing.T) {
	spec := tinyOuterJob(t, []int{2, 2}, 2, 0.7, 0.9, "int8")
	spec.Steps = 20
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	json.Unmarshal(b, &raw)
	sy := raw["sync"].(map[string]any)
	if sy["warmup"] != float64(0) {
		t.Fatalf("a Go spec's warm-up encodes as %v, want 0 written out", sy["warmup"])
	}
	delete(sy, "warmup")
	b, _ = json.Marshal(raw)
	p, err := job.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if p.SyncWarmup() != 6 {
		t.Fatalf("absent: warm-up %d, want a third of 20", p.SyncWarmup())
	}
	b2, _ := json.Marshal(p)
	q, err := job.Parse(b2)
	if err != nil || q.SyncWarmup() != 6 {
		t.Fatalf("encoded and parsed again: %d, %v", q.SyncWarmup(), err)
	}
	sy["batches"] = job.BatchesOwn
	b, _ = json.Marshal(raw)
	if o, err := job.Parse(b); err != nil || o.SyncWarmup() != 0 {
		t.Fatalf("own batches: warm-up %d, %v; want none by default", o.SyncWarmup(), err)
	}
	delete(sy, "batches")
	for _, w := range []int{-1, 20} {
		sy["warmup"] = w
		b, _ = json.Marshal(raw)
		if _, err := job.Parse(b); err == nil {
			t.Fatalf("warm-up %d of 20 steps parsed", w)
		}
	}
	sy["mode"] = "step"
	for _, k := range []string{"every", "outer_lr", "outer_momentum", "compress"} {
		delete(sy, k)
	}
	sy["warmup"] = 0
	b, _ = json.Marshal(raw)
	if _, err := job.Parse(b); err == nil {
		t.Fatal("a step-mode sync with a warm-up parsed")
	}
}

// corpusOf is spec's corpus.
func corpusOf(t *testing.T, spec job.Spec) *data.Corpus {
	t.Helper()
	c, err := data.Load(spec.Data, spec.DataExtensions)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
