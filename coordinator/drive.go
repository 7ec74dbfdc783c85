package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// One driver trains both sync modes (train). A round is the steps between two points where
// everyone stands still; a group is the participants that finish a step together and share its
// clip factor. The job's sync mode, chosen once (syncRule), says what rounds and groups are:
//
//   - Step mode: a round of one step, one group of every participant. The replicas' reports are
//     merged into the step's one norm and clip factor (their trees sum the same gradient), which
//     go out when every participant has reported; a departure answered by a reshare abandons the
//     step in flight, which the survivors compute again (reshare.go).
//   - Outer mode: rounds of free-running replicas (round.go), a group per replica, each with its
//     own norm, clip factor and next step.
//
// What the driver does is the same for both: open a group's step and send its inputs, gather one
// answer per member — a report, or a step failure, weighed once every member answered — hold a
// link failure until its peer's departure is heard or its grace runs out (linkSuspect), drop the
// members silent past their deadline, and record each step once every group finished it, in
// order.

// syncRule is how a job's replicas agree on a step (job.Sync): step mode's lockstep or outer
// mode's free-running replicas. It is chosen once, when the job starts (newSyncRule).
type syncRule interface {
	// roundEnd is the end (exclusive) of the round that begins at step s0.
	roundEnd(j *jobRun, s0 int) int
	// groups are the active plan's groups: each a list of participant indices and the replica
	// positions whose micro-batches it computes.
	groups(j *jobRun) []stepGroup
	// finished takes group g's step s of the round ending at s1 once every member reported it
	// (reports by member, in the group's order): the step's checks and audit work, then its clip
	// factor to the group. It returns the totals complete records, when the group's are the
	// step's (step mode; outer mode totals the replicas' reports at complete).
	finished(ctx context.Context, j *jobRun, g stepGroup, s, s1 int, in *groupInFlight, reports []*proto.StepReport) (stepTotals, error)
	// complete records step s, which every group finished (st), and advances the job past it.
	complete(ctx context.Context, j *jobRun, s, s1 int, st *stepInFlight, dt time.Duration) error
	// book is the mode as the rule book (sched.Decide) knows it: with SyncOuter the replicas run
	// free, and their steps are shown one by one.
	book() sched.SyncMode
	// joins weighs the planner's plan over everyone (stages, hosts, standby) when workers joined
	// (fresh) or stand by: whether the running plan is as good as kept, and the growth that
	// takes the newcomers in from peers' state, if one can (grow.go; nil: none).
	// choice is why the planner chose its plan, for a growth into it.
	joins(j *jobRun, fresh []string, stages []placement, hosts []hostPlacement, standby []string, choice string) (kept bool, g *growth)
}

// newSyncRule is the rule of the job's sync mode.
func newSyncRule(spec job.Spec) syncRule {
	if spec.Outer() {
		return outerRule{}
	}
	return stepRule{}
}

// stepGroup is a set of participants that finish a step together.
type stepGroup struct {
	members []int // indices into the plan's participants
	reps    []int // the positions of the replicas whose inputs it carries
}

// stepTotals are a finished group's numbers of a step, for its record.
type stepTotals struct{ ce, aux, norm float64 }

// groupInFlight is a group's progress through a round.
type groupInFlight struct {
	step     int       // the step its members are computing; -1 when none
	opened   time.Time // when that step was opened
	due      time.Time // its deadline
	answered []bool    // by member: reported (or failed) the step
	left     int       // members yet to answer
	// By replica of the group: the step as opened on its stages, and the inputs sent — what its
	// audits check. In step mode every replica's are the step's own (one batch, M micro-batches).
	specs  []proto.StepSpec
	xs, ys [][]int32
}

// stepInFlight gathers a step's reports from the groups as they finish it.
type stepInFlight struct {
	reports []*proto.StepReport // by participant
	elapsed []time.Duration     // by participant: from its group's open to its report
	done    []bool              // by group: finished the step
	left    int                 // groups yet to finish the step
	totals  stepTotals          // step mode: the one group's (finished)
}

