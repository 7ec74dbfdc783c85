package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"time"

	"github.com/google/uuid"
)

// Step is the record of one training step of a job.
type Step struct {
	JobID uuid.UUID
	Step  int64 // numbered from 0
	// PlanVersion is the plan the step ran under; it must have been saved.
	PlanVersion int64
	Loss        float64  // cross-entropy, mean over micro-batches
	Aux         float64  // load-balancing loss, mean over micro-batches
	ValLoss     *float64 // nil when the step computed no validation loss
	Tokens      int64    // tokens trained on in this step
	// Timings is per-stage timing as JSON, whatever shape the coordinator
	// reports; nil is stored as {}.
	Timings json.RawMessage
	// Attempts counts how many times the step was recorded: 1, plus one
	// for each replay after a recovery. Set by RecordStep.
	Attempts int
	// CreatedAt is when the step was first recorded, UpdatedAt when last.
	CreatedAt time.Time
	UpdatedAt time.Time
}

const stepColumns = "job_id, step, plan_version, loss, aux, val_loss, tokens, timings, attempts, created_at, updated_at"

func scanStep(row interface{ Scan(...any) error }) (Step, error) {
	var s Step
	var jobID, timings, created, updated string
	var val sql.NullFloat64
	if err := row.Scan(&jobID, &s.Step, &s.PlanVersion, &s.Loss, &s.Aux, &val, &s.Tokens, &timings,
		&s.Attempts, &created, &updated); err != nil {
		return Step{}, err
	}
	var err error
	if s.JobID, err = uuid.Parse(jobID); err != nil {
		return Step{}, fmt.Errorf("stored job id %q: %w", jobID, err)
	}
	if val.Valid {
		s.ValLoss = &val.Float64
	}
	s.Timings = json.RawMessage(timings)
	if s.CreatedAt, err = parseTime(created); err != nil {
		return Step{}, err
	}
	if s.UpdatedAt, err = parseTime(updated); err != nil {
		return Step{}, err
	}
	return s, nil
}

// RecordStep records a finished step and sets the job's Step to s.Step+1 in
// the same transaction, so the job's progress and its step rows never
// disagree. It returns the row as stored.
//
// Recording a step that already has a row overwrites it and increments
// Attempts: an upsert, last write wins. A step is recorded again only when it
// is replayed after the job rewound to a checkpoint, and the earlier run's
// parameters were discarded with that rewind; the replay is the run the
// job's parameters now descend from, so its losses and timings are the ones
// to keep. (On one backend the replay is bitwise identical anyway; across
// backends it differs within the stated tolerance.) Keeping the first write
// instead would show timings and a plan version that no longer describe the
// job, and rejecting the duplicate would make the coordinator's recovery path
// handle an error that is not one. CreatedAt keeps the first recording.
//
// Losses must be finite: a NaN or infinite loss fails with ErrInvalid, and
// the coordinator should record an event and fail or rewind the job instead.
func (tx *Tx) RecordStep(ctx context.Context, s Step) (Step, error) {
	if err := validStep(s); err != nil {
		return Step{}, fmt.Errorf("record step %d of job %s: %w", s.Step, s.JobID, err)
	}
	timings, err := jsonDoc("timings", s.Timings, "{}")
	if err != nil {
		return Step{}, fmt.Errorf("record step %d of job %s: %w", s.Step, s.JobID, err)
	}
	if err := jobExists(ctx, tx.tx, s.JobID); err != nil {
		return Step{}, fmt.Errorf("record step %d: %w", s.Step, err)
	}
	if _, err := getPlan(ctx, tx.tx, s.JobID, s.PlanVersion); err != nil {
		return Step{}, fmt.Errorf("record step %d: %w", s.Step, err)
	}
	var val sql.NullFloat64
	if s.ValLoss != nil {
		val = sql.NullFloat64{Float64: *s.ValLoss, Valid: true}
	}
	now := formatTime(tx.now)
	_, err = tx.tx.ExecContext(ctx,
		`INSERT INTO steps (`+stepColumns+`) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?)
		 ON CONFLICT (job_id, step) DO UPDATE SET
		     plan_version = excluded.plan_version, loss = excluded.loss, aux = excluded.aux,
		     val_loss = excluded.val_loss, tokens = excluded.tokens, timings = excluded.timings,
		     attempts = attempts + 1, updated_at = excluded.updated_at`,
		s.JobID.String(), s.Step, s.PlanVersion, s.Loss, s.Aux, val, s.Tokens, timings, now, now)
	if err != nil {
		return Step{}, fmt.Errorf("record step %d of job %s: %w", s.Step, s.JobID, err)
	}
	_, err = tx.tx.ExecContext(ctx, "UPDATE jobs SET step = ?, updated_at = ? WHERE id = ?",
		s.Step+1, now, s.JobID.String())
	if err != nil {
		return Step{}, fmt.Errorf("record step %d of job %s: advance job: %w", s.Step, s.JobID, err)
	}
	stored, err := scanStep(tx.tx.QueryRowContext(ctx,
		"SELECT "+stepColumns+" FROM steps WHERE job_id = ? AND step = ?", s.JobID.String(), s.Step))
	if err != nil {
		return Step{}, fmt.Errorf("record step %d of job %s: read back: %w", s.Step, s.JobID, err)
	}
	return stored, nil
}

