package main

import (
	"bytes"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"
)

// workerCPU reads the CPU time a local cluster's worker processes have used so far, for `shoal
// train --workers --json`'s per-step workers_cpu_s. A benchmark that compares what two runs cost
// the workers (scripts/bench_audit.sh) needs the cost per step in the steady state: the CPU
// time each worker reports at exit also holds the start (restore, the first touch of every
// buffer) and the end (the last checkpoint), which a short run's steps do not amortise the way
// a job's hundreds of steps do.
type workerCPU struct {
	mu    sync.Mutex
	pids  []int           // 0 until the worker has started
	last  []time.Duration // the last figure read, or the kernel's final one once it has exited
	ended []bool
}

func newWorkerCPU(n int) *workerCPU {
	return &workerCPU{pids: make([]int, n), last: make([]time.Duration, n), ended: make([]bool, n)}
}

func (w *workerCPU) started(i, pid int) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pids[i] = pid
}

// exited records worker i's CPU time at its exit (the kernel's accounting of the reaped process),
// which its rows show from then on: a worker killed mid-job has no /proc entry left to read.
func (w *workerCPU) exited(i int, d time.Duration) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last[i], w.ended[i] = max(w.last[i], d), true
}

// read returns each worker's CPU time (user and system) so far, in worker order, or nil when a
// worker has not started or the kernel does not say (no /proc).
func (w *workerCPU) read() []time.Duration {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]time.Duration, len(w.pids))
	for i, pid := range w.pids {
		if !w.ended[i] {
			d, ok := procCPU(pid)
			switch {
			case ok:
				w.last[i] = max(w.last[i], d)
			case pid == 0 || runtime.GOOS != "linux":
				return nil
			}
			// Otherwise the process is gone and not yet reaped: its last figure stands.
		}
		out[i] = w.last[i]
	}
	return out
}

// procCPU is the user and system time of process pid and all its threads: fields 14 and 15 of
// /proc/PID/stat, in the kernel's USER_HZ ticks (100 a second on every Linux /proc reports to).
func procCPU(pid int) (time.Duration, bool) {
	if pid <= 0 {
		return 0, false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name, field 2, is in parentheses and may hold spaces: count from its end.
	end := bytes.LastIndexByte(b, ')')
	if end < 0 {
		return 0, false
	}
	f := bytes.Fields(b[end+1:]) // f[0] is field 3
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	stime, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * (time.Second / 100), true
}
