package coordinator

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Shares by measured pace (issue 30; sched.WeighRebalance). The planner sized the step-mode
// replicas' shares of a step's micro-batches to the speeds it believed; from then on each step's
// reports say how long every stage computed. A replica's pace is its slowest stage's compute time
// over its micro-batches (the stages of a pipeline work at once, so the slowest bounds it), and
// the replicas reduce together, so the step waits for the slowest replica. When the replicas'
// median paces over the plan's last paceWindow steps say that other shares would make the step's
// compute shorter by sched.RebalanceMinGain and repay the change, the job shares the micro-batches
// again at the next step boundary: a new plan version in which every stage keeps its state
// (proto.Keep, as a reshare's survivors do) and only the runs move. A step's gradient is the same
// tree over the same micro-batches whoever computes them, so no bit changes.
//
// Only the planner's own plans are rebalanced (a pinned plan pins its shares too), in step mode,
// with at least two replicas and no expert hosts (a host folds one run per replica). Steps with a
// reroute are not timed: their shares were not the plan's.
//
// The paces come from the workers' reports, which a worker could falsify. A worker that claims to
// be slower than it is (client.FaultFalsePace) sheds micro-batches onto the others — at most as
// slow as the coordinator's own clock allows: no stage is taken to have computed longer than the
// step took. One that claims to be faster is given more, and the step then waits for it. Either
// way the step gets slower, not faster, which the coordinator sees on its own clock whatever the
// reports say. So every rebalance is held to account (rebalanceVerify): once the new plan's steps
// are timed, a step that is not faster than before it, on the coordinator's clock, undoes the
// change at the next boundary and turns rebalancing off for the job. A liar costs the job one
// rebalance's worth of slower steps, then nothing.

const (
	// paceWindow is how many of a plan's timed steps (after measure's warm-up) its paces are the
	// median of, before the plan can be rebalanced.
	paceWindow = 5
	// minKeepCost is the least a change of plan keeping every state is taken to cost.
	minKeepCost = 50 * time.Millisecond
)

// paceTrack is what the coordinator measured of the active plan's replicas' paces.
type paceTrack struct {
	samples [][]float64 // by replica position: seconds a micro-batch, the last paceWindow steps
	walls   []float64   // the same steps' time on the coordinator's clock: open to last report
	// rebalanced is set on a plan that came from a rebalance until its steps are timed and found
	// faster than wallBefore, the median step of the plan before it; undo are that plan's shares.
	rebalanced bool
	wallBefore float64
	undo       []int
	// undoDue asks the next boundary to share the micro-batches as undo says.
	undoDue bool
	// off is set, for the job, once a rebalance did not deliver.
	off bool
	// cost is the last change of plan that kept every state, timed (0: none yet).
	cost time.Duration
}

// samplePace records the paces of step s of the active plan: reports and elapsed by participant.
func (j *jobRun) samplePace(s int, reports []*proto.StepReport, elapsed []time.Duration) {
	tr := &j.pace
	if !j.rebalanceShape() || j.planSteps <= warmupSteps || j.reroutedAt(s) != nil || len(reports) < len(j.stages) || len(elapsed) < len(j.stages) {
		return
	}
	if len(tr.samples) != len(j.reps) {
		tr.samples = make([][]float64, len(j.reps))
	}
	pace := make([]float64, len(j.reps))
	wall := time.Duration(0)
	for _, e := range elapsed {
		wall = max(wall, e)
	}
	for p, rr := range j.reps {
		for k := rr.lo; k < rr.hi; k++ {
			r := reports[k]
			if r == nil || elapsed[k] <= 0 || rr.n <= 0 {
				return
			}
			compute := min(max(time.Duration(r.Timings.ForwardNS+r.Timings.BackwardNS), time.Microsecond), elapsed[k])
			pace[p] = max(pace[p], compute.Seconds()/float64(rr.n))
		}
	}
	for p := range pace {
		tr.samples[p] = lastN(append(tr.samples[p], pace[p]), paceWindow)
	}
	tr.walls = lastN(append(tr.walls, wall.Seconds()), paceWindow)
	if tr.rebalanced && len(tr.walls) == paceWindow {
		j.rebalanceVerify()
	}
}

// lastN is the last n of xs.
func lastN(xs []float64, n int) []float64 {
	if len(xs) > n {
		return xs[len(xs)-n:]
	}
	return xs
}

// medianOf is the median of xs (the upper one of an even count), NaN of none.
func medianOf(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	c := slices.Clone(xs)
	slices.Sort(c)
	return c[len(c)/2]
}

// rebalanceShape says whether the active plan is one whose shares may follow the replicas' pace
// (see the top of this file).
func (j *jobRun) rebalanceShape() bool {
	return j.spec.Plan == nil && j.sync.book() == sched.SyncStep && len(j.reps) >= 2 && len(j.hosts) == 0 &&
		len(j.stages) > 0 && j.phase.planned()
}

// medianPaces are the replicas' median paces over the plan's last paceWindow timed steps, nil
// until every replica has that many.
func (j *jobRun) medianPaces() []float64 {
	tr := &j.pace
	if len(tr.samples) != len(j.reps) {
		return nil
	}
	out := make([]float64, len(tr.samples))
	for p, s := range tr.samples {
		if len(s) < paceWindow {
			return nil
		}
		out[p] = medianOf(s)
	}
	return out
}

