package main

import "syscall"

// lowerThreadPriority gives the calling OS thread the lowest priority (nice 19): on Linux a
// thread's nice value is its own, so the rest of the process keeps its priority. A thread cannot
// raise its priority again without privilege, so its caller keeps it locked for good.
func lowerThreadPriority() {
	_ = syscall.Setpriority(syscall.PRIO_PROCESS, syscall.Gettid(), 19) // best effort: a failure leaves the normal priority
}
