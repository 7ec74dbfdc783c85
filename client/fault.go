package client

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Fault injection (SHOAL_FAULT, WorkerConfig.Fault): a worker that cheats or computes wrongly on
// purpose, in one stated way (most kinds on every training step), so that verification can be
// shown to catch it (docs/design.md, "Verification and credit"). A faulty worker commits to what it actually sent,
// reported and holds, as a cheater would have to, so every kind is caught by recomputing an
// audited step or by comparing a commitment with a state the coordinator knows (poison-start:
// the state it handed out; a checkpoint; a replica's twin); none needs the coordinator's help to
// be noticed. Evaluations are left alone.
//
// The honest code calls a conduct at each point where a cheater would act, and the honest
// conduct (honest) changes nothing there; a fault wraps it, overriding the hooks its kind
// misbehaves at and passing the rest on. The hooks sit outside the runners, which an auditor's
// recomputation shares (Recompute): on the tensors going out (faultNet, over the recorder, stepNet),
// on the report coming back and on the update (trainer.step, trainer.apply), on the state
// restored, initialised or kept (newTrainer, assignShard), on the Ready, the checkpoint and the
// audit request (session). The honest path never branches on a fault.

// The fault kinds.
const (
	// FaultFlipBit flips the lowest mantissa bit of the first value of the first float32 tensor
	// (with at least one value) the worker sends in each step: a silent 1-ulp corruption, still
	// finite, that only a bitwise comparison sees.
	FaultFlipBit = "flip-bit"
	// FaultScaleGrad multiplies the shard's parameter gradients by 1+1e-3 before their norms and
	// the update: the reported ‖g‖² of every tensor is (1+1e-3)² times the true one, and AdamW
	// runs on the gradients ×(1+1e-3) (as the clip factor ×(1+1e-3), the same update on any
	// device). Tensors sent are honest.
	FaultScaleGrad = "scale-grad"
	// FaultZeroAct sends zeros in place of every float32 tensor: activations, their gradients,
	// expert rows and replicas' partial gradients. Tokens and targets come from the coordinator.
	FaultZeroAct = "zero-act"
	// FaultReplay computes honestly on the first training step after each assignment, then on
	// every later step sends, under the current step's keys, that first step's payloads of the
	// same keys (where a key's payload has the same size: expert rows vary with routing, and a
	// tensor of the wrong size would fail the step loudly rather than cheat), and reports that
	// first step's losses and ‖g‖². It updates its own state honestly.
	FaultReplay = "replay"
	// FaultStaleWeights never updates: AdamW is skipped at every Clip (the gradients are still
	// cleared), so the shard computes every step from its initial state.
	FaultStaleWeights = "stale-weights"
	// FaultFalseNorm reports the ‖g‖² of one tensor (the one with the largest, the first by name
	// among equals) ×1.5; everything computed, sent and applied is honest.
	FaultFalseNorm = "false-norm"
	// FaultFalseLoss reports every cross-entropy (the last stage) and every balancing loss (a
	// stage with MoE blocks) ×0.9; a shard that reports no loss cannot play it.
	FaultFalseLoss = "false-loss"
	// FaultFalseCheckpoint computes, sends and reports honestly, and uploads checkpoints with the
	// lowest mantissa bit of their first value flipped: a poisoned checkpoint, which every shard
	// would restore from after a failure. The coordinator compares each uploaded shard with the
	// state its worker committed to.
	FaultFalseCheckpoint = "false-checkpoint"
	// FaultPoisonOuter poisons what it sends at outer steps (sync mode "outer"): the first value
	// of each pseudo-gradient payload becomes 1e30 — with int8, the first chunk's scale, so that
	// every code of the chunk stands for up to 1.27e32; without, θ_r's first value. Finite, so
	// that only a bound on what honest AdamW steps can move catches it. Training steps are
	// honest.
	FaultPoisonOuter = "poison-outer"
	// FaultPoisonAverage contributes honestly to the others' segments of an outer step (sync mode
	// "outer"), and poisons the average of its own segment it sends every other holder in the
	// all-gather, as FaultPoisonOuter poisons a contribution — a lying owner: signed, finite, and
	// far beyond what the participants' bound lets their average be.
	FaultPoisonAverage = "poison-average"
	// FaultFalseAccuse sends and trains honestly, and at every outer step (sync mode "outer")
	// refuses the first other replica's contribution, showing as evidence its first chunk with
	// the first value made 1e30 (with int8, the chunk's scale): a liar framing an honest replica.
	FaultFalseAccuse = "false-accuse"
	// FaultUnsignedOuter sends and trains honestly, but signs what it sends at outer steps
	// falsely (one bit of every signature flipped): a refusal of it cannot be proved, only voted.
	FaultUnsignedOuter = "unsigned-outer"
	// FaultPoisonStart multiplies its shard's parameters by poisonFactor right after each restore
	// or initialisation, before its first step, and is honest from then on: every step it computes
	// is the right step from the wrong state, so only the chain of custody (the coordinator knows
	// the state it handed out) sees it.
	FaultPoisonStart = "poison-start"
	// FaultRareCheat is honest except on one step per assignment: the first update it applies
	// after an audit request (proto.Audit) arrives, which it applies with the clip factor
	// ×rareCheatClip. That is the step a predictable audit window leaves safest: the audit just
	// asked was of the step before.
	FaultRareCheat = "rare-cheat"
	// FaultLeaveOnAudit cheats as FaultFlipBit does, and leaves for good when an audit arrives
	// rather than show its evidence: the session ends and RunWorker returns, as a process that
	// exits. Leaving is not a verdict, so the coordinator cannot ban it for the cheat; it rejects
	// its unverified work and replays the job from before it, which undoes the cheat.
	FaultLeaveOnAudit = "leave-on-audit"
	// FaultPoisonKept is honest until the coordinator has it keep its shard across a plan
	// change (proto.Keep): then it scales the kept parameters by poisonFactor and commits to the
	// poisoned state in its Ready, as if it were how the last step ended.
	FaultPoisonKept = "poison-kept"
	// FaultFalseKept keeps its shard honestly across a plan change but commits, in its Ready, to
	// a state it does not hold.
	FaultFalseKept = "false-kept"
	// FaultLeaveInExchange trains honestly and, at its first outer step (sync mode "outer"),
	// sends its contributions to every other participant but its average to the first of them
	// only, then leaves for good without a word: a volunteer lost mid-exchange, after some of the
	// others may have all they need and before the rest do.
	FaultLeaveInExchange = "leave-in-exchange"
	// FaultFalseReroutes computes and sends honestly, and says in every report that the step
	// includes one more reroute (proto.StepReroute) than the coordinator sent: a report of work it
	// was never asked for.
	FaultFalseReroutes = "false-reroutes"
	// FaultLeaveOnGive trains honestly and, when a plan has it hand its stage's state over to a
	// worker that joins (proto.Assign.Give), leaves for good without a word before it sends any:
	// a volunteer lost while a newcomer waits for its state.
	FaultLeaveOnGive = "leave-on-give"
	// FaultLeaveMidStep trains honestly through leaveMidStepAfter training steps of an
	// assignment, and in the next leaves for good without a word as soon as it has sent its
	// first activation or gradient to a neighbour: a volunteer lost mid-step, whose neighbours
	// hold part of what it computed of the step (a stage takeover's case: proto.StageTakeover).
	FaultLeaveMidStep = "leave-mid-step"
	// FaultCheatTakeover is honest except toward a stage takeover (proto.StageTakeover): it
	// flips a low bit of every boundary tensor it sends a worker that is not one of its plan
	// neighbours — as the neighbour of a stage taken over, what it sends the taker (again, and
	// from then on); as the taker, what its run of the lost stage sends that stage's neighbours.
	// Such a step was once left unaudited; its audit bans the cheat.
	FaultCheatTakeover = "cheat-takeover"
	// FaultFalsePace computes, sends and applies honestly, and reports its forward and backward
	// time ×8: it claims a slower machine than it has, to shed micro-batches onto the other
	// replicas when the coordinator shares them by measured pace (coordinator/rebalance.go).
	FaultFalsePace = "false-pace"
	// FaultFalseAveraged trains and exchanges honestly, and says at every outer step that it
	// averaged one segment more than its replica owns (proto.OuterDone.Averaged): a record that
	// would make a replay average that segment otherwise than the run did.
	FaultFalseAveraged = "false-averaged"
)

