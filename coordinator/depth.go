package coordinator

import (
	"errors"

	"github.com/shoal-ml/shoal/sched"
)

// planDepth chooses the pipeline depth of a plan: how many micro-batches beyond plain 1F1B every
// stage keeps in flight (sched.OneFOneBDepth; proto.Assign.Depth), fixed for the plan version and
// sent in every Assign of it, so that an expert host follows its stage's order.
//
// A pinned plan's depth ("depth" in the job's plan) is taken as it is: the admin asked for it,
// and a worker that cannot hold it refuses the assignment for memory as for any other pinned
// shard. Otherwise it is the largest depth ≤ M−1 at which every stage still fits the memory its
// peer offered (plannedMemory), by the very estimate the worker checks its assignment against
// (sched.StageShardMemory, with the experts the stage's Assign places elsewhere; for a stage whose
// Assign carries a replica, sched.ReplicaShardMemory, as client's checkMemory does):
// extra depth costs no compute, only the activations of the micro-batches it keeps, and it hides
// the link latency a stage otherwise waits out before its first gradient. Expert hosts are
// budgeted for all M micro-batches in flight (sched.ExpertShardMemory), which bounds every depth,
// so they never limit it. When not even depth 0 fits, 0: the planner's own memory check (or the
// worker's, for a pinned plan) has the last word.
func (j *jobRun) planDepth(stages []placement, replicas map[[2]int][]string) int {
	M := j.spec.MicroBatches
	if p := j.spec.Plan; p != nil && p.Depth != nil {
		return *p.Depth
	}
	if M < 1 {
		return 0
	}
	b := j.spec.BatchSize / M
	reps := replicaRuns(stages)
	maxDepth := M - 1
	for _, rr := range reps {
		maxDepth = min(maxDepth, rr.n-1) // a replica's schedule has its share of micro-batches
	}
	replica := j.assignsReplica(len(reps))
	fits := func(depth int) bool {
		for _, rr := range reps {
			if j.fitsDepth(stages[rr.lo:rr.hi], replicas, b, rr.n, depth, replica) != nil {
				return false
			}
		}
		return true
	}
	// Memory grows with the depth (until every stage holds M), so the first depth that does not
	// fit ends the search.
	depth := 0
	for depth < maxDepth && fits(depth+1) {
		depth++
	}
	return depth
}

// fitsDepth checks the stages of one pipeline, computing M micro-batches at the given depth,
// against the memory their peers offered; nil when they fit. With replica their Assigns carry a
// replica (assignsReplica), and each is checked as its worker will check it: by the replica
// planner's formula, which in outer mode counts no gradient tree (the inner step sums its
// micro-batches in a chain) where the pipeline's counts one of M micro-batches — at M 64, 24
// bytes a parameter the worker never keeps, which kept a whole replica of the 1B model off a
// 24 GB peer whatever its depth.
func (j *jobRun) fitsDepth(stages []placement, replicas map[[2]int][]string, b, M, depth int, replica bool) error {
	for i, st := range stages {
		pr := j.peers[st.peer]
		if pr == nil || pr.hello == nil {
			continue // gone: the plan fails at assignment anyway
		}
		if replica {
			// Experts on hosts are counted as held, as the worker counts them.
			need, err := sched.ReplicaShardMemory(j.spec.Model, b, st.begin, st.end, i, len(stages), st.first, st.n, min(depth, st.n-1), j.spec.ShardJob(), j.spec.ReplicaOptions())
			if err != nil {
				return err
			}
			if need > float64(j.plannedMemory(pr)) {
				return errNoFit
			}
			continue
		}
		remote := 0
		for blk := st.begin; blk < st.end; blk++ {
			for e := 0; e < j.spec.Model.NExpert; e++ {
				if len(replicas[[2]int{blk, e}]) > 0 {
					remote++
				}
			}
		}
		need, err := sched.StageShardMemory(j.spec.Model, b, M, st.begin, st.end, i, len(stages), remote, depth, j.spec.ShardJob())
		if err != nil {
			return err
		}
		if need > float64(j.plannedMemory(pr)) {
			return errNoFit
		}
	}
	return nil
}

// assignsReplica says whether a plan of n replicas gives its stages' Assigns a replica
// (proto.Assign.Replica): more than one, or any in outer mode. Their workers then check their
// shards by the replica planner's formula (sched.ReplicaShardMemory).
func (j *jobRun) assignsReplica(n int) bool {
	return n > 1 || j.spec.Outer()
}

var errNoFit = errors.New("does not fit")