// train drives the round that begins at j.step (see the top of this file), recording every step
// as it completes and advancing j.step past it.
func (j *jobRun) train(ctx context.Context) error {
	// The round is under way from here: a departure while it waits for audits to drain is one at
	// its first step, which nobody has opened yet — in outer mode its replica is dropped and the
	// others go on (before, the wait stood at a boundary, and the rule book restored every shard).
	restore := j.enterFor(phaseTraining)
	defer func() { restore(); j.atBarrier = false; j.hastenWaited() }()
	j.hastenWaited() // step mode: a step waits on every worker
	for {
		err := j.auditBackpressure(ctx)
		d, ok := errors.AsType[*replicaLeft](err)
		if !ok || d.reshare {
			if err != nil {
				return err
			}
			break
		}
		if p := j.replicaPos(d.index); p >= 0 {
			j.dropReplica(p, d, j.step, false)
		}
	}
	spec, rule := j.spec, j.sync
	if j.delayed.holdsOpen(spec, j.step) {
		// A round that begins after a delayed outer step's take-up begins from its commit.
		if err := j.commitDelayed(ctx); err != nil {
			return err
		}
	}
	s0 := j.step
	s1 := rule.roundEnd(j, s0)
	j.roundMax = max(j.roundMax, s1-s0)
	parts := j.participants()
	M, B, T := spec.MicroBatches, spec.BatchSize, spec.Model.BlockSize
	groups := rule.groups(j)
	inFlight := make([]groupInFlight, len(groups))
	steps := map[int]*stepInFlight{}
	free := rule.book() == sched.SyncOuter // replicas run free: their steps are shown one by one
	if free {
		j.replicaAt = make([]int, len(j.reps))
	}
	// A step's shared batch is drawn once, when the first replica opens the step, and kept until
	// the last has.
	type sharedBatch struct {
		x, y []int32
		left int // replicas yet to open the step
	}
	shared := map[int]*sharedBatch{}
	// batchOf is replica r's inputs of step s and how many micro-batches its stages' step has:
	// its share of the step's batch, or with own batches its own batch.
	batchOf := func(r, s int) (x, y []int32, mbs int, err error) {
		rr := j.reps[r]
		switch {
		case !spec.OwnBatches():
			b := shared[s]
			if b == nil {
				b = &sharedBatch{left: len(j.reps)}
				if b.x, b.y, err = j.corpus.Batch(spec.Seed, s, B, T); err != nil {
					return nil, nil, 0, err
				}
				shared[s] = b
			}
			if b.left--; b.left == 0 {
				delete(shared, s)
			}
			return b.x, b.y, M, nil
		case rr.index > 0 || rr.n != M:
			x, y, err = j.replicaBatch(r, s)
			return x, y, rr.n, err
		default: // the first replica's own batch of M micro-batches is the job's batch
			x, y, err = j.corpus.Batch(spec.Seed, s, B, T)
			return x, y, M, err
		}
	}
	// open opens step s on group g's members and sends its replicas' micro-batches.
	open := func(g, s int) error {
		grp := groups[g]
		base := &proto.StepOpen{Step: uint64(s), PlanVersion: j.version, LR: spec.LRAt(s), MicroBatches: M,
			DeadlineMS: j.deadline().Milliseconds(), Rows: B / M}
		// A member's time runs from here to its report, by the coordinator's clock: the
		// measurement (measure.go) that no report can inflate.
		in := groupInFlight{step: s, opened: time.Now(), answered: make([]bool, len(grp.members)), left: len(grp.members)}
		opens := map[int]*proto.StepOpen{} // by participant: a replica's stages' open
		for _, r := range grp.reps {
			x, y, mbs, err := batchOf(r, s)
			if err != nil {
				return err
			}
			o := base
			if mbs != M {
				c := *base
				c.MicroBatches = mbs
				o = &c
			}
			rr := j.reps[r]
			for k := rr.lo; k < rr.hi; k++ {
				opens[k] = o
			}
			in.specs, in.xs, in.ys = append(in.specs, stepSpec(o)), append(in.xs, x), append(in.ys, y)
			if free {
				j.replicaAt[r] = s
			}
		}
		// A member found gone (sendFailed's departure) does not stop the others' opening: the
		// step goes on without its replica (a drop, a reroute), or ends once it is answered.
		var gone error
		sent := func(err error) error {
			if _, ok := errors.AsType[*replicaLeft](err); ok {
				gone = cmp.Or(gone, err)
				return nil
			}
			return err
		}
		for _, i := range grp.members {
			o := opens[i]
			if o == nil {
				o = base // an expert host
			}
			if err := j.s.hub.Send(parts[i], o); err != nil {
				if err := sent(j.sendFailed(parts[i], "open step on", err)); err != nil {
					return err
				}
			}
		}
		if steps[s] == nil {
			steps[s] = &stepInFlight{reports: make([]*proto.StepReport, len(parts)), elapsed: make([]time.Duration, len(parts)),
				done: make([]bool, len(groups)), left: len(groups)}
		}
		in.due = in.opened.Add(time.Duration(base.DeadlineMS) * time.Millisecond)
		inFlight[g] = in
		for k, r := range grp.reps {
			if err := sent(j.sendInputs(j.reps[r], in.specs[k], in.xs[k], in.ys[k])); err != nil {
				return err
			}
		}
		return gone
	}
	// failures are the members' failures of the round's steps, in the order they came: once there
	// is one the round is abandoned — nothing more opens, the steps in flight are waited for —
	// unless the failing member's replica is dropped meanwhile (outer mode), which takes its
	// failures with it. A failure on a link to another member waits for that member's departure
	// first (linkSuspect, one at a time: the others queue in suspects).
	type memberFailure struct {
		worker string
		err    error
	}
	var failures []memberFailure
	var suspects []linkSuspect
	// held are the replicas' next steps that follow a delayed outer step's take-up, opened once it
	// is committed (outer mode: round.go, "delayed outer steps").
	type heldOpen struct{ index, step int }
	var held []heldOpen
	fail := func(worker string, err error) { failures = append(failures, memberFailure{worker, err}) }
	failure := func() error {
		if len(failures) == 0 {
			return nil
		}
		return failures[0].err
	}
	// finished takes group g's step once all its members reported it: the rule's checks and
	// clip factor, and its next step.
	finished := func(g int) error {
		s := inFlight[g].step
		in := inFlight[g]
		inFlight[g].step, inFlight[g].xs, inFlight[g].ys = -1, nil, nil
		st := steps[s]
		st.left--
		st.done[g] = true
		reports := make([]*proto.StepReport, len(groups[g].members))
		for k, i := range groups[g].members {
			reports[k] = st.reports[i]
		}
		t, err := rule.finished(ctx, j, groups[g], s, s1, &in, reports)
		if err != nil {
			return err
		}
		st.totals = t
		if free && s+1 == s1 && !j.atBarrier {
			// The first replica done with the round waits for the others (roundEnd): from
			// here on one that vanished holds up every replica until it is noticed.
			j.atBarrier = true
			j.hastenWaited()
		}
		if s+1 < s1 && failure() == nil {
			if j.delayed.holdsOpen(spec, s+1) {
				// After the take-up: the delayed outer step must be committed first (round.go).
				held = append(held, heldOpen{index: j.reps[groups[g].reps[0]].index, step: s + 1})
				return nil
			}
			return open(g, s+1)
		}
		return nil
	}
	// release opens the steps held for the delayed outer step's commit, which went out.
	release := func() error {
		hs := held
		held = nil
		for _, h := range hs {
			if p := j.replicaPos(h.index); p >= 0 && failure() == nil && h.step < s1 {
				if err := open(p, h.step); err != nil {
					return err
				}
			}
		}
		return nil
	}
	// drop takes replica d out of the round (outer mode; see round.go): its steps not recorded
	// yet wait for it no more and lose its reports, a shared batch no longer waits for it to
	// open a step, and the plan goes on without it (dropReplica).
	drop := func(d *replicaLeft) {
		p := j.replicaPos(d.index)
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
		inFlight = slices.Delete(inFlight, p, p+1)
		gone := func(w string) bool {
			return slices.ContainsFunc(j.stages[rr.lo:rr.hi], func(st placement) bool { return st.peer == w })
		}
		failures = slices.DeleteFunc(failures, func(f memberFailure) bool { return gone(f.worker) })
		suspects = slices.DeleteFunc(suspects, func(l linkSuspect) bool { return gone(l.by) || gone(l.peer) })
		j.dropReplica(p, d, j.step, false)
		parts = j.participants()
		groups = rule.groups(j)
	}
	// reroute answers a departure during step mode's step in flight (reroute.go): the replicas
	// beside the lost one take its micro-batches, and every survivor reports the step again.
	reroute := func(d *replicaLeft) error {
		in := &inFlight[0]
		s := in.step
		shares, err := j.reroute(d, s, in.specs[0], in.xs[0], in.ys[0])
		if err != nil {
			return err
		}
		in.specs[0].Reroutes = append(in.specs[0].Reroutes, shares)
		if r := j.reroutedAt(s); r != nil && r.takeover != nil {
			tk := r.takeover.tk // a recomputation takes it up as the pool did (audits)
			in.specs[0].Takeover = &tk
		}
		gone := func(w string) bool { return j.rerouted.workers[w] }
		failures = slices.DeleteFunc(failures, func(f memberFailure) bool { return gone(f.worker) })
		suspects = slices.DeleteFunc(suspects, func(l linkSuspect) bool { return gone(l.by) || gone(l.peer) })
		if l := j.suspect; l != nil && (gone(l.by) || gone(l.peer)) {
			j.suspect = nil
		}
		parts = j.participants()
		groups = rule.groups(j)
		in.answered, in.left = make([]bool, len(groups[0].members)), len(groups[0].members)
		// The step's deadline stands, as the survivors' own from its open does. A reroute adds
		// the lost replica's share to its neighbours': one replica lost of two at most doubles
		// the step, within the deadline (4× the median step, at least step_deadline_min_s);
		// a step that several reroutes stretch past it fails as any late step does.
		st := steps[s]
		st.reports, st.elapsed = make([]*proto.StepReport, len(parts)), make([]time.Duration, len(parts))
		return nil
	}
	// left drops the replica an error says left (a send to a worker that left finds it gone
	// before the hub's event does: sendFailed), or reroutes around it, reporting whether it did.
	// Any other departure the rule book answers with a reshare is the job loop's (reshare.go): it
	// ends the round.
	left := func(err error) (bool, error) {
		d, ok := errors.AsType[*replicaLeft](err)
		switch {
		case !ok:
			return false, err
		case !d.reshare:
			drop(d)
			return true, nil
		case len(inFlight) == 1 && inFlight[0].step >= 0 && j.canReroute(d, inFlight[0].step):
			return true, reroute(d)
		}
		return false, err
	}
	last := time.Now() // when the previous step completed: a step's wall time runs from there
	for g := 0; g < len(groups); g++ {
		n := len(groups)
		if lost, err := left(open(g, s0)); err != nil {
			return err
		} else if lost && len(groups) < n {
			g-- // the groups after it moved down one (a drop; a reroute keeps the one group)
		}
	}
	// Replicas lost while the plan loaded (step mode): the plan left them out when it was ready
	// (rerouteAtLoad), and its first step's inputs went to the survivors' widened runs; now that
	// the step is open, the survivors hear of it.
	if rec := j.reroutedAt(s0); rec != nil && rec.unsent && len(inFlight) == 1 {
		if err := j.sendReroutes(rec); err != nil {
			return err
		}
		inFlight[0].specs[0].Reroutes = slices.Clone(rec.shares)
	}
	cut := false // the round was cut short (cutRound)
	for s := s0; s < s1; {
		if free && !cut && (len(j.s.commands) > 0 || j.s.isStopping()) {
			// An admin command or the coordinator's stop waits for the round's end, which at
			// fast steps is up to 30 s away (sched.RoundSteps): end it at the first step it can.
			cut = true
			s1 = j.cutRound(s, s1)
		}
		// The delayed outer step's answers, whenever they came (noteDelayed): its failures — a
		// departure's is mended by its redo, a link to a worker still here waits for that worker's
		// departure (as a step's failure on a link does), any other fails the round — and, once
		// every stage holds it, its commit and the steps held for it.
		ls, err := j.takeFailures()
		if err != nil {
			fail("", err)
		}
		for _, l := range ls {
			l.err = &stayedError{by: l.by, err: l.err}
			if j.suspect == nil {
				j.suspect = l
			} else if j.suspect.peer != l.peer && !slices.ContainsFunc(suspects, func(q linkSuspect) bool { return q.peer == l.peer }) {
				suspects = append(suspects, *l)
			}
		}
		if j.delayedComplete() {
			if err := j.sendCommit(ctx); err != nil {
				return err
			}
			if _, err := left(release()); err != nil {
				return err
			}
		}
		// Record the steps every group has finished, in order.
		if st := steps[s]; st != nil && st.left == 0 && failure() == nil {
			delete(steps, s)
			// Recording a step may evaluate and take the outer step: no round in flight there.
			restore := j.enterFor(phaseBoundary)
			err := rule.complete(ctx, j, s, s1, st, time.Since(last))
			restore()
			if err != nil {
				return err
			}
			last = time.Now()
			s++
			continue
		}
		busy := false
		deadline := time.Time{}
		for g := range inFlight {
			if inFlight[g].step >= 0 {
				busy = true
				if d := inFlight[g].due; deadline.IsZero() || d.Before(deadline) {
					deadline = d
				}
			}
		}
		if j.delayed != nil && len(held) > 0 && failure() == nil {
			// Replicas wait for the delayed outer step's commit: its stages have the step
			// deadline from its last attempt's ask to answer.
			busy = true
			if d := j.delayedDeadline(); deadline.IsZero() || d.Before(deadline) {
				deadline = d
			}
		}
		// The next suspected departure, once the one before has left or stayed.
		for j.suspect == nil && len(suspects) > 0 {
			l := suspects[0]
			suspects = suspects[1:]
			if j.holds(l.peer) {
				l.until = time.Now().Add(linkGrace)
				j.suspect = &l
			}
		}
		var due <-chan time.Time // nil: waiting only on a suspected departure (linkSuspect)
		var timer *time.Timer
		if !busy {
			// Nothing in flight: a failure ends the round once no departure that may explain it
			// is still awaited.
			if j.suspect == nil {
				if err := failure(); err != nil {
					return err
				}
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
		// A reroute that fails (a send finding another worker gone) ends the round with its
		// error, as at the open above: the job loop answers that departure.
		if lost, err := left(err); lost && err == nil {
			continue
		} else if l, ok := errors.AsType[*stayedError](err); ok {
			fail(l.by, l)
			continue
		} else if err != nil {
			return err
		}
		if late && j.delayed != nil && len(held) > 0 && !time.Now().Before(j.delayedDeadline()) {
			return j.delayedLate()
		}
		if late {
			// The peers that did not answer in time are lost to this plan: drop them (they may
			// rejoin) and record it.
			for g := range inFlight {
				in := inFlight[g]
				if in.step < 0 || time.Now().Before(in.due) {
					continue
				}
				for k, ok := range in.answered {
					if !ok {
						id := parts[groups[g].members[k]]
						j.s.event(j.rec.ID, "worker.deadline", id, map[string]any{"step": in.step})
						j.s.hub.Drop(id, fmt.Errorf("no report for step %d within its %v deadline", in.step, in.due.Sub(in.opened)))
					}
				}
				return fmt.Errorf("%w: step %d missed its deadline with %d of %d reports (group %d of %d)", errStep, in.step,
					len(in.answered)-in.left, len(in.answered), g+1, len(groups))
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
		g := slices.IndexFunc(groups, func(grp stepGroup) bool { return slices.Contains(grp.members, i) })
		if g < 0 {
			continue
		}
		k := slices.Index(groups[g].members, i)
		in := &inFlight[g]
		switch m := ev.Msg.(type) {
		case *proto.OuterDone:
			continue // kept (noteDelayed) and weighed at the loop's top
		case *proto.Error:
			if dl := j.delayed; dl != nil && m.Step != nil && *m.Step == uint64(dl.step) && *m.Step != uint64(in.step) {
				continue // the delayed outer step's: kept (noteDelayed) and weighed at the loop's top
			}
			// A step failure of the group's step in flight — under this plan: a failure of the
			// same step under an earlier one (abandoned when its plan changed around the worker,
			// a reshare) is not this one's. The round is abandoned once every step in flight has
			// answered (so that what the others report, an outer-step refusal among it, is
			// weighed first).
			if m.Step == nil || in.step < 0 || *m.Step != uint64(in.step) || m.PlanVersion != j.version || in.answered[k] {
				continue
			}
			failed := fmt.Errorf("%w: step %d failed on %s: %v", errStep, in.step, ev.Worker, m)
			if p := slices.Index(parts, m.Peer); m.Peer != ev.Worker && p >= 0 && slices.Contains(groups[g].members, p) {
				// Lost on a link to a member of its own group: a worker killed mid-step can have
				// reported the step (its own part done) while what it sent last died with its
				// connection — and a worker stopping may report its own step cancelled first. If
				// that member is leaving, its departure is the rule book's to answer (a drop, a
				// reshare), not a failure between two that stay (a restore); if it stays, the
				// round fails.
				l := linkSuspect{peer: m.Peer, by: ev.Worker, err: &stayedError{by: ev.Worker, err: failed}}
				if j.suspect == nil {
					l.until = time.Now().Add(linkGrace)
					j.suspect = &l
				} else if j.suspect.peer != m.Peer && !slices.ContainsFunc(suspects, func(q linkSuspect) bool { return q.peer == m.Peer }) {
					suspects = append(suspects, l)
				}
			} else {
				fail(ev.Worker, failed)
			}
			in.answered[k] = true
			if in.left--; in.left == 0 {
				in.step = -1
			}
		case *proto.StepReport:
			if m.PlanVersion != j.version || in.step < 0 || m.Step != uint64(in.step) {
				j.s.log.Debug("stale report", "from", ev.Worker, "step", m.Step, "plan", m.PlanVersion)
				continue
			}
			if n := len(j.reroutedAt(in.step).sharesOrNil()); m.Reroutes > n {
				j.s.hub.Drop(ev.Worker, fmt.Errorf("a report of step %d that includes %d reroutes: %d were sent", m.Step, m.Reroutes, n))
				continue
			} else if m.Reroutes < n {
				// A report from before the step's last reroute: another that includes it follows.
				j.s.log.Debug("report before a reroute", "from", ev.Worker, "step", m.Step, "reroutes", m.Reroutes)
				continue
			}
			if in.answered[k] {
				j.s.hub.Drop(ev.Worker, fmt.Errorf("unexpected report for step %d", m.Step))
				continue
			}
			if m.Eval {
				return fmt.Errorf("%w: %s sent a report of the wrong kind", errStep, ev.Worker)
			}
			st := steps[in.step]
			st.reports[i], st.elapsed[i] = m, time.Since(in.opened)
			in.answered[k] = true
			if in.left--; in.left > 0 {
				continue
			}
			if failure() != nil {
				in.step = -1
				continue
			}
			if _, err := left(finished(g)); err != nil {
				return err
			}
		}
	}
	return nil
}

// stepRule is step mode's lockstep: every step is a round, every participant one group.
type stepRule struct{}

func (stepRule) roundEnd(_ *jobRun, s0 int) int { return s0 + 1 }
func (stepRule) book() sched.SyncMode           { return sched.SyncStep }

// joins keeps the plan when the planner would place everyone as it is, and grows it when every
// stage of the planner's plan is held now, or by a twin that can hand it over (growable) — if
// need be once its workers are moved among its stages so that the holders stay on their blocks
// (keepHolders), else with the holders it leaves out handing their stages over before they
// stand by.
func (stepRule) joins(j *jobRun, _ []string, stages []placement, hosts []hostPlacement, standby []string, choice string) (bool, *growth) {
	g := j.growable(stages, hosts, standby, false)
	if g == nil {
		if kept, ok := j.keepHolders(stages, hosts); ok {
			if j.allHeld(kept) {
				return true, nil // the planner only moved the workers it runs: the joiners stand by
			}
			// Who stands by: the planner's standbys and workers, less those the move placed.
			placed := peersOf(kept)
			var rest []string
			for _, id := range append(slices.Clone(standby), peersOf(stages)...) {
				if !slices.Contains(placed, id) && !slices.Contains(rest, id) {
					rest = append(rest, id)
				}
			}
			if g = j.growable(kept, hosts, rest, false); g != nil {
				choice += "; its workers moved among its stages so that the holders stay on their blocks"
			}
		}
	}
	if g == nil {
		// The planner's plan puts a joiner in place of a holder, and moving its workers would
		// cost too much: the holder hands its state over and stands by.
		if g = j.growable(stages, hosts, standby, true); g != nil {
			choice += "; holders it leaves out hand their stages over and stand by"
		}
	}
	if g != nil {
		g.choice = choice
	}
	return samePlacements(stages, hosts, j.stages, j.hosts), g
}

func (stepRule) groups(j *jobRun) []stepGroup {
	g := stepGroup{members: make([]int, len(j.participants()))}
	for i := range g.members {
		g.members[i] = i
	}
	for r := range j.reps {
		g.reps = append(g.reps, r)
	}
	return []stepGroup{g}
}

// finished merges the replicas' reports into the step's norm — a divergence between holders of
// one tensor is disputed (audit.go) — checks the commitments and draws the previous step's
// audits, then sends every participant the clip factor, after which every shard applies AdamW.
func (stepRule) finished(ctx context.Context, j *jobRun, _ stepGroup, s, _ int, in *groupInFlight, reports []*proto.StepReport) (stepTotals, error) {
	st, lr, x, y := in.specs[0], j.spec.LRAt(s), in.xs[0], in.ys[0] // the one batch, shared
	ce, aux, norm, err := proto.StepTotals(j.mergeReplicas(reports), j.spec.MicroBatches)
	if errors.Is(err, proto.ErrReplicasDiverged) {
		return stepTotals{}, j.dispute(ctx, s, st, lr, reports, x, y, err)
	}
	if err != nil {
		return stepTotals{}, fmt.Errorf("%w: step %d: %v", errStep, s, err)
	}
	if math.IsNaN(norm) || math.IsInf(norm, 0) || math.IsNaN(ce) {
		return stepTotals{}, fmt.Errorf("%w: step %d diverged (loss %v, gradient norm %v)", errStep, s, ce, norm)
	}
	clip := model.ClipFactor(norm, j.spec.Clip)
	// Commitments are checked, and the previous step's audits drawn, before the clip lets anyone
	// apply this step's update.
	if err := j.afterReports(ctx, s, st, lr, clip, reports, x, y); err != nil {
		return stepTotals{}, err
	}
	for _, p := range j.participants() {
		if err := j.s.hub.Send(p, &proto.Clip{Step: uint64(s), PlanVersion: j.version, Factor: float64(clip)}); err != nil {
			// Every report is in: the step is complete without the departed worker's clip, and
			// the others apply it. Its departure is answered when the job loop hears of it.
			if resharing(j.sendFailed(p, "clip to", err)) != nil {
				continue
			}
			return stepTotals{}, fmt.Errorf("%w: clip to %s: %v", errReplan, p, err)
		}
	}
	return stepTotals{ce: ce, aux: aux, norm: norm}, nil
}

// complete records the step and takes the checkpoint that is due. A departure heard after the
// step's clip factors went out leaves the step applied by every survivor: the job reshares from
// the next (afterStep's resharing error).
func (stepRule) complete(ctx context.Context, j *jobRun, s, _ int, st *stepInFlight, dt time.Duration) error {
	t := st.totals
	if err := j.recordStep(ctx, s, j.spec.LRAt(s), st.reports, st.elapsed, dt, t.ce, t.aux, t.norm, nil); err != nil {
		return err
	}
	rec := j.reroutedAt(s)
	if rec != nil && rec.takeover != nil {
		stood := j.standTakenOver(rec.takeover)
		// The taken-over replica's other workers applied the step, and what they sent is in it;
		// but no next report of theirs commits to the state it reached. Their audit is drawn now,
		// before the reshare's Assigns (so that they still hold the evidence), and compares what
		// they sent and reported (next ""): their own state is trained on again only if a later
		// plan keeps it, whose twins' states are then compared (checkKept).
		if a := j.audits; a != nil && a.prev != nil && int(a.prev.spec.Step) == s {
			for _, w := range stood {
				j.askAudit(ctx, w, s, a.prev, "", false)
			}
		}
	}
	err := j.afterStep(ctx, s, true)
	// A step rerouted around a lost replica reshares from the next step (reroute.go): the
	// survivors share the micro-batches in proportion to their speed, keeping their state.
	if rec != nil && err == nil {
		err = rec.left[0]
	}
	// A departure during the step's evaluation reshares from the next step, as one after the
	// clip factors went out does.
	if d := j.leftInEval; d != nil {
		j.leftInEval = nil
		if err == nil {
			err = d
		}
	}
	if err == nil || resharing(err) != nil {
		j.step = s + 1
	}
	return err
}

// stayedError is a link suspect's expiry in a round: the peer stayed, so the failure reported by
// worker by on its link to it is the step's own.
type stayedError struct {
	by  string
	err error
}

func (e *stayedError) Error() string { return e.err.Error() }
func (e *stayedError) Unwrap() []error {
	return []error{errStayed, e.err}
}

// cutRound is the earliest end of outer mode's round in flight, whose next step to record is s
// and whose end was s1: past the step every replica has opened (a step opened is trained and
// recorded), and never right after a delayed outer step, which a replica that finished it may
// have been asked already within the round (outerRule.finished) while a round's end asks it of
// every replica (outerRule.complete).
func (j *jobRun) cutRound(s, s1 int) int {
	e := s + 1
	for _, at := range j.replicaAt {
		e = max(e, at+1)
	}
	for e < s1 && j.spec.OuterStepAfter(e-1) {
		e++
	}
	return min(e, s1)
}