// leaveMidStepAfter is how many training steps of an assignment FaultLeaveMidStep completes.
const leaveMidStepAfter = 5

// faultKinds are the kinds in the order help texts list them, with what each does in a few words.
var faultKinds = []struct{ kind, does string }{
	{FaultFlipBit, "flips a low mantissa bit of one tensor sent each step"},
	{FaultScaleGrad, "scales its gradients by 1+1e-3 before the norms and the update"},
	{FaultZeroAct, "sends zeros instead of every float32 tensor"},
	{FaultReplay, "resends the first step's tensors, losses and norms on every later step"},
	{FaultStaleWeights, "never applies an update"},
	{FaultFalseNorm, "reports one tensor's gradient norm ×1.5"},
	{FaultFalseLoss, "reports its losses ×0.9"},
	{FaultFalseCheckpoint, "uploads checkpoints with one bit flipped"},
	{FaultPoisonOuter, "sends a pseudo-gradient of 1e30 at every outer step"},
	{FaultPoisonAverage, "sends an average of 1e30 for its segment of every outer step"},
	{FaultFalseAccuse, "refuses an honest outer-step contribution with forged evidence"},
	{FaultUnsignedOuter, "signs its outer-step contributions falsely"},
	{FaultPoisonStart, "scales its shard ×3 before its first step, then trains honestly"},
	{FaultRareCheat, "cheats on one update only: the first after an audit request"},
	{FaultLeaveOnAudit, "flips a bit as flip-bit does, and leaves for good when an audit arrives"},
	{FaultPoisonKept, "scales a shard it keeps across a plan change ×3, and commits to it"},
	{FaultFalseKept, "commits to a state it does not hold when it keeps its shard across a plan change"},
	{FaultLeaveInExchange, "leaves without a word in the middle of its first outer step's exchange"},
	{FaultFalseReroutes, "claims in every report a reroute that was never sent"},
	{FaultLeaveOnGive, "leaves without a word when a plan has it hand its state to a newcomer"},
	{FaultLeaveMidStep, "leaves without a word in its sixth training step, once it sent a neighbour one tensor"},
	{FaultCheatTakeover, "flips a bit of each boundary tensor it sends beyond its plan neighbours (a stage takeover's)"},
	{FaultFalsePace, "reports its compute time ×8"},
	{FaultFalseAveraged, "claims at every outer step to have averaged a segment it does not own"},
}

