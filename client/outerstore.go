package client

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
)

// The outer state of a replica's stage (outerState) is as large as its training state: the
// global θ and the outer momentum, with int8 both error feedbacks and an attempt's copies of
// them, with a delay θ_r at the outer step, and the outer step's own buffers — 12 to 36 bytes a
// parameter (sched.OuterStateBytesPerParam), where the shard's parameters and AdamW moments are 12 and its gradient 4. It is
// touched once per H steps: at the outer step, and by a checkpoint, an evaluation or a handover.
//
// So a native worker keeps it in a file mapping (outerstore_unix.go), not on its heap: a sparse
// file under the user's cache directory, removed as soon as it is mapped, so that nothing is left
// behind however the worker ends. After an outer step the worker gives the pages back (release):
// the kernel's page cache keeps them while memory is free and writes them out when it is not —
// unless the memory it offered holds them beside its shard (outerArena.resident). The
// planner budgets a replica at 16 bytes a parameter plus activations (sched.ReplicaStageMemory),
// which is what lets a 24 GB volunteer hold a whole replica of the 1B model. A browser tab has no
// files to map: its state stays on its heap (outerOnHeap), and the coordinator offers the planner
// only the part of a tab's memory the rest leaves (sched.HeapOuterOffer).

// outerSlot is one buffer of an outer state's arena, laid out like the stage's parameters.
type outerSlot int

const (
	slotGlobal   outerSlot = iota // the global θ of the last outer step
	slotMomentum                  // the outer momentum V
	slotAvgErr                    // int8: the average's error feedback (model.Outer.Err)
	slotErr                       // int8: this replica's error feedback e_r
	slotDelta                     // int8: the pseudo-gradient through int8, as given
	slotSnap                      // with a delay: θ_r at the outer step (pendingOuter.snap)
	slotOwn                       // θ_r while an evaluation runs on the global θ
	outerSlots
)

// outerSlotsOf are the slots a stage of job spec uses.
func outerSlotsOf(spec job.Spec) []outerSlot {
	s := []outerSlot{slotGlobal, slotMomentum}
	if spec.Sync.Compress == "int8" {
		s = append(s, slotAvgErr, slotErr, slotDelta)
	}
	if spec.Sync.Delay > 0 {
		s = append(s, slotSnap)
	}
	// An evaluation's copy: a job without validation may still be evaluated at its end.
	return append(s, slotOwn)
}

// outerArena is the memory of one outer state: a file mapping, or the heap (outerOnHeap).
type outerArena struct {
	specs []model.Spec
	n     int             // values of one slot
	at    [outerSlots]int // a slot's offset in mem, in values; -1 where the job does not use it
	mem   []float32       // the mapping as values; nil on the heap
	raw   []byte          // the mapping as mapped (outerstore_unix.go)
	kept  [outerSlots]*model.Params
	// resident keeps the mapping's pages between outer steps (release does nothing): the
	// worker's memory holds them beside its shard (outerResident). Given back, every page faults
	// in again at the next outer step — about half a CPU-second a worker an outer step for the
	// default model's whole replica on this machine (docs/benchmarks.md, "The outer step's page
	// faults") — the price of holding a replica as large as the memory offered, not one a worker
	// with room to spare should pay.
	resident bool
}

// bytes is the arena's size: what keeping it resident takes from the memory offered.
func (a *outerArena) bytes() int64 {
	if a == nil {
		return 0
	}
	used := 0
	for _, off := range a.at {
		if off >= 0 {
			used++
		}
	}
	return int64(used) * int64(a.n) * 4
}

// errOuterDisk is an outer state that the worker's disk has no room for.
var errOuterDisk = errors.New("no room for the outer state")

// outerDir is the directory of outer-state files: the user's cache directory's shoal folder
// (tests point it elsewhere).
var outerDir = func() (string, error) {
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "shoal"), nil
}

// newOuterArena makes the arena of an outer state of tensors specs in job spec.
func newOuterArena(specs []model.Spec, spec job.Spec) (*outerArena, error) {
	a := &outerArena{specs: specs, n: model.SpecsSize(specs)}
	for i := range a.at {
		a.at[i] = -1
	}
	slots := outerSlotsOf(spec)
	for i, s := range slots {
		a.at[s] = i * a.n
	}
	if outerOnHeap || a.n == 0 {
		return a, nil
	}
	dir, err := outerDir()
	if err != nil {
		return nil, fmt.Errorf("the outer state's directory: %w", err)
	}
	if err := mapOuter(a, dir, int64(len(slots))*int64(a.n)*4); err != nil {
		return nil, err
	}
	return a, nil
}

// params is slot s as parameters, the same each time: state that lasts (the global θ, the
// momentum, the error feedbacks and their copies).
func (a *outerArena) params(s outerSlot) *model.Params {
	if a.kept[s] == nil {
		a.kept[s] = a.slab(s)
	}
	return a.kept[s]
}

// buffer is slot s as parameters for one use (the outer step's delta, a delayed step's
// snapshot, an evaluation's copy of θ_r): the mapping's slot, the same each time; on the heap a
// fresh allocation, which goes when its use does rather than stay for the next outer step.
func (a *outerArena) buffer(s outerSlot) *model.Params {
	if a.mem == nil {
		return model.NewParams(a.specs)
	}
	return a.params(s)
}

func (a *outerArena) slab(s outerSlot) *model.Params {
	off := a.at[s]
	if off < 0 {
		panic(fmt.Sprintf("client: outer-state slot %d, which this job does not use", s))
	}
	if a.mem == nil {
		return model.NewParams(a.specs)
	}
	return model.NewParamsOver(a.specs, a.mem[off:off+a.n:off+a.n], a)
}

// release gives the mapping's pages back to the kernel, which keeps them in its page cache while
// memory is free: after an outer step, which is what touches them, until the next. Nothing on the
// heap, nor where the arena is resident.
func (a *outerArena) release() {
	if a != nil && a.raw != nil && !a.resident {
		releaseOuter(a.raw)
	}
}

// close drops the mapping now rather than when the arena is garbage: its range becomes anonymous
// zero pages (a slice still held somewhere reads zeros, never faults), and the file goes with it.
// The arena must not be used after.
func (a *outerArena) close() {
	if a != nil && a.raw != nil {
		unmapOuter(a.raw)
		a.raw, a.mem, a.kept = nil, nil, [outerSlots]*model.Params{}
	}
}

// outerRoom is the free space an outer-state file of size bytes leaves the disk holding dir
// (free is what the disk has, total its size): the worker keeps a tenth of the disk, and at least
// 1 GiB, for everything else.
func outerRoom(size, free, total int64) error {
	keep := max(total/10, 1<<30)
	if free-size < keep {
		return fmt.Errorf("%w: %s on disk, where %s is free and %s must stay so", errOuterDisk, fmtBytes(size), fmtBytes(free), fmtBytes(keep))
	}
	return nil
}

func fmtBytes(b int64) string {
	return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
}
