package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/storage"
	"github.com/shoal-ml/shoal/vulkan"
)

// minPauseEnv shortens minPause in the worker processes the tests start (TestMain runs main in
// them), which would otherwise keep an integration test waiting two minutes per pause.
const minPauseEnv = "SHOAL_TEST_MIN_PAUSE"

func init() {
	if d, err := time.ParseDuration(os.Getenv(minPauseEnv)); err == nil && os.Getenv("SHOAL_TEST_AS_MAIN") == "1" {
		minPause = d
	}
}

func TestParseSchedule(t *testing.T) {
	at := func(hm string) time.Time {
		c, err := parseClock(hm, false)
		if err != nil {
			t.Fatal(err)
		}
		return time.Date(2026, 12, 4, c/60, c%60, 0, 0, time.Local)
	}
	for _, tc := range []struct {
		in       string
		inside   []string
		outside  []string
		asString string
	}{
		{"22:00-07:00", []string{"22:00", "23:59", "00:00", "06:59"}, []string{"07:00", "12:00", "21:59"}, "22:00-07:00"},
		{"9:30-17:00", []string{"09:30", "16:59"}, []string{"09:29", "17:00", "00:00"}, "09:30-17:00"},
		{"12:00-13:30, 22:00-24:00", []string{"12:00", "13:29", "22:00", "23:59"}, []string{"13:30", "00:00", "21:59"}, "12:00-13:30,22:00-00:00"},
		{"00:00-00:01", []string{"00:00"}, []string{"00:01", "23:59"}, "00:00-00:01"},
	} {
		s, err := parseSchedule(tc.in)
		if err != nil {
			t.Fatalf("%q: %v", tc.in, err)
		}
		if s.String() != tc.asString {
			t.Errorf("%q reads back as %q, want %q", tc.in, s, tc.asString)
		}
		for _, hm := range tc.inside {
			if !s.contains(at(hm)) {
				t.Errorf("%q does not contain %s", tc.in, hm)
			}
		}
		for _, hm := range tc.outside {
			if s.contains(at(hm)) {
				t.Errorf("%q contains %s", tc.in, hm)
			}
		}
	}
	for _, bad := range []string{"", "22:00", "22-07", "22:00-07", "25:00-07:00", "22:60-07:00", "22:00-24:01",
		"24:00-07:00", "07:00-07:00", "00:00-24:00", "22:00-07:00,", "-1:00-07:00", "22:0-07:00", "a:bc-07:00", "22:00-07:00-08:00"} {
		if s, err := parseSchedule(bad); err == nil {
			t.Errorf("--schedule %q accepted as %v", bad, s)
		}
	}
}