// FaultKinds lists the kinds WorkerConfig.Fault (SHOAL_FAULT) accepts.
func FaultKinds() []string {
	var ks []string
	for _, k := range faultKinds {
		ks = append(ks, k.kind)
	}
	return ks
}

// faultDoes says what kind does, "" for an unknown kind.
func faultDoes(kind string) string {
	for _, k := range faultKinds {
		if k.kind == kind {
			return k.does
		}
	}
	return ""
}

// CheckFault returns an error naming the kinds when kind is neither "" (honest) nor one of them.
func CheckFault(kind string) error {
	if kind == "" || faultDoes(kind) != "" {
		return nil
	}
	return fmt.Errorf("SHOAL_FAULT=%q is not a fault kind: want one of %s", kind, strings.Join(FaultKinds(), ", "))
}

// errLeftOnAudit ends a worker that plays FaultLeaveOnAudit, for good; errLeftInExchange one
// that plays FaultLeaveInExchange; errLeftOnGive one that plays FaultLeaveOnGive.
var (
	errLeftOnAudit    = errors.New("left rather than show the evidence of an audited step (SHOAL_FAULT=" + FaultLeaveOnAudit + ")")
	errLeftInExchange = errors.New("left in the middle of an outer step's exchange (SHOAL_FAULT=" + FaultLeaveInExchange + ")")
	errLeftOnGive     = errors.New("left rather than hand its state to a newcomer (SHOAL_FAULT=" + FaultLeaveOnGive + ")")
	errLeftMidStep    = errors.New("left in the middle of a training step (SHOAL_FAULT=" + FaultLeaveMidStep + ")")
)

