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

// CheckpointState says whether a checkpoint can be restored from.
type CheckpointState string

// The checkpoint states.
const (
	// CheckpointPending: begun, some shards not landed yet. Never restored
	// from; it may stay pending forever if a peer died mid-upload.
	CheckpointPending CheckpointState = "pending"
	// CheckpointComplete: every expected shard landed; usable.
	CheckpointComplete CheckpointState = "complete"
	// CheckpointDiscarded: the job rolled back past it (DiscardCheckpointsAfter)
	// because it holds the work of a worker caught cheating. Never restored
	// from, exported, pruned or deleted: the row and its blobs stay as the
	// record of what was thrown away. CompletedAt says whether it had
	// completed. The state is derived from the discarded_at column, so that
	// the stored state still says how far the checkpoint got; it is spelled
	// as a State of its own so that code that looks for complete checkpoints
	// (retention, export) passes it over without knowing of discards.
	CheckpointDiscarded CheckpointState = "discarded"
)

// Checkpoint is one consistent cut of a job: one safetensors blob per shard,
// all taken after the same step.
type Checkpoint struct {
	ID    int64
	JobID uuid.UUID
	// Step is the number of steps completed when it was taken, the same
	// number as the step in the shards' safetensors metadata.
	Step  int64
	State CheckpointState
	// Shards lists every expected shard in name order, landed or not.
	Shards      []Shard
	CreatedAt   time.Time
	CompletedAt time.Time // zero while pending, and if discarded while pending
	DiscardedAt time.Time // zero unless discarded
}

// Shard is one file of a checkpoint.
type Shard struct {
	Name   string // e.g. "stage0", "experts.b3.e1"; chosen by the coordinator
	SHA256 string // lowercase hex name of the blob; "" until the shard lands
	Bytes  int64
	// AddedAt is when the shard landed; zero until then.
	AddedAt time.Time
}

// Landed reports whether the shard's blob has been recorded.
func (s Shard) Landed() bool { return s.SHA256 != "" }

// BeginCheckpoint starts a pending checkpoint of the job at step, expecting
// one shard under each of the given names. The names are fixed here, so
// that completion is a count and not a guess about who else may upload.
func (tx *Tx) BeginCheckpoint(ctx context.Context, jobID uuid.UUID, step int64, shardNames []string) (Checkpoint, error) {
	if step < 0 {
		return Checkpoint{}, fmt.Errorf("begin checkpoint of job %s: step %d: %w", jobID, step, ErrInvalid)
	}
	if len(shardNames) == 0 {
		return Checkpoint{}, fmt.Errorf("begin checkpoint of job %s: no shards: %w", jobID, ErrInvalid)
	}
	seen := make(map[string]bool, len(shardNames))
	for _, n := range shardNames {
		if n == "" || seen[n] {
			return Checkpoint{}, fmt.Errorf("begin checkpoint of job %s: shard name %q empty or repeated: %w", jobID, n, ErrInvalid)
		}
		seen[n] = true
	}
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return Checkpoint{}, fmt.Errorf("begin checkpoint: %w", err)
	}
	now := formatTime(tx.now)
	var id int64
	err := tx.tx.QueryRowContext(ctx,
		`INSERT INTO checkpoints (job_id, step, state, shards_expected, created_at)
		 VALUES (?, ?, 'pending', ?, ?) RETURNING id`,
		jobID.String(), step, len(shardNames), now).Scan(&id)
	if err != nil {
		return Checkpoint{}, fmt.Errorf("begin checkpoint of job %s: %w", jobID, err)
	}
	for _, n := range shardNames {
		if _, err := tx.tx.ExecContext(ctx,
			"INSERT INTO checkpoint_shards (checkpoint_id, name) VALUES (?, ?)", id, n); err != nil {
			return Checkpoint{}, fmt.Errorf("begin checkpoint of job %s: shard %q: %w", jobID, n, err)
		}
	}
	return getCheckpoint(ctx, tx.tx, id)
}

// BeginCheckpoint is Tx.BeginCheckpoint in a transaction of its own.
func (db *DB) BeginCheckpoint(ctx context.Context, jobID uuid.UUID, step int64, shardNames []string) (Checkpoint, error) {
	return inTx(ctx, db, func(tx *Tx) (Checkpoint, error) { return tx.BeginCheckpoint(ctx, jobID, step, shardNames) })
}

