package client

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"slices"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Outer mode across pipeline replicas (job.SyncOuter; model/outer.go is the definition, local's
// outer loop the single-process reference). A replica's stages train their replica's
// micro-batches as steps of their own — clipped by the replica's own norm — and at each outer step
// every stage sends the stages of the other participating replicas that hold its tensors what
// crosses: its θ_r as float32, or with int8 compression its pseudo-gradient's codes and scales.
// Every holder then takes the same outer step (model.Outer.StepGiven) and continues from the new
// global θ. Sending everything to every holder, rather than a reduce-scatter, keeps one holder's
// arithmetic the whole tensor's: with two replicas it moves the same bytes. With a delay
// (job.Sync.Delay) the exchange and the step run in a goroutine while the stage trains on, and the
// stage takes the new θ up τ steps later at a clip factor (takeUpOuter, model.Rebase).

// outerState is a replica's stage's share of the outer optimizer: the global θ of its tensors at
// the last outer step, their outer momentum (and the average's error feedback), and this
// replica's own error feedback.
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
}

// pendingOuter is an outer step taken with a delay (job.Sync.Delay): the stage sent what it gives
// and trains on while a goroutine of its own receives the others' contributions, checks them and
// takes the step into global, V and Err. Nothing else touches those until wait returns: an
// evaluation, a checkpoint and the take-up wait first. Training touches only the shard's θ_r.
type pendingOuter struct {
	step   uint64        // the training step the outer step follows
	takeUp int           // the step after which the stage takes it up (job.Spec.OuterTakeUpAfter)
	snap   *model.Params // θ_r at the outer step, which the take-up keeps the progress since
	done   chan error    // the exchange's outcome, sent once
	err    error
	waited bool
}

// wait blocks until the exchange is over and returns its outcome (every time it is asked).
func (p *pendingOuter) wait() error {
	if !p.waited {
		p.err, p.waited = <-p.done, true
	}
	return p.err
}

// settled is the pending state of a checkpoint taken while an outer step was pending: its global
// part is already the outer step's, so there is nothing left to wait for.
func settled(step uint64, takeUp int, snap *model.Params) *pendingOuter {
	return &pendingOuter{step: step, takeUp: takeUp, snap: snap, waited: true}
}

func newOuterState(specs []model.Spec, spec job.Spec) *outerState {
	y := spec.Sync
	compressed := y.Compress == "int8"
	o := &outerState{outer: model.NewOuter(specs, y.OuterLR, y.OuterMomentum, compressed), global: model.NewParams(specs), spec: spec}
	if compressed {
		o.err = model.NewParams(specs)
	}
	return o
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

// checkGiven refuses a participant's contribution to the outer step — of one tensor, whose
// global θ is g: its θ_q (x, float32) or its pseudo-gradient's values after int8 — that no honest
// replica could have sent: a value that is not finite, or a pseudo-gradient larger than the
// round's AdamW steps can move a parameter from the global θ (audit.OuterBound), chunk by chunk
// (model.OuterChunk) at the chunk's largest |θ|. It runs before anything is applied, so a peer
// sending NaN or 1e30 cannot reach any replica's parameters. It returns the refused chunk, -1 if
// none.
func checkGiven(b audit.OuterBound, name string, g, x []float32) (int, error) {
	for a := 0; a < len(g); a += model.OuterChunk {
		end := min(a+model.OuterChunk, len(g))
		if i, d, limit, ok := b.Check(g[a:end], x[a:end]); !ok {
			return a / model.OuterChunk, fmt.Errorf("%s[%d]: a pseudo-gradient of %g, where the round's AdamW steps from the global θ move a parameter by %g at most", name, a+i, d, limit)
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

// baseNet is the workerNet under the stage's Transport (a step's recorder wraps it: stepNet), or
// nil.
func baseNet(t Transport) *workerNet {
	if s, ok := t.(*stepNet); ok {
		t = s.inner
	}
	w, _ := t.(*workerNet)
	return w
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
						cancel(fmt.Errorf("replica %d's stage %s: %w", q, l.peer.Worker, ErrPeerGone))
					case <-quit:
					}
				}()
			}
		}
	}
	return qctx, func() { close(quit); cancel(nil) }
}