// give: FaultLeaveOnGive leaves rather than hand its state to takers.
func (f *fault) give(takers []string) error {
	if f.kind == FaultLeaveOnGive && len(takers) > 0 {
		return errLeftOnGive
	}
	return nil
}

// gradScale is scale-grad's factor, and the other kinds' falsifications.
const (
	gradScale     = 1 + 1e-3
	falseNormMult = 1.5
	falseLossMult = 0.9
	falsePaceMult = 8
	poisonFactor  = 3
	rareCheatClip = 2
)

// conduct is how a worker behaves where the protocol trusts it: one hook for each point where a
// worker could cheat. Every hook of the honest conduct (honest) changes nothing; a SHOAL_FAULT's
// (fault) wraps it. One conduct serves one assignment, from the session's executor.
type conduct interface {
	// wrap returns the Transport the shard's runner sends through, net being the honest one.
	wrap(net Transport) Transport
	// begin and stepDone bracket a training step; stepDone may alter the report of a step that
	// ended well (ok) before anything commits to it.
	begin()
	stepDone(rep *proto.StepReport, ok bool)
	// update applies training step step's update to r's shard, with the coordinator's clip
	// factor clip.
	update(r shardRunner, step uint64, lr float64, clip float32)
	// started is told of a shard's state just restored or initialised, kept of one kept across a
	// plan change (proto.Keep): before anything commits to it.
	started(sh *model.Shard)
	kept(sh *model.Shard)
	// readyState is the state digest a Ready carries for a kept shard whose true digest is d.
	readyState(d string) string
	// checkpoint returns the tensors a checkpoint of ts writes, sharing nothing it changes with ts.
	checkpoint(ts []safetensors.Tensor) []safetensors.Tensor
	// audited is told that the coordinator asks the evidence of a step (proto.Audit); an error
	// ends the worker rather than answer.
	audited(m *proto.Audit) error
	// give is told that a plan has the worker hand its kept state to takers (proto.Assign.Give),
	// before it sends any; an error ends the worker rather than give.
	give(takers []string) error
	// idle says why the conduct cannot misbehave on the shard r runs, "" when it can (or is
	// honest).
	idle(r shardRunner) string
	// neighbours is told a stage's plan neighbours, before its first step.
	neighbours(prev, next string)
	// averaged is what an OuterDone says of the segments the stage averaged, av in truth.
	averaged(av []proto.SegmentAveraged) []proto.SegmentAveraged
}

// honest is the conduct of a worker that follows the protocol: it changes nothing.
type honest struct{}

func (honest) wrap(net Transport) Transport     { return net }
func (honest) begin()                           {}
func (honest) stepDone(*proto.StepReport, bool) {}
func (honest) started(*model.Shard)             {}
func (honest) kept(*model.Shard)                {}
func (honest) readyState(d string) string       { return d }
func (honest) audited(*proto.Audit) error       { return nil }
func (honest) give([]string) error              { return nil }
func (honest) idle(shardRunner) string          { return "" }
func (honest) neighbours(string, string)        {}
func (honest) averaged(av []proto.SegmentAveraged) []proto.SegmentAveraged {
	return av
}
func (honest) checkpoint(ts []safetensors.Tensor) []safetensors.Tensor { return ts }
func (honest) update(r shardRunner, step uint64, lr float64, clip float32) {
	r.Apply(step, lr, clip)
}

// newConduct is the conduct of a worker playing fault kind for a new assignment: honest for "".
func newConduct(kind string) (conduct, error) {
	f, err := newFault(kind)
	if f == nil || err != nil {
		return honest{}, err
	}
	return f, nil
}

// fault is one assignment's misbehaviour: kind, and what kind needs to remember across steps. It
// wraps the honest conduct, which does what kind leaves alone.
type fault struct {
	honest
	kind string

	// mu guards what a training step's sends change (faultNet.Send: a stage's sends and its
	// experts' may run at once), and on.
	mu sync.Mutex
	on bool // in a training step: its tensors are altered

	flipped bool // flip-bit: this step's bit is flipped

	// replay: the first step's payloads by proto.KeyID, and its report; both nil until it ends
	// well. recording gathers the payloads during that first step.
	payloads  map[string][]byte
	first     *proto.StepReport
	recording map[string][]byte

	// rare-cheat: an audit request arrived (armed), and the one cheated update is spent (cheated).
	armed, cheated bool

	steps int // training steps begun under this assignment (leave-mid-step)

	prev, next string // the stage's plan neighbours (cheat-takeover)
}

