package storage

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"path/filepath"
	"testing"
	"testing/fstest"
	"time"

	"github.com/google/uuid"
)

// TestCreditPerIdentity: the work of two workers of one identity (a volunteer's restart, or its
// second tab) adds up on one line, named by the identity and the worker recorded last; a worker
// without one keeps its own line. A ban of one of the identity's workers rejects all of the
// identity's work in the job, and whatever a new worker of that identity does there is born
// rejected: no credit is earned for a banned volunteer, under any worker id.
func TestCreditPerIdentity(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := context.Background()
	job := newJob(t, db)
	const vol = "id:00112233445566778899aabbccddeeff"
	recordWork(t, db, job, 0, 1, Work{Worker: "w-a", Identity: vol, MicroBatches: 2, FLOPs: 10}, Work{Worker: "anon", MicroBatches: 2, FLOPs: 10})
	if _, err := db.VerifyWork(ctx, job, "w-a", 0); err != nil {
		t.Fatal(err)
	}
	recordWork(t, db, job, 1, 1, Work{Worker: "w-b", Identity: vol, MicroBatches: 3, FLOPs: 15}, Work{Worker: "anon", MicroBatches: 2, FLOPs: 10})
	cs, err := db.Credits(ctx, job)
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) != 2 {
		t.Fatalf("credits %+v, want one line for the volunteer and one for the worker without identity", cs)
	}
	c, err := db.WorkerCredit(ctx, job, vol)
	if err != nil || c.Identity != vol || c.Worker != "w-b" || c.VerifiedMicroBatches != 2 || c.PendingMicroBatches != 3 {
		t.Fatalf("the volunteer's credit: %+v, %v", c, err)
	}
	if c2, err := db.WorkerCredit(ctx, job, "w-b"); err != nil || c2 != c {
		t.Fatalf("credit by its last worker: %+v, %v, want %+v", c2, err, c)
	}
	if err := db.BanWorker(ctx, job, Ban{Worker: "w-b", Identity: vol, Addr: "192.0.2.1", Reason: "audit", Step: 1}); err != nil {
		t.Fatal(err)
	}
	recordWork(t, db, job, 2, 1, Work{Worker: "w-c", Identity: vol, MicroBatches: 4, FLOPs: 20})
	c, err = db.WorkerCredit(ctx, job, vol)
	if err != nil || c.VerifiedMicroBatches != 0 || c.PendingMicroBatches != 0 || c.RejectedMicroBatches != 9 || c.Worker != "w-c" {
		t.Fatalf("the banned volunteer's credit: %+v, %v, want all of it rejected", c, err)
	}
	if a, err := db.WorkerCredit(ctx, job, "anon"); err != nil || a.PendingMicroBatches != 4 || a.Identity != "" {
		t.Fatalf("the other worker's credit: %+v, %v", a, err)
	}
	if b, err := db.WorkerBan(ctx, job, vol); err != nil || b.Worker != "w-b" || b.Identity != vol || b.Addr != "192.0.2.1" {
		t.Fatalf("ban by identity: %+v, %v", b, err)
	}
}