func TestParseRate(t *testing.T) {
	for in, want := range map[string]float64{
		"10Mbit": 1.25e6, "10Mbit/s": 1.25e6, "10mbps": 1.25e6, "1Gbit": 125e6, "800kbit": 1e5,
		"2MB/s": 2e6, "2MB": 2e6, "512KiB/s": 512 << 10, "1.5 MiB/s": 1.5 * (1 << 20), "4096B/s": 4096,
	} {
		got, err := parseRate(in)
		if err != nil || got != want {
			t.Errorf("parseRate(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "10", "-10Mbit", "0Mbit", "10Mbit/s/s", "10Mbps/s", "fast", "10 furlongs", "100bit", "1e9Gbit", "Mbit"} {
		if got, err := parseRate(bad); err == nil {
			t.Errorf("parseRate(%q) = %v, want an error", bad, got)
		}
	}
	var p percentFlag
	for _, bad := range []string{"0", "100", "-5", "150", "x", "NaN"} {
		if p.Set(bad) == nil {
			t.Errorf("--pause-when-busy %s accepted", bad)
		}
	}
	if p.Set("50%") != nil || p != 50 {
		t.Errorf("--pause-when-busy 50%%: %v", p)
	}
}

func TestDecide(t *testing.T) {
	night, _ := parseSchedule("22:00-07:00")
	noon := time.Date(2026, 12, 4, 12, 0, 0, 0, time.Local)
	late := time.Date(2026, 12, 4, 23, 0, 0, 0, time.Local)
	idle := readings{Busy: 5}
	for _, tc := range []struct {
		name string
		pol  workerPolicy
		now  time.Time
		r    readings
		want string // "" runs; else a part of the reason
	}{
		{"no policy", workerPolicy{}, noon, readings{OnBattery: true, Busy: 100}, ""},
		{"on AC", workerPolicy{onBattery: true}, noon, idle, ""},
		{"on battery", workerPolicy{onBattery: true}, noon, readings{OnBattery: true, Busy: -1}, "on battery"},
		{"battery, not asked", workerPolicy{busyPct: 50}, noon, readings{OnBattery: true, Busy: 5}, ""},
		{"busy", workerPolicy{busyPct: 50}, noon, readings{Busy: 80}, "80% of the CPUs"},
		{"at the threshold", workerPolicy{busyPct: 50}, noon, readings{Busy: 50}, ""},
		{"busy unknown", workerPolicy{busyPct: 50}, noon, readings{Busy: -1}, ""},
		{"inside the schedule", workerPolicy{schedule: night}, late, idle, ""},
		{"outside the schedule", workerPolicy{schedule: night}, noon, idle, "outside --schedule 22:00-07:00 (now 12:00)"},
		{"two reasons", workerPolicy{onBattery: true, schedule: night}, noon, readings{OnBattery: true}, "(now 12:00); on battery"},
	} {
		v, _ := tc.pol.decide(tc.now, tc.r, policyState{})
		if v.pause != (tc.want != "") || !strings.Contains(v.reason, tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, v, tc.want)
		}
	}
}

// writePower writes a laptop's power supplies under dir as Linux's sysfs shows them: mains
// online or not, and a battery charging or discharging. Each file is replaced whole (a rename),
// so that a reader never sees half of one.
func writePower(t *testing.T, dir string, mains bool) {
	t.Helper()
	online, status := "0", "Discharging"
	if mains {
		online, status = "1", "Charging"
	}
	for _, f := range [][3]string{{"AC", "type", "Mains"}, {"AC", "online", online}, {"BAT0", "type", "Battery"}, {"BAT0", "status", status}} {
		d := filepath.Join(dir, f[0])
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		tmp := filepath.Join(d, "."+f[1])
		if err := os.WriteFile(tmp, []byte(f[2]+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(d, f[1])); err != nil {
			t.Fatal(err)
		}
	}
}

func TestOnBattery(t *testing.T) {
	dir := t.TempDir()
	writePower(t, dir, true)
	if b, err := onBattery(dir); err != nil || b {
		t.Fatalf("on mains: %v, %v", b, err)
	}
	writePower(t, dir, false)
	if b, err := onBattery(dir); err != nil || !b {
		t.Fatalf("discharging: %v, %v", b, err)
	}
	// A battery that reports no discharge (full, or a firmware that says "Unknown") with the
	// mains offline is still on battery; a desktop without a battery never is.
	os.WriteFile(filepath.Join(dir, "BAT0", "status"), []byte("Unknown\n"), 0o644)
	if b, _ := onBattery(dir); !b {
		t.Error("mains offline with a battery: not on battery")
	}
	os.RemoveAll(filepath.Join(dir, "BAT0"))
	if b, _ := onBattery(dir); b {
		t.Error("no battery: on battery")
	}
	if _, err := onBattery(filepath.Join(dir, "none")); err == nil {
		t.Error("a missing directory read without an error")
	}
}

func TestOthersBusy(t *testing.T) {
	a := cpuSample{total: 1000, idle: 800, self: 50}
	b := cpuSample{total: 2000, idle: 1300, self: 350}
	// 1000 ticks: 500 idle, 300 this process's, 200 the others'.
	if got := othersBusy(a, b); got != 20 {
		t.Fatalf("others busy %v%%, want 20", got)
	}
	if got := othersBusy(b, b); got >= 0 {
		t.Fatalf("no ticks: %v, want unknown", got)
	}
	if _, err := readCPU(time.Now()); err != nil && isLinux() {
		t.Fatal(err)
	}
}

func isLinux() bool {
	_, err := os.Stat("/proc/self/stat")
	return err == nil
}

// TestWorkerPausesOnBattery: a coordinator and two worker processes train the tiny job on a
// pinned plan of two stages. When one worker's machine goes on battery (its power supplies are
// files the test writes), it leaves at a step boundary — the coordinator checkpoints the boundary
// and the job waits, since nobody else can hold the stage — and when the mains come back it
// rejoins and the job finishes: every step computed once, with losses and the final model
// bitwise those of one process.
func TestWorkerPausesOnBattery(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts processes")
	}
	if !isLinux() {
		t.Skip("--pause-on-battery reads Linux's power supply class")
	}
	dir := t.TempDir()
	const steps = 24
	jobPath := tinyJob(t, dir, steps)
	editJob(t, jobPath, func(s *job.Spec) {
		s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
		s.StepDeadlineMinS, s.StepDeadlineMaxS = 5, 60
	})
	refDir := filepath.Join(dir, "ref")
	refOut, _, err := run(t, "train", "--job", jobPath, "--out", refDir, "--json")
	if err != nil {
		t.Fatal(err)
	}
	want := parseSteps(t, refOut)
	ref, _, err := model.LoadModel(filepath.Join(refDir, local.CheckpointName(steps)))
	if err != nil {
		t.Fatal(err)
	}

	power := filepath.Join(dir, "power")
	writePower(t, power, true)
	t.Setenv(powerSupplyEnv, power) // read by the worker with --pause-on-battery alone
	t.Setenv(minPauseEnv, "1s")
	addr := freeAddr(t)
	url := "http://" + addr
	data := filepath.Join(dir, "data")
	coord := startProc(t, dir, "coordinator", "serve", "--data-dir", data, "--listen", addr, "--job", jobPath, "--min-workers", "2")
	plain := startProc(t, dir, "worker-0", "worker", "--coordinator", url, "--threads", "1", "--device", "cpu", "--name", "w0")
	laptop := startProc(t, dir, "laptop", "worker", "--coordinator", url, "--threads", "1", "--device", "cpu", "--name", "laptop", "--pause-on-battery")
	procs := []*proc{coord, plain, laptop}
	t.Cleanup(func() {
		for _, p := range procs {
			p.kill()
			<-p.done
		}
	})
	laptopLog := func() string {
		b, _ := os.ReadFile(filepath.Join(dir, "laptop.log"))
		return string(b)
	}
	status := func() (chaosStatus, bool) {
		var st chaosStatus
		resp, err := http.Get(url + "/api/status")
		if err != nil {
			return st, false
		}
		defer resp.Body.Close()
		return st, json.NewDecoder(resp.Body).Decode(&st) == nil && st.Job != nil
	}
	exited := func() {
		for _, p := range procs {
			select {
			case <-p.done:
				t.Fatalf("%s exited:\n%s", p.name, tail(filepath.Join(dir, p.name+".log")))
			default:
			}
		}
	}
	await := func(what string, ok func(chaosStatus) bool) chaosStatus {
		t.Helper()
		for deadline := time.Now().Add(3 * time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			exited()
			if st, got := status(); got && ok(st) {
				return st
			}
		}
		t.Fatalf("timed out waiting for %s; the laptop's log:\n%s", what, laptopLog())
		return chaosStatus{}
	}

	await("step 3", func(st chaosStatus) bool { return st.Job.Step >= 3 })
	writePower(t, power, false)
	st := await("the laptop to pause", func(chaosStatus) bool { return strings.Contains(laptopLog(), "msg=paused ") })
	if st.Job.State == "done" || st.Job.Step >= steps {
		t.Fatalf("the job finished (step %d) before the laptop paused: give it more steps", st.Job.Step)
	}
	pausedAt := st.Job.Step
	if l := laptopLog(); !strings.Contains(l, `reason="on battery power"`) {
		t.Errorf("the pause does not say why:\n%s", l)
	}
	writePower(t, power, true)
	await("the job to finish", func(st chaosStatus) bool { return st.Job.State == "done" })
	l := laptopLog()
	if !strings.Contains(l, "msg=\"resuming: ") || strings.Count(l, "msg=joined") < 2 {
		t.Fatalf("the laptop did not resume and join again:\n%s", l)
	}
	t.Logf("paused after step %d; the laptop's log:\n%s", pausedAt, l)

	coord.kill()
	<-coord.done
	db, err := storage.Open(context.Background(), filepath.Join(data, "shoal.db"), storage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	jobs, err := db.ListJobs(context.Background())
	if err != nil || len(jobs) != 1 {
		t.Fatalf("jobs %v, %v: want one", jobs, err)
	}
	got, err := db.ListSteps(context.Background(), jobs[0].ID, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("%d steps recorded, %d by one process", len(got), len(want))
	}
	for i, s := range got {
		w := want[i]
		if s.Step != int64(w["step"]) || s.Loss != w["loss"] || s.Aux != w["aux"] {
			t.Errorf("step %d: loss %v aux %v, one process %v %v", s.Step, s.Loss, s.Aux, w["loss"], w["aux"])
		}
		if v, ok := w["val_loss"]; ok && (s.ValLoss == nil || *s.ValLoss != v) {
			t.Errorf("step %d: val_loss %v, one process %v", s.Step, s.ValLoss, v)
		}
		if s.Attempts != 1 {
			t.Errorf("step %d computed %d times: the pause was not at a step boundary", s.Step, s.Attempts)
		}
	}
	evs, err := db.ListEvents(context.Background(), storage.EventFilter{})
	if err != nil {
		t.Fatal(err)
	}
	leaving := 0
	for _, e := range evs {
		switch e.Kind {
		case "worker.leaving":
			leaving++
			if !bytes.Contains(e.Message, []byte("on battery power")) {
				t.Errorf("worker.leaving %s does not say why", e.Message)
			}
		case "step.abandoned":
			t.Errorf("a step was abandoned: %s", e.Message)
		}
	}
	if leaving != 1 {
		t.Errorf("%d worker.leaving events, want 1", leaving)
	}
	db.Close()

	out := filepath.Join(dir, "final.safetensors")
	if _, stderr, err := run(t, "export", "--data-dir", data, "--out", out); err != nil {
		t.Fatalf("export: %v\n%s", err, stderr)
	}
	final, ck, err := model.LoadModel(out)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != steps {
		t.Fatalf("final checkpoint after step %d, want %d", ck.Step, steps)
	}
	for i, tt := range ref.P.Tensors {
		g := final.P.Tensors[i].Data
		for j := range g {
			if math.Float32bits(g[j]) != math.Float32bits(tt.Data[j]) {
				t.Fatalf("%s[%d] = %v after the pause, %v without", tt.Name, j, g[j], tt.Data[j])
			}
		}
	}
}

// TestDeployWorkerConf: every key deploy/worker.conf shows, set or commented out, is a flag of
// `shoal worker`, and its values are ones the flag takes.
func TestDeployWorkerConf(t *testing.T) {
	b, err := os.ReadFile("../../deploy/worker.conf")
	if err != nil {
		t.Fatal(err)
	}
	_, help, _ := run(t, "worker", "--help")
	key := regexp.MustCompile(`^(?:# )?([a-z][a-z-]*)(?: = (\S+))?$`)
	var conf strings.Builder
	seen := 0
	for _, line := range strings.Split(string(b), "\n") {
		m := key.FindStringSubmatch(strings.TrimSpace(line))
		if m == nil {
			continue
		}
		if !strings.Contains(help, "\n  -"+m[1]+" ") && !strings.Contains(help, "\n  -"+m[1]+"\n") {
			t.Errorf("worker.conf shows %q, which `shoal worker --help` does not list", m[1])
			continue
		}
		seen++
		if m[1] != "identity" && m[1] != "join" {
			conf.WriteString(strings.TrimPrefix(strings.TrimSpace(line), "# ") + "\n")
		}
	}
	for _, want := range []string{"pause-on-battery", "pause-when-busy", "schedule", "max-upload", "gpu-memory"} {
		if !strings.Contains(conf.String(), want) {
			t.Errorf("worker.conf does not show %s", want)
		}
	}
	// The values parse: a worker given them all gets as far as the coordinator (here, none).
	p := filepath.Join(t.TempDir(), "worker.conf")
	os.WriteFile(p, []byte(strings.ReplaceAll(conf.String(), "http://127.0.0.1:8470", "127.0.0.1:1")), 0o600)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	m := &Main{Stdout: io.Discard, Stderr: io.Discard}
	if err := m.Run(ctx, []string{"worker", "--config", p, "--device", "cpu", "--identity", filepath.Join(t.TempDir(), "id")}); err != nil {
		t.Errorf("a worker from deploy/worker.conf's keys: %v", err)
	}
	if seen < 8 {
		t.Errorf("found %d keys in worker.conf: the pattern is broken", seen)
	}
}

// TestSamplerBusyWindow: the busy reading is the others' share over the last minute of samples,
// unknown until half a minute has been watched, and it follows the load as the window moves.
func TestSamplerBusyWindow(t *testing.T) {
	if !isLinux() {
		t.Skip("the busy check reads Linux's /proc")
	}
	s := newSampler(workerPolicy{busyPct: 50}, slog.New(slog.DiscardHandler))
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.Local)
	var c cpuSample
	others := 80 // percent of each interval's ticks used by other processes
	s.readCPU = func(now time.Time) (cpuSample, error) {
		c.at = now
		c.total += 100
		c.idle += uint64(100 - others - 10)
		c.self += 10
		return c, nil
	}
	now := t0
	for i := 0; i < 14; i++ { // 26 s of readings
		if r := s.read(now, true); r.Busy >= 0 && now.Sub(t0) < busyWindow/2 {
			t.Fatalf("a busy reading after %v: %v", now.Sub(t0), r.Busy)
		}
		now = now.Add(policyEvery)
	}
	for now.Sub(t0) < 2*busyWindow {
		s.read(now, true)
		now = now.Add(policyEvery)
	}
	if r := s.read(now, false); r.Busy != 80 {
		t.Fatalf("others busy %v%%, want 80", r.Busy)
	}
	others = 0
	for end := now.Add(busyWindow + policyEvery); now.Before(end); now = now.Add(policyEvery) {
		s.read(now, true)
	}
	if r := s.read(now, false); r.Busy != 0 {
		t.Fatalf("a minute after the others stopped: %v%%, want 0", r.Busy)
	}
	if len(s.cpu) > int(busyWindow/policyEvery)+2 {
		t.Fatalf("%d samples kept for a %v window", len(s.cpu), busyWindow)
	}
}

// TestMonitorSchedule: the monitor, on an injected clock, pauses when a nudge finds the clock
// outside the schedule and resumes when it is inside again; its verdict's channel says so.
func TestMonitorSchedule(t *testing.T) {
	night, _ := parseSchedule("22:00-07:00")
	clock := time.Date(2026, 12, 4, 23, 0, 0, 0, time.Local)
	var mu sync.Mutex
	m := newMonitor(workerPolicy{schedule: night}, slog.New(slog.DiscardHandler), func() time.Time { mu.Lock(); defer mu.Unlock(); return clock }, nil)
	set := func(t time.Time) { mu.Lock(); clock = t; mu.Unlock() }
	if v, _ := m.current(); v.pause {
		t.Fatalf("at 23:00 in 22:00-07:00: %v", v)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.run(ctx)
	set(time.Date(2026, 12, 5, 7, 0, 0, 0, time.Local))
	m.nudge()
	v, ok := m.await(ctx, true, nil)
	if !ok || !strings.Contains(v.reason, "outside --schedule 22:00-07:00 (now 07:00)") {
		t.Fatalf("at 07:00: %v", v)
	}
	set(time.Date(2026, 12, 5, 22, 0, 0, 0, time.Local))
	m.nudge()
	if v, ok := m.await(ctx, false, nil); !ok || v.pause {
		t.Fatalf("at 22:00: %v", v)
	}
}

// TestPolicyFlags: `shoal worker` takes the policy's flags in their forms and refuses nonsense
// with a usage error naming the flag.
func TestPolicyFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--gpu-memory", "4GiB"}, {"--max-upload", "10Mbit"}, {"--max-upload", "2MB/s"}, {"--pause-on-battery"},
		{"--pause-when-busy", "50"}, {"--pause-when-gpu-busy", "50"}, {"--pause-when-gpu-busy", "12.5%"}, {"--schedule", "22:00-07:00"}, {"--schedule", "12:00-13:30,22:00-07:00"},
	} {
		if _, stderr, err := run(t, append(append([]string{"worker"}, args...), "--help")...); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("shoal worker %v: %v\n%s", args, err, stderr)
		}
	}
	for _, args := range [][]string{
		{"--gpu-memory", "-5"}, {"--gpu-memory", "0"}, {"--max-upload", "10"}, {"--max-upload", "-1Mbit"},
		{"--pause-when-busy", "0"}, {"--pause-when-busy", "101"}, {"--pause-when-gpu-busy", "0"}, {"--pause-when-gpu-busy", "100"},
		{"--pause-when-gpu-busy", "-3"}, {"--pause-when-gpu-busy", "busy"}, {"--pause-when-gpu-busy", "NaN"}, {"--schedule", "25:00-07:00"}, {"--schedule", "07:00-07:00"},
		{"--schedule", "evenings"},
	} {
		_, stderr, err := run(t, append(append([]string{"worker"}, args...), "--help")...)
		if !errors.Is(err, errUsage) || !strings.Contains(stderr, args[0][2:]) {
			t.Errorf("shoal worker %v: %v, want a usage error naming the flag\n%s", args, err, stderr)
		}
	}
}