// newFault makes the state of a fault of kind for a new assignment; nil for "" (honest).
func newFault(kind string) (*fault, error) {
	if kind == "" {
		return nil, nil
	}
	if err := CheckFault(kind); err != nil {
		return nil, err
	}
	return &fault{kind: kind}, nil
}

// wrap puts faultNet between the runner and net: what the fault alters is what net records and
// sends.
func (f *fault) wrap(net Transport) Transport { return &faultNet{Transport: net, f: f} }

// faultNet is the Transport a faulty worker's runner sends through: during a training step the
// fault alters each tensor before the honest Transport under it (the recorder, which commits to
// what actually leaves) sends it; at outer steps it alters, or frames, as the fault says
// (outerAlterer). Evaluations, and what it receives, pass untouched.
type faultNet struct {
	Transport
	f *fault
}

func (n *faultNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	n.f.mu.Lock()
	if n.f.on && !outerFrame(t.Key) {
		t = n.f.send(t)
	}
	boundary := t.Key.Kind == proto.KindActivation || t.Key.Kind == proto.KindActivationGrad
	leave := n.f.kind == FaultLeaveMidStep && n.f.on && n.f.steps > leaveMidStepAfter && boundary
	// Not only while on: a takeover that reaches a stage after it reported the step is taken up
	// in the executor (StageRunner.Reroute), outside the step's begin and stepDone. No other
	// boundary tensor goes beyond the plan's neighbours (an evaluation runs through them).
	if n.f.kind == FaultCheatTakeover && boundary && to != n.f.prev && to != n.f.next && len(t.Data) > 0 {
		t.Data = append([]byte(nil), t.Data...)
		t.Data[0] ^= 1 // little-endian: the first value's lowest mantissa bit
	}
	n.f.mu.Unlock()
	if err := n.Transport.Send(ctx, to, t); err != nil || !leave {
		return err
	}
	return errLeftMidStep
}

func (n *faultNet) unwrap() Transport { return n.Transport }

// alterOuter alters what the stage gives at an outer step, before it is signed (FaultPoisonOuter;
// outer steps run outside training steps).
func (n *faultNet) alterOuter(t proto.Tensor) proto.Tensor { return n.f.sendOuter(t) }

// accuseOuter is forged evidence against the sender of an accepted outer-step contribution, made
// from the honest evidence (FaultFalseAccuse); nil when the worker is not framing.
func (n *faultNet) accuseOuter(honest func() *proto.OuterEvidence) *proto.OuterEvidence {
	return n.f.accuseOuter(honest)
}

// leavesInExchange says whether the worker plays FaultLeaveInExchange.
func (n *faultNet) leavesInExchange() bool { return n.f.kind == FaultLeaveInExchange }

// begin starts a training step.
func (f *fault) begin() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.on, f.flipped = true, false
	f.steps++
	if f.kind == FaultReplay && f.first == nil {
		f.recording = map[string][]byte{}
	}
}

// send alters a tensor on its way out of a training step (faultNet.Send, under mu). It never
// writes into t.Data (the runner's), only replaces it.
func (f *fault) send(t proto.Tensor) proto.Tensor {
	switch f.kind {
	case FaultFlipBit, FaultLeaveOnAudit:
		if !f.flipped && t.DType != proto.I32 && len(t.Data) >= 4 {
			t.Data = append([]byte(nil), t.Data...)
			// Little-endian: the lowest mantissa bit of the first value (of an I8 tensor, the
			// first row's scale); the exponent, the sign, and so validity, stay.
			t.Data[0] ^= 1
			f.flipped = true
		}
	case FaultZeroAct:
		if t.DType != proto.I32 { // all zero bytes are zeros in every float format, I8 included
			t.Data = make([]byte, len(t.Data))
		}
	case FaultReplay:
		k := proto.KeyID(t.Key)
		if f.first == nil {
			f.recording[k] = t.Data
		} else if p, ok := f.payloads[k]; ok && len(p) == len(t.Data) {
			t.Data = p
		}
	}
	return t
}

