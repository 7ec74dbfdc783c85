package storage

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// SetSession records hash as the digest of worker id's current session credential, replacing
// the previous one (which stops being accepted).
func (tx *Tx) SetSession(ctx context.Context, id string, hash []byte) error {
	if id == "" || len(hash) != 32 {
		return fmt.Errorf("set session of %q: want an id and a 32-byte digest: %w", id, ErrInvalid)
	}
	_, err := tx.tx.ExecContext(ctx, `INSERT INTO sessions (worker_id, token_sha256, issued_at) VALUES (?, ?, ?)
		ON CONFLICT (worker_id) DO UPDATE SET token_sha256 = excluded.token_sha256, issued_at = excluded.issued_at`,
		id, hash, formatTime(tx.now))
	if err != nil {
		return fmt.Errorf("set session of %s: %w", id, err)
	}
	return nil
}

// SetSession is Tx.SetSession in a transaction of its own.
func (db *DB) SetSession(ctx context.Context, id string, hash []byte) error {
	return db.Tx(ctx, func(tx *Tx) error { return tx.SetSession(ctx, id, hash) })
}

// SessionHash returns the digest of worker id's current session credential, or ErrNotFound.
func (db *DB) SessionHash(ctx context.Context, id string) ([]byte, error) {
	var h []byte
	err := db.r.QueryRowContext(ctx, "SELECT token_sha256 FROM sessions WHERE worker_id = ?", id).Scan(&h)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("session of %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("session of %s: %w", id, err)
	}
	return h, nil
}

// KnownWorker reports whether id was ever given to a worker: it has a session or a worker row.
func (db *DB) KnownWorker(ctx context.Context, id string) (bool, error) {
	var n int
	err := db.r.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM sessions WHERE worker_id = ?) + (SELECT count(*) FROM workers WHERE id = ?)`, id, id).Scan(&n)
	if err != nil {
		return false, fmt.Errorf("known worker %s: %w", id, err)
	}
	return n > 0, nil
}
