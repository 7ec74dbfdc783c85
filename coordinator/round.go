package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/job"
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
// checkpoint, the job's end, and at least every roundSteps steps, so that admin commands,
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

// roundSteps bounds a round of free-running replicas (see above) by steps and by time, at the
// median step time measured lately (sched.RoundSteps, the simulator's rule too): 20 steps, or as
// many as 30 s takes when steps are faster. Every round's end is a barrier, where a replica that
// vanished holds every other until it is noticed; at fleet scale that came at nearly every end.
func (j *jobRun) roundSteps() int {
	if len(j.stepTimes) == 0 {
		return sched.RoundSteps(0)
	}
	ts := slices.Clone(j.stepTimes)
	slices.Sort(ts)
	return sched.RoundSteps(ts[len(ts)/2].Seconds())
}

// outerRule is outer mode's sync rule (drive.go): rounds of free-running replicas, a group each.
type outerRule struct{}

func (outerRule) book() sched.SyncMode { return sched.SyncOuter }

// joins keeps a plan of the same shape — replicas of the same cuts and shares — whoever the
// planner would have staff it: moving a replica to a faster worker would cost a checkpoint and a
// restore of every replica, which under churn is the whole difference. For the same reason the
// replicas it dropped are staffed again at their indices (the replicas that stayed are not the
// planner's to move: their states differ) — when the planner too would run replicas of that
// shape; a refill it would not choose stalls the job for the handovers and leaves the replan due.
func (outerRule) joins(j *jobRun, fresh []string, stages []placement, hosts []hostPlacement, standby []string, _ string) (bool, *growth) {
	shape := len(hosts) == 0 && len(j.hosts) == 0
	kept := samePlacements(stages, hosts, j.stages, j.hosts) || shape && sameShape(stages, j.stages)
	_, pending := j.spec.OuterPending(j.step)
	if og := j.outerGrowable(fresh); og != nil && shape && sameShape(stages, og.stages) {
		og.later = pending
		return kept, og
	}
	if !kept {
		// Newcomers the planner would place: new replicas beside those that run, when they pay,
		// or else the planner's plan with the replicas it keeps kept and the rest taking the
		// global θ from their holders — rather than a checkpoint and a replan of everyone.
		g := j.outerExtend(fresh)
		if g == nil {
			g = j.outerReshape(stages, hosts, standby)
		}
		if g != nil {
			g.later = pending
		}
		return kept, g
	}
	return kept, nil
}

// leftOutAfter records worker's replica as left out of the outer steps after the last one it fed
// (fed: each worker's last step that fed one; none, -1): audits of only its steps since that it
// abandons roll nothing back (audit.go: abandon), until it holds a stage again (adopt).
func (j *jobRun) leftOutAfter(worker string, fed map[string]int) {
	if j.outerLeft == nil {
		j.outerLeft = map[string]int{}
	}
	e, ok := fed[worker]
	if !ok {
		e = -1
	}
	j.outerLeft[worker] = e
}

// roundEnd is the end (exclusive) of the round of outer mode that begins at step s0.
func (outerRule) roundEnd(j *jobRun, s0 int) int {
	spec := j.spec
	maxRoundSteps := j.roundSteps()
	for s := s0; ; s++ {
		done := s + 1
		// A growth that waits for a delayed outer step's take-up (growth.later) ends the round
		// right after it: the first boundary at which the takers have nothing to take up.
		_, before := spec.OuterPending(s)
		_, after := spec.OuterPending(done)
		if done >= spec.Steps || done-s0 >= maxRoundSteps || (spec.OuterStepAfter(s) && spec.OuterTakeUpAfter(s) == s) ||
			(j.growSoon && before && !after) ||
			(spec.ValEvery > 0 && s%spec.ValEvery == 0) ||
			(spec.CheckpointEvery > 0 && done%spec.CheckpointEvery == 0) {
			return done
		}
	}
}