// sendOuter alters a tensor sent at an outer step (FaultPoisonOuter: its payload, before it is
// signed; FaultPoisonAverage: the payload of the average it sends as a segment's owner;
// FaultUnsignedOuter: its signature); others pass untouched.
func (f *fault) sendOuter(t proto.Tensor) proto.Tensor {
	// The signature itself is in a batch's frame; beside each segment goes only its place.
	sk, err := proto.ParseOuterSigKey(t.Key)
	sig := err == nil && sk.Batch
	average := false
	if k, err := proto.ParseOuterDeltaKey(t.Key); err == nil {
		average = k.Part >= proto.OuterAveragePart
	}
	switch {
	case (f.kind == FaultPoisonOuter || f.kind == FaultPoisonAverage && average) && t.Key.Kind == proto.KindOuterDelta && len(t.Data) >= 4:
		t.Data = append([]byte(nil), t.Data...)
		binary.LittleEndian.PutUint32(t.Data, math.Float32bits(1e30))
	case f.kind == FaultUnsignedOuter && sig && len(t.Data) > 0:
		t.Data = append([]byte(nil), t.Data...)
		t.Data[0] ^= 1
	}
	return t
}

// accuseOuter makes the honest evidence of a contribution this stage accepted into evidence that
// frames its sender (FaultFalseAccuse); nil for any other fault.
func (f *fault) accuseOuter(honest func() *proto.OuterEvidence) *proto.OuterEvidence {
	if f.kind != FaultFalseAccuse {
		return nil
	}
	e := honest()
	e.Given = append([]byte(nil), e.Given...)
	binary.LittleEndian.PutUint32(e.Given, math.Float32bits(1e30))
	return e
}

// stepDone ends a training step, and alters its report if it ended well (ok), before it commits
// to it; replay remembers its first such step.
func (f *fault) stepDone(rep *proto.StepReport, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.on = false
	if !ok {
		f.recording = nil // a failed first step is no step to replay
		return
	}
	switch f.kind {
	case FaultScaleGrad:
		for n, v := range rep.GradSq {
			rep.GradSq[n] = v * gradScale * gradScale
		}
	case FaultFalseNorm:
		names := make([]string, 0, len(rep.GradSq))
		for n := range rep.GradSq {
			names = append(names, n)
		}
		sort.Strings(names)
		pick := ""
		for _, n := range names {
			if pick == "" || rep.GradSq[n] > rep.GradSq[pick] {
				pick = n
			}
		}
		if pick != "" {
			if rep.GradSq[pick] == 0 {
				rep.GradSq[pick] = 1 // ×1.5 would leave a zero norm true
			} else {
				rep.GradSq[pick] *= falseNormMult
			}
		}
	case FaultFalseReroutes:
		rep.Reroutes++
	case FaultFalsePace:
		rep.Timings.ForwardNS *= falsePaceMult
		rep.Timings.BackwardNS *= falsePaceMult
	case FaultFalseLoss:
		for i := range rep.CE {
			rep.CE[i] *= falseLossMult
		}
		for _, a := range rep.Aux {
			for j := range a.Aux {
				a.Aux[j] *= falseLossMult
			}
		}
	case FaultReplay:
		if f.first == nil {
			f.payloads, f.recording = f.recording, nil
			f.first = &proto.StepReport{CE: slices.Clone(rep.CE), GradSq: maps.Clone(rep.GradSq), Aux: cloneAux(rep.Aux)}
			return
		}
		rep.CE, rep.GradSq, rep.Aux = slices.Clone(f.first.CE), maps.Clone(f.first.GradSq), cloneAux(f.first.Aux)
	}
}

// update skips the update (FaultStaleWeights), or alters its clip factor (clip).
func (f *fault) update(r shardRunner, step uint64, lr float64, clip float32) {
	if f.kind == FaultStaleWeights {
		r.shard().ZeroGrads() // the update skipped, the gradients cleared as after one
		return
	}
	f.honest.update(r, step, lr, f.clip(clip))
}

// clip is the clip factor the shard's update runs with.
func (f *fault) clip(c float32) float32 {
	switch {
	case f.kind == FaultScaleGrad:
		return c * gradScale
	case f.kind == FaultRareCheat && f.armed && !f.cheated:
		f.cheated = true
		return c * rareCheatClip
	}
	return c
}

