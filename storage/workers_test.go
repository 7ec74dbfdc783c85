package storage

import (
	"errors"
	"testing"
	"time"
)

func TestUpsertWorkerAndHeartbeat(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	joined := clock.Now()
	w, err := db.UpsertWorker(ctx, Worker{ID: "w1", Kind: WorkerNative, Backend: "avx2", GFLOPS: 120.5, MemoryBytes: 8 << 30})
	if err != nil {
		t.Fatal(err)
	}
	want := Worker{ID: "w1", Kind: WorkerNative, Backend: "avx2", GFLOPS: 120.5, MemoryBytes: 8 << 30,
		State: WorkerIdle, JoinedAt: joined, LastSeenAt: joined}
	if w != want {
		t.Errorf("UpsertWorker =\n %+v\nwant\n %+v", w, want)
	}

	clock.Advance(10 * time.Second)
	if err := db.Heartbeat(ctx, "w1"); err != nil {
		t.Fatal(err)
	}
	got, _ := db.Worker(ctx, "w1")
	if !got.LastSeenAt.Equal(clock.Now()) || !got.JoinedAt.Equal(joined) {
		t.Errorf("after heartbeat: joined %v seen %v; want %v, %v", got.JoinedAt, got.LastSeenAt, joined, clock.Now())
	}

	// A reconnect replaces the figures and counts as a new join.
	clock.Advance(time.Minute)
	w, err = db.UpsertWorker(ctx, Worker{ID: "w1", Kind: WorkerNative, Backend: "avx512", GFLOPS: 300, MemoryBytes: 4 << 30, State: WorkerActive})
	if err != nil {
		t.Fatal(err)
	}
	if w.Backend != "avx512" || w.GFLOPS != 300 || w.State != WorkerActive || !w.JoinedAt.Equal(clock.Now()) {
		t.Errorf("after reconnect: %+v", w)
	}

	if err := db.Heartbeat(ctx, "w1", "nobody"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Heartbeat(unknown) = %v, want ErrNotFound", err)
	}
	// The failed batch must not have half-applied.
	if got, _ := db.Worker(ctx, "w1"); !got.LastSeenAt.Equal(clock.Now()) {
		t.Errorf("last seen %v changed by a failed heartbeat batch", got.LastSeenAt)
	}
	if _, err := db.Worker(ctx, "nobody"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Worker(unknown) = %v, want ErrNotFound", err)
	}
}

func TestUpsertWorkerRejects(t *testing.T) {
	db, _ := openTestDB(t)
	for _, tc := range []struct {
		name string
		w    Worker
	}{
		{"no id", Worker{Kind: WorkerNative}},
		{"bad kind", Worker{ID: "x", Kind: "gpu"}},
		{"bad state", Worker{ID: "x", Kind: WorkerBrowser, State: "asleep"}},
		{"negative memory", Worker{ID: "x", Kind: WorkerBrowser, MemoryBytes: -1}},
		{"negative gflops", Worker{ID: "x", Kind: WorkerBrowser, GFLOPS: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := db.UpsertWorker(t.Context(), tc.w); !errors.Is(err, ErrInvalid) {
				t.Errorf("UpsertWorker(%+v) = %v, want ErrInvalid", tc.w, err)
			}
		})
	}
}

func TestWorkerStateAndList(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	for _, id := range []string{"a", "b", "c"} {
		if _, err := db.UpsertWorker(ctx, Worker{ID: id, Kind: WorkerBrowser, Backend: "webgpu"}); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second)
	}
	seen, _ := db.Worker(ctx, "b")
	clock.Advance(time.Second)
	if err := db.SetWorkerState(ctx, "b", WorkerGone); err != nil {
		t.Fatal(err)
	}
	if got, _ := db.Worker(ctx, "b"); got.State != WorkerGone || !got.LastSeenAt.Equal(seen.LastSeenAt) {
		t.Errorf("after SetWorkerState: %+v; want gone and last seen unchanged", got)
	}
	if err := db.SetWorkerState(ctx, "zz", WorkerGone); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetWorkerState(unknown) = %v, want ErrNotFound", err)
	}
	if err := db.SetWorkerState(ctx, "a", "bogus"); !errors.Is(err, ErrInvalid) {
		t.Errorf("SetWorkerState(bogus) = %v, want ErrInvalid", err)
	}
	idle, err := db.ListWorkers(ctx, WorkerIdle)
	if err != nil {
		t.Fatal(err)
	}
	if len(idle) != 2 || idle[0].ID != "a" || idle[1].ID != "c" {
		t.Errorf("ListWorkers(idle) = %+v, want a, c", idle)
	}
	if all, _ := db.ListWorkers(ctx); len(all) != 3 {
		t.Errorf("ListWorkers() has %d workers, want 3", len(all))
	}
}
