package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// The test binary doubles as the shoal binary: `shoal train --workers` starts workers with
// os.Executable(), which under `go test` is this binary. With SHOAL_TEST_AS_MAIN=1 it runs main.
func TestMain(m *testing.M) {
	if os.Getenv("SHOAL_TEST_AS_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	// The workers these tests start keep their identity (shoal worker --identity) in the user's
	// config directory unless told otherwise: a directory of the tests' own, not the user's.
	cfg, err := os.MkdirTemp("", "shoal-test-config-")
	if err != nil {
		panic(err)
	}
	os.Setenv("XDG_CONFIG_HOME", cfg) // what os.UserConfigDir reads first on Linux
	code := m.Run()
	os.RemoveAll(cfg)
	os.Exit(code)
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
	return trainBothWaysOn(t, jobPath, dir, 3, nil)
}

// trainBothWaysOn is trainBothWays with the given number of workers; onLine, when set, sees
// every line the cluster prints to stdout as it comes (a test's trigger).
func trainBothWaysOn(t *testing.T, jobPath, dir string, workers int, onLine func(string)) (steps []map[string]float64, stderr string) {
	t.Helper()
	localOut, _, err := run(t, "train", "--job", jobPath, "--json", "--out", filepath.Join(dir, "one"))
	if err != nil {
		t.Fatal(err)
	}
	var o lineWriter
	o.onLine = onLine
	var e bytes.Buffer
	m := &Main{Stdout: &o, Stderr: &e}
	err = m.Run(context.Background(), []string{"train", "--job", jobPath, "--json", "--workers", strconv.Itoa(workers), "--out", filepath.Join(dir, "cluster")})
	stderr = e.String()
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr)
	}
	checkWorkersCPU(t, o.buf.String(), workers)
	// A step replayed after a failure prints again: its last printing is the one that counts.
	want, got := parseSteps(t, localOut), lastOfEachStep(parseSteps(t, o.buf.String()))
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

// checkWorkersCPU: on Linux every --json row of a cluster run says how much CPU time each
// worker process has used so far, never less than the row before.
func checkWorkersCPU(t *testing.T, out string, workers int) {
	t.Helper()
	if runtime.GOOS != "linux" {
		return
	}
	var last []float64
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var row struct {
			Step int       `json:"step"`
			CPU  []float64 `json:"workers_cpu_s"`
		}
		if err := json.Unmarshal([]byte(line), &row); err != nil {
			t.Fatalf("--json line %q: %v", line, err)
		}
		if len(row.CPU) != workers {
			t.Fatalf("step %d: workers_cpu_s %v, want one figure for each of %d workers", row.Step, row.CPU, workers)
		}
		for i, c := range row.CPU {
			if last != nil && c < last[i] {
				t.Errorf("step %d: worker %d's CPU time fell from %v to %v s", row.Step, i, last[i], c)
			}
		}
		last = row.CPU
	}
}

// lastOfEachStep keeps the last printing of every step, in step order.
func lastOfEachStep(steps []map[string]float64) []map[string]float64 {
	var out []map[string]float64
	for _, s := range steps {
		if n := int(s["step"]); n < len(out) {
			out = out[:n]
		}
		out = append(out, s)
	}
	return out
}

// killerTest skips a test that kills worker processes where it cannot (-short, no /proc) and
// makes this binary the workers' main.
func killerTest(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc to find the worker to kill")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
}

// killAt returns an onLine that SIGKILLs the worker process named name once the line of step step
// is printed, and a function reporting the pid killed (0 if none was).
func killAt(t *testing.T, step int, name string) (onLine func(string), killed func() int) {
	var once sync.Once
	var pid atomic.Int64
	return func(line string) {
			if !strings.Contains(line, fmt.Sprintf(`"step":%d,`, step)) {
				return
			}
			once.Do(func() {
				for _, p := range children(t) {
					b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p), "cmdline"))
					if pr, err := os.FindProcess(p); strings.Contains(string(b), name) && err == nil && pr.Kill() == nil { // SIGKILL on Unix
						pid.Store(int64(p))
						return
					}
				}
			})
		}, func() int {
			return int(pid.Load())
		}
}

