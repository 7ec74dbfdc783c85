package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Departures in step mode without a restore (issue 30; sched.Reshare). A step-mode replica
// computes micro-batches [first, first+n) of every step and reduces its gradient with the other
// replicas' in a fixed tree over all M micro-batches (model/gradtree.go): whoever computes a
// micro-batch, the step's gradient is the same bits. So when a worker of a replica leaves, the
// replica leaves the plan and the survivors share its micro-batches: a new plan version from the
// step in flight, every survivor keeping the shard it holds (proto.Keep) — no checkpoint restored,
// no step replayed. The step in flight, which no survivor applied (its clip factor never went out),
// is computed again under the new plan; what the departure costs is that step's work so far, the
// new Assigns and the new links between the survivors.
//
// A departure heard after a step's clip factors went out leaves that step complete and applied
// by every survivor (stepRule.finished sends the others theirs): the job reshares from the next step, and
// a checkpoint the departure cut short is asked again of the new plan (afterStep, ckAgain).
//
// The chain of custody (custody.go) runs through the change: a kept shard's Ready carries the
// digest of the state it kept (proto.Ready.State), which is the worker's commitment to how the
// previous plan's last step ended — that step is drawn for audit against it, under the
// assignment it was computed under (checkKept) — and which its first report under the new plan
// must commit to again. Survivors holding the same blocks on one CPU kernel family must keep the
// same state bit for bit; when they do not, all of them are audited (a dispute, as twinDisputes).
//
// A survivor that cannot keep its shard (it holds another plan's, another step's) refuses the
// Assign, and the job falls back to a restore, as it does for a departure while the new plan
// loads.

// resharing is the departure err carries when the rule book answered it with sched.Reshare.
func resharing(err error) *replicaLeft {
	if d, ok := errors.AsType[*replicaLeft](err); ok && d.reshare {
		return d
	}
	return nil
}

// reshare answers sched.Reshare: the replica that d's worker left leaves the plan, the others
// share its micro-batches from j.step on, keeping their shards (see the top of this file).
func (j *jobRun) reshare(ctx context.Context, d *replicaLeft) error {
	// A step abandoned after a stage of it was taken over (a second departure: takeover.go):
	// the lost stage's replica stands by before the survivors share the step.
	rec := j.rerouted
	takenOver := rec != nil && rec.takeover != nil && !slices.Contains(rec.left, d)
	if takenOver {
		j.standTakenOver(rec.takeover)
	}
	p := j.replicaPos(d.index)
	// A replica rerouted around during the step just completed has left the plan already, its
	// workers standing by (reroute.go): the survivors share the micro-batches as before it. So
	// has one whose stage was taken over, when another of its workers left before the step ended.
	rerouted := rec != nil && (slices.Contains(rec.left, d) || takenOver && d.index == rec.takeover.tk.Replica)
	j.rerouted = nil
	if !j.phase.planned() || !rerouted && (p < 0 || len(j.reps) < 2) {
		return fmt.Errorf("%w: worker %s left: replica %d is not in a plan to reshare", errReplan, d.worker, d.index)
	}
	t0 := time.Now()
	standby := slices.Clone(j.standby)
	var stages []placement
	if rerouted {
		stages = slices.Clone(j.stages) // a stage taken over stood its replica by already (standTakenOver)
		for k := range stages {
			stages[k].n = rec.n[stages[k].replica]
		}
	} else {
		rr := j.reps[p]
		for _, st := range j.stages[rr.lo:rr.hi] {
			if st.peer != d.worker && j.peers[st.peer] != nil {
				standby = append(standby, st.peer)
			}
		}
		stages = slices.Concat(j.stages[:rr.lo], j.stages[rr.hi:])
	}
	// Left while a plan that hands state over got ready (a grow): a replica with a stage that has
	// not said it holds the state it takes — its giver may be the worker that left — has nothing
	// to keep, and stands by with its workers rather than refuse to keep and restore every shard.
	var unready []string
	for _, rr := range replicaRuns(stages) {
		if slices.ContainsFunc(stages[rr.lo:rr.hi], func(st placement) bool {
			p := j.peers[st.peer]
			return len(j.tookFrom[st.peer]) > 0 && (p == nil || p.ready != j.version)
		}) {
			for _, st := range stages[rr.lo:rr.hi] {
				unready = append(unready, st.peer)
			}
		}
	}
	if len(unready) > 0 {
		stages = slices.DeleteFunc(stages, func(st placement) bool { return slices.Contains(unready, st.peer) })
		for _, w := range unready {
			if j.peers[w] != nil && !slices.Contains(standby, w) {
				standby = append(standby, w)
			}
		}
		if len(stages) == 0 {
			return fmt.Errorf("%w: worker %s left while the plan got ready, and no replica left holds its state", errReplan, d.worker)
		}
		j.s.log.Warn("replicas whose stages had not taken their state yet stand by", "workers", unready)
	}
	stages = shareMicroBatches(stages, j.spec.MicroBatches)
	from, step := j.version, j.step
	left := len(replicaRuns(stages))
	ver, err := j.keepPlan(ctx, stages, j.hosts, standby, heldBy(stages), nil, func(ver uint32) {
		j.s.log.Warn("replica lost: the others share its micro-batches", "replica", d.index, "worker", d.worker, "step", step, "replicas", left)
		j.planChoice = fmt.Sprintf("%d replicas, step sync: replica %d was lost with worker %s at step %d, and the others share its micro-batches, keeping their state",
			left, d.index, d.worker, step)
		j.refillDue = len(standby) > 0
	})
	if err != nil {
		return err
	}
	shares := make([][2]int, len(j.reps))
	for r, rr := range j.reps {
		shares[r] = [2]int{rr.first, rr.first + rr.n}
	}
	if !rerouted { // a reroute said what it cost, during the step
		j.s.event(j.rec.ID, "work.rerouted", d.worker, map[string]any{"replica": d.index, "step": step, "plan": ver, "from_plan": from,
			"replicas": len(j.reps), "micro_batches": shares, "seconds": time.Since(t0).Seconds(), "reason": d.why})
		j.s.metrics.recovery()
	}
	if j.ckAgain == step {
		j.ckAgain = 0
		if err := j.checkpoint(ctx, step); err != nil {
			return err
		}
		j.lastCheckpoint = time.Now()
	}
	return nil
}

