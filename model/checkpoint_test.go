package model

import (
	"math"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/safetensors"
)

func trainSteps(t *testing.T, m *Model, text []byte, from, to int) {
	t.Helper()
	const B = 8
	for s := from; s < to; s++ {
		x, y := windows(text[s*200:], B, m.Cfg.BlockSize)
		if _, err := m.TrainStep(x, y, B, Hyper{MicroBatches: 2, LR: 1e-2, WeightDecay: 0.1, Clip: 1}); err != nil {
			t.Fatal(err)
		}
	}
}

func requireSameParams(t *testing.T, a, b *Params) {
	t.Helper()
	for i, ta := range a.Tensors {
		tb := b.Tensors[i]
		for j := range ta.Data {
			if math.Float32bits(ta.Data[j]) != math.Float32bits(tb.Data[j]) {
				t.Fatalf("%s[%d]: %v vs %v", ta.Name, j, ta.Data[j], tb.Data[j])
			}
		}
	}
}

// TestResumeEqualsStraightRun: 4 steps in one go equal 2 steps, a checkpoint, a fresh process
// state loaded from it, and 2 more — parameters and Adam moments bit for bit.
func TestResumeEqualsStraightRun(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	straight, _ := NewModel(cfg)
	straight.Init(3)
	trainSteps(t, straight, text, 0, 4)

	first, _ := NewModel(cfg)
	first.Init(3)
	trainSteps(t, first, text, 0, 2)
	path := filepath.Join(t.TempDir(), "ck.safetensors")
	if err := first.Save(path); err != nil {
		t.Fatal(err)
	}
	resumed, ck, err := LoadModel(path)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != 2 || resumed.Step != 2 || ck.Cfg != cfg {
		t.Fatalf("checkpoint step %d (model %d), config %+v", ck.Step, resumed.Step, ck.Cfg)
	}
	trainSteps(t, resumed, text, 2, 4)
	requireSameParams(t, straight.P, resumed.P)
	requireSameParams(t, straight.Opt.M, resumed.Opt.M)
	requireSameParams(t, straight.Opt.V, resumed.Opt.V)
}

func TestCheckpointLayout(t *testing.T) {
	cfg := TinyConfig()
	m, _ := NewModel(cfg)
	m.Init(1)
	m.Step = 17
	path := filepath.Join(t.TempDir(), "ck.safetensors")
	if err := m.Save(path); err != nil {
		t.Fatal(err)
	}
	ts, meta, err := safetensors.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if meta["step"] != "17" {
		t.Errorf("step metadata %q", meta["step"])
	}
	got, err := ParseConfig([]byte(meta["config"]))
	if err != nil || got != cfg {
		t.Errorf("config metadata %q: %v", meta["config"], err)
	}
	names := map[string]bool{}
	for _, tt := range ts {
		names[tt.Name] = true
	}
	for _, s := range cfg.Specs() {
		for _, n := range []string{s.Name, "optim.m." + s.Name, "optim.v." + s.Name} {
			if !names[n] {
				t.Errorf("missing %s", n)
			}
		}
	}
	if len(ts) != 3*len(cfg.Specs()) {
		t.Errorf("%d tensors, want %d", len(ts), 3*len(cfg.Specs()))
	}
}

func TestLoadRejectsMismatch(t *testing.T) {
	cfg := TinyConfig()
	m, _ := NewModel(cfg)
	dir := t.TempDir()
	// A checkpoint missing a tensor.
	ts := CheckpointTensors(m.P, nil)[1:]
	p := filepath.Join(dir, "short.safetensors")
	if err := safetensors.WriteFile(p, ts, CheckpointMeta(cfg, 0)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadModel(p); err == nil {
		t.Error("checkpoint without transformer.wte.weight accepted")
	}
	// No config.
	p2 := filepath.Join(dir, "nometa.safetensors")
	if err := safetensors.WriteFile(p2, CheckpointTensors(m.P, nil), nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadModel(p2); err == nil {
		t.Error("checkpoint without config accepted")
	}
	// Truncated file.
	b, _ := os.ReadFile(p2)
	p3 := filepath.Join(dir, "trunc.safetensors")
	os.WriteFile(p3, b[:len(b)-5], 0o644)
	if _, err := LoadCheckpoint(p3); err == nil {
		t.Error("truncated checkpoint accepted")
	}
}

// TestThreadCountDoesNotChangeResults trains with 1 and with 3 threads: bitwise-equal parameters.
func TestThreadCountDoesNotChangeResults(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	run := func(threads int) *Model {
		old := runtime.GOMAXPROCS(threads)
		oldK := kernels.Threads()
		kernels.SetThreads(threads)
		defer func() { runtime.GOMAXPROCS(old); kernels.SetThreads(oldK) }()
		m, _ := NewModel(cfg)
		m.Init(5)
		trainSteps(t, m, text, 0, 2)
		return m
	}
	requireSameParams(t, run(1).P, run(3).P)
}

// TestTorchEval: the model's loss on a checkpoint equals the anchor's eval within 1e-5 relative.
func TestTorchEval(t *testing.T) {
	requireTorch(t)
	cfg := TinyConfig()
	m := perturbedModel(t, cfg, 8)
	dir := t.TempDir()
	ck, dataPath := filepath.Join(dir, "m.safetensors"), filepath.Join(dir, "d.txt")
	if err := SaveCheckpoint(ck, cfg, 0, m.P, nil); err != nil {
		t.Fatal(err)
	}
	text := testText(t, 20*(cfg.BlockSize+1))
	os.WriteFile(dataPath, text, 0o644)
	ref := runAnchor(t, "eval", "--checkpoint", ck, "--data", dataPath, "--windows", "20")
	x, y := windows(text, 20, cfg.BlockSize)
	ce, aux, err := m.Evaluate(x, y, 20, cfg.BlockSize)
	if err != nil {
		t.Fatal(err)
	}
	if e := math.Abs(ce-ref["loss"]) / ref["loss"]; e > 1e-5 {
		t.Errorf("loss %.8f, torch %.8f (rel %.2g)", ce, ref["loss"], e)
	}
	if e := math.Abs(aux-ref["aux"]) / ref["aux"]; e > 1e-5 {
		t.Errorf("aux %.8f, torch %.8f (rel %.2g)", aux, ref["aux"], e)
	}
}
