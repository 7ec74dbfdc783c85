package client

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/safetensors"
)

// A checkpoint shard or an audit's evidence is as large as the shard's state (12 bytes per
// parameter; the evidence twice that), and it is uploaded while the next steps run. Held in a
// growing bytes.Buffer it cost up to twice its size in memory at once (the buffer doubles and
// copies), on top of the shard — a worker of the large model capped at 1.2 GB peaked at 6 GB
// and was killed by the OS. So an upload is written to a file first (a spill) and streamed from
// it: the memory an upload costs is a copy buffer, and the shard may change again as soon as the
// file is written. Where there is no file system (a browser tab: Go's js/wasm os returns ENOSYS),
// it is held in memory, in one allocation of its final size when the size is known. Lean
// evidence, which lies in memory kept for it anyway, is read from there and spilled only when its
// upload outlasts its step (evidence.go).

// A coordinator asks for checkpoints and evidence, and a hostile or broken one could ask for them
// faster than they upload (or never answer an upload): each request would take a file the size
// of the shard's state until its upload ended. So a worker holds at most one checkpoint's spill
// and maxAuditSpills audits', each capped at the size its shard's state implies, and a request
// beyond that is refused and logged; every upload is bounded in time (coordhttp.go), and its spill
// goes with it.

// maxAuditSpills bounds the evidence spills a worker holds at once: as many as an honest
// coordinator keeps audits open (coordinator's maxOpenAudits), so that no honest audit is refused
// — a refused one is never uploaded, and the coordinator would take the silence for a cheat — when
// a slow uplink is still sending earlier evidence.
const maxAuditSpills = 4

// spillSlots counts a worker's spills in flight, across its sessions.
type spillSlots struct {
	mu     sync.Mutex
	n      int // spills held: the checkpoint's and the audits'
	audits int
	audit  uint64 // the step of the last audit taken
	// The checkpoint being uploaded (ckpt 0: none): its step, how to cancel its upload, and a
	// channel closed when its spill is given back.
	ckpt     int64
	ckStep   uint64
	ckCancel context.CancelFunc
	ckDone   chan struct{}
}

// supersedeWait bounds how long a newer checkpoint waits for the upload it cancels to let go.
const supersedeWait = 10 * time.Second

// takeCheckpoint reserves the checkpoint spill for checkpoint id of step, whose upload cancel
// stops. A checkpoint of a later step supersedes one still uploading — the coordinator keeps only
// its newest complete checkpoint, and a worker that refused the newer one left a job whose final
// checkpoint came while the last periodic one was still uploading waiting for ever — so the older
// upload is cancelled and its spill waited for (briefly). So does a newer checkpoint of the same
// step (a larger id): the coordinator asks a step's checkpoint again when a replica was dropped
// while it was taken (in outer mode the replicas gather int8's error feedback for it, and one
// that refused would leave the others waiting). A request for an earlier step, or for the same
// step under an id not newer, is refused: a flood of requests holds one checkpoint spill.
func (s *spillSlots) takeCheckpoint(id int64, step uint64, cancel context.CancelFunc) error {
	s.mu.Lock()
	if s.ckpt != 0 && (step > s.ckStep || step == s.ckStep && id > s.ckpt) {
		old, done := s.ckCancel, s.ckDone
		s.mu.Unlock()
		old()
		select {
		case <-done:
		case <-time.After(supersedeWait):
		}
		s.mu.Lock()
	}
	defer s.mu.Unlock()
	switch {
	case s.ckpt != 0:
		return fmt.Errorf("checkpoint %d (step %d) is still uploading: one checkpoint at a time", s.ckpt, s.ckStep)
	}
	s.n++
	s.ckpt, s.ckStep, s.ckCancel, s.ckDone = id, step, cancel, make(chan struct{})
	return nil
}

func (s *spillSlots) doneCheckpoint() {
	s.mu.Lock()
	s.n--
	s.ckpt, s.ckCancel = 0, nil
	close(s.ckDone)
	s.mu.Unlock()
}

// takeAudit reserves a spill for the evidence of step, or says why there is none.
func (s *spillSlots) takeAudit(step uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.audits >= maxAuditSpills {
		return fmt.Errorf("the evidence of %d audits is still uploading (the last of step %d): at most %d at a time", s.audits, s.audit, maxAuditSpills)
	}
	s.n++
	s.audits++
	s.audit = step
	return nil
}

func (s *spillSlots) doneAudit() {
	s.mu.Lock()
	s.n--
	s.audits--
	s.mu.Unlock()
}

// spill is an upload body written once and read once — or, for evidence that must reach the
// coordinator through a lost connection, again from its start (again).
type spill struct {
	io.Reader
	file *os.File // nil when held in memory
	size int64
}

// newSpill runs write against a temporary file, or a buffer of sizeHint bytes when no file can be
// made, and returns the body to upload; writing more than limit bytes fails. Close it after the
// upload.
func newSpill(sizeHint, limit int64, write func(io.Writer) error) (*spill, error) {
	if f, err := os.CreateTemp("", "shoal-upload-*"); err == nil {
		// Unlinked at once on Unix: the file goes with its last descriptor, even if this
		// process is killed mid-upload.
		os.Remove(f.Name())
		sp := &spill{Reader: f, file: f}
		if err := write(&capWriter{w: f, left: limit}); err != nil {
			sp.Close()
			return nil, err
		}
		size, err := f.Seek(0, io.SeekCurrent)
		if err == nil {
			_, err = f.Seek(0, io.SeekStart)
		}
		if err != nil {
			sp.Close()
			return nil, err
		}
		sp.size = size
		return sp, nil
	}
	buf := bytes.NewBuffer(make([]byte, 0, min(max(sizeHint, 0), limit)))
	if err := write(&capWriter{w: buf, left: limit}); err != nil {
		return nil, err
	}
	return &spill{Reader: bytes.NewReader(buf.Bytes()), size: int64(buf.Len())}, nil
}

// again returns a reader of the whole spill from its start, for another try at uploading it (an
// audit's evidence after a lost connection). It reads at offsets, so that tries share nothing but
// the bytes; it must not be used once the spill is closed.
func (s *spill) again() io.Reader {
	return io.NewSectionReader(s.Reader.(io.ReaderAt), 0, s.size)
}

// Close removes the spill's file.
func (s *spill) Close() error {
	if s.file == nil {
		return nil
	}
	name := s.file.Name()
	err := s.file.Close()
	os.Remove(name) // where unlinking an open file failed (Windows)
	return err
}

// capWriter fails a write past its cap.
type capWriter struct {
	w    io.Writer
	left int64
}

func (c *capWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > c.left {
		return 0, fmt.Errorf("upload past its cap of the size its shard implies (%d bytes left, %d more written)", c.left, len(p))
	}
	c.left -= int64(len(p))
	return c.w.Write(p)
}

// fileBytes bounds the safetensors file of ts: its payload, and a header of at most
// headerPerTensor bytes per tensor beyond its name, and headerSlack.
func fileBytes(ts []safetensors.Tensor) int64 {
	n := 8 + stateBytes(ts) + headerSlack
	for _, t := range ts {
		n += int64(len(t.Name)) + headerPerTensor
	}
	return n
}

// stateBytes is the payload of ts, for a spill's size hint (headers add little).
func stateBytes(ts []safetensors.Tensor) int64 {
	var n int64
	for _, t := range ts {
		n += 4 * int64(len(t.Data))
	}
	return n
}