// TestWorkerGPUMemory: `shoal worker --device vulkan --gpu-memory` offers the coordinator no more
// than the GPU's share (the shard lives in the GPU's memory), whatever --memory says, and says so.
func TestWorkerGPUMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts processes")
	}
	if infos, err := vulkan.Devices(); err != nil || len(infos) == 0 {
		if os.Getenv("SHOAL_VULKAN_REQUIRED") == "1" {
			t.Fatalf("no Vulkan device (%v) and SHOAL_VULKAN_REQUIRED=1", err)
		}
		t.Skipf("no Vulkan device: %v", err)
	}
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 4)
	addr := freeAddr(t)
	data := filepath.Join(dir, "data")
	// Two workers to start with: the job waits, and the one worker's offer is recorded.
	coord := startProc(t, dir, "coordinator", "serve", "--data-dir", data, "--listen", addr, "--job", jobPath, "--min-workers", "2")
	w := startProc(t, dir, "gpu", "worker", "--coordinator", "http://"+addr, "--device", "vulkan", "--memory", "8GiB", "--gpu-memory", "96MiB")
	t.Cleanup(func() {
		for _, p := range []*proc{coord, w} {
			p.kill()
			<-p.done
		}
	})
	w.awaitJoined(t, dir)
	// The worker's row is written by the coordinator's recorder, after the job loop heard the
	// join: wait for its worker.joined event, which /api/status reads back after flushing what is
	// queued (the same transaction as the row), before the kill.
	recorded := func() bool {
		resp, err := http.Get("http://" + addr + "/api/status")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		type event struct {
			Kind string `json:"kind"`
		}
		var st struct {
			Events []event `json:"events"`
		}
		return json.NewDecoder(resp.Body).Decode(&st) == nil &&
			slices.ContainsFunc(st.Events, func(e event) bool { return e.Kind == "worker.joined" })
	}
	for deadline := time.Now().Add(2 * time.Minute); !recorded(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no worker.joined event; the coordinator's log:\n%s", tail(filepath.Join(dir, "coordinator.log")))
		}
	}
	coord.kill()
	<-coord.done
	db, err := storage.Open(context.Background(), filepath.Join(data, "shoal.db"), storage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ws, err := db.ListWorkers(context.Background())
	if err != nil || len(ws) != 1 {
		t.Fatalf("workers %v, %v: want one", ws, err)
	}
	if ws[0].MemoryBytes != 96<<20 {
		t.Errorf("the worker offered %d bytes, want its --gpu-memory of 96MiB", ws[0].MemoryBytes)
	}
	if l := tail(filepath.Join(dir, "gpu.log")); !strings.Contains(l, "gpu memory: at most 96MiB for the shard") {
		t.Errorf("the worker does not say its GPU memory cap:\n%s", l)
	}
}

