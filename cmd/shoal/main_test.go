package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

func run(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var o, e bytes.Buffer
	m := &Main{Stdout: &o, Stderr: &e}
	err = m.Run(context.Background(), args)
	return o.String(), e.String(), err
}

func TestHelpListsCommands(t *testing.T) {
	_, stderr, err := run(t, "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range commands {
		if !strings.Contains(stderr, "  "+c.name+" ") {
			t.Errorf("--help does not list %s:\n%s", c.name, stderr)
		}
	}
	if _, _, err := run(t, "frobnicate"); !errors.Is(err, errUsage) {
		t.Errorf("unknown command: %v", err)
	}
	if _, _, err := run(t, "train", "--no-such-flag"); !errors.Is(err, errUsage) {
		t.Errorf("unknown flag: %v", err)
	}
}

// tinyJob writes a small job over a text file and returns its path.
func tinyJob(t *testing.T, dir string, steps int) string {
	t.Helper()
	var text []byte
	for _, f := range []string{"main.go", "train.go", "eval.go", "sample.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text = append(text, b...)
	}
	dataPath := filepath.Join(dir, "corpus.txt")
	if err := os.WriteFile(dataPath, text, 0o644); err != nil {
		t.Fatal(err)
	}
	s := job.Default()
	s.Model = model.TinyConfig()
	s.Data, s.Steps, s.BatchSize, s.MicroBatches = dataPath, steps, 4, 2
	s.Warmup, s.CheckpointEvery, s.ValEvery = 2, 3, 2
	b, _ := json.Marshal(s)
	p := filepath.Join(dir, "job.json")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// editJob rewrites the job file at path with change applied, and returns the spec written.
func editJob(t *testing.T, path string, change func(*job.Spec)) job.Spec {
	t.Helper()
	spec, err := job.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	change(&spec)
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return spec
}

func parseSteps(t *testing.T, out string) []map[string]float64 {
	t.Helper()
	var steps []map[string]float64
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var raw map[string]any
		if err := json.Unmarshal([]byte(line), &raw); err != nil {
			t.Fatalf("--json line %q: %v", line, err)
		}
		m := map[string]float64{}
		for k, v := range raw {
			if f, ok := v.(float64); ok {
				m[k] = f
			}
		}
		steps = append(steps, m)
	}
	return steps
}

// TestTrainJSONAndResume: --json prints one object per step with the documented keys, checkpoints
// land every checkpoint_every steps, and resuming from the directory finishes with exactly the
// losses and parameters of the uninterrupted run.
func TestTrainJSONAndResume(t *testing.T) {
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 6)
	straight := filepath.Join(dir, "straight")
	out, _, err := run(t, "train", "--job", jobPath, "--out", straight, "--json")
	if err != nil {
		t.Fatal(err)
	}
	steps := parseSteps(t, out)
	if len(steps) != 6 {
		t.Fatalf("%d step lines, want 6", len(steps))
	}
	for i, s := range steps {
		for _, k := range []string{"step", "loss", "aux", "tokens_per_s"} {
			if _, ok := s[k]; !ok {
				t.Errorf("step line %d lacks %q", i, k)
			}
		}
		_, hasVal := s["val_loss"]
		if want := i%2 == 0 || i == 5; hasVal != want {
			t.Errorf("step %d: val_loss present %v, want %v", i, hasVal, want)
		}
	}
	for _, n := range []int{3, 6} {
		if _, err := os.Stat(filepath.Join(straight, local.CheckpointName(n))); err != nil {
			t.Errorf("checkpoint after step %d: %v", n, err)
		}
	}

	// Resume the run from its step-3 checkpoint, in another directory.
	resumed := filepath.Join(dir, "resumed")
	os.MkdirAll(resumed, 0o755)
	b, _ := os.ReadFile(filepath.Join(straight, local.CheckpointName(3)))
	os.WriteFile(filepath.Join(resumed, local.CheckpointName(3)), b, 0o644)
	out2, _, err := run(t, "train", "--job", jobPath, "--out", resumed, "--resume", resumed, "--json")
	if err != nil {
		t.Fatal(err)
	}
	steps2 := parseSteps(t, out2)
	if len(steps2) != 3 || steps2[0]["step"] != 3 {
		t.Fatalf("resumed run printed %v", steps2)
	}
	for i, s := range steps2 {
		if s["loss"] != steps[3+i]["loss"] {
			t.Errorf("step %v: resumed loss %v, straight %v", s["step"], s["loss"], steps[3+i]["loss"])
		}
	}
	a, _ := os.ReadFile(filepath.Join(straight, local.CheckpointName(6)))
	c, _ := os.ReadFile(filepath.Join(resumed, local.CheckpointName(6)))
	if !bytes.Equal(a, c) {
		t.Error("final checkpoints of the straight and the resumed run differ")
	}

	// sample runs on the result.
	sout, _, err := run(t, "sample", "--checkpoint", filepath.Join(straight, local.CheckpointName(6)), "--prompt", "func ", "--tokens", "20")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(sout, "func ") || len(sout) < 25 {
		t.Errorf("sample printed %q", sout)
	}
}

