//go:build !unix && !windows

package coordinator

import "os"

// lockExclusive does nothing where the OS offers no file lock the coordinator knows of: the data
// directory is then not guarded against a second coordinator.
func lockExclusive(*os.File) error { return nil }

func unlock(*os.File) {}
