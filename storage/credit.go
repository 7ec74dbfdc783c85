package storage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Credit for volunteered work follows BOINC's rule: only verified work earns
// credit (docs/design.md, "Verification and credit"). The coordinator records each worker's share of
// every step as pending work (RecordWork); an audit of the worker that passes
// at step s verifies its pending work up to s (VerifyWork); a worker caught
// cheating is banned (Ban) and all of its work in the job rejected
// (RejectWork); a worker that leaves an audit unanswered forfeits its pending
// work only (RejectPendingWork); and when the job rolls back to a checkpoint,
// the pending work after it is discarded (DiscardWork), since it is
// recomputed and the recomputation is what counts.

// WorkState is where a row of work stands.
type WorkState string

// The work states.
const (
	// WorkPending: recorded, not yet vouched for by an audit.
	WorkPending WorkState = "pending"
	// WorkVerified: an audit of the worker at or after its step passed. Only
	// verified work earns credit.
	WorkVerified WorkState = "verified"
	// WorkRejected: the worker was banned from the job, and earns nothing there;
	// or it left an audit unanswered, and earns nothing for what it had not
	// shown.
	WorkRejected WorkState = "rejected"
	// WorkDiscarded: the job rolled back past it before it was verified; the
	// step is recomputed and the recomputation's work is what counts.
	WorkDiscarded WorkState = "discarded"
)

// Work is one worker's share of one step.
type Work struct {
	Worker string
	// Identity is the fingerprint of the key the worker proved it holds (proto.Fingerprint): its
	// credit is kept under it, across the worker ids of the volunteer's restarts and tabs. ""
	// for a worker without one: its credit is kept under its worker id.
	Identity     string
	MicroBatches int64   // micro-batches its shard computed in the step
	FLOPs        float64 // floating-point operations they took
}

// RecordWork records each worker's share of the job's step, run under plan
// version planVersion, as pending work, in one transaction: one row per
// worker. The plan must have been saved (ErrNotFound otherwise); a worker
// named twice, an empty worker id, negative counts or non-finite FLOPs fail
// with ErrInvalid and record nothing.
//
// Recording the same (job, worker, step, plan version) again replaces a
// pending or discarded row: a retried report, or a step replayed under the
// same plan after a rollback, whose work is pending again. A verified or
// rejected row is settled and stays as it is: a replay neither takes back
// credit an audit granted nor restores credit a ban took away. The work of a
// worker banned from the job is recorded as rejected at once.
func (tx *Tx) RecordWork(ctx context.Context, jobID uuid.UUID, step, planVersion int64, work []Work) error {
	if step < 0 || planVersion < 1 {
		return fmt.Errorf("record work of step %d, plan %d of job %s: %w", step, planVersion, jobID, ErrInvalid)
	}
	seen := make(map[string]bool, len(work))
	for _, w := range work {
		switch {
		case w.Worker == "" || seen[w.Worker]:
			return fmt.Errorf("record work of step %d of job %s: worker %q empty or repeated: %w", step, jobID, w.Worker, ErrInvalid)
		case w.Identity != "" && !strings.HasPrefix(w.Identity, "id:"):
			return fmt.Errorf("record work of step %d of job %s: worker %s: identity %q is not a fingerprint: %w", step, jobID, w.Worker, w.Identity, ErrInvalid)
		case w.MicroBatches < 0 || w.FLOPs < 0 || math.IsNaN(w.FLOPs) || math.IsInf(w.FLOPs, 0):
			return fmt.Errorf("record work of step %d of job %s: worker %s: %d micro-batches, %v FLOPs: %w",
				step, jobID, w.Worker, w.MicroBatches, w.FLOPs, ErrInvalid)
		}
		seen[w.Worker] = true
	}
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return fmt.Errorf("record work of step %d: %w", step, err)
	}
	if _, err := getPlan(ctx, tx.tx, jobID, planVersion); err != nil {
		return fmt.Errorf("record work of step %d: %w", step, err)
	}
	// A banned worker's row is born rejected, and settled at once.
	ins, err := tx.tx.PrepareContext(ctx,
		`INSERT INTO work (job_id, worker_id, step, plan_version, micro_batches, flops, state, recorded_at, settled_at, identity)
		 SELECT ?1, ?2, ?3, ?4, ?5, ?6, iif(b.n > 0, 'rejected', 'pending'), ?7, iif(b.n > 0, ?7, NULL), ?8
		 FROM (SELECT (SELECT count(*) FROM bans WHERE job_id = ?1 AND worker_id = ?2) +
		              (SELECT count(*) FROM bans WHERE job_id = ?1 AND ?8 <> '' AND identity = ?8) AS n) AS b
		 WHERE true
		 ON CONFLICT (job_id, worker_id, step, plan_version) DO UPDATE SET
		     micro_batches = excluded.micro_batches, flops = excluded.flops, state = excluded.state,
		     recorded_at = excluded.recorded_at, settled_at = excluded.settled_at
		 WHERE work.state IN ('pending', 'discarded')`)
	if err != nil {
		return fmt.Errorf("record work of step %d of job %s: %w", step, jobID, err)
	}
	defer ins.Close()
	now := formatTime(tx.now)
	for _, w := range work {
		if _, err := ins.ExecContext(ctx, jobID.String(), w.Worker, step, planVersion, w.MicroBatches, w.FLOPs, now, w.Identity); err != nil {
			return fmt.Errorf("record work of %s at step %d of job %s: %w", w.Worker, step, jobID, err)
		}
	}
	return nil
}

