-- 0001: the first Shoal schema.
--
-- Conventions, kept by every later migration:
--   * STRICT tables, so a wrong Go type is an error instead of a silently
--     coerced value.
--   * Times are TEXT 'YYYY-MM-DDTHH:MM:SS.mmmZ' (UTC, fixed width): they sort
--     in time order and read plainly in a sqlite3 shell.
--   * JSON columns carry a json_valid check; the Go side checks first and
--     names the field, this is the backstop.
--   * Enumerations are CHECKed here and mirrored by Go constants.
--   * A migration runs inside one transaction with foreign_keys=ON, where
--     PRAGMA foreign_keys cannot be switched off; a migration that rebuilds
--     a referenced table must use PRAGMA defer_foreign_keys instead.

CREATE TABLE jobs (
    id         TEXT    NOT NULL PRIMARY KEY CHECK (length(id) = 36),
    spec       TEXT    NOT NULL CHECK (json_valid(spec)),
    state      TEXT    NOT NULL CHECK (state IN ('queued', 'running', 'paused', 'done', 'failed', 'cancelled')),
    -- Steps completed, which is also the index of the next step to run; it
    -- matches a checkpoint's step and moves back when a job rewinds to one.
    step       INTEGER NOT NULL DEFAULT 0 CHECK (step >= 0),
    -- Why the job is in its state (a failure, who cancelled); '' if nothing to say.
    reason     TEXT    NOT NULL DEFAULT '',
    created_at TEXT    NOT NULL,
    updated_at TEXT    NOT NULL
) STRICT;

-- The coordinator's restart path asks for the jobs that were running.
CREATE INDEX jobs_state ON jobs (state, created_at);

CREATE TABLE workers (
    id           TEXT    NOT NULL PRIMARY KEY CHECK (id <> ''),
    kind         TEXT    NOT NULL CHECK (kind IN ('native', 'browser')),
    backend      TEXT    NOT NULL,
    gflops       REAL    NOT NULL CHECK (gflops >= 0),
    memory_bytes INTEGER NOT NULL CHECK (memory_bytes >= 0),
    state        TEXT    NOT NULL CHECK (state IN ('idle', 'active', 'draining', 'gone')),
    joined_at    TEXT    NOT NULL,
    last_seen_at TEXT    NOT NULL
) STRICT;

CREATE INDEX workers_state ON workers (state, last_seen_at);

-- Plans are append-only: a frame names the plan version it was computed
-- under, and a step row names the plan that produced it, so old versions stay.
CREATE TABLE plans (
    job_id     TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    version    INTEGER NOT NULL CHECK (version >= 1),
    plan       TEXT    NOT NULL CHECK (json_valid(plan)),
    created_at TEXT    NOT NULL,
    PRIMARY KEY (job_id, version)
) STRICT;

-- One row per (job, step). A step replayed after a recovery overwrites its
-- row (see RecordStep): the row describes the execution whose parameters the
-- job carries on from, and attempts counts how often the step ran.
CREATE TABLE steps (
    job_id       TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step         INTEGER NOT NULL CHECK (step >= 0),
    plan_version INTEGER NOT NULL,
    loss         REAL    NOT NULL,  -- cross-entropy, mean over micro-batches
    aux          REAL    NOT NULL,  -- load-balancing loss, mean over micro-batches
    val_loss     REAL,              -- NULL when not computed at this step
    tokens       INTEGER NOT NULL CHECK (tokens >= 0),
    timings      TEXT    NOT NULL CHECK (json_valid(timings)),  -- per-stage timings
    attempts     INTEGER NOT NULL DEFAULT 1 CHECK (attempts >= 1),
    created_at   TEXT    NOT NULL,  -- first recorded
    updated_at   TEXT    NOT NULL,  -- last recorded
    PRIMARY KEY (job_id, step),
    FOREIGN KEY (job_id, plan_version) REFERENCES plans (job_id, version)
) STRICT;

