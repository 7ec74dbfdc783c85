package storage

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
)

var creditSeed = flag.Uint64("credit.seed", 0, "seed of TestCreditTotalsMatchRows; 0 picks one and prints it")

// credits is Credits that fails the test on an error.
func credits(t *testing.T, db *DB, job uuid.UUID) []Credit {
	t.Helper()
	cs, err := db.Credits(t.Context(), job)
	if err != nil {
		t.Fatalf("Credits: %v", err)
	}
	return cs
}

func recordWork(t *testing.T, db *DB, job uuid.UUID, step, plan int64, work ...Work) {
	t.Helper()
	if err := db.RecordWork(t.Context(), job, step, plan, work); err != nil {
		t.Fatalf("RecordWork(step %d, plan %d): %v", step, plan, err)
	}
}

// workStates is the state of each of the job's work rows, keyed "worker@step/plan".
func workStates(t *testing.T, db *DB, job uuid.UUID) map[string]WorkState {
	t.Helper()
	rows, err := db.r.QueryContext(t.Context(), "SELECT worker_id, step, plan_version, state FROM work WHERE job_id = ?", job.String())
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]WorkState{}
	for rows.Next() {
		var w, st string
		var step, plan int64
		if err := rows.Scan(&w, &step, &plan, &st); err != nil {
			t.Fatal(err)
		}
		out[fmt.Sprintf("%s@%d/%d", w, step, plan)] = WorkState(st)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestWorkLifecycle walks work through its states as the coordinator drives
// it: recorded pending, verified by a passed audit, discarded by a rollback,
// replayed, rejected by a ban.
func TestWorkLifecycle(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	job := newJob(t, db)
	for s := int64(0); s < 6; s++ {
		recordWork(t, db, job, s, 1,
			Work{Worker: "w-a", MicroBatches: 2, FLOPs: 1e9},
			Work{Worker: "w-b", MicroBatches: 2, FLOPs: 3e9})
	}
	want := []Credit{
		{Worker: "w-a", PendingMicroBatches: 12, PendingFLOPs: 6e9},
		{Worker: "w-b", PendingMicroBatches: 12, PendingFLOPs: 18e9},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after 6 steps, Credits = %+v, want %+v (nothing verified: worker order)", got, want)
	}

	// An audit of w-a at step 3 passed: it vouches for steps 0..3.
	if n, err := db.VerifyWork(ctx, job, "w-a", 3); err != nil || n != 4 {
		t.Errorf("VerifyWork(w-a, 3) = %d, %v; want 4, nil", n, err)
	}
	if n, err := db.VerifyWork(ctx, job, "w-a", 3); err != nil || n != 0 {
		t.Errorf("VerifyWork(w-a, 3) again = %d, %v; want 0, nil", n, err)
	}
	if n, err := db.VerifyWork(ctx, job, "w-b", 1); err != nil || n != 2 {
		t.Errorf("VerifyWork(w-b, 1) = %d, %v; want 2, nil", n, err)
	}
	want = []Credit{
		{Worker: "w-b", VerifiedMicroBatches: 4, PendingMicroBatches: 8, VerifiedFLOPs: 6e9, PendingFLOPs: 12e9},
		{Worker: "w-a", VerifiedMicroBatches: 8, PendingMicroBatches: 4, VerifiedFLOPs: 4e9, PendingFLOPs: 2e9},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after audits, Credits = %+v, want %+v (most verified FLOPs first)", got, want)
	}

	// The job rolls back to its checkpoint at step 2: the pending work of
	// steps 2.. is discarded, verified work stays.
	if err := db.DiscardWork(ctx, job, 2); err != nil {
		t.Fatal(err)
	}
	states := workStates(t, db, job)
	for key, st := range map[string]WorkState{
		"w-a@1/1": WorkVerified, "w-a@3/1": WorkVerified, "w-a@4/1": WorkDiscarded,
		"w-b@1/1": WorkVerified, "w-b@2/1": WorkDiscarded, "w-b@5/1": WorkDiscarded,
	} {
		if states[key] != st {
			t.Errorf("after DiscardWork(2), %s is %s, want %s", key, states[key], st)
		}
	}
	want = []Credit{
		{Worker: "w-b", VerifiedMicroBatches: 4, VerifiedFLOPs: 6e9},
		{Worker: "w-a", VerifiedMicroBatches: 8, VerifiedFLOPs: 4e9},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after the rollback, Credits = %+v, want %+v", got, want)
	}

	// The replay of steps 2..3 under the same plan: a discarded row is
	// pending again; a verified one stays as the audit left it.
	for s := int64(2); s < 4; s++ {
		recordWork(t, db, job, s, 1,
			Work{Worker: "w-a", MicroBatches: 2, FLOPs: 1e9},
			Work{Worker: "w-b", MicroBatches: 2, FLOPs: 3e9})
	}
	states = workStates(t, db, job)
	if states["w-a@3/1"] != WorkVerified || states["w-b@3/1"] != WorkPending || states["w-b@4/1"] != WorkDiscarded {
		t.Errorf("after the replay, w-a@3 %s, w-b@3 %s, w-b@4 %s; want verified, pending, discarded",
			states["w-a@3/1"], states["w-b@3/1"], states["w-b@4/1"])
	}
	want = []Credit{
		{Worker: "w-b", VerifiedMicroBatches: 4, PendingMicroBatches: 4, VerifiedFLOPs: 6e9, PendingFLOPs: 6e9},
		{Worker: "w-a", VerifiedMicroBatches: 8, VerifiedFLOPs: 4e9},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after the replay, Credits = %+v, want %+v", got, want)
	}

	// w-b is caught: everything it did in the job, verified or not, is
	// rejected; its discarded rows stay discarded.
	if err := db.RejectWork(ctx, job, "w-b"); err != nil {
		t.Fatal(err)
	}
	if err := db.RejectWork(ctx, job, "w-b"); err != nil {
		t.Errorf("RejectWork again: %v", err)
	}
	states = workStates(t, db, job)
	if states["w-b@0/1"] != WorkRejected || states["w-b@3/1"] != WorkRejected || states["w-b@4/1"] != WorkDiscarded {
		t.Errorf("after RejectWork, w-b@0 %s, w-b@3 %s, w-b@4 %s; want rejected, rejected, discarded",
			states["w-b@0/1"], states["w-b@3/1"], states["w-b@4/1"])
	}
	want = []Credit{
		{Worker: "w-a", VerifiedMicroBatches: 8, VerifiedFLOPs: 4e9},
		{Worker: "w-b", RejectedMicroBatches: 8},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after RejectWork, Credits = %+v, want %+v", got, want)
	}
	// A rejected row is settled: recording it again changes nothing.
	recordWork(t, db, job, 0, 1, Work{Worker: "w-b", MicroBatches: 2, FLOPs: 3e9})
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("after re-recording rejected work, Credits = %+v, want %+v", got, want)
	}
}

