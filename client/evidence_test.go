package client

import (
	"bytes"
	"io"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"

	"github.com/shoal-ml/shoal/safetensors"
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

// TestSnapshotLent: at a Clip, evidence uploads still reading the snapshot from memory keep it,
// and the Clip's copy goes into another buffer — one lent at a time, and only where the memory
// allows it (spareOK); the rest are written to spills. A lent buffer whose uploads ended is the
// next spare. What an upload reads is the snapshot of its own step throughout.
func TestSnapshotLent(t *testing.T) {
	state := func(v float32) []safetensors.Tensor {
		return []safetensors.Tensor{{Name: "w", Shape: []int{3}, Data: []float32{v, v + 1, v + 2}}}
	}
	// upload is an upload of b's memory, and the bytes it must read.
	upload := func(b *stateBuffers) (*memBody, []byte) {
		mem := unsafe.Slice((*byte)(unsafe.Pointer(&b.tensors[0].Data[0])), 12)
		mb, err := newMemBody([][]byte{mem}, 1<<10)
		if err != nil {
			t.Fatal(err)
		}
		return mb, slices.Clone(mem)
	}
	reads := func(mb *memBody, want []byte) {
		t.Helper()
		got, err := io.ReadAll(mb.again())
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("the upload read %x (%v), want %x", got, err, want)
		}
	}
	tr := &trainer{spareOK: true}
	tr.snap = tr.snap.copyOf(state(1)) // Clip of step 1
	a := tr.snap
	up1, want1 := upload(a) // its audit, just before the next Clip
	tr.uploads = []*memBody{up1}
	tr.freeSnapshot() // Clip of step 2
	if tr.lent != a || tr.snap == a || !up1.readsMemory() {
		t.Fatalf("the upload's snapshot was not lent: lent %p, snap %p, a %p", tr.lent, tr.snap, a)
	}
	tr.snap = tr.snap.copyOf(state(10))
	reads(up1, want1)
	up2, want2 := upload(tr.snap)
	tr.uploads = []*memBody{up2}
	tr.freeSnapshot() // Clip of step 3, step 1's upload still going: step 2's goes to a spill
	if up2.readsMemory() || tr.lent != a {
		t.Fatal("a second buffer was lent, or step 2's upload was not written out")
	}
	tr.snap = tr.snap.copyOf(state(20))
	reads(up1, want1)
	reads(up2, want2)
	up1.Close()
	up2.Close()
	tr.freeSnapshot() // Clip of step 4: step 1's upload is over, its buffer the spare
	if tr.lent != nil || tr.spare != a {
		t.Fatal("the buffer of an upload that ended did not come back")
	}
	b := tr.snap
	up3, want3 := upload(b)
	tr.uploads = []*memBody{up3}
	tr.freeSnapshot()
	if tr.lent != b || tr.snap != a || tr.spare != nil {
		t.Fatal("the spare was not taken for the next snapshot")
	}
	tr.snap = tr.snap.copyOf(state(30))
	reads(up3, want3)
	up3.Close()

	// No room for a second snapshot: every upload still reading is written out.
	tr = &trainer{}
	tr.snap = tr.snap.copyOf(state(1))
	up4, want4 := upload(tr.snap)
	tr.uploads = []*memBody{up4}
	tr.freeSnapshot()
	if up4.readsMemory() || tr.lent != nil {
		t.Fatal("a snapshot was lent without room for a second")
	}
	tr.snap = tr.snap.copyOf(state(5))
	reads(up4, want4)
	up4.Close()
}
