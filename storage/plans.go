package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// Plan is one version of a job's placement: stage boundaries and expert
// hosts, as JSON that package sched defines and storage does not read.
type Plan struct {
	JobID uuid.UUID
	// Version numbers a job's plans 1, 2, 3...; frames and step records
	// name the version they were computed under.
	Version   int64
	Plan      json.RawMessage
	CreatedAt time.Time
}

const planColumns = "job_id, version, plan, created_at"

func scanPlan(row interface{ Scan(...any) error }) (Plan, error) {
	var p Plan
	var jobID, plan, created string
	if err := row.Scan(&jobID, &p.Version, &plan, &created); err != nil {
		return Plan{}, err
	}
	var err error
	if p.JobID, err = uuid.Parse(jobID); err != nil {
		return Plan{}, fmt.Errorf("stored job id %q: %w", jobID, err)
	}
	p.Plan = json.RawMessage(plan)
	if p.CreatedAt, err = parseTime(created); err != nil {
		return Plan{}, err
	}
	return p, nil
}

// SavePlan stores plan as the job's next version (1 for its first plan) and
// returns it with the version assigned. The version is chosen inside the
// write transaction, so two plans saved at once cannot get the same number.
// Save a plan before sending it to any peer: a frame or step record may then
// name its version at any time.
func (tx *Tx) SavePlan(ctx context.Context, jobID uuid.UUID, plan json.RawMessage) (Plan, error) {
	doc, err := jsonObject("plan", plan)
	if err != nil {
		return Plan{}, fmt.Errorf("save plan for job %s: %w", jobID, err)
	}
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return Plan{}, fmt.Errorf("save plan: %w", err)
	}
	var version int64
	err = tx.tx.QueryRowContext(ctx,
		`INSERT INTO plans (job_id, version, plan, created_at)
		 SELECT ?1, coalesce(max(version), 0) + 1, ?2, ?3 FROM plans WHERE job_id = ?1
		 RETURNING version`,
		jobID.String(), doc, formatTime(tx.now)).Scan(&version)
	if err != nil {
		return Plan{}, fmt.Errorf("save plan for job %s: %w", jobID, err)
	}
	return getPlan(ctx, tx.tx, jobID, version)
}

// SavePlan is Tx.SavePlan in a transaction of its own.
func (db *DB) SavePlan(ctx context.Context, jobID uuid.UUID, plan json.RawMessage) (Plan, error) {
	return inTx(ctx, db, func(tx *Tx) (Plan, error) { return tx.SavePlan(ctx, jobID, plan) })
}

func getPlan(ctx context.Context, q querier, jobID uuid.UUID, version int64) (Plan, error) {
	p, err := scanPlan(q.QueryRowContext(ctx,
		"SELECT "+planColumns+" FROM plans WHERE job_id = ? AND version = ?", jobID.String(), version))
	if errors.Is(err, sql.ErrNoRows) {
		return Plan{}, fmt.Errorf("plan %d of job %s: %w", version, jobID, ErrNotFound)
	}
	if err != nil {
		return Plan{}, fmt.Errorf("get plan %d of job %s: %w", version, jobID, err)
	}
	return p, nil
}

func latestPlan(ctx context.Context, q querier, jobID uuid.UUID) (Plan, error) {
	p, err := scanPlan(q.QueryRowContext(ctx,
		"SELECT "+planColumns+" FROM plans WHERE job_id = ? ORDER BY version DESC LIMIT 1", jobID.String()))
	if errors.Is(err, sql.ErrNoRows) {
		return Plan{}, fmt.Errorf("plan of job %s: %w", jobID, ErrNotFound)
	}
	if err != nil {
		return Plan{}, fmt.Errorf("get latest plan of job %s: %w", jobID, err)
	}
	return p, nil
}

// Plan returns the given version of a job's plan, or ErrNotFound.
func (tx *Tx) Plan(ctx context.Context, jobID uuid.UUID, version int64) (Plan, error) {
	return getPlan(ctx, tx.tx, jobID, version)
}

// Plan returns the given version of a job's plan, or ErrNotFound.
func (db *DB) Plan(ctx context.Context, jobID uuid.UUID, version int64) (Plan, error) {
	return getPlan(ctx, db.r, jobID, version)
}

// LatestPlan returns the job's newest plan, or ErrNotFound if it has none.
func (tx *Tx) LatestPlan(ctx context.Context, jobID uuid.UUID) (Plan, error) {
	return latestPlan(ctx, tx.tx, jobID)
}

// LatestPlan returns the job's newest plan, or ErrNotFound if it has none.
func (db *DB) LatestPlan(ctx context.Context, jobID uuid.UUID) (Plan, error) {
	return latestPlan(ctx, db.r, jobID)
}