// writeFile writes name under dir, making its directories.
func writeFile(t *testing.T, dir, name, text string) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(text), 0o755); err != nil {
		t.Fatal(err)
	}
}

// fakeSMI writes a script that answers as nvidia-smi does with the query the sampler makes (and
// refuses any other), printing out.
func fakeSMI(t *testing.T, out string) string {
	t.Helper()
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("the fake nvidia-smi is a shell script")
	}
	dir := t.TempDir()
	writeFile(t, dir, "nvidia-smi", `#!/bin/sh
if [ "$1 $2" != "--query-gpu=utilization.gpu --format=csv,noheader,nounits" ]; then
	echo "unexpected arguments: $*" >&2; exit 2
fi
`+out+"\n")
	return filepath.Join(dir, "nvidia-smi")
}

// TestGPUBusySysfs: the GPU's utilisation is read from each DRM card's gpu_busy_percent under
// the sysfs root, the busiest card's; connectors and render nodes are not cards, a card without
// the file is skipped, and a file that does not hold a percentage is an error beside the others'
// reading.
func TestGPUBusySysfs(t *testing.T) {
	sys := t.TempDir()
	if got, err := readGPUBusy(sys, "", time.Second); got >= 0 || err == nil {
		t.Fatalf("no GPU: %v, %v; want unknown and an error", got, err)
	}
	if src := gpuSources(sys, ""); len(src) != 0 {
		t.Fatalf("no GPU, sources %v", src)
	}
	drm := "class/drm/"
	writeFile(t, sys, drm+"card0/device/gpu_busy_percent", "37\n")
	writeFile(t, sys, drm+"card1/device/gpu_busy_percent", "12\n")
	writeFile(t, sys, drm+"card0-DP-1/device/gpu_busy_percent", "99\n") // not a card
	writeFile(t, sys, drm+"renderD128/device/gpu_busy_percent", "98\n")
	writeFile(t, sys, drm+"card2/device/vendor", "0x8086\n") // a card whose driver does not say
	if got, err := readGPUBusy(sys, "", time.Second); got != 37 || err != nil {
		t.Fatalf("two cards at 37%% and 12%%: %v, %v; want 37", got, err)
	}
	if src := gpuSources(sys, ""); len(src) != 2 {
		t.Fatalf("sources %v, want card0's and card1's", src)
	}
	writeFile(t, sys, drm+"card1/device/gpu_busy_percent", "140\n")
	if got, err := readGPUBusy(sys, "", time.Second); got != 37 || err == nil || !strings.Contains(err.Error(), "card1") {
		t.Fatalf("card1 says 140%%: %v, %v; want card0's 37 and an error naming card1", got, err)
	}
}

