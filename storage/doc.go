// Package storage is the coordinator's durable memory: a SQLite database
// (modernc.org/sqlite, pure Go, no cgo) holding jobs, workers, plans, step
// records, checkpoints and their shards, events, router statistics, the work each
// worker did with its credit state (pending, verified, rejected, discarded) and the
// workers an audit banned, and a
// content-addressed blob store holding the checkpoint shard files themselves.
//
// Everything a restarted coordinator needs to resume a job lives here: the job
// spec and state, the newest plan, and the newest complete checkpoint. A
// checkpoint becomes complete in the same transaction that records its last
// shard, so a crash at any moment leaves either a usable checkpoint or a
// pending one, never a half checkpoint marked usable (see AddShard).
//
// # Connections
//
// Open keeps two connection pools on one database file in WAL mode: a write
// pool of exactly one connection, whose transactions start with BEGIN
// IMMEDIATE, and a read pool whose connections are query_only. Writers queue
// in Go (bounded by their context) instead of contending for SQLite's write
// lock, so SQLITE_BUSY storms cannot happen inside one process; WAL lets the
// readers run beside the writer. busy_timeout covers the other processes that
// may open the same file (shoal status, an admin's sqlite3 shell).
//
// # What must not import it
//
// The worker runtime (package client) and the browser build (package wasm)
// must never import storage, directly or through another package: SQLite has
// no place in a GOOS=js binary, and a worker holds no durable state of its own.
// Only cmd and coordinator import it. storage itself imports no other Shoal
// package, so that the dependency points one way only.
package storage
