package client

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// StageRunner runs one pipeline stage's part of each training step: the 1F1B instruction list of
// sched.OneFOneBDepth against a Transport, then — once the coordinator has summed every shard's
// gradient norms — AdamW on the stage's own tensors.
type StageRunner struct {
	// fits, on a replica's stage of a worker that offered a memory bound, checks a run a reroute
	// or a stage takeover widens to micro-batches [first, first+n) against it (widenedFits).
	fits func(first, n int) error

	Shard       *model.Shard // a stage shard: Shard.Stage is set
	Index       int          // this stage's position in the pipeline, 0-based
	NumStages   int          // S
	Prev, Next  string       // neighbour peer ids; "" at the ends of the pipeline
	Net         Transport
	WeightDecay float64
	// Dispatch, when some of the stage's experts live on other peers, exchanges their rows; it is
	// the stage's model.Experts, told which step's tensors to use.
	Dispatch *ExpertDispatch
	// Depth is the plan's pipeline depth (proto.Assign.Depth): micro-batches kept in flight
	// beyond plain 1F1B, to hide link latency. It changes no result, only when the stage waits.
	Depth int
	// Replica, in a plan of several pipeline replicas, is the stage's replica — which
	// micro-batches of each step it computes — and the stages of other replicas it reduces
	// gradients with (client/replica.go); nil for one pipeline. links are computed from it.
	Replica *proto.ReplicaAssign
	links   []reduceLink
	// reroutes is where the session leaves the reroutes of the step in flight (reroute.go); nil
	// where nobody reroutes (a recomputation takes them from the step's spec).
	reroutes *rerouteBox
	cur      *stepRun // the training step in flight, until the next
	// Outer, in sync mode "outer" (client/outer.go), is the stage's share of the outer
	// optimizer: its replica then trains its micro-batches as steps of their own, and OuterStep
	// takes the outer steps.
	Outer *outerState
}

// Keys name the tensors of a step on the wire (tokens and targets: proto.TokensKey and
// proto.TargetsKey). The boundary between stages is named by the first block of the later stage,
// for activations and their gradients alike.
func actKey(st proto.StepSpec, mb, boundary int) proto.TensorKey {
	return proto.StageKey{Kind: proto.KindActivation, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: mb, Block: boundary}.Key()
}

func gradKey(st proto.StepSpec, mb, boundary int) proto.TensorKey {
	return proto.StageKey{Kind: proto.KindActivationGrad, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: mb, Block: boundary}.Key()
}

// RunStep runs the stage's schedule for one step and returns its report: per-tensor ‖g‖², the
// last stage's cross-entropy per micro-batch, each MoE block's balancing loss per micro-batch, and
// where the time went. On error the step is abandoned: activations are dropped and gradients
// must not be applied.
func (r *StageRunner) RunStep(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	if r.Dispatch != nil {
		r.Dispatch.begin(ctx, st)
		r.Dispatch.takeWait() // a failed step's leftovers
	}
	rep, err := r.runStep(ctx, st)
	if err != nil {
		r.cur.end()
		r.cur = nil
		r.reroutes.abort()
		r.Shard.Reset()
		return nil, fmt.Errorf("stage %d step %d: %w", r.Index, st.Step, err)
	}
	return rep, nil
}

