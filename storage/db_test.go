package storage

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestConnectionPragmas checks that every pooled connection, not only the
// first, carries the settings: they come from the DSN, and this is the test
// that would catch someone "simplifying" them into a one-off db.Exec.
func TestConnectionPragmas(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()

	type conn struct {
		name string
		c    *sql.Conn
	}
	var conns []conn
	for i := range 3 {
		c, err := db.r.Conn(ctx) // held, so each is a distinct connection
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, conn{"read" + string(rune('0'+i)), c})
	}
	w, err := db.w.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	conns = append(conns, conn{"write", w})

	for _, c := range conns {
		for _, tc := range []struct {
			pragma string
			want   string
		}{
			{"journal_mode", "wal"},
			{"foreign_keys", "1"},
			{"synchronous", "2"}, // FULL
			{"busy_timeout", "5000"},
		} {
			var got string
			if err := c.c.QueryRowContext(ctx, "PRAGMA "+tc.pragma).Scan(&got); err != nil {
				t.Fatalf("%s: PRAGMA %s: %v", c.name, tc.pragma, err)
			}
			if got != tc.want {
				t.Errorf("%s: PRAGMA %s = %s, want %s", c.name, tc.pragma, got, tc.want)
			}
		}
	}
	var qo int
	if err := conns[0].c.QueryRowContext(ctx, "PRAGMA query_only").Scan(&qo); err != nil || qo != 1 {
		t.Errorf("read connection query_only = %d, %v; want 1", qo, err)
	}
	if _, err := conns[0].c.ExecContext(ctx, "DELETE FROM jobs"); err == nil {
		t.Errorf("write through the read pool succeeded; want it refused")
	}
}

func TestOpenRejectsMemoryAndEmpty(t *testing.T) {
	for _, path := range []string{"", ":memory:"} {
		if _, err := Open(t.Context(), path, Options{}); !errors.Is(err, ErrInvalid) {
			t.Errorf("Open(%q) = %v, want ErrInvalid", path, err)
		}
	}
}

// TestOpenOddPath checks that a path with URI metacharacters names the file
// it says, rather than being cut at the '?'.
func TestOpenOddPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a dir?x=1#frag%20")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "my db?.sqlite")
	db, err := Open(t.Context(), path, Options{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer db.Close()
	if _, err := db.CreateJob(t.Context(), testSpec); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("database not at the path given: %v", err)
	}
	entries, _ := os.ReadDir(filepath.Dir(dir))
	if len(entries) != 1 {
		t.Errorf("files created beside the directory: %v", entries)
	}
}

func TestTxCommitsOnNil(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	var created Job
	err := db.Tx(ctx, func(tx *Tx) error {
		var err error
		created, err = tx.CreateJob(ctx, testSpec)
		if err != nil {
			return err
		}
		// Reads inside the transaction see its own writes.
		_, err = tx.Job(ctx, created.ID)
		return err
	})
	if err != nil {
		t.Fatalf("Tx: %v", err)
	}
	if _, err := db.Job(ctx, created.ID); err != nil {
		t.Errorf("job after commit: %v", err)
	}
}

func TestTxRollsBackOnError(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	boom := errors.New("boom")
	err := db.Tx(ctx, func(tx *Tx) error {
		if _, err := tx.CreateJob(ctx, testSpec); err != nil {
			return err
		}
		return boom
	})
	if err != boom {
		t.Fatalf("Tx = %v, want the closure's own error back unchanged", err)
	}
	assertNoJobs(t, db)
}

func TestTxRollsBackOnPanic(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	func() {
		defer func() {
			if r := recover(); r != "kaboom" {
				t.Errorf("recovered %v, want the closure's panic value", r)
			}
		}()
		_ = db.Tx(ctx, func(tx *Tx) error {
			if _, err := tx.CreateJob(ctx, testSpec); err != nil {
				return err
			}
			panic("kaboom")
		})
		t.Errorf("Tx returned; want the panic to continue")
	}()
	assertNoJobs(t, db)
	// The single write connection must be free again, not stuck in the
	// abandoned transaction.
	if _, err := db.CreateJob(ctx, testSpec); err != nil {
		t.Errorf("write after the panic: %v", err)
	}
}

func TestTxRollsBackOnGoexit(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = db.Tx(ctx, func(tx *Tx) error {
			if _, err := tx.CreateJob(ctx, testSpec); err != nil {
				return err
			}
			runtime.Goexit() // what t.FailNow does in a closure
			return nil
		})
	}()
	<-done
	assertNoJobs(t, db)
	if _, err := db.CreateJob(ctx, testSpec); err != nil {
		t.Errorf("write after Goexit: %v", err)
	}
}

func TestTxContextCancelled(t *testing.T) {
	db, _ := openTestDB(t)
	ctx, cancel := context.WithCancel(t.Context())
	err := db.Tx(ctx, func(tx *Tx) error {
		if _, err := tx.CreateJob(ctx, testSpec); err != nil {
			return err
		}
		cancel()
		return nil
	})
	if err == nil {
		t.Fatalf("Tx committed after its context was cancelled")
	}
	assertNoJobs(t, db)
}

func assertNoJobs(t *testing.T, db *DB) {
	t.Helper()
	jobs, err := db.ListJobs(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 0 {
		t.Errorf("found %d jobs after rollback, want 0", len(jobs))
	}
}

func TestCheck(t *testing.T) {
	db, _ := openTestDB(t)
	newJob(t, db)
	if err := db.Check(t.Context()); err != nil {
		t.Errorf("Check on a healthy database: %v", err)
	}
}

func TestDSNEscapes(t *testing.T) {
	got := dsn("/tmp/a?b#c%d", DefaultBusyTimeout, true)
	if !strings.HasPrefix(got, "file:/tmp/a%3Fb%23c%25d?") {
		t.Errorf("dsn = %s, want the path escaped before the parameters", got)
	}
}
