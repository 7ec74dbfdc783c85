package storage

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// The crash tests re-execute the test binary as a helper process that writes
// to a database, and SIGKILL it mid-write. These variables tell TestMain to
// run the helper instead of the tests.
const (
	crashHelperEnv     = "SHOAL_STORAGE_CRASH_DB"
	crashModeEnv       = "SHOAL_STORAGE_CRASH_MODE"
	crashJobEnv        = "SHOAL_STORAGE_CRASH_JOB"
	crashCheckpointEnv = "SHOAL_STORAGE_CRASH_CHECKPOINT"
	crashBlobsEnv      = "SHOAL_STORAGE_CRASH_BLOBS"
)

var crashSeed = flag.Uint64("storage.crash-seed", 0, "seed for the crash tests' kill timing (0: pick one and print it)")

// crashHelper is the process the crash tests kill. It prints a line to
// stdout once it is where the parent wants to kill it, then keeps writing
// until it is killed. It returns only on failure.
func crashHelper(path string) int {
	// Never outlive a parent that failed to kill it.
	time.AfterFunc(60*time.Second, func() { os.Exit(3) })
	ctx := context.Background()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "crash helper:", err)
		return 2
	}
	db, err := Open(ctx, path, Options{})
	if err != nil {
		return fail(err)
	}
	jobID, err := uuid.Parse(os.Getenv(crashJobEnv))
	if err != nil {
		return fail(err)
	}
	switch mode := os.Getenv(crashModeEnv); mode {
	case "long-tx":
		cp, err := strconv.ParseInt(os.Getenv(crashCheckpointEnv), 10, 64)
		if err != nil {
			return fail(err)
		}
		return fail(crashLongTx(ctx, db, jobID, cp))
	case "commits":
		blobs, err := OpenBlobStore(os.Getenv(crashBlobsEnv))
		if err != nil {
			return fail(err)
		}
		return fail(crashCommits(ctx, db, blobs, jobID))
	default:
		return fail(fmt.Errorf("unknown mode %q", mode))
	}
}

// crashTimings is a realistic per-stage timing document, big enough that a
// few thousand step rows overflow the page cache.
var crashTimings = json.RawMessage(`{"stages":[` +
	strings.Repeat(`{"forward_ms":12.25,"backward_ms":25.5,"send_ms":1.5,"recv_ms":2.75},`, 15) +
	`{"forward_ms":1}]}`)

// crashLongTx writes thousands of rows in one transaction, completes the
// pending checkpoint inside it, announces "in-tx", and goes on writing.
func crashLongTx(ctx context.Context, db *DB, jobID uuid.UUID, cp int64) error {
	return db.Tx(ctx, func(tx *Tx) error {
		// A tiny page cache makes SQLite spill the transaction's pages
		// into the WAL before it commits, so the kill leaves uncommitted
		// frames on disk for recovery to ignore: the hard case.
		if _, err := tx.tx.ExecContext(ctx, "PRAGMA cache_size = 50"); err != nil {
			return err
		}
		for i := int64(0); ; i++ {
			step := 10 + i
			if _, err := tx.RecordStep(ctx, Step{JobID: jobID, Step: step, PlanVersion: 1, Loss: 3, Aux: 0.01, Tokens: 256, Timings: crashTimings}); err != nil {
				return err
			}
			if err := tx.RecordRouterStats(ctx, jobID, []RouterStat{{step, 1, 0, 100}, {step, 1, 1, 156}}); err != nil {
				return err
			}
			if _, err := tx.AppendEvent(ctx, Event{JobID: jobID, Kind: "step", Message: json.RawMessage(`{"note":"uncommitted"}`)}); err != nil {
				return err
			}
			if i == 300 {
				for _, name := range []string{"stage1", "stage2"} {
					done, err := tx.AddShard(ctx, cp, name, sha(name), 1000)
					if err != nil {
						return err
					}
					if done != (name == "stage2") {
						return fmt.Errorf("AddShard(%s) completed = %v", name, done)
					}
				}
				fmt.Println("in-tx")
			}
		}
	})
}

