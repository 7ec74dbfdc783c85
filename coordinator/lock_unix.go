//go:build unix

package coordinator

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// lockExclusive takes an advisory lock on f without waiting (flock: held by the open file, so
// two opens in one process exclude each other as two processes do).
func lockExclusive(f *os.File) error {
	err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return errLocked
	}
	return err
}

func unlock(f *os.File) { unix.Flock(int(f.Fd()), unix.LOCK_UN) }
