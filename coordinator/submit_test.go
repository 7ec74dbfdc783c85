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
)

// submitSpec POSTs spec to /api/jobs with the admin token and returns the status and the body.
func submitSpec(t *testing.T, base string, spec any) (int, map[string]any) {
	t.Helper()
	b, _ := json.Marshal(spec)
	req, _ := http.NewRequest("POST", base+"/api/jobs", bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer tok")
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
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), AdminToken: "tok", Logger: slog.New(slog.DiscardHandler)})
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
	if code, out := submitSpec(t, hs.URL, spec); code != http.StatusCreated {
		t.Errorf("a readable job: %d %v", code, out)
	}
}
