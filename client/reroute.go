package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// Reroutes: a step-mode replica lost during a step costs only its own work on it (issue 30). The
// coordinator tells the stages of the surviving replicas (proto.StepReroute) that their replicas'
// runs of the step are wider now — a lost run split between its surviving neighbours, each share
// still one contiguous run in replica order — and sends the first and last stages the added
// micro-batches' tokens and targets. Each stage, after its own micro-batches, keeps the gradient
// nodes it has made, widens its tree (model.Shard.ExtendGradients), runs the added micro-batches
// through its replica's pipeline (one 1F1B leg for the run before its own, one for the run after),
// and reduces with the survivors only: the nodes of their widened runs, keeping what it received
// before. The step's gradient is the same tree over the same micro-batches: the single process's
// bits.
//
// Where a reroute is taken up is fixed — after the stage's own micro-batches and the nodes they
// made final were queued, then after each leg a reroute added — so a recomputation that knows the
// step's reroutes up front (proto.StepSpec.Reroutes) sends and reports exactly what the live stage
// did, whenever the reroute reached it. A stage that reported the step before its reroute came
// takes it up the same way and reports the step again (Reroute), its commitment covering the
// whole step's traffic.

// rerouteBox is where the session's reader leaves the reroutes of the step in flight on a stage
// (offer) for the stage to take up (take); a reroute of a step that is not in flight here goes to
// the executor instead, which re-enters the step (StageRunner.Reroute). One per plan.
type rerouteBox struct {
	mu      sync.Mutex
	plan    uint32
	step    uint64
	open    bool // a step is in flight here: between its start and its report
	pending []*proto.StepReroute
	grown   chan struct{} // closed, and replaced, when pending grows
	// rt is the route of step rtStep's own run (attach): a stage takeover offered for that step
	// redirects it at once, whatever the stage is busy with (takeover.go).
	rt     *route
	rtStep uint64
}

// attach makes rt the route of step's own run, and returns the stage takeovers offered for the
// step so far, for the caller to take up on rt before it sends anything.
func (b *rerouteBox) attach(step uint64, rt *route) []*proto.StageTakeover {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rt, b.rtStep = rt, step
	var out []*proto.StageTakeover
	if b.open && b.step == step {
		for _, m := range b.pending {
			if m.Stage != nil {
				out = append(out, m.Stage)
			}
		}
	}
	return out
}

func newRerouteBox(plan uint32) *rerouteBox {
	return &rerouteBox{plan: plan, grown: make(chan struct{})}
}

// changed is closed once a reroute is offered after this call: taken before take, so that none
// goes unseen between the two.
func (b *rerouteBox) changed() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.grown
}

// offer leaves m for the step in flight, reporting whether that step takes it.
func (b *rerouteBox) offer(m *proto.StepReroute) bool {
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.open || m.Step != b.step || m.PlanVersion != b.plan {
		return false
	}
	// A stage takeover redirects the step's route at once, whatever the stage is busy with, and
	// under the lock: the step cannot report (end) before its resends are under way, which
	// its report then waits for (settle) and commits to. A step reported already takes it up
	// in the executor (Reroute), after its traffic is recorded again.
	if rt := b.rt; m.Stage != nil && rt != nil && b.rtStep == m.Step {
		rt.redirect(rt.ctx, m.Stage)
	}
	b.pending = append(b.pending, m)
	close(b.grown)
	b.grown = make(chan struct{})
	return true
}

// begin opens step to reroutes, with first (if any) taken already: the session's reader, as it
// hands the executor the step's open, or the executor, as it re-enters a step reported already.
func (b *rerouteBox) begin(step uint64, first ...*proto.StepReroute) {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.step, b.open, b.pending = step, true, slices.Clone(first)
}

// take returns the reroutes left since the last take.
func (b *rerouteBox) take() []*proto.StepReroute {
	b.mu.Lock()
	defer b.mu.Unlock()
	p := b.pending
	b.pending = nil
	return p
}

// end closes the step to reroutes unless some came since the last take: those are returned, and
// the step, still open, takes them up before it reports.
func (b *rerouteBox) end() []*proto.StepReroute {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := b.pending; len(p) > 0 {
		b.pending = nil
		return p
	}
	b.open = false
	return nil
}

