package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver
)

// DefaultBusyTimeout is how long a connection waits for a lock that another
// process holds before SQLite reports SQLITE_BUSY. Inside one process the
// single write connection means no writer ever waits on SQLite's lock, so the
// timeout only matters when a second process (shoal status, a sqlite3 shell,
// a checkpoint of the WAL) holds the file briefly; 5 s rides over those.
const DefaultBusyTimeout = 5 * time.Second

// Options configures Open. The zero value is ready to use.
type Options struct {
	// BusyTimeout is SQLite's busy_timeout; zero means DefaultBusyTimeout.
	BusyTimeout time.Duration
	// ReadConns caps the read pool; zero means max(4, GOMAXPROCS). Each
	// connection carries its own page cache, so more is not free.
	ReadConns int
	// Now is the clock stamped into created/updated/seen columns; nil means
	// time.Now. Tests inject a fixed clock to check timestamps exactly.
	Now func() time.Time
}

// DB is a Shoal database. It is safe for concurrent use. Its methods that
// change anything run in their own write transaction; to make several changes
// atomically, use Tx and the same methods on *Tx.
type DB struct {
	path string
	// w has exactly one connection, so write transactions queue in
	// database/sql (in order, bounded by each caller's ctx) instead of
	// racing for SQLite's RESERVED lock. Its transactions begin IMMEDIATE:
	// a deferred transaction that reads and then writes must upgrade its
	// lock, and an upgrade that collides with another writer fails with
	// SQLITE_BUSY at once, busy_timeout or not, because waiting could
	// deadlock. Taking the write lock at BEGIN makes the wait safe.
	w *sql.DB
	// r serves reads. In WAL mode readers see the last committed snapshot
	// and neither block the writer nor wait for it. query_only makes a write
	// sent here by mistake fail loudly instead of taking the write lock
	// behind w's back.
	r   *sql.DB
	now func() time.Time
}

// Open opens the database file at path, creating it if needed, and brings its
// schema up to date with the migrations embedded in this binary. ctx bounds
// the migrations and the first connections, not the lifetime of the DB.
//
// Open refuses a database whose schema is newer than this binary knows
// (ErrSchemaTooNew) and a SQLite file that another program created
// (ErrNotShoalDatabase). path must name a file: ":memory:" would give each
// pooled connection a database of its own.
func Open(ctx context.Context, path string, opts Options) (*DB, error) {
	if path == "" || path == ":memory:" {
		return nil, fmt.Errorf("open database %q: need a file path: %w", path, ErrInvalid)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("open database %s: %w", path, err)
	}
	if opts.BusyTimeout <= 0 {
		opts.BusyTimeout = DefaultBusyTimeout
	}
	if opts.ReadConns <= 0 {
		opts.ReadConns = max(4, runtime.GOMAXPROCS(0))
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}

	if err := preflight(ctx, abs, opts.BusyTimeout); err != nil {
		return nil, fmt.Errorf("open database %s: %w", abs, err)
	}
	db := &DB{path: abs, now: opts.Now}
	db.w, err = sql.Open("sqlite", dsn(abs, opts.BusyTimeout, true))
	if err != nil {
		return nil, fmt.Errorf("open database %s: %w", abs, err)
	}
	db.w.SetMaxOpenConns(1)
	db.w.SetMaxIdleConns(1)
	// Keep the one connection forever: reopening it would rerun the DSN
	// pragmas and drop its page cache for nothing.
	db.w.SetConnMaxLifetime(0)
	db.w.SetConnMaxIdleTime(0)

	if err := db.checkJournalMode(ctx); err != nil {
		db.w.Close()
		return nil, err
	}
	if err := migrate(ctx, db.w, migrationFS); err != nil {
		db.w.Close()
		return nil, fmt.Errorf("open database %s: %w", abs, err)
	}

	// The read pool opens after the migrations so that its query_only
	// connections never meet a half-built schema.
	db.r, err = sql.Open("sqlite", dsn(abs, opts.BusyTimeout, false))
	if err != nil {
		db.w.Close()
		return nil, fmt.Errorf("open database %s: %w", abs, err)
	}
	db.r.SetMaxOpenConns(opts.ReadConns)
	db.r.SetMaxIdleConns(opts.ReadConns)
	if err := db.r.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("open database %s: %w", abs, err)
	}
	return db, nil
}

