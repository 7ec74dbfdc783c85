//go:build linux || darwin

package client

import (
	"errors"
	"os"
	"runtime"
	"testing"
	"weak"

	"github.com/shoal-ml/shoal/model"
)

// TestOuterStateNoRoom: a worker whose disk would be left with less than its share free refuses
// the outer state with errOuterDisk (reported as proto.ErrCodeMemory: it would refuse again),
// and writes nothing.
func TestOuterStateNoRoom(t *testing.T) {
	dir := t.TempDir()
	useOuterDir(t, dir)
	old := diskSpace
	diskSpace = func(string) (int64, int64, error) { return 2 << 30, 100 << 30, nil } // 2 of 100 GiB free
	t.Cleanup(func() { diskSpace = old })
	_, err := newOuterState(model.TinyConfig().Specs(), outerJob(0))
	if !errors.Is(err, errOuterDisk) {
		t.Fatalf("an outer state with 2 of 100 GiB free: %v, want errOuterDisk", err)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("the refused state left %v", left)
	}
}

// TestOuterParamsHoldTheirMapping: parameters laid over an outer state's mapping, or a view of
// them, keep the mapping alive once nothing else names the state. The collector does not follow
// pointers into the mapping, so without that a restore compared, or a checkpoint written, from
// the global θ of a state its runner had dropped read zeros where the values were (a CI failure
// of TestRestoreOuterAtStepZero under -race).
func TestOuterParamsHoldTheirMapping(t *testing.T) {
	useOuterDir(t, t.TempDir())
	specs := model.TinyConfig().Specs()
	o, err := newOuterState(specs, outerJob(0))
	if err != nil {
		t.Fatal(err)
	}
	arena := weak.Make(o.arena)
	global := o.global
	for i := range global.Slab {
		global.Slab[i] = 1
	}
	view, err := global.Sub(specs[len(specs)-1:])
	if err != nil {
		t.Fatal(err)
	}
	o, global = nil, nil
	runtime.GC()
	runtime.GC()
	if arena.Value() == nil {
		t.Fatal("the mapping was collected while a view of its parameters is held")
	}
	for _, v := range view.Tensors[0].Data {
		if v != 1 {
			t.Fatalf("a held view reads %v, want 1", v)
		}
	}
	runtime.KeepAlive(view)
	view = nil
	runtime.GC()
	runtime.GC()
	if arena.Value() != nil {
		t.Error("the mapping outlived every view of it: its file would stay until the worker ends")
	}
}