// OuterStep takes the outer step m asks for (see the top of this file). The shard's parameters
// end as the new global θ; its AdamW state is its own.
func (r *StageRunner) OuterStep(ctx context.Context, m *proto.OuterSync) error {
	o, rep := r.Outer, r.Replica
	if o == nil || rep == nil {
		return fmt.Errorf("outer step after step %d: this stage is not in a plan of replicas in outer mode", m.Step)
	}
	if !slices.Contains(m.Participants, rep.Index) {
		return fmt.Errorf("outer step after step %d: replica %d is not among the participants %v", m.Step, rep.Index, m.Participants)
	}
	r.forgetOuter(m)
	if o.pending != nil {
		return fmt.Errorf("outer step after step %d while the one after step %d is not taken up", m.Step, o.pending.step)
	}
	sh := r.Shard
	sh.Pull() // θ_r, from the device
	// With a delay the stage trains on while the exchange runs, so what it gives is a snapshot of
	// θ_r, which the take-up needs as well.
	takeUp := o.spec.OuterTakeUpAfter(int(m.Step))
	theta := sh.P
	if takeUp != int(m.Step) {
		theta = model.NewParams(sh.P.Specs())
		if err := theta.CopyFrom(sh.P); err != nil {
			return err
		}
	}
	compressed := o.outer.Int8
	// What this replica gives: θ_r, or its pseudo-gradient through int8 and back, with the codes
	// and scales to send.
	mine := model.OuterGiven{Theta: theta}
	payload := make(map[string][2][]byte, len(theta.Tensors)) // int8: the tensor's parts
	if compressed {
		mine.Delta = model.NewParams(theta.Specs())
		for ti, t := range theta.Tensors {
			g, e, x := o.global.Tensors[ti].Data, o.err.Tensors[ti].Data, mine.Delta.Tensors[ti].Data
			payload[t.Name] = model.OuterLayout{N: len(g), Int8: true}.EncodeInt8(g, t.Data, x, e)
		}
	}
	if takeUp == int(m.Step) {
		if err := r.exchangeOuter(ctx, m, mine, payload); err != nil {
			return err
		}
		if err := sh.P.CopyFrom(o.global); err != nil {
			return err
		}
		sh.Push()
		return nil
	}
	p := &pendingOuter{step: m.Step, takeUp: takeUp, snap: theta, done: make(chan error, 1)}
	go func() { p.done <- r.exchangeOuter(ctx, m, mine, payload) }()
	o.pending = p
	return nil
}

// takeUpOuter takes up the delayed outer step after step s when it is due (job.Sync.Delay): it
// waits for the exchange and moves θ_r to the new global θ plus the progress made since the
// outer step (model.Rebase). It does nothing at any other step.
func (r *StageRunner) takeUpOuter(s int) error {
	o := r.Outer
	if o == nil || o.pending == nil || o.pending.takeUp != s {
		return nil
	}
	p := o.pending
	if err := p.wait(); err != nil {
		return err
	}
	o.pending = nil
	sh := r.Shard
	sh.Pull()
	if err := model.Rebase(sh.P, o.global, p.snap); err != nil {
		return err
	}
	sh.Push()
	return nil
}

// settleOuter waits for a delayed outer step's exchange, if one runs, so that the global θ is
// the latest outer step's: before an evaluation or a checkpoint.
func (r *StageRunner) settleOuter() error {
	if o := r.Outer; o != nil && o.pending != nil {
		return o.pending.wait()
	}
	return nil
}

