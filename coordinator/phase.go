package coordinator

import (
	"context"
	"time"

	"github.com/shoal-ml/shoal/sched"
)

// The job loop (jobRun.run) is one goroutine that owns the job. Where it is is one value, its
// phase; what it reacts to while it waits — the hub's events, checkpoint uploads, audit verdicts,
// admin commands, a stopping coordinator, its own deadlines — it reads in one place, await.

// jobPhase is where the job loop is with its plan.
type jobPhase int

const (
	// phasePlanning: no plan runs; the next is made from the connected workers (establish),
	// keeping what it can of the one just left at a checkpointed boundary (keepPoint).
	phasePlanning jobPhase = iota
	// phaseRecovering: no plan runs, the last one having failed (a step abandoned, a worker lost
	// that the rule book could not drop): the next restores from the newest complete checkpoint.
	phaseRecovering
	// phaseLoading: a plan is assigned and some of its shards load from a checkpoint or the seed
	// (adopt); no step has run under it.
	phaseLoading
	// phaseRestoring: as phaseLoading, with every shard restored from the checkpoint and nothing
	// kept or handed over — in outer mode each replica then loads on its own, and one lost
	// meanwhile is dropped while the others load on (sched.Membership.Restoring).
	phaseRestoring
	// phaseRejoining: a plan whose every stage keeps its shard or takes it from a peer that does
	// gets ready (a reshare, a grow): a departure meanwhile is answered as at a boundary, the
	// survivors still holding their state.
	phaseRejoining
	// phaseBoundary: a plan runs, between steps (or rounds): evaluations, checkpoints requested at
	// a step's end, commands, replans for joins and drift happen here.
	phaseBoundary
	// phaseTraining: a step is in flight, or in outer mode a round of free-running replicas.
	phaseTraining
	// phaseExchange: outer mode, an outer step without a delay is being exchanged and not yet
	// committed by everyone (awaitOuter).
	phaseExchange
	// phaseCheckpointing: at a boundary, waiting for a checkpoint of this very step to complete
	// before the plan is left (checkpointNow: a replan, a drain, a stopping coordinator).
	phaseCheckpointing
	// phaseEvaluating: a validation pass after a step every replica applied (evaluate). A
	// departure is weighed as in training: in outer mode its replica is dropped from the next
	// step, in step mode the survivors reshare from it — the pass going on, or starting again on
	// another replica when the departed worker was computing it.
	phaseEvaluating
)

var phaseNames = [...]string{"planning", "recovering", "loading", "restoring", "rejoining", "boundary", "training", "exchange", "checkpointing", "evaluating"}

func (p jobPhase) String() string {
	if int(p) < len(phaseNames) {
		return phaseNames[p]
	}
	return "unknown"
}

// planned reports whether a plan runs: a plan version is current, its Assigns sent.
func (p jobPhase) planned() bool { return p != phasePlanning && p != phaseRecovering }

// rule is the phase as the rule book (sched.Decide) weighs a departure in it.
func (p jobPhase) rule() sched.Phase {
	switch p {
	case phaseLoading, phaseRestoring:
		return sched.PhaseLoading
	case phaseTraining, phaseEvaluating:
		return sched.PhaseTraining
	case phaseExchange:
		return sched.PhaseExchange
	}
	return sched.PhaseBoundary
}

// enterFor moves the job loop to phase p for the span of a step, a round, a load or an
// exchange, and returns what puts back the phase it was in — unless the plan was left meanwhile
// (leave), which stays.
func (j *jobRun) enterFor(p jobPhase) (restore func()) {
	prev := j.phase
	j.phase = p
	return func() {
		if j.phase.planned() {
			j.phase = prev
		}
	}
}

// leave abandons the active plan: recovering is true when it failed (the next plan restores
// from the newest complete checkpoint), false when it was left on purpose at a boundary. The
// version is zeroed with it, so that no late message of the plan left matches the next.
func (j *jobRun) leave(recovering bool) {
	j.version = 0
	j.rerouted, j.lostAtLoad = nil, nil
	j.phase = phasePlanning
	if recovering {
		j.phase = phaseRecovering
	}
	j.hastenWaited()
}