// RecordWork is Tx.RecordWork in a transaction of its own.
func (db *DB) RecordWork(ctx context.Context, jobID uuid.UUID, step, planVersion int64, work []Work) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.RecordWork(ctx, jobID, step, planVersion, work) })
}

// VerifyWork marks the worker's pending work in the job at steps up to upTo
// verified and returns how many rows it changed: an audit of the worker's
// work at step upTo passed, and it vouches for the work since the worker's
// previous audit, because the state each step started from was the one the
// audited step's inputs were checked against. Rows already settled are left
// alone, so verifying again changes nothing.
func (tx *Tx) VerifyWork(ctx context.Context, jobID uuid.UUID, worker string, upTo int64) (int64, error) {
	// Without statistics SQLite prefers the primary key here, which walks every row of the
	// worker up to upTo, verified ones included: a long job's whole history at every audit. The
	// partial index holds only the pending rows.
	return tx.settle(ctx, "verify work of "+worker, jobID,
		`UPDATE work INDEXED BY work_pending_by_worker SET state = 'verified', settled_at = ?
		 WHERE job_id = ? AND worker_id = ? AND state = 'pending' AND step <= ?`,
		formatTime(tx.now), jobID.String(), worker, upTo)
}

// VerifyWork is Tx.VerifyWork in a transaction of its own.
func (db *DB) VerifyWork(ctx context.Context, jobID uuid.UUID, worker string, upTo int64) (int64, error) {
	return inTx(ctx, db, func(tx *Tx) (int64, error) { return tx.VerifyWork(ctx, jobID, worker, upTo) })
}

// RejectWork marks all of the worker's pending and verified work in the job
// rejected: a worker caught cheating earns nothing in that job, not even for
// the work that passed earlier audits, since it may have cheated selectively.
// Discarded rows stay discarded. Ban does this too.
func (tx *Tx) RejectWork(ctx context.Context, jobID uuid.UUID, worker string) error {
	_, err := tx.settle(ctx, "reject work of "+worker, jobID,
		`UPDATE work SET state = 'rejected', settled_at = ?
		 WHERE job_id = ? AND worker_id = ? AND state IN ('pending', 'verified')`,
		formatTime(tx.now), jobID.String(), worker)
	return err
}

// RejectWork is Tx.RejectWork in a transaction of its own.
func (db *DB) RejectWork(ctx context.Context, jobID uuid.UUID, worker string) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.RejectWork(ctx, jobID, worker) })
}

