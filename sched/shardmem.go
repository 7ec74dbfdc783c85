package sched

import (
	"fmt"

	"github.com/shoal-ml/shoal/model"
)

// The memory of one assigned shard, as the planner budgets it, for a worker to check an
// assignment against what it offered (`shoal worker --memory`) before allocating anything. These
// are the planner's own formulas on the planner's own profiles: an assignment the planner made
// for a peer of MemoryBytes m never needs more than m here.

// StageShardMemory is the memory of pipeline stage index of S holding blocks [begin, end) of cfg,
// for a job of M micro-batches of microBatch sequences: Profile.StageMemory, less the state
// (StateBytesPerParam per parameter) of remoteExperts expert MLPs of its MoE blocks that live on
// other workers (proto.Assign.ExpertHosts). The planner counts every expert with its stage, so
// with remote experts this is below what the planner budgeted; their activations stay counted
// (the stage keeps the dispatched rows and the returned outputs instead).
func StageShardMemory(cfg model.Config, microBatch, M, begin, end, index, S, remoteExperts int) (float64, error) {
	prof, err := NewProfile(cfg, microBatch)
	if err != nil {
		return 0, err
	}
	switch {
	case M < 1:
		return 0, fmt.Errorf("%w: %d micro-batches", ErrBadInput, M)
	case begin < 0 || end <= begin || end > prof.NumBlocks():
		return 0, fmt.Errorf("%w: blocks [%d, %d) of %d", ErrBadInput, begin, end, prof.NumBlocks())
	case S < 1 || index < 0 || index >= S:
		return 0, fmt.Errorf("%w: stage %d of %d", ErrBadInput, index, S)
	case remoteExperts < 0:
		return 0, fmt.Errorf("%w: %d remote experts", ErrBadInput, remoteExperts)
	}
	need := prof.StageMemory(begin, end, index, S, M)
	if remoteExperts > 0 {
		c, f := int64(cfg.NEmbd), int64(cfg.Hidden())
		need -= StateBytesPerParam * float64(int64(remoteExperts)*(2*f*c+f+c))
	}
	return need, nil
}

// ExpertShardMemory is the memory of an expert shard of n experts (or replicas) of one block of
// cfg, for a job of M micro-batches of microBatch sequences: n times the memory PlaceExperts
// gives each shard with the coordinator's options (InFlight 0, that is M micro-batches in flight
// at the worst case of every token routed to the expert).
func ExpertShardMemory(cfg model.Config, microBatch, M, n int) (float64, error) {
	prof, err := NewExpertProfile(cfg, microBatch, M)
	if err != nil {
		return 0, err
	}
	if n < 1 {
		return 0, fmt.Errorf("%w: %d experts", ErrBadInput, n)
	}
	return float64(n) * prof.expertMemory(M), nil
}
