package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/vulkan"
)

// TestTrainVulkanWorkers: `shoal train --workers 2 --worker-device vulkan` — two `shoal worker
// --device vulkan` processes (Mesa's lavapipe where there is no GPU) holding the two stages of a
// pinned pipeline — trains the tiny job to `shoal train`'s losses within the cross-backend bound
// of the browser's WebGPU runs (2e-5 relative; the coordinator package's TestClusterVulkanWorker
// states where it comes from), and the workers say what they compute on. It skips without a
// Vulkan device unless SHOAL_VULKAN_REQUIRED=1 (.ci/run).
func TestTrainVulkanWorkers(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	if infos, err := vulkan.Devices(); err != nil || len(infos) == 0 {
		if os.Getenv("SHOAL_VULKAN_REQUIRED") == "1" {
			t.Fatalf("no Vulkan device (%v) and SHOAL_VULKAN_REQUIRED=1", err)
		}
		t.Skipf("no Vulkan device: %v", err)
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 4)
	editJob(t, jobPath, func(s *job.Spec) { s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}} })
	localOut, _, err := run(t, "train", "--job", jobPath, "--json")
	if err != nil {
		t.Fatal(err)
	}
	var o, e bytes.Buffer
	m := &Main{Stdout: &o, Stderr: &e}
	data := filepath.Join(dir, "data")
	if err := m.Run(context.Background(), []string{"train", "--job", jobPath, "--json", "--workers", "2", "--worker-device", "vulkan", "--data-dir", data}); err != nil {
		t.Fatalf("%v\n%s", err, e.String())
	}
	want, got := parseSteps(t, localOut), lastOfEachStep(parseSteps(t, o.String()))
	if len(got) != len(want) {
		t.Fatalf("%d steps on Vulkan workers, %d in one process", len(got), len(want))
	}
	worst := 0.0
	for i := range want {
		for _, k := range []string{"loss", "aux", "val_loss"} {
			w, g := want[i][k], got[i][k]
			if d := math.Abs(g-w) / math.Max(math.Abs(w), 1e-12); d > worst {
				worst = d
			}
		}
	}
	t.Logf("losses within %.2g (relative) of one process's", worst)
	if worst > 2e-5 {
		t.Errorf("losses on Vulkan workers differ from one process's by %.3g relative (bound 2e-5)", worst)
	}
	logs, _ := filepath.Glob(filepath.Join(data, "*.log"))
	var said bool
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		// It timed the job's own model, which the coordinator's status gave it.
		said = said || strings.Contains(string(b), "device: vulkan:0") && strings.Contains(string(b), "two blocks of the job's model")
		if strings.Contains(string(b), "device: vulkan:0") {
			t.Logf("%s: %s", filepath.Base(l), strings.SplitN(string(b), "\n", 2)[0])
		}
	}
	if !said {
		t.Errorf("no worker log says it computes on vulkan:0, timed on the job's model (%v)", logs)
	}
	assertNoChildren(t)
}

// TestJobModelBounded: `--device auto` reads the job's model from the coordinator's status before
// it times anything on it: a valid config comes back (the join token presented), while one whose
// probe would be huge, an invalid one, or an endless answer is refused before any allocation.
func TestJobModelBounded(t *testing.T) {
	tiny, _ := json.Marshal(model.TinyConfig())
	huge := model.TinyConfig()
	huge.NEmbd, huge.NHead, huge.VocabSize = 1<<14, 16, 1<<20
	hugeJSON, _ := json.Marshal(huge)
	for _, tc := range []struct {
		name, body string
		ok         bool
	}{
		{"the job's model", `{"job":{"model_config":` + string(tiny) + `}}`, true},
		{"a probe too large", `{"job":{"model_config":` + string(hugeJSON) + `}}`, false},
		{"an invalid config", `{"job":{"model_config":{"n_layer":-1}}}`, false},
		{"no job yet", `{"job":null}`, false},
		{"an endless answer", `{"job":{"model":"` + strings.Repeat("x", 20<<20) + `"}}`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get(coordinator.JoinHeader) != "tok" {
					http.Error(w, "no token", http.StatusForbidden)
					return
				}
				io.WriteString(w, tc.body)
			}))
			defer srv.Close()
			cfg, err := jobModel(context.Background(), srv.URL, "tok")
			if (err == nil) != tc.ok {
				t.Fatalf("config %+v, error %v; want ok %v", cfg, err, tc.ok)
			}
			if tc.ok && cfg != model.TinyConfig() {
				t.Errorf("config %+v, want the tiny one", cfg)
			}
		})
	}
}