func (r *StageRunner) runStep(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	M := st.MicroBatches
	if M < 1 || st.Rows < 1 || r.Depth < 0 {
		return nil, fmt.Errorf("step with %d micro-batches of %d rows at depth %d", M, st.Rows, r.Depth)
	}
	// The stage computes micro-batches [first, first+n) of the step's M: all of them, or its
	// replica's share. Keys, routing and the loss scale use the step's numbering; the stage model
	// numbers them from off less.
	first, n := 0, M
	if r.Replica != nil {
		first, n = r.Replica.First, r.Replica.MicroBatches
		if first+n > M || r.Depth >= n {
			return nil, fmt.Errorf("replica micro-batches [%d,%d) at depth %d in a step of %d", first, first+n, r.Depth, M)
		}
	}
	run := &stepRun{st: st, start: time.Now(), lo: first, hi: first + n, ce: map[int]float64{}, aux: map[int][]float64{}}
	if d, ok := ctx.Deadline(); ok {
		run.until = d
	} else {
		run.until = run.start.Add(time.Hour)
	}
	r.cur = run
	// The stage model's numbering: the step's in step mode, where the replicas' micro-batches
	// make one step's gradient tree; the replica's own in outer mode, where its micro-batches
	// are a step of their own (local's outer loop trains them as a model.Model.TrainStep).
	// In outer mode they are summed in one chain (model.Shard.BeginChain): nobody else computes
	// any of them, so the tree's node buffers would buy nothing.
	var err error
	if r.Outer != nil {
		run.treeM, run.off = n, first
		err = r.Shard.BeginChain(n)
	} else {
		run.treeM = M
		err = r.Shard.BeginGradients(M, first, first+n)
	}
	if err != nil {
		return nil, err
	}
	// A replica's stage exchanges its gradient nodes as they become final, beside the backward.
	if r.Replica != nil && r.Outer == nil && len(r.links) > 0 {
		run.red = r.startReduce(ctx, st)
		defer run.red.close(true) // a failed step's sending stops; after settle, a no-op
		r.Shard.Stage.AfterGroup = func(mb, group int) {
			if run.queueErr == nil {
				run.queueErr = run.red.queue(mb, group)
			}
		}
		defer func() { r.Shard.Stage.AfterGroup = nil }()
	}
	// A stage of a step-mode replica whose plan can take a stage over (its Assign names the pools
	// beside it) keeps what it sends its neighbours for the step — one step's boundary tensors —
	// which a stage takeover sends the lost neighbour's taker again (takeover.go).
	run.rt = &route{prev: r.Prev, next: r.Next}
	if tk := st.Takeover; tk != nil && r.reroutes == nil {
		// A recomputation of a step with a stage takeover: a neighbour of the lost stage sent its
		// taker everything (and the lost stage what it sent before it left, which the audit
		// matches with the taker's copies: audit.Outcome.Moved).
		run.rt.prev, run.rt.next = takerFor(tk, r.Prev), takerFor(tk, r.Next)
	}
	if run.red != nil && r.reroutes != nil && r.Replica != nil && len(r.Replica.PrevPool)+len(r.Replica.NextPool) > 0 {
		// Its resends may outlive the step's own context: a takeover heard just as the stage
		// reported is taken up after (Reroute), until the step is applied or abandoned.
		rctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), run.until)
		run.rt.log, run.rt.ctx, run.rt.cancel, run.rt.net, run.rt.forget, run.rt.box = true, rctx, cancel, r.Net, r.forgetPeer, r.reroutes
		for _, tk := range r.reroutes.attach(st.Step, run.rt) {
			run.rt.redirect(rctx, tk)
		}
		run.red.rt = run.rt
	}
	if err := r.leg(ctx, run, first, n, run.rt); err != nil {
		return nil, err
	}
	if err := r.settle(ctx, run); err != nil {
		return nil, err
	}
	return r.report(run)
}

// stepRun is a training step in flight on the stage, from RunStep to the next: what its report is
// made of and, on a stage of a step-mode replica, what a reroute changes (reroute.go) — the
// micro-batches the stage computes and whom it reduces with.
type stepRun struct {
	st     proto.StepSpec
	start  time.Time
	tm     proto.Timings
	treeM  int       // the micro-batches of the stage model's step: M, or in outer mode the replica's n
	off    int       // a micro-batch's number on the wire less its number in the stage model
	lo, hi int       // the micro-batches computed, on the wire: [lo, hi)
	until  time.Time // the step's deadline here, which a reroute after the report keeps
	// By the stage model's micro-batch: the last stage's cross-entropy, and each MoE block's
	// balancing loss; routed is each MoE block's token counts per expert, summed.
	ce       map[int]float64
	aux      map[int][]float64
	routed   [][]int
	red      *reducer
	queueErr error
	reroutes int    // proto.StepReroutes taken up
	rt       *route // where the stage's own run sends its boundary tensors (takeover.go)
}

// end ends run's resends, if any (nil run: none).
func (run *stepRun) end() {
	if run != nil && run.rt != nil && run.rt.cancel != nil {
		run.rt.cancel()
	}
}

