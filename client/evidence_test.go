package client

import (
	"bytes"
	"io"
	"math/rand/v2"
	"testing"
)

// TestMemBodyDetach: an evidence upload read from memory reads the bundle's bytes exactly,
// segment boundaries or not, and goes on reading the same bytes after detach wrote them out and
// the memory changed (the next update overwrites the start state kept) — from any offset, as a
// retry does.
func TestMemBodyDetach(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	var segs [][]byte
	var want []byte
	for _, n := range []int{13, 0, 1, 4096, 70000, 5, 33333} {
		s := make([]byte, n)
		for i := range s {
			s[i] = byte(r.Uint32())
		}
		segs = append(segs, s)
		want = append(want, s...)
	}
	b, err := newMemBody(segs, int64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	if b.length() != int64(len(want)) {
		t.Fatalf("length %d, want %d", b.length(), len(want))
	}
	// Random reads, in memory.
	for range 200 {
		off := r.IntN(len(want) + 10)
		p := make([]byte, r.IntN(9000))
		n, err := b.ReadAt(p, int64(off))
		end := min(off+len(p), len(want))
		if off >= len(want) {
			end = off
		}
		if n != end-off || !bytes.Equal(p[:n], want[off:end]) || (end < off+len(p)) != (err == io.EOF) {
			t.Fatalf("ReadAt(%d bytes, %d) = %d, %v", len(p), off, n, err)
		}
	}
	// An upload halfway when the Clip comes.
	up := b.again()
	half := make([]byte, len(want)/2)
	if _, err := io.ReadFull(up, half); err != nil {
		t.Fatal(err)
	}
	b.detach()
	for _, s := range segs {
		for i := range s {
			s[i] ^= 0xff // the next update
		}
	}
	rest, err := io.ReadAll(up)
	if err != nil {
		t.Fatal(err)
	}
	if got := append(half, rest...); !bytes.Equal(got, want) {
		t.Fatal("the upload read other bytes once the memory changed after detach")
	}
	if again, err := io.ReadAll(b.again()); err != nil || !bytes.Equal(again, want) {
		t.Fatalf("a retry after detach: %v", err)
	}
	b.detach() // twice: nothing more
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReadAt(make([]byte, 1), 0); err == nil {
		t.Fatal("read after Close")
	}
	b.detach() // after Close: nothing
	if _, err := newMemBody(segs, int64(len(want))-1); err == nil {
		t.Fatal("a body past its cap was taken")
	}
}
