package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/audit"
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

// checkHandover refuses a handover the plan around it does not support. In a plan of replicas a
// giver or taker that holds a stage of it must hold the blocks it gives or takes — a peer this
// stage exchanges gradients (or outer steps) with, never a pipeline neighbour of its own replica.
// A giver may also be a worker the plan leaves out, which hands its stage over and stands by
// (proto.Assign.Standby), as may a single pipeline's: the coordinator names it, admission takes
// the state from it alone, and the taker's Ready commits to what it took, which the coordinator
// holds against the giver's. Experts on hosts are no obstacle: every replica's stage of the same
// blocks routes to the same hosts (the plan's ExpertHosts), so giver and taker build the same
// shard without them and its state is the same tensors; the hosts keep theirs (proto.Keep) and
// serve the taker's replica too.
func checkHandover(spec job.Spec, a *proto.Assign) error {
	if len(a.From) == 0 && len(a.Give) == 0 {
		return nil
	}
	st := a.Shard.Stage
	if st == nil {
		return errors.New("only a stage hands its state over")
	}
	if a.Replica == nil {
		if spec.Outer() {
			return errors.New("in sync mode \"outer\" only a replica's stage hands its state over")
		}
		return nil // a single pipeline's stage, or a standby's: the plan has no twins to check
	}
	// holds reports whether w holds blocks [b, e) in this plan, or no stage of it that this one
	// sees (a holder the plan leaves out, or another replica's stage of other tensors).
	holds := func(w string, b, e int) bool {
		if w == a.Prev || w == a.Next {
			return false
		}
		i := slices.IndexFunc(a.Replica.Peers, func(p proto.ReducePeer) bool { return p.Worker == w })
		return i < 0 || a.Replica.Peers[i].Begin <= b && e <= a.Replica.Peers[i].End
	}
	for _, f := range a.From {
		if !holds(f.Worker, f.Begin, f.End) {
			return fmt.Errorf("the state's giver %s holds a stage without blocks [%d,%d) in this plan", f.Worker, f.Begin, f.End)
		}
	}
	for _, g := range a.Give {
		if !slices.ContainsFunc(a.Replica.Peers, func(p proto.ReducePeer) bool {
			return p.Worker == g.Worker && p.Begin <= g.Begin && g.End <= p.End
		}) {
			return fmt.Errorf("the state's taker %s holds no stage with blocks [%d,%d) in this plan", g.Worker, g.Begin, g.End)
		}
	}
	return nil
}

// handoverOnly reports whether a's only traffic with peer p is a handover of state — p gives this
// worker blocks of its stage (From) or takes them (Give) and is no neighbour of the plan
// otherwise: a standby giver, or its taker. Once the state has crossed nothing waits on that
// link, so its failure is contained (RTCConfig.Contained) and the taker closes it.
func handoverOnly(a *proto.Assign, p string) bool {
	if !slices.Contains(proto.Givers(a.From), p) && !slices.Contains(proto.Takers(a.Give), p) {
		return false
	}
	if p == a.Prev || p == a.Next {
		return false
	}
	for _, h := range a.ExpertHosts {
		if slices.Contains(h.Workers, p) {
			return false
		}
	}
	return a.Replica == nil || !slices.ContainsFunc(a.Replica.Peers, func(q proto.ReducePeer) bool { return q.Worker == p })
}

// In outer mode (job.SyncOuter) the replicas' own states differ — each its θ_r, its AdamW — and
// what they share is the global θ of the last outer step and the outer momentum, which every
// holder keeps alike. A replica that joins a running job takes those from a holder of its
// stage's blocks and starts as a replica new to the job does from a checkpoint: θ_r the global
// θ, AdamW's moments and its error feedback zero (StageRunner.outerRestore). Every holder,
// giver, keeper and taker alike, restarts the average's error feedback (model.Outer.Grown), which
// between outer steps no one holds whole.