// leg runs the 1F1B schedule over micro-batches [first, first+n) of run's step, sending and
// receiving the boundary tensors through rt: the stage's own run, a run a reroute added, or the
// run of a lost stage this one took over (takeover.go).
func (r *StageRunner) leg(ctx context.Context, run *stepRun, first, n int, rt *route) error {
	s := r.Shard.Stage
	cfg := s.Cfg
	st := run.st
	T, C := cfg.BlockSize, cfg.NEmbd
	tm := &run.tm
	recv := func(key proto.TensorKey, want proto.DType, n int) (proto.Tensor, error) {
		t0 := time.Now()
		t, err := r.Net.Recv(ctx, key)
		tm.WaitNS += int64(time.Since(t0))
		if err != nil {
			return t, err
		}
		if t.DType != want || len(t.Data) != 4*n {
			return t, fmt.Errorf("%v: %v of %d bytes, want %v of %d", key, t.DType, len(t.Data), want, 4*n)
		}
		return t, nil
	}
	// The stage's output and input gradient cross to the neighbours in the job's wire formats,
	// activations forward and gradients backward (client/wire.go).
	wire := s.Wire
	send := func(forward bool, key proto.TensorKey, f model.Format, x []float32) error {
		t, err := packRows(key, f, x, C, st.Rows, T, C)
		if err != nil {
			return err
		}
		t0 := time.Now()
		err = rt.send(ctx, r.Net, forward, t)
		tm.TransferNS += int64(time.Since(t0))
		return err
	}
	recvBoundary := func(key proto.TensorKey, f model.Format) ([]float32, error) {
		t0 := time.Now()
		t, err := r.recvRouted(ctx, rt, key)
		tm.WaitNS += int64(time.Since(t0))
		if err != nil {
			return nil, err
		}
		return unpackRows(t, f, st.Rows*T, C)
	}
	inputs := make([]model.StageInput, n)
	outputs := make([][]float32, n)
	grads := make([][]float32, n)
	scale := 1 / float32(run.treeM)
	N := st.Rows * T
	// A run a reroute added may be shorter than the plan's depth: its warm-up is all of it.
	for _, ins := range sched.OneFOneBDepth(r.Index, r.NumStages, n, min(r.Depth, n-1)) {
		k := ins.MicroBatch
		mb := first + k     // on the wire
		smb := mb - run.off // in the stage model
		switch ins.Op {
		case sched.OpRecvAct:
			x, err := recvBoundary(actKey(st, mb, s.Lo), wire.Activations)
			if err != nil {
				return err
			}
			inputs[k].X = x
		case sched.OpForward:
			in := &inputs[k]
			in.B, in.T, in.Micro = st.Rows, T, run.treeM
			if s.First() {
				t, err := recv(proto.TokensKey(st, mb), proto.I32, N)
				if err != nil {
					return err
				}
				if in.Tokens, err = proto.Int32s(t.Data); err != nil {
					return err
				}
			}
			if s.Last() {
				t, err := recv(proto.TargetsKey(st, mb), proto.I32, N)
				if err != nil {
					return err
				}
				if in.Targets, err = proto.Int32s(t.Data); err != nil {
					return err
				}
			}
			t0 := time.Now()
			out, err := s.Forward(smb, *in)
			tm.ForwardNS += int64(time.Since(t0))
			r.moveExpertWait(&tm.ForwardNS, &tm.WaitNS)
			if err != nil {
				return err
			}
			*in = model.StageInput{} // the stage keeps its own copy
			outputs[k] = out.X
			if s.Last() {
				run.ce[smb] = out.CE
			}
			run.aux[smb] = out.Aux
			if run.routed == nil {
				run.routed = make([][]int, len(out.Routed))
				for i := range run.routed {
					run.routed[i] = make([]int, cfg.NExpert)
				}
			}
			for i, counts := range out.Routed {
				for e, n := range counts {
					run.routed[i][e] += n
				}
			}
		case sched.OpSendAct:
			if err := send(true, actKey(st, mb, s.Hi), wire.Activations, outputs[k]); err != nil {
				return err
			}
			outputs[k] = nil
		case sched.OpRecvGrad:
			g, err := recvBoundary(gradKey(st, mb, s.Hi), wire.Gradients)
			if err != nil {
				return err
			}
			grads[k] = g
		case sched.OpBackward:
			t0 := time.Now()
			// The leaf accumulates in the node buffer it becomes at its fold, not in G to be
			// copied there (model.Shard.LeafInNode): the same bits, one copy fewer.
			r.Shard.LeafInNode(smb)
			dx, err := s.Backward(smb, grads[k], scale)
			tm.BackwardNS += int64(time.Since(t0))
			r.moveExpertWait(&tm.BackwardNS, &tm.WaitNS)
			if err != nil {
				return err
			}
			grads[k] = append(grads[k][:0], dx...) // dx is the stage's scratch: copy before the next backward
			if run.queueErr != nil {
				return run.queueErr
			}
			if err := r.Shard.MicroBatchDone(smb); err != nil {
				return err
			}
		case sched.OpSendGrad:
			if err := send(false, gradKey(st, mb, s.Lo), wire.Gradients, grads[k]); err != nil {
				return err
			}
			grads[k] = nil
		}
	}
	return nil
}

