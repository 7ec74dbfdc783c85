package storage

import (
	"database/sql"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"testing/fstest"
)

// TestMigrationsEmbedded checks the migrations this binary ships: numbered
// without gaps, so SchemaVersion cannot panic.
func TestMigrationsEmbedded(t *testing.T) {
	ms, err := loadMigrations(migrationFS)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) == 0 || SchemaVersion() != len(ms) {
		t.Fatalf("SchemaVersion() = %d with %d migrations", SchemaVersion(), len(ms))
	}
}

func TestOpenMigratesAndReopens(t *testing.T) {
	path := filepath.Join(t.TempDir(), "shoal.db")
	db, err := Open(t.Context(), path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	id := newJob(t, db)
	var version int
	if err := db.r.QueryRow("PRAGMA user_version").Scan(&version); err != nil || version != SchemaVersion() {
		t.Errorf("user_version = %d, %v; want %d", version, err, SchemaVersion())
	}
	for _, table := range []string{"jobs", "workers", "plans", "steps", "checkpoints", "checkpoint_shards", "events", "router_stats"} {
		var n int
		if err := db.r.QueryRow("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?", table).Scan(&n); err != nil || n != 1 {
			t.Errorf("table %s: count %d, %v", table, n, err)
		}
	}
	db.Close()

	db, err = Open(t.Context(), path, Options{})
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer db.Close()
	if _, err := db.Job(t.Context(), id); err != nil {
		t.Errorf("job after reopen: %v", err)
	}
}

func TestOpenRefusesNewerSchema(t *testing.T) {
	path := filepath.Join(t.TempDir(), "shoal.db")
	db, err := Open(t.Context(), path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	newer := SchemaVersion() + 2
	if _, err := db.w.Exec("PRAGMA user_version = " + strconv.Itoa(newer)); err != nil {
		t.Fatal(err)
	}
	db.Close()

	_, err = Open(t.Context(), path, Options{})
	if !errors.Is(err, ErrSchemaTooNew) {
		t.Fatalf("Open = %v, want ErrSchemaTooNew", err)
	}
	want := "database schema " + strconv.Itoa(newer) + " is newer than this shoal (" + strconv.Itoa(SchemaVersion()) + "): upgrade shoal"
	if !strings.HasSuffix(err.Error(), want) {
		t.Errorf("error %q does not end with %q", err, want)
	}
}

func TestOpenRefusesForeignDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "other.db")
	raw, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Exec("CREATE TABLE accounts (id INTEGER PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	raw.Close()
	if _, err := Open(t.Context(), path, Options{}); !errors.Is(err, ErrNotShoalDatabase) {
		t.Fatalf("Open = %v, want ErrNotShoalDatabase", err)
	}
	// And it must not have been touched.
	raw, _ = sql.Open("sqlite", path)
	defer raw.Close()
	var n int
	if err := raw.QueryRow("SELECT count(*) FROM sqlite_schema").Scan(&n); err != nil || n != 1 {
		t.Errorf("foreign database has %d schema objects, %v; want its 1 untouched", n, err)
	}
	var mode string
	if err := raw.QueryRow("PRAGMA journal_mode").Scan(&mode); err != nil || mode != "delete" {
		t.Errorf("foreign database journal mode %q, %v; want delete, untouched", mode, err)
	}
}

// TestMigrationIsAtomic runs a migration that fails halfway: its first
// statement must not survive, and the version must stay at the last
// migration that fully applied.
func TestMigrationIsAtomic(t *testing.T) {
	fsys := fstest.MapFS{
		"migrations/0001_a.sql": {Data: []byte("CREATE TABLE a (x INTEGER) STRICT;")},
		"migrations/0002_b.sql": {Data: []byte("CREATE TABLE b (x INTEGER) STRICT; INSERT INTO nowhere VALUES (1);")},
	}
	path := filepath.Join(t.TempDir(), "m.db")
	w, err := sql.Open("sqlite", dsn(path, DefaultBusyTimeout, true))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	w.SetMaxOpenConns(1)

	if err := migrate(t.Context(), w, fsys); err == nil || !strings.Contains(err.Error(), "0002_b.sql") {
		t.Fatalf("migrate = %v, want an error naming 0002_b.sql", err)
	}
	var version, a, b int
	w.QueryRow("PRAGMA user_version").Scan(&version)
	w.QueryRow("SELECT count(*) FROM sqlite_schema WHERE name = 'a'").Scan(&a)
	w.QueryRow("SELECT count(*) FROM sqlite_schema WHERE name = 'b'").Scan(&b)
	if version != 1 || a != 1 || b != 0 {
		t.Errorf("after failed migration 2: user_version %d, table a %d, table b %d; want 1, 1, 0", version, a, b)
	}

	// Fixed, it applies on the next run, and only migration 2 runs.
	fsys["migrations/0002_b.sql"] = &fstest.MapFile{Data: []byte("CREATE TABLE b (x INTEGER) STRICT;")}
	if err := migrate(t.Context(), w, fsys); err != nil {
		t.Fatalf("migrate after fix: %v", err)
	}
	w.QueryRow("PRAGMA user_version").Scan(&version)
	if version != 2 {
		t.Errorf("user_version = %d, want 2", version)
	}
}

func TestLoadMigrationsRejectsBadNumbering(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files []string
	}{
		{"gap", []string{"0001_a.sql", "0003_c.sql"}},
		{"repeat", []string{"0001_a.sql", "0001_b.sql"}},
		{"zero", []string{"0000_a.sql"}},
		{"unnumbered", []string{"init.sql"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fsys := fstest.MapFS{}
			for _, f := range tc.files {
				fsys["migrations/"+f] = &fstest.MapFile{Data: []byte("SELECT 1;")}
			}
			if _, err := loadMigrations(fsys); err == nil {
				t.Errorf("loadMigrations(%v) succeeded, want an error", tc.files)
			}
		})
	}
}
