package model

import (
	"math"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
)

// withThreads runs f with the kernels' pool at n threads, so that the model takes lanes even on a
// machine (or a GOMAXPROCS) of one core.
func withThreads(t *testing.T, n int, f func()) {
	t.Helper()
	old := kernels.Threads()
	kernels.SetThreads(n)
	defer kernels.SetThreads(old)
	f()
}

// TestLanesEqualSerial: a step computed in two lanes (each half of the micro-batches on its own
// copy of the stage) is the one-lane step bit for bit — losses, gradient norm, parameters and
// Adam's moments — for even and uneven halves, and the lanes really ran.
func TestLanesEqualSerial(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 1<<14)
	for _, M := range []int{2, 3, 4, 8} {
		serial, _ := NewModel(cfg)
		serial.Init(9)
		serial.Serial = true
		lanes, _ := NewModel(cfg)
		lanes.Init(9)
		B := 2 * M
		withThreads(t, 2, func() {
			for s := 0; s < 3; s++ {
				x, y := windows(text[s*300:], B, cfg.BlockSize)
				h := Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: 0.1, Clip: 1}
				a, err := serial.TrainStep(x, y, B, h)
				if err != nil {
					t.Fatal(err)
				}
				b, err := lanes.TrainStep(x, y, B, h)
				if err != nil {
					t.Fatal(err)
				}
				for _, v := range [][2]float64{{a.CE, b.CE}, {a.Aux, b.Aux}, {a.GradNorm, b.GradNorm}} {
					if math.Float64bits(v[0]) != math.Float64bits(v[1]) {
						t.Fatalf("M=%d step %d: serial %+v, lanes %+v", M, s, a, b)
					}
				}
			}
		})
		if serial.lane != nil || lanes.lane == nil {
			t.Fatalf("M=%d: serial model has a lane: %v; lanes model has one: %v", M, serial.lane != nil, lanes.lane != nil)
		}
		requireSameParams(t, serial.P, lanes.P)
		requireSameParams(t, serial.Opt.M, lanes.Opt.M)
		requireSameParams(t, serial.Opt.V, lanes.Opt.V)
	}
}

// A step that fails in the second lane leaves nothing behind in either: the next steps equal a
// model that never saw the failure.
func TestLaneFailureRecovers(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 1<<14)
	m, ref := laneAndSerial(t, cfg, 5)
	withThreads(t, 2, func() {
		trainSteps(t, m, text, 0, 1)
		trainSteps(t, ref, text, 0, 1)
		if m.lane == nil {
			t.Fatal("no lane after a step of two micro-batches at two threads")
		}
		// The lane computes micro-batch 1 of 2: make its block 3 expert 0 hold it already.
		if _, err := m.lane.Experts.Get(3, 0).Forward(1, make([]float32, cfg.NEmbd)); err != nil {
			t.Fatal(err)
		}
		x, y := windows(text, 8, cfg.BlockSize)
		if _, err := m.TrainStep(x, y, 8, Hyper{MicroBatches: 2, LR: 1e-2, WeightDecay: 0.1, Clip: 1}); err == nil || !strings.Contains(err.Error(), "forwarded twice") {
			t.Fatalf("the rigged step: %v, want the lane's expert to refuse", err)
		}
		trainSteps(t, m, text, 1, 3)
		trainSteps(t, ref, text, 1, 3)
	})
	requireSameParams(t, ref.P, m.P)
	requireSameParams(t, ref.Opt.V, m.Opt.V)
}

// gradsOnG fails unless every gradient buffer of sh (the ones its stage and experts accumulate
// into) is G's own memory again, as it must be between steps (leafInNode points them away).
func gradsOnG(t *testing.T, sh *Shard, what string) {
	t.Helper()
	for i, b := range sh.dg.bufs {
		f, g := hf(b), sh.G.Tensors[i].Data
		if len(f) != len(g) || (len(g) > 0 && &f[0] != &g[0]) {
			t.Fatalf("%s: the gradient buffer of %s is not G's", what, sh.G.Tensors[i].Name)
		}
	}
}

