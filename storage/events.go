package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Event is one line of a job's or the coordinator's history: a peer joined
// or was lost, a plan changed, a checkpoint completed, a job failed.
type Event struct {
	// ID is assigned by AppendEvent and only grows, so a reader can tail
	// the log by asking for the events after the last id it saw.
	ID int64
	// JobID is the job the event concerns; uuid.Nil for coordinator-wide
	// events.
	JobID uuid.UUID
	// Time is when it happened; zero means the transaction's time.
	Time time.Time
	// Kind names the event, e.g. "worker.lost", "checkpoint.complete";
	// the coordinator defines the vocabulary.
	Kind string
	// WorkerID is the worker concerned, or "" for none.
	WorkerID string
	// Message is the event's details as JSON; nil is stored as {}.
	Message json.RawMessage
}

// AppendEvent stores e and returns it with its ID and Time filled in.
func (tx *Tx) AppendEvent(ctx context.Context, e Event) (Event, error) {
	if e.Kind == "" {
		return Event{}, fmt.Errorf("append event: empty kind: %w", ErrInvalid)
	}
	msg, err := jsonDoc("event message", e.Message, "{}")
	if err != nil {
		return Event{}, fmt.Errorf("append %s event: %w", e.Kind, err)
	}
	var job, worker sql.NullString
	if e.JobID != uuid.Nil {
		if err := jobExists(ctx, tx.tx, e.JobID); err != nil {
			return Event{}, fmt.Errorf("append %s event: %w", e.Kind, err)
		}
		job = sql.NullString{String: e.JobID.String(), Valid: true}
	}
	if e.WorkerID != "" {
		worker = sql.NullString{String: e.WorkerID, Valid: true}
	}
	if e.Time.IsZero() {
		e.Time = tx.now
	}
	t := formatTime(e.Time)
	err = tx.tx.QueryRowContext(ctx,
		"INSERT INTO events (job_id, time, kind, worker_id, message) VALUES (?, ?, ?, ?, ?) RETURNING id",
		job, t, e.Kind, worker, msg).Scan(&e.ID)
	if err != nil {
		return Event{}, fmt.Errorf("append %s event: %w", e.Kind, err)
	}
	e.Time, _ = parseTime(t) // as stored: UTC, milliseconds
	e.Message = json.RawMessage(msg)
	return e, nil
}

// AppendEvent is Tx.AppendEvent in a transaction of its own.
func (db *DB) AppendEvent(ctx context.Context, e Event) (Event, error) {
	return inTx(ctx, db, func(tx *Tx) (Event, error) { return tx.AppendEvent(ctx, e) })
}

// EventFilter selects events for ListEvents. The zero value selects the
// oldest events of every job, up to DefaultEventLimit.
type EventFilter struct {
	// JobID keeps only the job's events; uuid.Nil keeps all.
	JobID uuid.UUID
	// WorkerID keeps only events about that worker; "" keeps all.
	WorkerID string
	// Kind keeps only events of that kind; "" keeps all.
	Kind string
	// AfterID keeps only events with a larger ID, for tailing.
	AfterID int64
	// Limit caps the number returned; zero or less means DefaultEventLimit.
	Limit int
	// Newest returns the newest Limit events instead of the oldest (still in
	// ID order), for a dashboard that shows the latest.
	Newest bool
}

// DefaultEventLimit is ListEvents' limit when the filter sets none, so that
// a forgotten limit cannot pull a long job's whole history into memory.
const DefaultEventLimit = 1000

func listEvents(ctx context.Context, q querier, f EventFilter) ([]Event, error) {
	var where []string
	var args []any
	if f.JobID != uuid.Nil {
		where, args = append(where, "job_id = ?"), append(args, f.JobID.String())
	}
	if f.WorkerID != "" {
		where, args = append(where, "worker_id = ?"), append(args, f.WorkerID)
	}
	if f.Kind != "" {
		where, args = append(where, "kind = ?"), append(args, f.Kind)
	}
	if f.AfterID > 0 {
		where, args = append(where, "id > ?"), append(args, f.AfterID)
	}
	if f.Limit <= 0 {
		f.Limit = DefaultEventLimit
	}
	query := "SELECT id, job_id, time, kind, worker_id, message FROM events"
	if len(where) > 0 {
		query += " WHERE " + strings.Join(where, " AND ")
	}
	order := "ASC"
	if f.Newest {
		order = "DESC"
	}
	query += " ORDER BY id " + order + " LIMIT ?"
	args = append(args, f.Limit)

	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("list events: %w", err)
	}
	defer rows.Close()
	var events []Event
	for rows.Next() {
		var e Event
		var job, worker sql.NullString
		var t, msg string
		if err := rows.Scan(&e.ID, &job, &t, &e.Kind, &worker, &msg); err != nil {
			return nil, fmt.Errorf("list events: %w", err)
		}
		if job.Valid {
			if e.JobID, err = uuid.Parse(job.String); err != nil {
				return nil, fmt.Errorf("list events: stored job id %q: %w", job.String, err)
			}
		}
		if e.Time, err = parseTime(t); err != nil {
			return nil, fmt.Errorf("list events: %w", err)
		}
		e.WorkerID = worker.String
		e.Message = json.RawMessage(msg)
		events = append(events, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list events: %w", err)
	}
	if f.Newest {
		for i, j := 0, len(events)-1; i < j; i, j = i+1, j-1 {
			events[i], events[j] = events[j], events[i]
		}
	}
	return events, nil
}

// ListEvents returns the events f selects, in ID (time) order.
func (tx *Tx) ListEvents(ctx context.Context, f EventFilter) ([]Event, error) {
	return listEvents(ctx, tx.tx, f)
}

// ListEvents returns the events f selects, in ID (time) order.
func (db *DB) ListEvents(ctx context.Context, f EventFilter) ([]Event, error) {
	return listEvents(ctx, db.r, f)
}
