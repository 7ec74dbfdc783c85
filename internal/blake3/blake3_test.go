package blake3

import (
	"math/rand/v2"
	"testing"

	zb "github.com/zeebo/blake3"
)

// sizes are the input lengths the tests hash: the edges of the wide path (its smallest input,
// whole runs of 16 chunks and one byte either side, odd numbers of chunks at every level of the
// tree) and random ones up to 3 MB.
func sizes() []int {
	out := []int{0, 1, 64, 1023, 1024, 1025, 2048, wideMin - 1, wideMin, wideMin + 1,
		17 * chunkLen, 31*chunkLen + 5, 32 * chunkLen, 33 * chunkLen, 48*chunkLen - 1,
		257 * chunkLen, 511*chunkLen + 1000, 1000 * chunkLen}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		out = append(out, wideMin+r.IntN(3<<20))
	}
	return out
}

func input(n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(uint64(n), 3))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestSum256 holds Sum256 — on this CPU's path, AVX-512's lanes where it has them — to
// zeebo/blake3's hash of the same bytes.
func TestSum256(t *testing.T) {
	t.Logf("wide path (AVX-512): %v", wide)
	for _, n := range sizes() {
		b := input(n)
		if got, want := Sum256(b), zb.Sum256(b); got != want {
			t.Errorf("%d bytes: %x, zeebo/blake3 %x", n, got, want)
		}
	}
}

// TestTree holds the wide path's tree, with the lanes computed one by one in Go, to zeebo/blake3
// on any CPU, and the lanes to that reference where the CPU has them.
func TestTree(t *testing.T) {
	for _, n := range sizes() {
		if n < 2*chunkLen {
			continue
		}
		b := input(n)
		want := zb.Sum256(b)
		if got := sumWide(b, lanesScalar); got != want {
			t.Errorf("%d bytes, lanes in Go: %x, zeebo/blake3 %x", n, got, want)
		}
		if wide {
			if got := sumWide(b, compressLanes); got != want {
				t.Errorf("%d bytes, AVX-512 lanes: %x, zeebo/blake3 %x", n, got, want)
			}
		}
	}
}

// TestLanes compares the 16-lane compression with the Go one on chunks and on parents, at a
// counter past 2³² (its high words).
func TestLanes(t *testing.T) {
	if !wide {
		t.Skip("no AVX-512 here")
	}
	b := input(16 * chunkLen)
	var chunk, par [16]uint32
	chunk[0], chunk[15] = chunkStart, chunkEnd
	par[0] = parent
	for _, c := range []struct {
		stride, blocks int
		ctr            uint64
		perLane        bool
		flags          *[16]uint32
	}{{chunkLen, 16, 5, true, &chunk}, {chunkLen, 16, 1<<32 - 3, true, &chunk}, {blockLen, 1, 0, false, &par}} {
		got, want := make([][8]uint32, 16), make([][8]uint32, 16)
		compressLanes(b, c.stride, c.blocks, &iv, c.ctr, c.perLane, c.flags, got)
		lanesScalar(b, c.stride, c.blocks, &iv, c.ctr, c.perLane, c.flags, want)
		for j := range got {
			if got[j] != want[j] {
				t.Errorf("stride %d counter %d lane %d: %x, want %x", c.stride, c.ctr, j, got[j], want[j])
			}
		}
	}
}

// BenchmarkSum256 sets Sum256 beside zeebo/blake3 on 40 MB (about an audited default-job
// worker's state, hashed after every update) and on 256 KiB (one of its larger tensors).
func BenchmarkSum256(b *testing.B) {
	for _, n := range []int{40 << 20, 256 << 10} {
		buf := input(n)
		b.Run("shoal/"+size(n), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				Sum256(buf)
			}
		})
		b.Run("zeebo/"+size(n), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				zb.Sum256(buf)
			}
		})
	}
}

func size(n int) string {
	if n >= 1<<20 {
		return itoa(n>>20) + "MiB"
	}
	return itoa(n>>10) + "KiB"
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}