// TestRejectPendingWork: a worker that left an audit unanswered forfeits its
// pending work, and only that: what a passed audit verified stays, other
// workers' work is untouched, and the earliest step forfeited is returned for
// the rollback.
func TestRejectPendingWork(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	job := newJob(t, db)
	for s := int64(0); s < 6; s++ {
		recordWork(t, db, job, s, 1,
			Work{Worker: "w-a", MicroBatches: 2, FLOPs: 1e9},
			Work{Worker: "w-b", MicroBatches: 2, FLOPs: 3e9})
	}
	if _, err := db.VerifyWork(ctx, job, "w-a", 2); err != nil {
		t.Fatal(err)
	}
	rows, first, err := db.RejectPendingWork(ctx, job, "w-a")
	if err != nil || rows != 3 || first != 3 {
		t.Fatalf("RejectPendingWork = %d rows from step %d, %v; want 3 from step 3", rows, first, err)
	}
	want := []Credit{
		{Worker: "w-a", VerifiedMicroBatches: 6, RejectedMicroBatches: 6, VerifiedFLOPs: 3e9},
		{Worker: "w-b", PendingMicroBatches: 12, PendingFLOPs: 18e9},
	}
	if got := credits(t, db, job); !slices.Equal(got, want) {
		t.Errorf("Credits = %+v, want %+v", got, want)
	}
	if rows, first, err := db.RejectPendingWork(ctx, job, "w-a"); err != nil || rows != 0 || first != -1 {
		t.Errorf("RejectPendingWork again = %d rows from step %d, %v; want none (-1)", rows, first, err)
	}
	if _, _, err := db.RejectPendingWork(ctx, uuid.New(), "w-a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("RejectPendingWork of no job = %v, want ErrNotFound", err)
	}
}

