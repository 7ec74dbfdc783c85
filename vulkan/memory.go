package vulkan

import (
	"fmt"
	"unsafe"

	"github.com/shoal-ml/shoal/model"
)

// Memory: tensors are ranges of a few large VkBuffers, each bound to its own VkDeviceMemory
// (a block), because drivers cap the number of allocations (maxMemoryAllocationCount is often
// 4096) and an allocation costs far more than a range. Kernels bind whole blocks and take each
// tensor's element offset in their push constants, so a view may start at any element and the
// descriptor sets depend on the blocks alone (a handful, cached). A tensor larger than a block
// gets a block of its own, released when it is freed.

// allocAlign is the byte granularity of ranges within a block: a cache line on every GPU, so
// that neighbouring tensors share none and vector loads of a tensor's start are aligned.
const allocAlign = 256

// block is one VkBuffer with its memory and the ranges of it that are free.
type block struct {
	buf, mem  handle
	size      int64
	free      []span // sorted by offset, coalesced
	dedicated bool
	tensor    bool // device-local, counted in Device.tensorBytes
}

type span struct{ off, n int64 } // bytes

// span3 is a byte range of one VkBuffer, for hazard tracking.
type span3 struct {
	buf    handle
	lo, hi int64
}

// buffer is a model.Buf of the device: n elements (float32 or int32) at element off of its
// allocation.
type buffer struct {
	a      *allocation
	off, n int
}

// allocation is one Alloc's range of a block.
type allocation struct {
	blk   *block
	at    int64 // byte offset in the block
	n     int   // elements
	i32   bool
	freed bool
}

func (b *buffer) Len() int { return b.n }

// elem is b's first element's index in its block, what a kernel's off_* field takes.
func (b *buffer) elem() uint32 { return uint32(b.a.at/4) + uint32(b.off) }

func (b *buffer) byteRange() span3 {
	lo := b.a.at + int64(b.off)*4
	return span3{b.a.blk.buf, lo, lo + int64(b.n)*4}
}

func (d *Device) createBlock(size int64, memType uint32, usage uint32) (*block, error) {
	b := &block{size: size}
	bci := &bufferCreateInfo{sType: stBufferCreateInfo, size: uint64(size), usage: usage}
	if err := check(call(d.fn.CreateBuffer, uintptr(d.dev), uintptr(unsafe.Pointer(bci)), 0, uintptr(unsafe.Pointer(&b.buf))), "create buffer"); err != nil {
		return nil, err
	}
	req := new(memoryRequirements)
	call(d.fn.GetBufferMemoryRequirements, uintptr(d.dev), uintptr(b.buf), uintptr(unsafe.Pointer(req)))
	if req.memoryTypeBits&(1<<memType) == 0 {
		d.destroyBlock(b)
		return nil, fmt.Errorf("vulkan: buffers cannot use memory type %d", memType)
	}
	mai := &memoryAllocateInfo{sType: stMemoryAllocateInfo, allocationSize: req.size, memoryTypeIndex: memType}
	if err := check(call(d.fn.AllocateMemory, uintptr(d.dev), uintptr(unsafe.Pointer(mai)), 0, uintptr(unsafe.Pointer(&b.mem))), fmt.Sprintf("allocate %d MiB", size>>20)); err != nil {
		d.destroyBlock(b)
		return nil, err
	}
	if err := check(call(d.fn.BindBufferMemory, uintptr(d.dev), uintptr(b.buf), uintptr(b.mem), 0), "bind buffer memory"); err != nil {
		d.destroyBlock(b)
		return nil, err
	}
	b.free = []span{{0, size}}
	return b, nil
}

func (d *Device) destroyBlock(b *block) {
	if b.tensor && b.mem != 0 {
		d.tensorBytes -= b.size
	}
	if b.buf != 0 {
		call(d.fn.DestroyBuffer, uintptr(d.dev), uintptr(b.buf), 0)
	}
	if b.mem != 0 {
		call(d.fn.FreeMemory, uintptr(d.dev), uintptr(b.mem), 0) // unmaps too
	}
	b.buf, b.mem = 0, 0
}

const tensorUsage = bufferUsageStorage | bufferUsageTransferSrc | bufferUsageTransferDst