// AddShard records that the named shard of a checkpoint landed as the blob
// sha256 of the given size, and, if it was the last shard missing, marks the
// checkpoint complete in the same transaction. completed is true only for
// the call that completed the checkpoint: of any number of concurrent
// uploads, exactly one sees true, so the coordinator can announce the
// checkpoint and apply retention once.
//
// Put the blob in the BlobStore, fsynced, before calling AddShard: once the
// checkpoint is complete it may be restored from at any time.
//
// Adding a shard that already landed with the same hash and size is a no-op
// (an upload retried after a lost reply) returning false; with a different
// hash it fails with ErrShardConflict. A name the checkpoint did not expect
// fails with ErrUnexpectedShard, an unknown or discarded checkpoint with
// ErrNotFound.
func (tx *Tx) AddShard(ctx context.Context, checkpointID int64, name, sha256 string, size int64) (completed bool, err error) {
	if !ValidSHA256(sha256) {
		return false, fmt.Errorf("add shard %q to checkpoint %d: hash %q is not 64 lowercase hex digits: %w", name, checkpointID, sha256, ErrInvalid)
	}
	if size < 0 {
		return false, fmt.Errorf("add shard %q to checkpoint %d: size %d: %w", name, checkpointID, size, ErrInvalid)
	}
	var discarded sql.NullString
	err = tx.tx.QueryRowContext(ctx, "SELECT discarded_at FROM checkpoints WHERE id = ?", checkpointID).Scan(&discarded)
	if errors.Is(err, sql.ErrNoRows) {
		return false, fmt.Errorf("add shard %q: checkpoint %d: %w", name, checkpointID, ErrNotFound)
	}
	if err != nil {
		return false, fmt.Errorf("add shard %q to checkpoint %d: %w", name, checkpointID, err)
	}
	if discarded.Valid {
		// To an uploader a discarded checkpoint is as gone as one that
		// retention deleted: the job rolled back past it.
		return false, fmt.Errorf("add shard %q: checkpoint %d was discarded: %w", name, checkpointID, ErrNotFound)
	}
	var have sql.NullString
	var haveSize sql.NullInt64
	err = tx.tx.QueryRowContext(ctx,
		"SELECT sha256, bytes FROM checkpoint_shards WHERE checkpoint_id = ? AND name = ?",
		checkpointID, name).Scan(&have, &haveSize)
	if errors.Is(err, sql.ErrNoRows) {
		return false, fmt.Errorf("add shard %q to checkpoint %d: %w", name, checkpointID, ErrUnexpectedShard)
	}
	if err != nil {
		return false, fmt.Errorf("add shard %q to checkpoint %d: %w", name, checkpointID, err)
	}
	if have.Valid {
		if have.String == sha256 && haveSize.Int64 == size {
			return false, nil
		}
		return false, fmt.Errorf("add shard %q to checkpoint %d: have %s (%d bytes), got %s (%d bytes): %w",
			name, checkpointID, have.String, haveSize.Int64, sha256, size, ErrShardConflict)
	}
	now := formatTime(tx.now)
	if _, err := tx.tx.ExecContext(ctx,
		`UPDATE checkpoint_shards SET sha256 = ?, bytes = ?, added_at = ?
		 WHERE checkpoint_id = ? AND name = ? AND sha256 IS NULL`,
		sha256, size, now, checkpointID, name); err != nil {
		return false, fmt.Errorf("add shard %q to checkpoint %d: %w", name, checkpointID, err)
	}
	var missing int
	if err := tx.tx.QueryRowContext(ctx,
		"SELECT count(*) FROM checkpoint_shards WHERE checkpoint_id = ? AND sha256 IS NULL",
		checkpointID).Scan(&missing); err != nil {
		return false, fmt.Errorf("add shard %q to checkpoint %d: count missing: %w", name, checkpointID, err)
	}
	if missing > 0 {
		return false, nil
	}
	// The state guard makes completion happen once even if this code were
	// ever reached twice; the schema's trigger independently refuses to
	// complete a checkpoint with a shard missing.
	res, err := tx.tx.ExecContext(ctx,
		"UPDATE checkpoints SET state = 'complete', completed_at = ? WHERE id = ? AND state = 'pending'",
		now, checkpointID)
	if err != nil {
		return false, fmt.Errorf("complete checkpoint %d: %w", checkpointID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("complete checkpoint %d: %w", checkpointID, err)
	}
	return n == 1, nil
}

// AddShard is Tx.AddShard in a transaction of its own. Concurrent calls are
// serialised by the single write connection, which is what makes exactly one
// of them see the checkpoint complete.
func (db *DB) AddShard(ctx context.Context, checkpointID int64, name, sha256 string, size int64) (completed bool, err error) {
	return inTx(ctx, db, func(tx *Tx) (bool, error) { return tx.AddShard(ctx, checkpointID, name, sha256, size) })
}

const checkpointColumns = "id, job_id, step, state, created_at, completed_at, discarded_at"

// readCheckpoints runs query (selecting checkpointColumns) and fills in each
// checkpoint's shards. Callers run it inside a transaction so that the
// checkpoints and their shards come from one snapshot.
func readCheckpoints(ctx context.Context, q querier, query string, args ...any) ([]Checkpoint, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	var cps []Checkpoint
	for rows.Next() {
		var c Checkpoint
		var jobID, state, created string
		var completed, discarded sql.NullString
		if err := rows.Scan(&c.ID, &jobID, &c.Step, &state, &created, &completed, &discarded); err != nil {
			rows.Close()
			return nil, err
		}
		if c.JobID, err = uuid.Parse(jobID); err != nil {
			rows.Close()
			return nil, fmt.Errorf("stored job id %q: %w", jobID, err)
		}
		c.State = CheckpointState(state)
		if c.CreatedAt, err = parseTime(created); err != nil {
			rows.Close()
			return nil, err
		}
		if c.CompletedAt, err = parseNullTime(completed); err != nil {
			rows.Close()
			return nil, err
		}
		if c.DiscardedAt, err = parseNullTime(discarded); err != nil {
			rows.Close()
			return nil, err
		}
		if discarded.Valid {
			c.State = CheckpointDiscarded
		}
		cps = append(cps, c)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, err
	}
	if len(cps) == 0 {
		return nil, nil
	}

	index := make(map[int64]int, len(cps))
	args = args[:0]
	for i, c := range cps {
		index[c.ID] = i
		args = append(args, c.ID)
	}
	rows, err = q.QueryContext(ctx,
		`SELECT checkpoint_id, name, sha256, bytes, added_at FROM checkpoint_shards
		 WHERE checkpoint_id IN (?`+strings.Repeat(", ?", len(cps)-1)+`) ORDER BY checkpoint_id, name`,
		args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var s Shard
		var sha, added sql.NullString
		var size sql.NullInt64
		if err := rows.Scan(&id, &s.Name, &sha, &size, &added); err != nil {
			return nil, err
		}
		s.SHA256, s.Bytes = sha.String, size.Int64
		if s.AddedAt, err = parseNullTime(added); err != nil {
			return nil, err
		}
		c := &cps[index[id]]
		c.Shards = append(c.Shards, s)
	}
	return cps, rows.Err()
}

func getCheckpoint(ctx context.Context, q querier, id int64) (Checkpoint, error) {
	cps, err := readCheckpoints(ctx, q, "SELECT "+checkpointColumns+" FROM checkpoints WHERE id = ?", id)
	if err != nil {
		return Checkpoint{}, fmt.Errorf("get checkpoint %d: %w", id, err)
	}
	if len(cps) == 0 {
		return Checkpoint{}, fmt.Errorf("checkpoint %d: %w", id, ErrNotFound)
	}
	return cps[0], nil
}

// Checkpoint returns the checkpoint with the given id, or ErrNotFound.
func (tx *Tx) Checkpoint(ctx context.Context, id int64) (Checkpoint, error) {
	return getCheckpoint(ctx, tx.tx, id)
}

// Checkpoint returns the checkpoint with the given id, or ErrNotFound.
func (db *DB) Checkpoint(ctx context.Context, id int64) (Checkpoint, error) {
	return inReadTx(ctx, db, func(q querier) (Checkpoint, error) { return getCheckpoint(ctx, q, id) })
}

// usableCheckpoint is the SQL condition of a checkpoint that may be restored from.
const usableCheckpoint = "state = 'complete' AND discarded_at IS NULL"

func latestCheckpoint(ctx context.Context, q querier, jobID uuid.UUID, atMost int64) (Checkpoint, error) {
	cps, err := readCheckpoints(ctx, q,
		"SELECT "+checkpointColumns+" FROM checkpoints WHERE job_id = ? AND "+usableCheckpoint+` AND step <= ?
		 ORDER BY step DESC, id DESC LIMIT 1`, jobID.String(), atMost)
	if err != nil {
		return Checkpoint{}, fmt.Errorf("latest checkpoint of job %s: %w", jobID, err)
	}
	if len(cps) == 0 {
		return Checkpoint{}, fmt.Errorf("complete checkpoint of job %s: %w", jobID, ErrNotFound)
	}
	return cps[0], nil
}

// LatestCheckpoint returns the job's newest complete checkpoint, the one a
// recovery restarts from, or ErrNotFound if it has none (the job then
// restarts from its initialisation at step 0). Pending and discarded
// checkpoints are never returned, however new.
func (tx *Tx) LatestCheckpoint(ctx context.Context, jobID uuid.UUID) (Checkpoint, error) {
	return latestCheckpoint(ctx, tx.tx, jobID, math.MaxInt64)
}

// LatestCheckpoint returns the job's newest complete checkpoint, the one a
// recovery restarts from, or ErrNotFound if it has none (the job then
// restarts from its initialisation at step 0). Pending and discarded
// checkpoints are never returned, however new.
func (db *DB) LatestCheckpoint(ctx context.Context, jobID uuid.UUID) (Checkpoint, error) {
	return inReadTx(ctx, db, func(q querier) (Checkpoint, error) { return latestCheckpoint(ctx, q, jobID, math.MaxInt64) })
}

// LatestCheckpointAtMost is LatestCheckpoint among the checkpoints taken at
// or before step: where a job rolls back to when the work of a worker that
// first took part in step is thrown away (a checkpoint at step was taken
// before that step ran).
func (tx *Tx) LatestCheckpointAtMost(ctx context.Context, jobID uuid.UUID, step int64) (Checkpoint, error) {
	return latestCheckpoint(ctx, tx.tx, jobID, step)
}

// LatestCheckpointAtMost is LatestCheckpoint among the checkpoints taken at
// or before step: where a job rolls back to when the work of a worker that
// first took part in step is thrown away (a checkpoint at step was taken
// before that step ran).
func (db *DB) LatestCheckpointAtMost(ctx context.Context, jobID uuid.UUID, step int64) (Checkpoint, error) {
	return inReadTx(ctx, db, func(q querier) (Checkpoint, error) { return latestCheckpoint(ctx, q, jobID, step) })
}

// DiscardCheckpointsAfter marks every checkpoint of the job taken after step
// (Step > step), complete or pending, as discarded, and returns how many it
// marked: the job rolls back to its checkpoint at step, and the later ones
// hold work that is thrown away. A discarded checkpoint is never returned by
// LatestCheckpoint, refuses uploads, and is left alone by PruneCheckpoints and
// DeleteCheckpoint; its rows and blobs stay (ReferencedBlobs still names
// them), as the record of what was thrown away. Discarding is final, and
// discarding again marks nothing new.
func (tx *Tx) DiscardCheckpointsAfter(ctx context.Context, jobID uuid.UUID, step int64) (int, error) {
	if err := jobExists(ctx, tx.tx, jobID); err != nil {
		return 0, fmt.Errorf("discard checkpoints after step %d: %w", step, err)
	}
	res, err := tx.tx.ExecContext(ctx,
		"UPDATE checkpoints SET discarded_at = ? WHERE job_id = ? AND step > ? AND discarded_at IS NULL",
		formatTime(tx.now), jobID.String(), step)
	if err != nil {
		return 0, fmt.Errorf("discard checkpoints of job %s after step %d: %w", jobID, step, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("discard checkpoints of job %s after step %d: %w", jobID, step, err)
	}
	return int(n), nil
}

// DiscardCheckpointsAfter is Tx.DiscardCheckpointsAfter in a transaction of
// its own.
func (db *DB) DiscardCheckpointsAfter(ctx context.Context, jobID uuid.UUID, step int64) (int, error) {
	return inTx(ctx, db, func(tx *Tx) (int, error) { return tx.DiscardCheckpointsAfter(ctx, jobID, step) })
}

func listCheckpoints(ctx context.Context, q querier, jobID uuid.UUID) ([]Checkpoint, error) {
	cps, err := readCheckpoints(ctx, q,
		"SELECT "+checkpointColumns+" FROM checkpoints WHERE job_id = ? ORDER BY step, id", jobID.String())
	if err != nil {
		return nil, fmt.Errorf("list checkpoints of job %s: %w", jobID, err)
	}
	return cps, nil
}

// ListCheckpoints returns all of the job's checkpoints, pending, complete and
// discarded, oldest step first.
func (tx *Tx) ListCheckpoints(ctx context.Context, jobID uuid.UUID) ([]Checkpoint, error) {
	return listCheckpoints(ctx, tx.tx, jobID)
}

// ListCheckpoints returns all of the job's checkpoints, pending, complete and
// discarded, oldest step first.
func (db *DB) ListCheckpoints(ctx context.Context, jobID uuid.UUID) ([]Checkpoint, error) {
	return inReadTx(ctx, db, func(q querier) ([]Checkpoint, error) { return listCheckpoints(ctx, q, jobID) })
}

// DeleteCheckpoint deletes a checkpoint and its shard rows. The blobs stay
// until CollectGarbage finds them unreferenced, since another checkpoint may
// share a blob.
//
// A discarded checkpoint is refused with ErrInvalid and stays: it is the
// record of work thrown away after a ban, and code that clears out
// checkpoints that are not complete (older pending ones) must not take it
// along. It goes only with its job.
func (tx *Tx) DeleteCheckpoint(ctx context.Context, id int64) error {
	var discarded sql.NullString
	err := tx.tx.QueryRowContext(ctx, "SELECT discarded_at FROM checkpoints WHERE id = ?", id).Scan(&discarded)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("delete checkpoint %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("delete checkpoint %d: %w", id, err)
	}
	if discarded.Valid {
		return fmt.Errorf("delete checkpoint %d: it was discarded, and is kept as the record of a rollback: %w", id, ErrInvalid)
	}
	if _, err := tx.tx.ExecContext(ctx, "DELETE FROM checkpoints WHERE id = ?", id); err != nil {
		return fmt.Errorf("delete checkpoint %d: %w", id, err)
	}
	return nil
}

// DeleteCheckpoint is Tx.DeleteCheckpoint in a transaction of its own.
func (db *DB) DeleteCheckpoint(ctx context.Context, id int64) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.DeleteCheckpoint(ctx, id) })
}