// groups are the replicas, each its stages (outer mode places no expert hosts).
func (outerRule) groups(j *jobRun) []stepGroup {
	gs := make([]stepGroup, len(j.reps))
	for r, rr := range j.reps {
		for i := rr.lo; i < rr.hi; i++ {
			gs[r].members = append(gs[r].members, i)
		}
		gs[r].reps = []int{r}
	}
	return gs
}

// finished takes replica r's step once all its stages reported it: its own norm and clip factor,
// its audit work, the clip to its stages, and a delayed outer step asked as it finishes the step
// after which it is due.
func (outerRule) finished(ctx context.Context, j *jobRun, g stepGroup, s, s1 int, in *groupInFlight, reports []*proto.StepReport) (stepTotals, error) {
	r := g.reps[0]
	rr := j.reps[r]
	_, _, norm, err := proto.StepTotals(reports, rr.n)
	if err != nil {
		return stepTotals{}, fmt.Errorf("%w: step %d: replica %d: %v", errStep, s, r, err)
	}
	if math.IsNaN(norm) || math.IsInf(norm, 0) {
		return stepTotals{}, fmt.Errorf("%w: step %d diverged on replica %d (gradient norm %v)", errStep, s, r, norm)
	}
	factor := model.ClipFactor(norm, j.spec.Clip)
	// Commitments are checked, and the replica's previous step drawn for audit, before its
	// clip factor lets its stages apply this step.
	if err := j.auditReplicaStep(ctx, r, s, in.specs[0], factor, reports, in.xs[0], in.ys[0]); err != nil {
		return stepTotals{}, err
	}
	clip := &proto.Clip{Step: uint64(s), PlanVersion: j.version, Factor: float64(factor)}
	parts := j.participants()
	for _, i := range g.members {
		if err := j.s.hub.Send(parts[i], clip); err != nil {
			return stepTotals{}, j.sendFailed(parts[i], "clip to", err)
		}
	}
	if s+1 < s1 && j.spec.OuterStepAfter(s) { // delayed: no round's end
		if dl := j.delayed; dl == nil || dl.step != s {
			// The first replica asked: from here on none opens a step after the take-up
			// before the commit (train: delayedOuter.holdsOpen).
			j.askedDelayed(s)
		}
		// Asked its latest attempt: a replica dropped before this one finished step s is out
		// of it already, and the replicas asked before were asked again (redoDelayed).
		dl := j.delayed
		dl.asked[rr.index], dl.since = true, time.Now() // its deadline runs from the last ask
		if err := j.outerSync(s, r, dl.attempt); err != nil {
			return stepTotals{}, err
		}
	}
	return stepTotals{}, nil
}