// TestLeafInNodeEqualsCopy: a step whose leaves without a finished sibling are accumulated in
// their node buffers (leafInNode) is the step that accumulates every leaf in G and copies it out
// at its fold, bit for bit — losses, gradient norm, parameters and Adam's moments — for several
// M, in one lane and in two; and the gradient buffers are G's again after every step.
func TestLeafInNodeEqualsCopy(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 1<<14)
	for _, threads := range []int{1, 2} {
		for _, M := range []int{1, 2, 3, 4, 5, 8} {
			direct, _ := NewModel(cfg)
			direct.Init(3)
			copied, _ := NewModel(cfg)
			copied.Init(3)
			copied.noLeafInNode = true
			B := 2 * M
			withThreads(t, threads, func() {
				for s := 0; s < 3; s++ {
					x, y := windows(text[s*300:], B, cfg.BlockSize)
					h := Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: 0.1, Clip: 1}
					a, err := copied.TrainStep(x, y, B, h)
					if err != nil {
						t.Fatal(err)
					}
					b, err := direct.TrainStep(x, y, B, h)
					if err != nil {
						t.Fatal(err)
					}
					for _, v := range [][2]float64{{a.CE, b.CE}, {a.Aux, b.Aux}, {a.GradNorm, b.GradNorm}} {
						if math.Float64bits(v[0]) != math.Float64bits(v[1]) {
							t.Fatalf("threads %d M=%d step %d: copied %+v, in node buffers %+v", threads, M, s, a, b)
						}
					}
					requireSameParams(t, copied.G, direct.G)
					for _, sh := range []*Shard{direct.Shard, direct.lane} {
						if sh != nil {
							gradsOnG(t, sh, "after a step")
						}
					}
				}
			})
			requireSameParams(t, copied.P, direct.P)
			requireSameParams(t, copied.Opt.M, direct.Opt.M)
			requireSameParams(t, copied.Opt.V, direct.Opt.V)
		}
	}
}

// TestLeafInNodeBinds: leafInNode really points the gradient at a node buffer for a leaf that
// will be one (micro-batch 0 of 4), not for one that is added to its finished sibling, and
// resetTree (a failed step's) points it back at G.
func TestLeafInNodeBinds(t *testing.T) {
	m, _ := NewModel(TinyConfig())
	sh := m.Shard
	if err := sh.BeginGradients(4, 0, 4); err != nil {
		t.Fatal(err)
	}
	sh.leafInNode(0)
	for i, b := range sh.dg.bufs {
		if f, g := hf(b), sh.G.Tensors[i].Data; &f[0] == &g[0] {
			t.Fatalf("micro-batch 0: the gradient of %s is still G's", sh.G.Tensors[i].Name)
		}
	}
	if err := sh.MicroBatchDone(0); err != nil {
		t.Fatal(err)
	}
	gradsOnG(t, sh, "after micro-batch 0's fold")
	sh.leafInNode(1) // its sibling [0,1) is done: the leaf is added to it from G
	gradsOnG(t, sh, "micro-batch 1")
	if err := sh.MicroBatchDone(1); err != nil {
		t.Fatal(err)
	}
	sh.leafInNode(2)
	sh.resetTree()
	gradsOnG(t, sh, "after resetTree")
}

// TestLaneKeepsItsNodeInG: the first lane's node of its micro-batches stays in G (gradTree.keep)
// — at M = 2 its one leaf needs no node buffer at all — while the step stays the one-lane step,
// bit for bit (TestLanesEqualSerial).
func TestLaneKeepsItsNodeInG(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 1<<14)
	m, ref := laneAndSerial(t, cfg, 4)
	withThreads(t, 2, func() {
		trainSteps(t, m, text, 0, 3)
		trainSteps(t, ref, text, 0, 3)
	})
	if m.lane == nil {
		t.Fatal("no lane at two threads")
	}
	for _, p := range m.tree.parts {
		if len(p.free) > 0 {
			t.Fatalf("the first lane holds %d node buffers for tensors [%d,%d); want none at M = 2", len(p.free), p.t0, p.t1)
		}
	}
	requireSameParams(t, ref.P, m.P)
	requireSameParams(t, ref.Opt.V, m.Opt.V)
}

// laneAndSerial is two models of cfg initialised from seed: one free to use a second lane, and its
// reference kept to one (Serial).
func laneAndSerial(t *testing.T, cfg Config, seed uint64) (m, ref *Model) {
	t.Helper()
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref, err = NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(seed)
	ref.Init(seed)
	ref.Serial = true
	return m, ref
}