// Alloc returns a buffer of n zeroed float32.
func (d *Device) Alloc(n int) model.Buf { return d.alloc(n, false) }

// AllocInt32 returns a buffer of n zeroed int32 (token ids, targets).
func (d *Device) AllocInt32(n int) model.Buf { return d.alloc(n, true) }

func (d *Device) alloc(n int, i32 bool) model.Buf {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.allocLocked(n, i32)
}

func (d *Device) allocLocked(n int, i32 bool) *buffer {
	if n < 0 {
		panic(fmt.Sprintf("vulkan: alloc of %d elements", n))
	}
	size := (max(int64(n)*4, 1) + allocAlign - 1) &^ (allocAlign - 1)
	a := &allocation{n: n, i32: i32}
	if !d.place(a, size) {
		blockSize, dedicated := d.blockSize, false
		if size > d.blockSize {
			blockSize, dedicated = size, true
		}
		if size > d.maxRange {
			panic(fmt.Sprintf("vulkan: a buffer of %d bytes, the device binds at most %d", size, d.maxRange))
		}
		var blk *block
		var err error
		if left := d.limit - d.tensorBytes; d.limit > 0 && blockSize > left {
			// Under a limit the last ordinary block is what is left of it.
			if !dedicated && size <= left {
				blockSize = left
			} else {
				err = fmt.Errorf("%d MiB more would pass this device's memory limit of %d MiB (%d MiB in use)", blockSize>>20, d.limit>>20, d.tensorBytes>>20)
			}
		}
		if err == nil {
			blk, err = d.createBlock(blockSize, d.deviceMem, tensorUsage)
		}
		if err != nil {
			// No memory: a programming-level failure of the caller's plan, as make() panics.
			panic(fmt.Sprintf("vulkan: alloc of %d elements: %v", n, err))
		}
		blk.dedicated, blk.tensor = dedicated, true
		d.tensorBytes += blk.size
		d.blocks = append(d.blocks, blk)
		d.place(a, size)
	}
	b := &buffer{a: a, n: n}
	if n > 0 && d.err == nil {
		// A range may have held a freed tensor: zero it in the command stream, after the ops
		// that used it.
		r := b.byteRange()
		d.access(nil, []span3{r})
		call(d.fn.CmdFillBuffer, uintptr(d.cmdBuf()), uintptr(r.buf), uintptr(r.lo), uintptr(r.hi-r.lo), 0)
	}
	return b
}

// place puts a in the first free range of an existing block that holds size bytes.
func (d *Device) place(a *allocation, size int64) bool {
	for _, blk := range d.blocks {
		if blk.dedicated && blk.size != size {
			continue
		}
		for i, s := range blk.free {
			if s.n < size {
				continue
			}
			a.blk, a.at = blk, s.off
			if s.n == size {
				blk.free = append(blk.free[:i], blk.free[i+1:]...)
			} else {
				blk.free[i] = span{s.off + size, s.n - size}
			}
			return true
		}
	}
	return false
}

// Slice is a view of b's elements [off, off+n).
func (d *Device) Slice(b model.Buf, off, n int) model.Buf {
	v := b.(*buffer)
	if off < 0 || n < 0 || off+n > v.n {
		panic(fmt.Sprintf("vulkan: slice [%d, %d) of a buffer of %d", off, off+n, v.n))
	}
	return &buffer{a: v.a, off: v.off + off, n: n}
}

// Free releases b's memory (b must come from Alloc or AllocInt32, not Slice) for later Allocs;
// b and its views must not be used afterwards. The range is reused only by ops queued after
// Free, so queued ops that read b still see it.
func (d *Device) Free(b model.Buf) {
	d.mu.Lock()
	d.flushAdam() // a pending AdamW may use b
	defer d.mu.Unlock()
	d.free(b.(*buffer))
}

func (d *Device) free(v *buffer) {
	a := v.a
	if v.off != 0 || v.n != a.n {
		panic("vulkan: Free of a view")
	}
	if a.freed {
		panic("vulkan: buffer freed twice")
	}
	a.freed = true
	size := (max(int64(a.n)*4, 1) + allocAlign - 1) &^ (allocAlign - 1)
	blk := a.blk
	blk.free = insertSpan(blk.free, span{a.at, size})
	if len(blk.free) == 1 && blk.free[0].n == blk.size && (blk.dedicated || d.emptyBlocks() > 1) {
		// Keep one empty ordinary block for the next allocations; release the others, once the
		// commands that may still use them have run.
		for i, x := range d.blocks {
			if x == blk {
				d.blocks = append(d.blocks[:i], d.blocks[i+1:]...)
				break
			}
		}
		d.dying = append(d.dying, blk)
		if !d.recording {
			d.reap()
		}
	}
}