// RejectPendingWork marks the worker's pending work in the job rejected — the
// work no passed audit vouches for — and returns how many rows it changed and
// the earliest step among them (-1 when none): a worker that leaves an audit
// unanswered forfeits what it has not shown, and the job replays it from
// before that step. Verified work stays verified.
func (tx *Tx) RejectPendingWork(ctx context.Context, jobID uuid.UUID, worker string) (rows, first int64, err error) {
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return 0, -1, fmt.Errorf("reject pending work of %s: %w", worker, err)
	}
	var lo sql.NullInt64
	if err := tx.tx.QueryRowContext(ctx,
		`SELECT min(step) FROM work INDEXED BY work_pending_by_worker
		 WHERE job_id = ? AND worker_id = ? AND state = 'pending'`,
		jobID.String(), worker).Scan(&lo); err != nil {
		return 0, -1, fmt.Errorf("reject pending work of %s in job %s: %w", worker, jobID, err)
	}
	if !lo.Valid {
		return 0, -1, nil
	}
	n, err := tx.settle(ctx, "reject pending work of "+worker, jobID,
		`UPDATE work INDEXED BY work_pending_by_worker SET state = 'rejected', settled_at = ?
		 WHERE job_id = ? AND worker_id = ? AND state = 'pending'`,
		formatTime(tx.now), jobID.String(), worker)
	return n, lo.Int64, err
}

// RejectPendingWork is Tx.RejectPendingWork in a transaction of its own.
func (db *DB) RejectPendingWork(ctx context.Context, jobID uuid.UUID, worker string) (rows, first int64, err error) {
	err = db.Tx(ctx, func(tx *Tx) error {
		var err error
		rows, first, err = tx.RejectPendingWork(ctx, jobID, worker)
		return err
	})
	return rows, first, err
}

// DiscardWork marks every worker's pending work in the job at steps fromStep
// and later discarded: the job rolled back to its checkpoint at fromStep, and
// those steps are recomputed. Verified work stays verified: it was done and
// checked, and the rollback is no fault of its worker's.
func (tx *Tx) DiscardWork(ctx context.Context, jobID uuid.UUID, fromStep int64) error {
	_, err := tx.settle(ctx, fmt.Sprintf("discard work from step %d", fromStep), jobID,
		`UPDATE work SET state = 'discarded', settled_at = ?
		 WHERE job_id = ? AND state = 'pending' AND step >= ?`,
		formatTime(tx.now), jobID.String(), fromStep)
	return err
}

// DiscardWork is Tx.DiscardWork in a transaction of its own.
func (db *DB) DiscardWork(ctx context.Context, jobID uuid.UUID, fromStep int64) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.DiscardWork(ctx, jobID, fromStep) })
}

// settle runs an UPDATE of work rows of an existing job and returns how many
// rows it changed. (The credits triggers' changes are not counted: SQLite
// counts only the statement's own rows.)
func (tx *Tx) settle(ctx context.Context, what string, jobID uuid.UUID, query string, args ...any) (int64, error) {
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	res, err := tx.tx.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, fmt.Errorf("%s in job %s: %w", what, jobID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("%s in job %s: %w", what, jobID, err)
	}
	return n, nil
}

// Credit is a volunteer's work in a job, summed by state: an identity's, over
// all of its workers, or a worker's that had none. Discarded work is in none
// of the sums: it earns nothing and costs nothing.
type Credit struct {
	// Worker is the worker whose work was recorded last under the account.
	Worker string
	// Identity is the volunteer's fingerprint (Work.Identity); "" when the
	// account is Worker's alone.
	Identity             string
	VerifiedMicroBatches int64
	PendingMicroBatches  int64
	RejectedMicroBatches int64
	VerifiedFLOPs        float64 // the credit proper
	PendingFLOPs         float64
}

