package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// The worker's side of verification (docs/design.md, "Verification and credit"; package audit has the protocol). A job
// with AuditRate > 0 has every shard commit, in each training step's report, to the state it
// started from and to every tensor it received and sent; the coordinator later asks for the
// evidence of some of those steps (proto.Audit) and recomputes them elsewhere (Recompute).
//
// The timeline the coordinator follows, and what this worker holds along it:
//
//	report(s) → Clip(s) → … → report(s+1) → [Audit{s}] → Clip(s+1) → …
//
// Report s commits to the state digest taken after Apply(s-1) and to the traffic of step s. At
// Clip(s), before the update, the worker snapshots its state and keeps it with step s's traffic:
// the evidence of step s, which replaces that of step s-1. Report s+1's state digest then
// commits to Apply(s), so an Audit{s} arriving before Clip(s+1) finds the start state, the
// traffic and the end state (the live one) all committed to. After the job's last step L the
// final checkpoint plays the part of report L+1.

// trainer runs a shard's training steps and updates for a session: it records the traffic of each
// step and commits to it when the job audits, keeps the evidence of the last updated step, and
// calls the worker's conduct where it could cheat (honest, or its SHOAL_FAULT). Owned by the
// session's executor.
type trainer struct {
	runner  shardRunner
	audits  bool      // the job audits: commit, record, keep evidence
	conduct conduct   // honest{}, or a fault wrapping it
	net     *stepNet  // records training steps' traffic, under the conduct's Transport; nil unless audits
	state   string    // the digest of the shard's state now (when audits)
	last    *traffic  // the last training step's traffic, until its Clip
	held    *evidence // the evidence of the last updated step
	snapshots
	// Outer mode (when audits): sums are the tensor digests the state digest is made of
	// (audit.TensorSums, in model.CheckpointTensors order); boundary ties the state across the
	// last outer step for the next report (afterOuter); endSnap keeps, for the evidence, the
	// parameters the last update reached before an outer step changed them.
	sums []proto.KeyDigest
	// cvs are the chaining values of the large tensors' groups of the state t.state is the digest
	// of, taken in the same walk (audit.TensorSumsGroups): a thin bundle's lists (ThinKnown),
	// which the worker then does not hash again when it is audited. A new map each time: the
	// evidence held keeps the one of its start state.
	cvs      map[string][][32]byte
	boundary *proto.OuterBoundary
	endSnap  *stateBuffers
	// spareOK: the worker's memory holds a second snapshot beside its shard (snapshots.lent).
	spareOK bool
	// pending is closed when the digest of the state an update reached, taken in the background
	// (digestLater), is done; nil when none is under way. See settle.
	pending chan struct{}
}

// snapshots are the buffers a step's start state is kept in at its Clip (the evidence held) and
// the evidence uploads reading them from memory (evidence.go). They go on together with a kept
// shard (session.assignShard): a buffer must not be written while an upload reads it.
type snapshots struct {
	snap *stateBuffers // the snapshot buffers, reused from step to step
	// uploads read snap, which the next Clip's copy must not change under them (freeSnapshot).
	uploads []*memBody
	// lent is a snapshot that uploads (lentTo) still read after the Clip that followed their
	// audit, which took spare for its own snapshot instead of writing them to a spill: at most
	// one at a time, and only where the worker's memory holds a second snapshot beside its shard
	// (trainer.spareOK). An audit arrives just before the next Clip (the draw follows the next
	// reports), so without it nearly every upload is written out and read back.
	lent   *stateBuffers
	lentTo []*memBody
	spare  *stateBuffers
}

// traffic is what a shard received and sent in one training step.
type traffic struct {
	step uint64
	plan uint32
	recv []proto.Tensor
	sent []audit.Sent
}

// evidence is what an audit of step traffic.step asks for, less the end state (the live one).
type evidence struct {
	traffic
	stateIn []safetensors.Tensor
	// inCVs are the chaining values of stateIn's large tensors' groups (trainer.cvs at the Clip).
	inCVs map[string][][32]byte
	// paramsOut are the parameters the step's update reached when an outer step has changed
	// them since (beforeOuter); nil when the live ones are.
	paramsOut []safetensors.Tensor
}

