//go:build linux || darwin

package client

import (
	"errors"
	"os"
	"testing"

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
