-- 0004: credit for verified work, bans, and discarded checkpoints (docs/design.md,
-- "Verification and credit"; issue 18). Only verified work earns credit, as in BOINC: a
-- worker's work is pending until an audit of it passes, rejected when the
-- worker is banned, and discarded when the job rolls back past it.

-- One row per worker per (step, plan version) it took part in. A step
-- replanned mid-way, or replayed under a new plan after a rollback, is other
-- work and gets other rows; a step replayed under the same plan replaces a
-- pending or discarded row (see RecordWork).
CREATE TABLE work (
    job_id        TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    -- Not a foreign key, as in events: credit outlives the worker's row.
    worker_id     TEXT    NOT NULL CHECK (worker_id <> ''),
    step          INTEGER NOT NULL CHECK (step >= 0),
    plan_version  INTEGER NOT NULL CHECK (plan_version >= 1),
    micro_batches INTEGER NOT NULL CHECK (micro_batches >= 0),
    flops         REAL    NOT NULL CHECK (flops >= 0),
    state         TEXT    NOT NULL CHECK (state IN ('pending', 'verified', 'rejected', 'discarded')),
    recorded_at   TEXT    NOT NULL,
    settled_at    TEXT,   -- when it left pending; NULL while pending
    CHECK ((state = 'pending') = (settled_at IS NULL)),
    PRIMARY KEY (job_id, worker_id, step, plan_version)
) STRICT, WITHOUT ROWID;

-- Pending rows are the few recent ones an audit or a rollback settles; the
-- partial indexes keep VerifyWork and DiscardWork from walking a long job's
-- whole history.
CREATE INDEX work_pending_by_worker ON work (job_id, worker_id, step) WHERE state = 'pending';
CREATE INDEX work_pending_by_step ON work (job_id, step) WHERE state = 'pending';

-- Running totals of work per (job, worker), kept by the triggers below in the
-- transaction that changes the work, so that a status (read on every
-- dashboard and contributor poll) reads the top of a leaderboard through an
-- index instead of summing a long job's history. *_rows count the rows in
-- each state: when a state's count drops to zero its FLOPs are set to exactly
-- zero, so that adding and subtracting floats leaves no residue behind.
CREATE TABLE credits (
    job_id         TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    worker_id      TEXT    NOT NULL,
    verified_rows  INTEGER NOT NULL DEFAULT 0,
    verified_mb    INTEGER NOT NULL DEFAULT 0,
    verified_flops REAL    NOT NULL DEFAULT 0,
    pending_rows   INTEGER NOT NULL DEFAULT 0,
    pending_mb     INTEGER NOT NULL DEFAULT 0,
    pending_flops  REAL    NOT NULL DEFAULT 0,
    rejected_rows  INTEGER NOT NULL DEFAULT 0,
    rejected_mb    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, worker_id)
) STRICT, WITHOUT ROWID;

CREATE INDEX credits_rank ON credits (job_id, verified_flops DESC, worker_id);

CREATE TRIGGER work_insert_credits AFTER INSERT ON work
BEGIN
    INSERT INTO credits (job_id, worker_id) VALUES (NEW.job_id, NEW.worker_id)
        ON CONFLICT (job_id, worker_id) DO NOTHING;
    UPDATE credits SET
        verified_rows  = verified_rows + (NEW.state = 'verified'),
        verified_mb    = verified_mb + iif(NEW.state = 'verified', NEW.micro_batches, 0),
        verified_flops = verified_flops + iif(NEW.state = 'verified', NEW.flops, 0.0),
        pending_rows   = pending_rows + (NEW.state = 'pending'),
        pending_mb     = pending_mb + iif(NEW.state = 'pending', NEW.micro_batches, 0),
        pending_flops  = pending_flops + iif(NEW.state = 'pending', NEW.flops, 0.0),
        rejected_rows  = rejected_rows + (NEW.state = 'rejected'),
        rejected_mb    = rejected_mb + iif(NEW.state = 'rejected', NEW.micro_batches, 0)
    WHERE job_id = NEW.job_id AND worker_id = NEW.worker_id;
END;

