//go:build !linux

package main

// lowerThreadPriority does nothing where a thread's priority is not its own (setpriority is
// per process on macOS; Windows would need SetThreadPriority): the recomputation keeps the
// normal priority there.
func lowerThreadPriority() {}