// newTrainer sets up runner's training on net, the worker's Transport, behaving as c says. It
// must be called once the shard is initialised or restored: it takes the digest of the start
// state.
func newTrainer(runner shardRunner, net Transport, audits bool, c conduct) *trainer {
	t := &trainer{runner: runner, audits: audits, conduct: c}
	if audits {
		t.net = &stepNet{inner: net}
		net = t.net
	}
	// The conduct's Transport over the recorder: the commitment is to what actually leaves.
	// Nothing to record or alter: no wrapper in the way.
	if sr, ok := runner.(*StageRunner); ok {
		c.neighbours(sr.Prev, sr.Next) // FaultCheatTakeover
	}
	runner.setNet(c.wrap(net))
	c.started(runner.shard()) // FaultPoisonStart: before anything commits to the state
	if audits {
		// Init and restore leave the host mirror equal to the device: no Pull needed.
		t.digest(model.CheckpointTensors(runner.shard().P, runner.shard().Opt))
	}
	return t
}

// digest takes the digest of the shard's state ts (model.CheckpointTensors) as the state now.
func (t *trainer) digest(ts []safetensors.Tensor) {
	t.sums, t.cvs = audit.TensorSumsGroups(ts)
	t.state = t.compose(ts)
}

// digestLater takes the digest of ts, the state an update reached, in the background: the next
// training step only reads the state, so its forward pass need not wait behind the hash of every
// parameter and both moments (12 bytes a parameter; for a large shard, or a GPU worker whose
// host is idle while its device computes, most of a second). Its report waits for it (commit).
func (t *trainer) digestLater(ts []safetensors.Tensor) {
	done := make(chan struct{})
	t.pending = done
	go func() {
		defer close(done)
		t.digest(ts)
	}()
}

// settle waits for the digest taken in the background, if one is under way. Every use of the
// digest (t.state, t.sums) and every change of the state — an update, an outer step or its
// take-up, an evaluation on the global θ, a new plan, a fault's — comes after it: the executor
// settles before any message but a training step's (session.do), and the trainer before it
// commits or a fault may act.
func (t *trainer) settle() {
	if t != nil && t.pending != nil {
		<-t.pending
		t.pending = nil
	}
}

// compose is the state digest of ts from t.sums.
func (t *trainer) compose(ts []safetensors.Tensor) string {
	m := make(map[string]string, len(t.sums))
	for _, d := range t.sums {
		m[d.Key] = d.Digest
	}
	d, err := audit.ComposeState(ts, m)
	if err != nil {
		panic("client: state digest: " + err.Error()) // t.sums are of ts: cannot happen
	}
	return d
}

// beforeOuter is told that an outer step (or its take-up) is about to change the shard's
// parameters after step after's update: the evidence of that step keeps the parameters the update
// reached, which an audit of it recomputes (the moments the outer step leaves alone).
func (t *trainer) beforeOuter(after uint64) {
	if t == nil || !t.audits {
		return
	}
	t.settle()
	if h := t.held; h != nil && h.step == after {
		sh := t.runner.shard()
		sh.Pull()
		t.endSnap = t.endSnap.copyOf(model.CheckpointTensors(sh.P, nil))
		h.paramsOut = t.endSnap.tensors
	}
}

// afterOuter is told that an outer step (or its take-up) changed the shard's parameters after
// step after's update, global being the global θ it computed: the next report commits to the
// state before and after the change and to the global θ (proto.OuterBoundary), so that the
// coordinator can tie the chain of custody across it. The moments are the outer step's to leave
// alone: their digests carry over.
func (t *trainer) afterOuter(after uint64, global *model.Params) {
	if t == nil || !t.audits {
		return
	}
	t.settle()
	sh := t.runner.shard()
	sh.Pull()
	ts := model.CheckpointTensors(sh.P, sh.Opt)
	n := len(sh.P.Tensors)
	if len(t.sums) != len(ts) {
		t.digest(ts) // cannot happen: the shard's layout is its assignment's
		return
	}
	start, cvs := audit.TensorSumsGroups(ts[:n])
	b := &proto.OuterBoundary{After: after, End: slices.Clone(t.sums[:n]), Start: start, Moments: slices.Clone(t.sums[n:]),
		Global: audit.TensorSums(model.CheckpointTensors(global, nil))}
	copy(t.sums, start)
	// The parameters' lists are the new ones; the moments' carry over, as their digests do.
	t.cvs = maps.Clone(t.cvs)
	for _, x := range ts[:n] {
		delete(t.cvs, x.Name)
	}
	maps.Copy(t.cvs, cvs)
	t.state = t.compose(ts)
	t.boundary = b
}

