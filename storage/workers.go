package storage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// WorkerKind says what runs a worker.
type WorkerKind string

// The worker kinds.
const (
	WorkerNative  WorkerKind = "native"  // the shoal worker daemon
	WorkerBrowser WorkerKind = "browser" // a browser tab running the wasm worker
)

// Valid reports whether k is one of the worker kinds.
func (k WorkerKind) Valid() bool { return k == WorkerNative || k == WorkerBrowser }

// WorkerState is what the coordinator last decided about a worker.
type WorkerState string

// The worker states.
const (
	WorkerIdle     WorkerState = "idle"     // connected, holds no shard (a standby)
	WorkerActive   WorkerState = "active"   // holds a shard of a running plan
	WorkerDraining WorkerState = "draining" // leaving on its own (SIGTERM, Stop pressed)
	WorkerGone     WorkerState = "gone"     // disconnected or declared lost
)

// Valid reports whether s is one of the worker states.
func (s WorkerState) Valid() bool {
	switch s {
	case WorkerIdle, WorkerActive, WorkerDraining, WorkerGone:
		return true
	}
	return false
}

// Worker is a peer that joined the coordinator, with what it reported about
// itself on joining.
type Worker struct {
	// ID is the worker's id as the coordinator knows it; a worker that
	// reconnects under the same id updates its row.
	ID      string
	Kind    WorkerKind
	Backend string  // compute backend, e.g. "avx512", "go", "webgpu"
	GFLOPS  float64 // measured on join, GFLOP/s of Backend
	// MemoryBytes is the memory the worker offers for shards.
	MemoryBytes int64
	State       WorkerState
	JoinedAt    time.Time // the latest join (hello), not the first
	LastSeenAt  time.Time
}

const workerColumns = "id, kind, backend, gflops, memory_bytes, state, joined_at, last_seen_at"

func scanWorker(row interface{ Scan(...any) error }) (Worker, error) {
	var w Worker
	var kind, state, joined, seen string
	if err := row.Scan(&w.ID, &kind, &w.Backend, &w.GFLOPS, &w.MemoryBytes, &state, &joined, &seen); err != nil {
		return Worker{}, err
	}
	w.Kind, w.State = WorkerKind(kind), WorkerState(state)
	var err error
	if w.JoinedAt, err = parseTime(joined); err != nil {
		return Worker{}, err
	}
	if w.LastSeenAt, err = parseTime(seen); err != nil {
		return Worker{}, err
	}
	return w, nil
}

// UpsertWorker records a worker's hello: a new id gets a row, a known id (a
// reconnect) has its kind, backend, benchmark figures and state replaced.
// Either way JoinedAt and LastSeenAt become now. An empty State means idle.
// It returns the worker as stored.
func (tx *Tx) UpsertWorker(ctx context.Context, w Worker) (Worker, error) {
	if w.State == "" {
		w.State = WorkerIdle
	}
	switch {
	case w.ID == "":
		return Worker{}, fmt.Errorf("upsert worker: empty id: %w", ErrInvalid)
	case !w.Kind.Valid():
		return Worker{}, fmt.Errorf("upsert worker %s: unknown kind %q: %w", w.ID, w.Kind, ErrInvalid)
	case !w.State.Valid():
		return Worker{}, fmt.Errorf("upsert worker %s: unknown state %q: %w", w.ID, w.State, ErrInvalid)
	case w.MemoryBytes < 0:
		return Worker{}, fmt.Errorf("upsert worker %s: memory %d: %w", w.ID, w.MemoryBytes, ErrInvalid)
	}
	if err := finite("gflops", w.GFLOPS); err != nil || w.GFLOPS < 0 {
		return Worker{}, fmt.Errorf("upsert worker %s: gflops %v: %w", w.ID, w.GFLOPS, ErrInvalid)
	}
	now := formatTime(tx.now)
	_, err := tx.tx.ExecContext(ctx,
		`INSERT INTO workers (`+workerColumns+`, took_part) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)
		 ON CONFLICT (id) DO UPDATE SET
		     kind = excluded.kind, backend = excluded.backend, gflops = excluded.gflops,
		     memory_bytes = excluded.memory_bytes, state = excluded.state,
		     joined_at = excluded.joined_at, last_seen_at = excluded.last_seen_at`,
		w.ID, w.Kind, w.Backend, w.GFLOPS, w.MemoryBytes, w.State, now, now)
	if err != nil {
		return Worker{}, fmt.Errorf("upsert worker %s: %w", w.ID, err)
	}
	return getWorker(ctx, tx.tx, w.ID)
}

// UpsertWorker is Tx.UpsertWorker in a transaction of its own.
func (db *DB) UpsertWorker(ctx context.Context, w Worker) (Worker, error) {
	return inTx(ctx, db, func(tx *Tx) (Worker, error) { return tx.UpsertWorker(ctx, w) })
}

// Heartbeat sets the LastSeenAt of the given workers to now. An id without
// a row fails the whole call with ErrNotFound. Heartbeats from many workers
// should be batched into one call: each write transaction costs an fsync
// (synchronous=FULL), and the coordinator need not persist every beat, only
// often enough that a restarted coordinator knows who was recently alive.
func (tx *Tx) Heartbeat(ctx context.Context, ids ...string) error {
	now := formatTime(tx.now)
	for _, id := range ids {
		res, err := tx.tx.ExecContext(ctx, "UPDATE workers SET last_seen_at = ? WHERE id = ?", now, id)
		if err != nil {
			return fmt.Errorf("heartbeat worker %s: %w", id, err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return fmt.Errorf("heartbeat worker %s: %w", id, err)
		} else if n == 0 {
			return fmt.Errorf("heartbeat: worker %s: %w", id, ErrNotFound)
		}
	}
	return nil
}

// Heartbeat is Tx.Heartbeat in a transaction of its own.
func (db *DB) Heartbeat(ctx context.Context, ids ...string) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.Heartbeat(ctx, ids...) })
}

