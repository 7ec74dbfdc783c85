//go:build linux || darwin

package client

import (
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// outerOnHeap: a native worker on Linux or macOS maps its outer state from a file.
const outerOnHeap = false

// mapOuter maps a new outer-state file of size bytes in dir into a: sparse, so that only what is
// written takes disk, and removed at once, so that it goes with its last mapping however the
// worker ends. The disk must keep its share free after size more (outerRoom): the file is sparse
// and a write past the disk's end would be a SIGBUS, not an error, so the room is checked here.
//
// fallocate would turn that SIGBUS into an error at once, but writes through a mapping into its
// unwritten extents ran 2–19× slower than into a sparse file here (docs/benchmarks.md), slow
// enough that a worker loading a 1B replica missed its heartbeats.
func mapOuter(a *outerArena, dir string, size int64) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("the outer state's directory: %w", err)
	}
	free, total, err := diskSpace(dir)
	if err != nil {
		return fmt.Errorf("the outer state's disk: %w", err)
	}
	if err := outerRoom(size, free, total); err != nil {
		return fmt.Errorf("%w (in %s)", err, dir)
	}
	f, err := os.CreateTemp(dir, "outer-*")
	if err != nil {
		return fmt.Errorf("the outer state's file: %w", err)
	}
	defer f.Close() // the mapping keeps the file
	os.Remove(f.Name())
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("the outer state's file: %w", err)
	}
	raw, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mapping the outer state's file of %s: %w", fmtBytes(size), err)
	}
	a.raw = raw
	a.mem = unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(raw))), len(raw)/4)
	// Once the arena is garbage its range becomes an anonymous zero mapping rather than a hole,
	// and the file goes with its last page. Parameters laid over it hold the arena (slab), so
	// only a bare slice of it still held somewhere (a delayed step's snapshot in a goroutine on
	// its way out) can outlive it: that reads zeros but never faults.
	runtime.AddCleanup(a, func(raw []byte) { unmapOuter(raw) }, raw)
	return nil
}

// diskSpace is the free space (for this user) and the size of the disk holding dir.
var diskSpace = func(dir string) (free, total int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	bs := int64(st.Bsize)
	return int64(st.Bavail) * bs, int64(st.Blocks) * bs, nil
}

// releaseOuter gives raw's pages back to the kernel: they stay in the page cache (the mapping is
// shared) until memory is wanted, and are read back from there or the file when next touched.
func releaseOuter(raw []byte) {
	unix.Madvise(raw, unix.MADV_DONTNEED)
}

// unmapOuter replaces the mapping raw with anonymous zero pages that take no memory until
// written (see mapOuter).
func unmapOuter(raw []byte) {
	unix.MmapPtr(-1, 0, unsafe.Pointer(unsafe.SliceData(raw)), uintptr(len(raw)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_FIXED|unix.MAP_NORESERVE)
}