// TestRecordWorkReplaces: recording the same (worker, step, plan) again
// replaces the pending row instead of adding to it, and another plan version
// of the same step is other work.
func TestRecordWorkReplaces(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	job := newJob(t, db)
	recordWork(t, db, job, 7, 1, Work{Worker: "w", MicroBatches: 4, FLOPs: 10})
	clock.Advance(time.Second)
	recordWork(t, db, job, 7, 1, Work{Worker: "w", MicroBatches: 2, FLOPs: 5})
	if got, want := credits(t, db, job), []Credit{{Worker: "w", PendingMicroBatches: 2, PendingFLOPs: 5}}; !slices.Equal(got, want) {
		t.Errorf("after recording step 7 twice, Credits = %+v, want %+v", got, want)
	}
	var recorded string
	if err := db.r.QueryRowContext(ctx, "SELECT recorded_at FROM work WHERE job_id = ?", job.String()).Scan(&recorded); err != nil || recorded != formatTime(clock.Now()) {
		t.Errorf("recorded_at = %q, %v; want the second recording's %q", recorded, err, formatTime(clock.Now()))
	}
	if _, err := db.SavePlan(ctx, job, json.RawMessage(`{"stages":[[0,4]]}`)); err != nil {
		t.Fatal(err)
	}
	recordWork(t, db, job, 7, 2, Work{Worker: "w", MicroBatches: 3, FLOPs: 7})
	if got, want := credits(t, db, job), []Credit{{Worker: "w", PendingMicroBatches: 5, PendingFLOPs: 12}}; !slices.Equal(got, want) {
		t.Errorf("after step 7 under plan 2, Credits = %+v, want %+v", got, want)
	}
	if err := db.RecordWork(ctx, job, 8, 1, nil); err != nil {
		t.Errorf("RecordWork with no work = %v, want nil", err)
	}
}

func TestRecordWorkRejects(t *testing.T) {
	db, _ := openTestDB(t)
	job := newJob(t, db)
	ok := Work{Worker: "w", MicroBatches: 1, FLOPs: 1}
	tests := []struct {
		name string
		job  uuid.UUID
		step int64
		plan int64
		work []Work
		want error
	}{
		{"negative step", job, -1, 1, []Work{ok}, ErrInvalid},
		{"plan 0", job, 0, 0, []Work{ok}, ErrInvalid},
		{"plan never saved", job, 0, 9, []Work{ok}, ErrNotFound},
		{"unknown job", uuid.New(), 0, 1, []Work{ok}, ErrNotFound},
		{"empty worker", job, 0, 1, []Work{ok, {MicroBatches: 1}}, ErrInvalid},
		{"worker twice", job, 0, 1, []Work{ok, ok}, ErrInvalid},
		{"negative micro-batches", job, 0, 1, []Work{{Worker: "x", MicroBatches: -1}}, ErrInvalid},
		{"negative FLOPs", job, 0, 1, []Work{{Worker: "x", FLOPs: -1}}, ErrInvalid},
		{"NaN FLOPs", job, 0, 1, []Work{{Worker: "x", FLOPs: math.NaN()}}, ErrInvalid},
		{"infinite FLOPs", job, 0, 1, []Work{{Worker: "x", FLOPs: math.Inf(1)}}, ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := db.RecordWork(t.Context(), tt.job, tt.step, tt.plan, tt.work); !errors.Is(err, tt.want) {
				t.Errorf("RecordWork = %v, want %v", err, tt.want)
			}
		})
	}
	if got := credits(t, db, job); len(got) != 0 {
		t.Errorf("refused calls recorded %+v", got)
	}
	ctx := t.Context()
	if _, err := db.VerifyWork(ctx, uuid.New(), "w", 1); !errors.Is(err, ErrNotFound) {
		t.Errorf("VerifyWork of an unknown job = %v, want ErrNotFound", err)
	}
	if err := db.RejectWork(ctx, uuid.New(), "w"); !errors.Is(err, ErrNotFound) {
		t.Errorf("RejectWork of an unknown job = %v, want ErrNotFound", err)
	}
	if err := db.DiscardWork(ctx, uuid.New(), 0); !errors.Is(err, ErrNotFound) {
		t.Errorf("DiscardWork of an unknown job = %v, want ErrNotFound", err)
	}
}