// dsn builds the connection string. Every setting that must hold on every
// connection is a DSN parameter, because database/sql opens and reopens
// pooled connections on its own; a PRAGMA run once through db.Exec would
// reach only whichever connection happened to run it.
//
//   - journal_mode=WAL: readers and the writer do not block each other, and a
//     commit appends to the log instead of rewriting pages in place.
//   - synchronous=FULL: the WAL is fsynced at every commit, so a transaction
//     that returned is on disk. NORMAL would also survive a killed process,
//     but after a power cut it may lose the last commits while the blob
//     store's effects (fsynced renames, garbage collection) survive: the
//     database could roll back to naming as newest a checkpoint whose blobs
//     were already collected. The coordinator commits a few times per training
//     step, so the cost of one fsync per commit is noise beside the step.
//   - foreign_keys=ON: SQLite's default is OFF, per connection.
//   - busy_timeout: see DefaultBusyTimeout.
//
// The path is escaped and sent as a file: URI so that a '?' or '%' in it
// cannot be read as the start of the parameters.
func dsn(path string, busy time.Duration, write bool) string {
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(busy.Milliseconds(), 10)+")")
	q.Add("_pragma", "foreign_keys(1)")
	q.Add("_pragma", "synchronous(FULL)")
	if write {
		// Only the writer sets the journal mode: it is a property of the
		// file, set once, and the writer connects first.
		q.Add("_pragma", "journal_mode(WAL)")
		q.Set("_txlock", "immediate")
	} else {
		q.Add("_pragma", "query_only(1)")
	}
	u := url.URL{Scheme: "file", Path: filepath.ToSlash(path)}
	return "file:" + u.EscapedPath() + "?" + q.Encode()
}

// preflight refuses a file that another program made, or a newer shoal,
// through a read-only connection without pragmas, before the write pool's
// DSN switches the file to WAL: a foreign database must be left exactly as
// it was, journal mode included. migrate checks again under the write lock.
func preflight(ctx context.Context, path string, busy time.Duration) error {
	if fi, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) || (err == nil && fi.Size() == 0) {
		return nil // a new database
	}
	u := url.URL{Scheme: "file", Path: filepath.ToSlash(path)}
	ro, err := sql.Open("sqlite", "file:"+u.EscapedPath()+"?mode=ro&_pragma=busy_timeout("+
		strconv.FormatInt(busy.Milliseconds(), 10)+")")
	if err != nil {
		return err
	}
	defer ro.Close()
	known := SchemaVersion()
	_, err = schemaState(ctx, ro, known)
	return err
}

// checkJournalMode fails Open when the file system cannot do WAL (SQLite then
// silently keeps the old journal mode, and the concurrency argument above
// would no longer hold).
func (db *DB) checkJournalMode(ctx context.Context) error {
	var mode string
	if err := db.w.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return fmt.Errorf("open database %s: %w", db.path, err)
	}
	if mode != "wal" {
		return fmt.Errorf("open database %s: journal mode is %q, need wal (is it on a network file system?)", db.path, mode)
	}
	return nil
}

// Path returns the absolute path of the database file.
func (db *DB) Path() string { return db.path }

// Close closes both connection pools. Transactions still running fail.
func (db *DB) Close() error {
	var errR error
	if db.r != nil {
		errR = db.r.Close()
	}
	return errors.Join(errR, db.w.Close())
}

// Check runs SQLite's integrity_check and foreign_key_check and returns an
// error describing the first problems found. It reads the whole file: meant
// for shoal status --check and for tests, not for every request.
func (db *DB) Check(ctx context.Context) error {
	rows, err := db.r.QueryContext(ctx, "PRAGMA integrity_check")
	if err != nil {
		return fmt.Errorf("integrity check: %w", err)
	}
	var problems []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			rows.Close()
			return fmt.Errorf("integrity check: %w", err)
		}
		if s != "ok" {
			problems = append(problems, s)
		}
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return fmt.Errorf("integrity check: %w", err)
	}
	if len(problems) > 0 {
		return fmt.Errorf("integrity check of %s: %q", db.path, problems)
	}
	rows, err = db.r.QueryContext(ctx, "PRAGMA foreign_key_check")
	if err != nil {
		return fmt.Errorf("foreign key check: %w", err)
	}
	defer rows.Close()
	if rows.Next() {
		var table, parent string
		var rowid sql.NullInt64
		var fkid int64
		if err := rows.Scan(&table, &rowid, &parent, &fkid); err != nil {
			return fmt.Errorf("foreign key check: %w", err)
		}
		return fmt.Errorf("foreign key check of %s: %s row %d references a missing %s row", db.path, table, rowid.Int64, parent)
	}
	return rows.Err()
}