// creditColumns reads the running totals that the schema's triggers keep
// (migration 0004). The FLOPs are clamped at zero: a sum that went up and
// down by floats may end a rounding error below it.
const creditColumns = `account, worker_id, verified_mb, pending_mb, rejected_mb, max(verified_flops, 0.0), max(pending_flops, 0.0)`

// creditsFrom leaves out workers whose only work was discarded.
const creditsFrom = ` FROM credits WHERE job_id = ? AND verified_rows + pending_rows + rejected_rows > 0`

func scanCredit(row interface{ Scan(...any) error }) (Credit, error) {
	var c Credit
	var account string
	err := row.Scan(&account, &c.Worker, &c.VerifiedMicroBatches, &c.PendingMicroBatches, &c.RejectedMicroBatches,
		&c.VerifiedFLOPs, &c.PendingFLOPs)
	if strings.HasPrefix(account, "id:") {
		c.Identity = account
	}
	return c, err
}

func listCredits(ctx context.Context, q querier, jobID uuid.UUID, n int) ([]Credit, error) {
	if n <= 0 {
		n = -1 // SQLite's LIMIT -1: no limit
	}
	rows, err := q.QueryContext(ctx,
		"SELECT "+creditColumns+creditsFrom+" ORDER BY verified_flops DESC, account LIMIT ?", jobID.String(), n)
	if err != nil {
		return nil, fmt.Errorf("credits of job %s: %w", jobID, err)
	}
	defer rows.Close()
	var out []Credit
	for rows.Next() {
		c, err := scanCredit(rows)
		if err != nil {
			return nil, fmt.Errorf("credits of job %s: %w", jobID, err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("credits of job %s: %w", jobID, err)
	}
	return out, nil
}

// Credits returns every worker's credit in the job, the most verified FLOPs
// first, ties in worker id order. Workers whose only work was discarded are
// left out.
func (db *DB) Credits(ctx context.Context, jobID uuid.UUID) ([]Credit, error) {
	return listCredits(ctx, db.r, jobID, 0)
}

// TopCredits is Credits cut to its first n entries (all of them when n <= 0):
// a leaderboard. It reads n rows through an index however many workers the
// job had.
func (db *DB) TopCredits(ctx context.Context, jobID uuid.UUID, n int) ([]Credit, error) {
	return listCredits(ctx, db.r, jobID, n)
}

// WorkerCredit returns one volunteer's credit in the job, named by its
// identity or by a worker id (the account that worker's work was recorded
// under last), or ErrNotFound if it has none: what a contributor's page shows,
// wherever the volunteer stands on the leaderboard.
func (db *DB) WorkerCredit(ctx context.Context, jobID uuid.UUID, worker string) (Credit, error) {
	c, err := scanCredit(db.r.QueryRowContext(ctx,
		"SELECT "+creditColumns+creditsFrom+" AND (account = ?2 OR worker_id = ?2) ORDER BY account = ?2 DESC LIMIT 1", jobID.String(), worker))
	if errors.Is(err, sql.ErrNoRows) {
		return Credit{}, fmt.Errorf("credit of %s in job %s: %w", worker, jobID, ErrNotFound)
	}
	if err != nil {
		return Credit{}, fmt.Errorf("credit of %s in job %s: %w", worker, jobID, err)
	}
	return c, nil
}

// VolunteerTotal returns a volunteer's credit summed over every job, named
// by its identity (or, for a worker without one, its worker id): what its
// page shows as its total. Worker is who, Identity who when it is one.
func (db *DB) VolunteerTotal(ctx context.Context, who string) (Credit, error) {
	var c Credit
	err := db.r.QueryRowContext(ctx,
		`SELECT coalesce(sum(verified_mb), 0), coalesce(sum(pending_mb), 0), coalesce(sum(rejected_mb), 0),
		        max(coalesce(sum(verified_flops), 0.0), 0.0), max(coalesce(sum(pending_flops), 0.0), 0.0)
		 FROM credits INDEXED BY credits_account WHERE account = ?`, who).Scan(
		&c.VerifiedMicroBatches, &c.PendingMicroBatches, &c.RejectedMicroBatches, &c.VerifiedFLOPs, &c.PendingFLOPs)
	if err != nil {
		return Credit{}, fmt.Errorf("total credit of %s: %w", who, err)
	}
	c.Worker = who
	if strings.HasPrefix(who, "id:") {
		c.Identity = who
	}
	return c, nil
}

// Ban is a worker banned from a job.
type Ban struct {
	Worker string
	// Identity is the banned worker's identity (Work.Identity), banned from the
	// job with it: its other workers, and any it starts later, are refused.
	// "" when it had none.
	Identity string
	// Addr is the banned worker's address (an IPv4 address, an IPv6 /64),
	// refused for a while (BannedAddrs); "" when not known.
	Addr   string
	Reason string // what it was caught at, in the coordinator's words
	Step   int64  // the step whose audit or cross-check caught it
	At     time.Time
}

// Ban bans the worker from the job for reason, caught at step, and rejects
// all of its work there (RejectWork) in the same transaction, so that no
// crash leaves a banned worker with credit. Banning again keeps the first
// ban's reason, step and time.
func (tx *Tx) Ban(ctx context.Context, jobID uuid.UUID, worker, reason string, step int64) error {
	return tx.BanWorker(ctx, jobID, Ban{Worker: worker, Reason: reason, Step: step})
}

// BanWorker is Ban of b.Worker, which also bans b.Identity from the job —
// all of the identity's work there is rejected too — and records b.Addr for
// BannedAddrs. b.At is ignored: the ban is dated now.
func (tx *Tx) BanWorker(ctx context.Context, jobID uuid.UUID, b Ban) error {
	worker, reason, step := b.Worker, b.Reason, b.Step
	if worker == "" || step < 0 || b.Identity != "" && !strings.HasPrefix(b.Identity, "id:") {
		return fmt.Errorf("ban %q from job %s at step %d: %w", worker, jobID, step, ErrInvalid)
	}
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return fmt.Errorf("ban %s: %w", worker, err)
	}
	if _, err := tx.tx.ExecContext(ctx,
		`INSERT INTO bans (job_id, worker_id, reason, step, at, identity, addr) VALUES (?, ?, ?, ?, ?, ?, ?)
		 ON CONFLICT (job_id, worker_id) DO NOTHING`,
		jobID.String(), worker, reason, step, formatTime(tx.now), b.Identity, b.Addr); err != nil {
		return fmt.Errorf("ban %s from job %s: %w", worker, jobID, err)
	}
	if err := tx.RejectWork(ctx, jobID, worker); err != nil {
		return fmt.Errorf("ban %s: %w", worker, err)
	}
	if b.Identity != "" {
		if _, err := tx.settle(ctx, "reject work of "+b.Identity, jobID,
			`UPDATE work SET state = 'rejected', settled_at = ?
			 WHERE job_id = ? AND identity = ? AND state IN ('pending', 'verified')`,
			formatTime(tx.now), jobID.String(), b.Identity); err != nil {
			return fmt.Errorf("ban %s: %w", worker, err)
		}
	}
	return nil
}

// BanWorker is Tx.BanWorker in a transaction of its own.
func (db *DB) BanWorker(ctx context.Context, jobID uuid.UUID, b Ban) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.BanWorker(ctx, jobID, b) })
}