-- The key columns never change (RecordWork replaces the other columns of the
-- row with the same key), so OLD and NEW name the same credits row.
CREATE TRIGGER work_update_credits AFTER UPDATE OF state, micro_batches, flops ON work
BEGIN
    UPDATE credits SET
        verified_rows  = verified_rows - (OLD.state = 'verified') + (NEW.state = 'verified'),
        verified_mb    = verified_mb - iif(OLD.state = 'verified', OLD.micro_batches, 0)
                                     + iif(NEW.state = 'verified', NEW.micro_batches, 0),
        verified_flops = iif(verified_rows - (OLD.state = 'verified') + (NEW.state = 'verified') = 0, 0.0,
                             verified_flops - iif(OLD.state = 'verified', OLD.flops, 0.0)
                                            + iif(NEW.state = 'verified', NEW.flops, 0.0)),
        pending_rows   = pending_rows - (OLD.state = 'pending') + (NEW.state = 'pending'),
        pending_mb     = pending_mb - iif(OLD.state = 'pending', OLD.micro_batches, 0)
                                    + iif(NEW.state = 'pending', NEW.micro_batches, 0),
        pending_flops  = iif(pending_rows - (OLD.state = 'pending') + (NEW.state = 'pending') = 0, 0.0,
                             pending_flops - iif(OLD.state = 'pending', OLD.flops, 0.0)
                                           + iif(NEW.state = 'pending', NEW.flops, 0.0)),
        rejected_rows  = rejected_rows - (OLD.state = 'rejected') + (NEW.state = 'rejected'),
        rejected_mb    = rejected_mb - iif(OLD.state = 'rejected', OLD.micro_batches, 0)
                                     + iif(NEW.state = 'rejected', NEW.micro_batches, 0)
    WHERE job_id = NEW.job_id AND worker_id = NEW.worker_id;
END;

CREATE TRIGGER work_key_is_final
BEFORE UPDATE OF job_id, worker_id, step, plan_version ON work
BEGIN
    SELECT RAISE(ABORT, 'a work row''s key cannot change');
END;

-- Work rows go only with their job, whose credits go with it too; this keeps
-- the totals right should anything else ever delete one.
CREATE TRIGGER work_delete_credits AFTER DELETE ON work
BEGIN
    UPDATE credits SET
        verified_rows  = verified_rows - (OLD.state = 'verified'),
        verified_mb    = verified_mb - iif(OLD.state = 'verified', OLD.micro_batches, 0),
        verified_flops = iif(verified_rows - (OLD.state = 'verified') = 0, 0.0,
                             verified_flops - iif(OLD.state = 'verified', OLD.flops, 0.0)),
        pending_rows   = pending_rows - (OLD.state = 'pending'),
        pending_mb     = pending_mb - iif(OLD.state = 'pending', OLD.micro_batches, 0),
        pending_flops  = iif(pending_rows - (OLD.state = 'pending') = 0, 0.0,
                             pending_flops - iif(OLD.state = 'pending', OLD.flops, 0.0)),
        rejected_rows  = rejected_rows - (OLD.state = 'rejected'),
        rejected_mb    = rejected_mb - iif(OLD.state = 'rejected', OLD.micro_batches, 0)
    WHERE job_id = OLD.job_id AND worker_id = OLD.worker_id;
END;

-- A worker banned from a job: caught cheating by an audit or a referee. The
-- first ban's reason and step are kept; banning again changes nothing.
CREATE TABLE bans (
    job_id    TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    worker_id TEXT    NOT NULL CHECK (worker_id <> ''),
    reason    TEXT    NOT NULL,
    step      INTEGER NOT NULL CHECK (step >= 0),
    at        TEXT    NOT NULL,
    PRIMARY KEY (job_id, worker_id)
) STRICT, WITHOUT ROWID;

CREATE INDEX bans_time ON bans (job_id, at, worker_id);

-- A checkpoint taken after a banned worker's first step holds its work: the
-- job rolls back past it and never restores from or exports it again. The row
-- and its blobs stay, as the record of what was thrown away. The column says
-- when it was discarded; NULL while usable.
ALTER TABLE checkpoints ADD COLUMN discarded_at TEXT;

-- 0001's checkpoint_complete_is_final refused every change to a complete
-- checkpoint; marking one discarded must pass, and nothing else may change.
DROP TRIGGER checkpoint_complete_is_final;

CREATE TRIGGER checkpoint_complete_is_final
BEFORE UPDATE OF id, job_id, step, state, shards_expected, created_at, completed_at ON checkpoints
WHEN OLD.state = 'complete'
BEGIN
    SELECT RAISE(ABORT, 'a complete checkpoint cannot change');
END;

CREATE TRIGGER checkpoint_discard_is_final
BEFORE UPDATE OF discarded_at ON checkpoints
WHEN OLD.discarded_at IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'a discarded checkpoint stays discarded');
END;

-- A pending checkpoint discarded before its last shard landed never becomes
-- usable: AddShard refuses its uploads, and this backs that up.
CREATE TRIGGER checkpoint_discarded_never_completes
BEFORE UPDATE OF state ON checkpoints
WHEN NEW.state = 'complete' AND OLD.discarded_at IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'a discarded checkpoint cannot complete');
END;
