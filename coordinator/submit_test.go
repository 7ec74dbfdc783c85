package coordinator

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
)

// submitSpec POSTs spec to /api/jobs with the admin token and returns the status and the body.
func submitSpec(t *testing.T, base string, spec any) (int, map[string]any) {
	t.Helper()
	b, _ := json.Marshal(spec)
	req, _ := http.NewRequest("POST", base+"/api/jobs", bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+servingAdmin)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

// TestSubmitRefusesUnreadableData: a job whose data path does not exist, or is a directory
// without the files it asks for, is refused at POST /api/jobs with a 400 that names the path and
// why — and no flag the coordinator lacks — and nothing is queued; a readable one is taken.
func TestSubmitRefusesUnreadableData(t *testing.T) {
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), AdminToken: servingAdmin, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hs := httptest.NewServer(srv.Handler())
	defer hs.Close()

	spec := tinyJob(t, 4)
	noGo := t.TempDir()
	if err := os.WriteFile(filepath.Join(noGo, "notes.txt"), []byte("text"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, why string }{
		{filepath.Join(t.TempDir(), "no-such-corpus.txt"), "does not exist"},
		{noGo, "holds no files ending in"},
	} {
		bad := spec
		bad.Data = tc.path
		if bad.Data == noGo {
			bad.DataExtensions = []string{".go"}
		}
		code, out := submitSpec(t, hs.URL, bad)
		msg, _ := out["error"].(string)
		if code != http.StatusBadRequest || !strings.Contains(msg, tc.path) || !strings.Contains(msg, tc.why) || strings.Contains(msg, "--data") {
			t.Errorf("data %s: %d %q, want 400 naming the path and saying %q", tc.path, code, msg, tc.why)
		}
	}
	if jobs, _ := srv.db.ListJobs(context.Background()); len(jobs) != 0 {
		t.Errorf("refused jobs were stored: %d", len(jobs))
	}
	// Taken, with a word on the memory it needs: no worker is connected.
	code, out := submitSpec(t, hs.URL, spec)
	if w, _ := out["warning"].(string); code != http.StatusCreated || !strings.Contains(w, "no worker is connected: one alone needs ≥ ") {
		t.Errorf("a readable job: %d %v, want 201 and a warning on memory", code, out)
	}
}

// TestMemoryFit: a job is warned of when the memory the workers offer holds no plan of it — too
// little in all, or a pinned stage on a worker too small for it — and not when it fits.
func TestMemoryFit(t *testing.T) {
	spec := tinyJob(t, 4)
	for _, tc := range []struct {
		name   string
		pinned bool
		offers map[string]int64
		want   string // "" fits
	}{
		{"fits", false, map[string]int64{"a": 1 << 30}, ""},
		{"fits on two", false, map[string]int64{"a": 64 << 20, "b": 64 << 20}, ""},
		{"too little", false, map[string]int64{"a": 1 << 20, "b": 1 << 20}, "no plan fits the 2 connected workers: "},
		{"none", false, nil, "no worker is connected"},
		{"pinned fits", true, map[string]int64{"a": 1 << 30, "b": 1 << 30}, ""},
		{"pinned short", true, map[string]int64{"a": 1 << 30}, "the pinned plan needs 2 workers, 1 are connected"},
		{"pinned small", true, map[string]int64{"a": 1 << 30, "b": 1 << 20}, "stage 2 of 2 (blocks [2,4)) needs ≥ "},
	} {
		s := spec
		if tc.pinned {
			s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
		}
		got := memoryFit(s, tc.offers)
		if tc.want == "" && got != "" || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
