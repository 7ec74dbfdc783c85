package main

import (
	"context"
	"runtime"
	"sync"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/kernels"
)

// idleRecomputer is the auditor of a coordinator that shares its machine with its own workers
// (`shoal train --workers`): each recomputation runs at the lowest CPU priority, in the gaps the
// workers' steps leave, instead of taking a core from the pipeline it audits. On two cores the
// recomputation of a fifth of the shard-steps at the normal priority cost the default job a
// third of its tokens/s (docs/benchmarks.md, "What audits cost").
//
// The recomputations run one at a time (the coordinator asks for one at a time) on one goroutine
// locked to its own OS thread, whose priority is lowered when it starts (lowerThreadPriority),
// and the kernels' pool of the process is one thread, so that no part of a multiply runs on a
// helper at the normal priority. The goroutine never ends: a locked goroutine that ends takes
// its thread with it, and a worker process started from that thread would get its parent-death
// signal (pdeath_linux.go), which is delivered when the creating thread, not the process, exits.
type idleRecomputer struct {
	once sync.Once
	runs chan func()
	next audit.Recomputer
}

// recompute runs r.next's recomputation on the idle thread.
func (r *idleRecomputer) recompute(ctx context.Context, rp *audit.Replay) (*audit.Outcome, error) {
	r.once.Do(func() {
		kernels.SetThreads(1)
		r.runs = make(chan func())
		go func() {
			runtime.LockOSThread() // for good: see the type
			lowerThreadPriority()
			for f := range r.runs {
				f()
			}
		}()
	})
	var out *audit.Outcome
	var err error
	done := make(chan struct{})
	select {
	case r.runs <- func() { defer close(done); out, err = r.next(ctx, rp) }:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	<-done
	return out, err
}