// complete records step s of a round ending at s1 once every replica finished it, taking the
// outer step after it when one is due, and advances the job past it (afterStep: progress, and at
// the round's end the checkpoint that is due).
func (outerRule) complete(ctx context.Context, j *jobRun, s, s1 int, st *stepInFlight, dt time.Duration) error {
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

// replicaPos is the position in the active plan of the replica of index i; -1 when it has none
// (dropped already).
func (j *jobRun) replicaPos(i int) int {
	return slices.IndexFunc(j.reps, func(rr replicaRun) bool { return rr.index == i })
}

// dropReplica drops the replica at position p of the active plan, whose worker d.worker left
// during a round or an outer exchange (sched.DropReplica): the plan goes on with the others, each
// keeping its index; the replica's other workers stand by; the drop is recorded as an event and
// in the plan's status, from step from, the first step recorded without it (PlanStatus.Dropped),
// and with leftOut as left out of the outer step after step from−1 too, and the plan is
// published again (Config.OnPlan), so that a plans file replays it.
func (j *jobRun) dropReplica(p int, d *replicaLeft, from int, leftOut bool) {
	rr := j.reps[p]
	dr := droppedReplica{index: rr.index, step: from, first: rr.first, n: rr.n, leftOut: leftOut, leftOutOf: -1, ghostOf: -1}
	// A participant of the delayed outer step pending: the others take it again without it
	// (below). Its record says so when its step before that outer step counts (from after it);
	// dropped from that step or before, it trained nothing a replay would put in the step.
	redo := false
	if dl := j.delayed; dl != nil && !leftOut && slices.Contains(dl.participants, rr.index) {
		redo = true
		if from > dl.step {
			dr.leftOutOf = dl.step
		} else {
			dr.ghostOf = dl.step
		}
	}
	// A replica a refill staffed, dropped before any step of it counted: while the refill gets
	// ready (dropAtLoad), or during the plan's first step. Its holders restarted their error
	// feedback at the refill all the same, so a replay must grow it before it drops it.
	dr.refilled = (j.phase == phaseRejoining || from == j.planFrom) &&
		slices.ContainsFunc(j.stages[rr.lo:rr.hi], func(st placement) bool { return len(j.tookFrom[st.peer]) > 0 })
	for _, st := range j.stages[rr.lo:rr.hi] {
		dr.stages = append(dr.stages, [2]int{st.begin, st.end})
		if st.peer != d.worker && j.peers[st.peer] != nil {
			j.standby = append(j.standby, st.peer)
		}
	}
	j.dropped = append(j.dropped, dr)
	for _, st := range j.stages[rr.lo:rr.hi] {
		fed := j.outerFed
		if dr.leftOutOf >= 0 {
			// Left out of the delayed step it was recorded as feeding: what it fed is what it
			// had fed before that step was asked (audit.go's abandon: nothing the job holds
			// depends on its steps since).
			fed = j.delayed.fedBefore
		}
		j.leftOutAfter(st.peer, fed)
	}
	j.refillDue = true // standbys and newcomers may staff it again (grow.go)
	j.stages = slices.Delete(j.stages, rr.lo, rr.hi)
	j.reps = replicaRuns(j.stages)
	j.hastenWaited()
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
	j.s.log.Warn("replica dropped", "replica", rr.index, "worker", d.worker, "step", from, "replicas", len(j.reps), "left_out_of_outer_step", leftOut, "left_out_of_delayed", dr.leftOutOf)
	ev := map[string]any{"replica": rr.index, "step": from, "plan": j.version, "replicas": len(j.reps), "reason": d.why, "left_out": leftOut}
	if dr.leftOutOf >= 0 {
		ev["left_out_of"] = dr.leftOutOf
	}
	j.s.event(j.rec.ID, "replica.dropped", d.worker, ev)
	if redo {
		// The delayed outer step it contributed to is not committed: the others take it again
		// without it, beside their training.
		j.redoDelayed(d.worker)
	}
	j.publish()
	if j.s.cfg.OnPlan != nil {
		j.s.cfg.OnPlan(*j.s.status.Load().Plan)
	}
}

// dropAtLoad answers a departure d while an outer-mode plan gets ready — a restore loading every
// replica on its own, or a refill whose survivors hold their state (sched.DropReplica): d's replica
// leaves the plan from its first step, step, and so does every replica a stage of which was to take
// its state from d's worker (grow.go), which has nothing to start from now. The others load on.
func (j *jobRun) dropAtLoad(d *replicaLeft, step int) {
	if p := j.replicaPos(d.index); p >= 0 {
		j.dropReplica(p, d, step, false)
	}
	for _, taker := range slices.Sorted(maps.Keys(j.tookFrom)) {
		if !slices.Contains(sched.GiversOf(j.tookFrom[taker]), d.worker) {
			continue
		}
		k := slices.IndexFunc(j.stages, func(st placement) bool { return st.peer == taker })
		if k < 0 {
			continue // dropped already, with its replica
		}
		idx := j.stages[k].replica
		j.dropReplica(j.replicaPos(idx), &replicaLeft{worker: d.worker, index: idx,
			why: fmt.Sprintf("its worker %s was to take its state from worker %s, which left", taker, d.worker)}, step, false)
	}
}

// sendFailed is the error of a send to worker p of the active plan that failed (what it sent:
// "clip to"). A worker that left is gone from the hub before its departure event reaches the job
// loop: the rule book decides as it does for the event (handle), which then finds p out of the
// plan when the rule book dropped its replica.
func (j *jobRun) sendFailed(p, what string, err error) error {
	if errors.Is(err, ErrUnknownWorker) {
		if d := sched.Decide(j.membership(), sched.Change{Left: p}); d.Action == sched.DropReplica || d.Action == sched.Reshare || d.Action == sched.Reroute {
			kernels := ""
			if q := j.peers[p]; q != nil && q.hello != nil {
				kernels = q.hello.Kernels
			}
			return &replicaLeft{worker: p, index: d.Replica, why: d.Why, reshare: d.Action != sched.DropReplica, reroute: d.Action == sched.Reroute, kernels: kernels}
		}
	}
	return fmt.Errorf("%w: %s %s: %v", errReplan, what, p, err)
}

// Delayed outer steps (job.Sync.Delay) have two phases too (client/outer.go): every replica is
// asked the outer step after step e as it finishes e, and trains on while its stages exchange;
// each stage answers proto.OuterDone once it holds the average, and the coordinator commits the
// step (proto.OuterCommit) once every participant's stage does. Until then no replica opens a
// step after the take-up (train holds it: delayedOuter.due), and no checkpoint or evaluation is
// asked (commitDelayed) — both need the new global θ. A replica lost before the commit is dropped
// and left out of the step (droppedReplica.leftOutOf), and the step is asked again of the others
// (redoDelayed), who exchange again from the θ_r they gave, still beside training: no restore.

// delayedOuter is the delayed outer step after step step, asked and not yet committed.
type delayedOuter struct {
	step         int
	attempt      int
	participants []int           // the replicas of the attempt, by index
	asked        map[int]bool    // the replicas asked so far, each as it finished step (by index)
	done         map[string]bool // the participants' workers that hold the attempt's average
	since        time.Time       // when the attempt was asked: its deadline runs from there
	failures     []stageFailure  // the stages' failures of it, not weighed yet (takeFailures)
	// fedBefore is, by worker, the last outer step each stage's work fed before this one was
	// asked (jobRun.outerFed then): a replica left out of it fed no more than that.
	fedBefore map[string]int
}

// takeUp is the step after which the replicas take the step up.
func (dl *delayedOuter) takeUp(spec job.Spec) int { return spec.OuterTakeUpAfter(dl.step) }

// holdsOpen reports whether a replica's step s must wait for the commit: it follows the take-up.
func (dl *delayedOuter) holdsOpen(spec job.Spec, s int) bool { return dl != nil && s > dl.takeUp(spec) }

// askedDelayed records that the delayed outer step after step s was asked of every replica.
func (j *jobRun) askedDelayed(s int) {
	j.askOuter()
	j.delayed = &delayedOuter{step: s, participants: j.outerParticipants(), asked: map[int]bool{}, done: map[string]bool{}, since: time.Now(),
		fedBefore: maps.Clone(j.outerFed)}
	j.hastenWaited()
}

// redoDelayed asks the delayed outer step again (its next attempt) of the replicas left that were
// asked it already, after the departure of worker left's replica; those still training the step
// before it are asked that attempt as they finish it (outerRule.finished). So a step half asked
// when a replica leaves needs no restore either: every participant takes the same attempt.
func (j *jobRun) redoDelayed(left string) {
	dl := j.delayed
	dl.attempt++
	dl.participants = j.outerParticipants()
	j.reassignOuter()
	if d := &j.dropped[len(j.dropped)-1]; d.leftOutOf == dl.step || d.ghostOf == dl.step {
		d.leftOutAt = dl.attempt
	}
	clear(dl.done)
	dl.since = time.Now()
	j.s.event(j.rec.ID, "outer.redo", left, map[string]any{"step": dl.step, "attempt": dl.attempt, "participants": dl.participants, "delayed": true})
	for r, rr := range j.reps {
		if !dl.asked[rr.index] {
			continue
		}
		if err := j.outerSync(dl.step, r, dl.attempt); err != nil {
			// A worker found gone here is heard again as its hub event, which drops its replica
			// and asks the next attempt.
			j.s.log.Debug("delayed outer redo not sent", "step", dl.step, "attempt", dl.attempt, "err", err)
		}
	}
}

// noteDelayed keeps what event ev says of the delayed outer step asked: a stage's OuterDone of
// its latest attempt (delayedDone), or a stage's failure of it (delayedOuter.failures, weighed by
// takeFailures). Every event the job loop reads passes here (await), whatever it waits for.
func (j *jobRun) noteDelayed(ev Event) {
	dl := j.delayed
	if dl == nil || ev.Kind != EventMessage {
		return
	}
	switch m := ev.Msg.(type) {
	case *proto.OuterDone:
		j.delayedDone(ev.Worker, m)
	case *proto.Error:
		if m.Step != nil && *m.Step == uint64(dl.step) && m.PlanVersion == j.version && j.holds(ev.Worker) {
			dl.failures = append(dl.failures, stageFailure{worker: ev.Worker, m: m})
		}
	}
}

// stageFailure is a stage's failure of the delayed outer step, as it reported it.
type stageFailure struct {
	worker string
	m      *proto.Error
}

// delayedDone takes a stage's OuterDone for the delayed step; it reports whether every
// participant's stage holds the attempt's average now.
func (j *jobRun) delayedDone(worker string, m *proto.OuterDone) bool {
	dl := j.delayed
	if dl == nil || m.Step != uint64(dl.step) || m.PlanVersion != j.version || m.Attempt != dl.attempt {
		return false
	}
	dl.done[worker] = true
	j.outerAveraged[worker] = m.Averaged
	return j.delayedComplete()
}

// delayedComplete reports whether every participant's stage holds the delayed step's average.
func (j *jobRun) delayedComplete() bool {
	dl := j.delayed
	return dl != nil && !slices.ContainsFunc(j.participants(), func(p string) bool { return !dl.done[p] })
}

// takeFailures weighs the stages' failures of the delayed step kept since the last call
// (delayedFailure): the suspects, and the first failure that ends the plan.
func (j *jobRun) takeFailures() ([]*linkSuspect, error) {
	dl := j.delayed
	if dl == nil {
		return nil, nil
	}
	fs := dl.failures
	dl.failures = nil
	var out []*linkSuspect
	for _, f := range fs {
		l, err := j.delayedFailure(f.worker, f.m)
		if err != nil {
			return out, err
		}
		if l != nil {
			out = append(out, l)
		}
	}
	return out, nil
}

// sendCommit commits the delayed outer step every participant's stage holds.
func (j *jobRun) sendCommit(ctx context.Context) error {
	dl := j.delayed
	if err := j.recordSegments(ctx, dl.step, dl.attempt); err != nil {
		return err
	}
	j.delayed = nil
	j.hastenWaited()
	c := &proto.OuterCommit{Step: uint64(dl.step), PlanVersion: j.version, Attempt: dl.attempt}
	for _, p := range j.participants() {
		if err := j.s.hub.Send(p, c); err != nil {
			return fmt.Errorf("%w: delayed outer commit to %s: %v", errReplan, p, err)
		}
	}
	return nil
}

// delayedFailure weighs a stage's failure of the delayed outer step (m, from worker) as
// outerFailure does; nil, nil for a message of another step or plan.
func (j *jobRun) delayedFailure(worker string, m *proto.Error) (*linkSuspect, error) {
	dl := j.delayed
	if dl == nil || m.Step == nil || *m.Step != uint64(dl.step) || m.PlanVersion != j.version {
		return nil, nil
	}
	return j.outerFailure(worker, m, dl.step, "delayed outer step")
}

// outerFailure weighs a stage's failure m (from worker) of the outer step after step s — what
// names it — delayed or not: a refusal (what another replica sent no honest one could) ends the
// plan; a failure on a link to a worker that left, or no longer holds a stage (an attempt before
// the last), is nil, nil — that departure drops its replica and the step is asked again without
// it; one on a link to a worker still here is a suspect (linkSuspect: its departure within
// linkGrace explains it, or the failure stands); any other ends the plan.
func (j *jobRun) outerFailure(worker string, m *proto.Error, s int, what string) (*linkSuspect, error) {
	fails := fmt.Errorf("%w: the %s after step %d failed on %s: %v", errReplan, what, s, worker, m.Message)
	switch {
	case m.Code == proto.ErrCodeOuterRefused:
		return nil, fmt.Errorf("%w: %s refused the %s after step %d", errReplan, worker, what, s)
	case m.Peer != "" && m.Peer != worker && (!j.holds(m.Peer) || !j.s.hub.Connected(m.Peer)):
		return nil, nil
	case m.Peer != "" && m.Peer != worker:
		return &linkSuspect{peer: m.Peer, by: worker, err: fails, until: time.Now().Add(linkGrace)}, nil
	}
	return nil, fails
}

// delayedLate answers the delayed outer step's deadline (the step deadline from its last
// attempt's ask): the participants' workers that did not answer are dropped from the job, and the
// plan fails.
func (j *jobRun) delayedLate() error {
	dl := j.delayed
	for _, p := range j.participants() {
		if !dl.done[p] {
			j.s.event(j.rec.ID, "worker.deadline", p, map[string]any{"step": dl.step, "outer": true, "delayed": true})
			j.s.hub.Drop(p, fmt.Errorf("no answer to the delayed outer step after step %d within its deadline", dl.step))
		}
	}
	return fmt.Errorf("%w: the delayed outer step after step %d missed its deadline", errStep, dl.step)
}

// delayedDeadline is when the delayed outer step's last attempt runs out of time.
func (j *jobRun) delayedDeadline() time.Time {
	return j.delayed.since.Add(time.Duration(j.spec.StepDeadlineMaxS * float64(time.Second)))
}

// commitDelayed sees the delayed outer step, if one is asked (at a round's end every replica has
// been), through to its commit: it waits
// for every participant's OuterDone, a departure dropping its replica and asking the others again
// (dropReplica, redoDelayed), and a stage silent past the step deadline failing the plan.
func (j *jobRun) commitDelayed(ctx context.Context) error {
	if j.delayed == nil {
		return nil
	}
	defer j.enterFor(phaseExchange)()
	for j.delayed != nil {
		if j.delayedComplete() {
			return j.sendCommit(ctx)
		}
		timer := time.NewTimer(time.Until(j.delayedDeadline()))
		ev, late, err := j.awaitEvent(ctx, timer.C)
		timer.Stop()
		if d, ok := errors.AsType[*replicaLeft](err); ok && !d.reshare {
			if p := j.replicaPos(d.index); p >= 0 {
				j.dropReplica(p, d, j.step, false)
			}
			continue
		}
		if err != nil {
			return err
		}
		if late {
			return j.delayedLate()
		}
		_ = ev // its OuterDone or failure of the step is kept already (noteDelayed)
		ls, err := j.takeFailures()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if j.suspect == nil {
				l.by = "" // the job loop's own wait: awaitEvent returns its error as it stands
				j.suspect = l
			}
		}
	}
	return nil
}

// hastenWaited has the hub notice a worker of the plan that goes silent after its quick timeout
// rather than the heartbeat timeout (Hub.Hasten) while every replica waits on every other: an
// outer exchange under way (without a delay the whole fleet stalls until a vanished participant
// is noticed and the step asked again without it; with one the take-up waits on it), a round's
// end once a replica has reached it, and in step mode every step in flight (a step ends only
// once every replica's micro-batches are in, a lost one's rerouted). At 10,000 simulated peers a
// replica leaves every few seconds, and with 5 s to notice each the exchange redos cascaded
// (docs/benchmarks.md). Otherwise — replicas training free — nobody waits on anybody and nobody
// is hastened: an honest worker whose beat is late costs its replica's round when it is dropped.
// Called wherever the exchange, the round's end or the participants change.
func (j *jobRun) hastenWaited() {
	if j.s == nil || j.s.hub == nil {
		return // a unit test's job without a server
	}
	var ids []string
	stepMode := j.sync != nil && j.sync.book() == sched.SyncStep
	if j.phase.planned() && (j.phase == phaseExchange || j.delayed != nil || j.atBarrier || stepMode && j.phase == phaseTraining) {
		ids = j.participants()
	}
	j.s.hub.Hasten(ids)
}
