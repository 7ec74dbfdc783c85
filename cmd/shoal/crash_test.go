package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

var (
	crashIterations = flag.Int("crash.iterations", 20, "coordinator kills in TestCrashCoordinator")
	crashSeed       = flag.Uint64("crash.seed", 0, "seed for TestCrashCoordinator's kill timing (0: pick one and print it)")
)

// TestCrashCoordinator SIGKILLs a training coordinator at random moments while it writes a
// checkpoint after every step, and after every kill checks the data directory as the restart
// will find it: SQLite's integrity and foreign keys hold, the job is still the one running job,
// and every checkpoint marked complete has all its shards in the blob store with contents that
// hash to their names. Then it restarts the coordinator on the same directory and port; the two
// in-process workers reconnect on their own. Training must make progress across the restarts,
// or the test proves nothing.
//
// Most kills wait until the restarted coordinator has trained a step, so that they land among
// steps, uploads and assemblies; about one in four lands during recovery (plan, assembling the
// restore point, workers restoring) instead.
//
// -crash.iterations=N soaks longer. The coordinator keeps its newest 5 checkpoints
// (--keep-checkpoints), so retention runs under the kills too; its blob collection spares blobs
// younger than an hour, so the disk still grows by a few MB per step (two shards of the tiny
// model) during a soak.
func TestCrashCoordinator(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts coordinator processes")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc to check for leftover processes")
	}
	seed := *crashSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (replay with -crash.seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	dir := t.TempDir()
	dataDir := filepath.Join(dir, "data")
	jobPath := crashJob(t, dir)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// One port for every incarnation, so that the workers reconnect to the same URL. The
	// coordinator's listener sets SO_REUSEADDR (Go's default), so a killed one's connections in
	// TIME_WAIT do not keep the next from binding.
	addr := freeAddr(t)
	url := "http://" + addr

	c := &crashCoordinator{t: t, exe: exe, dir: dir, args: []string{"serve", "--keep-checkpoints", "5", "--data-dir", dataDir,
		"--listen", addr, "--job", jobPath, "--min-workers", "2"}}
	t.Cleanup(func() { c.kill() })
	c.start()

	ctx, cancel := context.WithCancel(context.Background())
	var workers sync.WaitGroup
	stopWorkers := func() {
		cancel()
		done := make(chan struct{})
		go func() { workers.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Error("workers did not stop within 15 s of their context ending")
		}
	}
	t.Cleanup(stopWorkers)
	// The workers log to a file of their own: reconnecting twenty times is noisy, and the file
	// goes into the failure message of a restart that never trains.
	wlogf, err := os.Create(filepath.Join(dir, "workers.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { wlogf.Close() })
	c.workersLog = wlogf.Name()
	wlog := slog.New(slog.NewTextHandler(wlogf, nil))
	for i := range 2 {
		cfg := client.WorkerConfig{Coordinator: url, MemoryBytes: 1 << 30, Threads: 1, Name: "crash-" + strconv.Itoa(i),
			Logger: wlog.With("worker", i), BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
			HTTP: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
		workers.Add(1)
		go func() {
			defer workers.Done()
			if err := client.RunWorker(ctx, cfg); err != nil {
				t.Errorf("worker %d: %v", i, err)
			}
		}()
	}

	v := &crashVerifier{dataDir: dataDir, verified: map[string]bool{}}
	var firstStep, advanced, trained int
	var recoveries []time.Duration
	prevNewest := int64(-1)
	for it := range *crashIterations {
		early := it > 0 && rng.IntN(4) == 0
		var delay time.Duration
		if early {
			delay = time.Duration(rng.IntN(600)) * time.Millisecond
		} else {
			delay = time.Duration(100+rng.IntN(701)) * time.Millisecond
			took := c.awaitTraining(url, 60*time.Second)
			recoveries = append(recoveries, took)
			trained++
		}
		time.Sleep(delay)
		if !c.kill() {
			t.Fatalf("coordinator %d exited before kill %d, %v after %s:\n%s", c.n, it, delay, c.when(early), c.logTail())
		}
		// A race-built coordinator reports a race when it sees it, but exits with the race
		// detector's status only if it lives to exit, which a killed one does not.
		if b, _ := os.ReadFile(c.logPath); bytes.Contains(b, []byte("WARNING: DATA RACE")) {
			t.Errorf("coordinator %d found a data race:\n%s", c.n, b)
		}
		f, err := v.check(context.Background())
		if err != nil {
			t.Fatalf("after kill %d (%v after %s): %v\n%s", it, delay, c.when(early), err, c.logTail())
		}
		if it == 0 {
			firstStep = int(f.newest)
		}
		if f.newest > prevNewest && it > 0 {
			advanced++
		}
		t.Logf("kill %2d: %-8s +%3d ms: job step %4d, %4d complete checkpoints (newest after step %4d), %d pending",
			it, c.when(early), delay.Milliseconds(), f.jobStep, f.complete, f.newest, f.pending)
		prevNewest = max(prevNewest, f.newest)
		if it < *crashIterations-1 {
			c.start()
		}
	}
	stopWorkers()

	// Every blob once more, in full: a later incarnation must not have damaged an earlier
	// checkpoint.
	v.verified = map[string]bool{}
	f, err := v.check(context.Background())
	if err != nil {
		t.Fatalf("final check: %v", err)
	}
	var blobBytes int64
	filepath.WalkDir(filepath.Join(dataDir, "blobs"), func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				blobBytes += fi.Size()
			}
		}
		return nil
	})
	var sum time.Duration
	for _, d := range recoveries {
		sum += d
	}
	if len(recoveries) > 0 {
		t.Logf("%d kills, %d during training; restart to first step: mean %v; %d complete checkpoints, newest after step %d (first kill: %d); the newest advanced across %d restarts; blob store %.0f MB",
			*crashIterations, trained, (sum / time.Duration(len(recoveries))).Round(time.Millisecond), f.complete, f.newest, firstStep, advanced, float64(blobBytes)/1e6)
	}
	// Progress: the restarted coordinators trained, and their checkpoints completed. Each
	// restart that trained a step before its kill normally completes that step's checkpoint, so
	// demand that at least a third of them moved the newest forward.
	if *crashIterations >= 2 && f.newest <= int64(firstStep) {
		t.Errorf("no progress across restarts: newest complete checkpoint after step %d, as at the first kill", f.newest)
	}
	if *crashIterations >= 6 && advanced < trained/3 {
		t.Errorf("the newest complete checkpoint advanced across only %d of %d restarts that trained", advanced, trained)
	}

	assertNoChildren(t)
}