// lineWriter collects what is written and calls onLine with each complete line.
type lineWriter struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	partial string
	onLine  func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	w.partial += string(p)
	for {
		i := strings.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		line := w.partial[:i]
		w.partial = w.partial[i+1:]
		if w.onLine != nil {
			w.onLine(line)
		}
	}
	return len(p), nil
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

// replicaJob is the tiny job with M = 4 pinned to two pipeline replicas with different cuts and
// shares of 3 and 1 micro-batches: the gradient reduction crosses different stage boundaries
// (replica 0's first stage shares blocks with both of replica 1's stages).
func replicaJob(t *testing.T, dir string, steps int) string {
	t.Helper()
	jobPath := tinyJob(t, dir, steps)
	spec, err := job.ReadFile(jobPath)
	if err != nil {
		t.Fatal(err)
	}
	spec.BatchSize, spec.MicroBatches = 8, 4
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
		{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 3},
		{Stages: [][2]int{{0, 1}, {1, 4}}, MicroBatches: 1},
	}}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(jobPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return jobPath
}

// TestTrainReplicasEqualsLocal: `shoal train --workers 4` on a job pinning 2 pipeline replicas of
// 2 stages each — gradients reduced between the replicas peer to peer every step — prints bitwise
// the same losses as `shoal train`, and says it runs replicas; so does the same plan with two
// experts of block 3 on an expert host serving both replicas (five workers): the host folds
// micro-batches from two pipelines as they come, and its gradient is the whole step's.
func TestTrainReplicasEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	for _, tc := range replicaCases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			_, stderr := trainBothWaysOn(t, tc.job(t, dir, 6), dir, tc.workers, nil)
			for _, want := range tc.says {
				if !strings.Contains(stderr, want) {
					t.Errorf("the plan printed does not say %q:\n%s", want, stderr)
				}
			}
			assertNoChildren(t)
		})
	}
}

// replicaCases are the pinned plans of two replicas the cluster tests run: without and with an
// expert host, and what the plan printed says of each.
var replicaCases = []struct {
	name    string
	job     func(t *testing.T, dir string, steps int) string
	workers int
	says    []string
}{
	{"stages", replicaJob, 4, []string{"2 pipeline replicas, step sync", "replica 0: micro-batches [0,3) of 4", "replica 1: micro-batches [3,4) of 4"}},
	{"expert-host", hostedReplicaJob, 5, []string{"2 pipeline replicas, step sync", "expert host: block 3 experts [0 2]"}},
}

// hostedReplicaJob is replicaJob with two experts of MoE block 3 on an expert host, which serves
// both replicas' stages of the block (replica 0's second stage, replica 1's second).
func hostedReplicaJob(t *testing.T, dir string, steps int) string {
	t.Helper()
	jobPath := replicaJob(t, dir, steps)
	editJob(t, jobPath, func(s *job.Spec) {
		s.Plan.Experts = []job.ExpertShard{{Block: 3, Host: 0, Experts: []int{0, 2}}}
	})
	return jobPath
}

// TestTrainReplicaKilled: a worker is SIGKILLed mid-job; the job goes on with the one replica
// the workers left can staff, and every step's losses are still bitwise those of one process.
// Without expert hosts the survivors share the lost replica's micro-batches keeping their shards
// (sched.Reshare): the plan after the kill restores nothing, and there is no other; an expert
// host serving every replica keeps its experts too. Only the host's own loss restores from the
// newest checkpoint: nobody else holds its experts.
func TestTrainReplicaKilled(t *testing.T) {
	killerTest(t)
	for _, tc := range replicaCases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			// Whatever local-3 holds — a stage of either replica or the host — the workers left
			// staff only one replica (and the host).
			onLine, killed := killAt(t, 3, "local-3")
			_, stderr := trainBothWaysOn(t, tc.job(t, dir, 8), dir, tc.workers, onLine)
			if killed() == 0 {
				t.Fatal("no worker process local-3 was killed")
			}
			before, after, ok := strings.Cut(stderr, "plan v2:")
			if !ok || strings.Count(stderr, "pipeline replicas") != 1 {
				t.Errorf("no plan of one pipeline after the kill:\n%s", stderr)
			}
			for _, want := range tc.says {
				if strings.HasPrefix(want, "expert host") && !strings.Contains(after, want) {
					t.Errorf("the plan after the kill does not say %q:\n%s", want, stderr)
				}
			}
			kept := strings.Contains(after, "every shard kept from plan v1 at step")
			if hostLost := strings.Contains(before, "expert host: block 3 experts [0 2] on local-3"); kept == hostLost || (kept && strings.Contains(after, "plan v3:")) {
				t.Errorf("the plans after the kill (the expert host lost: %v) say they kept the shards: %v, want %v and no other plan:\n%s", hostLost, kept, !hostLost, stderr)
			}
			assertNoChildren(t)
		})
	}
}

