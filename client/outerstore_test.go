package client

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// testOuterState is newOuterState for a test: its file (where there is one) in the test's
// temporary directory rather than the user's cache.
func testOuterState(t testing.TB, specs []model.Spec, spec job.Spec) *outerState {
	t.Helper()
	useOuterDir(t, t.TempDir())
	o, err := newOuterState(specs, spec)
	if err != nil {
		t.Fatal(err)
	}
	// Unmapped when the test ends, and so held until then: a state the test no longer names
	// would be unmapped by the collector while a slice of it is still compared. The arena only:
	// a test may leave a pending step of its own making, which no exchange will end.
	t.Cleanup(o.arena.close)
	return o
}

// useOuterDir points the outer-state files at dir for the test.
func useOuterDir(t testing.TB, dir string) {
	old := outerDir
	outerDir = func() (string, error) { return dir, nil }
	t.Cleanup(func() { outerDir = old })
}

// outerJob is an outer-mode job of the tiny model: int8, a delay of d steps.
func outerJob(d int) job.Spec {
	spec := job.Default()
	spec.Model, spec.Steps = model.TinyConfig(), 8
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Delay: d}
	return spec
}

// TestOuterStoreInFile: a native worker's outer state is a mapping of a file it removed at once
// (nothing left in the directory, however it ends), not its heap; once an outer step is done with
// it the pages go back to the kernel (release), and the values stay. Closed (a plan that does not
// keep the stage), the range is no longer the file's, so the file goes at once.
func TestOuterStoreInFile(t *testing.T) {
	if outerOnHeap || runtime.GOOS != "linux" {
		t.Skip("the outer state is in a file mapping on Linux (read through /proc/self/smaps)")
	}
	dir := t.TempDir()
	useOuterDir(t, dir)
	// 4 Mi values a slot: 16 MiB, pages enough to see.
	specs := []model.Spec{{Name: "w", Shape: []int{1024, 4096}}}
	o, err := newOuterState(specs, outerJob(0))
	if err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("the outer state's directory holds %v: the file was not removed once mapped", left)
	}
	for _, p := range []*model.Params{o.global, o.outer.V, o.outer.Err, o.err} {
		for i := range p.Slab {
			p.Slab[i] = float32(i % 97)
		}
	}
	start := uintptr(unsafe.Pointer(unsafe.SliceData(o.arena.raw)))
	m := smapsOf(t, start)
	if !strings.HasSuffix(m.path, "(deleted)") || !strings.HasPrefix(m.path, dir) {
		t.Fatalf("the outer state is mapped from %q; want a removed file in %s", m.path, dir)
	}
	written := int64(4 * 4 * len(o.global.Slab))
	if m.rss < written {
		t.Fatalf("%d bytes of the mapping resident after writing %d: the state is not where the test looks", m.rss, written)
	}
	if o.global.Slab[1] != 1 {
		t.Fatal("a value written is not read back")
	}
	// A resident arena (the worker's memory holds it beside the shard) keeps its pages.
	o.arena.resident = true
	o.release()
	if m := smapsOf(t, start); m.rss < written {
		t.Errorf("%d bytes resident after the release of a resident arena; want the %d written kept", m.rss, written)
	}
	o.arena.resident = false
	o.release()
	if m := smapsOf(t, start); m.rss > written/8 {
		t.Errorf("%d bytes still resident after the release; want the pages given back", m.rss)
	}
	for _, p := range []*model.Params{o.global, o.outer.V, o.outer.Err, o.err} {
		for i := 0; i < len(p.Slab); i += 4099 {
			if p.Slab[i] != float32(i%97) {
				t.Fatalf("after the release value %d reads %v, want %v", i, p.Slab[i], float32(i%97))
			}
		}
	}
	// A stage the worker no longer holds closes its state: the range stays mapped (zeros, no
	// fault for a slice still held) but no longer from the file, which goes with it.
	o.close()
	if m := smapsOf(t, start); strings.HasPrefix(m.path, dir) {
		t.Errorf("after close the range is still mapped from %q", m.path)
	}
	if v := o.global.Slab[1]; v != 0 {
		t.Errorf("a slice of the closed state reads %v, want 0", v)
	}
	runtime.KeepAlive(o)

	// A disk that would be left with less than its share free refuses the state.
	if err := outerRoom(8<<30, 10<<30, 100<<30); !errors.Is(err, errOuterDisk) {
		t.Errorf("8 GiB of state on a 100 GiB disk with 10 GiB free: %v, want errOuterDisk (10 GiB must stay free)", err)
	}
	if err := outerRoom(8<<30, 20<<30, 100<<30); err != nil {
		t.Errorf("8 GiB of state with 20 of 100 GiB free: %v", err)
	}
	if err := outerRoom(1<<30, 1<<30+1<<29, 4<<30); !errors.Is(err, errOuterDisk) {
		t.Errorf("1 GiB of state leaving 0.5 GiB of a small disk free: %v, want errOuterDisk (1 GiB must stay free)", err)
	}
}