// step runs training step st and returns its report, with the commitment when the job audits.
// The conduct has altered what was sent, if it does; here it may alter what is reported.
func (t *trainer) step(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	if _, ok := t.conduct.(honest); !ok {
		t.settle() // a fault may change the state as the step begins
	}
	t.conduct.begin()
	if t.net != nil {
		t.net.begin()
	}
	rep, err := t.runner.RunStep(ctx, st)
	return t.commit(st.Step, st.PlanVersion, rep, err)
}

// commit ends the recording of the traffic of step of plan, lets the conduct alter its report
// rep (err: the step failed), and commits to the traffic when the job audits.
func (t *trainer) commit(step uint64, plan uint32, rep *proto.StepReport, err error) (*proto.StepReport, error) {
	var recv []proto.Tensor
	var sent []audit.Sent
	if t.net != nil {
		recv, sent = t.net.end()
	}
	t.settle()
	t.conduct.stepDone(rep, err == nil)
	if err != nil {
		return nil, err
	}
	if t.audits {
		rep.Commit = audit.NewCommit(t.state, recv, sent)
		rep.Commit.Boundary, t.boundary = t.boundary, nil
		t.last = &traffic{step: step, plan: plan, recv: recv, sent: sent}
	}
	return rep, nil
}

// reroute takes reroute m up on the step the stage reported last and reports it again (a stage
// reports a step once more for each reroute that reaches it after its report). The traffic
// recorded goes on from the step's, and the commitment is to the whole step's.
func (t *trainer) reroute(ctx context.Context, m *proto.StepReroute) (*proto.StepReport, error) {
	r, ok := t.runner.(*StageRunner)
	if !ok {
		return nil, fmt.Errorf("a reroute of step %d on a shard that is no stage", m.Step)
	}
	if t.net != nil {
		l := t.last
		if l == nil || l.step != m.Step || l.plan != m.PlanVersion {
			return nil, fmt.Errorf("a reroute of step %d, whose traffic this worker does not hold", m.Step)
		}
		t.net.resume(l.recv, l.sent)
	}
	rep, err := r.Reroute(ctx, m)
	if err != nil {
		t.last = nil // the step is abandoned here
	}
	return t.commit(m.Step, m.PlanVersion, rep, err)
}

// apply finishes training step step of plan with the coordinator's clip factor. When the job
// audits, the state the step started from is kept first, with the step's traffic, as the
// evidence an audit of the step asks for; the digest of the state reached is what the next
// report commits to.
func (t *trainer) apply(step uint64, plan uint32, lr float64, clip float32) {
	sh := t.runner.shard()
	t.freeSnapshot()
	if t.audits {
		t.held = nil // the previous step's evidence: its audit, if any, came before this Clip
		if l := t.last; l != nil && l.step == step && l.plan == plan {
			sh.Pull()
			t.snap = t.snap.copyOf(model.CheckpointTensors(sh.P, sh.Opt))
			t.held = &evidence{traffic: *l, stateIn: t.snap.tensors, inCVs: t.cvs}
		}
		t.last = nil
	}
	t.conduct.update(t.runner, step, lr, clip)
	if t.audits {
		sh.Pull()
		t.digestLater(model.CheckpointTensors(sh.P, sh.Opt))
	}
}

// unappliedBundle returns the evidence of step of plan while it waits for its clip factor — the
// traffic recorded and the live state, which is still the start state — or nil when the last
// step reported is another. The coordinator asks it when the step's reports disagree
// (proto.Audit.Unapplied); the bundle has no end state.
func (t *trainer) unappliedBundle(step uint64, plan uint32) *audit.Bundle {
	l := t.last
	if l == nil || l.step != step || l.plan != plan {
		return nil
	}
	sh := t.runner.shard()
	sh.Pull()
	return &audit.Bundle{Step: step, PlanVersion: plan, StateIn: model.CheckpointTensors(sh.P, sh.Opt), Recv: l.recv, Sent: l.sent}
}

// bundle returns the evidence of step of plan, or nil when this worker does not hold it (an older
// step, another plan). The end state is the shard's live tensors: write the bundle before the
// shard changes again.
func (t *trainer) bundle(step uint64, plan uint32) *audit.Bundle {
	h := t.held
	if h == nil || h.step != step || h.plan != plan {
		return nil
	}
	sh := t.runner.shard()
	sh.Pull()
	out := model.CheckpointTensors(sh.P, sh.Opt)
	if h.paramsOut != nil {
		copy(out, h.paramsOut) // the parameters come first; an outer step changed the live ones
	}
	return &audit.Bundle{Step: step, PlanVersion: plan, StateIn: h.stateIn,
		StateOut: out, Recv: h.recv, Sent: h.sent}
}