func (d *Device) emptyBlocks() int {
	n := 0
	for _, b := range d.blocks {
		if !b.dedicated && len(b.free) == 1 && b.free[0].n == b.size {
			n++
		}
	}
	return n
}

// insertSpan adds s to the sorted free list, merging it with its neighbours.
func insertSpan(free []span, s span) []span {
	i := 0
	for i < len(free) && free[i].off < s.off {
		i++
	}
	free = append(free, span{})
	copy(free[i+1:], free[i:])
	free[i] = s
	if i+1 < len(free) && free[i].off+free[i].n == free[i+1].off {
		free[i].n += free[i+1].n
		free = append(free[:i+1], free[i+2:]...)
	}
	if i > 0 && free[i-1].off+free[i-1].n == free[i].off {
		free[i-1].n += free[i].n
		free = append(free[:i], free[i+1:]...)
	}
	return free
}

// reap destroys the freed blocks and the descriptor sets that name them; nothing queued uses
// them any more.
func (d *Device) reap() {
	for _, blk := range d.dying {
		for k, s := range d.sets {
			for _, h := range k.bufs[:k.n] {
				if h == blk.buf {
					set := &[1]handle{s.set}
					call(d.fn.FreeDescriptorSets, uintptr(d.dev), uintptr(s.pool), 1, uintptr(unsafe.Pointer(&set[0])))
					delete(d.sets, k)
					break
				}
			}
		}
		d.destroyBlock(blk)
	}
	d.dying = d.dying[:0]
}

// Blocks returns how many memory blocks the device holds and their total size in bytes: what
// grows if buffers are allocated and never freed.
func (d *Device) Blocks() (n int, bytes int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, b := range d.blocks {
		n++
		bytes += b.size
	}
	return n, bytes
}

// growStaging replaces the staging buffer by one of at least size bytes. Nothing may be queued
// that uses the old one.
func (d *Device) growStaging(size int64) error {
	if d.staging != nil {
		d.destroyBlock(d.staging)
		d.staging, d.stagingPtr = nil, nil
	}
	blk, err := d.createBlock(size, d.stagingMem, bufferUsageTransferSrc|bufferUsageTransferDst)
	if err != nil {
		return err
	}
	p := new(unsafe.Pointer)
	if err := check(call(d.fn.MapMemory, uintptr(d.dev), uintptr(blk.mem), 0, uintptr(wholeSize), 0, uintptr(unsafe.Pointer(p))), "map staging memory"); err != nil {
		d.destroyBlock(blk)
		return err
	}
	d.staging, d.stagingPtr, d.stagingUsed = blk, *p, 0
	return nil
}

// stage reserves size bytes of the staging buffer for this batch of commands, submitting the
// batch first (a wait) when they do not fit beside what it already holds. It returns the
// offset, or -1 after an error.
func (d *Device) stage(size int64) int64 {
	size = (size + allocAlign - 1) &^ (allocAlign - 1)
	if d.stagingUsed+size > d.staging.size {
		if d.recording {
			d.submit()
		}
		if size > d.staging.size {
			if err := d.growStaging(max(size, 2*d.staging.size)); err != nil {
				d.fail(err)
				return -1
			}
		}
	}
	if d.staging == nil {
		return -1
	}
	off := d.stagingUsed
	d.stagingUsed += size
	return off
}

// SetMemoryLimit caps the device memory the tensors may take, in bytes (≤ 0: no cap): a
// volunteer's share of the GPU (`shoal worker --gpu-memory`). Allocations past it panic, as
// allocations the device has no memory for do; the worker keeps within it by offering no more
// than it to the planner. The staging buffer is host memory and is not counted.
func (d *Device) SetMemoryLimit(bytes int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.limit = max(bytes, 0)
}

// TensorBytes is the device memory the tensors' blocks take now.
func (d *Device) TensorBytes() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.tensorBytes
}
