package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
)

// The test binary doubles as the shoal binary: `shoal train --workers` starts workers with
// os.Executable(), which under `go test` is this binary. With SHOAL_TEST_AS_MAIN=1 it runs main.
func TestMain(m *testing.M) {
	if os.Getenv("SHOAL_TEST_AS_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// children lists the processes whose parent is this one.
func children(t *testing.T) []int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	var out []int
	me := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) > 1 {
			if ppid, _ := strconv.Atoi(f[1]); ppid == me {
				out = append(out, pid)
			}
		}
	}
	return out
}

// assertNoChildren waits up to 10 s for this process's children (workers of `shoal train
// --workers`) to exit, and fails the test with those left behind.
func assertNoChildren(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(children(t)) > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if c := children(t); len(c) > 0 {
		t.Fatalf("processes left behind: %v", c)
	}
}

// trainBothWays runs the job at jobPath with `shoal train` (checkpoints under dir/one) and with
// `shoal train --workers 3` (dir/cluster), fails the test unless every step's losses are bitwise
// the same, and returns the cluster's steps and its stderr (the plan it printed).
func trainBothWays(t *testing.T, jobPath, dir string) (steps []map[string]float64, stderr string) {
	t.Helper()
	localOut, _, err := run(t, "train", "--job", jobPath, "--json", "--out", filepath.Join(dir, "one"))
	if err != nil {
		t.Fatal(err)
	}
	out, stderr, err := run(t, "train", "--job", jobPath, "--json", "--workers", "3", "--out", filepath.Join(dir, "cluster"))
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr)
	}
	want, got := parseSteps(t, localOut), parseSteps(t, out)
	if len(got) != len(want) {
		t.Fatalf("%d steps from the cluster, %d from one process", len(got), len(want))
	}
	for i := range want {
		for _, k := range []string{"step", "loss", "aux", "val_loss"} {
			if got[i][k] != want[i][k] {
				t.Errorf("step %d %s: cluster %v, one process %v", i, k, got[i][k], want[i][k])
			}
		}
	}
	return got, stderr
}

// TestTrainWorkersEqualsLocal: `shoal train --workers 3` — a coordinator here and three worker
// processes over WebRTC on loopback — prints bitwise the same losses as `shoal train`, and leaves
// no process behind.
func TestTrainWorkersEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc to check for leftover processes")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 8)
	spec, err := job.ReadFile(jobPath)
	if err != nil {
		t.Fatal(err)
	}
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 2}, {2, 4}}}
	b, _ := json.Marshal(spec)
	os.WriteFile(jobPath, b, 0o644)

	_, stderr := trainBothWays(t, jobPath, dir)
	// The workers have memory to spare for the tiny model: the coordinator keeps all M
	// micro-batches in flight (the most depth, M−1), and the plan says so.
	if want := "in flight: depth " + strconv.Itoa(spec.MicroBatches-1) + " "; !strings.Contains(stderr, want) {
		t.Errorf("the plan printed does not say %q:\n%s", want, stderr)
	}
	assertNoChildren(t)
}

// TestEventPrinterEscapes: what peers say reaches the terminal without escape sequences or line
// breaks, and bounded.
func TestEventPrinterEscapes(t *testing.T) {
	var out strings.Builder
	p := &eventPrinter{w: &out, before: func() {}, names: map[string]string{}}
	p.print("worker.joined", "w-1", `{"name":"evil\u001b[2J\nname"}`)
	p.print("worker.left", "w-1", `{"reason":"bye\u001b]0;title\u0007\r\nforged line `+strings.Repeat("x", 1000)+`"}`)
	got := out.String()
	if strings.ContainsAny(strings.TrimSuffix(got, "\n"), "\x1b\x07\r\n") {
		t.Errorf("control characters reached the terminal: %q", got)
	}
	if !strings.HasPrefix(got, "! peer evil?[2J?name left: bye?]0;title???forged line xxx") || len(got) > 400 {
		t.Errorf("printed %d bytes: %q", len(got), got)
	}
}