// knownCVs are the chaining values this worker holds of the groups of the bundle of step of plan
// (bundle, or unappliedBundle when unapplied): of its start state and of its end state, nil where
// it holds none (then ThinKnown hashes). The end state's are the last digest's, of the live
// state, unless an outer step has changed the parameters since the update (paramsOut).
func (t *trainer) knownCVs(step uint64, plan uint32, unapplied bool) (in, out map[string][][32]byte) {
	if unapplied {
		if l := t.last; l != nil && l.step == step && l.plan == plan {
			return t.cvs, nil
		}
		return nil, nil
	}
	h := t.held
	if h == nil || h.step != step || h.plan != plan {
		return nil, nil
	}
	if h.paramsOut != nil {
		return h.inCVs, nil
	}
	return h.inCVs, t.cvs
}

// freeSnapshot leaves the snapshot buffers free for the copy a Clip makes: the uploads still
// reading the evidence held from memory keep its buffer (lent) when no other is lent and the
// worker's memory holds one more (spareOK) — the next snapshot goes into the spare, or a new
// one — and are written out to spills otherwise (memBody.detach). A lent buffer whose uploads
// have all ended becomes the spare.
func (t *trainer) freeSnapshot() {
	if t.lent != nil && !slices.ContainsFunc(t.lentTo, (*memBody).readsMemory) {
		t.spare, t.lent, t.lentTo = t.lent, nil, nil
	}
	ups := slices.DeleteFunc(t.uploads, func(b *memBody) bool { return !b.readsMemory() })
	t.uploads = nil
	switch {
	case len(ups) == 0:
	case t.spareOK && t.lent == nil && t.snap != nil:
		t.lent, t.lentTo = t.snap, ups
		t.snap, t.spare = t.spare, nil
	default:
		for _, b := range ups {
			b.detach()
		}
	}
}

// dropEvidence forgets the evidence held and the last step's traffic.
func (t *trainer) dropEvidence() { t.held, t.last, t.boundary = nil, nil, nil }

// stateBuffers is a deep copy of a shard's state tensors. The snapshot of every step is the same
// size, so one copy is overwritten rather than a new one allocated each step (its evidence is
// dropped at the same moment).
type stateBuffers struct {
	tensors []safetensors.Tensor
}

// copyOf copies ts into b's buffers (allocating them when b is nil or of another layout) and
// returns b.
func (b *stateBuffers) copyOf(ts []safetensors.Tensor) *stateBuffers {
	if b == nil || len(b.tensors) != len(ts) {
		b = &stateBuffers{tensors: make([]safetensors.Tensor, len(ts))}
	}
	for i, t := range ts {
		o := &b.tensors[i]
		if o.Name != t.Name || len(o.Data) != len(t.Data) {
			*o = safetensors.Tensor{Name: t.Name, Shape: append([]int(nil), t.Shape...), Data: make([]float32, len(t.Data))}
		}
		copy(o.Data, t.Data)
	}
	return b
}

// stepNet stands between a runner and the worker's Transport when the job audits: during a
// training step it records each tensor sent, as it actually goes out (after the conduct altered
// it: faultNet sits above), and each tensor received, so that the commitment is to the traffic as
// it was. Outside a training step (evaluations) it passes everything through unrecorded.
type stepNet struct {
	inner Transport

	mu   sync.Mutex
	on   bool // in a training step
	recv []proto.Tensor
	sent []audit.Sent
}

// begin starts recording a training step's traffic.
// resume records again, after the traffic recv and sent that a step recorded already.
func (n *stepNet) resume(recv []proto.Tensor, sent []audit.Sent) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.on, n.recv, n.sent = true, slices.Clone(recv), slices.Clone(sent)
}

func (n *stepNet) begin() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.on = true
	n.recv, n.sent = nil, nil
}

// end ends the training step and returns what it recorded.
func (n *stepNet) end() ([]proto.Tensor, []audit.Sent) {
	n.mu.Lock()
	defer n.mu.Unlock()
	recv, sent := n.recv, n.sent
	n.on, n.recv, n.sent = false, nil, nil
	return recv, sent
}