// exchangeOuter sends what this replica gives to the other participants' stages holding its
// tensors, receives theirs, verifies their signatures and checks them (checkGiven), and takes the
// outer step into the global θ, V and Err (model.Outer.StepGiven): mine is this replica's
// contribution, payload its int8 parts. What is sent is signed, and what is received verified,
// over the global θ as it stands before the step (package audit, "Outer commitments").
func (r *StageRunner) exchangeOuter(ctx context.Context, m *proto.OuterSync, mine model.OuterGiven, payload map[string][2][]byte) error {
	o, rep, sh := r.Outer, r.Replica, r.Shard
	compressed := o.outer.Int8
	// The global θ's Merkle leaves, tensor by tensor: both what this stage signs and what it
	// verifies are over them. Computed before anything is sent; nothing changes the global θ
	// until StepGiven below.
	base := make(map[string][][32]byte, len(o.global.Tensors))
	for _, t := range o.global.Tensors {
		base[t.Name] = audit.OuterBaseLeaves(t.Data)
	}
	sent := make(chan error, 1)
	go func() {
		signed := map[string][]proto.Tensor{} // each tensor's frames, signed once for every link
		for _, l := range r.links {
			if !slices.Contains(m.Participants, l.peer.Replica) {
				continue
			}
			for _, t := range l.tensors {
				pts, ok := signed[t.name]
				if !ok {
					var err error
					if pts, err = r.signedOuter(m, t, rep.Index, mine.Theta.Get(t.name), payload[t.name], base[t.name]); err != nil {
						sent <- err
						return
					}
					signed[t.name] = pts
				}
				for _, pt := range pts {
					if err := r.Net.Send(ctx, l.peer.Worker, pt); err != nil {
						sent <- fmt.Errorf("outer step: %s to replica %d: %w", t.name, l.peer.Replica, err)
						return
					}
				}
			}
		}
		sent <- nil
	}()
	given := make([]model.OuterGiven, len(m.Participants))
	bound := audit.NewOuterBound(o.spec, int(m.Step), compressed)
	for k, q := range m.Participants {
		if q == rep.Index {
			given[k] = mine
			continue
		}
		theirs := model.NewParams(sh.P.Specs())
		// Each tensor is verified and checked as it arrives, so that what proves a refusal is
		// kept for one tensor at a time.
		qctx, stop := r.fromPartner(ctx, q)
		for ti := range theirs.Tensors {
			t := &theirs.Tensors[ti]
			if err := r.takeOuter(qctx, m, q, bound, o.global.Tensors[ti].Data, t, base[t.Name]); err != nil {
				if qctx.Err() != nil && ctx.Err() == nil {
					err = fmt.Errorf("outer step: %w", context.Cause(qctx))
				}
				stop()
				<-sent
				return err
			}
		}
		stop()
		if compressed {
			given[k].Delta = theirs
		} else {
			given[k].Theta = theirs
		}
	}
	if err := <-sent; err != nil {
		return err
	}
	return o.outer.StepGiven(o.global, given)
}

