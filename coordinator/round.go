package coordinator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Outer mode's replicas run free between outer steps. Each replica's inner step depends on
// nothing from another replica — its own micro-batches, its own norm and clip factor, its own
// AdamW — so the coordinator drives each replica through the steps of a round at its own pace:
// as soon as a replica's stages have reported step s, they get their clip factor and step s+1,
// whatever the other replicas are doing. Driving them in lockstep instead made every step wait
// for the slowest replica's step and for the coordinator's round trip to all of them, which is
// DiLoCo's communication every step by other means: E[max] of the replicas' step times, step
// after step, where free replicas pay the max of their sums once a round.
//
// Everyone stands still at a round's end (roundEnd): before an outer step, an evaluation, a
// checkpoint, the job's end, and at least every maxRoundSteps steps, so that admin commands,
// replans for joining workers and checkpoints by time wait no longer than that. An outer step
// taken with a delay (job.Sync.Delay) is no round's end: each replica's stages are asked for it
// as the replica finishes its step, and the replica trains on while the exchange runs, so that
// replicas do not wait for each other there either — only for the exchange, if it takes longer
// than the delay, when they take the outer step up. A step is
// recorded — its losses are the replicas' weighed in replica order (outerTotals), exactly as in
// lockstep — once every replica has reported it; the numbers are the same bits either way, only
// the waiting differs. A failure anywhere abandons the round like a failed step: the job replans
// from the newest complete checkpoint, which is always at a round's end.
//
// A replica whose worker leaves during a round is dropped at once when the rule book says so
// (sched.Decide: another replica survives, and no outer exchange it took part in may be in
// flight): the others carry on, the steps not yet recorded are recorded without it — its reports
// of them are discarded — and no later outer step counts it (outerSync's participants), so its
// round is left out of the next outer average. The plan's status records from which step
// (PlanStatus.Dropped), so that a replay leaves it out from the same step.

// maxRoundSteps bounds a round of free-running replicas (see above).
const maxRoundSteps = 20

// roundEnd is the end (exclusive) of the round of outer mode that begins at step s0.
func (j *jobRun) roundEnd(s0 int) int {
	spec := j.spec
	for s := s0; ; s++ {
		done := s + 1
		if done >= spec.Steps || done-s0 >= maxRoundSteps || (spec.OuterStepAfter(s) && spec.OuterTakeUpAfter(s) == s) ||
			(spec.ValEvery > 0 && s%spec.ValEvery == 0) ||
			(spec.CheckpointEvery > 0 && done%spec.CheckpointEvery == 0) {
			return done
		}
	}
}

// freeRunning reports whether the active plan's steps run as rounds of free-running replicas:
// outer mode, stages only (outer mode places no expert hosts).
func (j *jobRun) freeRunning() bool {
	return j.spec.Outer() && len(j.reps) > 0 && len(j.participants()) == len(j.stages)
}

// replicaInFlight is a replica's progress through a round.
type replicaInFlight struct {
	step     int       // the step its stages are computing; -1 when none
	opened   time.Time // when that step was opened
	due      time.Time // its deadline
	answered []bool    // by stage of the replica: reported (or failed) the step
	left     int       // stages yet to answer
	// spec, x and y are the step as opened and the inputs sent: its audits check them
	// (auditReplicaStep).
	spec proto.StepSpec
	x, y []int32
}

// stepInFlight gathers a step's reports from the replicas as they finish it.
type stepInFlight struct {
	reports []*proto.StepReport // by participant
	elapsed []time.Duration     // by participant: from its replica's open to its report
	done    []bool              // by replica: finished the step
	left    int                 // replicas yet to finish the step
}

