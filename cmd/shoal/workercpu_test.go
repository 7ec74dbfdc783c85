package main

import (
	"os"
	"runtime"
	"testing"
	"time"
)

// TestWorkerCPU: the CPU time read for a process grows as it computes, and a worker not yet
// started (or a system without /proc) gives no row at all rather than a zero.
func TestWorkerCPU(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("/proc/PID/stat is Linux's")
	}
	w := newWorkerCPU(2)
	w.started(0, os.Getpid())
	if got := w.read(); got != nil {
		t.Fatalf("with worker 1 not started: %v, want nil", got)
	}
	w.started(1, os.Getpid())
	first := w.read()
	if len(first) != 2 || first[0] < 0 {
		t.Fatalf("read %v", first)
	}
	// Compute until the kernel's accounting (10 ms ticks) moves: an event, not a sleep.
	deadline := time.Now().Add(time.Minute)
	x := 1.0
	for w.read()[0] <= first[0] {
		if time.Now().After(deadline) {
			t.Fatal("a minute of computing did not move the process's CPU time")
		}
		for i := range 1 << 20 {
			x = x*1.0000001 + float64(i&1)
		}
	}
	if x == 0 {
		t.Log(x) // keeps the loop
	}
	// A worker that has exited shows the kernel's final figure from then on, whatever /proc says.
	w.exited(1, time.Hour)
	if got := w.read(); got[1] != time.Hour || got[0] >= time.Hour {
		t.Errorf("after worker 1 exited at an hour of CPU: %v", got)
	}
	if _, ok := procCPU(0); ok {
		t.Error("procCPU(0) claims a figure")
	}
	var none *workerCPU
	none.started(0, 1)
	if none.read() != nil {
		t.Error("a nil workerCPU reads figures")
	}
}