// shareMicroBatches gives the replicas of stages (replica after replica, as a plan lists them) the
// job's M micro-batches in proportion to the shares they had — which the planner sized to their
// speed — each at least one, contiguous in replica order, and numbers the replicas from 0.
func shareMicroBatches(stages []placement, M int) []placement {
	reps := replicaRuns(stages)
	total := 0
	for _, rr := range reps {
		total += rr.n
	}
	ns := make([]int, len(reps))
	type rem struct{ r, frac int }
	var rems []rem
	given := 0
	for r, rr := range reps {
		ns[r] = max(M*rr.n/total, 1)
		given += ns[r]
		rems = append(rems, rem{r, M * rr.n % total})
	}
	// The largest remainders get what flooring left; a replica raised to one micro-batch gives
	// it back from the largest share.
	slices.SortStableFunc(rems, func(a, b rem) int { return b.frac - a.frac })
	for i := 0; given < M; i++ {
		ns[rems[i%len(rems)].r]++
		given++
	}
	for given > M {
		ns[slices.Index(ns, slices.Max(ns))]--
		given--
	}
	out := slices.Clone(stages)
	first := 0
	for r, rr := range reps {
		for k := rr.lo; k < rr.hi; k++ {
			out[k].replica, out[k].first, out[k].n = r, first, ns[r]
		}
		first += ns[r]
	}
	return out
}

// checkKept ties the kept states of the active plan into the chain of custody (see the top of
// this file): each kept shard's Ready state is what the worker's first report under the plan must
// commit to, and the end of the previous plan's last step — prev, step-1 of plan from, run under
// the assignments olds — which is drawn for audit against it, every holder of a group of twins
// that disagree being audited. prev is nil when that step was drawn already (against the
// checkpoint a boundary replan took: drawBeforeReplan).
func (j *jobRun) checkKept(ctx context.Context, step int, prev *stepRecord, from uint32, olds map[string]*proto.Assign) error {
	if j.audits == nil {
		return nil
	}
	states, err := j.keptStates(step)
	if err != nil || j.spec.Outer() && !j.warmOut {
		// Outer mode: a replica's last step under the previous plan is not drawn, as at any
		// outer-mode replan (outeraudit.go) — its end state, and the outer step after it, are
		// crossed by the kept state's commitment alone — and the replicas' own states differ,
		// so there are no twins to compare.
		return err
	}
	force := map[string]bool{}
	for _, ks := range j.twins() {
		ks = slices.DeleteFunc(slices.Clone(ks), func(k int) bool { return states[j.stages[k].peer] == "" })
		agree := true
		for _, k := range ks {
			agree = agree && states[j.stages[k].peer] == states[j.stages[ks[0]].peer]
		}
		if agree {
			continue
		}
		var ws []string
		for _, k := range ks {
			ws = append(ws, j.stages[k].peer)
			force[j.stages[k].peer] = true
		}
		j.s.event(j.rec.ID, "state.disputed", "", map[string]any{"step": step - 1, "blocks": [2]int{j.stages[ks[0]].begin, j.stages[ks[0]].end}, "workers": ws})
	}
	if prev == nil || prev.plan != from || int(prev.spec.Step)+1 != step {
		return nil
	}
	for _, w := range prev.workers {
		if st, ok := states[w]; ok {
			j.askAuditOf(ctx, w, step-1, prev, st, force[w], olds[w])
		}
	}
	return nil
}

