package model

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/shoal-ml/shoal/safetensors"
)

// The PyTorch anchor (testdata's copy, testdata/torch_gpt_moe.py, so that a clean clone has
// it) is the oracle for the model's loss and gradients. These tests need Debian's python with
// torch (`apt-get install -y python3-torch`, which .ci/run does) and skip, saying so, without it.

const anchorPython = "/usr/bin/python3"

func requireTorch(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: skipping the PyTorch comparison")
	}
	if err := exec.Command(anchorPython, "-c", "import torch, numpy").Run(); err != nil {
		t.Skipf("skipping: %s cannot import torch and numpy (apt-get install -y python3-torch): %v", anchorPython, err)
	}
}

func anchorPath(t *testing.T) string {
	p, err := filepath.Abs("testdata/torch_gpt_moe.py")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// runAnchor runs the anchor with args and decodes the JSON line it prints.
func runAnchor(t *testing.T, args ...string) map[string]float64 {
	t.Helper()
	cmd := exec.Command(anchorPython, append([]string{anchorPath(t)}, args...)...)
	cmd.Env = append(os.Environ(), "OMP_NUM_THREADS=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("anchor %v: %v\n%s", args, err, stderr.String())
	}
	var res map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
		t.Fatalf("anchor output %q: %v", out, err)
	}
	f := map[string]float64{}
	for k, v := range res {
		if x, ok := v.(float64); ok {
			f[k] = x
		}
	}
	return f
}

// perturbedModel is an initialised model with every tensor nudged, so that biases and LayerNorm
// parameters are not at their special initial values and every path of backward is exercised.
func perturbedModel(t *testing.T, cfg Config, seed uint64) *Model {
	t.Helper()
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(seed)
	r := rand.New(rand.NewPCG(seed, 99))
	for _, tt := range m.P.Tensors {
		for i := range tt.Data {
			tt.Data[i] += float32(r.NormFloat64() * 0.02)
		}
	}
	return m
}

// testText is source text for the tests' batches: real bytes, so that the routing is not uniform.
func testText(t *testing.T, n int) []byte {
	t.Helper()
	var b []byte
	for _, f := range []string{"stage.go", "moe.go", "../kernels/layers.go", "params.go", "model.go", "optim.go"} {
		s, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b = append(b, s...)
	}
	for len(b) < n {
		b = append(b, b...)
	}
	return b[:n]
}

func windows(text []byte, n, T int) (x, y []int32) {
	x, y = make([]int32, n*T), make([]int32, n*T)
	for i := 0; i < n; i++ {
		for j := 0; j < T; j++ {
			x[i*T+j] = int32(text[i*(T+1)+j])
			y[i*T+j] = int32(text[i*(T+1)+j+1])
		}
	}
	return x, y
}

func relDiff(got, want []float32) float64 {
	var d, n float64
	for i := range got {
		e := float64(got[i]) - float64(want[i])
		d += e * e
		n += float64(want[i]) * float64(want[i])
	}
	if n == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / n)
}

// TestTorchGradients compares every gradient with PyTorch's. The anchor computes the batch in one
// pass; "tree" computes it as 4 micro-batches summed by the gradient tree (gradtree.go) — with
// the balancing loss off, whose per-micro-batch terms are the only thing M changes, that is the
// same gradient, so the tree's sum is checked against PyTorch too.
func TestTorchGradients(t *testing.T) {
	requireTorch(t)
	for _, tc := range []struct {
		name string
		k, M int
	}{{"top1", 1, 1}, {"top2", 2, 1}, {"tree", 2, 4}} {
		cfg := TinyConfig()
		cfg.TopK = tc.k
		if tc.M > 1 {
			cfg.AuxLossCoef = 0
		}
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			m := perturbedModel(t, cfg, 7)
			ck, dataPath, gradsPath := filepath.Join(dir, "m.safetensors"), filepath.Join(dir, "data.txt"), filepath.Join(dir, "g.safetensors")
			if err := m.Save(ck); err != nil {
				t.Fatal(err)
			}
			const W = 16
			text := testText(t, W*(cfg.BlockSize+1))
			if err := os.WriteFile(dataPath, text, 0o644); err != nil {
				t.Fatal(err)
			}
			ref := runAnchor(t, "grads", "--checkpoint", ck, "--data", dataPath, "--windows", "16", "--out", gradsPath)
			x, y := windows(text, W, cfg.BlockSize)
			r, err := m.Gradients(x, y, W, tc.M)
			if err != nil {
				t.Fatal(err)
			}
			if e := math.Abs(r.CE-ref["loss"]) / ref["loss"]; e > 1e-5 {
				t.Errorf("loss %.8f, torch %.8f (rel %.2g)", r.CE, ref["loss"], e)
			}
			if e := math.Abs(r.Aux-ref["aux"]) / ref["aux"]; tc.M == 1 && e > 1e-5 { // per micro-batch otherwise
				t.Errorf("aux %.8f, torch %.8f (rel %.2g)", r.Aux, ref["aux"], e)
			}
			want, _, err := safetensors.ReadFile(gradsPath)
			if err != nil {
				t.Fatal(err)
			}
			if len(want) != len(m.G.Tensors) {
				t.Fatalf("torch wrote %d gradients, the model has %d tensors", len(want), len(m.G.Tensors))
			}
			worst := 0.0
			for _, w := range want {
				g, ok := m.G.Lookup(w.Name)
				if !ok {
					t.Errorf("torch has gradient %s, Shoal has no such tensor", w.Name)
					continue
				}
				e := relDiff(g.Data, w.Data)
				worst = max(worst, e)
				if e > 1e-5 {
					t.Errorf("%s: ‖Δ‖/‖ref‖ = %.3g > 1e-5", w.Name, e)
				}
			}
			t.Logf("loss %.6f aux %.6f; worst per-tensor ‖Δ‖/‖ref‖ = %.3g over %d tensors", r.CE, r.Aux, worst, len(want))
		})
	}
}