// abort closes the step to reroutes: it failed.
func (b *rerouteBox) abort() {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.open, b.pending = false, nil
}

// settle completes run's gradient once the stage's own micro-batches are done: it queues the
// final nodes, takes up the reroutes heard (or, recomputing, those of the step's spec), and
// receives the other replicas' nodes — which a reroute heard meanwhile interrupts — until the
// gradient is complete and every reroute heard is in it.
func (r *StageRunner) settle(ctx context.Context, run *stepRun) error {
	red := run.red
	if red == nil {
		if !r.Shard.GradientsComplete() {
			return fmt.Errorf("step %d: the gradient tree is incomplete", run.st.Step)
		}
		return nil
	}
	given := run.st.Reroutes // a recomputation's: taken all at once, where a live stage takes its first
	for {
		if err := red.queueAll(); err != nil {
			return err
		}
		var wake <-chan struct{}
		if r.reroutes != nil && given == nil {
			wake = r.reroutes.changed()
		}
		var next []*proto.StepReroute
		switch {
		case given != nil:
			for i, sh := range given[run.reroutes:] {
				m := &proto.StepReroute{Step: run.st.Step, PlanVersion: run.st.PlanVersion, Attempt: run.reroutes + len(next) + 1, Shares: sh}
				if run.reroutes+i == 0 {
					m.Stage = run.st.Takeover // a takeover is only ever a step's first reroute
				}
				next = append(next, m)
			}
		case r.reroutes != nil:
			next = r.reroutes.take()
		}
		if len(next) > 0 {
			for _, m := range next {
				if err := r.takeUp(ctx, run, m); err != nil {
					return err
				}
			}
			continue
		}
		if !r.Shard.GradientsComplete() {
			err := red.finish(&run.tm, wake)
			if errors.Is(err, errRerouted) {
				continue
			}
			if err != nil {
				return err
			}
		}
		// A pool mate that received none of this stage's nodes may have left after it sent its
		// own (make churn: killed at its step's end, it was taken over while its pool mate
		// reported the failed sends as the step's). Its departure is answered by a reroute or a
		// takeover: wait for it, as a wait for its nodes does (recvNode), and take it up.
		if wake != nil && red.unanswered() && rerouteWithin(ctx, wake) {
			continue
		}
		if r.reroutes != nil && given == nil {
			if more := r.reroutes.end(); len(more) > 0 {
				r.reroutes.begin(run.st.Step, more...)
				continue
			}
		}
		// What a stage takeover had this stage send its taker again is part of the step.
		if rt := run.rt; rt != nil {
			if err := rt.flush(); err != nil {
				return err
			}
		}
		sendNS, err := red.close(false)
		run.tm.TransferNS += sendNS
		return err
	}
}