// PruneCheckpoints applies retention to a job: it keeps the newest keep
// complete checkpoints (at least one, whatever keep says: the job must always
// have a cut to restart from) and deletes the older complete ones, together
// with every pending checkpoint at or below the newest complete step, which
// a recovery could never prefer. Pending checkpoints above it stay: they may
// still complete. Discarded checkpoints neither count among the kept nor are
// deleted (see DiscardCheckpointsAfter). It returns the ids it deleted.
func (tx *Tx) PruneCheckpoints(ctx context.Context, jobID uuid.UUID, keep int) ([]int64, error) {
	keep = max(keep, 1)
	rows, err := tx.tx.QueryContext(ctx,
		`SELECT id FROM checkpoints WHERE job_id = ?1 AND discarded_at IS NULL AND (
		     (state = 'complete' AND id NOT IN (
		         SELECT id FROM checkpoints WHERE job_id = ?1 AND `+usableCheckpoint+`
		         ORDER BY step DESC, id DESC LIMIT ?2))
		  OR (state = 'pending' AND step <= (
		         SELECT max(step) FROM checkpoints WHERE job_id = ?1 AND `+usableCheckpoint+`)))
		 ORDER BY id`,
		jobID.String(), keep)
	if err != nil {
		return nil, fmt.Errorf("prune checkpoints of job %s: %w", jobID, err)
	}
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, fmt.Errorf("prune checkpoints of job %s: %w", jobID, err)
		}
		ids = append(ids, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, fmt.Errorf("prune checkpoints of job %s: %w", jobID, err)
	}
	for _, id := range ids {
		if err := tx.DeleteCheckpoint(ctx, id); err != nil {
			return nil, fmt.Errorf("prune checkpoints of job %s: %w", jobID, err)
		}
	}
	return ids, nil
}