// trainRound drives the round of outer mode that begins at j.step (see the top of this file),
// recording every step as it completes and advancing j.step past it, and at the round's end takes
// the outer step, evaluation and checkpoint that are due.
func (j *jobRun) trainRound(ctx context.Context) error {
	if err := j.auditBackpressure(ctx); err != nil {
		return err
	}
	spec := j.spec
	s0 := j.step
	s1 := j.roundEnd(s0)
	parts := j.participants()
	M, B, T := spec.MicroBatches, spec.BatchSize, spec.Model.BlockSize
	reps := make([]replicaInFlight, len(j.reps))
	steps := map[int]*stepInFlight{}
	j.replicaAt = make([]int, len(j.reps))
	j.phase = sched.PhaseTraining
	defer func() { j.phase = sched.PhaseBoundary }()
	// A step's shared batch is drawn once, when the first replica opens the step, and kept until
	// the last has.
	type sharedBatch struct {
		x, y []int32
		left int // replicas yet to open the step
	}
	shared := map[int]*sharedBatch{}
	// open opens step s on replica r's stages and sends its micro-batches: its share of the step's
	// batch, or with own batches its own batch.
	open := func(r, s int) error {
		rr := j.reps[r]
		o := &proto.StepOpen{Step: uint64(s), PlanVersion: j.version, LR: spec.LRAt(s), MicroBatches: M,
			DeadlineMS: j.deadline().Milliseconds(), Rows: B / M}
		var x, y []int32
		var err error
		switch {
		case !spec.OwnBatches():
			b := shared[s]
			if b == nil {
				b = &sharedBatch{left: len(j.reps)}
				if b.x, b.y, err = j.corpus.Batch(spec.Seed, s, B, T); err != nil {
					return err
				}
				shared[s] = b
			}
			x, y = b.x, b.y
			if b.left--; b.left == 0 {
				delete(shared, s)
			}
		case rr.index > 0 || rr.n != M:
			o.MicroBatches = rr.n
			x, y, err = j.replicaBatch(r, s)
		default: // the first replica's own batch of M micro-batches is the job's batch
			x, y, err = j.corpus.Batch(spec.Seed, s, B, T)
		}
		if err != nil {
			return err
		}
		j.replicaAt[r] = s
		for _, p := range parts[rr.lo:rr.hi] {
			if err := j.s.hub.Send(p, o); err != nil {
				return j.sendFailed(p, "open step on", err)
			}
		}
		if steps[s] == nil {
			steps[s] = &stepInFlight{reports: make([]*proto.StepReport, len(parts)), elapsed: make([]time.Duration, len(parts)),
				done: make([]bool, len(j.reps)), left: len(j.reps)}
		}
		now := time.Now()
		reps[r] = replicaInFlight{step: s, opened: now, due: now.Add(time.Duration(o.DeadlineMS) * time.Millisecond), answered: make([]bool, rr.hi-rr.lo), left: rr.hi - rr.lo,
			spec: stepSpec(o), x: x, y: y}
		return j.sendInputs(rr, stepSpec(o), x, y)
	}
	var failure error // the round is abandoned: open nothing more, wait for the steps in flight
	fail := func(err error) {
		if failure == nil {
			failure = err
		}
	}
	// finished takes replica r's step once all its stages reported it: its clip factor goes to
	// its stages, and its next step opens.
	finished := func(r int) error {
		rr, s := j.reps[r], reps[r].step
		reps[r].step = -1
		st := steps[s]
		st.left--
		st.done[r] = true
		_, _, norm, err := proto.StepTotals(st.reports[rr.lo:rr.hi], rr.n)
		if err != nil {
			return fmt.Errorf("%w: step %d: replica %d: %v", errStep, s, r, err)
		}
		if math.IsNaN(norm) || math.IsInf(norm, 0) {
			return fmt.Errorf("%w: step %d diverged on replica %d (gradient norm %v)", errStep, s, r, norm)
		}
		factor := model.ClipFactor(norm, spec.Clip)
		// Commitments are checked, and the replica's previous step drawn for audit, before its
		// clip factor lets its stages apply this step.
		in := reps[r]
		reps[r].x, reps[r].y = nil, nil
		if err := j.auditReplicaStep(ctx, r, s, in.spec, factor, st.reports[rr.lo:rr.hi], in.x, in.y); err != nil {
			return err
		}
		clip := &proto.Clip{Step: uint64(s), PlanVersion: j.version, Factor: float64(factor)}
		for _, p := range parts[rr.lo:rr.hi] {
			if err := j.s.hub.Send(p, clip); err != nil {
				return j.sendFailed(p, "clip to", err)
			}
		}
		if s+1 < s1 && spec.OuterStepAfter(s) { // delayed: no round's end
			j.outerAsking = true // until the step is recorded, every replica asked
			if err := j.outerSync(s, r, 0); err != nil {
				return err
			}
		}
		if s+1 < s1 && failure == nil {
			return open(r, s+1)
		}
		return nil
	}
	// drop takes replica d out of the round (see the top of this file): its steps not recorded
	// yet wait for it no more and lose its reports, a shared batch no longer waits for it to
	// open a step, and the plan goes on without it (dropReplica).
	drop := func(d *replicaLeft) {
		p := slices.IndexFunc(j.reps, func(rr replicaRun) bool { return rr.index == d.index })
		if p < 0 {
			return
		}
		rr := j.reps[p]
		for _, st := range steps {
			if !st.done[p] {
				st.left--
			}
			st.reports = slices.Delete(st.reports, rr.lo, rr.hi)
			st.elapsed = slices.Delete(st.elapsed, rr.lo, rr.hi)
			st.done = slices.Delete(st.done, p, p+1)
		}
		for s, b := range shared {
			if s > j.replicaAt[p] {
				if b.left--; b.left == 0 {
					delete(shared, s)
				}
			}
		}
		reps = slices.Delete(reps, p, p+1)
		j.dropReplica(p, d, j.step, false)
		parts = j.participants()
	}
	// left drops the replica a send found gone (a send to a worker that left finds it gone
	// before the hub's event does: sendFailed), reporting whether it did.
	left := func(err error) (bool, error) {
		if d, ok := errors.AsType[*replicaLeft](err); ok {
			drop(d)
			return true, nil
		}
		return false, err
	}
	for r := 0; r < len(j.reps); r++ {
		if lost, err := left(open(r, s0)); err != nil {
			return err
		} else if lost {
			r-- // the replicas after it moved down one
		}
	}
	last := time.Now() // when the previous step completed: a step's wall time runs from there
	for s := s0; s < s1; {
		// Record the steps every replica has finished, in order.
		if st := steps[s]; st != nil && st.left == 0 && failure == nil {
			delete(steps, s)
			// Recording a step may evaluate and take the outer step: no round in flight there.
			j.phase = sched.PhaseBoundary
			err := j.completeStep(ctx, s, s1, st, time.Since(last))
			j.phase = sched.PhaseTraining
			if err != nil {
				return err
			}
			last = time.Now()
			s++
			continue
		}
		inFlight := false
		deadline := time.Time{}
		for r := range reps {
			if reps[r].step >= 0 {
				inFlight = true
				if d := reps[r].due; deadline.IsZero() || d.Before(deadline) {
					deadline = d
				}
			}
		}
		var due <-chan time.Time // nil: waiting only on a suspected departure (linkSuspect)
		var timer *time.Timer
		if !inFlight {
			if failure != nil {
				return failure
			}
			if j.suspect == nil {
				return fmt.Errorf("round of steps %d to %d stalled at step %d", s0, s1, s) // unreachable
			}
		} else {
			timer = time.NewTimer(time.Until(deadline))
			due = timer.C
		}
		ev, late, err := j.awaitEvent(ctx, due)
		if timer != nil {
			timer.Stop()
		}
		if d, ok := errors.AsType[*replicaLeft](err); ok {
			drop(d)
			continue
		}
		if errors.Is(err, errStayed) {
			fail(err)
			continue
		}
		if err != nil {
			return err
		}
		if late {
			// The peers that did not answer in time are lost to this plan: drop them (they may
			// rejoin) and record it.
			for r := range reps {
				if reps[r].step < 0 || time.Now().Before(reps[r].due) {
					continue
				}
				rr := j.reps[r]
				for k, ok := range reps[r].answered {
					if !ok {
						id := parts[rr.lo+k]
						j.s.event(j.rec.ID, "worker.deadline", id, map[string]any{"step": reps[r].step})
						j.s.hub.Drop(id, fmt.Errorf("no report for step %d within its %v deadline", reps[r].step, reps[r].due.Sub(reps[r].opened)))
					}
				}
				return fmt.Errorf("%w: step %d missed its deadline on replica %d", errStep, reps[r].step, r)
			}
			continue
		}
		if ev.Kind != EventMessage {
			continue
		}
		i := slices.Index(parts, ev.Worker)
		if i < 0 {
			continue
		}
		r := j.replicaOf(i)
		k := i - j.reps[r].lo
		switch m := ev.Msg.(type) {
		case *proto.Error:
			// A step failure of the step in flight on the worker's replica: the round is abandoned
			// once every step in flight has answered (so that what the others report, an
			// outer-step refusal among it, is weighed first).
			if m.Step == nil || reps[r].step < 0 || *m.Step != uint64(reps[r].step) || reps[r].answered[k] {
				continue
			}
			failed := fmt.Errorf("%w: step %d failed on %s: %v", errStep, reps[r].step, ev.Worker, m)
			if rr := j.reps[r]; m.Peer != "" && m.Peer != ev.Worker && slices.Contains(parts[rr.lo:rr.hi], m.Peer) && j.suspect == nil {
				// Lost on a link to a stage of its own replica: if that stage is leaving, its
				// departure drops the replica (drop) and the others carry on; if it stays, the
				// round fails (awaitDeparture in step.go).
				j.suspect = &linkSuspect{peer: m.Peer, err: fmt.Errorf("%w: %w", errStayed, failed), until: time.Now().Add(linkGrace)}
			} else {
				fail(failed)
			}
			reps[r].answered[k] = true
			if reps[r].left--; reps[r].left == 0 {
				reps[r].step = -1
			}
		case *proto.StepReport:
			if m.PlanVersion != j.version || reps[r].step < 0 || m.Step != uint64(reps[r].step) {
				j.s.log.Debug("stale report", "from", ev.Worker, "step", m.Step, "plan", m.PlanVersion)
				continue
			}
			if reps[r].answered[k] {
				j.s.hub.Drop(ev.Worker, fmt.Errorf("unexpected report for step %d", m.Step))
				continue
			}
			if m.Eval {
				return fmt.Errorf("%w: %s sent a report of the wrong kind", errStep, ev.Worker)
			}
			st := steps[reps[r].step]
			st.reports[i], st.elapsed[i] = m, time.Since(reps[r].opened)
			reps[r].answered[k] = true
			if reps[r].left--; reps[r].left > 0 {
				continue
			}
			if failure != nil {
				reps[r].step = -1
				continue
			}
			if _, err := left(finished(r)); err != nil {
				return err
			}
		}
	}
	return nil
}