// keptStates ties each kept or taken-up state of the active plan into the chain of custody: its
// Ready state is what its first report under the plan must commit to, and a taker's must be what
// its giver said it handed over (grow.go: the giver's own state in step mode, the global θ with
// zero moments in outer mode). It returns the states by worker.
func (j *jobRun) keptStates(step int) (map[string]string, error) {
	states := map[string]string{}
	for _, w := range j.participants() {
		asg := j.audits.assigns[w]
		if asg == nil || asg.Keep == nil && len(asg.From) == 0 {
			continue // restored: its state is one the coordinator handed out (expectState)
		}
		p := j.peers[w]
		if p == nil || p.readyState == "" {
			return nil, fmt.Errorf("%w: worker %s kept or took up its shard without committing to the state it holds", errReplan, w)
		}
		if len(asg.From) > 0 {
			if err := j.disputeHandover(w, asg, p.readyState); err != nil {
				return nil, err
			}
		}
		states[w] = p.readyState
		j.expectKept(w, j.version, step, p.readyState)
	}
	for _, w := range j.handing() {
		// A holder that handed its stage over and stands by: its Ready state is what its taker's
		// must be, and the end of its last step, which may be drawn for audit against it.
		p := j.peers[w]
		if p == nil || p.readyState == "" {
			return nil, fmt.Errorf("%w: worker %s handed its stage over without committing to the state it holds", errReplan, w)
		}
		states[w] = p.readyState
	}
	return states, nil
}

// keepPlan takes up a new plan version of stages, hosts and standby at this step boundary in
// which every worker keeps the shard it holds (proto.Keep; held: each worker's blocks now) or
// takes it from a giver (from: taker → giver, a grow's), and ties the kept states into the chain
// of custody (checkKept): a reshare's, a grow's and a rebalance's change of plan. announce is
// told the new version before any Assign goes out (their log line and plan choice). It returns
// the version.
func (j *jobRun) keepPlan(ctx context.Context, stages []placement, hosts []hostPlacement, standby []string, held map[string][2]int, from map[string][]sched.Part, announce func(ver uint32)) (uint32, error) {
	// A stage keeps its state only with no delayed outer step half done (client: keepable).
	if err := j.commitDelayed(ctx); err != nil {
		return 0, err
	}
	fromPlan, step := j.version, j.step
	ver, err := j.savePlan(ctx, stages, hosts, standby)
	if err != nil {
		return 0, err
	}
	// What the audit of the previous plan's last step needs once the kept shards say what they
	// hold: its record and the assignments it ran under.
	var prev *stepRecord
	var olds map[string]*proto.Assign
	if a := j.audits; a != nil {
		prev, a.prev = a.prev, nil
		olds = maps.Clone(a.assigns)
	}
	announce(ver)
	j.keepRef, j.keepUploaded = nil, nil
	if err := j.adopt(ctx, ver, stages, hosts, standby, step, nil, &proto.Keep{FromPlan: fromPlan, Step: uint64(step)}, held, from); err != nil {
		return ver, err
	}
	return ver, j.checkKept(ctx, step, prev, fromPlan, olds)
}

// heldBy is the blocks each worker of stages holds.
func heldBy(stages []placement) map[string][2]int {
	held := make(map[string][2]int, len(stages))
	for _, st := range stages {
		held[st.peer] = [2]int{st.begin, st.end}
	}
	return held
}