// Tx runs fn inside one write transaction. It commits when fn returns nil and
// rolls back when fn returns an error, which Tx then returns unchanged, or
// panics, in which case the panic continues after the rollback. ctx bounds the
// wait for the write connection and every statement; a ctx that ends before
// the commit rolls the transaction back.
//
// Write transactions run one at a time. Inside fn, use tx's methods and never
// db's write methods or a nested db.Tx: they would wait for the connection
// that fn itself holds, until ctx ends. Keep fn short and free of network I/O
// for the same reason.
func (db *DB) Tx(ctx context.Context, fn func(tx *Tx) error) error {
	sqlTx, err := db.w.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	// Rolling back in a deferred call, rather than recovering and
	// re-panicking, also covers runtime.Goexit (t.FailNow in a test
	// closure) and keeps the panic's original stack trace.
	finished := false
	defer func() {
		if !finished {
			_ = sqlTx.Rollback()
		}
	}()
	tx := &Tx{tx: sqlTx, now: db.now().UTC()}
	if err := fn(tx); err != nil {
		finished = true
		if rbErr := sqlTx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			return errors.Join(err, fmt.Errorf("roll back: %w", rbErr))
		}
		return err
	}
	finished = true
	if err := sqlTx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// Tx is one write transaction, valid only inside the function passed to
// DB.Tx. Its methods mirror DB's; reads through a Tx see the transaction's
// own uncommitted writes.
type Tx struct {
	tx *sql.Tx
	// now is read once per transaction so that every row the transaction
	// writes carries the same timestamp.
	now time.Time
}

// inTx runs fn in a write transaction and returns its value: the bridge from
// DB's convenience methods to Tx's.
func inTx[T any](ctx context.Context, db *DB, fn func(tx *Tx) (T, error)) (T, error) {
	var v T
	err := db.Tx(ctx, func(tx *Tx) error {
		var err error
		v, err = fn(tx)
		return err
	})
	return v, err
}

// inReadTx runs fn in a read transaction on the read pool, so that a method
// making several queries sees one snapshot.
func inReadTx[T any](ctx context.Context, db *DB, fn func(q querier) (T, error)) (T, error) {
	var zero T
	sqlTx, err := db.r.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return zero, fmt.Errorf("begin read: %w", err)
	}
	defer sqlTx.Rollback()
	return fn(sqlTx)
}

// querier is what *sql.DB and *sql.Tx have in common, so that one function
// serves both DB's read pool and a Tx.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// timeLayout stores times as fixed-width UTC text with milliseconds: it sorts
// lexicographically in time order and reads plainly in a sqlite3 shell. Times
// read back are therefore UTC and truncated to the millisecond.
const timeLayout = "2006-01-02T15:04:05.000Z"

func formatTime(t time.Time) string { return t.UTC().Format(timeLayout) }

func parseTime(s string) (time.Time, error) {
	t, err := time.Parse(timeLayout, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("stored time %q: %w", s, err)
	}
	return t, nil
}

func parseNullTime(s sql.NullString) (time.Time, error) {
	if !s.Valid {
		return time.Time{}, nil
	}
	return parseTime(s.String)
}

// jsonDoc validates a JSON document before it is stored; empty means def. The
// schema's json_valid checks back this up, but a Go error names the field.
func jsonDoc(what string, doc json.RawMessage, def string) (string, error) {
	if len(doc) == 0 {
		if def == "" {
			return "", fmt.Errorf("%s: empty JSON document: %w", what, ErrInvalid)
		}
		return def, nil
	}
	if !json.Valid(doc) {
		return "", fmt.Errorf("%s: malformed JSON: %w", what, ErrInvalid)
	}
	return string(doc), nil
}

// jsonObject is jsonDoc for documents that must be a JSON object (specs and
// plans): a bare number or array there is certainly a caller's bug.
func jsonObject(what string, doc json.RawMessage) (string, error) {
	s, err := jsonDoc(what, doc, "")
	if err != nil {
		return "", err
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(doc, &obj); err != nil || obj == nil {
		return "", fmt.Errorf("%s: want a JSON object: %w", what, ErrInvalid)
	}
	return s, nil
}

func finite(what string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return fmt.Errorf("%s is %v: %w", what, v, ErrInvalid)
	}
	return nil
}
