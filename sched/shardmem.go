package sched

import (
	"fmt"

	"github.com/shoal-ml/shoal/model"
)

// The memory of one assigned shard, as the planner budgets it, for a worker to check an
// assignment against what it offered (`shoal worker --memory`) before allocating anything. These
// are the planner's own formulas on the planner's own profiles: an assignment the planner made
// for a peer of MemoryBytes m never needs more than m here.

// ShardJob is what of a job, besides its model and batch, the memory of a shard depends on.
type ShardJob struct {
	// Audited: the job audits its steps, and its workers keep each step's evidence
	// (Profile.Audited).
	Audited bool
	// EvalRows is the sequences of one validation pass (job.Spec.ValPassRows) when the job computes a
	// validation loss, 0 when it does not (Profile.Evaluated).
	EvalRows int
	// OuterBytesPerParam is what outer mode keeps per parameter in memory beside a shard's own
	// state: an audited job's evidence of the step before an outer step
	// (job.OuterEvidenceBytesPerParam); 0 in step mode. The outer state itself is on disk, or
	// counted in a browser tab's offer (OuterStateBytesPerParam).
	OuterBytesPerParam float64
}

// Profiles returns the stage and expert profiles of cfg, for micro-batches of microBatch
// sequences, M of them a step, in job j: what the planner plans with and a worker checks its
// assignment against.
func (j ShardJob) Profiles(cfg model.Config, microBatch, M int) (Profile, ExpertProfile, error) {
	prof, err := NewProfile(cfg, microBatch)
	if err != nil {
		return Profile{}, ExpertProfile{}, err
	}
	ep, err := NewExpertProfile(cfg, microBatch, M)
	if err != nil {
		return Profile{}, ExpertProfile{}, err
	}
	if j.Audited {
		prof, ep = prof.Audited(), ep.Audited()
	}
	if j.OuterBytesPerParam > 0 {
		prof = prof.withStateBytes(j.OuterBytesPerParam)
	}
	if j.EvalRows > 0 {
		prof, ep = prof.Evaluated(j.EvalRows, cfg.BlockSize), ep.Evaluated(j.EvalRows, cfg.BlockSize)
	}
	return prof, ep, nil
}

// StageShardMemory is the memory of pipeline stage index of S holding blocks [begin, end) of cfg,
// for a job of M micro-batches of microBatch sequences running OneFOneBDepth with depth extra
// micro-batches in flight (proto.Assign.Depth, 0 ≤ depth < M), in job j (audit evidence, a
// validation pass): Profile.StageMemoryDepth, less the state (ExpertProfile.StateBytes) of
// remoteExperts expert MLPs of its MoE blocks that live on other workers
// (proto.Assign.ExpertHosts). The planner counts every expert with its stage, so with remote
// experts this is below what the planner budgeted; their activations stay counted (the stage
// keeps the dispatched rows and the returned outputs instead).
func StageShardMemory(cfg model.Config, microBatch, M, begin, end, index, S, remoteExperts, depth int, j ShardJob) (float64, error) {
	if M < 1 {
		return 0, fmt.Errorf("%w: %d micro-batches", ErrBadInput, M)
	}
	prof, ep, err := j.Profiles(cfg, microBatch, M)
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
	case depth < 0 || depth >= M:
		return 0, fmt.Errorf("%w: depth %d for %d micro-batches (want 0 <= depth < M)", ErrBadInput, depth, M)
	}
	need := prof.StageMemoryDepth(begin, end, index, S, M, depth)
	if remoteExperts > 0 {
		need -= float64(remoteExperts) * ep.StateBytes
	}
	return need, nil
}

