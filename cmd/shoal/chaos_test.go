package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/storage"
)

var (
	chaosSeed = flag.Uint64("chaos.seed", 0, "seed of the chaos test's faults (0: a new one, printed)")
	chaosSoak = flag.Bool("chaos.soak", false, "run the chaos test long: more steps, more faults")
)

// proc is a shoal subprocess (the test binary acting as shoal).
type proc struct {
	cmd  *exec.Cmd
	name string
	done chan struct{} // closed when the process has exited
}

func startProc(t *testing.T, dir, name string, args ...string) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), "SHOAL_TEST_AS_MAIN=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	setParentDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, name: name, done: make(chan struct{})}
	go func() { cmd.Wait(); logf.Close(); close(p.done) }()
	return p
}

// awaitJoined waits until the worker process's log says it joined (or it exited), so that it
// has long installed its signal handlers.
func (p *proc) awaitJoined(t *testing.T, dir string) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		select {
		case <-p.done:
			return
		default:
		}
		if b, err := os.ReadFile(filepath.Join(dir, p.name+".log")); err == nil && bytes.Contains(b, []byte("msg=joined")) {
			return
		}
	}
	t.Errorf("%s never joined", p.name)
}

func (p *proc) kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
}

type chaosStatus struct {
	Job *struct {
		State string `json:"state"`
		Step  int    `json:"step"`
	} `json:"job"`
}

