package storage

import (
	"context"
	"fmt"
	"math"

	"github.com/google/uuid"
)

// RouterStat is how many tokens one expert of one MoE block received in one
// step (summed over micro-batches and over the expert's replicas).
type RouterStat struct {
	Step   int64
	Block  int // the block's index among all blocks
	Expert int
	Tokens int64
}

// RecordRouterStats stores router statistics for a job. For every step that
// appears in stats, the rows already stored for that step are replaced
// whole, with the same last-write-wins reasoning as RecordStep: a replayed
// step's routing is the one the job's parameters descend from.
func (tx *Tx) RecordRouterStats(ctx context.Context, jobID uuid.UUID, stats []RouterStat) error {
	for _, s := range stats {
		if s.Step < 0 || s.Block < 0 || s.Expert < 0 || s.Tokens < 0 {
			return fmt.Errorf("record router stats of job %s: negative field in %+v: %w", jobID, s, ErrInvalid)
		}
	}
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return fmt.Errorf("record router stats: %w", err)
	}
	cleared := make(map[int64]bool)
	for _, s := range stats {
		if !cleared[s.Step] {
			cleared[s.Step] = true
			if _, err := tx.tx.ExecContext(ctx, "DELETE FROM router_stats WHERE job_id = ? AND step = ?",
				jobID.String(), s.Step); err != nil {
				return fmt.Errorf("record router stats of job %s step %d: %w", jobID, s.Step, err)
			}
		}
	}
	for _, s := range stats {
		// Upsert, not insert: a caller that reports one expert twice in a
		// batch gets the last value rather than a constraint error.
		if _, err := tx.tx.ExecContext(ctx,
			`INSERT INTO router_stats (job_id, step, block, expert, tokens) VALUES (?, ?, ?, ?, ?)
			 ON CONFLICT (job_id, step, block, expert) DO UPDATE SET tokens = excluded.tokens`,
			jobID.String(), s.Step, s.Block, s.Expert, s.Tokens); err != nil {
			return fmt.Errorf("record router stats of job %s step %d: %w", jobID, s.Step, err)
		}
	}
	return nil
}

// RecordRouterStats is Tx.RecordRouterStats in a transaction of its own.
func (db *DB) RecordRouterStats(ctx context.Context, jobID uuid.UUID, stats []RouterStat) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.RecordRouterStats(ctx, jobID, stats) })
}

func listRouterStats(ctx context.Context, q querier, jobID uuid.UUID, from, to int64) ([]RouterStat, error) {
	if to < 0 {
		to = math.MaxInt64
	}
	rows, err := q.QueryContext(ctx,
		`SELECT step, block, expert, tokens FROM router_stats
		 WHERE job_id = ? AND step >= ? AND step < ? ORDER BY step, block, expert`,
		jobID.String(), from, to)
	if err != nil {
		return nil, fmt.Errorf("list router stats of job %s: %w", jobID, err)
	}
	defer rows.Close()
	var stats []RouterStat
	for rows.Next() {
		var s RouterStat
		if err := rows.Scan(&s.Step, &s.Block, &s.Expert, &s.Tokens); err != nil {
			return nil, fmt.Errorf("list router stats of job %s: %w", jobID, err)
		}
		stats = append(stats, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list router stats of job %s: %w", jobID, err)
	}
	return stats, nil
}

// ListRouterStats returns the job's router statistics for steps in
// [from, to), ordered by step, block, expert; a negative to means no bound.
func (tx *Tx) ListRouterStats(ctx context.Context, jobID uuid.UUID, from, to int64) ([]RouterStat, error) {
	return listRouterStats(ctx, tx.tx, jobID, from, to)
}

// ListRouterStats returns the job's router statistics for steps in
// [from, to), ordered by step, block, expert; a negative to means no bound.
func (db *DB) ListRouterStats(ctx context.Context, jobID uuid.UUID, from, to int64) ([]RouterStat, error) {
	return listRouterStats(ctx, db.r, jobID, from, to)
}