-- Tokens each expert received at each step, for the dashboard's expert map
-- and for the planner's load estimates. Small rows, looked up by key only.
CREATE TABLE router_stats (
    job_id TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step   INTEGER NOT NULL CHECK (step >= 0),
    block  INTEGER NOT NULL CHECK (block >= 0),
    expert INTEGER NOT NULL CHECK (expert >= 0),
    tokens INTEGER NOT NULL CHECK (tokens >= 0),
    PRIMARY KEY (job_id, step, block, expert)
) STRICT, WITHOUT ROWID;

-- AUTOINCREMENT so that an id is never reused after retention deletes a
-- checkpoint: a late upload naming a deleted checkpoint must fail, not land
-- in a new one that happened to get the same id.
CREATE TABLE checkpoints (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id          TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step            INTEGER NOT NULL CHECK (step >= 0),  -- steps completed
    state           TEXT    NOT NULL CHECK (state IN ('pending', 'complete')),
    shards_expected INTEGER NOT NULL CHECK (shards_expected >= 1),
    created_at      TEXT    NOT NULL,
    completed_at    TEXT,
    CHECK ((state = 'complete') = (completed_at IS NOT NULL))
) STRICT;

CREATE INDEX checkpoints_job ON checkpoints (job_id, state, step);

-- Every expected shard has a row from the moment its checkpoint begins; the
-- blob columns are NULL until the shard lands.
CREATE TABLE checkpoint_shards (
    checkpoint_id INTEGER NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
    name          TEXT    NOT NULL CHECK (name <> ''),
    sha256        TEXT    CHECK (sha256 IS NULL OR (length(sha256) = 64 AND NOT sha256 GLOB '*[^0-9a-f]*')),
    bytes         INTEGER CHECK (bytes IS NULL OR bytes >= 0),
    added_at      TEXT,
    CHECK ((sha256 IS NULL) = (bytes IS NULL) AND (sha256 IS NULL) = (added_at IS NULL)),
    PRIMARY KEY (checkpoint_id, name)
) STRICT;

-- The invariant the whole design leans on, enforced by the database itself
-- and not only by AddShard: a checkpoint is complete exactly when all of its
-- expected shards have landed, and a complete checkpoint never changes.
CREATE TRIGGER checkpoint_complete_needs_all_shards
BEFORE UPDATE OF state ON checkpoints
WHEN NEW.state = 'complete' AND NEW.shards_expected <> (
    SELECT count(*) FROM checkpoint_shards
    WHERE checkpoint_id = NEW.id AND sha256 IS NOT NULL)
BEGIN
    SELECT RAISE(ABORT, 'checkpoint cannot complete before all its shards land');
END;

CREATE TRIGGER checkpoint_complete_is_final
BEFORE UPDATE ON checkpoints
WHEN OLD.state = 'complete'
BEGIN
    SELECT RAISE(ABORT, 'a complete checkpoint cannot change');
END;

CREATE TRIGGER checkpoint_shard_is_final
BEFORE UPDATE ON checkpoint_shards
WHEN OLD.sha256 IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'a landed shard cannot change');
END;

CREATE TRIGGER checkpoint_shards_fixed_at_begin
BEFORE INSERT ON checkpoint_shards
WHEN (SELECT state FROM checkpoints WHERE id = NEW.checkpoint_id) = 'complete'
BEGIN
    SELECT RAISE(ABORT, 'cannot add a shard name to a complete checkpoint');
END;

-- AUTOINCREMENT so that ids only grow: a dashboard tails events by asking
-- for those after the last id it saw.
CREATE TABLE events (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id    TEXT    REFERENCES jobs (id) ON DELETE CASCADE,  -- NULL: not about one job
    time      TEXT    NOT NULL,
    kind      TEXT    NOT NULL CHECK (kind <> ''),
    -- Not a foreign key: an event may name a worker that never got a row,
    -- such as one whose hello was rejected.
    worker_id TEXT,
    message   TEXT    NOT NULL CHECK (json_valid(message))
) STRICT;

CREATE INDEX events_job ON events (job_id, id);
CREATE INDEX events_worker ON events (worker_id, id) WHERE worker_id IS NOT NULL;