// audited leaves rather than show the evidence (FaultLeaveOnAudit), or notes an audit request of
// an applied step (rare-cheat arms on it).
func (f *fault) audited(m *proto.Audit) error {
	switch {
	case f.kind == FaultLeaveOnAudit:
		return errLeftOnAudit
	case f.kind == FaultRareCheat && !m.Unapplied:
		f.armed = true
	}
	return nil
}

// started alters a shard's state just restored or initialised, before anything commits to it
// (FaultPoisonStart): its parameters ×poisonFactor, on the host and the device.
func (f *fault) started(sh *model.Shard) {
	if f.kind == FaultPoisonStart {
		poisonShard(sh)
	}
}

// kept plays the fault on a shard kept across a plan change (proto.Keep), before anything
// commits to its state (FaultPoisonKept).
func (f *fault) kept(sh *model.Shard) {
	if f.kind == FaultPoisonKept {
		poisonShard(sh)
	}
}

// poisonShard scales sh's parameters by poisonFactor.
func poisonShard(sh *model.Shard) {
	for _, t := range sh.P.Tensors {
		for i := range t.Data {
			t.Data[i] *= poisonFactor
		}
	}
	sh.Push()
}

// averaged adds a segment after the last (false-averaged).
func (f *fault) averaged(av []proto.SegmentAveraged) []proto.SegmentAveraged {
	if f.kind != FaultFalseAveraged {
		return av
	}
	next := 0
	if len(av) > 0 {
		next = av[len(av)-1].Segment + 1
	}
	return append(slices.Clone(av), proto.SegmentAveraged{Segment: next})
}

// readyState is the state digest a Ready carries for a kept shard whose true digest is d.
func (f *fault) readyState(d string) string {
	if f.kind != FaultFalseKept || d == "" {
		return d
	}
	b := []byte(d)
	if b[0] == 'A' {
		b[0] = 'B'
	} else {
		b[0] = 'A'
	}
	return string(b)
}

// neighbours keeps a stage's plan neighbours (cheat-takeover).
func (f *fault) neighbours(prev, next string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.prev, f.next = prev, next
}

// idle says why the fault cannot misbehave on the shard r runs, "" when it can.
func (f *fault) idle(r shardRunner) string {
	sends := true
	loss := false
	switch r := r.(type) {
	case *StageRunner:
		sends = r.NumStages > 1 || r.Dispatch != nil
		loss = r.Shard.Stage.Last()
		for blk := r.Shard.Stage.Lo; blk < r.Shard.Stage.Hi; blk++ {
			loss = loss || r.Shard.Cfg.IsMoE(blk)
		}
	}
	switch {
	case !sends && (f.kind == FaultFlipBit || f.kind == FaultZeroAct || f.kind == FaultLeaveOnAudit):
		return "the shard sends no tensors"
	case !loss && f.kind == FaultFalseLoss:
		return "the shard reports no loss"
	case f.kind == FaultPoisonOuter || f.kind == FaultFalseAccuse || f.kind == FaultUnsignedOuter:
		if r, ok := r.(*StageRunner); !ok || r.Outer == nil {
			return "the shard takes no outer steps"
		}
	}
	return ""
}

// checkpoint alters a checkpoint's tensors before they are written (FaultFalseCheckpoint): it
// returns the tensors to write, sharing nothing it changes with the shard.
func (f *fault) checkpoint(ts []safetensors.Tensor) []safetensors.Tensor {
	if f.kind != FaultFalseCheckpoint {
		return ts
	}
	out := slices.Clone(ts)
	for i, t := range out {
		if len(t.Data) > 0 {
			d := slices.Clone(t.Data)
			d[0] = math.Float32frombits(math.Float32bits(d[0]) ^ 1)
			out[i].Data = d
			break
		}
	}
	return out
}

func cloneAux(as []proto.BlockAux) []proto.BlockAux {
	out := make([]proto.BlockAux, len(as))
	for i, a := range as {
		out[i] = proto.BlockAux{Block: a.Block, Aux: slices.Clone(a.Aux)}
	}
	return out
}
