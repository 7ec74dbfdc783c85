package storage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// BlobStore is a directory of immutable files named by the SHA-256 of their
// contents, laid out as <dir>/<first two hex digits>/<sha256> so that no
// directory grows past a few thousand entries. Checkpoint shards live here;
// the database records only their hashes. It is safe for concurrent use, by
// several processes too: every change is a rename, which is atomic.
type BlobStore struct {
	dir string
	// staging holds one token per Stage writer open: they write what
	// untrusted peers send, and each may grow to a shard's size on disk.
	staging chan struct{}
}

// tempPrefix marks the temporary files of blobs being written. They live in
// the store's root so that the final rename stays on one file system; GC and
// OpenBlobStore remove stale ones.
const tempPrefix = ".put-"

// StagingLimit is how many Stage writers may be open at once: each holds a
// file descriptor and up to a shard's size of disk until it commits, so a
// crowd of uploaders must queue rather than fill the disk or the descriptor
// table.
const StagingLimit = 4

// StaleTempAge is how long a temporary file may go unwritten before
// OpenBlobStore takes it for the leftover of a process that died mid-write.
// Writers still alive write far more often than that: an upload that stalls
// for half a minute is cut.
const StaleTempAge = time.Hour

// OpenBlobStore opens the blob store in dir, creating the directory if
// needed, and removes the temporary files that no one has written for
// StaleTempAge: a crash between a temp file's creation and its rename leaves
// one behind, and nothing else would ever look at it again.
func OpenBlobStore(dir string) (*BlobStore, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("open blob store %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("open blob store: %w", err)
	}
	s := &BlobStore{dir: abs, staging: make(chan struct{}, StagingLimit)}
	if _, err := s.removeStaleTemps(time.Now().Add(-StaleTempAge)); err != nil {
		return nil, fmt.Errorf("open blob store: %w", err)
	}
	return s, nil
}

// removeStaleTemps removes the temporary files last written before cutoff.
func (s *BlobStore) removeStaleTemps(cutoff time.Time) (int, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), tempPrefix) || !e.Type().IsRegular() {
			continue
		}
		removed, _, err := removeIfOlder(filepath.Join(s.dir, e.Name()), cutoff)
		if err != nil {
			return n, err
		}
		if removed {
			n++
		}
	}
	return n, nil
}

// Dir returns the store's absolute directory.
func (s *BlobStore) Dir() string { return s.dir }

// ValidSHA256 reports whether h is a blob name: exactly 64 lowercase hex
// digits. Only such names ever reach the file system, which rules out path
// traversal ("../x", "/etc/passwd") and two spellings of one blob.
func ValidSHA256(h string) bool {
	return len(h) == 2*sha256.Size && isLowerHex(h)
}