// handoverTensors are what a handover of sh carries, in order: in step mode its state, parameters
// then AdamW's moments (model.CheckpointTensors' order, the order audit.StateDigest digests them
// in); in outer mode (o not nil) the global θ, then the outer momentum.
func handoverTensors(sh *model.Shard, o *outerState) []safetensors.Tensor {
	if o == nil {
		return model.CheckpointTensors(sh.P, sh.Opt)
	}
	var out []safetensors.Tensor
	for _, ps := range []*model.Params{o.global, o.outer.V} {
		for _, t := range ps.Tensors {
			out = append(out, safetensors.Tensor{Name: t.Name, Shape: t.Shape, Data: t.Data})
		}
	}
	return out
}

// handoverSizes are the values of each tensor a handover of sh carries (handoverTensors), before
// the taker holds any of them: the sizes its admission allows.
func handoverSizes(spec job.Spec, sh *model.Shard) []int {
	var out []int
	if spec.Outer() {
		for range 2 {
			for _, t := range sh.P.Tensors {
				out = append(out, len(t.Data))
			}
		}
		return out
	}
	for _, t := range model.CheckpointTensors(sh.P, sh.Opt) {
		out = append(out, len(t.Data))
	}
	return out
}

// handoverNumbers are, for each tensor a handover of sh carries (handoverSizes' order), its
// number on the wire (proto.StateKey.Tensor: its part and its index among the whole model's
// tensors, which a giver and a taker of other blocks share) and its block (model.Config.BlockOf),
// by which a stage's state comes from several givers.
func handoverNumbers(spec job.Spec, sh *model.Shard) (nums, blocks []int, err error) {
	n := len(sh.P.Tensors)
	parts := len(handoverSizes(spec, sh)) / max(n, 1)
	index := sh.Cfg.SpecIndex()
	nums, blocks = make([]int, parts*n), make([]int, parts*n)
	for i := range nums {
		name := sh.P.Tensors[i%n].Name
		k, ok := index[name]
		b, okb := sh.Cfg.BlockOf(name)
		if !ok || !okb {
			return nil, nil, fmt.Errorf("the shard's tensor %s is not the model's", name)
		}
		nums[i], blocks[i] = (i/n)*len(index)+k, b
	}
	return nums, blocks, nil
}

// giverOf is the part of from (Assign.From) that gives block b, nil for none.
func giverOf(from []proto.Handover, b int) *proto.Handover {
	for i := range from {
		if from[i].Begin <= b && b < from[i].End {
			return &from[i]
		}
	}
	return nil
}

// grownState is the state an outer-mode taker starts from once it holds the global θ and the
// momentum its giver handed over: θ_r the global θ, AdamW's moments and its error feedback zero,
// the average's error feedback restarted.
func (o *outerState) grown(sh *model.Shard) error {
	if err := sh.P.CopyFrom(o.global); err != nil {
		return err
	}
	sh.Opt.M.Zero()
	sh.Opt.V.Zero()
	if o.err != nil {
		o.err.Zero()
	}
	o.outer.Grown()
	o.pending = nil
	return nil
}

// gaveDigest is the digest of the state a taker of this stage's global θ starts from (grown):
// the global θ with zero moments, as the taker's Ready names it; and the value hash of each tensor
// of the global θ (proto.Ready.Sums), from which, with zero moments, the coordinator composes the
// state of a taker of several givers. The moments are one zero buffer of the largest tensor's
// size, not two copies of the stage's parameters.
func (o *outerState) gaveDigest() (string, []proto.KeyDigest) {
	ts := model.CheckpointLayout(o.global.Specs())
	largest := 0
	for _, t := range o.global.Tensors {
		largest = max(largest, len(t.Data))
	}
	zero := make([]float32, largest)
	for i := range ts {
		if i < len(o.global.Tensors) {
			ts[i].Data = o.global.Tensors[i].Data
		} else {
			ts[i].Data = zero[:o.global.Tensors[i%len(o.global.Tensors)].Size()]
		}
	}
	sums := audit.TensorSums(ts)
	named := make(map[string]string, len(sums))
	for _, d := range sums {
		named[d.Key] = d.Digest
	}
	d, err := audit.ComposeState(ts, named)
	if err != nil {
		panic("client: the given state's digest: " + err.Error()) // sums are of ts: cannot happen
	}
	return d, sums[:len(o.global.Tensors)]
}