// TestTrainOuterEqualsLocal: sync mode "outer" (DiLoCo) over two pipeline replicas of two
// stages each — inner steps apart, an outer step every 2 steps and after the last, θ_r or int8
// pseudo-gradients exchanged peer to peer — prints bitwise the losses and validation losses of
// `shoal train`'s single-process outer loop, for both compressions; and so does the outer step
// overlapped with training ("delay" 2, every 3): each replica's exchange runs beside its next
// steps and is taken up two steps later, with checkpoints (after steps 3 and 6) and evaluations
// falling while one is pending.
func TestTrainOuterEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	for _, tc := range []struct {
		name, compress string
		every, delay   int
	}{{"none", "none", 2, 0}, {"int8", "int8", 2, 0}, {"int8-delay", "int8", 3, 2}, {"none-delay", "none", 3, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			jobPath := replicaJob(t, dir, 7)
			spec, err := job.ReadFile(jobPath)
			if err != nil {
				t.Fatal(err)
			}
			spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: tc.every, OuterLR: 0.7, OuterMomentum: 0.9, Compress: tc.compress, Delay: tc.delay}
			b, _ := json.Marshal(spec)
			if err := os.WriteFile(jobPath, b, 0o644); err != nil {
				t.Fatal(err)
			}
			_, stderr := trainBothWaysOn(t, jobPath, dir, 4, nil)
			if !strings.Contains(stderr, "2 pipeline replicas, outer sync") {
				t.Errorf("the plan printed does not say it runs outer sync:\n%s", stderr)
			}
			if says := "every outer step overlapping 2 inner steps"; (tc.delay > 0) != strings.Contains(stderr, says) {
				t.Errorf("delay %d: the plan printed says %q or not wrongly:\n%s", tc.delay, says, stderr)
			}
			assertNoChildren(t)
		})
	}
}