// report is run's report once the stage's gradient is complete: per-tensor ‖g‖², and the losses
// and router counts of the micro-batches it computed, in micro-batch order.
func (r *StageRunner) report(run *stepRun) (*proto.StepReport, error) {
	s := r.Shard.Stage
	cfg := s.Cfg
	st := run.st
	rep := &proto.StepReport{Step: st.Step, PlanVersion: st.PlanVersion, Reroutes: run.reroutes}
	rep.GradSq = r.Shard.GradSquaredNorms()
	if err := deviceErr(r.Shard.Device()); err != nil {
		return nil, err
	}
	lo, hi := run.lo-run.off, run.hi-run.off
	// A GPU stage's MoE statistics waited on the device and came back with the norms, in the
	// step's one read (model.Shard.GradSquaredNorms, Stage.TakeStats).
	for _, d := range s.TakeStats() {
		if d.Block == -1 { // the micro-batch's loss
			if d.MB < lo || d.MB >= hi || !s.Last() {
				return nil, fmt.Errorf("step %d: loss of micro-batch %d out of range", st.Step, d.MB)
			}
			run.ce[d.MB] = d.CE
			continue
		}
		a, ok := run.aux[d.MB]
		if !ok || d.Block >= len(a) || d.Block >= len(run.routed) || len(d.Routed) != len(run.routed[d.Block]) {
			return nil, fmt.Errorf("step %d: statistics of micro-batch %d block %d out of range", st.Step, d.MB, d.Block)
		}
		a[d.Block] = d.Aux
		for e, c := range d.Routed {
			run.routed[d.Block][e] += c
		}
	}
	if s.Last() {
		for smb := lo; smb < hi; smb++ {
			rep.CE = append(rep.CE, run.ce[smb])
		}
	}
	for i, blk := 0, s.Lo; blk < s.Hi; blk++ {
		if !cfg.IsMoE(blk) {
			continue
		}
		ba := proto.BlockAux{Block: blk}
		for smb := lo; smb < hi; smb++ {
			ba.Aux = append(ba.Aux, run.aux[smb][i])
		}
		rep.Aux = append(rep.Aux, ba)
		rep.Routed = append(rep.Routed, proto.BlockRouting{Block: blk, Tokens: slices.Clone(run.routed[i])})
		i++
	}
	rep.Timings = run.tm
	rep.Timings.TotalNS = int64(time.Since(run.start))
	return rep, nil
}

// moveExpertWait moves the time the last Forward or Backward spent waiting for remote experts
// from its compute time to the wait time.
func (r *StageRunner) moveExpertWait(compute, wait *int64) {
	if r.Dispatch == nil {
		return
	}
	w := int64(r.Dispatch.takeWait())
	w = min(w, *compute)
	*compute -= w
	*wait += w
}

// Apply finishes step (0-based) with the coordinator's clip factor: AdamW on the stage's own
// tensors at learning rate lr, then the gradients are cleared for the next step.
func (r *StageRunner) Apply(step uint64, lr float64, clip float32) {
	r.cur.end()
	r.cur = nil
	r.Shard.Apply(int(step)+1, lr, r.WeightDecay, clip)
	r.Shard.ZeroGrads()
}

