package storage

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
)

func TestCheckpointCompletesOnLastShard(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	cp, err := db.BeginCheckpoint(ctx, id, 10, []string{"stage1", "stage0", "experts.b1.e0"})
	if err != nil {
		t.Fatal(err)
	}
	if cp.State != CheckpointPending || len(cp.Shards) != 3 || cp.Shards[0].Name != "experts.b1.e0" || cp.Shards[0].Landed() {
		t.Fatalf("begun checkpoint = %+v", cp)
	}

	for i, name := range []string{"stage0", "stage1"} {
		clock.Advance(time.Second)
		done, err := db.AddShard(ctx, cp.ID, name, sha(name), int64(100+i))
		if err != nil || done {
			t.Fatalf("AddShard(%s) = %v, %v; want false, nil", name, done, err)
		}
		if _, err := db.LatestCheckpoint(ctx, id); !errors.Is(err, ErrNotFound) {
			t.Errorf("LatestCheckpoint with shards missing = %v, want ErrNotFound", err)
		}
	}
	clock.Advance(time.Second)
	done, err := db.AddShard(ctx, cp.ID, "experts.b1.e0", sha("e0"), 7)
	if err != nil || !done {
		t.Fatalf("last AddShard = %v, %v; want true, nil", done, err)
	}
	latest, err := db.LatestCheckpoint(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if latest.ID != cp.ID || latest.State != CheckpointComplete || !latest.CompletedAt.Equal(clock.Now()) || latest.Step != 10 {
		t.Errorf("LatestCheckpoint = %+v", latest)
	}
	want := Shard{Name: "experts.b1.e0", SHA256: sha("e0"), Bytes: 7, AddedAt: clock.Now()}
	if latest.Shards[0] != want {
		t.Errorf("shard = %+v, want %+v", latest.Shards[0], want)
	}

	// A retried upload of a landed shard is a no-op, also after completion.
	if done, err := db.AddShard(ctx, cp.ID, "stage0", sha("stage0"), 100); err != nil || done {
		t.Errorf("identical re-add = %v, %v; want false, nil", done, err)
	}
	if _, err := db.AddShard(ctx, cp.ID, "stage0", sha("other"), 100); !errors.Is(err, ErrShardConflict) {
		t.Errorf("different re-add = %v, want ErrShardConflict", err)
	}
}

func TestAddShardRejects(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	cp, err := db.BeginCheckpoint(ctx, id, 1, []string{"stage0"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, shard, hash string
		id                int64
		size              int64
		want              error
	}{
		{"unexpected name", "stage9", sha("x"), cp.ID, 1, ErrUnexpectedShard},
		{"unknown checkpoint", "stage0", sha("x"), cp.ID + 100, 1, ErrNotFound},
		{"short hash", "stage0", "abc", cp.ID, 1, ErrInvalid},
		{"uppercase hash", "stage0", "A" + sha("x")[1:], cp.ID, 1, ErrInvalid},
		{"traversal", "stage0", "../../../../etc/passwd" + sha("x")[22:], cp.ID, 1, ErrInvalid},
		{"negative size", "stage0", sha("x"), cp.ID, -1, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := db.AddShard(ctx, tc.id, tc.shard, tc.hash, tc.size); !errors.Is(err, tc.want) {
				t.Errorf("AddShard = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestBeginCheckpointRejects(t *testing.T) {
	db, _ := openTestDB(t)
	id := newJob(t, db)
	for _, tc := range []struct {
		name  string
		job   uuid.UUID
		step  int64
		names []string
		want  error
	}{
		{"no shards", id, 1, nil, ErrInvalid},
		{"repeated name", id, 1, []string{"a", "a"}, ErrInvalid},
		{"empty name", id, 1, []string{""}, ErrInvalid},
		{"negative step", id, -1, []string{"a"}, ErrInvalid},
		{"unknown job", uuid.New(), 1, []string{"a"}, ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := db.BeginCheckpoint(t.Context(), tc.job, tc.step, tc.names); !errors.Is(err, tc.want) {
				t.Errorf("BeginCheckpoint = %v, want %v", err, tc.want)
			}
		})
	}
}

// TestCheckpointTriggers: the schema refuses a premature or repeated
// completion even from code that bypasses AddShard.
func TestCheckpointTriggers(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	cp, _ := db.BeginCheckpoint(ctx, id, 1, []string{"a", "b"})
	if _, err := db.AddShard(ctx, cp.ID, "a", sha("a"), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := db.w.ExecContext(ctx, "UPDATE checkpoints SET state = 'complete', completed_at = 'x' WHERE id = ?", cp.ID); err == nil {
		t.Errorf("completing with a shard missing succeeded; want the trigger to refuse")
	}
	if _, err := db.w.ExecContext(ctx, "UPDATE checkpoint_shards SET bytes = 2 WHERE checkpoint_id = ? AND name = 'a'", cp.ID); err == nil {
		t.Errorf("changing a landed shard succeeded; want the trigger to refuse")
	}
	if _, err := db.AddShard(ctx, cp.ID, "b", sha("b"), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := db.w.ExecContext(ctx, "UPDATE checkpoints SET step = 99 WHERE id = ?", cp.ID); err == nil {
		t.Errorf("changing a complete checkpoint succeeded; want the trigger to refuse")
	}
	if _, err := db.w.ExecContext(ctx, "INSERT INTO checkpoint_shards (checkpoint_id, name) VALUES (?, 'c')", cp.ID); err == nil {
		t.Errorf("adding a shard name to a complete checkpoint succeeded; want the trigger to refuse")
	}
}

// TestAddShardRaceCompletesOnce races uploads of every shard of a checkpoint,
// each shard twice (a retry), through two DB handles on one file (two
// coordinator processes, as far as SQLite can tell): exactly one call may
// report the completion.
func TestAddShardRaceCompletesOnce(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	db2, err := Open(ctx, db.Path(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db2.Close()
	id := newJob(t, db)

	const rounds, shards = 6, 6
	for round := range rounds {
		var names []string
		for i := range shards {
			names = append(names, fmt.Sprintf("stage%d", i))
		}
		cp, err := db.BeginCheckpoint(ctx, id, int64(round), names)
		if err != nil {
			t.Fatal(err)
		}
		var completions atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, name := range names {
			for _, h := range []*DB{db, db2} {
				wg.Go(func() {
					<-start
					done, err := h.AddShard(ctx, cp.ID, name, sha(name), int64(i))
					if err != nil {
						t.Errorf("AddShard(%s): %v", name, err)
					}
					if done {
						completions.Add(1)
					}
				})
			}
		}
		close(start)
		wg.Wait()
		if n := completions.Load(); n != 1 {
			t.Errorf("round %d: %d calls reported completion, want exactly 1", round, n)
		}
		if got, _ := db.Checkpoint(ctx, cp.ID); got.State != CheckpointComplete {
			t.Errorf("round %d: checkpoint %s after all shards", round, got.State)
		}
	}
}

func TestLatestListDeletePrune(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	other := newJob(t, db)

	complete := func(job uuid.UUID, step int64) int64 {
		t.Helper()
		cp, err := db.BeginCheckpoint(ctx, job, step, []string{"s"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.AddShard(ctx, cp.ID, "s", sha(fmt.Sprint(job, step)), step); err != nil {
			t.Fatal(err)
		}
		return cp.ID
	}
	pending := func(job uuid.UUID, step int64) int64 {
		t.Helper()
		cp, err := db.BeginCheckpoint(ctx, job, step, []string{"s", "t"})
		if err != nil {
			t.Fatal(err)
		}
		return cp.ID
	}
	c10 := complete(id, 10)
	p15 := pending(id, 15)
	c20 := complete(id, 20)
	c30 := complete(id, 30)
	p30 := pending(id, 30)
	p40 := pending(id, 40) // newer than every complete one, still uploading
	complete(other, 50)

	latest, err := db.LatestCheckpoint(ctx, id)
	if err != nil || latest.ID != c30 {
		t.Errorf("LatestCheckpoint = %d, %v; want %d (pending %d is newer but incomplete)", latest.ID, err, c30, p40)
	}
	list, _ := db.ListCheckpoints(ctx, id)
	var got []int64
	for _, c := range list {
		got = append(got, c.ID)
	}
	if !slices.Equal(got, []int64{c10, p15, c20, c30, p30, p40}) {
		t.Errorf("ListCheckpoints = %v", got)
	}
	if len(list[1].Shards) != 2 || list[1].Shards[0].Landed() {
		t.Errorf("pending checkpoint's shards = %+v", list[1].Shards)
	}

	pruned, err := db.PruneCheckpoints(ctx, id, 2)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(pruned, []int64{c10, p15, p30}) {
		t.Errorf("PruneCheckpoints(keep 2) deleted %v, want %v", pruned, []int64{c10, p15, p30})
	}
	list, _ = db.ListCheckpoints(ctx, id)
	if len(list) != 3 {
		t.Errorf("%d checkpoints after pruning, want 3 (c20, c30, p40)", len(list))
	}
	if pruned, _ := db.PruneCheckpoints(ctx, id, 0); !slices.Equal(pruned, []int64{c20}) {
		t.Errorf("PruneCheckpoints(keep 0) deleted %v, want only %d: the newest complete always stays", pruned, c20)
	}

	refs, err := db.ReferencedBlobs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(refs) != 2 || !refs[sha(fmt.Sprint(id, 30))] || refs[sha(fmt.Sprint(id, 10))] {
		t.Errorf("ReferencedBlobs = %v", refs)
	}

	if err := db.DeleteCheckpoint(ctx, c30); err != nil {
		t.Fatal(err)
	}
	if err := db.DeleteCheckpoint(ctx, c30); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete = %v, want ErrNotFound", err)
	}
	if _, err := db.LatestCheckpoint(ctx, id); !errors.Is(err, ErrNotFound) {
		t.Errorf("LatestCheckpoint after deleting all complete = %v, want ErrNotFound", err)
	}
	// Ids are never reused, not even the highest one: a late upload for a
	// deleted checkpoint must fail rather than land in its successor.
	gone, _ := db.BeginCheckpoint(ctx, id, 60, []string{"s"})
	if err := db.DeleteCheckpoint(ctx, gone.ID); err != nil {
		t.Fatal(err)
	}
	again, _ := db.BeginCheckpoint(ctx, id, 60, []string{"s"})
	if again.ID == gone.ID {
		t.Errorf("checkpoint id %d reused after deletion", gone.ID)
	}
	if _, err := db.AddShard(ctx, gone.ID, "s", sha("late"), 1); !errors.Is(err, ErrNotFound) {
		t.Errorf("late upload to deleted checkpoint = %v, want ErrNotFound", err)
	}
}

// TestDiscardCheckpointsAfter: a rollback to step 20 discards the later
// checkpoints, complete and pending. They are never restored from again, take
// no uploads, survive retention and deletion, and keep their blobs.
func TestDiscardCheckpointsAfter(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	id, other := newJob(t, db), newJob(t, db)
	complete := func(job uuid.UUID, step int64) int64 {
		t.Helper()
		cp, err := db.BeginCheckpoint(ctx, job, step, []string{"s"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.AddShard(ctx, cp.ID, "s", sha(fmt.Sprint(job, step)), step); err != nil {
			t.Fatal(err)
		}
		return cp.ID
	}
	c10, c20, c30, c40 := complete(id, 10), complete(id, 20), complete(id, 30), complete(id, 40)
	p50, err := db.BeginCheckpoint(ctx, id, 50, []string{"s", "t"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.AddShard(ctx, p50.ID, "s", sha("p50.s"), 1); err != nil {
		t.Fatal(err)
	}
	o30 := complete(other, 30)

	if ck, err := db.LatestCheckpointAtMost(ctx, id, 29); err != nil || ck.ID != c20 {
		t.Errorf("LatestCheckpointAtMost(29) = %d, %v; want %d", ck.ID, err, c20)
	}
	if ck, err := db.LatestCheckpointAtMost(ctx, id, 20); err != nil || ck.ID != c20 {
		t.Errorf("LatestCheckpointAtMost(20) = %d, %v; want %d: a checkpoint at the step counts", ck.ID, err, c20)
	}
	if _, err := db.LatestCheckpointAtMost(ctx, id, 9); !errors.Is(err, ErrNotFound) {
		t.Errorf("LatestCheckpointAtMost(9) = %v, want ErrNotFound", err)
	}

	clock.Advance(time.Minute)
	n, err := db.DiscardCheckpointsAfter(ctx, id, 20)
	if err != nil || n != 3 {
		t.Fatalf("DiscardCheckpointsAfter(20) = %d, %v; want 3 (30, 40 and the pending 50)", n, err)
	}
	if n, err := db.DiscardCheckpointsAfter(ctx, id, 20); err != nil || n != 0 {
		t.Errorf("DiscardCheckpointsAfter(20) again = %d, %v; want 0", n, err)
	}
	if _, err := db.DiscardCheckpointsAfter(ctx, uuid.New(), 0); !errors.Is(err, ErrNotFound) {
		t.Errorf("DiscardCheckpointsAfter of an unknown job = %v, want ErrNotFound", err)
	}

	if ck, err := db.LatestCheckpoint(ctx, id); err != nil || ck.ID != c20 {
		t.Errorf("LatestCheckpoint = %d, %v; want %d: 30 and 40 are discarded", ck.ID, err, c20)
	}
	if ck, err := db.LatestCheckpointAtMost(ctx, id, 45); err != nil || ck.ID != c20 {
		t.Errorf("LatestCheckpointAtMost(45) = %d, %v; want %d", ck.ID, err, c20)
	}
	if ck, err := db.LatestCheckpoint(ctx, other); err != nil || ck.ID != o30 {
		t.Errorf("another job's LatestCheckpoint = %d, %v; want %d, untouched", ck.ID, err, o30)
	}
	got, err := db.Checkpoint(ctx, c30)
	if err != nil || got.State != CheckpointDiscarded || !got.DiscardedAt.Equal(clock.Now()) || got.CompletedAt.IsZero() || !got.Shards[0].Landed() {
		t.Errorf("Checkpoint(c30) = %+v, %v; want discarded now, completed before, its shard still there", got, err)
	}
	if got, _ := db.Checkpoint(ctx, c20); got.State != CheckpointComplete || !got.DiscardedAt.IsZero() {
		t.Errorf("Checkpoint(c20) = %+v; want complete, not discarded", got)
	}

	// The pending one never completes: its last upload is refused as if it
	// had been deleted, and the schema refuses the completion itself.
	if done, err := db.AddShard(ctx, p50.ID, "t", sha("p50.t"), 1); !errors.Is(err, ErrNotFound) || done {
		t.Errorf("AddShard to a discarded checkpoint = %v, %v; want false, ErrNotFound", done, err)
	}
	err = db.Tx(ctx, func(tx *Tx) error {
		if _, err := tx.tx.ExecContext(ctx, "UPDATE checkpoint_shards SET sha256 = ?, bytes = 1, added_at = 'x' WHERE checkpoint_id = ? AND name = 't'", sha("t"), p50.ID); err != nil {
			return err
		}
		_, err := tx.tx.ExecContext(ctx, "UPDATE checkpoints SET state = 'complete', completed_at = 'x' WHERE id = ?", p50.ID)
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "a discarded checkpoint cannot complete") {
		t.Errorf("completing a discarded checkpoint behind AddShard's back = %v, want the schema's refusal", err)
	}
	if _, err := db.w.ExecContext(ctx, "UPDATE checkpoints SET discarded_at = NULL WHERE id = ?", c30); err == nil ||
		!strings.Contains(err.Error(), "stays discarded") {
		t.Errorf("un-discarding a checkpoint = %v, want the schema's refusal", err)
	}
	if _, err := db.w.ExecContext(ctx, "UPDATE checkpoints SET step = 31 WHERE id = ?", c30); err == nil ||
		!strings.Contains(err.Error(), "a complete checkpoint cannot change") {
		t.Errorf("changing a complete checkpoint = %v, want the schema's refusal", err)
	}

	// Retention neither counts them among the kept nor deletes them, and
	// nothing else may delete them either.
	pruned, err := db.PruneCheckpoints(ctx, id, 1)
	if err != nil || !slices.Equal(pruned, []int64{c10}) {
		t.Errorf("PruneCheckpoints(keep 1) = %v, %v; want only %d deleted: %d is the newest usable", pruned, err, c10, c20)
	}
	if err := db.DeleteCheckpoint(ctx, c40); !errors.Is(err, ErrInvalid) {
		t.Errorf("DeleteCheckpoint of a discarded checkpoint = %v, want ErrInvalid", err)
	}
	list, _ := db.ListCheckpoints(ctx, id)
	var ids []int64
	var states []CheckpointState
	for _, c := range list {
		ids, states = append(ids, c.ID), append(states, c.State)
	}
	if !slices.Equal(ids, []int64{c20, c30, c40, p50.ID}) ||
		!slices.Equal(states, []CheckpointState{CheckpointComplete, CheckpointDiscarded, CheckpointDiscarded, CheckpointDiscarded}) {
		t.Errorf("ListCheckpoints = %v %v", ids, states)
	}
	refs, err := db.ReferencedBlobs(ctx)
	if err != nil || !refs[sha(fmt.Sprint(id, 30))] || !refs[sha(fmt.Sprint(id, 40))] || !refs[sha("p50.s")] {
		t.Errorf("ReferencedBlobs = %v, %v; want the discarded checkpoints' blobs kept", refs, err)
	}

	// The replay takes new checkpoints at the same steps; they are the ones
	// restored from.
	n30 := complete(id, 30)
	if ck, err := db.LatestCheckpoint(ctx, id); err != nil || ck.ID != n30 {
		t.Errorf("LatestCheckpoint after the replay = %d, %v; want %d", ck.ID, err, n30)
	}
}