// PruneCheckpoints is Tx.PruneCheckpoints in a transaction of its own.
func (db *DB) PruneCheckpoints(ctx context.Context, jobID uuid.UUID, keep int) ([]int64, error) {
	return inTx(ctx, db, func(tx *Tx) ([]int64, error) { return tx.PruneCheckpoints(ctx, jobID, keep) })
}

func referencedBlobs(ctx context.Context, q querier) (map[string]bool, error) {
	rows, err := q.QueryContext(ctx, "SELECT DISTINCT sha256 FROM checkpoint_shards WHERE sha256 IS NOT NULL")
	if err != nil {
		return nil, fmt.Errorf("list referenced blobs: %w", err)
	}
	defer rows.Close()
	refs := make(map[string]bool)
	for rows.Next() {
		var sha string
		if err := rows.Scan(&sha); err != nil {
			return nil, fmt.Errorf("list referenced blobs: %w", err)
		}
		refs[sha] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list referenced blobs: %w", err)
	}
	return refs, nil
}

// ReferencedBlobs returns the set of blob hashes that some checkpoint shard,
// pending, complete or discarded, refers to: the blobs garbage collection
// must keep. Whether a checkpoint is usable does not matter here; a blob goes
// when no row refers to it any more.
func (db *DB) ReferencedBlobs(ctx context.Context) (map[string]bool, error) {
	return referencedBlobs(ctx, db.r)
}