// deviceErr is the first error of a device that can fail mid-step (WebGPU: a lost device, a
// validation error), nil for the CPU. Such a device fills what it reads back with NaN, so the
// step could not go unnoticed; this names the cause.
func deviceErr(d model.Device) error {
	if err := d.Err(); err != nil {
		return fmt.Errorf("compute device: %w", err)
	}
	return nil
}

// RunEval runs forward passes only over M micro-batches of st.Rows rows (the validation windows):
// activations flow down the pipeline as in training, the last stage reports the cross-entropy of
// each micro-batch, and nothing is accumulated. st.Step should be proto.EvalStep(s).
func (r *StageRunner) RunEval(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	if r.Dispatch != nil {
		r.Dispatch.begin(ctx, st)
	}
	if r.Outer != nil {
		// Outer mode evaluates the global θ of the latest outer step, not the replica's own —
		// with a delay, once its exchange is over.
		if err := r.settleOuter(); err != nil {
			return nil, err
		}
		sh := r.Shard
		sh.Pull()
		own := r.Outer.arena.buffer(slotOwn)
		defer r.Outer.release()
		if err := own.CopyFrom(sh.P); err != nil {
			return nil, err
		}
		if err := sh.P.CopyFrom(r.Outer.global); err != nil {
			return nil, err
		}
		sh.Push()
		defer func() {
			sh.P.CopyFrom(own)
			sh.Push()
		}()
	}
	rep, err := r.runEval(ctx, st)
	// An evaluation's passes are larger than a training micro-batch: what they grew goes
	// (model.Stage.Trim), so the stage holds one or the other, as the planner budgets.
	r.Shard.Stage.Reset()
	r.Shard.Stage.Trim()
	if r.Shard.Experts != nil {
		r.Shard.Experts.Reset()
		r.Shard.Experts.Trim()
	}
	if err != nil {
		return nil, fmt.Errorf("stage %d eval %d: %w", r.Index, proto.TrainingStep(st.Step), err)
	}
	return rep, nil
}

func (r *StageRunner) runEval(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error) {
	s := r.Shard.Stage
	T, C := s.Cfg.BlockSize, s.Cfg.NEmbd
	N := st.Rows * T
	start := time.Now()
	rep := &proto.StepReport{Step: st.Step, PlanVersion: st.PlanVersion, Eval: true}
	for mb := 0; mb < st.MicroBatches; mb++ {
		in := model.StageInput{B: st.Rows, T: T}
		if s.First() {
			t, err := r.Net.Recv(ctx, proto.TokensKey(st, mb))
			if err != nil {
				return nil, err
			}
			if in.Tokens, err = proto.Int32s(t.Data); err != nil {
				return nil, err
			}
		} else {
			t, err := r.Net.Recv(ctx, actKey(st, mb, s.Lo))
			if err != nil {
				return nil, err
			}
			if in.X, err = unpackRows(t, s.Wire.Activations, N, C); err != nil {
				return nil, err
			}
		}
		if s.Last() {
			t, err := r.Net.Recv(ctx, proto.TargetsKey(st, mb))
			if err != nil {
				return nil, err
			}
			if in.Targets, err = proto.Int32s(t.Data); err != nil {
				return nil, err
			}
		}
		if len(in.Tokens) != N && len(in.X) != N*C {
			return nil, fmt.Errorf("micro-batch %d: input of the wrong size", mb)
		}
		out, err := s.Forward(mb, in)
		if err != nil {
			return nil, err
		}
		if s.Last() {
			rep.CE = append(rep.CE, out.CE)
		} else {
			t, err := packRows(actKey(st, mb, s.Hi), s.Wire.Activations, out.X, C, st.Rows, T, C)
			if err != nil {
				return nil, err
			}
			if err := r.Net.Send(ctx, r.Next, t); err != nil {
				return nil, err
			}
		}
		s.Release(mb)
		if r.Shard.Experts != nil {
			r.Shard.Experts.Reset()
		}
	}
	rep.Timings.TotalNS = int64(time.Since(start))
	return rep, nil
}