// TestChaos: a coordinator and 4 workers, all real processes, train the tiny job while the test
// SIGKILLs random workers every few steps (starting new ones in their place), SIGKILLs and
// restarts the coordinator once, and adds a worker. The job completes, and the model exported
// from the coordinator's store is bitwise the model of a fault-free run. The seed is printed;
// -chaos.seed replays it, -chaos.soak runs longer.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts processes")
	}
	seed := *chaosSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("chaos seed %d (replay with -chaos.seed=%d)", seed, seed)
	r := rand.New(rand.NewPCG(seed, 1))
	steps, faults := 30, 4
	if *chaosSoak {
		steps, faults = 300, 40
	}

	dir := t.TempDir()
	jobPath := tinyJob(t, dir, steps)
	spec, err := job.ReadFile(jobPath)
	if err != nil {
		t.Fatal(err)
	}
	spec.CheckpointEvery, spec.ValEvery = 3, 0
	spec.StepDeadlineMinS, spec.StepDeadlineMaxS = 5, 30
	b, _ := json.Marshal(spec)
	os.WriteFile(jobPath, b, 0o644)

	// The fault-free reference, in this process.
	refDir := filepath.Join(dir, "ref")
	if _, _, err := run(t, "train", "--job", jobPath, "--out", refDir, "--json"); err != nil {
		t.Fatal(err)
	}
	ref, _, err := model.LoadModel(filepath.Join(refDir, local.CheckpointName(steps)))
	if err != nil {
		t.Fatal(err)
	}

	addr := freeAddr(t)
	url := "http://" + addr
	data := filepath.Join(dir, "data")
	serveArgs := []string{"serve", "--data-dir", data, "--listen", addr, "--job", jobPath, "--min-workers", "2"}
	coord := startProc(t, dir, "coordinator-0", serveArgs...)
	var workers []*proc
	nw := 0
	addWorker := func() {
		workers = append(workers, startProc(t, dir, fmt.Sprintf("worker-%d", nw), "worker", "--coordinator", url, "--threads", "1", "--name", fmt.Sprintf("w%d", nw)))
		nw++
	}
	for i := 0; i < 4; i++ {
		addWorker()
	}
	t.Cleanup(func() {
		coord.kill()
		for _, w := range workers {
			w.kill()
		}
	})

	status := func() (chaosStatus, bool) {
		var st chaosStatus
		resp, err := http.Get(url + "/api/status")
		if err != nil {
			return st, false
		}
		defer resp.Body.Close()
		return st, json.NewDecoder(resp.Body).Decode(&st) == nil && st.Job != nil
	}
	// Faults happen at steps drawn in advance; one of them restarts the coordinator.
	var at []int
	for i := 0; i < faults; i++ {
		at = append(at, 2+r.IntN(steps-6))
	}
	slices.Sort(at)
	restartAt := r.IntN(faults)
	var log []string
	deadline := time.Now().Add(4 * time.Minute)
	if *chaosSoak {
		deadline = time.Now().Add(30 * time.Minute)
	}
	restarts := 1
	var drains sync.WaitGroup
	defer drains.Wait()
	for {
		if time.Now().After(deadline) {
			t.Fatalf("the job did not finish in time; faults: %v (logs in %s)", log, dir)
		}
		st, ok := status()
		if ok && st.Job.State == "done" {
			break
		}
		if ok && len(at) > 0 && st.Job.Step >= at[0] {
			at = at[1:]
			switch {
			case len(at) == faults-1-restartAt:
				coord.kill()
				time.Sleep(time.Duration(50+r.IntN(300)) * time.Millisecond)
				coord = startProc(t, dir, "coordinator-"+strconv.Itoa(restarts), serveArgs...)
				restarts++
				log = append(log, fmt.Sprintf("step %d: coordinator SIGKILLed and restarted", st.Job.Step))
			default:
				i := r.IntN(len(workers))
				// Most departures are crashes; some are a worker drained with SIGTERM, which
				// abandons its step cleanly, says goodbye and exits.
				if r.IntN(3) == 0 {
					w := workers[i]
					// A drain is a signal the worker handles: one that has not yet reached main
					// (a loaded machine starts a process slowly) would die of it instead.
					w.awaitJoined(t, dir)
					w.cmd.Process.Signal(syscall.SIGTERM)
					log = append(log, fmt.Sprintf("step %d: %s drained (SIGTERM)", st.Job.Step, w.name))
					drains.Add(1)
					go func() {
						defer drains.Done()
						select {
						case <-w.done:
							if c := w.cmd.ProcessState.ExitCode(); c != 0 {
								t.Errorf("%s exited with %d after SIGTERM, want 0", w.name, c)
							}
						case <-time.After(15 * time.Second):
							t.Errorf("%s did not exit within 15 s of SIGTERM", w.name)
						}
					}()
				} else {
					workers[i].kill()
					log = append(log, fmt.Sprintf("step %d: %s SIGKILLed", st.Job.Step, workers[i].name))
				}
				workers = append(workers[:i], workers[i+1:]...)
				addWorker()
			}
			if r.IntN(2) == 0 {
				addWorker()
				log = append(log, "a worker added")
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("faults: %v", log)
	reportRecoveries(t, data)
	out := filepath.Join(dir, "final.safetensors")
	if _, stderr, err := run(t, "export", "--data-dir", data, "--out", out); err != nil {
		t.Fatalf("export: %v\n%s", err, stderr)
	}
	got, ck, err := model.LoadModel(out)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != steps {
		t.Fatalf("final checkpoint after step %d, want %d", ck.Step, steps)
	}
	for _, set := range [][2]*model.Params{{got.P, ref.P}, {got.Opt.M, ref.Opt.M}, {got.Opt.V, ref.Opt.V}} {
		for i, tt := range set[1].Tensors {
			g := set[0].Tensors[i].Data
			for j := range g {
				if math.Float32bits(g[j]) != math.Float32bits(tt.Data[j]) {
					t.Fatalf("%s[%d] = %v after the faults, %v without (seed %d)", tt.Name, j, g[j], tt.Data[j], seed)
				}
			}
		}
	}
}

// reportRecoveries logs, from the coordinator's event log, each recovery: the step abandoned, the
// step every shard restarted from (the newest complete checkpoint), and the time from the
// failure being noticed to the new plan being assigned.
func reportRecoveries(t *testing.T, dataDir string) {
	db, err := storage.Open(context.Background(), filepath.Join(dataDir, "shoal.db"), storage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	evs, err := db.ListEvents(context.Background(), storage.EventFilter{})
	if err != nil {
		t.Fatal(err)
	}
	var failedAt *storage.Event
	var failedStep float64
	for i := range evs {
		e := &evs[i]
		var d map[string]any
		json.Unmarshal(e.Message, &d)
		switch e.Kind {
		case "step.abandoned":
			failedAt, failedStep = e, d["step"].(float64)
		case "plan":
			if failedAt != nil {
				from := d["from_step"].(float64)
				t.Logf("recovery: step %v abandoned, restarted from step %v (%v steps replayed), new plan %v after the failure",
					failedStep, from, failedStep-from, e.Time.Sub(failedAt.Time).Round(time.Millisecond))
				failedAt = nil
			}
		}
	}
}
