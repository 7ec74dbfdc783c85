package client

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Outer mode across pipeline replicas (job.SyncOuter; model/outer.go is the definition, local's
// outer loop the single-process reference). A replica's stages train their replica's
// micro-batches as steps of their own — clipped by the replica's own norm — and at each outer step
// the stages holding a tensor, one of each participating replica, take the step together as a
// reduce-scatter and an all-gather (outerx.go): each participant owns a few segments of the
// tensor (model.OuterOwners, model.OuterSegment), receives every other participant's θ_q
// (float32) or int8 pseudo-gradient of them, averages each exactly as the whole-tensor step would
// (model.Outer.ReduceSegment) and sends the average back; every holder then takes the same
// Nesterov step (model.Outer.ApplyAverage) and continues from the new global θ. Each stage sends
// about 2·(R−1)/R of its payload. With a delay (job.Sync.Delay) the exchange and the step run
// beside training, and the stage takes the new θ up τ steps later at a clip factor
// (takeUpOuter, model.Rebase).
//
// Without a delay an outer step has two phases (proto.OuterSync), so that losing a participant
// mid-exchange costs no restore. The stage exchanges, keeps the average it gathered without
// applying it (heldOuter) and answers proto.OuterDone; at proto.OuterCommit it applies it. If a
// participant is lost first, the coordinator asks the same outer step again without it
// (OuterSync.Attempt), and the exchange goes on rather than starting over (outerx.go, "an
// exchange that survives a departure"): a lost owner's segments go to survivors, what crossed
// stands, and each segment is averaged once, over the participants of the attempt its owner
// averaged it at, which the record keeps for a replay (local.Period.Segments).
//
// A delayed outer step has the same two phases, the exchange running beside training: the stage
// keeps the average it gathered in pendingOuter and answers proto.OuterDone once it holds it
// (session.delayedOutcome); the coordinator commits the step once every participant's stage
// holds it, and holds each replica's step after the take-up until then. The commit applies the
// average to the global θ and V; the take-up (model.Rebase) follows at the take-up step's clip
// factor, or at the commit if that comes later. A participant lost before the commit is left out
// as without a delay, the exchange going on from the snapshot of θ_r the stage took at the outer
// step while it trains on (local.Period.LeftOutOf).

// outerState is a replica's stage's share of the outer optimizer: the global θ of its tensors at
// the last outer step, their outer momentum (and the average's error feedback, of the segments it
// owns: model.Outer.Participate), and this replica's own error feedback.
type outerState struct {
	outer  *model.Outer
	global *model.Params
	err    *model.Params // int8 only: this replica's error feedback e_r
	spec   job.Spec      // the job: its learning rates, weight decay and H bound what crosses
	// pending is a delayed outer step whose exchange runs beside training (job.Sync.Delay), nil
	// when none: the stage takes it up after step pending.takeUp (takeUp).
	pending *pendingOuter
	// key signs what this stage gives (package audit, "Outer commitments") for job.
	key ed25519.PrivateKey
	job string
	// held is an outer step without a delay exchanged and not yet committed (proto.OuterCommit);
	// nil when none. failed is the step whose last attempt failed, -1 when none: the stage takes
	// no training step until the coordinator's redo or next plan.
	held   *heldOuter
	failed int64
	// arriving is the outer momentum still on its way from the giver this stage took its state
	// from (takeState); nil once it is in.
	arriving *momentumArrival
	// x is the exchange of the last outer step, open across its attempts until its commit, a
	// new plan or the next step (outerx.go); nil when none.
	x *outerExchange
	// arena holds all of the above that is laid out like the parameters (outerstore.go).
	arena *outerArena

	// signs and verifies count the signatures this stage made and checked (batches: signBatch,
	// verifyOuter); the worker's status adds them up.
	signs, verifies atomic.Int64
}

// heldOuter is an outer step exchanged and held until it is committed: avg is, by tensor, the
// whole average every holder applies (nil when the step was taken alone, and so applied).
type heldOuter struct {
	step     uint64
	attempt  int
	avg      [][]float32
	averaged []proto.SegmentAveraged // the segments this stage averaged (proto.OuterDone.Averaged)
}

// pendingOuter is an outer step taken with a delay (job.Sync.Delay): the stage sent what it gives
// and trains on while a goroutine of its own receives the others' contributions, checks them and
// takes the step into global, V and Err. Nothing else touches those until wait returns: an
// evaluation, a checkpoint and the take-up wait first. Training touches only the shard's θ_r.
type pendingOuter struct {
	step    uint64        // the training step the outer step follows
	attempt int           // the attempt exchanged (proto.OuterSync.Attempt)
	takeUp  int           // the step after which the stage takes it up (job.Spec.OuterTakeUpAfter)
	snap    *model.Params // θ_r at the outer step, which the take-up keeps the progress since
	// done is closed once the exchange is over: err is its outcome, and avg the average gathered
	// (by tensor; nil when the step was taken alone, and so applied), held until the commit.
	done     chan struct{}
	err      error
	avg      [][]float32
	averaged []proto.SegmentAveraged // the segments this stage averaged (proto.OuterDone.Averaged)
	// committed: the coordinator committed the step (proto.OuterCommit) and its average is in the
	// global θ and V; the take-up is what is left.
	committed bool
}

// wait blocks until the exchange is over and returns its outcome (every time it is asked).
func (p *pendingOuter) wait() error {
	<-p.done
	return p.err
}

// settled is the pending state of a checkpoint taken while an outer step was pending: its global
// part is already the outer step's (committed), so there is nothing left but the take-up.
func settled(step uint64, takeUp int, snap *model.Params) *pendingOuter {
	done := make(chan struct{})
	close(done)
	return &pendingOuter{step: step, takeUp: takeUp, snap: snap, done: done, committed: true}
}

// newOuterState is a stage's outer state, zero, for its tensors specs in job spec: in a file
// mapping on a native worker, on the heap in a browser tab (outerstore.go).
func newOuterState(specs []model.Spec, spec job.Spec) (*outerState, error) {
	a, err := newOuterArena(specs, spec)
	if err != nil {
		return nil, err
	}
	y := spec.Sync
	var avgErr *model.Params
	o := &outerState{global: a.params(slotGlobal), spec: spec, failed: -1, arena: a}
	if y.Compress == "int8" {
		avgErr, o.err = a.params(slotAvgErr), a.params(slotErr)
	}
	o.outer = model.NewOuterIn(a.params(slotMomentum), avgErr, y.OuterLR, y.OuterMomentum)
	return o, nil
}

// close ends the outer state of a stage the worker no longer holds: a delayed exchange, if one
// still runs, and its mapping, whose file goes at once (outerArena.close).
func (o *outerState) close() {
	o.dropPending()
	o.arena.close()
}

// release gives the pages of the outer state back once an outer step (or a checkpoint, an
// evaluation, a handover) is done with them (outerArena.release); nil-safe.
func (o *outerState) release() {
	if o != nil {
		o.arena.release()
	}
}

// warmStart starts the outer state from the synchronous warm-up's end (job.Sync.Warmup): the
// global θ the stage's parameters p, which every replica holds alike, with no outer momentum, no
// error feedback and nothing pending — as local/warm.go starts its outer run.
func (o *outerState) warmStart(p *model.Params) error {
	if err := o.global.CopyFrom(p); err != nil {
		return err
	}
	o.outer.Reset()
	if o.err != nil {
		o.err.Zero()
	}
	o.dropPending()
	o.held, o.failed = nil, -1
	return nil
}

// dropPending forgets a pending delayed outer step, and ends the exchange of the last outer
// step if it still runs.
func (o *outerState) dropPending() {
	o.endExchange()
	if o.pending != nil {
		<-o.pending.done
		o.pending = nil
	}
}

// outerRefusal is an outer step refused because of what another replica sent (checkGiven): this
// stage applied nothing, and stays connected (session.outerStep) while the coordinator replans.
// evidence proves it when the sender signed what it sent; nil when it did not.
type outerRefusal struct {
	replica  int
	err      error
	evidence *proto.OuterEvidence
}

func (e *outerRefusal) Error() string {
	return fmt.Sprintf("refused replica %d's contribution to the outer step: %v", e.replica, e.err)
}

func (e *outerRefusal) Unwrap() error { return e.err }

// checkGiven refuses a participant's contribution to the outer step — of values [lo, lo+len(g))
// of one tensor, whose global θ there is g: its θ_q (x, float32) or its pseudo-gradient's values
// after int8 — that no honest replica could have sent: a value that is not finite, or a
// pseudo-gradient larger than the round's AdamW steps can move a parameter from the global θ
// (audit.OuterBound), chunk by chunk (model.OuterChunk; lo starts one) at the chunk's largest
// |θ|. It runs before anything is applied, so a peer sending NaN or 1e30 cannot reach any
// replica's parameters. It returns the refused chunk of g, -1 if none.
func checkGiven(b audit.OuterBound, name string, lo int, g, x []float32) (int, error) {
	for a := 0; a < len(g); a += model.OuterChunk {
		end := min(a+model.OuterChunk, len(g))
		if i, d, limit, ok := b.Check(g[a:end], x[a:end]); !ok {
			return a / model.OuterChunk, fmt.Errorf("%s[%d]: a pseudo-gradient of %g, where the round's AdamW steps from the global θ move a parameter by %g at most", name, lo+a+i, d, limit)
		}
	}
	return -1, nil
}

// A replica's worker may leave while the others carry on (the coordinator drops its replica:
// sched.DropReplica). Its partners hear of it twice: their link to it fails, and the next outer
// step leaves its replica out of the participants. The link is this stage's to another replica
// only for outer steps (outerPartnerOnly), so its failure is contained (RTCConfig.Contained): it
// is not reported as the plan's, and it stops only what waits on that partner — an exchange
// that expects its contribution, which then fails as "a participant vanished" and is reported
// (outerFailed) — not the pipeline's activations nor an exchange among the others. An outer step
// that leaves the replica out forgets its links (forgetOuter).

// outerPartnerOnly reports whether worker p is, for the stage a assigns, only a stage of another
// replica it takes outer steps with — not a pipeline neighbour of its own replica.
func outerPartnerOnly(a *proto.Assign, p string) bool {
	if a.Replica == nil || p == a.Prev || p == a.Next {
		return false
	}
	for _, h := range a.ExpertHosts {
		if slices.Contains(h.Workers, p) {
			return false
		}
	}
	return slices.ContainsFunc(a.Replica.Peers, func(q proto.ReducePeer) bool { return q.Worker == p })
}

// forgetOuter forgets the links to the stages of replicas that outer step m leaves out, and
// their failures, so that the exchange among the participants is not stopped by a replica that
// left.
func (r *StageRunner) forgetOuter(m *proto.OuterSync) {
	w := baseNet(r.Net)
	if w == nil {
		return
	}
	for _, l := range r.links {
		if !slices.Contains(m.Participants, l.peer.Replica) {
			w.forget(l.peer.Worker)
		}
	}
}

// forget closes the link to peer and forgets its failure (RTCTransport.Disconnect).
func (w *workerNet) forget(peer string) {
	if w.rtc != nil && !w.viaRelay[peer] {
		w.rtc.Disconnect(peer)
	}
}

// peerDone is closed when the WebRTC link to peer fails (RTCTransport.PeerDone); nil for none.
func (w *workerNet) peerDone(peer string) <-chan struct{} {
	if w.rtc == nil || w.viaRelay[peer] {
		return nil
	}
	return w.rtc.PeerDone(peer)
}

// baseNet is the workerNet under the stage's Transport (a step's recorder, stepNet, and a
// fault's faultNet may wrap it), or nil.
func baseNet(t Transport) *workerNet {
	for {
		switch n := t.(type) {
		case *workerNet:
			return n
		case interface{ unwrap() Transport }:
			t = n.unwrap()
		default:
			return nil
		}
	}
}

// fromPartner is ctx ended, with a cause naming it, when the link to a stage of replica q this
// stage exchanges with fails: what this stage waits for from q will not come. stop releases it.
func (r *StageRunner) fromPartner(ctx context.Context, q int) (context.Context, func()) {
	qctx, cancel := context.WithCancelCause(ctx)
	quit := make(chan struct{})
	if w := baseNet(r.Net); w != nil {
		for _, l := range r.links {
			if d := w.peerDone(l.peer.Worker); l.peer.Replica == q && d != nil {
				go func() {
					select {
					case <-d:
						cancel(&PeerError{Peer: l.peer.Worker, Err: fmt.Errorf("replica %d's stage: %w", q, ErrPeerGone)})
					case <-quit:
					}
				}()
			}
		}
	}
	return qctx, func() { close(quit); cancel(nil) }
}

// OuterStep takes the outer step m asks for (see the top of this file). The shard's parameters
// end as the new global θ; its AdamW state is its own. base is what the exchange runs under,
// across the step's attempts (the session's); ctx is this attempt's, which a later attempt or
// plan ends: without a delay OuterStep waits under it for this attempt's average.
func (r *StageRunner) OuterStep(base, ctx context.Context, m *proto.OuterSync) error {
	o, rep := r.Outer, r.Replica
	if o == nil || rep == nil {
		return fmt.Errorf("outer step after step %d: this stage is not in a plan of replicas in outer mode", m.Step)
	}
	if !slices.Contains(m.Participants, rep.Index) {
		return fmt.Errorf("outer step after step %d: replica %d is not among the participants %v", m.Step, rep.Index, m.Participants)
	}
	// The plan's replicas bound what an exchange may be asked (model.OuterOwners), and so what
	// it allocates: a coordinator asking more is refused.
	if first, segs := len(m.FirstParticipants()), len(m.SegmentOwners()); first > rep.Count || segs > model.OuterSegmentsPerReplica*rep.Count {
		return fmt.Errorf("outer step after step %d: %d participants and %d segments, for a plan of %d replicas", m.Step, first, segs, rep.Count)
	}
	r.forgetOuter(m)
	if x := o.x; x != nil && x.step == m.Step && m.Attempt > 0 {
		return r.outerRedo(ctx, m)
	}
	// A first ask, of whichever attempt: a delayed step's replica still training the step
	// before it when a partner left is asked the redo's attempt first (coordinator:
	// redoDelayed).
	switch {
	case o.pending != nil:
		return fmt.Errorf("outer step after step %d while the one after step %d (attempt %d) is not taken up", m.Step, o.pending.step, o.pending.attempt)
	case o.held != nil:
		return fmt.Errorf("outer step after step %d while attempt %d of the one after step %d is not committed", m.Step, o.held.attempt, o.held.step)
	case o.failed >= 0:
		return fmt.Errorf("outer step after step %d while the one after step %d failed", m.Step, o.failed)
	}
	o.endExchange()
	sh := r.Shard
	// With a delay the stage trains on while the exchange runs, so what it gives is a snapshot of
	// θ_r, which the take-up needs as well.
	takeUp := o.spec.OuterTakeUpAfter(int(m.Step))
	theta := sh.P
	sh.Pull() // θ_r, from the device
	if takeUp != int(m.Step) {
		theta = o.arena.buffer(slotSnap)
		if err := theta.CopyFrom(sh.P); err != nil {
			return err
		}
	}
	// What this replica gives: θ_r, or its pseudo-gradient through int8 and back, with the codes
	// and scales to send — once, whatever attempts follow.
	mine := model.OuterGiven{Theta: theta}
	payload := make(map[string][2][]byte, len(theta.Tensors)) // int8: the tensor's parts
	if o.outer.Int8 {
		mine.Delta = o.arena.buffer(slotDelta)
		for ti, t := range theta.Tensors {
			g, e, x := o.global.Tensors[ti].Data, o.err.Tensors[ti].Data, mine.Delta.Tensors[ti].Data
			payload[t.Name] = model.OuterLayout{N: len(g), Int8: true}.EncodeInt8(g, t.Data, x, e)
		}
	}
	if len(m.Participants) == 1 && len(m.SegmentOwners()) == 1 {
		// Alone: the step at once, nothing to gather (a lone participant's Δ stays float64).
		o.outer.Participate(m.Participants)
		err := o.outer.StepGiven(o.global, []model.OuterGiven{mine})
		if takeUp == int(m.Step) {
			if err != nil {
				o.failed = int64(m.Step)
				return err
			}
			o.held = &heldOuter{step: m.Step}
			return nil
		}
		p := &pendingOuter{step: m.Step, takeUp: takeUp, snap: theta, done: make(chan struct{}), err: err}
		close(p.done)
		o.pending = p
		return nil
	}
	x := r.newOuterExchange(base, m, mine, payload)
	o.x = x
	if takeUp == int(m.Step) {
		return r.awaitExchange(ctx, m)
	}
	o.pending = x.pending(m.Attempt, takeUp, theta)
	return nil
}

// outerRedo takes up a later attempt m of the outer step whose exchange runs here: it goes on
// with fewer participants (outerx.go), and without a delay waits for this attempt's average.
func (r *StageRunner) outerRedo(ctx context.Context, m *proto.OuterSync) error {
	o := r.Outer
	x := o.x
	if p := o.pending; p != nil {
		if p.step != m.Step || p.committed || m.Attempt <= p.attempt {
			return fmt.Errorf("outer step after step %d (attempt %d) while the one after step %d (attempt %d) is not taken up", m.Step, m.Attempt, p.step, p.attempt)
		}
		if err := x.update(m); err != nil {
			return err
		}
		o.pending = x.pending(m.Attempt, p.takeUp, p.snap)
		return nil
	}
	if h := o.held; h != nil && (h.step != m.Step || h.attempt >= m.Attempt) {
		return fmt.Errorf("outer step after step %d, attempt %d, while attempt %d of the one after step %d is not committed", m.Step, m.Attempt, h.attempt, h.step)
	}
	if err := x.update(m); err != nil {
		return err
	}
	o.held, o.failed = nil, -1
	return r.awaitExchange(ctx, m)
}

// awaitExchange waits for attempt m's average of the exchange under way (an outer step without
// a delay) and holds it until the commit.
func (r *StageRunner) awaitExchange(ctx context.Context, m *proto.OuterSync) error {
	o := r.Outer
	avg, av, err := o.x.wait(ctx, m.Attempt)
	if err != nil {
		if !errors.Is(err, errSuperseded) {
			o.failed = int64(m.Step)
		}
		return err
	}
	o.held = &heldOuter{step: m.Step, attempt: m.Attempt, avg: avg, averaged: av}
	return nil
}

// pending is a delayed outer step's attempt on x: its goroutine waits for the attempt's average.
func (x *outerExchange) pending(attempt, takeUp int, snap *model.Params) *pendingOuter {
	p := &pendingOuter{step: x.step, attempt: attempt, takeUp: takeUp, snap: snap, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.avg, p.averaged, p.err = x.wait(x.ctx, attempt)
	}()
	return p
}

// endExchange ends the exchange of an earlier outer step, if one is still open.
func (o *outerState) endExchange() {
	if o.x != nil {
		o.x.close()
		o.x = nil
	}
}

// CommitOuter applies the outer step held (OuterStep) that m commits: the shard continues from the
// new global θ.
func (r *StageRunner) CommitOuter(m *proto.OuterCommit) error {
	o := r.Outer
	defer o.release() // the outer step is done with its state until the next
	if p := o.pendingOf(m.Step); p != nil {
		// A delayed step: its exchange is over here (this stage answered OuterDone), and the
		// take-up is the session's (takeUpOuter).
		if p.committed || p.attempt != m.Attempt {
			return fmt.Errorf("commit of the delayed outer step after step %d, attempt %d, where this stage holds attempt %d (committed %v)", m.Step, m.Attempt, p.attempt, p.committed)
		}
		select {
		case <-p.done:
		default:
			// This stage has not said it holds the average: no honest coordinator commits
			// yet, and waiting here would stall the session on its word.
			return fmt.Errorf("commit of the delayed outer step after step %d, whose exchange still runs here", m.Step)
		}
		if err := p.wait(); err != nil {
			return fmt.Errorf("commit of the delayed outer step after step %d, whose exchange failed here: %w", m.Step, err)
		}
		o.endExchange()
		if err := r.applyOuter(p.avg); err != nil {
			return err
		}
		p.avg, p.committed = nil, true
		return nil
	}
	if o == nil || o.held == nil || o.held.step != m.Step || o.held.attempt != m.Attempt {
		return fmt.Errorf("commit of the outer step after step %d, attempt %d, which this stage does not hold", m.Step, m.Attempt)
	}
	h := o.held
	o.held = nil
	o.endExchange()
	if err := r.applyOuter(h.avg); err != nil {
		return err
	}
	sh := r.Shard
	if err := sh.P.CopyFrom(o.global); err != nil {
		return err
	}
	sh.Push()
	return nil
}

// outerUncommitted says why the stage may not train now: an outer step without a delay that is
// held and not committed, or whose attempt failed; "" when none.
func (r *StageRunner) outerUncommitted() string {
	switch o := r.Outer; {
	case o == nil:
		return ""
	case o.held != nil:
		return fmt.Sprintf("the outer step after step %d is not committed", o.held.step)
	case o.failed >= 0:
		return fmt.Sprintf("the outer step after step %d failed and was not asked again", o.failed)
	}
	return ""
}

// applyOuter takes an outer step's average into the global θ and V, tensor by tensor (nil: the
// step was taken alone, and already applied).
func (r *StageRunner) applyOuter(avg [][]float32) error {
	o := r.Outer
	for ti, a := range avg {
		if err := o.outer.ApplyAverage(o.global, ti, 0, a); err != nil {
			return err
		}
	}
	return nil
}

// pendingOf is the delayed outer step after step pending, nil when none is (or o is nil).
func (o *outerState) pendingOf(step uint64) *pendingOuter {
	if o == nil || o.pending == nil || o.pending.step != step {
		return nil
	}
	return o.pending
}

// takeUpOuter takes up the delayed outer step pending once it is committed and the stage has
// applied step done, the step after which it is due, or a later one (job.Sync.Delay): it moves
// θ_r to the new global θ plus the progress made since the outer step (model.Rebase). It does
// nothing otherwise, and reports whether it took the step up.
func (r *StageRunner) takeUpOuter(done int) (bool, error) {
	o := r.Outer
	if o == nil || o.pending == nil || o.pending.takeUp > done || !o.pending.committed {
		return false, nil
	}
	p := o.pending
	o.pending = nil
	defer o.release()
	sh := r.Shard
	sh.Pull()
	if err := model.Rebase(sh.P, o.global, p.snap); err != nil {
		return true, err
	}
	sh.Push()
	return true, nil
}

// settleOuter makes sure that a delayed outer step pending is committed, so that the global θ is
// the latest outer step's: before an evaluation or a checkpoint, which the coordinator asks only
// once it has committed the step.
func (r *StageRunner) settleOuter() error {
	if o := r.Outer; o != nil && o.pending != nil {
		p := o.pending
		if err := p.wait(); err != nil {
			return err
		}
		if !p.committed {
			return fmt.Errorf("the delayed outer step after step %d is not committed", p.step)
		}
	}
	return nil
}

// leaveInExchangeAfter is how long a worker playing FaultLeaveInExchange lets its first average
// cross before it vanishes (closing its links drops what they have not delivered).
const leaveInExchangeAfter = 500 * time.Millisecond

// outerSeg is the values [lo, hi) of a tensor: a segment of the reduce-scatter
// (model.OuterSegment).
type outerSeg struct{ lo, hi int }

// chunks are the segment's chunks of the tensor, [first, end).
func (g outerSeg) chunks() [2]int {
	return [2]int{g.lo / model.OuterChunk, (g.hi + model.OuterChunk - 1) / model.OuterChunk}
}

// sendAll sends pts to the stage l links to.
func (r *StageRunner) sendAll(ctx context.Context, l reduceLink, pts []proto.Tensor) error {
	for _, pt := range pts {
		if err := r.Net.Send(ctx, l.peer.Worker, pt); err != nil {
			return err
		}
	}
	return nil
}

// outerFrames are the frames of segment seg of tensor t that this stage sends at outer step m —
// a contribution to the segment's owner (values, int8 parts of the segment), or with average the
// owner's average of it for the all-gather — as they leave: a fault (FaultPoisonOuter) alters them
// before they are signed, as a sender that means it would, and alters them alike every time.
func (r *StageRunner) outerFrames(plan uint32, step uint64, k int, t reduceTensor, replica int, values []float32, payload [2][]byte, average bool) []proto.Tensor {
	pts := outerTensors(plan, step, k, t, replica, values, payload, r.Outer.outer.Int8, average)
	for i := range pts {
		pts[i] = r.alterOuter(pts[i])
	}
	return pts
}

// outerEntry is the entry a batch's signature covers of frames pts, segment seg of tensor t
// (audit.OuterEntry); base are the global θ's leaves of t.
func (r *StageRunner) outerEntry(t reduceTensor, seg outerSeg, pts []proto.Tensor, base [][32]byte) (audit.OuterEntry, error) {
	var parts [2][]byte
	for _, pt := range pts {
		k, err := proto.ParseOuterDeltaKey(pt.Key)
		if err != nil {
			return audit.OuterEntry{}, fmt.Errorf("outer step: %s: %w", t.name, err)
		}
		parts[k.Part%proto.OuterAveragePart] = pt.Data
	}
	leaves, err := audit.OuterGivenLeaves(seg.hi-seg.lo, parts, r.Outer.outer.Int8)
	if err != nil {
		return audit.OuterEntry{}, fmt.Errorf("outer step: %s: %w", t.name, err)
	}
	c := seg.chunks()
	return audit.OuterEntry{Tensor: t.global, Segment: c, Base: audit.MerkleRoot(base[c[0]:c[1]]), Given: audit.MerkleRoot(leaves)}, nil
}

// outerBatch is what this stage signs at once (audit.OuterBatchMessage): an entry for each segment
// of one tensor that it hands one partner's stage, or of its averages, every partner's.
type outerBatch struct {
	at     map[int]int // segment → its entry
	first  int         // the segment of the first entry: the batch's signature travels under it
	leaves [][32]byte
	sig    []byte
	sent   map[int]bool // the partners the batch's signature is sent to (outerExchange.send)
}

// add makes e, of segment k, the batch's next entry.
func (b *outerBatch) add(k int, e audit.OuterEntry) {
	if b.at == nil {
		b.at, b.first = map[int]int{}, k
	}
	b.at[k] = len(b.leaves)
	b.leaves = append(b.leaves, e.Leaf())
}

// signBatch signs b's entries as replica's at outer step (plan, step), with average as
// averages.
func (r *StageRunner) signBatch(b *outerBatch, plan uint32, step uint64, replica int, average bool) error {
	o := r.Outer
	if o.key == nil {
		// Every worker has a key (RunWorker); unsigned, the others would refuse it anyway.
		return errors.New("outer step: this stage has no key to sign what it gives with")
	}
	b.sig = ed25519.Sign(o.key, audit.OuterBatchMessage(o.job, plan, step, replica, o.outer.Int8, average, len(b.leaves), audit.MerkleRoot(b.leaves)))
	o.signs.Add(1)
	return nil
}

// batchFrame is b's signature and leaves as they leave (proto.OuterBatchSig, under the key of
// its first segment); FaultUnsignedOuter alters it.
func (r *StageRunner) batchFrame(b *outerBatch, plan uint32, step uint64, t reduceTensor, replica int, average bool) proto.Tensor {
	key := proto.OuterSigKey{PlanVersion: plan, Step: step, Tensor: t.global, Replica: replica, Average: average, Segment: b.first, Batch: true}.Key()
	return r.alterOuter(proto.OuterBatchSig{Signature: b.sig, Leaves: b.leaves}.Tensor(key))
}

// entryFrame is the place of segment k of tensor t in batch b, which travels beside it
// (proto.OuterSigEntry).
func (r *StageRunner) entryFrame(b *outerBatch, plan uint32, step uint64, k int, t reduceTensor, replica int, average bool) proto.Tensor {
	key := proto.OuterSigKey{PlanVersion: plan, Step: step, Tensor: t.global, Replica: replica, Average: average, Segment: k}.Key()
	return r.alterOuter(proto.OuterSigEntry{Entry: b.at[k], Entries: len(b.leaves), First: b.first}.Tensor(key))
}

// alterOuter is t as it leaves: a fault may alter it.
func (r *StageRunner) alterOuter(t proto.Tensor) proto.Tensor {
	if f, ok := r.Net.(outerAlterer); ok {
		return f.alterOuter(t)
	}
	return t
}

// outerAlterer is a Transport that alters what a stage gives at an outer step, or frames a
// sender (faults).
type outerAlterer interface {
	alterOuter(proto.Tensor) proto.Tensor
	accuseOuter(honest func() *proto.OuterEvidence) *proto.OuterEvidence
}

// unsigned is a contribution whose signature is missing or does not verify with its sender's
// key: the sender broke the protocol (or the two replicas' global θ already differ), and nothing
// proves which to the coordinator.
type unsigned struct{ why string }

func (e *unsigned) Error() string { return "not signed by its sender: " + e.why }

// outerProof is what proves one received segment of a tensor: its sender, the segment, the
// global θ's and the received chunks' leaves, the int8 parts as they crossed (float32 ones are
// the received values themselves), and the batch it was signed in, with its entry.
type outerProof struct {
	sender       string
	tensor       int // in the model
	seg          outerSeg
	base, leaves [][32]byte
	parts        [2][]byte
	batch        *batchHeader
	entry        proto.OuterSigEntry
}

// evidence is the proof of chunk c of the segment: g is the global θ's segment, x the received
// values.
func (p outerProof) evidence(c int, g, x []float32, compressed bool) *proto.OuterEvidence {
	cs := p.seg.chunks()
	e := &proto.OuterEvidence{Sender: p.sender, Tensor: p.tensor, Chunk: cs[0] + c, Segment: cs,
		Base: audit.OuterBaseChunk(nil, g, c), BasePath: audit.MerklePath(p.base, c), GivenPath: audit.MerklePath(p.leaves, c),
		Entry: p.entry.Entry, Entries: p.entry.Entries, EntryPath: audit.MerklePath(p.batch.leaves, p.entry.Entry), Signature: bytes.Clone(p.batch.sig)}
	if compressed {
		e.Given = audit.OuterGivenChunk(nil, len(x), p.parts, true, c)
	} else {
		e.Given = audit.OuterBaseChunk(nil, x, c) // θ_q's bits, as they crossed
	}
	return e
}

// takeOuter receives replica q's contribution to segment seg of tensor name at outer step m into
// x, verifies its signature over what crossed and the global θ's leaves base (of the tensor),
// and checks it against the bound (checkGiven, g the global θ's tensor). A contribution unsigned
// or beyond the bound is an *outerRefusal, with evidence when it was signed.
func (r *StageRunner) takeOuter(ctx context.Context, hs *batchHeaders, plan uint32, step uint64, k, q int, bound audit.OuterBound, g []float32, name string, seg outerSeg, x []float32, base [][32]byte) error {
	compressed := r.Outer.outer.Int8
	l := r.linkOf(q, name)
	if l == nil {
		return fmt.Errorf("outer step: no stage of replica %d holds %s", q, name)
	}
	rt := l.tensor(name)
	parts, err := recvOuter(ctx, r.Net, plan, step, k, rt, q, x, compressed, false)
	var proof outerProof
	if err == nil {
		proof, err = r.verifyOuter(ctx, hs, plan, step, k, l, rt, q, seg, parts, base, false)
	}
	if bad := (*unsigned)(nil); errors.As(err, &bad) {
		return &outerRefusal{replica: q, err: fmt.Errorf("%s: %w", name, err)}
	}
	if err != nil {
		return fmt.Errorf("outer step: %s from replica %d: %w", name, q, err)
	}
	gs := g[seg.lo:seg.hi]
	if f, ok := r.Net.(outerAlterer); ok {
		if e := f.accuseOuter(func() *proto.OuterEvidence { return proof.evidence(0, gs, x, compressed) }); e != nil {
			return &outerRefusal{replica: q, err: fmt.Errorf("%s: framed (a fault)", name), evidence: e}
		}
	}
	c, err := checkGiven(bound, name, seg.lo, gs, x)
	if err != nil {
		return &outerRefusal{replica: q, err: err, evidence: proof.evidence(c, gs, x, compressed)}
	}
	return nil
}

// takeAverage receives the owner replica q's average of segment seg of tensor name at outer step
// m into avg, verifies the owner's signature over what crossed and the global θ's leaves base,
// and checks it (OuterBound.CheckAverage). An average unsigned or beyond the bound is an
// *outerRefusal, with evidence (proto.OuterEvidence.Average) when it was signed.
func (r *StageRunner) takeAverage(ctx context.Context, hs *batchHeaders, plan uint32, step uint64, k, q int, bound audit.OuterBound, g []float32, name string, seg outerSeg, avg []float32, base [][32]byte) error {
	l := r.linkOf(q, name)
	if l == nil {
		return fmt.Errorf("outer step: no stage of replica %d holds %s", q, name)
	}
	rt := l.tensor(name)
	compressed := r.Outer.outer.Int8
	parts, err := recvOuter(ctx, r.Net, plan, step, k, rt, q, avg, compressed, true)
	var proof outerProof
	if err == nil {
		proof, err = r.verifyOuter(ctx, hs, plan, step, k, l, rt, q, seg, parts, base, true)
	}
	if bad := (*unsigned)(nil); errors.As(err, &bad) {
		return &outerRefusal{replica: q, err: fmt.Errorf("the average of %s: %w", name, err)}
	}
	if err != nil {
		return fmt.Errorf("outer step: the average of %s from replica %d: %w", name, q, err)
	}
	gs := g[seg.lo:seg.hi]
	for a := 0; a < len(avg); a += model.OuterChunk {
		end := min(a+model.OuterChunk, len(avg))
		if i, d, limit, ok := bound.CheckAverage(gs[a:end], avg[a:end]); !ok {
			e := proof.evidence(a/model.OuterChunk, gs, avg, compressed)
			e.Average = true
			return &outerRefusal{replica: q, err: fmt.Errorf("the average of %s[%d]: %g, beyond the %g the participants' bound allows", name, seg.lo+a+i, d, limit), evidence: e}
		}
	}
	return nil
}

// verifyOuter receives the place of replica q's segment seg of tensor t at outer step m (its
// contribution, or with average its average) in the batch it was signed in, from its stage l,
// and verifies that the batch's signature (hs, once a batch) covers parts, as received, over the
// global θ's leaves base of the tensor.
func (r *StageRunner) verifyOuter(ctx context.Context, hs *batchHeaders, plan uint32, step uint64, k int, l *reduceLink, t reduceTensor, q int, seg outerSeg, parts [2][]byte, base [][32]byte, average bool) (outerProof, error) {
	o := r.Outer
	c := seg.chunks()
	p := outerProof{sender: l.peer.Worker, tensor: t.global, seg: seg, base: base[c[0]:c[1]]}
	if o.outer.Int8 {
		p.parts = parts
	}
	key := proto.OuterSigKey{PlanVersion: plan, Step: step, Tensor: t.global, Replica: q, Average: average, Segment: k}
	pt, err := r.Net.Recv(ctx, key.Key())
	if err != nil {
		return p, err
	}
	if p.entry, err = proto.ParseOuterSigEntry(pt.Data); err != nil || pt.DType != proto.I32 {
		return p, &unsigned{fmt.Sprintf("a signature's entry of %v: %v", pt.DType, err)}
	}
	if len(l.peer.Key) != ed25519.PublicKeySize {
		return p, &unsigned{fmt.Sprintf("worker %s has no signing key", l.peer.Worker)}
	}
	key.Segment, key.Batch = p.entry.First, true
	if p.batch, err = hs.get(ctx, key, func(ctx context.Context) (*batchHeader, error) {
		pt, err := r.Net.Recv(ctx, key.Key())
		if err != nil {
			return nil, err
		}
		// Before the leaves are copied and kept for the exchange: an honest sender's batches of a
		// tensor hold each of its segments once at most, whatever the attempt.
		if n, limit := (len(pt.Data)-64)/32, min(hs.segs, model.OuterLayout{N: t.size}.Chunks()); !hs.spend(q, t.global, average, n, limit) {
			return &batchHeader{why: fmt.Sprintf("batches of %s from replica %d with more than the %d entries its segments allow", t.name, q, limit)}, nil
		}
		b, err := proto.ParseOuterBatchSig(pt.Data)
		if err != nil || pt.DType != proto.I32 {
			return &batchHeader{why: fmt.Sprintf("a batch's signature of %v: %v", pt.DType, err)}, nil
		}
		h := &batchHeader{leaves: b.Leaves, sig: bytes.Clone(b.Signature)}
		msg := audit.OuterBatchMessage(o.job, plan, step, q, o.outer.Int8, average, len(h.leaves), audit.MerkleRoot(h.leaves))
		o.verifies.Add(1)
		if !ed25519.Verify(l.peer.Key, msg, h.sig) {
			h.why = fmt.Sprintf("the signature does not verify with worker %s's key over this global θ", l.peer.Worker)
		}
		return h, nil
	}); err != nil {
		return p, err
	}
	if p.batch.why != "" {
		return p, &unsigned{p.batch.why}
	}
	if p.leaves, err = audit.OuterGivenLeaves(seg.hi-seg.lo, parts, o.outer.Int8); err != nil {
		return p, err
	}
	e := audit.OuterEntry{Tensor: t.global, Segment: c, Base: audit.MerkleRoot(p.base), Given: audit.MerkleRoot(p.leaves)}
	if p.entry.Entries != len(p.batch.leaves) || p.batch.leaves[p.entry.Entry] != e.Leaf() {
		return p, &unsigned{fmt.Sprintf("segment %d is not entry %d of the %d its batch signed", k, p.entry.Entry, len(p.batch.leaves))}
	}
	return p, nil
}

// batchHeaders are the batches' signatures a stage receives in an exchange
// (proto.OuterBatchSig): each is received and checked once, by whichever receive of its batch's
// segments asks for it first, while the others wait for it.
type batchHeaders struct {
	segs int // the exchange's segments of every tensor
	mu   sync.Mutex
	m    map[proto.OuterSigKey]*batchHeader
	// leaves counts the entries of the batches received, by sender, tensor and phase (spend).
	leaves map[[3]int]int
}

// spend counts n entries of a batch of tensor from replica q (contributions, or with average its
// averages) against limit, the tensor's segments: whatever the attempt, an honest sender puts
// each segment of a tensor in one of its batches to a stage at most, so a sender past the limit
// is making this stage hold leaves that sign nothing it sends.
func (hs *batchHeaders) spend(q, tensor int, average bool, n, limit int) bool {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.leaves == nil {
		hs.leaves = map[[3]int]int{}
	}
	key := [3]int{q, tensor, 0}
	if average {
		key[2] = 1
	}
	if hs.leaves[key]+n > limit {
		return false
	}
	hs.leaves[key] += n
	return true
}

// batchHeader is a batch's signature and leaves as received; why says why they do not sign it
// (the batch's segments are refused as unsigned), "" when they do.
type batchHeader struct {
	leaves [][32]byte
	sig    []byte
	why    string
	done   chan struct{}
	err    error // the receive failed: another asker receives it again
}

// get is the batch signature under key, received by recv unless another asker has it or is
// receiving it.
func (hs *batchHeaders) get(ctx context.Context, key proto.OuterSigKey, recv func(context.Context) (*batchHeader, error)) (*batchHeader, error) {
	for {
		hs.mu.Lock()
		if hs.m == nil {
			hs.m = map[proto.OuterSigKey]*batchHeader{}
		}
		h, ok := hs.m[key]
		if !ok {
			h = &batchHeader{done: make(chan struct{})}
			hs.m[key] = h
			hs.mu.Unlock()
			got, err := recv(ctx)
			hs.mu.Lock()
			if err != nil {
				// Cut short (this asker's link or context ended): whoever asks next receives it.
				h.err = err
				delete(hs.m, key)
			} else {
				h.leaves, h.sig, h.why = got.leaves, got.sig, got.why
			}
			hs.mu.Unlock()
			close(h.done)
			return h, err
		}
		hs.mu.Unlock()
		select {
		case <-h.done:
			if h.err == nil {
				return h, nil
			}
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// linkOf is the link to replica q's stage holding tensor name, or nil.
func (r *StageRunner) linkOf(q int, name string) *reduceLink {
	for i := range r.links {
		l := &r.links[i]
		if l.peer.Replica == q && l.tensor(name).name == name {
			return l
		}
	}
	return nil
}

// outerKey names part of tensor t that replica gives at outer step m: of its contribution, or
// with average of its average (proto.OuterAveragePart).
func outerKey(plan uint32, step uint64, k int, t reduceTensor, replica, part int, average bool) proto.TensorKey {
	if average {
		part += proto.OuterAveragePart
	}
	return proto.OuterDeltaKey{PlanVersion: plan, Step: step, Tensor: t.global, Replica: replica, Part: part, Segment: k}.Key()
}

// outerTensors are the frames of a segment of tensor t at outer step m from replica — values as
// float32, or int8's parts (model.OuterLayout of the segment) — a contribution, or with average
// the owner's average.
func outerTensors(plan uint32, step uint64, k int, t reduceTensor, replica int, values []float32, parts [2][]byte, compressed, average bool) []proto.Tensor {
	l := model.OuterLayout{N: len(values), Int8: compressed}
	if !compressed {
		return []proto.Tensor{{Key: outerKey(plan, step, k, t, replica, 0, average), DType: proto.F32, Shape: proto.Shape{uint32(len(values)), 1, 1, 1}, Data: proto.AppendFloat32s(nil, values)}}
	}
	var out []proto.Tensor
	for p := range parts {
		if rows, cols, _ := l.Part(p); rows > 0 {
			out = append(out, proto.Tensor{Key: outerKey(plan, step, k, t, replica, p, average), DType: proto.I8, Shape: proto.Shape{uint32(rows), uint32(cols), 1, 1}, Data: parts[p]})
		}
	}
	return out
}

// recvOuter receives replica q's segment of tensor t at outer step m into dst (the segment's
// values): float32 values, or values decoded from int8 codes and scales; a contribution, or with
// average an owner's average. It returns the parts' payloads as they crossed, which their
// signature covers.
func recvOuter(ctx context.Context, net Transport, plan uint32, step uint64, k int, t reduceTensor, q int, dst []float32, compressed, average bool) (parts [2][]byte, err error) {
	if !compressed {
		pt, err := net.Recv(ctx, outerKey(plan, step, k, t, q, 0, average))
		if err != nil {
			return parts, err
		}
		if pt.DType != proto.F32 || len(pt.Data) != 4*len(dst) {
			return parts, fmt.Errorf("%v of %d bytes, want float32 of %d", pt.DType, len(pt.Data), 4*len(dst))
		}
		v, err := proto.Float32s(pt.Data)
		if err != nil {
			return parts, err
		}
		copy(dst, v)
		parts[0] = pt.Data
		return parts, nil
	}
	l := model.OuterLayout{N: len(dst), Int8: true}
	for p := range parts {
		rows, cols, _ := l.Part(p)
		if rows == 0 {
			continue
		}
		pt, err := net.Recv(ctx, outerKey(plan, step, k, t, q, p, average))
		if err != nil {
			return parts, err
		}
		if pt.DType != proto.I8 || pt.Shape != (proto.Shape{uint32(rows), uint32(cols), 1, 1}) || len(pt.Data) != l.Bytes(p) {
			return parts, fmt.Errorf("part %d: %v %v of %d bytes, want int8 (%d, %d)", p, pt.DType, pt.Shape, len(pt.Data), rows, cols)
		}
		parts[p] = pt.Data
		l.DecodeInt8(dst, p, pt.Data)
	}
	return parts, nil
}

// outerCheckpoint is what a replica's stage uploads in outer mode: its replica's part (θ_r, AdamW
// moments, error feedback) and, when the coordinator asks for it (proto.Checkpoint.Global: of one
// replica's stages, the first that is left), the global part of its tensors.
func (r *StageRunner) outerCheckpoint(ctx context.Context, plan uint32, m *proto.Checkpoint) ([]safetensors.Tensor, error) {
	if err := r.settleOuter(); err != nil {
		return nil, err
	}
	if err := r.gatherOuterErr(ctx, plan, m); err != nil {
		return nil, err
	}
	global := m.Global
	o, sh := r.Outer, r.Shard
	ts := model.OuterCheckpointReplica(r.Replica.Index, sh.P, sh.Opt, o.err)
	if o.pending != nil {
		ts = append(ts, model.OuterCheckpointSnap(r.Replica.Index, o.pending.snap)...)
	}
	if global {
		ts = append(model.OuterCheckpointGlobal(o.global, o.outer), ts...)
	}
	return ts, nil
}

// errGatherFailed is a checkpoint's gather of int8's error feedback (gatherOuterErr) cut short:
// a replica's link failed, its worker gone. The gather changes no state a step reads — a sender
// only sends, and the segments the global stage took are ones it holds after any gather — so the
// checkpoint is abandoned, not the plan: the coordinator asks again of the replicas left, or
// takes the next.
var errGatherFailed = errors.New("checkpoint")

// gatherOuterErr gives the stage uploading the global part of its tensors at checkpoint m
// (replica m.GlobalReplica's) the whole of int8's average error feedback, which each owner of
// the last outer step's reduce-scatter holds of its segments only (model.Outer.Participate): an
// owner's stage sends its segments there, float32 (proto.OuterErrPart), and that stage takes
// every other live owner's (m.Live); a dropped owner's segments are gone, and zero
// (model.Outer.Forget). It fails when a live owner's link fails meanwhile.
func (r *StageRunner) gatherOuterErr(ctx context.Context, plan uint32, m *proto.Checkpoint) error {
	o, rep, sh := r.Outer, r.Replica, r.Shard
	owners := o.outer.Owners()
	if o.outer.Err == nil || len(owners) < 2 || !slices.Contains(owners, m.GlobalReplica) {
		return nil
	}
	live := func(q int) bool { return m.Live == nil || slices.Contains(m.Live, q) }
	o.outer.Forget(live)
	R := len(owners)
	key := func(t reduceTensor, q, k int) proto.TensorKey {
		return proto.OuterDeltaKey{PlanVersion: plan, Step: m.Step, Tensor: t.global, Replica: q, Part: proto.OuterErrPart, Segment: k}.Key()
	}
	if rep.Index != m.GlobalReplica {
		// Every segment this replica owns: after a redo, a lost owner's too (model.OuterReassign).
		for me, q := range owners {
			if q != rep.Index {
				continue
			}
			for _, t := range sh.P.Tensors {
				lo, hi := model.OuterSegment(len(t.Data), R, me)
				l := r.linkOf(m.GlobalReplica, t.Name)
				if lo == hi || l == nil {
					continue
				}
				e := o.outer.Err.Get(t.Name)[lo:hi]
				pt := proto.Tensor{Key: key(l.tensor(t.Name), rep.Index, me), DType: proto.F32, Shape: proto.Shape{uint32(hi - lo), 1, 1, 1}, Data: proto.AppendFloat32s(nil, e)}
				if err := r.Net.Send(ctx, l.peer.Worker, pt); err != nil {
					return fmt.Errorf("%w after step %d: the average's error feedback of %s to replica %d: %w", errGatherFailed, m.Step, t.Name, m.GlobalReplica, err)
				}
			}
		}
		return nil
	}
	for k, q := range owners {
		if q == rep.Index || !live(q) {
			continue
		}
		qctx, stop := r.fromPartner(ctx, q)
		for ti, t := range sh.P.Tensors {
			lo, hi := model.OuterSegment(len(t.Data), R, k)
			l := r.linkOf(q, t.Name)
			if lo == hi || l == nil {
				continue
			}
			pt, err := r.Net.Recv(qctx, key(l.tensor(t.Name), q, k))
			if err == nil && (pt.DType != proto.F32 || len(pt.Data) != 4*(hi-lo)) {
				err = fmt.Errorf("%v of %d bytes, want float32 of %d", pt.DType, len(pt.Data), 4*(hi-lo))
			}
			var v []float32
			if err == nil {
				v, err = proto.Float32s(pt.Data)
			}
			if err != nil {
				if qctx.Err() != nil && ctx.Err() == nil {
					err = context.Cause(qctx)
				}
				stop()
				return fmt.Errorf("%w after step %d: the average's error feedback of %s from replica %d: %w", errGatherFailed, m.Step, t.Name, q, err)
			}
			copy(o.outer.Err.Tensors[ti].Data[lo:hi], v)
		}
		stop()
	}
	return nil
}

// outerRestore loads an outer-mode stage from a checkpoint: the global part, and this replica's
// own when the checkpoint has it — a replica new to the job starts from the global θ with AdamW
// moments and error feedback at zero.
func (r *StageRunner) outerRestore(ck *model.Checkpoint) error {
	o, sh := r.Outer, r.Shard
	o.dropPending() // its exchange, if it still runs, touches the outer state the checkpoint sets
	if err := ck.IntoOuterGlobal(o.global, o.outer); err != nil {
		return err
	}
	o.outer.Restored()
	has, err := ck.IntoOuterReplica(r.Replica.Index, sh.P, sh.Opt, o.err)
	if err != nil {
		return err
	}
	if !has {
		sh.Opt.M.Zero()
		sh.Opt.V.Zero()
		if err := sh.P.CopyFrom(o.global); err != nil {
			return err
		}
	}
	// Taken while a delayed outer step was pending: the global part is the outer step's, and
	// the replica takes it up as it would have. A replica new to the job starts from the global θ,
	// so its snapshot is that.
	if e, pending := o.spec.OuterPending(ck.Step); pending {
		snap := o.arena.buffer(slotSnap)
		found, err := ck.IntoOuterSnap(r.Replica.Index, snap)
		switch {
		case err != nil:
			return err
		case !found && has:
			return fmt.Errorf("checkpoint after step %d lacks replica %d's θ at the outer step after step %d", ck.Step, r.Replica.Index, e)
		case !found:
			if err := snap.CopyFrom(sh.P); err != nil {
				return err
			}
		}
		o.pending = settled(uint64(e), o.spec.OuterTakeUpAfter(e), snap)
	}
	return nil
}
