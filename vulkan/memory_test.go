package vulkan

import (
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// TestFree allocates and frees buffers of many sizes in a loop, some of them larger than a
// block (dedicated allocations), with ops and reads in between: the device's memory must stay
// bounded, and a recycled range must come back zeroed.
func TestFree(t *testing.T) {
	d := device(t)
	blocks0, bytes0 := d.Blocks()
	big := int(d.blockSize/4) + 1000
	var maxBlocks int
	var maxBytes int64
	for i := range 200 {
		sizes := []int{1, 37, 1000 + i, 65536, 300000}
		if i%20 == 0 {
			sizes = append(sizes, big)
		}
		var bufs []*buffer
		for _, n := range sizes {
			b := d.Alloc(n).(*buffer)
			bufs = append(bufs, b)
			h := make([]float32, n)
			h[n-1] = float32(i + 1)
			d.Write(b, h)
		}
		d.Add(bufs[1], bufs[1])
		if i%50 == 0 {
			got := make([]float32, 37)
			d.Read(got, bufs[1])
			if got[36] != float32(2*(i+1)) || got[0] != 0 {
				t.Fatalf("iteration %d: read %v", i, got[:1])
			}
		}
		n, bytes := d.Blocks()
		maxBlocks, maxBytes = max(maxBlocks, n), max(maxBytes, bytes)
		for _, b := range bufs {
			d.Free(b)
		}
	}
	// A recycled range is zeroed: the first floats of a fresh buffer read back 0.
	b := d.Alloc(1000)
	got := make([]float32, 1000)
	d.Read(got, b)
	for i, v := range got {
		if v != 0 {
			t.Fatalf("element %d of a new buffer is %v", i, v)
		}
	}
	d.Free(b)
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("blocks: %d (%d MiB) before, at most %d (%d MiB) during", blocks0, bytes0>>20, maxBlocks, maxBytes>>20)
	// Each iteration needs under one ordinary block plus, every 20th, one dedicated one.
	if maxBlocks > blocks0+3 || maxBytes > bytes0+3*d.blockSize+int64(big)*4 {
		t.Fatalf("memory grew to %d blocks, %d bytes (from %d, %d)", maxBlocks, maxBytes, blocks0, bytes0)
	}
}

// TestMemoryLimit: under SetMemoryLimit the tensors' blocks stay within the limit — the last
// ordinary block is what is left of it — and an allocation past it panics, naming the limit,
// instead of taking more of the volunteer's GPU; freeing makes room again.
func TestMemoryLimit(t *testing.T) {
	d := device(t)
	used := d.TensorBytes()
	limit := used + d.blockSize + d.blockSize/2
	d.SetMemoryLimit(limit)
	defer d.SetMemoryLimit(0)
	quarter := int(d.blockSize / 16) // a quarter of a block, in float32
	var bufs []model.Buf
	for d.TensorBytes()+d.blockSize/4 <= limit && len(bufs) < 64 {
		bufs = append(bufs, d.Alloc(quarter))
	}
	if got := d.TensorBytes(); got > limit {
		t.Fatalf("%d bytes of tensor blocks under a limit of %d", got, limit)
	}
	func() {
		defer func() {
			r := recover()
			if s, _ := r.(string); !strings.Contains(s, "memory limit") {
				t.Fatalf("an allocation past the limit: %v, want a panic naming the limit", r)
			}
		}()
		for range 8 {
			bufs = append(bufs, d.Alloc(quarter))
		}
	}()
	for _, b := range bufs {
		d.Free(b)
	}
	d.Free(d.Alloc(quarter)) // room again
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
}