// BannedAddrs returns the addresses of the bans made at since or later, in
// any job, each with its newest ban's time: the addresses a coordinator
// refuses for a while after a ban.
func (db *DB) BannedAddrs(ctx context.Context, since time.Time) (map[string]time.Time, error) {
	rows, err := db.r.QueryContext(ctx,
		"SELECT addr, max(at) FROM bans WHERE addr <> '' AND at >= ? GROUP BY addr", formatTime(since))
	if err != nil {
		return nil, fmt.Errorf("banned addresses: %w", err)
	}
	defer rows.Close()
	out := map[string]time.Time{}
	for rows.Next() {
		var addr, at string
		if err := rows.Scan(&addr, &at); err != nil {
			return nil, fmt.Errorf("banned addresses: %w", err)
		}
		t, err := parseTime(at)
		if err != nil {
			return nil, fmt.Errorf("banned addresses: %w", err)
		}
		out[addr] = t
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("banned addresses: %w", err)
	}
	return out, nil
}

// Ban is Tx.Ban in a transaction of its own.
func (db *DB) Ban(ctx context.Context, jobID uuid.UUID, worker, reason string, step int64) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.Ban(ctx, jobID, worker, reason, step) })
}

func banned(ctx context.Context, q querier, jobID uuid.UUID, worker string) (bool, error) {
	var n int
	if err := q.QueryRowContext(ctx, "SELECT count(*) FROM bans WHERE job_id = ? AND worker_id = ?",
		jobID.String(), worker).Scan(&n); err != nil {
		return false, fmt.Errorf("ban of %s in job %s: %w", worker, jobID, err)
	}
	return n > 0, nil
}