// TestGPUBusyNvidiaSMI: nvidia-smi's answer is read (one line a GPU; a GPU that cannot say is
// left out), the busiest GPU of it and sysfs counts, and a failing, hanging or garbled nvidia-smi
// is an error, bounded in time.
func TestGPUBusyNvidiaSMI(t *testing.T) {
	sys := t.TempDir()
	smi := fakeSMI(t, "echo 37; echo '[N/A]'; echo 64")
	if got, err := readGPUBusy(sys, smi, 10*time.Second); got != 64 || err != nil {
		t.Fatalf("nvidia-smi says 37 and 64: %v, %v", got, err)
	}
	if src := gpuSources(sys, smi); len(src) != 1 || src[0] != smi {
		t.Fatalf("sources %v, want nvidia-smi", src)
	}
	writeFile(t, sys, "class/drm/card0/device/gpu_busy_percent", "81\n")
	if got, err := readGPUBusy(sys, smi, 10*time.Second); got != 81 || err != nil {
		t.Fatalf("an amdgpu at 81 and NVIDIA GPUs at 37 and 64: %v, %v", got, err)
	}
	for what, script := range map[string]string{
		"failing": "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9",
		"garbled": "echo 'No devices were found'",
		"silent":  "echo '[Not Supported]'",
		"hanging": "sleep 5",
	} {
		smi := fakeSMI(t, script)
		start := time.Now()
		vs, err := nvidiaSMIBusy(smi, 200*time.Millisecond)
		if err == nil || len(vs) != 0 {
			t.Errorf("%s nvidia-smi: %v, %v; want an error", what, vs, err)
		}
		if d := time.Since(start); d > 20*time.Second {
			t.Errorf("%s nvidia-smi: returned after %v (timeout 200ms)", what, d)
		}
	}
	big := fakeSMI(t, "yes 50 | head -c 1000000")
	if vs, err := nvidiaSMIBusy(big, 10*time.Second); err == nil || len(vs) != 0 {
		t.Errorf("a megabyte of answer: %d readings, %v; want an error", len(vs), err)
	}
}