// outerFrame reports whether k is of an outer step's exchange, which with a delay runs beside the
// training steps (client/outer.go) and is no part of any: it is signed on its own ("Outer-mode
// signatures"), and neither recorded in a step's commitment nor altered by a step's fault.
func outerFrame(k proto.TensorKey) bool {
	return k.Kind == proto.KindOuterDelta || k.Kind == proto.KindOuterSig
}

func (n *stepNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	n.mu.Lock()
	if n.on && !outerFrame(t.Key) {
		// The runner allocates every payload it sends and no transport writes into one, so the
		// evidence can keep it without a copy.
		n.sent = append(n.sent, audit.Sent{To: to, T: t})
	}
	n.mu.Unlock()
	return n.inner.Send(ctx, to, t)
}

func (n *stepNet) unwrap() Transport { return n.inner }

func (n *stepNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	t, err := n.inner.Recv(ctx, key)
	if err != nil {
		return t, err
	}
	n.mu.Lock()
	if n.on && !outerFrame(t.Key) {
		n.recv = append(n.recv, t) // the runner decodes payloads into new slices: never changed
	}
	n.mu.Unlock()
	return t, nil
}

// behaviour is the conduct of the shard this worker holds, or before it holds one a new one of its
// SHOAL_FAULT (RunWorker checked the kind).
func (s *session) behaviour() conduct {
	if s.trainer != nil {
		return s.trainer.conduct
	}
	c, _ := newConduct(s.cfg.Fault)
	return c
}

// audit answers the coordinator's Audit: the evidence of the step, written now — before a later
// Clip changes the shard — and uploaded in the background, as a checkpoint is. Evidence this
// worker no longer holds is not an error worth a message: the coordinator's wait for the upload
// times out, and it judges that.
func (s *session) audit(ctx context.Context, m *proto.Audit) error {
	if err := s.behaviour().audited(m); err != nil {
		return err // FaultLeaveOnAudit
	}
	if s.trainer == nil || s.assign == nil {
		s.log.Warn("audit of a step this worker holds no shard for", "step", m.Step, "plan", m.PlanVersion)
		return nil
	}
	b := s.trainer.bundle(m.Step, m.PlanVersion)
	if m.Unapplied {
		b = s.trainer.unappliedBundle(m.Step, m.PlanVersion)
	}
	if b == nil {
		s.log.Warn("audit of a step whose evidence this worker does not hold", "step", m.Step, "plan", m.PlanVersion,
			"audits", s.trainer.audits)
		return nil
	}
	switch {
	case m.Sample != 0:
		// Thin: the start state's large moments only in the groups the seed draws, and the
		// end state by its groups' chaining values, taken now from the live tensors (and, not
		// lean, its large tensors' same groups).
		in, out := s.trainer.knownCVs(m.Step, m.PlanVersion, m.Unapplied)
		b = audit.ThinKnown(b, m.Sample, m.Lean, in, out)
	case m.Lean:
		// The coordinator recomputes bit for bit and compares with the digests this worker
		// committed to: the end state and what it sent need not travel.
		lean := *b
		lean.Lean, lean.StateOut, lean.Sent = true, nil, nil
		b = &lean
	}
	// Written out before this returns: the bundle's end state is the shard's live tensors.
	hint := stateBytes(b.StateIn) + stateBytes(b.StateOut) + 1<<20
	for _, t := range b.Recv {
		hint += int64(len(t.Data))
	}
	for _, t := range b.Sent {
		hint += int64(len(t.T.Data))
	}
	if err := s.spills.takeAudit(m.Step); err != nil {
		s.log.Warn("audit refused", "step", m.Step, "plan", m.PlanVersion, "why", err.Error())
		return nil
	}
	// Capped at twice the hint: the bundle's framing is a small part of it.
	var body uploadBody
	var err error
	if m.Lean && !m.Unapplied {
		// Its start state and traffic stay as they are until the next Clip, which detaches
		// the body (writes it out) if its upload is not over by then (evidence.go).
		var segs [][]byte
		var mb *memBody
		if segs, err = b.Segments(); err == nil {
			if mb, err = newMemBody(segs, 2*hint); err == nil {
				s.trainer.uploads = append(s.trainer.uploads, mb)
				body = mb
			}
		}
	} else {
		body, err = newSpill(hint, 2*hint, b.Write)
	}
	if err != nil {
		s.spills.doneAudit()
		return fmt.Errorf("write the evidence of step %d: %w", m.Step, err)
	}
	s.log.Info("audited: uploading the evidence", "step", m.Step, "plan", m.PlanVersion, "bytes", body.length())
	go func() {
		defer s.spills.doneAudit()
		s.uploadEvidence(ctx, m, body)
	}()
	return nil
}