// signedOuter is what this stage sends of tensor t at outer step m, signed: its frames
// (outerTensors) as they leave — a fault (FaultPoisonOuter) alters them before they are signed,
// as a sender that means it would — and its signature (proto.OuterSigKey; FaultUnsignedOuter
// alters that). base are the global θ's leaves of t.
func (r *StageRunner) signedOuter(m *proto.OuterSync, t reduceTensor, replica int, theta []float32, payload [2][]byte, base [][32]byte) ([]proto.Tensor, error) {
	o := r.Outer
	compressed := o.outer.Int8
	pts := outerTensors(m, t, replica, theta, payload, compressed)
	var parts [2][]byte
	for i := range pts {
		if f, ok := r.Net.(outerAlterer); ok {
			pts[i] = f.alterOuter(pts[i])
		}
		k, err := proto.ParseOuterDeltaKey(pts[i].Key)
		if err != nil {
			return nil, fmt.Errorf("outer step: %s: %w", t.name, err)
		}
		parts[k.Part] = pts[i].Data
	}
	if o.key == nil {
		// Every worker has a key (RunWorker); unsigned, the others would refuse it anyway.
		return nil, fmt.Errorf("outer step: %s: this stage has no key to sign what it gives with", t.name)
	}
	leaves, err := audit.OuterGivenLeaves(t.size, parts, compressed)
	if err != nil {
		return nil, fmt.Errorf("outer step: %s: %w", t.name, err)
	}
	msg := audit.OuterMessage(o.job, m.PlanVersion, m.Step, t.global, replica, compressed, audit.MerkleRoot(base), audit.MerkleRoot(leaves))
	sig := proto.Tensor{Key: proto.OuterSigKey{PlanVersion: m.PlanVersion, Step: m.Step, Tensor: t.global, Replica: replica}.Key(),
		DType: proto.I32, Shape: proto.Shape{proto.OuterSigWords, 1, 1, 1}, Data: ed25519.Sign(o.key, msg)}
	if f, ok := r.Net.(outerAlterer); ok {
		sig = f.alterOuter(sig)
	}
	return append(pts, sig), nil
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

// outerProof is what proves one received tensor: its sender, the global θ's and the received
// chunks' leaves, the int8 parts as they crossed (float32 ones are the received values
// themselves), and the signature.
type outerProof struct {
	sender       string
	tensor       int // in the model
	base, leaves [][32]byte
	parts        [2][]byte
	sig          []byte
}

// evidence is the proof of chunk c: g is the global θ's tensor, x the received values.
func (p outerProof) evidence(c int, g, x []float32, compressed bool) *proto.OuterEvidence {
	e := &proto.OuterEvidence{Sender: p.sender, Tensor: p.tensor, Chunk: c, Signature: p.sig,
		Base: audit.OuterBaseChunk(nil, g, c), BasePath: audit.MerklePath(p.base, c), GivenPath: audit.MerklePath(p.leaves, c)}
	if compressed {
		e.Given = audit.OuterGivenChunk(nil, len(x), p.parts, true, c)
	} else {
		e.Given = audit.OuterBaseChunk(nil, x, c) // θ_q's bits, as they crossed
	}
	return e
}

// takeOuter receives replica q's tensor t at outer step m into t, verifies its signature over
// what crossed and the global θ's leaves base, and checks it against the bound (checkGiven, g
// the global θ's values). A contribution unsigned or beyond the bound is an *outerRefusal, with
// evidence when it was signed.
func (r *StageRunner) takeOuter(ctx context.Context, m *proto.OuterSync, q int, bound audit.OuterBound, g []float32, t *model.Tensor, base [][32]byte) error {
	compressed := r.Outer.outer.Int8
	l := r.linkOf(q, t.Name)
	if l == nil {
		return fmt.Errorf("outer step: no stage of replica %d holds %s", q, t.Name)
	}
	rt := l.tensor(t.Name)
	parts, err := recvOuter(ctx, r.Net, m, rt, q, t.Data, compressed)
	var proof outerProof
	if err == nil {
		proof, err = r.verifyOuter(ctx, m, l, rt, q, parts, base)
	}
	if bad := (*unsigned)(nil); errors.As(err, &bad) {
		return &outerRefusal{replica: q, err: fmt.Errorf("%s: %w", t.Name, err)}
	}
	if err != nil {
		return fmt.Errorf("outer step: %s from replica %d: %w", t.Name, q, err)
	}
	if f, ok := r.Net.(outerAlterer); ok {
		if e := f.accuseOuter(func() *proto.OuterEvidence { return proof.evidence(0, g, t.Data, compressed) }); e != nil {
			return &outerRefusal{replica: q, err: fmt.Errorf("%s: framed (a fault)", t.Name), evidence: e}
		}
	}
	c, err := checkGiven(bound, t.Name, g, t.Data)
	if err != nil {
		return &outerRefusal{replica: q, err: err, evidence: proof.evidence(c, g, t.Data, compressed)}
	}
	return nil
}

// verifyOuter receives the signature of replica q's tensor t at outer step m from its stage l and
// verifies it over parts, as received, and the global θ's leaves base.
func (r *StageRunner) verifyOuter(ctx context.Context, m *proto.OuterSync, l *reduceLink, t reduceTensor, q int, parts [2][]byte, base [][32]byte) (outerProof, error) {
	o := r.Outer
	p := outerProof{sender: l.peer.Worker, tensor: t.global, base: base}
	if o.outer.Int8 {
		p.parts = parts
	}
	pt, err := r.Net.Recv(ctx, proto.OuterSigKey{PlanVersion: m.PlanVersion, Step: m.Step, Tensor: t.global, Replica: q}.Key())
	if err != nil {
		return p, err
	}
	if pt.DType != proto.I32 || len(pt.Data) != ed25519.SignatureSize {
		return p, &unsigned{fmt.Sprintf("a signature of %v, %d bytes", pt.DType, len(pt.Data))}
	}
	if len(l.peer.Key) != ed25519.PublicKeySize {
		return p, &unsigned{fmt.Sprintf("worker %s has no signing key", l.peer.Worker)}
	}
	if p.leaves, err = audit.OuterGivenLeaves(t.size, parts, o.outer.Int8); err != nil {
		return p, err
	}
	p.sig = pt.Data
	msg := audit.OuterMessage(o.job, m.PlanVersion, m.Step, t.global, q, o.outer.Int8, audit.MerkleRoot(base), audit.MerkleRoot(p.leaves))
	if !ed25519.Verify(l.peer.Key, msg, p.sig) {
		return p, &unsigned{fmt.Sprintf("the signature does not verify with worker %s's key over this global θ", l.peer.Worker)}
	}
	return p, nil
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

// outerKey names part of tensor t that replica gives at outer step m.
func outerKey(m *proto.OuterSync, t reduceTensor, replica, part int) proto.TensorKey {
	return proto.OuterDeltaKey{PlanVersion: m.PlanVersion, Step: m.Step, Tensor: t.global, Replica: replica, Part: part}.Key()
}

// outerTensors are the frames of tensor t at outer step m from replica: θ_r as float32, or int8's
// parts (model.OuterLayout).
func outerTensors(m *proto.OuterSync, t reduceTensor, replica int, theta []float32, parts [2][]byte, compressed bool) []proto.Tensor {
	l := model.OuterLayout{N: t.size, Int8: compressed}
	if !compressed {
		return []proto.Tensor{{Key: outerKey(m, t, replica, 0), DType: proto.F32, Shape: proto.Shape{uint32(len(theta)), 1, 1, 1}, Data: proto.AppendFloat32s(nil, theta)}}
	}
	var out []proto.Tensor
	for p := range parts {
		if rows, cols, _ := l.Part(p); rows > 0 {
			out = append(out, proto.Tensor{Key: outerKey(m, t, replica, p), DType: proto.I8, Shape: proto.Shape{uint32(rows), uint32(cols), 1, 1}, Data: parts[p]})
		}
	}
	return out
}

// recvOuter receives replica q's part of tensor t at outer step m into dst: θ_q (float32), or its
// pseudo-gradient decoded from int8 codes and scales. It returns the parts' payloads as they
// crossed, which their signature covers.
func recvOuter(ctx context.Context, net Transport, m *proto.OuterSync, t reduceTensor, q int, dst []float32, compressed bool) (parts [2][]byte, err error) {
	if !compressed {
		pt, err := net.Recv(ctx, outerKey(m, t, q, 0))
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
		pt, err := net.Recv(ctx, outerKey(m, t, q, p))
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
func (r *StageRunner) outerCheckpoint(global bool) ([]safetensors.Tensor, error) {
	if err := r.settleOuter(); err != nil {
		return nil, err
	}
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

// outerRestore loads an outer-mode stage from a checkpoint: the global part, and this replica's
// own when the checkpoint has it — a replica new to the job starts from the global θ with AdamW
// moments and error feedback at zero.
func (r *StageRunner) outerRestore(ck *model.Checkpoint) error {
	o, sh := r.Outer, r.Shard
	if err := ck.IntoOuterGlobal(o.global, o.outer); err != nil {
		return err
	}
	o.pending = nil
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
		snap := model.NewParams(sh.P.Specs())
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