// SetWorkerState changes a worker's state, leaving LastSeenAt alone: the
// coordinator marking a worker gone has not heard from it.
func (tx *Tx) SetWorkerState(ctx context.Context, id string, state WorkerState) error {
	if !state.Valid() {
		return fmt.Errorf("set worker %s state: unknown state %q: %w", id, state, ErrInvalid)
	}
	res, err := tx.tx.ExecContext(ctx, "UPDATE workers SET state = ? WHERE id = ?", state, id)
	if err != nil {
		return fmt.Errorf("set worker %s state: %w", id, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("set worker %s state: %w", id, err)
	} else if n == 0 {
		return fmt.Errorf("set worker state: worker %s: %w", id, ErrNotFound)
	}
	return nil
}

// SetWorkerState is Tx.SetWorkerState in a transaction of its own.
func (db *DB) SetWorkerState(ctx context.Context, id string, state WorkerState) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.SetWorkerState(ctx, id, state) })
}

func getWorker(ctx context.Context, q querier, id string) (Worker, error) {
	w, err := scanWorker(q.QueryRowContext(ctx, "SELECT "+workerColumns+" FROM workers WHERE id = ?", id))
	if errors.Is(err, sql.ErrNoRows) {
		return Worker{}, fmt.Errorf("worker %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Worker{}, fmt.Errorf("get worker %s: %w", id, err)
	}
	return w, nil
}

// Worker returns the worker with the given id, or ErrNotFound.
func (tx *Tx) Worker(ctx context.Context, id string) (Worker, error) {
	return getWorker(ctx, tx.tx, id)
}

// Worker returns the worker with the given id, or ErrNotFound.
func (db *DB) Worker(ctx context.Context, id string) (Worker, error) { return getWorker(ctx, db.r, id) }

func listWorkers(ctx context.Context, q querier, states []WorkerState) ([]Worker, error) {
	query := "SELECT " + workerColumns + " FROM workers"
	var args []any
	if len(states) > 0 {
		for _, s := range states {
			if !s.Valid() {
				return nil, fmt.Errorf("list workers: unknown state %q: %w", s, ErrInvalid)
			}
			args = append(args, string(s))
		}
		query += " WHERE state IN (?" + strings.Repeat(", ?", len(states)-1) + ")"
	}
	query += " ORDER BY joined_at, id"
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	defer rows.Close()
	var ws []Worker
	for rows.Next() {
		w, err := scanWorker(rows)
		if err != nil {
			return nil, fmt.Errorf("list workers: %w", err)
		}
		ws = append(ws, w)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	return ws, nil
}

// ListWorkers returns the workers in any of the given states (all if none
// are given), in the order they joined.
func (tx *Tx) ListWorkers(ctx context.Context, states ...WorkerState) ([]Worker, error) {
	return listWorkers(ctx, tx.tx, states)
}

// ListWorkers returns the workers in any of the given states (all if none
// are given), in the order they joined.
func (db *DB) ListWorkers(ctx context.Context, states ...WorkerState) ([]Worker, error) {
	return listWorkers(ctx, db.r, states)
}

// MarkTookPart records that the workers took part in a step: their rows never expire
// (PruneWorkers). Ids without a row are skipped.
func (tx *Tx) MarkTookPart(ctx context.Context, ids ...string) error {
	for _, id := range ids {
		if _, err := tx.tx.ExecContext(ctx, "UPDATE workers SET took_part = 1 WHERE id = ? AND took_part = 0", id); err != nil {
			return fmt.Errorf("mark worker %s: %w", id, err)
		}
	}
	return nil
}

// PruneWorkers deletes what a join left of the workers that never took part in a step and are
// gone since before: their worker rows, their events and their session credentials (so that a
// flood of joins that never worked leaves nothing that lasts), and the credentials, issued
// before, of ids that never got a worker row. It returns how many worker rows it deleted.
func (tx *Tx) PruneWorkers(ctx context.Context, before time.Time) (int64, error) {
	cut := formatTime(before)
	const unused = `SELECT id FROM workers INDEXED BY workers_unused WHERE took_part = 0 AND state = 'gone' AND last_seen_at < ?`
	for _, q := range []string{
		"DELETE FROM events WHERE worker_id IN (" + unused + ")",
		"DELETE FROM sessions WHERE worker_id IN (" + unused + ")",
	} {
		if _, err := tx.tx.ExecContext(ctx, q, cut); err != nil {
			return 0, fmt.Errorf("prune workers: %w", err)
		}
	}
	res, err := tx.tx.ExecContext(ctx, "DELETE FROM workers WHERE id IN ("+unused+")", cut)
	if err != nil {
		return 0, fmt.Errorf("prune workers: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("prune workers: %w", err)
	}
	if _, err := tx.tx.ExecContext(ctx,
		"DELETE FROM sessions WHERE issued_at < ? AND NOT EXISTS (SELECT 1 FROM workers WHERE id = sessions.worker_id)", cut); err != nil {
		return 0, fmt.Errorf("prune workers: %w", err)
	}
	return n, nil
}

// PruneWorkers is Tx.PruneWorkers in a transaction of its own.
func (db *DB) PruneWorkers(ctx context.Context, before time.Time) (int64, error) {
	return inTx(ctx, db, func(tx *Tx) (int64, error) { return tx.PruneWorkers(ctx, before) })
}
