package client

import (
	"bytes"
	"errors"
	"io"
	"os"
	"runtime"
	"testing"
)

// TestSpill: an upload is written to a file that is gone from the directory at once (Unix) and
// closed after, read back whole with its size; a failed write is an error with nothing left.
func TestSpill(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir)
	payload := bytes.Repeat([]byte("shoal"), 100_000)
	sp, err := newSpill(int64(len(payload)), int64(len(payload)), func(w io.Writer) error { _, err := w.Write(payload); return err })
	if err != nil {
		t.Fatal(err)
	}
	if sp.file == nil {
		t.Fatal("held in memory where a file could be made")
	}
	if ents, _ := os.ReadDir(dir); runtime.GOOS != "windows" && len(ents) != 0 {
		t.Errorf("the spill is visible in %s: %v", dir, ents)
	}
	got, err := io.ReadAll(sp)
	if err != nil || !bytes.Equal(got, payload) || sp.size != int64(len(payload)) {
		t.Fatalf("read back %d bytes (%v), size %d; wrote %d", len(got), err, sp.size, len(payload))
	}
	if err := sp.Close(); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}

	boom := errors.New("boom")
	if _, err := newSpill(int64(len(payload)), int64(len(payload)), func(w io.Writer) error { w.Write(payload); return boom }); !errors.Is(err, boom) {
		t.Fatalf("a failed write: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("a failed spill left %v", ents)
	}
	// A spill past its cap fails, and leaves nothing either.
	if _, err := newSpill(int64(len(payload))-1, int64(len(payload))-1, func(w io.Writer) error { _, err := w.Write(payload); return err }); err == nil {
		t.Fatal("a spill past its cap was taken")
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("a spill past its cap left %v", ents)
	}

	// Where no file can be made (a browser tab), the upload is held in memory, whole.
	t.Setenv("TMPDIR", dir+"/missing")
	sp, err = newSpill(int64(len(payload)), int64(len(payload)), func(w io.Writer) error { _, err := w.Write(payload); return err })
	if err != nil || sp.file != nil {
		t.Fatalf("without a temporary directory: %v, file %v", err, sp.file)
	}
	if got, _ := io.ReadAll(sp); !bytes.Equal(got, payload) {
		t.Fatal("the in-memory spill reads back wrong")
	}
}