// stateKey names state tensor i of a handover into plan ver at step.
func stateKey(ver uint32, step uint64, i int) proto.TensorKey {
	return proto.StateKey{PlanVersion: ver, Step: step, Tensor: i}.Key()
}

// giveState sends sh's state, which holds step updates, to each taker of to under plan ver: the
// tensors of the blocks its gift names. A taker whose link fails is skipped, not the giver's
// assignment: the giver keeps its own shard either way, and a taker that left is the
// coordinator's to answer (it reshares); only the assignment's end (ctx) stops it. It returns the
// takers it could not reach, each with why.
//
// In outer mode only the global θ goes before the giver is Ready: the outer momentum, which
// nobody reads before the next outer step, follows from a copy while everyone trains (a
// goroutine; takeState's taker waits for it only where it reads it), so a grow holds the job
// for half the bytes.
func giveState(ctx context.Context, net Transport, spec job.Spec, sh *model.Shard, o *outerState, ver uint32, step uint64, to []proto.Gift) ([]string, error) {
	if len(to) == 0 {
		return nil, nil
	}
	nums, blocks, err := handoverNumbers(spec, sh)
	if err != nil {
		return nil, err
	}
	sh.Pull() // the device → the host mirror the state is read from
	state := handoverTensors(sh, o)
	now, behind := len(state), 0
	if o != nil {
		now = len(o.global.Tensors)
		behind = len(state) - now
	}
	var missed []string
	send := func(ctx context.Context, g proto.Gift, lo, hi int) error {
		for i := lo; i < hi; i++ {
			if blocks[i] < g.Begin || blocks[i] >= g.End {
				continue
			}
			pt, err := rowsTensor(stateKey(ver, step, nums[i]), model.F32, state[i].Data, 1)
			if err != nil {
				return err
			}
			if err := net.Send(ctx, g.Worker, pt); err != nil {
				return err
			}
		}
		return nil
	}
	var reached []proto.Gift
	for _, g := range to {
		if err := send(ctx, g, 0, now); err != nil {
			if ctx.Err() != nil {
				return missed, fmt.Errorf("hand the state over to %s: %w", g.Worker, err)
			}
			missed = append(missed, fmt.Sprintf("%s (%v)", g.Worker, err))
			continue
		}
		reached = append(reached, g)
	}
	if behind > 0 && len(reached) > 0 {
		// A copy: the giver's own next outer step changes the momentum, perhaps before every
		// taker has it. The assignment's context ends when the giver is Ready; a link that fails,
		// or a plan that closes the transport, ends the sending instead.
		for i := now; i < len(state); i++ {
			state[i].Data = slices.Clone(state[i].Data)
		}
		go func() {
			for _, g := range reached {
				_ = send(context.WithoutCancel(ctx), g, now, len(state)) // the taker's wait fails in its place
			}
		}()
	}
	return missed, nil
}

// stateWaits are the receipts a taker posts for its state before its data plane opens, so that
// every tensor goes straight into the shard as it arrives: none waits in the mailbox, whose bound
// is sized for a step's traffic, not for a whole shard's state. In handoverTensors' order.
type stateWaits []<-chan proto.Tensor

// expectState posts the receipts of sh's state handed over into plan ver at step.
func expectState(box *Mailbox, spec job.Spec, sh *model.Shard, ver uint32, step uint64) (stateWaits, error) {
	nums, _, err := handoverNumbers(spec, sh)
	if err != nil {
		return nil, err
	}
	w := make(stateWaits, len(nums))
	for i, k := range nums {
		ch, err := box.Expect(stateKey(ver, step, k))
		if err != nil {
			return nil, err
		}
		w[i] = ch
	}
	return w, nil
}

