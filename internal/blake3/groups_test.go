package blake3

import (
	"testing"

	zb "github.com/zeebo/blake3"
)

// TestGroups holds the tree opened at a level of groups to zeebo/blake3's hash of the whole
// input: the groups' chaining values rebuild it, each group's own bytes give its entry, and a
// group's bytes changed or moved to another group's place do not.
func TestGroups(t *testing.T) {
	for _, gc := range []int{1, 2, 16, 64} {
		for _, n := range sizes() {
			b := input(n)
			want := zb.Sum256(b)
			sum, cvs := Groups(b, gc)
			if sum != want {
				t.Fatalf("groups of %d chunks, %d bytes: %x, zeebo/blake3 %x", gc, n, sum, want)
			}
			g := gc * chunkLen
			if n <= g {
				if cvs != nil {
					t.Fatalf("groups of %d chunks, %d bytes: %d chaining values of a single group", gc, n, len(cvs))
				}
				continue
			}
			if len(cvs) != (n+g-1)/g {
				t.Fatalf("groups of %d chunks, %d bytes: %d chaining values", gc, n, len(cvs))
			}
			root, err := RootOf(cvs)
			if err != nil || root != want {
				t.Fatalf("groups of %d chunks, %d bytes: RootOf %x (%v), want %x", gc, n, root, err, want)
			}
			last := len(cvs) - 1
			if got := GroupCV(b[last*g:], uint64(last*gc)); got != cvs[last] {
				t.Fatalf("groups of %d chunks, %d bytes: the last group's chaining value differs", gc, n)
			}
			if got := GroupCV(b[:g], uint64(gc)); got == cvs[0] {
				t.Fatalf("groups of %d chunks, %d bytes: the first group's bytes give its chaining value at another place", gc, n)
			}
			c := append([]byte(nil), b[:g]...)
			c[g/2] ^= 1
			if got := GroupCV(c, 0); got == cvs[0] {
				t.Fatalf("groups of %d chunks, %d bytes: a changed group gives the same chaining value", gc, n)
			}
		}
	}
	if _, err := RootOf(make([][32]byte, 1)); err == nil {
		t.Fatal("RootOf of one chaining value: no error")
	}
}

// BenchmarkGroups: a 40 MiB tensor's groups of 16 chunks (a thin audit's hashing of one), on this
// CPU's lanes (AVX-512 where it has them; `-tags purego` for the lanes in Go).
func BenchmarkGroups(b *testing.B) {
	in := input(40 << 20)
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		Groups(in, 16)
	}
}