// TestTrainOuterOwnBatchesEqualsLocal: outer mode with own batches ("batches": "own") prints
// bitwise the losses and validation losses of `shoal train`'s one process, with batches of the
// job's size — each of the two replicas trains all four micro-batches of a batch of its own, so
// a step trains two batches, and the losses are not the shared mode's — and of sizes of their
// own: replica 0 one micro-batch of B/M rows, replica 1 three, M being 2, so every stage of
// replica 1 runs a step of one more micro-batch than the job's M.
func TestTrainOuterOwnBatchesEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	cases := []struct {
		name    string
		workers int
		edit    func(s *job.Spec)
		plan    []string // what the plan printed says
	}{
		{"whole", 4, func(s *job.Spec) {
			for i := range s.Plan.Replicas {
				s.Plan.Replicas[i].MicroBatches = s.MicroBatches
			}
		}, []string{"replica 1: all 4 micro-batches of its own batch"}},
		{"sized", 3, func(s *job.Spec) {
			s.MicroBatches = 2
			s.Plan.Replicas = []job.ReplicaPlan{
				{Stages: [][2]int{{0, 4}}, MicroBatches: 1},
				{Stages: [][2]int{{0, 1}, {1, 4}}, MicroBatches: 3},
			}
		}, []string{"replica 0: 1 micro-batch of its own batch (the job's batch is 2 of 4 rows)",
			"replica 1: 3 micro-batches of its own batch (the job's batch is 2 of 4 rows)"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			jobPath := replicaJob(t, dir, 5)
			editJob(t, jobPath, func(s *job.Spec) {
				s.Sync = &job.Sync{Mode: job.SyncOuter, Every: 2, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Batches: job.BatchesOwn}
				tc.edit(s)
			})
			steps, stderr := trainBothWaysOn(t, jobPath, dir, tc.workers, nil)
			for _, want := range append(tc.plan, "2 pipeline replicas, outer sync, a batch of its own for each (2 batches a step)") {
				if !strings.Contains(stderr, want) {
					t.Errorf("the plan printed does not say %q:\n%s", want, stderr)
				}
			}
			if steps[1]["tokens_per_s"] <= 0 {
				t.Errorf("step 1: tokens/s %v", steps[1]["tokens_per_s"])
			}
			assertNoChildren(t)
			if tc.name != "whole" {
				return
			}
			// The shared mode's first replica trains micro-batches 0-3 of the one batch too, but
			// the second trains other data: the losses differ from the first step on.
			editJob(t, jobPath, func(s *job.Spec) {
				s.Sync.Batches = job.BatchesShared
				s.Plan.Replicas[0].MicroBatches, s.Plan.Replicas[1].MicroBatches = 3, 1
			})
			out, _, err := run(t, "train", "--job", jobPath, "--json")
			if err != nil {
				t.Fatal(err)
			}
			if shared := parseSteps(t, out); shared[0]["loss"] == steps[0]["loss"] {
				t.Errorf("own batches gave the shared mode's loss %v at step 0", steps[0]["loss"])
			}
		})
	}
}

// TestTrainOuterReplicaKilled: in outer mode a worker SIGKILLed mid-job leaves one replica. The
// coordinator drops the lost replica at once (sched.DropReplica): the survivor carries on under
// the same plan, and the lost replica's round is left out of the next outer average. Should the
// survivor's outer exchange still need the lost replica's contribution (with a delay, the outer
// step is taken up two steps after it is asked), the exchange fails and the job restores instead:
// the survivor's own state (θ_r, AdamW moments) and the outer optimizer's from the newest
// checkpoint. Either way the job finishes every step, and the run is not the pinned plan's: it is
// what the run recorded (plans.json: which replicas from which step, and which dropped), and
// `shoal train --replay` of that record prints the same losses and validation losses bit for bit.
func TestTrainOuterReplicaKilled(t *testing.T) {
	killerTest(t)
	for _, tc := range []struct {
		name, batches string
		own           []int // with own batches, each replica's micro-batches (M = 4)
		every, delay  int
	}{
		{job.BatchesShared, job.BatchesShared, nil, 2, 0},
		{job.BatchesOwn, job.BatchesOwn, []int{4, 4}, 2, 0},
		// The replica left after the kill keeps its 2 micro-batches; the lost one trained 6.
		{"own-unequal", job.BatchesOwn, []int{2, 6}, 2, 0},
		// The outer step after step 2 is taken up after step 4: the checkpoint after step 3,
		// which the survivor restores, holds the replicas' snapshots of step 2.
		{"delay", job.BatchesShared, nil, 3, 2},
	} {
		t.Run(tc.name, func(t *testing.T) { outerReplicaKilled(t, tc.batches, tc.own, tc.every, tc.delay) })
	}
}