// takeState fills sh with the state w receives (in outer mode, o's global θ and momentum, from
// which sh then starts: grown), each block's tensors from its giver in from, checking each
// tensor's type and size against the shard's own, and leaves it on sh's device. gone(w), when not
// nil, is closed if the link to giver w fails: the state will not come, and the assignment fails
// at once rather than when the coordinator gives up on it.
func takeState(ctx context.Context, w stateWaits, spec job.Spec, sh *model.Shard, o *outerState, from []proto.Handover, gone func(string) <-chan struct{}) error {
	state := handoverTensors(sh, o)
	_, blocks, err := handoverNumbers(spec, sh)
	if err != nil {
		return err
	}
	if len(blocks) != len(w) || len(state) != len(w) {
		return fmt.Errorf("the state: %d receipts for %d tensors", len(w), len(state))
	}
	now := len(w)
	if o != nil {
		now = min(len(o.global.Tensors), len(w)) // the momentum follows (giveState)
	}
	take := func(ctx context.Context, i int) error {
		f := giverOf(from, blocks[i])
		if f == nil {
			return fmt.Errorf("the state: no giver of block %d (tensor %s)", blocks[i], state[i].Name)
		}
		t, err := receiveState(ctx, w[i], gone(f.Worker))
		if errors.Is(err, errGiverGone) {
			// The giver's link failed: most likely it left, which the coordinator answers; the
			// error names it, so that the failure is weighed as its departure's.
			err = &PeerError{Peer: f.Worker, Err: err}
		}
		if err != nil {
			return fmt.Errorf("the state from %s (%d of %d tensors taken): %w", f.Worker, i, len(w), err)
		}
		dst := state[i].Data
		if t.DType != proto.F32 || len(t.Data) != 4*len(dst) {
			return fmt.Errorf("the state from %s: tensor %d (%s) is %d bytes of %v, want %d of float32", f.Worker, i, state[i].Name, len(t.Data), t.DType, 4*len(dst))
		}
		safetensors.DecodeF32(dst, t.Data)
		return nil
	}
	t0 := time.Now()
	for i := range now {
		if err := take(ctx, i); err != nil {
			return err
		}
	}
	if o != nil {
		if err := o.grown(sh); err != nil {
			return err
		}
		// As many bytes as the global θ's: four times its time, and never under momentumWait,
		// bound the wait where no link failure can end it (a relayed giver that left).
		a := &momentumArrival{done: make(chan struct{}), deadline: time.Now().Add(max(4*time.Since(t0), momentumWait))}
		o.arriving = a
		go func() {
			defer close(a.done)
			for i := now; i < len(w) && a.err == nil; i++ {
				// Not the assignment's context, which ends once the taker is Ready: the link to
				// the giver, or the plan's mailbox closing, ends this wait.
				a.err = take(context.WithoutCancel(ctx), i)
			}
		}()
	}
	sh.Push() // the host mirror → the device the shard computes on
	return nil
}

// momentumArrival is an outer-mode taker's outer momentum on its way from its giver, behind the
// global θ (giveState): the taker trains meanwhile, and whatever reads the momentum — an outer
// step, a checkpoint, a handover of its own — waits for it first (session.momentumGate).
type momentumArrival struct {
	done     chan struct{}
	err      error // set before done closes
	deadline time.Time
}

// momentumWait is the least a taker waits for the momentum once its global θ is in.
const momentumWait = 30 * time.Second

// wait returns once the momentum is in, or why it will not come: its giver's link failed, or it
// is later than its deadline.
func (a *momentumArrival) wait(ctx context.Context) error {
	late := time.NewTimer(time.Until(a.deadline))
	defer late.Stop()
	select {
	case <-a.done:
		return a.err
	case <-late.C:
		select {
		case <-a.done:
			return a.err
		default:
			return errors.New("later than its deadline")
		}
	case <-ctx.Done():
		return ctx.Err()
	}
}

// errGiverGone: the link to the worker handing its state over failed before the state came.
var errGiverGone = errors.New("the link to the giver failed")

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
			return t, errGiverGone
		case <-ctx.Done():
			return t, ctx.Err()
		}
	}
	if !ok {
		return t, ErrClosed
	}
	return t, nil
}