// ReplicaShardMemory is StageShardMemory for stage index of S of a pipeline replica computing
// micro-batches [first, first+n) of the step's opt.MicroBatches (proto.ReplicaAssign), or with own
// batches (opt.OwnBatches) [0, n) of its own batch, n up to MaxOwnMicroBatches: the
// planner's ReplicaStageMemory, with the job's audit evidence and validation pass from j. Its
// gradient tree is the replica's own run of the step's tree in step mode — up to 2·⌈log2 n⌉
// buffers, which StageShardMemory of n micro-batches from 0 under-counts. A stage of a replica
// with experts on hosts is counted as if it held them (client checkMemory): more than it keeps,
// never less.
func ReplicaShardMemory(cfg model.Config, microBatch, begin, end, index, S, first, n, depth int, j ShardJob, opt ReplicaOptions) (float64, error) {
	M := opt.MicroBatches
	prof, _, err := j.Profiles(cfg, microBatch, max(M, 1))
	if err != nil {
		return 0, err
	}
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return 0, err
	}
	switch {
	case begin < 0 || end <= begin || end > prof.NumBlocks():
		return 0, fmt.Errorf("%w: blocks [%d, %d) of %d", ErrBadInput, begin, end, prof.NumBlocks())
	case S < 1 || index < 0 || index >= S:
		return 0, fmt.Errorf("%w: stage %d of %d", ErrBadInput, index, S)
	case opt.OwnBatches && (first != 0 || n < 1 || n > MaxOwnMicroBatches(M, microBatch*cfg.BlockSize)):
		// Its own batch: [0, n) of n micro-batches, as many as its speed earns within the bound.
		return 0, fmt.Errorf("%w: micro-batches [%d, %d) of its own batch, at most %d", ErrBadInput, first, first+n, MaxOwnMicroBatches(M, microBatch*cfg.BlockSize))
	case !opt.OwnBatches && (first < 0 || n < 1 || first+n > M):
		return 0, fmt.Errorf("%w: micro-batches [%d, %d) of %d", ErrBadInput, first, first+n, M)
	case depth < 0 || depth >= n:
		return 0, fmt.Errorf("%w: depth %d for a share of %d micro-batches (want 0 <= depth < share)", ErrBadInput, depth, n)
	}
	return ReplicaStageMemory(prof, begin, end, index, S, first, n, depth, opt), nil
}

// ExpertShardMemory is the memory of an expert shard of n experts (or replicas) of one block of
// cfg, for a job of M micro-batches of microBatch sequences: n times the memory PlaceExperts
// gives each shard with the coordinator's options (InFlight 0, that is M micro-batches in flight
// at the worst case of every token routed to the expert). M bounds what any depth of
// OneFOneBDepth keeps in flight, so the depth of the plan does not change it. j adds the audit
// evidence and an evaluation pass (ExpertProfile.Audited, Evaluated).
func ExpertShardMemory(cfg model.Config, microBatch, M, n int, j ShardJob) (float64, error) {
	if M < 1 {
		return 0, fmt.Errorf("%w: %d micro-batches", ErrBadInput, M)
	}
	_, prof, err := j.Profiles(cfg, microBatch, M)
	if err != nil {
		return 0, err
	}
	if n < 1 {
		return 0, fmt.Errorf("%w: %d experts", ErrBadInput, n)
	}
	return float64(n) * prof.expertMemory(M), nil
}

// ExpertShardMemoryRuns is ExpertShardMemory for a host serving the stages of several pipeline
// replicas in step mode, runs being the micro-batches each computes (ascending, tiling [0, M)):
// their completions interleave (model.Shard.BeginGradientsRuns), so the gradient tree can hold
// every run's nodes at once — at most the sum of each run's TreeBuffers, instead of one run's
// from micro-batch 0.
func ExpertShardMemoryRuns(cfg model.Config, microBatch, M, n int, runs [][2]int, j ShardJob) (float64, error) {
	need, err := ExpertShardMemory(cfg, microBatch, M, n, j)
	if err != nil || len(runs) < 2 {
		return need, err
	}
	_, prof, err := j.Profiles(cfg, microBatch, M)
	if err != nil {
		return 0, err
	}
	extra := -model.TreeBuffers(M, 0, M)
	for _, r := range runs {
		if r[0] < 0 || r[1] <= r[0] || r[1] > M {
			return 0, fmt.Errorf("%w: micro-batches [%d, %d) of %d", ErrBadInput, r[0], r[1], M)
		}
		extra += model.TreeBuffers(M, r[0], r[1])
	}
	return need + float64(n)*4*float64(max(extra, 0))*float64(prof.Params), nil
}