// TestCreditsOrderAndBounds: most verified FLOPs first, ties by worker id;
// TopCredits cuts the list, WorkerCredit finds anyone on it; work of other
// jobs stays out; workers with only discarded work are not listed.
func TestCreditsOrderAndBounds(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	job, other := newJob(t, db), newJob(t, db)
	recordWork(t, db, job, 0, 1,
		Work{Worker: "w-c", MicroBatches: 1, FLOPs: 5},
		Work{Worker: "w-a", MicroBatches: 1, FLOPs: 5},
		Work{Worker: "w-b", MicroBatches: 1, FLOPs: 9},
		Work{Worker: "w-d", MicroBatches: 1, FLOPs: 1},
		Work{Worker: "w-e", MicroBatches: 1, FLOPs: 100})
	recordWork(t, db, other, 0, 1, Work{Worker: "w-a", MicroBatches: 1, FLOPs: 1000})
	for _, w := range []string{"w-a", "w-b", "w-c", "w-d"} {
		if _, err := db.VerifyWork(ctx, job, w, 0); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.VerifyWork(ctx, other, "w-a", 0); err != nil {
		t.Fatal(err)
	}
	recordWork(t, db, job, 1, 1, Work{Worker: "w-f", MicroBatches: 1, FLOPs: 1})
	if err := db.DiscardWork(ctx, job, 1); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range credits(t, db, job) {
		got = append(got, c.Worker)
	}
	if want := []string{"w-b", "w-a", "w-c", "w-d", "w-e"}; !slices.Equal(got, want) {
		t.Errorf("Credits order = %v, want %v (w-e's 100 FLOPs are pending; w-f has only discarded work)", got, want)
	}
	top, err := db.TopCredits(ctx, job, 2)
	if err != nil || len(top) != 2 || top[0].Worker != "w-b" || top[1].Worker != "w-a" || top[1].VerifiedFLOPs != 5 {
		t.Errorf("TopCredits(2) = %+v, %v", top, err)
	}
	if all, err := db.TopCredits(ctx, job, 0); err != nil || len(all) != 5 {
		t.Errorf("TopCredits(0) = %d credits, %v; want all 5", len(all), err)
	}
	c, err := db.WorkerCredit(ctx, job, "w-e")
	if want := (Credit{Worker: "w-e", PendingMicroBatches: 1, PendingFLOPs: 100}); err != nil || c != want {
		t.Errorf("WorkerCredit(w-e) = %+v, %v; want %+v", c, err, want)
	}
	for _, w := range []string{"w-f", "nobody"} {
		if _, err := db.WorkerCredit(ctx, job, w); !errors.Is(err, ErrNotFound) {
			t.Errorf("WorkerCredit(%s) = %v, want ErrNotFound", w, err)
		}
	}
}

// TestBan: a ban is kept with its first reason, rejects the worker's work in
// the same transaction, and makes its later work rejected from the start.
func TestBan(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	job, other := newJob(t, db), newJob(t, db)
	recordWork(t, db, job, 0, 1, Work{Worker: "cheat", MicroBatches: 2, FLOPs: 4}, Work{Worker: "honest", MicroBatches: 2, FLOPs: 4})
	if _, err := db.VerifyWork(ctx, job, "cheat", 0); err != nil {
		t.Fatal(err)
	}
	recordWork(t, db, job, 1, 1, Work{Worker: "cheat", MicroBatches: 2, FLOPs: 4})
	first := clock.Now()
	if err := db.Ban(ctx, job, "cheat", "audit of step 1: gradient digest differs", 1); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Minute)
	if err := db.Ban(ctx, job, "cheat", "a later, different reason", 5); err != nil {
		t.Errorf("Ban again: %v", err)
	}
	if err := db.Ban(ctx, job, "also", "cross-check of step 2", 2); err != nil {
		t.Fatal(err)
	}
	bans, err := db.Bans(ctx, job)
	want := []Ban{
		{Worker: "cheat", Reason: "audit of step 1: gradient digest differs", Step: 1, At: first},
		{Worker: "also", Reason: "cross-check of step 2", Step: 2, At: clock.Now()},
	}
	if err != nil || !slices.Equal(bans, want) {
		t.Errorf("Bans = %+v, %v; want %+v", bans, err, want)
	}
	if recent, err := db.RecentBans(ctx, job, 1); err != nil || !slices.Equal(recent, want[1:]) {
		t.Errorf("RecentBans(1) = %+v, %v; want %+v", recent, err, want[1:])
	}
	if b, err := db.WorkerBan(ctx, job, "cheat"); err != nil || b != want[0] {
		t.Errorf("WorkerBan(cheat) = %+v, %v", b, err)
	}
	if _, err := db.WorkerBan(ctx, job, "honest"); !errors.Is(err, ErrNotFound) {
		t.Errorf("WorkerBan(honest) = %v, want ErrNotFound", err)
	}
	for _, tc := range []struct {
		job    uuid.UUID
		worker string
		want   bool
	}{{job, "cheat", true}, {job, "honest", false}, {other, "cheat", false}} {
		if got, err := db.Banned(ctx, tc.job, tc.worker); err != nil || got != tc.want {
			t.Errorf("Banned(%s) = %v, %v; want %v", tc.worker, got, err, tc.want)
		}
	}
	if bans, err := db.Bans(ctx, other); err != nil || len(bans) != 0 {
		t.Errorf("Bans of another job = %+v, %v", bans, err)
	}

	// The ban rejected the verified step 0 and the pending step 1; work
	// recorded after it is rejected at once and no audit verifies it.
	recordWork(t, db, job, 2, 1, Work{Worker: "cheat", MicroBatches: 2, FLOPs: 4})
	if n, err := db.VerifyWork(ctx, job, "cheat", 10); err != nil || n != 0 {
		t.Errorf("VerifyWork of a banned worker = %d, %v; want 0", n, err)
	}
	got := credits(t, db, job)
	wantCredits := []Credit{{Worker: "cheat", RejectedMicroBatches: 6}, {Worker: "honest", PendingMicroBatches: 2, PendingFLOPs: 4}}
	if !slices.Equal(got, wantCredits) {
		t.Errorf("Credits after the ban = %+v, want %+v", got, wantCredits)
	}

	for _, tc := range []struct {
		name   string
		job    uuid.UUID
		worker string
		step   int64
		want   error
	}{{"empty worker", job, "", 0, ErrInvalid}, {"negative step", job, "x", -1, ErrInvalid}, {"unknown job", uuid.New(), "x", 0, ErrNotFound}} {
		if err := db.Ban(ctx, tc.job, tc.worker, "r", tc.step); !errors.Is(err, tc.want) {
			t.Errorf("Ban, %s = %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestCreditTotalsMatchRows drives random work through every transition and
// checks that the running totals the triggers keep equal sums over the rows.
// Run with -credit.seed=N to repeat a failure.
func TestCreditTotalsMatchRows(t *testing.T) {
	seed := *creditSeed
	if seed == 0 {
		seed = rand.Uint64()
	}
	t.Logf("seed %d (repeat with -credit.seed=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	db, _ := openTestDB(t)
	ctx := t.Context()
	job := newJob(t, db)
	if _, err := db.SavePlan(ctx, job, json.RawMessage(`{"stages":[[0,4]]}`)); err != nil {
		t.Fatal(err)
	}
	workers := []string{"w0", "w1", "w2", "w3", "w4"}
	step := int64(0)
	for range 300 {
		w := workers[rng.IntN(len(workers))]
		var err error
		switch op := rng.IntN(10); {
		case op < 5:
			var work []Work
			for _, x := range workers {
				if rng.IntN(3) > 0 {
					// FLOPs with many significant digits, so that sums round.
					work = append(work, Work{Worker: x, MicroBatches: rng.Int64N(5), FLOPs: rng.Float64() * 1e12})
				}
			}
			err = db.RecordWork(ctx, job, step, 1+rng.Int64N(2), work)
			step++
		case op < 8:
			_, err = db.VerifyWork(ctx, job, w, rng.Int64N(step+1))
		case op < 9:
			step = max(0, step-rng.Int64N(5))
			err = db.DiscardWork(ctx, job, step)
		default:
			if rng.IntN(3) == 0 {
				err = db.Ban(ctx, job, w, "random", step)
			} else {
				err = db.RejectWork(ctx, job, w)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	rows, err := db.r.QueryContext(ctx, `SELECT worker_id,
		    sum(iif(state = 'verified', micro_batches, 0)), sum(iif(state = 'pending', micro_batches, 0)),
		    sum(iif(state = 'rejected', micro_batches, 0)),
		    sum(iif(state = 'verified', flops, 0.0)), sum(iif(state = 'pending', flops, 0.0))
		FROM work WHERE job_id = ? AND state <> 'discarded' GROUP BY worker_id`, job.String())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Credit{}
	for rows.Next() {
		var c Credit
		if err := rows.Scan(&c.Worker, &c.VerifiedMicroBatches, &c.PendingMicroBatches, &c.RejectedMicroBatches, &c.VerifiedFLOPs, &c.PendingFLOPs); err != nil {
			t.Fatal(err)
		}
		want[c.Worker] = c
	}
	rows.Close()
	got := credits(t, db, job)
	if len(got) != len(want) {
		t.Errorf("Credits lists %d workers, the rows %d", len(got), len(want))
	}
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(math.Abs(a), math.Abs(b)) }
	for i, c := range got {
		w := want[c.Worker]
		if c.VerifiedMicroBatches != w.VerifiedMicroBatches || c.PendingMicroBatches != w.PendingMicroBatches ||
			c.RejectedMicroBatches != w.RejectedMicroBatches || !near(c.VerifiedFLOPs, w.VerifiedFLOPs) || !near(c.PendingFLOPs, w.PendingFLOPs) {
			t.Errorf("credit of %s = %+v, the rows sum to %+v", c.Worker, c, w)
		}
		// A state with no rows left has exactly zero FLOPs, not a rounding residue.
		if (w.VerifiedFLOPs == 0 && c.VerifiedFLOPs != 0) || (w.PendingFLOPs == 0 && c.PendingFLOPs != 0) {
			t.Errorf("credit of %s = %+v: residue where the rows have none", c.Worker, c)
		}
		if i > 0 && (got[i-1].VerifiedFLOPs < c.VerifiedFLOPs ||
			(got[i-1].VerifiedFLOPs == c.VerifiedFLOPs && got[i-1].Worker > c.Worker)) {
			t.Errorf("Credits out of order at %d: %+v before %+v", i, got[i-1], c)
		}
	}
}

// BenchmarkStatusCredits measures what a coordinator's status publication reads: the top 100
// credits and the newest 100 bans of a job with 1,000 workers and 100,000 rows of work.
func BenchmarkStatusCredits(b *testing.B) {
	db, _ := openTestDB(b)
	ctx := b.Context()
	job := newJob(b, db)
	workers := 1000
	for s := range int64(100) {
		work := make([]Work, workers)
		for i := range work {
			work[i] = Work{Worker: fmt.Sprintf("w%04d", i), MicroBatches: 2, FLOPs: float64(1e9 + i)}
		}
		if err := db.RecordWork(ctx, job, s, 1, work); err != nil {
			b.Fatal(err)
		}
	}
	for i := range workers / 2 {
		if _, err := db.VerifyWork(ctx, job, fmt.Sprintf("w%04d", i), 50); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 10 {
		if err := db.Ban(ctx, job, fmt.Sprintf("w%04d", workers-1-i), "bench", 60); err != nil {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	for b.Loop() {
		if cs, err := db.TopCredits(ctx, job, 100); err != nil || len(cs) != 100 {
			b.Fatalf("TopCredits = %d, %v", len(cs), err)
		}
		if _, err := db.RecentBans(ctx, job, 100); err != nil {
			b.Fatal(err)
		}
	}
}