// crashJob writes the tiny job for TestCrashCoordinator: a checkpoint after every step, no
// validation, and far more steps than the test runs, so that the job never finishes under it.
func crashJob(t *testing.T, dir string) string {
	t.Helper()
	p := tinyJob(t, dir, 10000)
	s, err := job.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	s.CheckpointEvery, s.ValEvery = 1, 0
	b, _ := json.Marshal(s)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// crashCoordinator is the `shoal serve` subprocess under test: this test binary re-executed as
// main (TestMain), so that it can be SIGKILLed.
type crashCoordinator struct {
	t       *testing.T
	exe     string
	dir     string
	args    []string
	n       int // incarnations started
	cmd     *exec.Cmd
	exited  chan struct{}
	started time.Time
	logPath string
	// workersLog is the in-process workers' log, shown beside the coordinator's when a restart
	// does not train.
	workersLog string
}

func (c *crashCoordinator) start() {
	c.t.Helper()
	c.n++
	c.logPath = filepath.Join(c.dir, fmt.Sprintf("coordinator-%02d.log", c.n))
	logf, err := os.Create(c.logPath)
	if err != nil {
		c.t.Fatal(err)
	}
	defer logf.Close() // the child holds its own descriptor
	cmd := exec.Command(c.exe, c.args...)
	cmd.Env = append(os.Environ(), "SHOAL_TEST_AS_MAIN=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	setParentDeathSignal(cmd) // a test that dies leaves no coordinator behind
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	c.cmd, c.exited, c.started = cmd, make(chan struct{}), time.Now()
	go func(exited chan struct{}) {
		cmd.Wait()
		close(exited)
	}(c.exited)
}

// kill SIGKILLs the coordinator, if one runs, and waits until it is gone. It reports whether
// the kill is what ended it, as opposed to an exit or crash of its own.
func (c *crashCoordinator) kill() bool {
	if c.cmd == nil {
		return false
	}
	c.cmd.Process.Kill()
	<-c.exited
	ws, ok := c.cmd.ProcessState.Sys().(syscall.WaitStatus)
	c.cmd = nil
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// awaitTraining waits until the coordinator has recorded a step since it started (its status
// lists only this incarnation's steps) and returns how long that took from its start.
func (c *crashCoordinator) awaitTraining(url string, timeout time.Duration) time.Duration {
	c.t.Helper()
	hc := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-c.exited:
			c.cmd = nil
			c.t.Fatalf("coordinator %d exited before training:\n%s", c.n, c.logTail())
		default:
		}
		if resp, err := hc.Get(url + "/api/status"); err == nil {
			var st coordinator.Status
			err := json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil && len(st.Steps) > 0 {
				return time.Since(c.started)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.t.Fatalf("coordinator %d did not train a step within %v:\n%s\n%s", c.n, timeout, c.logTail(), tail(c.workersLog))
	return 0
}

func (c *crashCoordinator) when(early bool) string {
	if early {
		return "recovery"
	}
	return "training"
}

// logTail is the end of the latest coordinator's log.
func (c *crashCoordinator) logTail() string { return tail(c.logPath) }

// tail is the last few kilobytes of a log file, from a line start.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
		b = b[bytes.IndexByte(b, '\n')+1:]
	}
	return fmt.Sprintf("--- %s ---\n%s", filepath.Base(path), b)
}

// crashVerifier checks a data directory between coordinator incarnations.
type crashVerifier struct {
	dataDir string
	// verified holds blobs already hashed in full: blobs are immutable once named, so later
	// checks only confirm that they are still there at their size.
	verified map[string]bool
}

type crashFigures struct {
	jobStep           int64
	complete, pending int
	newest            int64 // step of the newest complete checkpoint; -1 if none
}

func (v *crashVerifier) check(ctx context.Context) (crashFigures, error) {
	f := crashFigures{newest: -1}
	db, err := storage.Open(ctx, filepath.Join(v.dataDir, "shoal.db"), storage.Options{})
	if err != nil {
		return f, err
	}
	defer db.Close()
	if err := db.Check(ctx); err != nil {
		return f, err
	}
	blobs, err := storage.OpenBlobStore(filepath.Join(v.dataDir, "blobs"))
	if err != nil {
		return f, err
	}
	jobs, err := db.ListJobs(ctx)
	if err != nil {
		return f, err
	}
	if len(jobs) != 1 || jobs[0].State != storage.JobRunning {
		var states []string
		for _, j := range jobs {
			states = append(states, fmt.Sprintf("%s %s %q", j.ID, j.State, j.Reason))
		}
		return f, fmt.Errorf("want the one job, running; have %d: %v", len(jobs), states)
	}
	f.jobStep = jobs[0].Step
	cps, err := db.ListCheckpoints(ctx, jobs[0].ID)
	if err != nil {
		return f, err
	}
	for _, ck := range cps {
		if ck.State != storage.CheckpointComplete {
			f.pending++
			continue
		}
		f.complete++
		f.newest = max(f.newest, ck.Step)
		if len(ck.Shards) == 0 {
			return f, fmt.Errorf("complete checkpoint %d (step %d) has no shards", ck.ID, ck.Step)
		}
		for _, sh := range ck.Shards {
			if !sh.Landed() {
				return f, fmt.Errorf("complete checkpoint %d (step %d): shard %s never landed", ck.ID, ck.Step, sh.Name)
			}
			if err := v.checkBlob(ctx, blobs, sh); err != nil {
				return f, fmt.Errorf("complete checkpoint %d (step %d): shard %s: %w", ck.ID, ck.Step, sh.Name, err)
			}
		}
	}
	return f, nil
}

func (v *crashVerifier) checkBlob(ctx context.Context, blobs *storage.BlobStore, sh storage.Shard) error {
	fh, err := blobs.Open(sh.SHA256)
	if err != nil {
		return err
	}
	fi, err := fh.Stat()
	fh.Close()
	if err != nil {
		return err
	}
	if fi.Size() != sh.Bytes {
		return fmt.Errorf("blob %s has %d bytes, recorded %d", sh.SHA256, fi.Size(), sh.Bytes)
	}
	if v.verified[sh.SHA256] {
		return nil
	}
	if err := blobs.Verify(ctx, sh.SHA256); err != nil {
		return err
	}
	v.verified[sh.SHA256] = true
	return nil
}