func TestTrainFlagsOverrideJob(t *testing.T) {
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 6)
	out, _, err := run(t, "train", "--job", jobPath, "--steps", "2", "--lr", "0.002", "--print-job")
	if err != nil {
		t.Fatal(err)
	}
	s, err := job.Parse([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if s.Steps != 2 || s.LR != 0.002 || s.Model != model.TinyConfig() {
		t.Errorf("--print-job gave steps %d lr %v", s.Steps, s.LR)
	}
	if _, _, err := run(t, "train", "--job", jobPath, "--micro-batches", "3"); err == nil || !strings.Contains(err.Error(), "micro_batches") {
		t.Errorf("bad --micro-batches: %v", err)
	}
	if _, _, err := run(t, "train", "--job", jobPath, "--data", filepath.Join(dir, "nope")); err == nil || !strings.Contains(err.Error(), "--data") {
		t.Errorf("missing --data: %v", err)
	}
}

// TestEvalMatchesTorch: `shoal eval` prints the anchor's loss and aux within 1e-5 relative.
func TestEvalMatchesTorch(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: skipping the PyTorch comparison")
	}
	if err := exec.Command("/usr/bin/python3", "-c", "import torch, numpy").Run(); err != nil {
		t.Skipf("skipping: /usr/bin/python3 cannot import torch (apt-get install -y python3-torch): %v", err)
	}
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 3)
	if _, _, err := run(t, "train", "--job", jobPath, "--out", dir, "--json"); err != nil {
		t.Fatal(err)
	}
	ck := filepath.Join(dir, local.CheckpointName(3))
	dataPath := filepath.Join(dir, "corpus.txt")
	out, _, err := run(t, "eval", "--checkpoint", ck, "--data", dataPath, "--windows", "12")
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]float64
	json.Unmarshal([]byte(out), &got)
	anchor, _ := filepath.Abs("../../model/testdata/torch_gpt_moe.py")
	refOut, err := exec.Command("/usr/bin/python3", anchor, "eval", "--checkpoint", ck, "--data", dataPath, "--windows", "12").Output()
	if err != nil {
		t.Fatalf("anchor eval: %v", err)
	}
	var ref map[string]float64
	if err := json.Unmarshal(refOut, &ref); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"loss", "aux"} {
		if e := math.Abs(got[k]-ref[k]) / math.Abs(ref[k]); e > 1e-5 {
			t.Errorf("%s: shoal %.8f, torch %.8f (rel %.2g)", k, got[k], ref[k], e)
		}
	}
	t.Logf("shoal %v, torch %v", got, ref)
}

// TestVersion: `shoal --version` and `shoal version` print the build: the module's version and
// the Go release (the VCS revision too when the build recorded one).
func TestVersion(t *testing.T) {
	for _, arg := range []string{"--version", "version", "-version"} {
		out, _, err := run(t, arg)
		if err != nil || !strings.HasPrefix(out, "shoal ") || !strings.Contains(out, runtime.Version()) {
			t.Errorf("shoal %s: %q, %v", arg, out, err)
		}
	}
}