// Banned reports whether the worker is banned from the job.
func (tx *Tx) Banned(ctx context.Context, jobID uuid.UUID, worker string) (bool, error) {
	return banned(ctx, tx.tx, jobID, worker)
}

// Banned reports whether the worker is banned from the job.
func (db *DB) Banned(ctx context.Context, jobID uuid.UUID, worker string) (bool, error) {
	return banned(ctx, db.r, jobID, worker)
}

const banColumns = "worker_id, reason, step, at, identity, addr"

func scanBan(row interface{ Scan(...any) error }) (Ban, error) {
	var b Ban
	var at string
	if err := row.Scan(&b.Worker, &b.Reason, &b.Step, &at, &b.Identity, &b.Addr); err != nil {
		return Ban{}, err
	}
	var err error
	b.At, err = parseTime(at)
	return b, err
}

func listBans(ctx context.Context, q querier, jobID uuid.UUID, n int) ([]Ban, error) {
	if n <= 0 {
		n = -1
	}
	// The newest n, read newest first through the index and returned oldest
	// first.
	rows, err := q.QueryContext(ctx,
		"SELECT "+banColumns+" FROM bans WHERE job_id = ? ORDER BY at DESC, worker_id DESC LIMIT ?",
		jobID.String(), n)
	if err != nil {
		return nil, fmt.Errorf("bans of job %s: %w", jobID, err)
	}
	defer rows.Close()
	var out []Ban
	for rows.Next() {
		b, err := scanBan(rows)
		if err != nil {
			return nil, fmt.Errorf("bans of job %s: %w", jobID, err)
		}
		out = append(out, b)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("bans of job %s: %w", jobID, err)
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, nil
}

// Bans returns the job's bans, oldest first (ties in worker id order).
func (db *DB) Bans(ctx context.Context, jobID uuid.UUID) ([]Ban, error) {
	return listBans(ctx, db.r, jobID, 0)
}

// RecentBans returns the job's newest n bans (all when n <= 0), oldest first.
func (db *DB) RecentBans(ctx context.Context, jobID uuid.UUID, n int) ([]Ban, error) {
	return listBans(ctx, db.r, jobID, n)
}

// WorkerBan returns the ban from the job of the worker, or of the identity,
// that worker names, or ErrNotFound if there is none.
func (db *DB) WorkerBan(ctx context.Context, jobID uuid.UUID, worker string) (Ban, error) {
	b, err := scanBan(db.r.QueryRowContext(ctx,
		"SELECT "+banColumns+" FROM bans WHERE job_id = ?1 AND (worker_id = ?2 OR identity = ?2 AND ?2 <> '') ORDER BY at LIMIT 1", jobID.String(), worker))
	if errors.Is(err, sql.ErrNoRows) {
		return Ban{}, fmt.Errorf("ban of %s in job %s: %w", worker, jobID, ErrNotFound)
	}
	if err != nil {
		return Ban{}, fmt.Errorf("ban of %s in job %s: %w", worker, jobID, err)
	}
	return b, nil
}