// TestSamplerGPUQuiet: the sampler reads the GPU only while the worker's own device has made no
// submission for gpuQuiet before and during the reading, so that a worker computing back to back
// never sees its own load as another's; readings taken in its quiet moments are averaged over
// the busyWindow and known once half of it is covered.
func TestSamplerGPUQuiet(t *testing.T) {
	sys := t.TempDir()
	busy := func(pct string) { writeFile(t, sys, "class/drm/card0/device/gpu_busy_percent", pct+"\n") }
	busy("100") // this worker's own load, while it computes
	s := newSampler(workerPolicy{gpuBusyPct: 50}, slog.New(slog.DiscardHandler))
	s.sysfs, s.smi = sys, ""
	var submits uint64
	computing, startDuringRead := true, false
	s.gpuWork = func() uint64 {
		if computing {
			submits++
		}
		if startDuringRead {
			startDuringRead = false
			computing = true
		}
		return submits
	}
	now := time.Date(2026, 12, 4, 12, 0, 0, 0, time.Local)
	for end := now.Add(3 * busyWindow); now.Before(end); now = now.Add(policyEvery) {
		if r := s.read(now, true); r.GPUBusy >= 0 || len(s.gpu) > 0 {
			t.Fatalf("a GPU reading while the worker computes: %v (%d samples)", r.GPUBusy, len(s.gpu))
		}
	}
	// Paused: the device is quiet; a game keeps the GPU 80% busy.
	computing = false
	busy("80")
	start := now
	for ; now.Sub(start) < busyWindow; now = now.Add(policyEvery) {
		r := s.read(now, true)
		if r.GPUBusy >= 0 && r.GPUBusy != 80 {
			t.Fatalf("GPU busy %v, want 80", r.GPUBusy)
		}
		if r.GPUBusy >= 0 && now.Sub(start) < busyWindow/2 {
			t.Fatalf("known after %v of quiet", now.Sub(start))
		}
	}
	if r := s.read(now, false); r.GPUBusy != 80 {
		t.Fatalf("a minute of quiet readings at 80%%: %v", r.GPUBusy)
	}
	// The worker's own work starts during a reading: that reading is dropped.
	n := len(s.gpu)
	busy("100")
	startDuringRead = true
	s.read(now, true)
	if len(s.gpu) != n-1 && len(s.gpu) != n || s.gpu[len(s.gpu)-1].pct == 100 {
		t.Fatalf("a reading taken as the worker's own work began was kept: %v", s.gpu[len(s.gpu)-1])
	}
	computing = false
	for i := 0; i < 3; i++ { // gpuQuiet must pass before the next
		now = now.Add(policyEvery)
		s.read(now, true)
	}
	if g := s.gpu[len(s.gpu)-1]; g.pct != 100 || now.Sub(g.at) > policyEvery {
		t.Fatalf("no reading once quiet again: last %v", g)
	}
	// The readings age out: a minute later with the worker computing, nothing is known.
	computing = true
	for end := now.Add(busyWindow + policyEvery); now.Before(end); now = now.Add(policyEvery) {
		s.read(now, true)
	}
	if r := s.read(now, false); r.GPUBusy >= 0 {
		t.Fatalf("a minute of computing later: GPU busy %v, want unknown", r.GPUBusy)
	}
}