// crashCommits records steps one small transaction at a time, and every few
// steps a checkpoint whose shards are real blobs, uploaded one by one.
func crashCommits(ctx context.Context, db *DB, blobs *BlobStore, jobID uuid.UUID) error {
	names := []string{"stage0", "stage1", "experts.b1"}
	for step := int64(0); ; step++ {
		err := db.Tx(ctx, func(tx *Tx) error {
			if _, err := tx.RecordStep(ctx, Step{JobID: jobID, Step: step, PlanVersion: 1, Loss: 3, Tokens: 256, Timings: crashTimings}); err != nil {
				return err
			}
			_, err := tx.AppendEvent(ctx, Event{JobID: jobID, Kind: "step"})
			return err
		})
		if err != nil {
			return err
		}
		if step%5 == 4 {
			cp, err := db.BeginCheckpoint(ctx, jobID, step+1, names)
			if err != nil {
				return err
			}
			for _, name := range names {
				data := strings.Repeat(fmt.Sprintf("%s after step %d\n", name, step), 2000)
				h, n, err := blobs.Put(ctx, strings.NewReader(data))
				if err != nil {
					return err
				}
				if _, err := db.AddShard(ctx, cp.ID, name, h, n); err != nil {
					return err
				}
			}
		}
		if step == 10 {
			fmt.Println("running")
		}
	}
}

// killHelper starts the helper with env, waits for it to print ready, lets it
// run on for a random moment and SIGKILLs it.
func killHelper(t *testing.T, env []string, ready string) {
	t.Helper()
	seed := *crashSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("crash seed %d (rerun with -storage.crash-seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	select {
	case line, ok := <-lines:
		if !ok || line != ready {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("helper said %q before exiting, want %q; stderr:\n%s", line, ready, stderr.String())
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper not ready after 30s; stderr:\n%s", stderr.String())
	}
	time.Sleep(time.Duration(rng.IntN(150)) * time.Millisecond)
	// Process.Kill is SIGKILL on Unix: no deferred call, no rollback, no
	// close; whatever SQLite had written is all there is.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != -1 {
		t.Fatalf("helper ended with %v before it was killed; stderr:\n%s", err, stderr.String())
	}
	for range lines { // drain so the reader goroutine ends
	}
}

