package client

import (
	"errors"
	"io"
	"sync"
)

// An audit's evidence used to be written to a file (a spill) before its upload, and read back
// from it: two copies of the bundle through the kernel, on every audited step — with the state's
// digest, most of what auditing cost a worker's CPU (docs/benchmarks.md, "What audits cost"). A
// lean bundle (the start state kept at the step's Clip, and the tensors received) lies in memory
// that does not change until the next Clip: it is uploaded from there (memBody). An audit comes
// just before that Clip (it is drawn once the next step's reports are in), so at the Clip the
// upload has barely begun: where the worker's memory holds a second snapshot, the Clip copies
// into that and leaves the first to the upload (trainer.freeSnapshot: one lent at a time);
// otherwise, or with one lent already, the upload is written to a spill (detach) and goes on
// from there. The first snapshot is the evidence's own memory, which the planner counts; the
// second is taken only from what the worker offered beyond its shard.

// uploadBody is what an upload reads, from its start at every try.
type uploadBody interface {
	again() io.Reader
	length() int64
	Close() error
}

func (s *spill) length() int64 { return s.size }

// memBody is an upload read from the bundle's own memory (audit.Bundle.Segments) until detach
// writes what it holds to a spill; reads after that come from the spill. Safe for an upload's
// reads and the executor's detach at once.
type memBody struct {
	mu     sync.Mutex
	segs   [][]byte // nil once detached or closed
	starts []int64  // each segment's offset in the bundle
	size   int64
	file   *spill // after detach
	limit  int64  // a spill's cap
	closed bool
	copied bool // detach found no room for a spill: segs is a copy of the bundle's own
}

func newMemBody(segs [][]byte, limit int64) (*memBody, error) {
	b := &memBody{segs: segs, limit: limit}
	for _, s := range segs {
		b.starts = append(b.starts, b.size)
		b.size += int64(len(s))
	}
	if b.size > limit {
		return nil, errors.New("evidence past its cap of the size its shard implies")
	}
	return b, nil
}

func (b *memBody) length() int64 { return b.size }

func (b *memBody) again() io.Reader { return io.NewSectionReader(b, 0, b.size) }

// ReadAt reads the bundle at off, from memory or, once detached, from its spill.
func (b *memBody) ReadAt(p []byte, off int64) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.closed:
		return 0, errors.New("evidence upload closed")
	case b.file != nil:
		return b.file.Reader.(io.ReaderAt).ReadAt(p, off)
	case off >= b.size:
		return 0, io.EOF
	}
	n := 0
	for i, s := range b.segs {
		if n == len(p) {
			break
		}
		end := b.starts[i] + int64(len(s))
		if off >= end {
			continue
		}
		c := copy(p[n:], s[off-b.starts[i]:])
		n += c
		off += int64(c)
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// detach writes the bundle to a spill, unless its upload is over, so that the memory it lies in
// may change: the executor calls it before the next update. Where no spill can be written (a
// full disk), the bundle is copied into one buffer instead: an upload that stopped midway would
// cost an honest worker its audit.
func (b *memBody) detach() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.segs == nil || b.copied {
		return
	}
	write := func(w io.Writer) error {
		for _, s := range b.segs {
			if _, err := w.Write(s); err != nil {
				return err
			}
		}
		return nil
	}
	sp, err := newSpill(b.size, b.limit, write)
	if err != nil {
		buf := make([]byte, 0, b.size)
		for _, s := range b.segs {
			buf = append(buf, s...)
		}
		b.segs, b.starts, b.copied = [][]byte{buf}, []int64{0}, true
		return
	}
	b.file, b.segs, b.starts = sp, nil, nil
}

// readsMemory reports whether b still reads the memory the bundle lies in: neither detached nor
// closed.
func (b *memBody) readsMemory() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.closed && b.segs != nil && b.file == nil && !b.copied
}

// Close ends the body: its spill, if any, is removed and the memory let go.
func (b *memBody) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed, b.segs, b.starts = true, nil, nil
	if b.file != nil {
		return b.file.Close()
	}
	return nil
}