// decideOver runs decide from at over loads, one reading each policyEvery, as the monitor does,
// and returns the verdicts.
func decideOver(pol workerPolicy, at time.Time, rs []readings) []verdict {
	var st policyState
	out := make([]verdict, len(rs))
	for i, r := range rs {
		out[i], st = pol.decide(at.Add(time.Duration(i)*policyEvery), r, st)
	}
	return out
}

func changes(vs []verdict) int {
	n := 0
	for i := 1; i < len(vs); i++ {
		if vs[i].pause != vs[i-1].pause {
			n++
		}
	}
	return n
}

// TestDecideHysteresis: a load hovering around the threshold (±2 points) pauses the worker once
// and keeps it paused, where pausing on every reading above and resuming on every one below
// would make it leave and rejoin the job over and over; the pause ends only after the load has
// stayed under resumeBelow for a whole busyWindow (and the minimum pause has passed), for the
// CPU and the GPU alike.
func TestDecideHysteresis(t *testing.T) {
	noon := time.Date(2026, 12, 4, 12, 0, 0, 0, time.Local)
	for _, tc := range []struct {
		name string
		pol  workerPolicy
		load func(pct float64) readings
	}{
		{"cpu", workerPolicy{busyPct: 50}, func(p float64) readings { return readings{Busy: p, GPUBusy: -1} }},
		{"gpu", workerPolicy{gpuBusyPct: 50}, func(p float64) readings { return readings{Busy: -1, GPUBusy: p} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rs []readings
			for i := 0; i < 300; i++ { // ten minutes around the threshold
				rs = append(rs, tc.load(50+float64(2*(i%3)-2))) // 48, 50, 52, ...
			}
			vs := decideOver(tc.pol, noon, rs)
			if n := changes(vs); n != 1 || !vs[len(vs)-1].pause {
				t.Fatalf("a load at 50±2 against a threshold of 50: %d verdict changes, last %v; want one pause", n, vs[len(vs)-1])
			}
			// Then under the threshold but not under resumeBelow (45 > 40): still paused.
			// Then calm (35), but a reading of 45 half-way resets the wait.
			hover := len(rs)
			for i := 0; i < 60; i++ {
				rs = append(rs, tc.load(45))
			}
			calm := len(rs)
			for i := 0; i < 100; i++ {
				p := 35.0
				if i == 15 {
					p = 45
				}
				rs = append(rs, tc.load(p))
			}
			vs = decideOver(tc.pol, noon, rs)
			for i := hover; i < calm; i++ {
				if !vs[i].pause {
					t.Fatalf("resumed at a load of 45 (threshold 50, resume under %v)", resumeBelow(50))
				}
			}
			resumed := -1
			for i := calm; i < len(vs); i++ {
				if !vs[i].pause {
					resumed = i
					break
				}
			}
			want := calm + 16 + int(busyWindow/policyEvery)
			if resumed != want {
				t.Fatalf("resumed %d readings into the calm, want %d: a whole busyWindow under %v after the last reading over it", resumed-calm, want-calm, resumeBelow(50))
			}
			if changes(vs) != 2 {
				t.Fatalf("%d verdict changes, want a pause and a resume", changes(vs))
			}
			if r := vs[calm].reason; !strings.Contains(r, "more than 50%") || !strings.Contains(r, "resuming once under 40%") {
				t.Errorf("a pause held by the hysteresis says %q", r)
			}
		})
	}
	if got := resumeBelow(10); got != 5 {
		t.Errorf("resumeBelow(10) = %v, want 5 (half the threshold, when less than 10 points)", got)
	}
	if got := resumeBelow(90); got != 80 {
		t.Errorf("resumeBelow(90) = %v, want 80", got)
	}
}