// TestOuterStateReusesBuffers: the buffers an outer step writes (the int8 delta, a delayed step's
// snapshot of θ_r, an evaluation's copy) are the mapping's, the same at every use: a new buffer
// at each outer step would be a new range of the file, kept until a collection.
func TestOuterStateReusesBuffers(t *testing.T) {
	if outerOnHeap {
		t.Skip("on the heap each use allocates, and the collector takes it")
	}
	o := testOuterState(t, model.TinyConfig().Specs(), outerJob(1))
	for _, s := range []outerSlot{slotDelta, slotSnap, slotOwn} {
		a, b := o.arena.buffer(s), o.arena.buffer(s)
		if &a.Slab[0] != &b.Slab[0] {
			t.Errorf("slot %d: two uses have two buffers", s)
		}
		if p := uintptr(unsafe.Pointer(&a.Slab[0])); p < uintptr(unsafe.Pointer(&o.arena.mem[0])) || p >= uintptr(unsafe.Pointer(&o.arena.mem[len(o.arena.mem)-1])) {
			t.Errorf("slot %d is not in the mapping", s)
		}
	}
	seen := map[*float32]outerSlot{}
	for _, s := range outerSlotsOf(outerJob(1)) {
		p := &o.arena.buffer(s).Slab[0]
		if q, ok := seen[p]; ok {
			t.Errorf("slots %d and %d share memory", q, s)
		}
		seen[p] = s
	}
}

// TestCommitOuterWithoutOuterState: a commit to a stage in no outer mode is an error, not a
// crash (the release after a commit is nil-safe).
func TestCommitOuterWithoutOuterState(t *testing.T) {
	r := &StageRunner{}
	if err := r.CommitOuter(&proto.OuterCommit{Step: 3}); err == nil {
		t.Fatal("a commit to a stage without an outer state succeeded")
	}
}

type smapsEntry struct {
	path string
	rss  int64
}

// smapsOf is the mapping of this process holding address addr, from /proc/self/smaps.
func smapsOf(t *testing.T, addr uintptr) smapsEntry {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	var e smapsEntry
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) >= 5 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			if in {
				return e
			}
			var lo, hi uintptr
			if _, err := fmt.Sscanf(fields[0], "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
				in = true
				if len(fields) >= 6 {
					e.path = strings.Join(fields[5:], " ")
				}
			}
			continue
		}
		if in && len(fields) >= 2 && fields[0] == "Rss:" {
			kb, _ := strconv.ParseInt(fields[1], 10, 64)
			e.rss = kb << 10
		}
	}
	if !in {
		t.Fatalf("no mapping holds %#x", addr)
	}
	return e
}

// TestOuterSlotsMatchPlanner: the planner's figure of the outer state
// (sched.OuterStateBytesPerParam: on a browser tab's heap it is counted against the tab's offer,
// outerHeapBytes) is the arena's slots, 4 bytes each, in every mode: a figure below them would
// let a tab's heap outgrow what it offered.
func TestOuterSlotsMatchPlanner(t *testing.T) {
	for _, q8 := range []bool{false, true} {
		for _, d := range []int{0, 2} {
			spec := outerJob(d)
			if !q8 {
				spec.Sync.Compress = "none"
			}
			want := float64(4 * len(outerSlotsOf(spec)))
			if got := spec.ReplicaOptions().OuterStateBytes(); got != want {
				t.Errorf("int8 %v, delay %d: the planner counts %v bytes a parameter, the arena has %v", q8, d, got, want)
			}
			if got := outerHeapBytes(spec, 1000); got != 1000*want {
				t.Errorf("int8 %v, delay %d: a tab counts %v bytes for 1000 parameters, want %v", q8, d, got, 1000*want)
			}
		}
	}
}
