package coordinator

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// lockFile is the file in the data directory whose lock a coordinator holds while it runs: two
// coordinators on one directory would both take up its running job and write over each other's
// checkpoints. It holds the holder's pid, to name it in the refusal.
const lockFile = "lock"

// errLocked is what lockExclusive returns when another process holds the lock.
var errLocked = errors.New("locked")

// dirLock is a held lock on a data directory; the OS drops it when the process dies, however it
// dies, so a crashed coordinator leaves nothing to clean up.
type dirLock struct{ f *os.File }

// lockDataDir takes the data directory's lock, or says who holds it.
func lockDataDir(dir string) (*dirLock, error) {
	p := filepath.Join(dir, lockFile)
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock the data directory %s: %w", dir, err)
	}
	if err := lockExclusive(f); err != nil {
		f.Close()
		if !errors.Is(err, errLocked) {
			return nil, fmt.Errorf("lock the data directory %s: %w", dir, err)
		}
		holder := "another process"
		if b, err := os.ReadFile(p); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 {
				holder = fmt.Sprintf("another process (pid %d)", pid)
			}
		}
		return nil, fmt.Errorf("the data directory %s is in use by %s, a coordinator running on it: stop that one first, or give this one another --data-dir", dir, holder)
	}
	// The pid is written only under the lock; a refusal that reads the file while this is being
	// written says "another process" without it.
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &dirLock{f: f}, nil
}

// release drops the lock. The file stays: removing it would let a third process lock a new file
// of the same name while a second still waits on the old one.
func (l *dirLock) release() {
	if l == nil || l.f == nil {
		return
	}
	l.f.Truncate(0)
	unlock(l.f)
	l.f.Close()
	l.f = nil
}
