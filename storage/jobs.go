package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
)

// JobState is where a job is in its lifecycle.
type JobState string

// The job states. done, failed and cancelled are terminal.
const (
	JobQueued    JobState = "queued"
	JobRunning   JobState = "running"
	JobPaused    JobState = "paused"
	JobDone      JobState = "done"
	JobFailed    JobState = "failed"
	JobCancelled JobState = "cancelled"
)

// Valid reports whether s is one of the job states.
func (s JobState) Valid() bool {
	switch s {
	case JobQueued, JobRunning, JobPaused, JobDone, JobFailed, JobCancelled:
		return true
	}
	return false
}

// Terminal reports whether a job in state s is finished for good.
func (s JobState) Terminal() bool {
	return s == JobDone || s == JobFailed || s == JobCancelled
}

// CanTransition reports whether a job may go from state s to state to. A job
// may stay where it is; it may never leave a terminal state, because its
// shards and checkpoints may already be gone and a restarted coordinator
// must not resume it. running may go back to queued, for a job that lost the
// peers it needs and waits for more.
func (s JobState) CanTransition(to JobState) bool {
	if !s.Valid() || !to.Valid() {
		return false
	}
	if s == to {
		return true
	}
	switch s {
	case JobQueued:
		return to == JobRunning || to == JobPaused || to == JobCancelled || to == JobFailed
	case JobRunning:
		return true // paused, finished, or back to queued
	case JobPaused:
		return to == JobRunning || to == JobQueued || to == JobCancelled || to == JobFailed
	}
	return false
}

// Job is one training job.
type Job struct {
	ID uuid.UUID
	// Spec is the job spec as submitted, every field written out (see
	// docs/design.md, "Jobs"); storage checks only that it is a JSON object.
	Spec  json.RawMessage
	State JobState
	// Step is the number of steps completed, which is also the index of the
	// next step to run. RecordStep advances it; SetJobStep moves it back when
	// the job rewinds to a checkpoint.
	Step int64
	// Reason says why the job is in its state (the failure, who cancelled
	// it); empty if there is nothing to say.
	Reason string
	// JoinToken, when set, makes the job private: only workers that present
	// it may take part (SetJoinToken).
	JoinToken string
	CreatedAt time.Time
	UpdatedAt time.Time
}

const jobColumns = "id, spec, state, step, reason, created_at, updated_at, join_token"

func scanJob(row interface{ Scan(...any) error }) (Job, error) {
	var j Job
	var id, spec, state, created, updated string
	if err := row.Scan(&id, &spec, &state, &j.Step, &j.Reason, &created, &updated, &j.JoinToken); err != nil {
		return Job{}, err
	}
	var err error
	if j.ID, err = uuid.Parse(id); err != nil {
		return Job{}, fmt.Errorf("stored job id %q: %w", id, err)
	}
	j.Spec = json.RawMessage(spec)
	j.State = JobState(state)
	if j.CreatedAt, err = parseTime(created); err != nil {
		return Job{}, err
	}
	if j.UpdatedAt, err = parseTime(updated); err != nil {
		return Job{}, err
	}
	return j, nil
}

// CreateJob stores a new job in state queued at step 0 under a fresh id.
// The id is a UUIDv7, so ids sort by creation time.
func (tx *Tx) CreateJob(ctx context.Context, spec json.RawMessage) (Job, error) {
	return tx.createJob(ctx, spec, "")
}

// createJob is CreateJob of a job with join token token ("" for a public job).
func (tx *Tx) createJob(ctx context.Context, spec json.RawMessage, token string) (Job, error) {
	s, err := jsonObject("job spec", spec)
	if err != nil {
		return Job{}, fmt.Errorf("create job: %w", err)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Job{}, fmt.Errorf("create job: new id: %w", err)
	}
	now := formatTime(tx.now)
	_, err = tx.tx.ExecContext(ctx,
		`INSERT INTO jobs (id, spec, state, step, reason, created_at, updated_at, join_token)
		 VALUES (?, ?, ?, 0, '', ?, ?, ?)`,
		id.String(), s, JobQueued, now, now, token)
	if err != nil {
		return Job{}, fmt.Errorf("create job: %w", err)
	}
	return getJob(ctx, tx.tx, id)
}

// CreateJob is Tx.CreateJob in a transaction of its own.
func (db *DB) CreateJob(ctx context.Context, spec json.RawMessage) (Job, error) {
	return db.CreateJobWithToken(ctx, spec, "")
}

// CreateJobWithToken is CreateJob of a job that is private from its first row when token is
// not empty (SetJoinToken): its row is written with the token, so that a coordinator that picks
// up queued jobs never reads the job without it. Created and then made private in two, a private job taken
// up in between ran as a public one — shown to anyone, joined by anyone.
func (db *DB) CreateJobWithToken(ctx context.Context, spec json.RawMessage, token string) (Job, error) {
	return inTx(ctx, db, func(tx *Tx) (Job, error) { return tx.createJob(ctx, spec, token) })
}

