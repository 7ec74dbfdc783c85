package client

import (
	"context"
	"fmt"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// Gradient reduction between pipeline replicas (step mode). A stage of replica r computes
// micro-batches [First, First+n) of every step; its gradient tree then holds the nodes
// model.TreeNodes(M, First, First+n) of each tensor. It sends them to every stage of another
// replica that holds the same tensor (proto.ReplicaAssign.Peers), receives theirs, and sums the
// tree over all of them (model.Shard.ReduceGradients): every holder ends with the single
// process's gradient bit for bit, whatever the replicas and their shares.

// reduceLink is what a stage exchanges with one stage of another replica.
type reduceLink struct {
	peer proto.ReducePeer
	// tensors are the tensors both hold, in this shard's order: the name, and the index in the
	// model's tensor order that names it on the wire (proto.GradReduceKey).
	tensors []reduceTensor
	nodes   [][2]int // the peer's gradient-tree nodes: model.TreeNodes of its micro-batches
}

// gradReduceKey names node [lo, hi) of the gradient of the model's tensor number tensor that
// replica sends at step st.
func gradReduceKey(st proto.StepSpec, tensor, replica, lo, hi int) proto.TensorKey {
	return proto.GradReduceKey{PlanVersion: st.PlanVersion, Step: st.Step, Tensor: tensor, Replica: replica, Lo: lo, Hi: hi}.Key()
}

type reduceTensor struct {
	name   string
	global int
	size   int // float32 values
}

// reduceLinks computes the links of a stage shard sh in a replicated plan of spec: for every peer,
// the tensors it shares with sh. held says which experts the stages hold (those on expert hosts
// are every replica's alike: on the hosts). With own batches (outer mode) a peer's micro-batches
// are [0, n) of its own batch, n up to job.Spec.MaxOwnMicroBatches, its tree's one root node.
func reduceLinks(spec job.Spec, sh *model.Shard, r *proto.ReplicaAssign, held func(blk, e int) bool) ([]reduceLink, error) {
	cfg, M := spec.Model, spec.MicroBatches
	global := map[string]int{}
	for i, s := range cfg.Specs() {
		global[s.Name] = i
	}
	var links []reduceLink
	for _, p := range r.Peers {
		pm := M // the tree the peer's micro-batches are nodes of
		if spec.OwnBatches() {
			pm = p.MicroBatches
			if p.First != 0 || pm > spec.MaxOwnMicroBatches() {
				return nil, fmt.Errorf("reduce peer %s: micro-batches [%d,%d) of its own batch, want [0, n) with n at most %d", p.Worker, p.First, p.First+p.MicroBatches, spec.MaxOwnMicroBatches())
			}
		}
		if p.End > cfg.NLayer || p.First+p.MicroBatches > pm {
			return nil, fmt.Errorf("reduce peer %s: blocks [%d,%d), micro-batches [%d,%d) outside the job", p.Worker, p.Begin, p.End, p.First, p.First+p.MicroBatches)
		}
		theirs := map[string]bool{}
		for _, s := range cfg.StageShardSpecs(p.Begin, p.End, held) {
			theirs[s.Name] = true
		}
		l := reduceLink{peer: p, nodes: model.TreeNodes(pm, p.First, p.First+p.MicroBatches)}
		for _, t := range sh.G.Tensors {
			if theirs[t.Name] {
				l.tensors = append(l.tensors, reduceTensor{name: t.Name, global: global[t.Name], size: len(t.Data)})
			}
		}
		if len(l.tensors) == 0 {
			return nil, fmt.Errorf("reduce peer %s: blocks [%d,%d) share no tensor with this stage", p.Worker, p.Begin, p.End)
		}
		links = append(links, l)
	}
	return links, nil
}

// reducer is a step's gradient exchange with the other replicas. Nodes leave as soon as they are
// final — a subtree of the stage's micro-batches as soon as its last micro-batch's backward is
// done, each block's last node as soon as that block's backward is — on a goroutine of their own,
// so that sending overlaps the rest of the backward pass; receiving and summing wait for the
// schedule's end (finish).
type reducer struct {
	r      *StageRunner
	st     proto.StepSpec
	ctx    context.Context
	cancel context.CancelFunc
	jobs   chan reduceJob
	sent   map[string]int   // per tensor: its final nodes queued so far (the compute goroutine's)
	groups map[int][]string // per tensor group: the tensors some link shares
	links  map[string][]*reduceLink
	done   chan reduceResult
	closed bool
}

type reduceJob struct {
	t    reduceTensor
	node model.GradNode
}

type reduceResult struct {
	err    error
	sendNS int64
}

// startReduce starts the step's exchange: the sending goroutine, fed by queue.
func (r *StageRunner) startReduce(ctx context.Context, st proto.StepSpec) *reducer {
	ctx, cancel := context.WithCancel(ctx)
	x := &reducer{r: r, st: st, ctx: ctx, cancel: cancel, sent: map[string]int{}, groups: map[int][]string{},
		links: map[string][]*reduceLink{}, done: make(chan reduceResult, 1)}
	n := 0
	for i := range r.links {
		l := &r.links[i]
		for _, t := range l.tensors {
			if len(x.links[t.name]) == 0 {
				g := model.TensorGroup(t.name, r.Shard.Cfg.NLayer)
				x.groups[g] = append(x.groups[g], t.name)
				n += len(model.TreeNodes(st.MicroBatches, r.Replica.First, r.Replica.First+r.Replica.MicroBatches))
			}
			x.links[t.name] = append(x.links[t.name], l)
		}
	}
	// Room for every node the step has: queue never blocks the backward.
	x.jobs = make(chan reduceJob, n)
	go x.send()
	return x
}

// send sends each queued node to every link holding its tensor.
func (x *reducer) send() {
	var res reduceResult
	defer func() { x.done <- res }()
	idx := x.r.Replica.Index
	for j := range x.jobs {
		if res.err != nil {
			continue // drain
		}
		for _, l := range x.links[j.t.name] {
			pt, err := rowsTensor(gradReduceKey(x.st, j.t.global, idx, j.node.Lo, j.node.Hi), model.F32, j.node.Data, 1)
			if err != nil {
				res.err = err
				break
			}
			t0 := time.Now()
			err = x.r.Net.Send(x.ctx, l.peer.Worker, pt)
			res.sendNS += int64(time.Since(t0))
			if err != nil {
				res.err = fmt.Errorf("gradient of %s to replica %d: %w", j.t.name, l.peer.Replica, err)
				break
			}
		}
	}
}

// queue folds group's gradient of micro-batch mb into the tree (after its backward: the stage's
// AfterGroup) and queues the group's tensors' nodes that became final.
func (x *reducer) queue(mb, group int) error {
	if err := x.r.Shard.FoldGroup(mb, group); err != nil {
		return err
	}
	return x.queueFinal(group)
}

func (x *reducer) queueFinal(group int) error {
	for _, name := range x.groups[group] {
		ns, err := x.r.Shard.FinalGradNodes(name)
		if err != nil {
			return err
		}
		for _, n := range ns[x.sent[name]:] {
			x.jobs <- reduceJob{t: x.links[name][0].tensor(name), node: n}
		}
		x.sent[name] = len(ns)
	}
	return nil
}

// close stops queueing; abort also stops sending. Either waits for the goroutine and returns its
// result.
func (x *reducer) close(abort bool) reduceResult {
	if abort {
		x.cancel()
	}
	if !x.closed {
		x.closed = true
		close(x.jobs)
	}
	res := <-x.done
	x.done <- res // a second close returns the same
	x.cancel()
	return res
}

// finish queues what is left, receives the other replicas' nodes and completes every tensor's
// gradient (model.Shard.ReduceGradients), then waits for the sending.
func (x *reducer) finish(tm *proto.Timings) error {
	r := x.r
	for g := range x.groups {
		if err := x.queueFinal(g); err != nil {
			x.close(true)
			return err
		}
	}
	var waitNS int64
	for _, t := range r.Shard.G.Tensors {
		var theirs []model.GradNode
		for _, l := range x.links[t.Name] {
			rt := l.tensor(t.Name)
			for _, n := range l.nodes {
				t0 := time.Now()
				v, err := recvRows(x.ctx, r.Net, gradReduceKey(x.st, rt.global, l.peer.Replica, n[0], n[1]), model.F32, 1)
				waitNS += int64(time.Since(t0))
				if err != nil {
					x.close(true)
					return fmt.Errorf("gradient of %s from replica %d: %w", t.Name, l.peer.Replica, err)
				}
				theirs = append(theirs, model.GradNode{Lo: n[0], Hi: n[1], Data: v})
			}
		}
		if err := r.Shard.ReduceGradients(t.Name, theirs); err != nil {
			x.close(true)
			return err
		}
	}
	res := x.close(false)
	tm.WaitNS += waitNS
	tm.TransferNS += res.sendNS
	return res.err
}

// tensor is the shared tensor called name.
func (l *reduceLink) tensor(name string) reduceTensor {
	for _, t := range l.tensors {
		if t.name == name {
			return t
		}
	}
	return reduceTensor{}
}