func isLowerHex(h string) bool {
	for i := 0; i < len(h); i++ {
		c := h[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func (s *BlobStore) path(sha string) (string, error) {
	if !ValidSHA256(sha) {
		return "", fmt.Errorf("blob %q: not 64 lowercase hex digits: %w", sha, ErrInvalid)
	}
	return filepath.Join(s.dir, sha[:2], sha), nil
}

// Writer is a blob being written. Its bytes go to a temporary file in the
// store and through SHA-256 as they come; nothing is visible under a blob
// name until Commit. Abort, or a failed Commit, removes the temporary file:
// a writer whose contents turn out to be unwanted leaves nothing behind.
// A Writer is not safe for concurrent use.
type Writer struct {
	s       *BlobStore
	f       *os.File
	h       hash.Hash
	n       int64
	release func() // gives a Stage token back; nil for Create
	done    bool   // committed or aborted
}

// Create starts a blob. The caller must Commit or Abort it.
func (s *BlobStore) Create() (*Writer, error) {
	f, err := os.CreateTemp(s.dir, tempPrefix+"*")
	if err != nil {
		return nil, fmt.Errorf("create blob: %w", err)
	}
	return &Writer{s: s, f: f, h: sha256.New()}, nil
}

// Stage is Create for contents an untrusted peer sends: it first waits for
// one of StagingLimit places, until ctx ends, and holds it until Commit or
// Abort. Writers the store's owner trusts (Put, Create) do not queue here, so
// a crowd of uploads cannot hold them up.
func (s *BlobStore) Stage(ctx context.Context) (*Writer, error) {
	select {
	case s.staging <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("stage blob: waiting for one of %d places: %w", StagingLimit, ctx.Err())
	}
	w, err := s.Create()
	if err != nil {
		<-s.staging
		return nil, err
	}
	w.release = func() { <-s.staging }
	return w, nil
}

// Write appends p to the blob.
func (w *Writer) Write(p []byte) (int, error) {
	if w.done {
		return 0, errors.New("write blob: already committed or aborted")
	}
	n, err := w.f.Write(p)
	w.h.Write(p[:n])
	w.n += int64(n)
	if err != nil {
		return n, fmt.Errorf("write blob: %w", err)
	}
	return n, nil
}

// Size is the number of bytes written so far.
func (w *Writer) Size() int64 { return w.n }

// Commit makes the blob durable under the SHA-256 of what was written and
// returns that hash (lowercase hex) and the size: its contents are fsynced
// before it is renamed into place, and its directory after, so a crash
// leaves either no blob or the whole blob under its name, never a prefix.
// On error nothing is left behind.
//
// Committing contents that are already stored renames over the old file:
// that costs the copy that was made anyway, repairs a copy that rotted on
// disk, and refreshes the modification time that GC's grace period relies on.
func (w *Writer) Commit() (sha string, size int64, err error) {
	if w.done {
		return "", 0, errors.New("commit blob: already committed or aborted")
	}
	defer func() {
		if err != nil {
			w.Abort()
		}
	}()
	f := w.f
	// Read-only, because a blob's contents are its name.
	if err := f.Chmod(0o444); err != nil {
		return "", 0, fmt.Errorf("commit blob: %w", err)
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("commit blob: sync: %w", err)
	}
	if err := f.Close(); err != nil {
		return "", 0, fmt.Errorf("commit blob: close: %w", err)
	}
	sha = hex.EncodeToString(w.h.Sum(nil))
	sub := filepath.Join(w.s.dir, sha[:2])
	if err := os.Mkdir(sub, 0o755); err == nil {
		// A new directory entry in the root must be durable before
		// anything inside it can be.
		if err := syncDir(w.s.dir); err != nil {
			return "", 0, fmt.Errorf("commit blob %s: %w", sha, err)
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return "", 0, fmt.Errorf("commit blob %s: %w", sha, err)
	}
	if err := os.Rename(f.Name(), filepath.Join(sub, sha)); err != nil {
		return "", 0, fmt.Errorf("commit blob %s: %w", sha, err)
	}
	w.finish()
	if err := syncDir(sub); err != nil {
		return "", 0, fmt.Errorf("commit blob %s: %w", sha, err)
	}
	return sha, w.n, nil
}

// Abort discards the blob: its temporary file is closed and removed. It is a
// no-op after Commit or a previous Abort, so it can be deferred.
func (w *Writer) Abort() {
	if w.done {
		return
	}
	w.f.Close()
	os.Remove(w.f.Name())
	w.finish()
}

func (w *Writer) finish() {
	w.done = true
	if w.release != nil {
		w.release()
		w.release = nil
	}
}

// Put stores everything r yields as a blob and returns its SHA-256 (lowercase
// hex) and size; see Writer.Commit for what makes it durable. ctx is checked
// between reads of r. On error nothing is left behind.
func (s *BlobStore) Put(ctx context.Context, r io.Reader) (sha string, size int64, err error) {
	w, err := s.Create()
	if err != nil {
		return "", 0, fmt.Errorf("put blob: %w", err)
	}
	defer w.Abort()
	if _, err := io.Copy(w, ctxReader{ctx, r}); err != nil {
		return "", 0, fmt.Errorf("put blob: %w", err)
	}
	sha, size, err = w.Commit()
	if err != nil {
		return "", 0, fmt.Errorf("put blob: %w", err)
	}
	return sha, size, nil
}

// syncDir fsyncs a directory, making the entries created or renamed in it
// durable; fsyncing a file does not do that for its name.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory: %w", err)
	}
	if err := d.Sync(); err != nil {
		d.Close()
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return d.Close()
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// Open opens a blob for reading without checking its contents; the *os.File
// can be served with http.ServeContent (ranges, sizes). A missing blob is
// ErrNotFound. Use OpenVerified or Verify where a damaged file must not be
// used unnoticed.
func (s *BlobStore) Open(sha string) (*os.File, error) {
	p, err := s.path(sha)
	if err != nil {
		return nil, fmt.Errorf("open %w", err)
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("open blob %s: %w", sha, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("open blob: %w", err)
	}
	return f, nil
}

// OpenVerified opens a blob for reading and hashes it as it is read. The
// final Read, where a plain file would return io.EOF, returns an error
// wrapping ErrCorrupt instead if the contents do not match the name, so a
// consumer that reads to the end cannot take a damaged shard for a good one.
// Data already returned before that error must be discarded.
func (s *BlobStore) OpenVerified(sha string) (io.ReadCloser, error) {
	f, err := s.Open(sha)
	if err != nil {
		return nil, err
	}
	return &verifyingReader{f: f, h: sha256.New(), want: sha}, nil
}

type verifyingReader struct {
	f    *os.File
	h    hash.Hash
	want string
	err  error // sticky once the end is reached
}

func (v *verifyingReader) Read(p []byte) (int, error) {
	if v.err != nil {
		return 0, v.err
	}
	n, err := v.f.Read(p)
	v.h.Write(p[:n])
	if err == io.EOF {
		if got := hex.EncodeToString(v.h.Sum(nil)); got != v.want {
			v.err = fmt.Errorf("blob %s: contents hash to %s: %w", v.want, got, ErrCorrupt)
		} else {
			v.err = io.EOF
		}
		return n, v.err
	}
	return n, err
}

func (v *verifyingReader) Close() error { return v.f.Close() }

// Verify reads a whole blob and returns an error wrapping ErrCorrupt if its
// contents do not hash to its name, ErrNotFound if it is missing. ctx is
// checked between reads.
func (s *BlobStore) Verify(ctx context.Context, sha string) error {
	r, err := s.OpenVerified(sha)
	if err != nil {
		return err
	}
	defer r.Close()
	if _, err := io.Copy(io.Discard, ctxReader{ctx, r}); err != nil {
		return fmt.Errorf("verify blob %s: %w", sha, err)
	}
	return nil
}

// Has reports whether the blob is stored. It does not check the contents.
func (s *BlobStore) Has(sha string) (bool, error) {
	p, err := s.path(sha)
	if err != nil {
		return false, err
	}
	_, err = os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat blob %s: %w", sha, err)
	}
	return true, nil
}

// Size returns a blob's size without opening it; a missing blob is
// ErrNotFound.
func (s *BlobStore) Size(sha string) (int64, error) {
	p, err := s.path(sha)
	if err != nil {
		return 0, fmt.Errorf("stat %w", err)
	}
	fi, err := os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, fmt.Errorf("stat blob %s: %w", sha, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("stat blob: %w", err)
	}
	return fi.Size(), nil
}

// Remove deletes a blob; a missing one is ErrNotFound. Removing a blob that a
// checkpoint still refers to breaks that checkpoint: prefer CollectGarbage.
func (s *BlobStore) Remove(sha string) error {
	p, err := s.path(sha)
	if err != nil {
		return fmt.Errorf("remove %w", err)
	}
	err = os.Remove(p)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove blob %s: %w", sha, ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("remove blob: %w", err)
	}
	return nil
}

// GCStats counts what a garbage collection did.
type GCStats struct {
	Kept         int   // blobs referenced, or too new to judge
	Removed      int   // unreferenced blobs removed
	RemovedBytes int64 // their total size
	Temps        int   // abandoned temporary files removed
}

// GC removes every blob for which keep returns false and that was last
// written before olderThan, and every temporary file of an interrupted Put
// older than that. Files it does not recognise are left alone.
//
// The age cutoff is what makes GC safe beside uploads: a blob is Put first
// and referenced by AddShard only afterwards, so a fresh blob that keep does
// not know yet must survive. Choose olderThan well before now — longer ago
// than any upload takes from Put to AddShard (an hour is generous).
//
// Subdirectories are never removed, even empty: a Put may be about to rename
// a blob into one.
func (s *BlobStore) GC(ctx context.Context, keep func(sha string) bool, olderThan time.Time) (GCStats, error) {
	var st GCStats
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return st, fmt.Errorf("collect garbage: %w", err)
	}
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return st, fmt.Errorf("collect garbage: %w", err)
		}
		name := e.Name()
		switch {
		case strings.HasPrefix(name, tempPrefix) && e.Type().IsRegular():
			removed, _, err := removeIfOlder(filepath.Join(s.dir, name), olderThan)
			if err != nil {
				return st, fmt.Errorf("collect garbage: %w", err)
			}
			if removed {
				st.Temps++
			}
		case e.IsDir() && len(name) == 2 && isLowerHex(name):
			if err := s.gcDir(ctx, name, keep, olderThan, &st); err != nil {
				return st, fmt.Errorf("collect garbage: %w", err)
			}
		}
	}
	return st, nil
}

