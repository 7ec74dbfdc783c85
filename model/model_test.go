package model

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// A step that fails part-way — here block 3's experts refuse micro-batch 0 after block 1's have
// run it — must leave nothing behind: the next step used to fail with "forwarded twice" because
// only the stage was reset, not the local experts (issue 16). After the failure the model trains
// on exactly as a model that never saw it.
func TestGradientsRecoverAfterFailure(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	m, _ := NewModel(cfg)
	m.Init(5)
	ref, _ := NewModel(cfg)
	ref.Init(5)

	// Make block 3's first expert hold micro-batch 0 already, so that the step fails there.
	stuck := m.Experts.Get(3, 0)
	if stuck == nil {
		t.Fatal("the tiny model has no expert 0 in block 3")
	}
	if _, err := stuck.Forward(0, make([]float32, cfg.NEmbd)); err != nil {
		t.Fatal(err)
	}
	x, y := windows(text, 8, cfg.BlockSize)
	if _, err := m.TrainStep(x, y, 8, Hyper{MicroBatches: 2, LR: 1e-2, WeightDecay: 0.1, Clip: 1}); err == nil || !strings.Contains(err.Error(), "forwarded twice") {
		t.Fatalf("the rigged step: %v, want block 3's expert to refuse", err)
	}
	if m.Step != 0 {
		t.Fatalf("a failed step counted: step %d", m.Step)
	}
	trainSteps(t, m, text, 0, 2)
	trainSteps(t, ref, text, 0, 2)
	requireSameParams(t, ref.P, m.P)
	requireSameParams(t, ref.Opt.V, m.Opt.V)
}

// A step whose loss or gradient norm is not finite is not applied: TrainStep says so, naming
// what was not finite, and leaves the parameters and the step count as they were (it used to
// apply the update and turn every parameter into NaN, silently).
func TestTrainStepRefusesNonFinite(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	m, _ := NewModel(cfg)
	m.Init(5)
	m.P.Tensors[0].Data[0] = float32(math.Inf(1)) // wte: the embedding of token 0 diverged (Host: no copy to push)
	x, y := windows(text, 8, cfg.BlockSize)
	for i := range x {
		x[i] = 0 // every row starts with the token whose embedding is Inf
	}
	_, err := m.TrainStep(x, y, 8, Hyper{MicroBatches: 2, LR: 1e-2, WeightDecay: 0.1, Clip: 1})
	if !errors.Is(err, ErrNonFinite) {
		t.Fatalf("TrainStep on a diverged model: %v, want ErrNonFinite", err)
	}
	if m.Step != 0 {
		t.Fatalf("the diverged step was counted: step %d", m.Step)
	}
	for _, tn := range m.P.Tensors[1:] {
		for j, v := range tn.Data {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				t.Fatalf("%s[%d] = %v after a refused step", tn.Name, j, v)
			}
		}
	}
}
