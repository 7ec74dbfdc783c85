package storage

import "errors"

// ErrNotFound means the job, worker, plan, checkpoint, shard or blob asked
// for does not exist. The returned error says which.
var ErrNotFound = errors.New("not found")

// ErrInvalid means an argument was rejected before anything was written: a
// malformed JSON document, a negative step, a NaN loss, a malformed hash.
// Nothing was changed.
var ErrInvalid = errors.New("invalid argument")

// ErrSchemaTooNew means the database was written by a newer shoal whose
// migrations this binary does not know. Opening it anyway could corrupt it;
// the fix is to upgrade shoal.
var ErrSchemaTooNew = errors.New("database schema is newer than this shoal")

// ErrNotShoalDatabase means the file is a SQLite database that some other
// program created. Shoal refuses to add its tables to it.
var ErrNotShoalDatabase = errors.New("not a shoal database")

// ErrInvalidTransition means a job state change that the job lifecycle does
// not allow, such as leaving a terminal state (done, failed, cancelled).
var ErrInvalidTransition = errors.New("invalid job state transition")

// ErrUnexpectedShard means a shard was added to a checkpoint that did not list
// its name when it began. The coordinator decides the shard names when it
// begins a checkpoint; a different name is a bug or a stale upload.
var ErrUnexpectedShard = errors.New("shard not expected by checkpoint")

// ErrShardConflict means a shard that had already landed was added again with
// different contents. Landed shards are immutable: the first upload wins, and
// an identical re-upload (a retry) is accepted as a no-op.
var ErrShardConflict = errors.New("shard already recorded with different contents")

// ErrCorrupt means a blob's contents no longer hash to its name: the file was
// damaged on disk. The blob must not be used; re-upload or fall back to an
// older checkpoint.
var ErrCorrupt = errors.New("blob corrupt")

// detailedError carries a message that already says everything, and still
// matches its sentinel under errors.Is. It avoids messages that repeat
// themselves, like "schema is newer: schema 5 is newer (3)".
type detailedError struct {
	msg      string
	sentinel error
}

func (e *detailedError) Error() string { return e.msg }
func (e *detailedError) Unwrap() error { return e.sentinel }
