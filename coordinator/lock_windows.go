//go:build windows

package coordinator

import (
	"errors"
	"os"

	"golang.org/x/sys/windows"
)

// lockRange is the byte the lock covers: far past the pid the file holds, which a locked range
// would hide from the process that wants to name the holder.
const lockRange = 0x7fffffff

// lockExclusive takes a lock on f without waiting.
func lockExclusive(f *os.File) error {
	ol := windows.Overlapped{OffsetHigh: lockRange}
	err := windows.LockFileEx(windows.Handle(f.Fd()), windows.LOCKFILE_EXCLUSIVE_LOCK|windows.LOCKFILE_FAIL_IMMEDIATELY, 0, 1, 0, &ol)
	if errors.Is(err, windows.ERROR_LOCK_VIOLATION) {
		return errLocked
	}
	return err
}

func unlock(f *os.File) {
	ol := windows.Overlapped{OffsetHigh: lockRange}
	windows.UnlockFileEx(windows.Handle(f.Fd()), 0, 1, 0, &ol)
}
