package client

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Handover (docs/design.md, "Replicas and synchronisation"): a worker joining a running step-mode
// job takes up a stage's state from a worker of another replica that holds the same blocks at the
// same step — peer to peer over the plan's data plane, not from a checkpoint. The giver keeps its
// stage (Assign.Keep) and sends its state, tensor by tensor in model.CheckpointTensors' order, to
// every worker its Assign lists in Give, before it is Ready; each taker (Assign.From) receives
// exactly those tensors from exactly that worker (admission), fills its new shard with them, and
// commits to the state it took in its Ready, which the coordinator holds against the giver's.
// Replicas of one kernel family hold the same bits at every step, so the taker's state is the one
// a checkpoint of that step would have given it.

// checkHandover refuses a handover the plan around it does not support: the giver (From) or each
// taker (Give) must be a stage of another replica holding the same blocks — a peer this stage
// exchanges gradients with, and so a neighbour of its data plane — in step mode, with no experts on
// hosts (a stage's state then is its blocks' whole state).
func checkHandover(spec job.Spec, a *proto.Assign) error {
	if a.From == nil && len(a.Give) == 0 {
		return nil
	}
	st := a.Shard.Stage
	switch {
	case spec.Outer():
		return errors.New("sync mode \"outer\" hands over no state")
	case st == nil || a.Replica == nil:
		return errors.New("only a stage of a replica hands its state over")
	case len(a.ExpertHosts) > 0:
		return errors.New("a stage with experts on hosts hands over no state")
	}
	twin := func(w string) bool {
		return slices.ContainsFunc(a.Replica.Peers, func(p proto.ReducePeer) bool {
			return p.Worker == w && p.Begin == st.Begin && p.End == st.End
		})
	}
	if f := a.From; f != nil && !twin(f.Worker) {
		return fmt.Errorf("the state's giver %s holds no stage of blocks [%d,%d) in this plan", f.Worker, st.Begin, st.End)
	}
	for _, w := range a.Give {
		if !twin(w) {
			return fmt.Errorf("the state's taker %s holds no stage of blocks [%d,%d) in this plan", w, st.Begin, st.End)
		}
	}
	return nil
}

// stateTensors are the shard's state as handed over: its parameters, then AdamW's moments, in
// model.CheckpointTensors' order — the order audit.StateDigest digests them in.
func stateTensors(sh *model.Shard) []safetensors.Tensor {
	return model.CheckpointTensors(sh.P, sh.Opt)
}

// stateKey names state tensor i of a handover into plan ver at step.
func stateKey(ver uint32, step uint64, i int) proto.TensorKey {
	return proto.StateKey{PlanVersion: ver, Step: step, Tensor: i}.Key()
}

// giveState sends sh's state, which holds step updates, to each of to under plan ver. A taker
// whose link fails is skipped, not the giver's assignment: the giver keeps its own shard either
// way, and a taker that left is the coordinator's to answer (it reshares); only the assignment's
// end (ctx) stops it. It returns the takers it could not reach.
func giveState(ctx context.Context, net Transport, sh *model.Shard, ver uint32, step uint64, to []string) ([]string, error) {
	if len(to) == 0 {
		return nil, nil
	}
	sh.Pull() // the device → the host mirror the state is read from
	state := stateTensors(sh)
	var missed []string
	for _, w := range to {
		for i, t := range state {
			pt, err := rowsTensor(stateKey(ver, step, i), model.F32, t.Data, 1)
			if err != nil {
				return missed, err
			}
			if err := net.Send(ctx, w, pt); err != nil {
				if ctx.Err() != nil {
					return missed, fmt.Errorf("hand the state over to %s: %w", w, err)
				}
				missed = append(missed, w)
				break
			}
		}
	}
	return missed, nil
}

// stateWaits are the receipts a taker posts for its state before its data plane opens, so that
// every tensor goes straight into the shard as it arrives: none waits in the mailbox, whose bound
// is sized for a step's traffic, not for a whole shard's state.
type stateWaits []<-chan proto.Tensor

// expectState posts the receipts of sh's state handed over into plan ver at step.
func expectState(box *Mailbox, sh *model.Shard, ver uint32, step uint64) (stateWaits, error) {
	n := len(stateTensors(sh))
	w := make(stateWaits, n)
	for i := range n {
		ch, err := box.Expect(stateKey(ver, step, i))
		if err != nil {
			return nil, err
		}
		w[i] = ch
	}
	return w, nil
}

// takeState fills sh with the state w receives, checking each tensor's type and size against the
// shard's own, and leaves it on sh's device. gone, when not nil, is closed if the link to the giver
// fails: the state will not come, and the assignment fails at once rather than when the
// coordinator gives up on it.
func takeState(ctx context.Context, w stateWaits, sh *model.Shard, from string, gone <-chan struct{}) error {
	state := stateTensors(sh)
	for i, ch := range w {
		t, err := receiveState(ctx, ch, gone)
		if err != nil {
			return fmt.Errorf("the state from %s (%d of %d tensors taken): %w", from, i, len(w), err)
		}
		dst := state[i].Data
		if t.DType != proto.F32 || len(t.Data) != 4*len(dst) {
			return fmt.Errorf("the state from %s: tensor %d (%s) is %d bytes of %v, want %d of float32", from, i, state[i].Name, len(t.Data), t.DType, 4*len(dst))
		}
		safetensors.DecodeF32(dst, t.Data)
	}
	sh.Push() // the host mirror → the device the shard computes on
	return nil
}

// receiveState waits for the tensor ch delivers. A tensor that has arrived counts even when the
// link failed since (gone), which ends the wait only for one that has not.
func receiveState(ctx context.Context, ch <-chan proto.Tensor, gone <-chan struct{}) (proto.Tensor, error) {
	var t proto.Tensor
	var ok bool
	select {
	case t, ok = <-ch:
	default:
		select {
		case t, ok = <-ch:
		case <-gone:
			return t, errors.New("the link to the giver failed")
		case <-ctx.Done():
			return t, ctx.Err()
		}
	}
	if !ok {
		return t, ErrClosed
	}
	return t, nil
}