// RecordStep is Tx.RecordStep in a transaction of its own.
func (db *DB) RecordStep(ctx context.Context, s Step) (Step, error) {
	return inTx(ctx, db, func(tx *Tx) (Step, error) { return tx.RecordStep(ctx, s) })
}

func validStep(s Step) error {
	switch {
	case s.Step < 0:
		return fmt.Errorf("negative step: %w", ErrInvalid)
	case s.PlanVersion < 1:
		return fmt.Errorf("plan version %d: %w", s.PlanVersion, ErrInvalid)
	case s.Tokens < 0:
		return fmt.Errorf("tokens %d: %w", s.Tokens, ErrInvalid)
	case s.Step == math.MaxInt64:
		return fmt.Errorf("step %d leaves no next step: %w", s.Step, ErrInvalid)
	}
	if err := finite("loss", s.Loss); err != nil {
		return err
	}
	if err := finite("aux", s.Aux); err != nil {
		return err
	}
	if s.ValLoss != nil {
		if err := finite("val_loss", *s.ValLoss); err != nil {
			return err
		}
	}
	return nil
}

func listSteps(ctx context.Context, q querier, jobID uuid.UUID, from, to int64) ([]Step, error) {
	if to < 0 {
		to = math.MaxInt64
	}
	rows, err := q.QueryContext(ctx,
		"SELECT "+stepColumns+" FROM steps WHERE job_id = ? AND step >= ? AND step < ? ORDER BY step",
		jobID.String(), from, to)
	if err != nil {
		return nil, fmt.Errorf("list steps of job %s: %w", jobID, err)
	}
	defer rows.Close()
	var steps []Step
	for rows.Next() {
		s, err := scanStep(rows)
		if err != nil {
			return nil, fmt.Errorf("list steps of job %s: %w", jobID, err)
		}
		steps = append(steps, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list steps of job %s: %w", jobID, err)
	}
	return steps, nil
}

// ListSteps returns the job's recorded steps in [from, to), in step order;
// a negative to means no upper bound. After a rewind, rows at or beyond the
// job's Step belong to the abandoned run until the replay overwrites them.
func (tx *Tx) ListSteps(ctx context.Context, jobID uuid.UUID, from, to int64) ([]Step, error) {
	return listSteps(ctx, tx.tx, jobID, from, to)
}

// ListSteps returns the job's recorded steps in [from, to), in step order;
// a negative to means no upper bound. After a rewind, rows at or beyond the
// job's Step belong to the abandoned run until the replay overwrites them.
func (db *DB) ListSteps(ctx context.Context, jobID uuid.UUID, from, to int64) ([]Step, error) {
	return listSteps(ctx, db.r, jobID, from, to)
}
