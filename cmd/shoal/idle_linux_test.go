package main

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
)

// niceOf is the nice value of the calling thread (Linux's getpriority returns 20 − nice).
func niceOf(t *testing.T) int {
	p, err := syscall.Getpriority(syscall.PRIO_PROCESS, syscall.Gettid())
	if err != nil {
		t.Fatal(err)
	}
	return 20 - p
}

// TestIdleRecomputer: every recomputation of `shoal train --workers`' coordinator runs at nice 19,
// one at a time, and returns what the recomputer returned; the rest of the process keeps its
// priority.
func TestIdleRecomputer(t *testing.T) {
	before := niceOf(t)
	var nices []int
	var running atomic.Int32
	boom := errors.New("boom")
	r := &idleRecomputer{next: func(ctx context.Context, rp *audit.Replay) (*audit.Outcome, error) {
		if running.Add(1) != 1 {
			t.Error("two recomputations at once")
		}
		defer running.Add(-1)
		nices = append(nices, niceOf(t)) // one at a time, as checked above
		time.Sleep(time.Millisecond)     // a window for another to start, were they not serial
		if rp == nil {
			return nil, boom
		}
		return &audit.Outcome{}, nil
	}}
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if out, err := r.recompute(context.Background(), &audit.Replay{}); err != nil || out == nil {
				t.Errorf("recompute: %v, %v", out, err)
			}
		})
	}
	wg.Wait()
	if _, err := r.recompute(context.Background(), nil); !errors.Is(err, boom) {
		t.Fatalf("recompute: %v, want the recomputer's error", err)
	}
	for _, n := range nices {
		if n != 19 {
			t.Fatalf("recomputations ran at nice %v, want 19", nices)
		}
	}
	if len(nices) != 4 {
		t.Fatalf("%d recomputations ran, want 4", len(nices))
	}
	if n := niceOf(t); n != before {
		t.Fatalf("the test's thread is at nice %d after, %d before", n, before)
	}
}