func getJob(ctx context.Context, q querier, id uuid.UUID) (Job, error) {
	j, err := scanJob(q.QueryRowContext(ctx, "SELECT "+jobColumns+" FROM jobs WHERE id = ?", id.String()))
	if errors.Is(err, sql.ErrNoRows) {
		return Job{}, fmt.Errorf("job %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Job{}, fmt.Errorf("get job %s: %w", id, err)
	}
	return j, nil
}

// Job returns the job with the given id, or ErrNotFound.
func (tx *Tx) Job(ctx context.Context, id uuid.UUID) (Job, error) { return getJob(ctx, tx.tx, id) }

// Job returns the job with the given id, or ErrNotFound.
func (db *DB) Job(ctx context.Context, id uuid.UUID) (Job, error) { return getJob(ctx, db.r, id) }

func listJobs(ctx context.Context, q querier, states []JobState) ([]Job, error) {
	query := "SELECT " + jobColumns + " FROM jobs"
	var args []any
	if len(states) > 0 {
		for _, s := range states {
			if !s.Valid() {
				return nil, fmt.Errorf("list jobs: unknown state %q: %w", s, ErrInvalid)
			}
			args = append(args, string(s))
		}
		query += " WHERE state IN (?" + strings.Repeat(", ?", len(states)-1) + ")"
	}
	query += " ORDER BY created_at, id"
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	defer rows.Close()
	var jobs []Job
	for rows.Next() {
		j, err := scanJob(rows)
		if err != nil {
			return nil, fmt.Errorf("list jobs: %w", err)
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list jobs: %w", err)
	}
	return jobs, nil
}

// ListJobs returns the jobs in any of the given states (all jobs if none
// are given), oldest first.
func (tx *Tx) ListJobs(ctx context.Context, states ...JobState) ([]Job, error) {
	return listJobs(ctx, tx.tx, states)
}

// ListJobs returns the jobs in any of the given states (all jobs if none
// are given), oldest first.
func (db *DB) ListJobs(ctx context.Context, states ...JobState) ([]Job, error) {
	return listJobs(ctx, db.r, states)
}

// SetJobState moves a job to state with the given reason and returns the
// job as stored. A transition that JobState.CanTransition forbids fails with
// ErrInvalidTransition and changes nothing. Setting the state a job already
// has only replaces the reason.
func (tx *Tx) SetJobState(ctx context.Context, id uuid.UUID, state JobState, reason string) (Job, error) {
	if !state.Valid() {
		return Job{}, fmt.Errorf("set job %s state: unknown state %q: %w", id, state, ErrInvalid)
	}
	j, err := getJob(ctx, tx.tx, id)
	if err != nil {
		return Job{}, fmt.Errorf("set job state: %w", err)
	}
	if !j.State.CanTransition(state) {
		return Job{}, fmt.Errorf("set job %s state: %s -> %s: %w", id, j.State, state, ErrInvalidTransition)
	}
	_, err = tx.tx.ExecContext(ctx,
		"UPDATE jobs SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
		state, reason, formatTime(tx.now), id.String())
	if err != nil {
		return Job{}, fmt.Errorf("set job %s state: %w", id, err)
	}
	return getJob(ctx, tx.tx, id)
}

// SetJobState is Tx.SetJobState in a transaction of its own.
func (db *DB) SetJobState(ctx context.Context, id uuid.UUID, state JobState, reason string) (Job, error) {
	return inTx(ctx, db, func(tx *Tx) (Job, error) { return tx.SetJobState(ctx, id, state, reason) })
}

// SetJobStep sets the number of steps a job has completed. The coordinator
// calls it when it rewinds a job to a checkpoint's step after a failure;
// during normal progress RecordStep advances the step itself.
func (tx *Tx) SetJobStep(ctx context.Context, id uuid.UUID, step int64) error {
	if step < 0 {
		return fmt.Errorf("set job %s step to %d: %w", id, step, ErrInvalid)
	}
	res, err := tx.tx.ExecContext(ctx,
		"UPDATE jobs SET step = ?, updated_at = ? WHERE id = ?", step, formatTime(tx.now), id.String())
	if err != nil {
		return fmt.Errorf("set job %s step: %w", id, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("set job %s step: %w", id, err)
	} else if n == 0 {
		return fmt.Errorf("set job step: job %s: %w", id, ErrNotFound)
	}
	return nil
}

// SetJobStep is Tx.SetJobStep in a transaction of its own.
func (db *DB) SetJobStep(ctx context.Context, id uuid.UUID, step int64) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.SetJobStep(ctx, id, step) })
}

// jobExists returns ErrNotFound (wrapped) unless the job exists; writers call
// it first so that a bad id is an ErrNotFound and not a foreign key failure.
func jobExists(ctx context.Context, q querier, id uuid.UUID) error {
	var one int
	err := q.QueryRowContext(ctx, "SELECT 1 FROM jobs WHERE id = ?", id.String()).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("job %s: %w", id, ErrNotFound)
	}
	return err
}

// SetJoinToken makes a job private (token non-empty) or public (token empty).
func (db *DB) SetJoinToken(ctx context.Context, id uuid.UUID, token string) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.SetJoinToken(ctx, id, token) })
}

// SetJoinToken is DB.SetJoinToken within tx.
func (tx *Tx) SetJoinToken(ctx context.Context, id uuid.UUID, token string) error {
	res, err := tx.tx.ExecContext(ctx, "UPDATE jobs SET join_token = ?, updated_at = ? WHERE id = ?", token, formatTime(tx.now), id.String())
	if err != nil {
		return fmt.Errorf("set job %s join token: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("set join token: job %s: %w", id, ErrNotFound)
	}
	return nil
}