// TestCrashMidTransaction kills a process in the middle of a long write
// transaction that, among thousands of rows, completes a checkpoint. After
// recovery nothing of that transaction may be visible: no rows, and above
// all no checkpoint marked complete.
func TestCrashMidTransaction(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "shoal.db")
	db, err := Open(ctx, path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	jobID := newJob(t, db)
	for s := int64(0); s < 10; s++ {
		if _, err := db.RecordStep(ctx, Step{JobID: jobID, Step: s, PlanVersion: 1, Loss: 4, Tokens: 256}); err != nil {
			t.Fatal(err)
		}
	}
	cp, err := db.BeginCheckpoint(ctx, jobID, 10, []string{"stage0", "stage1", "stage2"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.AddShard(ctx, cp.ID, "stage0", sha("stage0"), 1000); err != nil {
		t.Fatal(err)
	}
	db.Close()

	killHelper(t, []string{
		crashHelperEnv + "=" + path,
		crashModeEnv + "=long-tx",
		crashJobEnv + "=" + jobID.String(),
		crashCheckpointEnv + "=" + strconv.FormatInt(cp.ID, 10),
	}, "in-tx")

	// The point of the test is recovery past uncommitted frames; make sure
	// the helper really left some.
	if fi, err := os.Stat(path + "-wal"); err != nil || fi.Size() == 0 {
		t.Errorf("no WAL content after the kill (%v): the transaction never spilled, the test proves less", err)
	} else {
		t.Logf("WAL left by the killed transaction: %d bytes", fi.Size())
	}

	db, err = Open(ctx, path, Options{})
	if err != nil {
		t.Fatalf("reopen after crash: %v", err)
	}
	defer db.Close()
	if err := db.Check(ctx); err != nil {
		t.Fatalf("after crash: %v", err)
	}
	counts := map[string]int{}
	for _, table := range []string{"steps", "router_stats", "events", "checkpoints", "checkpoint_shards"} {
		var n int
		if err := db.r.QueryRowContext(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		counts[table] = n
	}
	want := map[string]int{"steps": 10, "router_stats": 0, "events": 0, "checkpoints": 1, "checkpoint_shards": 3}
	for table, n := range want {
		if counts[table] != n {
			t.Errorf("%s has %d rows after the crash, want %d (the committed ones only)", table, counts[table], n)
		}
	}
	if j, _ := db.Job(ctx, jobID); j.Step != 10 {
		t.Errorf("job step %d after the crash, want 10", j.Step)
	}
	got, err := db.Checkpoint(ctx, cp.ID)
	if err != nil {
		t.Fatal(err)
	}
	landed := 0
	for _, s := range got.Shards {
		if s.Landed() {
			landed++
		}
	}
	if got.State != CheckpointPending || landed != 1 {
		t.Errorf("checkpoint after crash: %s with %d shards landed, want pending with 1", got.State, landed)
	}
	if _, err := db.LatestCheckpoint(ctx, jobID); !errors.Is(err, ErrNotFound) {
		t.Errorf("LatestCheckpoint after crash = %v, want ErrNotFound", err)
	}

	// And the database is fully usable: the uploads can be retried.
	for _, name := range []string{"stage1", "stage2"} {
		if _, err := db.AddShard(ctx, cp.ID, name, sha(name), 1000); err != nil {
			t.Fatal(err)
		}
	}
	if latest, err := db.LatestCheckpoint(ctx, jobID); err != nil || latest.ID != cp.ID {
		t.Errorf("LatestCheckpoint after retrying the uploads = %+v, %v", latest, err)
	}
}

// TestCrashBetweenCommits kills a process that commits steps and uploads
// checkpoints one small transaction at a time. Whatever instant the kill
// lands on, the committed prefix must be self-consistent: steps 0..n-1 and
// nothing else, the job's step equal to n, one event per step, and every
// complete checkpoint backed by blobs that exist and verify.
func TestCrashBetweenCommits(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	path := filepath.Join(dir, "shoal.db")
	blobDir := filepath.Join(dir, "blobs")
	db, err := Open(ctx, path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	jobID := newJob(t, db)
	db.Close()

	killHelper(t, []string{
		crashHelperEnv + "=" + path,
		crashModeEnv + "=commits",
		crashJobEnv + "=" + jobID.String(),
		crashBlobsEnv + "=" + blobDir,
	}, "running")

	db, err = Open(ctx, path, Options{})
	if err != nil {
		t.Fatalf("reopen after crash: %v", err)
	}
	defer db.Close()
	if err := db.Check(ctx); err != nil {
		t.Fatalf("after crash: %v", err)
	}
	blobs, err := OpenBlobStore(blobDir)
	if err != nil {
		t.Fatal(err)
	}

	steps, err := db.ListSteps(ctx, jobID, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	n := int64(len(steps))
	for i, s := range steps {
		if s.Step != int64(i) {
			t.Fatalf("step rows are not the prefix 0..%d: row %d is step %d", n-1, i, s.Step)
		}
	}
	if j, _ := db.Job(ctx, jobID); j.Step != n {
		t.Errorf("job step %d, but %d steps recorded", j.Step, n)
	}
	events, _ := db.ListEvents(ctx, EventFilter{JobID: jobID, Kind: "step", Limit: 1 << 20})
	if int64(len(events)) != n {
		t.Errorf("%d step events for %d steps: a step and its event committed apart", len(events), n)
	}
	cps, _ := db.ListCheckpoints(ctx, jobID)
	complete := 0
	for _, cp := range cps {
		landed := 0
		for _, s := range cp.Shards {
			if !s.Landed() {
				continue
			}
			landed++
			if err := blobs.Verify(ctx, s.SHA256); err != nil {
				t.Errorf("checkpoint %d shard %s: %v", cp.ID, s.Name, err)
			}
		}
		switch {
		case cp.State == CheckpointComplete && landed != len(cp.Shards):
			t.Errorf("checkpoint %d complete with %d of %d shards", cp.ID, landed, len(cp.Shards))
		case cp.State == CheckpointPending && landed == len(cp.Shards):
			t.Errorf("checkpoint %d has every shard but is still pending", cp.ID)
		case cp.State == CheckpointComplete:
			complete++
		}
		if cp.Step > n {
			t.Errorf("checkpoint %d at step %d is ahead of the %d recorded steps", cp.ID, cp.Step, n)
		}
	}
	t.Logf("killed after %d steps, %d checkpoints (%d complete)", n, len(cps), complete)
}