// jobHold is the admin's hold on the job. It is not a phase: a paused job stands at a step
// boundary with its plan or without one, and a plan can be lost while it is paused (a worker
// leaves), which the phase then says.
type jobHold int

const (
	holdRunning jobHold = iota
	holdPaused
	holdCancelled
)

// listen is what a wait of the job loop (await) listens to besides the hub's events and
// checkpoint uploads, which every wait takes.
type listen struct {
	// deadline ends the wait with wokeDeadline; timer with wokeTimer (a settle period, a tick).
	deadline, timer <-chan time.Time
	// verdicts takes audit verdicts (onAudit); a rollback or ban ends the wait with its error.
	verdicts bool
	// commands carries out admin commands (do), ending the wait with wokeCommand.
	commands bool
	// stopping ends the wait with wokeStopping when the coordinator stops.
	stopping bool
	// idle: no step is in flight — events go through handleIdle, which only logs what handle
	// makes of them; otherwise await returns handle's verdict with the event.
	idle bool
	// before, when not nil, sees each hub event before it is handled: a wait that counts what
	// events change (awaitWorkers) looks at the peer table as it was.
	before func(Event)
	// suspect watches a link failure's grace (linkSuspect): its expiry ends the wait with the
	// suspect's error, unless its peer left meanwhile. Step drivers set it.
	suspect bool
}

// wake is what ended a wait.
type wake int

const (
	// wokeNone: nothing the wait listens for; the error says why it ended (ctx, or a link
	// suspect's expiry). The zero value, so that no error can pass for an event.
	wokeNone     wake = iota
	wokeEvent         // a hub event, handled
	wokeUpload        // a checkpoint upload completed (onComplete)
	wokeVerdict       // an audit verdict taken (onAudit), without consequence for the wait
	wokeDeadline      // listen.deadline fired
	wokeTimer         // listen.timer fired
	wokeCommand       // an admin command carried out
	wokeStopping      // the coordinator is stopping
)

// await is the one place the job loop reads the hub's events, and with them everything else that
// arrives while it waits (w): it takes one thing, does what is always done with it — an event is
// handled (handle, or handleIdle), an upload recorded, a verdict weighed, a command carried out —
// and says what woke it. Its error is what handling made of it (handle's errReplan or
// replicaLeft, a verdict's rollback), ctx's, or an expired link suspect's; the waits around it
// decide what each means to them.
func (j *jobRun) await(ctx context.Context, w listen) (wake, Event, error) {
	var suspect <-chan time.Time
	if w.suspect && j.suspect != nil {
		t := time.NewTimer(time.Until(j.suspect.until))
		defer t.Stop()
		suspect = t.C
	}
	var commands chan command
	if w.commands {
		commands = j.s.commands
	}
	var stopping <-chan struct{}
	if w.stopping {
		stopping = j.s.stopping
	}
	var verdicts <-chan auditResult
	if w.verdicts {
		verdicts = j.s.auditResults
	}
	for {
		select {
		case <-ctx.Done():
			return wokeNone, Event{}, ctx.Err()
		case <-stopping:
			return wokeStopping, Event{}, nil
		case c := <-commands:
			c.done <- j.do(ctx, c)
			return wokeCommand, Event{}, nil
		case <-suspect:
			if j.suspect == nil {
				suspect = nil // its peer left meanwhile
				continue
			}
			err := j.suspect.err
			j.suspect = nil
			return wokeNone, Event{}, err
		case <-w.deadline:
			return wokeDeadline, Event{}, nil
		case <-w.timer:
			return wokeTimer, Event{}, nil
		case id := <-j.s.uploads:
			j.onComplete(ctx, id)
			return wokeUpload, Event{}, nil
		case r := <-verdicts:
			return wokeVerdict, Event{}, j.onAudit(ctx, r)
		case ev := <-j.s.hub.Events():
			if w.before != nil {
				w.before(ev)
			}
			// A delayed outer step's answers come while the job loop waits on anything (an
			// audit, a checkpoint, a round): kept here, weighed where the loop drives the step.
			j.noteDelayed(ev)
			if w.idle {
				j.handleIdle(ev)
				return wokeEvent, ev, nil
			}
			return wokeEvent, ev, j.handle(ev)
		}
	}
}
