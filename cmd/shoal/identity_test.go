package main

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
)

// identityStatus is what these tests read of /api/status.
type identityStatus struct {
	Job *struct {
		State string `json:"state"`
		Step  int    `json:"step"`
	} `json:"job"`
	Credits []creditJSON `json:"credits"`
}

func getIdentityStatus(t *testing.T, url string) (identityStatus, bool) {
	t.Helper()
	var st identityStatus
	resp, err := http.Get(url + "/api/status")
	if err != nil {
		return st, false
	}
	defer resp.Body.Close()
	return st, resp.StatusCode == http.StatusOK && json.NewDecoder(resp.Body).Decode(&st) == nil
}

// awaitCredit polls the status until ok says yes about its credits, or the coordinator or the
// worker exits, or a generous deadline passes.
func awaitCredit(t *testing.T, url string, procs []*proc, what string, ok func([]creditJSON) bool) []creditJSON {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Minute); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		for _, p := range procs {
			select {
			case <-p.done:
				t.Fatalf("%s exited while waiting for %s", p.name, what)
			default:
			}
		}
		if st, good := getIdentityStatus(t, url); good && ok(st.Credits) {
			return st.Credits
		}
	}
	t.Fatalf("timed out waiting for %s", what)
	return nil
}

// TestCreditSurvivesWorkerRestart: a volunteer's `shoal worker --identity FILE` earns verified
// credit from a real coordinator, is stopped, and starts again with the same file: it joins
// under a new worker id, and what it earns after the restart adds to the same line of the
// leaderboard — one volunteer, one total — named by the identity's fingerprint.
func TestCreditSurvivesWorkerRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts processes")
	}
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 100000)
	spec, err := job.ReadFile(jobPath)
	if err != nil {
		t.Fatal(err)
	}
	spec.CheckpointEvery, spec.ValEvery, spec.AuditRate = 4, 0, 0.5
	spec.StepDeadlineMinS, spec.StepDeadlineMaxS = 30, 120
	b, _ := json.Marshal(spec)
	os.WriteFile(jobPath, b, 0o644)

	addr := freeAddr(t)
	url := "http://" + addr
	coord := startProc(t, dir, "coordinator", "serve", "--data-dir", filepath.Join(dir, "data"), "--listen", addr, "--job", jobPath)
	defer func() { coord.kill(); <-coord.done }()
	idFile := filepath.Join(dir, "volunteer.identity")
	workerArgs := []string{"worker", "--coordinator", url, "--threads", "1", "--device", "cpu", "--identity", idFile}

	w1 := startProc(t, dir, "worker-1", workerArgs...)
	defer func() { w1.kill(); <-w1.done }()
	before := awaitCredit(t, url, []*proc{coord, w1}, "verified credit before the restart", func(cs []creditJSON) bool {
		return len(cs) == 1 && cs[0].VerifiedMicroBatches > 0
	})[0]
	if before.Identity == "" {
		t.Fatalf("credit kept under worker %s, with no identity", before.Worker)
	}
	if fi, err := os.Stat(idFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("identity file: %v, %v; want mode 0600", fi, err)
	}
	w1.cmd.Process.Signal(syscall.SIGTERM)
	<-w1.done

	w2 := startProc(t, dir, "worker-2", workerArgs...)
	defer func() { w2.kill(); <-w2.done }()
	after := awaitCredit(t, url, []*proc{coord, w2}, "verified credit after the restart", func(cs []creditJSON) bool {
		for _, c := range cs {
			if c.Identity == before.Identity && c.Worker != before.Worker && c.VerifiedMicroBatches > before.VerifiedMicroBatches {
				return true
			}
		}
		return false
	})
	if len(after) != 1 {
		t.Fatalf("credits after the restart: %+v, want one line for the one volunteer", after)
	}
	out, _, err := run(t, "status", "--coordinator", url, "--volunteer", before.Identity)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "volunteer "+before.Identity+", over every job: ") || !strings.Contains(out, before.Identity) {
		t.Errorf("shoal status --volunteer does not show the volunteer's total:\n%s", out)
	}
	t.Logf("volunteer %s: %d verified micro-batches as %s, %d in all after restarting as %s",
		before.Identity, before.VerifiedMicroBatches, before.Worker, after[0].VerifiedMicroBatches, after[0].Worker)
}
