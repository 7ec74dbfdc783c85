package storage

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
)

// migrationFS holds the schema migrations, applied in file-name order. A file
// is named NNNN_what.sql; NNNN is the schema version it produces, numbered
// from 0001 without gaps. A released migration is never edited: a change is
// a new file.
//
//go:embed migrations/*.sql
var migrationFS embed.FS

// applicationID marks the file as Shoal's ("Shol"), so that Open can tell a
// fresh database from one that belongs to another program.
const applicationID = 0x53686f6c

type migration struct {
	version int
	name    string
	sql     string
}

// loadMigrations reads and orders the migrations in fsys under migrations/.
func loadMigrations(fsys fs.FS) ([]migration, error) {
	names, err := fs.Glob(fsys, "migrations/*.sql")
	if err != nil {
		return nil, fmt.Errorf("list migrations: %w", err)
	}
	var ms []migration
	for _, name := range names {
		base := path.Base(name)
		num, _, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v < 1 {
			return nil, fmt.Errorf("migration %s: name must be NNNN_what.sql with NNNN >= 1", base)
		}
		body, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", base, err)
		}
		ms = append(ms, migration{version: v, name: base, sql: string(body)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].version < ms[j].version })
	for i, m := range ms {
		if m.version != i+1 {
			return nil, fmt.Errorf("migration %s: expected version %d: versions must run 1, 2, 3... without gaps or repeats", m.name, i+1)
		}
	}
	return ms, nil
}

// SchemaVersion is the schema version this binary's embedded migrations
// produce, and therefore the newest database it can open.
func SchemaVersion() int {
	ms, err := loadMigrations(migrationFS)
	if err != nil {
		// The embedded files are fixed at build time and checked by
		// TestMigrationsEmbedded, so this is a build that was never tested.
		panic(err)
	}
	return len(ms)
}

// migrate brings the database on w up to the newest migration in fsys. Each
// migration runs in its own IMMEDIATE transaction together with the
// user_version bump that records it, so a crash or an error leaves the
// schema at the last migration that fully applied. The version is re-read
// inside each transaction, so two processes opening one file at once apply
// each migration exactly once.
func migrate(ctx context.Context, w *sql.DB, fsys fs.FS) error {
	ms, err := loadMigrations(fsys)
	if err != nil {
		return err
	}
	known := len(ms)

	// Checked before anything is written, so that a too-new database or a
	// foreign file is left exactly as it was.
	if _, err := schemaState(ctx, w, known); err != nil {
		return err
	}
	for _, m := range ms {
		if err := applyMigration(ctx, w, m, known); err != nil {
			return err
		}
	}
	return nil
}

// schemaState returns the database's schema version, refusing files that are
// newer than known or were not made by Shoal.
func schemaState(ctx context.Context, q querier, known int) (int, error) {
	var version, appID, objects int
	if err := q.QueryRowContext(ctx, "PRAGMA user_version").Scan(&version); err != nil {
		return 0, fmt.Errorf("read schema version: %w", err)
	}
	if err := q.QueryRowContext(ctx, "PRAGMA application_id").Scan(&appID); err != nil {
		return 0, fmt.Errorf("read application id: %w", err)
	}
	if appID != applicationID {
		if err := q.QueryRowContext(ctx, "SELECT count(*) FROM sqlite_schema").Scan(&objects); err != nil {
			return 0, fmt.Errorf("read schema: %w", err)
		}
		// An empty file with no id is a new database; anything else
		// belongs to someone else.
		if appID != 0 || version != 0 || objects != 0 {
			return 0, fmt.Errorf("%w: application id %#x, user version %d, %d schema objects: point shoal at a new file",
				ErrNotShoalDatabase, appID, version, objects)
		}
	}
	if version > known {
		return 0, &detailedError{
			msg:      fmt.Sprintf("database schema %d is newer than this shoal (%d): upgrade shoal", version, known),
			sentinel: ErrSchemaTooNew,
		}
	}
	return version, nil
}

func applyMigration(ctx context.Context, w *sql.DB, m migration, known int) (err error) {
	tx, err := w.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("migration %s: begin: %w", m.name, err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	version, err := schemaState(ctx, tx, known)
	if err != nil {
		return err
	}
	if version >= m.version {
		return tx.Rollback()
	}
	if _, err := tx.ExecContext(ctx, m.sql); err != nil {
		return fmt.Errorf("migration %s: %w", m.name, err)
	}
	// PRAGMAs take no bound parameters; both values are integers we made.
	// Both are stored in the database header, which is written as part of
	// this transaction, so they commit or roll back with the migration.
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", m.version)); err != nil {
		return fmt.Errorf("migration %s: set user_version: %w", m.name, err)
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA application_id = %d", applicationID)); err != nil {
		return fmt.Errorf("migration %s: set application_id: %w", m.name, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migration %s: commit: %w", m.name, err)
	}
	return nil
}