// rebalanceVerify holds a rebalanced plan to account once paceWindow of its steps are timed (see
// the top of this file): a median step no faster, on the coordinator's clock, than the plan's
// before it means the paces that asked for the change were not the replicas' — noise, or a
// worker's false timings — and the change is undone at the next boundary, rebalancing off for the
// job.
func (j *jobRun) rebalanceVerify() {
	tr := &j.pace
	tr.rebalanced = false // judged once
	got := medianOf(tr.walls)
	if got < tr.wallBefore {
		return // it delivered: the shares may follow the paces again
	}
	tr.off, tr.undoDue = true, tr.undo != nil
	j.s.log.Warn("a rebalance did not make the step faster: undone, and no more for this job", "step", j.step, "step_s", got, "before_s", tr.wallBefore)
	j.s.event(j.rec.ID, "work.rebalance_undone", "", map[string]any{"step": j.step, "plan": j.version,
		"step_s": got, "step_s_before": tr.wallBefore, "micro_batches": tr.undo})
}

// rebalanceDue weighs the active plan's shares against its replicas' measured paces at this step
// boundary: the verdict when a change pays (or an undo is due), else nil.
func (j *jobRun) rebalanceDue() *sched.Rebalance {
	tr := &j.pace
	if !j.rebalanceShape() {
		return nil
	}
	if tr.undoDue {
		tr.undoDue = false
		if len(tr.undo) == len(j.reps) {
			return &sched.Rebalance{Shares: tr.undo, Pays: true, Why: "undone: the step did not get faster"}
		}
		return nil
	}
	if tr.off || tr.rebalanced {
		return nil
	}
	pace := j.medianPaces()
	if pace == nil {
		return nil
	}
	n := make([]int, len(j.reps))
	for p, rr := range j.reps {
		n[p] = rr.n
	}
	// Until a change that kept every state has been timed, it is taken to cost two steps: the
	// Assigns and Readys of a new plan version and its links are a round of the messages a step
	// sends.
	cost := tr.cost
	if cost == 0 {
		cost = max(2*time.Duration(medianOf(tr.walls)*float64(time.Second)), minKeepCost)
	}
	v := sched.WeighRebalance(n, pace, j.shareCaps(), j.spec.Steps-j.step, cost.Seconds())
	if !v.Pays {
		return nil
	}
	return &v
}

// shareCaps are the most micro-batches of a step each replica of the active plan can compute:
// the largest share whose every stage fits its worker's offered memory at depth 0 (fitsDepth;
// the plan's depth is then chosen to fit, as at any adoption) — a rebalance must not hand a
// worker a share it would refuse, which would cost a restore of every shard.
func (j *jobRun) shareCaps() []int {
	b, M := j.spec.BatchSize/max(j.spec.MicroBatches, 1), j.spec.MicroBatches
	caps := make([]int, len(j.reps))
	for p, rr := range j.reps {
		caps[p] = rr.n // held now: it fitted
		for n := rr.n + 1; n <= M && j.fitsDepth(j.stages[rr.lo:rr.hi], nil, b, n, 0, false) == nil; n++ {
			caps[p] = n
		}
	}
	return caps
}

// rebalance shares the step's micro-batches as v says from this step boundary on (see the top of
// this file): a new plan version, every stage keeping its state.
func (j *jobRun) rebalance(ctx context.Context, v *sched.Rebalance) error {
	t0 := time.Now()
	pace := j.medianPaces()
	wallBefore := medianOf(j.pace.walls)
	undo := make([]int, len(j.reps))
	for p, rr := range j.reps {
		undo[p] = rr.n
	}
	before := make([][2]int, len(j.reps))
	stages := slices.Clone(j.stages)
	first := 0
	for p, rr := range j.reps {
		before[p] = [2]int{rr.first, rr.first + rr.n}
		for k := rr.lo; k < rr.hi; k++ {
			stages[k].first, stages[k].n = first, v.Shares[p]
		}
		first += v.Shares[p]
	}
	from, step := j.version, j.step
	ms := make([]string, len(pace))
	for p, x := range pace {
		ms[p] = fmt.Sprintf("%.0f", 1000*x)
	}
	ver, err := j.keepPlan(ctx, stages, j.hosts, j.standby, heldBy(stages), nil, func(ver uint32) {
		j.s.log.Info("replicas' shares follow their measured pace", "step", step, "plan", ver, "shares", v.Shares, "pace_ms", ms, "why", v.Why)
		j.planChoice = fmt.Sprintf("%d replicas, step sync: micro-batches shared again by the replicas' measured pace (%s ms a micro-batch): %s",
			len(j.reps), strings.Join(ms, ", "), v.Why)
	})
	if err != nil {
		return err
	}
	after := make([][2]int, len(j.reps))
	for p, rr := range j.reps {
		after[p] = [2]int{rr.first, rr.first + rr.n}
	}
	took := time.Since(t0)
	j.pace.cost = took
	if !j.pace.off { // an undo is not held to account again
		j.pace.rebalanced, j.pace.wallBefore, j.pace.undo = true, wallBefore, undo
	}
	j.s.event(j.rec.ID, "work.rebalanced", "", map[string]any{"step": step, "plan": ver, "from_plan": from,
		"micro_batches_before": before, "micro_batches": after, "pace_ms": ms,
		"compute_s_before": v.Before, "compute_s_after": v.After, "seconds": took.Seconds()})
	return nil
}