// TestDecideMinPause: a pause for any condition but the schedule lasts minPause at least, so a
// charger plugged in and out does not make the worker leave and rejoin each time; a pause for the
// schedule ends when its window opens.
func TestDecideMinPause(t *testing.T) {
	pol := workerPolicy{onBattery: true}
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.Local)
	var rs []readings
	for i := 0; i < 200; i++ { // a flaky charger: 10 s on battery, 10 s on mains
		rs = append(rs, readings{OnBattery: i/5%2 == 0, Busy: -1, GPUBusy: -1})
	}
	vs := decideOver(pol, t0, rs)
	if n, most := changes(vs), int(2*len(rs)*int(policyEvery)/int(minPause+10*time.Second)); n > most {
		t.Fatalf("a charger flapping every 10 s: %d verdict changes in %v, want at most %d", n, time.Duration(len(rs))*policyEvery, most)
	}
	// Once: on battery for 10 s, then mains for good: paused until minPause has passed.
	vs = decideOver(pol, t0, append(rs[:5:5], slices.Repeat([]readings{{Busy: -1, GPUBusy: -1}}, 100)...))
	for i, v := range vs {
		at := time.Duration(i) * policyEvery
		if v.pause != (at < minPause) {
			t.Fatalf("%v after going on battery for 10 s: %v; want paused for %v", at, v, minPause)
		}
		if at >= 10*time.Second && at < minPause && !strings.Contains(v.reason, "minimum pause") {
			t.Errorf("a pause held for its minimum says %q", v.reason)
		}
	}
	// The schedule alone: the worker resumes when the window opens, 30 s after it paused.
	night, _ := parseSchedule("22:00-07:00")
	st := policyState{}
	v, st := workerPolicy{schedule: night}.decide(time.Date(2026, 12, 4, 21, 59, 30, 0, time.Local), readings{Busy: -1, GPUBusy: -1}, st)
	if !v.pause {
		t.Fatalf("at 21:59:30 outside 22:00-07:00: %v", v)
	}
	if v, _ = (workerPolicy{schedule: night}).decide(time.Date(2026, 12, 4, 22, 0, 0, 0, time.Local), readings{Busy: -1, GPUBusy: -1}, st); v.pause {
		t.Fatalf("at 22:00, 30 s into a pause for the schedule: %v", v)
	}
}
