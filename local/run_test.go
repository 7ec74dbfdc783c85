package local

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
)

// A run that diverges stops at the first non-finite step with an error naming it, instead of
// training on with every parameter NaN (issue 16).
func TestRunStopsAtNonFiniteStep(t *testing.T) {
	text, err := os.ReadFile("run.go")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "corpus.txt")
	if err := os.WriteFile(p, append(append(text, text...), text...), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := job.Default()
	spec.Model = model.TinyConfig()
	spec.Data, spec.Steps, spec.BatchSize, spec.MicroBatches = p, 50, 8, 2
	spec.LR, spec.Warmup, spec.Clip, spec.ValEvery, spec.CheckpointEvery = 1e30, 0, 0, 0, 0
	var last int
	_, err = Run(context.Background(), spec, Options{OnStep: func(r Report) { last = r.Step }})
	if !errors.Is(err, model.ErrNonFinite) {
		t.Fatalf("a diverging run ended with %v, want ErrNonFinite", err)
	}
	if !strings.Contains(err.Error(), "step ") {
		t.Fatalf("the error does not name the step: %v", err)
	}
	t.Logf("stopped after step %d: %v", last, err)
}