// outerReplicaKilled is TestTrainOuterReplicaKilled with the replicas training shares of each
// step's batch or batches of their own, of own[r] micro-batches, an outer step every every steps
// taken up delay steps later.
func outerReplicaKilled(t *testing.T, batches string, own []int, every, delay int) {
	dir := t.TempDir()
	jobPath := replicaJob(t, dir, 8)
	spec := editJob(t, jobPath, func(s *job.Spec) {
		s.Sync = &job.Sync{Mode: job.SyncOuter, Every: every, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Batches: batches, Delay: delay}
		for i, n := range own {
			s.Plan.Replicas[i].MicroBatches = n
		}
	})
	onLine, killed := killAt(t, 4, "local-3")
	o := &lineWriter{onLine: onLine}
	var e bytes.Buffer
	m := &Main{Stdout: o, Stderr: &e}
	out := filepath.Join(dir, "cluster")
	if err := m.Run(context.Background(), []string{"train", "--job", jobPath, "--json", "--workers", "4", "--out", out}); err != nil {
		t.Fatalf("%v\n%s", err, e.String())
	}
	if killed() == 0 {
		t.Fatal("no worker was killed")
	}
	steps := lastOfEachStep(parseSteps(t, o.buf.String()))
	if len(steps) != spec.Steps {
		t.Fatalf("%d steps, want %d", len(steps), spec.Steps)
	}
	assertNoChildren(t)
	b, err := os.ReadFile(filepath.Join(out, PlansFile))
	if err != nil {
		t.Fatal(err)
	}
	var periods []local.Period
	if err := json.Unmarshal(b, &periods); err != nil {
		t.Fatal(err)
	}
	last := periods[len(periods)-1]
	if len(periods) < 2 || len(periods[0].Replicas) != 2 || len(last.Replicas)-len(last.Dropped) != 1 {
		t.Fatalf("recorded plans %s: want 2 replicas from step 0, then 1", b)
	}
	replanned := strings.Contains(e.String(), "plan v2:")
	switch {
	case len(last.Dropped) == 1 && replanned:
		t.Errorf("recorded plans %s: a replica dropped, and yet a second plan:\n%s", b, e.String())
	case len(last.Dropped) == 1:
		t.Logf("the lost replica was dropped from step %d", last.From)
	case periods[1].From != 3:
		// The survivor restored the checkpoint after step 3 (checkpoint_every 3), with a delay
		// one taken while an outer step was pending: it holds every replica's snapshot.
		t.Errorf("recorded plans %s: want the second from step 3, the checkpoint before the kill", b)
	default:
		t.Logf("the survivor restored the checkpoint after step 3")
	}
	if _, pending := spec.OuterPending(3); pending {
		ck, err := model.LoadCheckpoint(filepath.Join(out, local.CheckpointName(3)))
		if err != nil {
			t.Fatal(err)
		}
		for r := range 2 {
			if _, ok := ck.Tensors[model.ReplicaPrefix(r)+model.ReplicaSnapPrefix+"transformer.wte.weight"]; !ok {
				t.Errorf("the checkpoint after step 3 lacks replica %d's snapshot", r)
			}
		}
	}
	replayed, _, err := run(t, "train", "--job", jobPath, "--json", "--replay", filepath.Join(out, PlansFile))
	if err != nil {
		t.Fatal(err)
	}
	want := parseSteps(t, replayed)
	if len(want) != len(steps) {
		t.Fatalf("%d steps replayed, %d run", len(want), len(steps))
	}
	for i := range want {
		for _, k := range []string{"step", "loss", "aux", "val_loss"} {
			if steps[i][k] != want[i][k] {
				t.Errorf("step %d %s: cluster %v, replay in one process %v (plans %s)", i, k, steps[i][k], want[i][k], b)
			}
		}
	}
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

// TestTrainStopsWhenUnstaffable: `shoal train --workers 2` on a job pinning two stages loses a
// worker (SIGKILL) mid-job; nobody will join to replace it, so the run ends at once with an error
// naming the worker and the plan's need, instead of waiting for a worker forever.
func TestTrainStopsWhenUnstaffable(t *testing.T) {
	killerTest(t)
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 40)
	editJob(t, jobPath, func(s *job.Spec) { s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}} })
	onLine, killed := killAt(t, 2, "local-1")
	o := &lineWriter{onLine: onLine}
	var e bytes.Buffer
	m := &Main{Stdout: o, Stderr: &e}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := m.Run(ctx, []string{"train", "--job", jobPath, "--json", "--workers", "2"})
	if killed() == 0 {
		t.Fatal("no worker was killed")
	}
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "the 1 left cannot staff a plan of 2") {
		t.Fatalf("run ended with %v (deadline: %v), want the unstaffable plan named\n%s", err, ctx.Err(), e.String())
	}
	assertNoChildren(t)
}