// completeStep records step s of a round ending at s1 once every replica finished it, taking the
// outer step after it when one is due, and advances the job past it (afterStep: progress, and at
// the round's end the checkpoint that is due).
func (j *jobRun) completeStep(ctx context.Context, s, s1 int, st *stepInFlight, dt time.Duration) error {
	ce, aux, norm, _, err := j.outerTotals(st.reports)
	if err != nil {
		return fmt.Errorf("%w: step %d: %v", errStep, s, err)
	}
	if math.IsNaN(norm) || math.IsInf(norm, 0) || math.IsNaN(ce) {
		return fmt.Errorf("%w: step %d diverged (loss %v, gradient norm %v)", errStep, s, ce, norm)
	}
	// Every replica's clip factor for s went out as it finished: what the stages read next is the
	// outer step. A delayed one, within the round, went out with the clip factors. recordStep
	// takes it once what it counts by participant is counted: a replica lost during the outer
	// exchange leaves the plan (awaitOuter).
	var outer func() error
	switch {
	case s == s1-1 && j.spec.OuterStepAfter(s):
		outer = func() error { return j.outerStep(ctx, s) }
	case j.spec.OuterStepAfter(s):
		outer = func() error { j.recordOuterStep(s); return nil }
	}
	if err := j.recordStep(ctx, s, j.spec.LRAt(s), st.reports, st.elapsed, dt, ce, aux, norm, outer); err != nil {
		return err
	}
	if err := j.afterStep(ctx, s, s == s1-1); err != nil {
		return err
	}
	j.step = s + 1
	return nil
}