// takeUp takes reroute m up on run: the stage's replica computes the micro-batches its share in m
// adds, and reduces with the replicas m lists only.
func (r *StageRunner) takeUp(ctx context.Context, run *stepRun, m *proto.StepReroute) error {
	st := run.st
	switch {
	case m.Stage != nil && r.Outer == nil && r.Dispatch == nil && r.Replica != nil && m.Step == st.Step && m.PlanVersion == st.PlanVersion && m.Attempt == run.reroutes+1:
		return r.takeOver(ctx, run, m)
	case r.Outer != nil || run.red == nil || r.Dispatch != nil || r.Replica == nil:
		return fmt.Errorf("step %d: a reroute of a stage that reroutes nothing (outer mode, expert hosts, or no replicas)", st.Step)
	case m.Step != st.Step || m.PlanVersion != st.PlanVersion:
		return fmt.Errorf("a reroute of step %d plan %d during step %d plan %d", m.Step, m.PlanVersion, st.Step, st.PlanVersion)
	case m.Attempt != run.reroutes+1:
		return fmt.Errorf("step %d: reroute %d after %d", st.Step, m.Attempt, run.reroutes)
	}
	M := st.MicroBatches
	if err := proto.CheckShares(m.Shares, M); err != nil {
		return fmt.Errorf("step %d: reroute %d: %w", st.Step, m.Attempt, err)
	}
	share := map[int][2]int{}
	for _, s := range m.Shares {
		share[s.Replica] = [2]int{s.First, s.First + s.MicroBatches}
	}
	mine, ok := share[r.Replica.Index]
	switch {
	case !ok:
		return fmt.Errorf("step %d: reroute %d leaves this stage's replica %d out", st.Step, m.Attempt, r.Replica.Index)
	case mine[0] > run.lo || mine[1] < run.hi:
		return fmt.Errorf("step %d: reroute %d gives replica %d micro-batches [%d,%d), fewer than its [%d,%d)", st.Step, m.Attempt, r.Replica.Index, mine[0], mine[1], run.lo, run.hi)
	}
	if r.fits != nil {
		if err := r.fits(mine[0], mine[1]-mine[0]); err != nil {
			return fmt.Errorf("step %d: reroute %d widens this stage's run to micro-batches [%d,%d): %w", st.Step, m.Attempt, mine[0], mine[1], err)
		}
	}
	if err := r.reduceWith(run, share, M); err != nil {
		return fmt.Errorf("step %d: reroute %d: %w", st.Step, m.Attempt, err)
	}
	if err := r.Shard.ExtendGradients(mine[0], mine[1]); err != nil {
		return fmt.Errorf("step %d: reroute %d: %w", st.Step, m.Attempt, err)
	}
	run.reroutes++
	lo, hi := run.lo, run.hi
	run.lo, run.hi = mine[0], mine[1]
	if mine[0] < lo {
		if err := r.leg(ctx, run, mine[0], lo-mine[0], run.rt); err != nil {
			return err
		}
	}
	if mine[1] > hi {
		if err := r.leg(ctx, run, hi, mine[1]-hi, run.rt); err != nil {
			return err
		}
	}
	return nil
}

// Reroute takes reroute m up on the step this stage reported already and has not applied, and
// reports the step again: the micro-batches m adds, the reduction among the replicas it lists.
func (r *StageRunner) Reroute(ctx context.Context, m *proto.StepReroute) (*proto.StepReport, error) {
	run := r.cur
	if run == nil || run.red == nil || run.st.Step != m.Step || run.st.PlanVersion != m.PlanVersion {
		return nil, fmt.Errorf("a reroute of step %d plan %d, which this stage is not waiting to apply", m.Step, m.PlanVersion)
	}
	if run.rt != nil {
		run.rt.redirect(ctx, m.Stage) // a neighbour of the lost stage: the taker gets what it sent
	}
	rep, err := r.reroute(ctx, run, m)
	if err != nil {
		run.end()
		r.cur = nil
		r.reroutes.abort()
		r.Shard.Reset()
		return nil, fmt.Errorf("stage %d step %d: %w", r.Index, m.Step, err)
	}
	return rep, nil
}

func (r *StageRunner) reroute(ctx context.Context, run *stepRun, m *proto.StepReroute) (*proto.StepReport, error) {
	if r.reroutes != nil {
		r.reroutes.begin(m.Step, m)
	}
	red := run.red
	red.start(ctx)
	defer red.close(true)
	r.Shard.Stage.AfterGroup = func(mb, group int) {
		if run.queueErr == nil {
			run.queueErr = red.queue(mb, group)
		}
	}
	defer func() { r.Shard.Stage.AfterGroup = nil }()
	if r.reroutes == nil {
		if err := r.takeUp(ctx, run, m); err != nil {
			return nil, err
		}
	}
	if err := r.settle(ctx, run); err != nil {
		return nil, err
	}
	return r.report(run)
}

// reduceWith makes run's reduction one among the replicas of share (their runs by index): a
// reduce peer whose replica is not in it is gone — its link forgotten, since what it still sends,
// or fails, is nobody's business — and each other's nodes are those of its run now.
func (r *StageRunner) reduceWith(run *stepRun, share map[int][2]int, M int) error {
	red := run.red
	for _, l := range r.links {
		sh, ok := share[l.peer.Replica]
		if !ok {
			if !red.gone[l.peer.Worker] {
				red.gone[l.peer.Worker] = true
				r.forgetPeer(l.peer.Worker)
			}
			continue
		}
		if red.gone[l.peer.Worker] {
			return fmt.Errorf("it brings back replica %d", l.peer.Replica)
		}
		red.nodes[l.peer.Worker] = model.TreeNodes(M, sh[0], sh[1])
	}
	return nil
}
