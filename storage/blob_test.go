package storage

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

func openTestBlobs(t *testing.T) *BlobStore {
	t.Helper()
	s, err := OpenBlobStore(filepath.Join(t.TempDir(), "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestBlobRoundTrip(t *testing.T) {
	s := openTestBlobs(t)
	ctx := t.Context()
	data := bytes.Repeat([]byte("safetensors shard "), 10_000)
	sum := sha256.Sum256(data)
	want := hex.EncodeToString(sum[:])

	got, size, err := s.Put(ctx, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	if got != want || size != int64(len(data)) {
		t.Errorf("Put = %s, %d; want %s, %d", got, size, want, len(data))
	}
	fi, err := os.Stat(filepath.Join(s.Dir(), want[:2], want))
	if err != nil {
		t.Fatalf("blob not at <dir>/<aa>/<sha256>: %v", err)
	}
	if fi.Mode().Perm()&0o222 != 0 {
		t.Errorf("blob mode %v is writable", fi.Mode())
	}
	if has, err := s.Has(want); !has || err != nil {
		t.Errorf("Has = %v, %v", has, err)
	}

	f, err := s.Open(want)
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := io.ReadAll(f)
	f.Close()
	r, err := s.OpenVerified(want)
	if err != nil {
		t.Fatal(err)
	}
	verified, err := io.ReadAll(r)
	r.Close()
	if err != nil || !bytes.Equal(plain, data) || !bytes.Equal(verified, data) {
		t.Errorf("read back: plain %d bytes, verified %d bytes, %v", len(plain), len(verified), err)
	}
	if err := s.Verify(ctx, want); err != nil {
		t.Errorf("Verify: %v", err)
	}

	// Storing the same contents again is fine and yields the same name.
	again, _, err := s.Put(ctx, bytes.NewReader(data))
	if err != nil || again != want {
		t.Errorf("second Put = %s, %v", again, err)
	}
	assertNoTemps(t, s)

	if err := s.Remove(want); err != nil {
		t.Fatal(err)
	}
	if has, _ := s.Has(want); has {
		t.Errorf("Has after Remove = true")
	}
	if err := s.Remove(want); !errors.Is(err, ErrNotFound) {
		t.Errorf("second Remove = %v, want ErrNotFound", err)
	}
	if _, err := s.Open(want); !errors.Is(err, ErrNotFound) {
		t.Errorf("Open after Remove = %v, want ErrNotFound", err)
	}
}

func TestBlobEmpty(t *testing.T) {
	s := openTestBlobs(t)
	got, size, err := s.Put(t.Context(), strings.NewReader(""))
	if err != nil || size != 0 || got != "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" {
		t.Errorf("Put(empty) = %s, %d, %v", got, size, err)
	}
}

func TestBlobCorruptionDetected(t *testing.T) {
	s := openTestBlobs(t)
	ctx := t.Context()
	data := []byte("the parameters of stage 0, as of step 100")
	h, _, err := s.Put(ctx, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	// Flip one bit on disk, as a failing disk would.
	path := filepath.Join(s.Dir(), h[:2], h)
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(data)
	bad[7] ^= 1
	if err := os.WriteFile(path, bad, 0o644); err != nil {
		t.Fatal(err)
	}

	if err := s.Verify(ctx, h); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Verify = %v, want ErrCorrupt", err)
	}
	r, err := s.OpenVerified(h)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(r); !errors.Is(err, ErrCorrupt) {
		t.Errorf("reading a corrupt blob to the end = %v, want ErrCorrupt", err)
	}
	r.Close()

	// Putting the good contents again repairs it.
	if _, _, err := s.Put(ctx, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if err := s.Verify(ctx, h); err != nil {
		t.Errorf("Verify after repair: %v", err)
	}
}

func TestBlobRejectsMalformedHashes(t *testing.T) {
	s := openTestBlobs(t)
	good := sha("x")
	for _, h := range []string{
		"",
		"abc",
		strings.ToUpper(good),
		good + "0",
		"../" + good[3:],
		"/etc/passwd",
		good[:62] + "/.",
		good[:63] + "g",
	} {
		if _, err := s.Open(h); !errors.Is(err, ErrInvalid) {
			t.Errorf("Open(%q) = %v, want ErrInvalid", h, err)
		}
		if _, err := s.Has(h); !errors.Is(err, ErrInvalid) {
			t.Errorf("Has(%q) = %v, want ErrInvalid", h, err)
		}
		if err := s.Remove(h); !errors.Is(err, ErrInvalid) {
			t.Errorf("Remove(%q) = %v, want ErrInvalid", h, err)
		}
		if err := s.Verify(t.Context(), h); !errors.Is(err, ErrInvalid) {
			t.Errorf("Verify(%q) = %v, want ErrInvalid", h, err)
		}
	}
}

func TestBlobPutFailureLeavesNothing(t *testing.T) {
	s := openTestBlobs(t)
	if _, _, err := s.Put(t.Context(), iotest.ErrReader(errors.New("connection reset"))); err == nil {
		t.Errorf("Put from a failing reader succeeded")
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, _, err := s.Put(ctx, strings.NewReader("data")); !errors.Is(err, context.Canceled) {
		t.Errorf("Put with a cancelled context = %v, want context.Canceled", err)
	}
	entries, _ := os.ReadDir(s.Dir())
	if len(entries) != 0 {
		t.Errorf("failed Puts left %v", entries)
	}
}

func TestBlobGC(t *testing.T) {
	s := openTestBlobs(t)
	ctx := t.Context()
	put := func(data string) string {
		h, _, err := s.Put(ctx, strings.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	old := time.Now().Add(-2 * time.Hour)
	age := func(path string) {
		if err := os.Chtimes(path, old, old); err != nil {
			t.Fatal(err)
		}
	}
	referenced, orphan, fresh := put("referenced"), put("orphan"), put("fresh orphan")
	age(filepath.Join(s.Dir(), referenced[:2], referenced))
	age(filepath.Join(s.Dir(), orphan[:2], orphan))
	staleTemp := filepath.Join(s.Dir(), tempPrefix+"123")
	os.WriteFile(staleTemp, []byte("half an upload"), 0o600)
	age(staleTemp)
	liveTemp := filepath.Join(s.Dir(), tempPrefix+"456")
	os.WriteFile(liveTemp, []byte("an upload in progress"), 0o600)
	stranger := filepath.Join(s.Dir(), "README")
	os.WriteFile(stranger, []byte("not a blob"), 0o644)
	age(stranger)

	st, err := s.GC(ctx, func(h string) bool { return h == referenced }, time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if st != (GCStats{Kept: 2, Removed: 1, RemovedBytes: int64(len("orphan")), Temps: 1}) {
		t.Errorf("GC = %+v", st)
	}
	for path, want := range map[string]bool{
		filepath.Join(s.Dir(), referenced[:2], referenced): true,
		filepath.Join(s.Dir(), fresh[:2], fresh):           true, // too new to judge
		filepath.Join(s.Dir(), orphan[:2], orphan):         false,
		staleTemp: false,
		liveTemp:  true,
		stranger:  true,
	} {
		if _, err := os.Stat(path); (err == nil) != want {
			t.Errorf("%s exists = %v, want %v", filepath.Base(path), err == nil, want)
		}
	}
}

// TestCollectGarbage runs GC against the shards a database refers to, after
// retention deleted a checkpoint.
func TestCollectGarbage(t *testing.T) {
	db, _ := openTestDB(t)
	s := openTestBlobs(t)
	ctx := t.Context()
	id := newJob(t, db)
	var cps []int64
	var hashes []string
	for step := int64(10); step <= 20; step += 10 {
		h, n, err := s.Put(ctx, strings.NewReader("stage0 at "+string(rune('0'+step/10))))
		if err != nil {
			t.Fatal(err)
		}
		cp, err := db.BeginCheckpoint(ctx, id, step, []string{"stage0"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.AddShard(ctx, cp.ID, "stage0", h, n); err != nil {
			t.Fatal(err)
		}
		cps, hashes = append(cps, cp.ID), append(hashes, h)
	}
	if _, err := db.PruneCheckpoints(ctx, id, 1); err != nil {
		t.Fatal(err)
	}
	// A cutoff in the future treats every blob as old enough.
	st, err := CollectGarbage(ctx, db, s, time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if st.Removed != 1 || st.Kept != 1 {
		t.Errorf("CollectGarbage = %+v, want 1 removed, 1 kept", st)
	}
	if has, _ := s.Has(hashes[0]); has {
		t.Errorf("blob of the pruned checkpoint survived")
	}
	if err := s.Verify(ctx, hashes[1]); err != nil {
		t.Errorf("blob of the kept checkpoint: %v", err)
	}
}

func assertNoTemps(t *testing.T, s *BlobStore) {
	t.Helper()
	entries, _ := os.ReadDir(s.Dir())
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), tempPrefix) {
			t.Errorf("temporary file %s left behind", e.Name())
		}
	}
}

// A Writer's bytes are invisible until Commit; Abort, and a failed check before Commit, leave
// nothing behind.
func TestBlobWriter(t *testing.T) {
	s := openTestBlobs(t)
	w, err := s.Create()
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(w, "<html>not a shard</html>")
	if w.Size() != int64(len("<html>not a shard</html>")) {
		t.Errorf("Size = %d", w.Size())
	}
	w.Abort()
	w.Abort() // idempotent
	if entries, _ := os.ReadDir(s.Dir()); len(entries) != 0 {
		t.Errorf("aborted writer left %v", entries)
	}
	if _, _, err := w.Commit(); err == nil {
		t.Error("Commit after Abort succeeded")
	}

	w, err = s.Create()
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("shard "), 1000)
	w.Write(data[:10])
	w.Write(data[10:])
	sha, size, err := w.Commit()
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if sha != hex.EncodeToString(sum[:]) || size != int64(len(data)) {
		t.Errorf("Commit = %s, %d", sha, size)
	}
	w.Abort() // a no-op after Commit
	if n, err := s.Size(sha); err != nil || n != size {
		t.Errorf("Size(%s) = %d, %v", sha, n, err)
	}
	if err := s.Verify(t.Context(), sha); err != nil {
		t.Error(err)
	}
	if entries, _ := os.ReadDir(s.Dir()); len(entries) != 1 {
		t.Errorf("store holds %v, want only the blob's directory", entries)
	}
	if _, err := s.Size(strings.Repeat("0", 64)); !errors.Is(err, ErrNotFound) {
		t.Errorf("Size of a missing blob = %v, want ErrNotFound", err)
	}
}

// At most StagingLimit Stage writers are open at once; the next waits until one ends or its
// context does.
func TestBlobStageLimit(t *testing.T) {
	s := openTestBlobs(t)
	var open []*Writer
	for range StagingLimit {
		w, err := s.Stage(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, w)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if _, err := s.Stage(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stage past the limit = %v, want to wait until the deadline", err)
	}
	// Trusted writers do not queue behind uploads.
	if _, _, err := s.Put(t.Context(), strings.NewReader("assembled")); err != nil {
		t.Errorf("Put while staging is full: %v", err)
	}
	got := make(chan error, 1)
	go func() {
		w, err := s.Stage(t.Context())
		if err == nil {
			w.Abort()
		}
		got <- err
	}()
	open[0].Abort()
	io.WriteString(open[1], "x")
	if _, _, err := open[1].Commit(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Errorf("Stage after a place freed: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Stage still waiting after a place freed")
	}
	for _, w := range open[2:] {
		w.Abort()
	}
}

// OpenBlobStore removes the temporary files of writers that died (a crash between create and
// rename), and leaves those being written.
func TestOpenBlobStoreRemovesStaleTemps(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "blobs")
	s, err := OpenBlobStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(dir, tempPrefix+"dead")
	live := filepath.Join(dir, tempPrefix+"live")
	os.WriteFile(stale, []byte("half an upload"), 0o600)
	os.WriteFile(live, []byte("an upload in progress"), 0o600)
	old := time.Now().Add(-StaleTempAge - time.Minute)
	os.Chtimes(stale, old, old)
	sha, _, err := s.Put(t.Context(), strings.NewReader("a blob"))
	if err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(dir, sha[:2], sha)
	os.Chtimes(blob, old, old)
	if _, err := OpenBlobStore(dir); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]bool{stale: false, live: true, blob: true} {
		if _, err := os.Stat(path); (err == nil) != want {
			t.Errorf("%s exists = %v, want %v", filepath.Base(path), err == nil, want)
		}
	}
}