func (s *BlobStore) gcDir(ctx context.Context, prefix string, keep func(string) bool, olderThan time.Time, st *GCStats) error {
	dir := filepath.Join(s.dir, prefix)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return err
		}
		sha := e.Name()
		if !ValidSHA256(sha) || sha[:2] != prefix || !e.Type().IsRegular() {
			continue
		}
		if keep(sha) {
			st.Kept++
			continue
		}
		removed, size, err := removeIfOlder(filepath.Join(dir, sha), olderThan)
		if err != nil {
			return err
		}
		if removed {
			st.Removed++
			st.RemovedBytes += size
		} else {
			st.Kept++
		}
	}
	return nil
}

// removeIfOlder removes path if its modification time is before cutoff. The
// time is read immediately before the removal to keep the window in which a
// concurrent Put could refresh it as small as possible.
func removeIfOlder(path string, cutoff time.Time) (removed bool, size int64, err error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, err
	}
	if !fi.ModTime().Before(cutoff) {
		return false, 0, nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, 0, err
	}
	return true, fi.Size(), nil
}

// CollectGarbage removes from blobs every blob older than olderThan that no
// checkpoint shard in db refers to; see BlobStore.GC for why the age cutoff
// matters. Run it after deleting or pruning checkpoints.
func CollectGarbage(ctx context.Context, db *DB, blobs *BlobStore, olderThan time.Time) (GCStats, error) {
	refs, err := db.ReferencedBlobs(ctx)
	if err != nil {
		return GCStats{}, fmt.Errorf("collect garbage: %w", err)
	}
	return blobs.GC(ctx, func(sha string) bool { return refs[sha] }, olderThan)
}
