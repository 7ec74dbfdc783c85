package client

import (
	"fmt"
	"math"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// memoryError is an assignment refused because its shard would not fit the memory this worker
// offered (WorkerConfig.MemoryBytes, `shoal worker --memory`). The worker reports it as
// proto.ErrCodeMemory rather than allocating and being killed by the OS.
type memoryError struct {
	need  float64 // bytes, as the planner estimates them
	offer int64
}

func (e *memoryError) Error() string {
	return fmt.Sprintf("the assigned shard needs %.0f bytes (parameters, gradients, Adam state, activations in flight), "+
		"this worker offers %d (--memory): give the worker more memory or the job more workers", e.need, e.offer)
}

// checkMemory estimates the memory of the shard a assigns, with the planner's formulas
// (sched.StageShardMemory at the plan's depth; sched.ExpertShardMemory, whose M in flight
// bound every depth), and returns a *memoryError when it exceeds offer. offer ≤ 0 is no cap.
// It allocates nothing: it runs before buildShard.
func checkMemory(spec job.Spec, a *proto.Assign, offer int64) error {
	if offer <= 0 {
		return nil
	}
	M := spec.MicroBatches
	if M < 1 {
		return fmt.Errorf("job spec: %d micro-batches", M)
	}
	b := spec.BatchSize / M
	switch {
	case a.Shard.Stage != nil:
		st := a.Shard.Stage
		remote := 0
		for _, h := range a.ExpertHosts {
			if len(h.Workers) > 0 {
				remote++
			}
		}
		// The plan's depth keeps min(S−index+depth, M) micro-batches in flight (sched.OneFOneBDepth);
		// a pipeline replica's schedule has its share of them (the coordinator's planDepth).
		var need float64
		var err error
		// A replica's stage with experts on hosts is counted as if it held them: more than it
		// keeps, never less.
		if r := a.Replica; r != nil {
			// The planner's formula for a replica (sched.ReplicaStageMemory): in step mode its
			// gradient tree is its own run of the step's, which can need more buffers than a
			// tree over as many micro-batches from 0.
			need, err = sched.ReplicaShardMemory(spec.Model, b, st.Begin, st.End, st.Index, st.Count, r.First, r.MicroBatches, a.Depth, spec.ShardJob(), spec.ReplicaOptions())
		} else {
			need, err = sched.StageShardMemory(spec.Model, b, M, st.Begin, st.End, st.Index, st.Count, remote, a.Depth, spec.ShardJob())
		}
		if err != nil {
			return err
		}
		if a.Replica != nil && spec.Outer() && outerOnHeap {
			// The outer state on this worker's heap (outerstore.go), which the coordinator left
			// out of what it offered the planner (sched.HeapOuterOffer).
			prof, err := sched.NewProfile(spec.Model, b)
			if err != nil {
				return err
			}
			need += outerHeapBytes(spec, prof.StageParams(st.Begin, st.End))
		}
		// The very comparison of the planner (sched.Partition).
		if need > float64(offer) {
			return &memoryError{need: need, offer: offer}
		}
	case a.Shard.Experts != nil:
		n := len(a.Shard.Experts.Experts)
		var runs [][2]int
		for _, rt := range a.Routers {
			runs = append(runs, [2]int{rt.First, rt.First + rt.MicroBatches})
		}
		per, err := sched.ExpertShardMemoryRuns(spec.Model, b, M, 1, runs, spec.ShardJob())
		if err != nil {
			return err
		}
		// The planner's own test (a host holds floor(memory / per) shards), not n·per > offer,
		// which may differ from it in the last bit.
		if float64(n) > math.Floor(float64(offer)/per) {
			return &memoryError{need: float64(n) * per, offer: offer}
		}
	}
	return nil
}

// widenedFits returns the check of a reroute or a stage takeover against the memory this worker
// offered (`shoal worker --memory`): the stage of replica assignment a, its run widened to
// micro-batches [first, first+n) of the step, needs what the planner's formula gives that share
// (a wider gradient tree and route log; sched.ReplicaShardMemory) — else a coordinator could have
// a worker widen its run to every micro-batch of the step, whose tree alone grows with the log of
// it, past what it offered.
func widenedFits(spec job.Spec, a *proto.Assign, offer int64) func(first, n int) error {
	return func(first, n int) error {
		w, r := *a, *a.Replica
		r.First, r.MicroBatches = first, n
		w.Replica = &r
		return checkMemory(spec, &w, offer)
	}
}

// outerHeapBytes is what the outer state of a stage of params parameters takes on the heap in job
// spec (sched.OuterStateBytesPerParam, the slots of outerSlotsOf).
func outerHeapBytes(spec job.Spec, params int64) float64 {
	return spec.ReplicaOptions().OuterStateBytes() * float64(params)
}

// outerResident reports whether a worker offering offer bytes (0: no cap) keeps an outer state of
// size bytes resident between outer steps (outerArena.resident) beside assignment a of spec: the
// shard's need, as checkMemory counts it, and the whole outer state must fit.
func outerResident(spec job.Spec, a *proto.Assign, offer, size int64) bool {
	return offer <= 0 || offer > size && checkMemory(spec, a, offer-size) == nil
}