// dropReplica drops the replica at position p of the active plan, whose worker d.worker left
// during a round or an outer exchange (sched.DropReplica): the plan goes on with the others, each
// keeping its index; the replica's other workers stand by; the drop is recorded as an event and
// in the plan's status, from step from, the first step recorded without it (PlanStatus.Dropped),
// and with leftOut as left out of the outer step after step from−1 too, and the plan is
// published again (Config.OnPlan), so that a plans file replays it.
func (j *jobRun) dropReplica(p int, d *replicaLeft, from int, leftOut bool) {
	rr := j.reps[p]
	dr := droppedReplica{index: rr.index, step: from, first: rr.first, n: rr.n, leftOut: leftOut}
	for _, st := range j.stages[rr.lo:rr.hi] {
		dr.stages = append(dr.stages, [2]int{st.begin, st.end})
		if st.peer != d.worker && j.peers[st.peer] != nil {
			j.standby = append(j.standby, st.peer)
		}
	}
	j.dropped = append(j.dropped, dr)
	if j.outerLeft == nil {
		j.outerLeft = map[string]int{}
	}
	for _, st := range j.stages[rr.lo:rr.hi] {
		e, ok := j.outerFed[st.peer]
		if !ok {
			e = -1
		}
		j.outerLeft[st.peer] = e
	}
	j.refillDue = true // standbys and newcomers may staff it again (grow.go)
	j.stages = slices.Delete(j.stages, rr.lo, rr.hi)
	j.reps = replicaRuns(j.stages)
	if p < len(j.replicaAt) { // none while a plan loads
		j.replicaAt = slices.Delete(j.replicaAt, p, p+1)
	}
	// The others may be exchanging an outer step with it, or about to: tell them it left, so that
	// they stop waiting for it now rather than when their links to it time out (proto.PeerLeft).
	for _, st := range j.stages {
		if err := j.s.hub.Send(st.peer, &proto.PeerLeft{PlanVersion: j.version, Worker: d.worker}); err != nil {
			j.s.log.Debug("peer_left not sent", "to", st.peer, "err", err)
		}
	}
	j.s.log.Warn("replica dropped", "replica", rr.index, "worker", d.worker, "step", from, "replicas", len(j.reps), "left_out_of_outer_step", leftOut)
	j.s.event(j.rec.ID, "replica.dropped", d.worker, map[string]any{"replica": rr.index, "step": from, "plan": j.version,
		"replicas": len(j.reps), "reason": d.why, "left_out": leftOut})
	j.publish()
	if j.s.cfg.OnPlan != nil {
		j.s.cfg.OnPlan(*j.s.status.Load().Plan)
	}
}

// sendFailed is the error of a send to worker p of the active plan that failed (what it sent:
// "clip to"). A worker that left is gone from the hub before its departure event reaches the job
// loop: the rule book decides as it does for the event (handle), which then finds p out of the
// plan when the rule book dropped its replica.
func (j *jobRun) sendFailed(p, what string, err error) error {
	if errors.Is(err, ErrUnknownWorker) {
		if d := sched.Decide(j.membership(), sched.Change{Left: p}); d.Action == sched.DropReplica || d.Action == sched.Reshare {
			return &replicaLeft{worker: p, index: d.Replica, why: d.Why, reshare: d.Action == sched.Reshare}
		}
	}
	return fmt.Errorf("%w: %s %s: %v", errReplan, what, p, err)
}
