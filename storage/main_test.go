package storage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/internal/leaktest"
)

func TestMain(m *testing.M) {
	// The crash test re-executes this binary as the process it kills; in
	// that role it runs the helper and never the tests.
	if path := os.Getenv(crashHelperEnv); path != "" {
		os.Exit(crashHelper(path))
	}
	flag.Parse()
	code := m.Run()
	if code == 0 {
		// A DB not closed leaves its pool's connectionOpener goroutine running.
		if err := leaktest.Wait(3 * time.Second); err != nil {
			fmt.Fprintf(os.Stderr, "storage tests leaked goroutines (a DB not closed?):\n%v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// testClock is an injected clock that moves only when told to, so tests can
// check stored timestamps exactly.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock {
	return &testClock{t: time.Date(2025, 1, 2, 3, 4, 5, 6_000_000, time.UTC)}
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// openTestDB opens a fresh database in a temporary directory, closed when
// the test ends.
func openTestDB(t testing.TB) (*DB, *testClock) {
	t.Helper()
	clock := newTestClock()
	db, err := Open(t.Context(), filepath.Join(t.TempDir(), "shoal.db"), Options{Now: clock.Now})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := db.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return db, clock
}

// testSpec is a job spec of the shape docs/design.md ("Jobs") describes; storage only
// requires a JSON object, but realistic data catches quoting mistakes.
var testSpec = json.RawMessage(`{"model":{"n_layer":4,"n_head":4,"n_embd":64,"block_size":32,"vocab_size":256,"n_experts":4,"top_k":2,"moe_every":2,"aux_loss_coef":0.01},` +
	`"data":"tiny","seed":1,"steps":100,"batch_size":8,"micro_batches":2,"lr":0.001,"warmup":10,"min_lr_ratio":0.1,` +
	`"weight_decay":0.1,"clip":1,"checkpoint_every":10,"val_every":10}`)

// newJob creates a job with one saved plan (version 1), ready for steps.
func newJob(t testing.TB, db *DB) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	j, err := db.CreateJob(ctx, testSpec)
	if err != nil {
		t.Fatalf("CreateJob: %v", err)
	}
	if _, err := db.SavePlan(ctx, j.ID, json.RawMessage(`{"stages":[[0,2],[2,4]]}`)); err != nil {
		t.Fatalf("SavePlan: %v", err)
	}
	return j.ID
}

// sha returns the blob name of s, for tests that need hashes without blobs
// behind them.
func sha(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}
