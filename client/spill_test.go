package client

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"runtime"
	"strings"
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

// TestCheckpointSupersedes: a checkpoint of a later step cancels the upload of an earlier one
// still in flight and takes its spill — the coordinator keeps only its newest, and refusing the
// newer left a job waiting for its final checkpoint — and so does the same step's asked again
// (a newer id: a replica dropped while it was taken), while a request for an earlier step, or
// the same step under an older or the same id, is refused, so that a flood of requests holds
// one checkpoint spill.
func TestCheckpointSupersedes(t *testing.T) {
	var s spillSlots
	// upload is the cancel of an upload that ends when cancelled, giving its spill back.
	upload := func() (context.CancelFunc, <-chan struct{}) {
		cancelled := make(chan struct{})
		go func() {
			<-cancelled
			s.doneCheckpoint()
		}()
		return func() { close(cancelled) }, cancelled
	}
	c2, cancelled2 := upload()
	if err := s.takeCheckpoint(2, 5, c2); err != nil {
		t.Fatal(err)
	}
	for _, r := range [][2]int{{1, 5}, {2, 5}, {9, 4}} {
		if err := s.takeCheckpoint(int64(r[0]), uint64(r[1]), func() {}); err == nil || !strings.Contains(err.Error(), "one checkpoint at a time") {
			t.Fatalf("checkpoint %d of step %d while checkpoint 2 of step 5 uploads: %v, want refused", r[0], r[1], err)
		}
	}
	c3, cancelled3 := upload()
	if err := s.takeCheckpoint(3, 5, c3); err != nil {
		t.Fatalf("checkpoint 3 of step 5, asked again while checkpoint 2 uploads: %v, want it to supersede", err)
	}
	if err := s.takeCheckpoint(4, 6, func() {}); err != nil {
		t.Fatalf("a checkpoint of step 6 while step 5's uploads: %v, want it to supersede", err)
	}
	for i, c := range []<-chan struct{}{cancelled2, cancelled3} {
		select {
		case <-c:
		default:
			t.Fatalf("superseded upload %d was not cancelled", i+2)
		}
	}
	if s.n != 1 || s.ckpt != 4 {
		t.Fatalf("%d spills held, checkpoint %d: want 1, 4", s.n, s.ckpt)
	}
}

// TestAuditSpillsForEveryOpenAudit: a worker uploading a checkpoint takes the evidence of as
// many audits as an honest coordinator keeps open (4) — a refused audit is never uploaded, and
// its silence would look like a cheat — and refuses more.
func TestAuditSpillsForEveryOpenAudit(t *testing.T) {
	var s spillSlots
	if err := s.takeCheckpoint(1, 5, func() {}); err != nil {
		t.Fatal(err)
	}
	for i := range maxAuditSpills {
		if err := s.takeAudit(uint64(i)); err != nil {
			t.Fatalf("audit %d with a checkpoint uploading: %v", i, err)
		}
	}
	if err := s.takeAudit(9); err == nil {
		t.Fatal("a fifth audit's evidence taken: want it refused")
	}
	s.doneAudit()
	if err := s.takeAudit(10); err != nil {
		t.Fatalf("an audit once one upload ended: %v", err)
	}
}