// TestBannedAddrs: the addresses of recent bans, in any job, each with its newest ban.
func TestBannedAddrs(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := context.Background()
	j1, j2 := newJob(t, db), newJob(t, db)
	start := clock.Now()
	for _, b := range []struct {
		job  uuid.UUID
		ban  Ban
		wait time.Duration
	}{
		{j1, Ban{Worker: "a", Addr: "192.0.2.1", Reason: "r"}, 0},
		{j2, Ban{Worker: "b", Addr: "2001:db8::/64", Reason: "r"}, time.Hour},
		{j2, Ban{Worker: "c", Addr: "192.0.2.1", Reason: "r"}, time.Hour},
		{j2, Ban{Worker: "d", Reason: "r"}, 0},
	} {
		clock.Advance(b.wait)
		if err := db.BanWorker(ctx, b.job, b.ban); err != nil {
			t.Fatal(err)
		}
	}
	got, err := db.BannedAddrs(ctx, start.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	want := start.Add(2 * time.Hour).Truncate(time.Millisecond)
	if len(got) != 2 || !got["192.0.2.1"].Equal(want) || !got["2001:db8::/64"].Equal(start.Add(time.Hour).Truncate(time.Millisecond)) {
		t.Fatalf("banned addresses %v", got)
	}
}

// TestPruneWorkersKeepsParticipants: rows of workers that never took part expire once gone for
// the retention; a participant's, a connected one's and a recent one's stay.
func TestPruneWorkersKeepsParticipants(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := context.Background()
	job := newJob(t, db)
	for _, id := range []string{"used", "unused", "connected", "recent"} {
		if _, err := db.UpsertWorker(ctx, Worker{ID: id, Kind: WorkerNative, Backend: "cpu"}); err != nil {
			t.Fatal(err)
		}
		if err := db.SetSession(ctx, id, make([]byte, 32)); err != nil {
			t.Fatal(err)
		}
		if _, err := db.AppendEvent(ctx, Event{JobID: job, Kind: "worker.joined", WorkerID: id}); err != nil {
			t.Fatal(err)
		}
	}
	db.SetSession(ctx, "never-recorded", make([]byte, 32))
	if err := db.Tx(ctx, func(tx *Tx) error { return tx.MarkTookPart(ctx, "used") }); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"used", "unused"} {
		db.SetWorkerState(ctx, id, WorkerGone)
	}
	clock.Advance(48 * time.Hour)
	db.UpsertWorker(ctx, Worker{ID: "recent", Kind: WorkerNative, Backend: "cpu", State: WorkerGone})
	n, err := db.PruneWorkers(ctx, clock.Now().Add(-24*time.Hour))
	if err != nil || n != 1 {
		t.Fatalf("pruned %d, %v; want the one unused worker", n, err)
	}
	for id, kept := range map[string]bool{"used": true, "unused": false, "connected": true, "recent": true, "never-recorded": false} {
		if known, _ := db.KnownWorker(ctx, id); known != kept {
			t.Errorf("%s known %v after pruning, want %v", id, known, kept)
		}
	}
	if _, err := db.Worker(ctx, "unused"); !errors.Is(err, ErrNotFound) {
		t.Errorf("the unused worker's row: %v", err)
	}
	if evs, _ := db.ListEvents(ctx, EventFilter{WorkerID: "unused"}); len(evs) != 0 {
		t.Errorf("the unused worker's events: %d", len(evs))
	}
	if evs, _ := db.ListEvents(ctx, EventFilter{WorkerID: "used"}); len(evs) != 1 {
		t.Errorf("the participant's events: %d", len(evs))
	}
}

// TestMigrateCreditsToAccounts: a database of the schema before identities, with credit and a
// ban, opens with its credit intact, each worker's under its own id, and keeps counting.
func TestMigrateCreditsToAccounts(t *testing.T) {
	old := fstest.MapFS{}
	for _, name := range []string{"0001_init.sql", "0002_join_token.sql", "0003_sessions.sql", "0004_credit.sql"} {
		b, err := fs.ReadFile(migrationFS, "migrations/"+name)
		if err != nil {
			t.Fatal(err)
		}
		old["migrations/"+name] = &fstest.MapFile{Data: b}
	}
	path := filepath.Join(t.TempDir(), "shoal.db")
	w, err := sql.Open("sqlite", dsn(path, DefaultBusyTimeout, true))
	if err != nil {
		t.Fatal(err)
	}
	w.SetMaxOpenConns(1)
	if err := migrate(t.Context(), w, old); err != nil {
		t.Fatal(err)
	}
	const job = "00000000-0000-0000-0000-000000000001"
	for _, q := range []string{
		`INSERT INTO jobs (id, spec, state, created_at, updated_at) VALUES ('` + job + `', '{}', 'running', 'x', 'x')`,
		`INSERT INTO plans (job_id, version, plan, created_at) VALUES ('` + job + `', 1, '{}', 'x')`,
		`INSERT INTO work VALUES ('` + job + `', 'w-a', 0, 1, 2, 10, 'verified', 'x', 'x')`,
		`INSERT INTO work VALUES ('` + job + `', 'w-b', 0, 1, 3, 10, 'pending', 'x', NULL)`,
		`INSERT INTO workers (id, kind, backend, gflops, memory_bytes, state, joined_at, last_seen_at) VALUES ('w-a', 'native', 'cpu', 1, 1, 'gone', 'x', 'x')`,
	} {
		if _, err := w.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	w.Close()
	db, err := Open(t.Context(), path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	id := uuid.MustParse(job)
	cs, err := db.Credits(t.Context(), id)
	if err != nil || len(cs) != 2 || cs[0].Worker != "w-a" || cs[0].VerifiedMicroBatches != 2 || cs[0].Identity != "" ||
		cs[1].Worker != "w-b" || cs[1].PendingMicroBatches != 3 {
		t.Fatalf("credits after the migration: %+v, %v", cs, err)
	}
	if _, err := db.VerifyWork(t.Context(), id, "w-b", 0); err != nil {
		t.Fatal(err)
	}
	if c, err := db.WorkerCredit(t.Context(), id, "w-b"); err != nil || c.VerifiedMicroBatches != 3 || c.PendingMicroBatches != 0 {
		t.Fatalf("w-b after verifying: %+v, %v", c, err)
	}
	// A worker from before the migration counts as having taken part: it never expires.
	if n, err := db.PruneWorkers(t.Context(), time.Now()); err != nil || n != 0 {
		t.Fatalf("pruned %d, %v: an old worker row", n, err)
	}
}
