package sched

import "fmt"

// Shares by measured pace (issue 30: a pool's work "weighted by measured throughput"). The planner
// sizes step-mode replicas' shares of a step's micro-batches to the speeds it believes — claims
// until measured, benchmarks, a class's figures — and a volunteer's machine changes speed under it
// (a browser tab in the background, a laptop on battery, another job on the same GPU). Whoever
// computes a micro-batch, a step's gradient is the same tree over the same micro-batches
// (model/gradtree.go), so the shares can follow the replicas' measured pace at a step boundary
// without a checkpoint and without changing a bit: every replica keeps its state, and only the
// runs of micro-batches move (coordinator/rebalance.go).

// PaceShares splits M micro-batches over replicas whose measured pace — compute seconds a
// micro-batch — is pace, each replica at least one and at most its cap (caps[r], what its
// workers' memory holds; nil for none), so that the slowest replica's time (StepTime) is as short
// as it can be: after one each, the micro-batches go one at a time to the replica below its cap
// that would finish its next one soonest (ties to the lower position), which is the min-max
// allocation. nil when there are fewer micro-batches than replicas, no replica, a pace that is
// not positive and finite, or caps that cannot hold M.
func PaceShares(pace []float64, caps []int, M int) []int {
	if len(pace) == 0 || M < len(pace) || caps != nil && len(caps) != len(pace) {
		return nil
	}
	room := func(r, n int) bool { return caps == nil || n < caps[r] }
	for _, p := range pace {
		if !(p > 0) || p > 1e12 {
			return nil
		}
	}
	n := make([]int, len(pace))
	for r := range n {
		if caps != nil && caps[r] < 1 {
			return nil
		}
		n[r] = 1
	}
	for range M - len(pace) {
		best := -1
		for r := range n {
			if room(r, n[r]) && (best < 0 || float64(n[r]+1)*pace[r] < float64(n[best]+1)*pace[best]) {
				best = r
			}
		}
		if best < 0 {
			return nil
		}
		n[best]++
	}
	return n
}

// StepTime is the replicas' compute time of a step whose shares are n at pace: the slowest
// replica's n × pace (they reduce together, so the step waits for it).
func StepTime(n []int, pace []float64) float64 {
	t := 0.0
	for r := range n {
		t = max(t, float64(n[r])*pace[r])
	}
	return t
}

// Rebalance is the verdict of WeighRebalance.
type Rebalance struct {
	// Shares are the micro-batches each replica would compute, by position; nil when none differ.
	Shares []int
	// Before and After are the step's compute time (StepTime) with the shares now and with Shares.
	Before, After float64
	// Pays says whether to change: the step gets faster by RebalanceMinGain at least, and the time
	// saved over the next RebalanceHorizon steps (or the steps left) repays the change's cost
	// RebalancePayback times.
	Pays bool
	Why  string
}

const (
	// RebalanceMinGain is how much shorter the step's compute must get: a measured pace moves by
	// a few percent from step to step on a shared machine, and a change of shares for less would
	// chase that noise.
	RebalanceMinGain = 0.2
	// RebalanceHorizon is how many steps ahead a gain is counted: paces change, and a gain
	// promised for the rest of a long job is not one to bet a change on.
	RebalanceHorizon = 50
	// RebalancePayback is how many times over the time saved within the horizon must repay the
	// change (new Assigns, every stage keeping its state, the links of a new plan version).
	RebalancePayback = 4
)

// WeighRebalance weighs sharing a step's micro-batches again: n are the replicas' shares now, pace
// their measured compute seconds a micro-batch and caps the most each can hold (by position, as
// n; nil for no caps), left the steps the job has still to run and cost the seconds a change of
// plan that keeps every state takes.
func WeighRebalance(n []int, pace []float64, caps []int, left int, cost float64) Rebalance {
	M := 0
	for _, k := range n {
		M += k
	}
	if len(pace) != len(n) || len(n) < 2 {
		return Rebalance{Why: "fewer than two replicas"}
	}
	to := PaceShares(pace, caps, M)
	if to == nil {
		return Rebalance{Why: "no pace measured for every replica"}
	}
	v := Rebalance{Before: StepTime(n, pace), After: StepTime(to, pace)}
	same := true
	for r := range n {
		same = same && n[r] == to[r]
	}
	if same {
		v.Why = "the shares are the measured pace's already"
		return v
	}
	v.Shares = to
	saved := (v.Before - v.After) * float64(min(max(left, 0), RebalanceHorizon))
	switch {
	case v.After > (1-RebalanceMinGain)*v.Before:
		v.Why = fmt.Sprintf("the step's compute would fall from %.3g s to %.3g s, less than %.0f%%", v.Before, v.After, 100*RebalanceMinGain)
	case saved < RebalancePayback*cost:
		v.Why = fmt.Sprintf("%.3g s saved over the next %d steps does not repay a change of %.3g s %d times", saved, min(max(left, 0), RebalanceHorizon), cost, RebalancePayback)
	default:
		v.Pays = true
		v.Why = fmt.Sprintf("the step's compute falls from %.3g s to %.3g s", v.Before, v.After)
	}
	return v
}

// WeightedShares divides M micro-batches among len(weights) ≤ M parts in proportion to the
// positive weights, each at least one, by largest remainder (ties to the earlier part): a pinned
// plan's replicas sharing the step's micro-batches when fewer of them run than it pins
// (coordinator), or when a job's warm-up shares the batch its own-batch replicas each train
// whole (job.Spec.Phase).
func WeightedShares(weights []int, M int) []int {
	total := 0
	for _, w := range weights {
		total += w
	}
	out := make([]int, len(weights))
	rem := make([]float64, len(weights))
	left := M
	for i, w := range weights {
		exact := float64(w) * float64(M) / float64(total)
		out[i] = max(int(exact), 1)
		rem[i] = exact - float64(out[i])
		left -= out[i]
	}
	for left != 0 {
		best := -1
		for i := range out {
			if left > 0 && (best < 0 || rem[i] > rem[best]) {
				best = i
			}
			if left < 0 && out[i] > 1 && (best < 0 || rem[i] < rem[best]) {
				best = i
			}
		}
		if left > 0 {
			out[best]++
			rem[best]--
			left--
		} else {
			out[best]--
			rem[best]++
			left++
		}
	}
	return out
}