// evidenceRetryFor bounds how long a worker goes on uploading evidence again: longer than any
// coordinator waits for it (coordinator/uplink.go), so that the coordinator, which answers 409
// once it no longer waits, is the one that ends the tries.
const evidenceRetryFor = time.Hour

// uploadEvidence uploads an audit's evidence, and uploads it again, whole, after backing off,
// as long as the upload fails on the way — a connection lost or cut, a coordinator busy — and
// not on the coordinator's answer: a connection that drops mid-upload must not cost an honest
// worker its audit. It ends with the session (ctx), and closes body.
func (s *session) uploadEvidence(ctx context.Context, m *proto.Audit, body uploadBody) {
	defer body.Close()
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	until := time.Now().Add(evidenceRetryFor)
	for try := 1; ; try++ {
		status, err := s.postEvidence(ctx, m.UploadPath, body)
		switch {
		case err == nil:
			if try > 1 {
				s.log.Info("evidence uploaded", "step", m.Step, "tries", try)
			}
			return
		case ctx.Err() != nil:
			return
		case !retryEvidence(status):
			s.log.Warn("audit upload refused", "step", m.Step, "err", err)
			return
		}
		d := Backoff(try-1, s.cfg.BackoffBase, s.cfg.BackoffMax, r)
		if time.Now().Add(d).After(until) {
			s.log.Warn("audit upload failed; giving up", "step", m.Step, "tries", try, "err", err)
			return
		}
		s.log.Warn("audit upload failed; uploading again", "step", m.Step, "try", try, "err", err, "in", d.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

// retryEvidence says whether an upload that got status (0: no answer) may succeed if tried again.
func retryEvidence(status int) bool {
	switch {
	case status == 0, status == http.StatusRequestTimeout, status == http.StatusTooManyRequests, status >= 500:
		return true
	}
	return false
}

// postEvidence uploads the whole of body to path and returns the coordinator's status (0 when
// none came) with an error unless it is a success.
func (s *session) postEvidence(ctx context.Context, path string, body uploadBody) (int, error) {
	// The spill is read afresh on every try, and no transport may close it between tries; the
	// upload is cut when no byte moves for the stall limit (coordhttp.go), as every request is.
	ctx, touch, stop := watch(ctx, s.stall())
	defer stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(s.cfg.Coordinator, "/")+path, io.NopCloser(&progressReader{r: s.uplink.reader(ctx, body.again()), touch: touch}))
	if err != nil {
		return 0, err
	}
	req.ContentLength = body.length() // not chunked: the coordinator refuses an oversize upload up front
	s.authorize(req)
	resp, err := s.http.Do(req)
	if err != nil {
		return 0, stallErr(ctx, err)
	}
	msg, err := io.ReadAll(io.LimitReader(&progressReader{r: resp.Body, touch: touch}, 1024))
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, fmt.Errorf("POST %s: %s: %s", path, resp.Status, bytes.TrimSpace(msg))
	}
	return resp.StatusCode, stallErr(ctx, err)
}

// Recompute is the auditor's half: it runs r.Worker's training step again from its evidence, on
// dev (nil: the CPU kernels), and returns what the worker should have sent, reported and reached.
// It builds the shard and runner exactly as the worker did from its assignment (buildShard),
// loads the evidence's start state, and runs the runner's own RunStep against a transport that
// serves the evidence's received tensors and captures what is sent; then it applies the update
// with the step's learning rate and clip factor. On the worker's backend the result is the
// worker's bit for bit, if the worker was honest.
//
// It touches no state outside its arguments, so a coordinator may run several at once beside its
// other work. ctx bounds the step.
func Recompute(ctx context.Context, dev model.Device, r *audit.Replay) (*audit.Outcome, error) {
	if r == nil || r.Assign == nil || r.Bundle == nil {
		return nil, errors.New("recompute: no assignment or no evidence")
	}
	if dev == nil {
		dev = model.Host{}
	}
	if r.Bundle.Step != r.Spec.Step || r.Bundle.PlanVersion != r.Spec.PlanVersion {
		return nil, fmt.Errorf("recompute: evidence of step %d plan %d for step %d plan %d",
			r.Bundle.Step, r.Bundle.PlanVersion, r.Spec.Step, r.Spec.PlanVersion)
	}
	spec, err := job.Parse(r.Assign.Spec)
	if err != nil {
		return nil, fmt.Errorf("recompute: the assignment's job: %w", err)
	}
	if want := stepMicroBatches(spec, r.Assign); r.Spec.MicroBatches != want {
		// A worker refuses such a step (session.runStep): there is nothing it could have computed.
		return nil, fmt.Errorf("recompute: step of %d micro-batches, the shard's steps have %d", r.Spec.MicroBatches, want)
	}
	b, err := buildShard(dev, spec, r.Assign, r.Worker)
	if err != nil {
		return nil, fmt.Errorf("recompute: %w", err)
	}
	sh := b.sh
	if err := loadState(sh, r.Bundle.StateIn); err != nil {
		return nil, fmt.Errorf("recompute: the start state: %w", err)
	}
	net := newReplayNet(r.Bundle.Recv)
	b.runner.setNet(net)
	rep, err := b.runner.RunStep(ctx, r.Spec)
	if err != nil {
		return nil, fmt.Errorf("recompute: %w", err)
	}
	// A neighbour of a stage taken over sent the lost stage some boundary tensors before it left,
	// and all of them to the taker; a pool mate's tree nodes sent the lost stage are its own.
	var moved map[string]string
	if tk := r.Spec.Takeover; tk != nil && (r.Assign.Prev == tk.Lost || r.Assign.Next == tk.Lost) {
		moved = map[string]string{tk.Lost: tk.Taker}
	}
	if r.Unapplied {
		return &audit.Outcome{Sent: net.sent, Report: rep, Moved: moved}, nil
	}
	b.runner.Apply(r.Spec.Step, r.LR, r.Clip)
	sh.Pull()
	// The shard is this call's alone and goes with it: its tensors need no copy.
	return &audit.Outcome{Sent: net.sent, Report: rep, StateOut: model.CheckpointTensors(sh.P, sh.Opt),
		Update: audit.Update{T: int(r.Spec.Step) + 1, LR: r.LR, WeightDecay: spec.WeightDecay}, Moved: moved}, nil
}

// loadState loads a shard's whole state — exactly its tensors, no more — and pushes it to the
// device.
func loadState(sh *model.Shard, ts []safetensors.Tensor) error {
	ck := &model.Checkpoint{Cfg: sh.Cfg, Tensors: make(map[string]safetensors.Tensor, len(ts))}
	for _, t := range ts {
		if _, dup := ck.Tensors[t.Name]; dup {
			return fmt.Errorf("tensor %s twice", t.Name)
		}
		ck.Tensors[t.Name] = t
	}
	if want := 3 * len(sh.P.Tensors); len(ts) != want {
		return fmt.Errorf("%d tensors, the shard has %d (parameters and Adam's two moments)", len(ts), want)
	}
	if err := ck.Into(sh.P, sh.Opt); err != nil {
		return err
	}
	sh.Push()
	return nil
}

// replayNet is a recomputation's Transport: it serves the tensors the audited worker received, by
// key, and captures what the runner sends. A tensor the evidence lacks fails at once: nothing else
// will ever deliver it.
type replayNet struct {
	mu   sync.Mutex
	recv map[proto.TensorKey]proto.Tensor
	sent []audit.Sent
}

func newReplayNet(recv []proto.Tensor) *replayNet {
	n := &replayNet{recv: make(map[proto.TensorKey]proto.Tensor, len(recv))}
	for _, t := range recv {
		n.recv[t.Key] = t
	}
	return n
}

// ErrNotInEvidence means a recomputation asked for a tensor the audited worker's evidence does not
// hold: the worker did not receive (or did not commit to) what its step needs.
var ErrNotInEvidence = errors.New("tensor not in the evidence")

func (n *replayNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.sent = append(n.sent, audit.Sent{To: to, T: t})
	return nil
}

func (n *replayNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	t, ok := n.recv[key]
	if !ok {
		return proto.Tensor{}, fmt.Errorf("%w: %v", ErrNotInEvidence, key)
	}
	delete(n.recv, key) // each is received once, as from a mailbox
	return t, nil
}
