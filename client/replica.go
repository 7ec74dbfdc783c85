package client

import (
	"context"
	"fmt"
	"slices"
	"time"

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

type reduceTensor struct {
	name   string
	global int
	size   int // float32 values
}

// reduceLinks computes the links of a stage shard sh in a replicated plan: for every peer, the
// tensors it shares with sh.
func reduceLinks(cfg model.Config, M int, sh *model.Shard, r *proto.ReplicaAssign) ([]reduceLink, error) {
	global := map[string]int{}
	for i, s := range cfg.Specs() {
		global[s.Name] = i
	}
	var links []reduceLink
	for _, p := range r.Peers {
		if p.End > cfg.NLayer || p.First+p.MicroBatches > M {
			return nil, fmt.Errorf("reduce peer %s: blocks [%d,%d), micro-batches [%d,%d) outside the job", p.Worker, p.Begin, p.End, p.First, p.First+p.MicroBatches)
		}
		theirs := map[string]bool{}
		for _, s := range cfg.StageShardSpecs(p.Begin, p.End, func(int, int) bool { return true }) {
			theirs[s.Name] = true
		}
		l := reduceLink{peer: p, nodes: model.TreeNodes(M, p.First, p.First+p.MicroBatches)}
		for _, t := range sh.G.Tensors {
			if theirs[t.Name] {
				l.tensors = append(l.tensors, reduceTensor{name: t.Name, global: global[t.Name], size: len(t.Data)})
			}
		}
		links = append(links, l)
	}
	return links, nil
}

// reduceGradients exchanges the stage's gradient-tree nodes with the other replicas' stages and
// completes every tensor's gradient. Sending runs beside receiving, so that neither side waits
// for the other to drain; what a peer sends is admitted only as the links say (admission).
func (r *StageRunner) reduceGradients(ctx context.Context, st proto.StepSpec, tm *proto.Timings) error {
	rep := r.Replica
	// This shard's nodes, read once (on the host a view of the tree's buffers, which nothing
	// writes until the next step).
	mine := map[string][]model.GradNode{}
	for _, t := range r.Shard.G.Tensors {
		ns, err := r.Shard.GradNodes(t.Name)
		if err != nil {
			return err
		}
		mine[t.Name] = ns
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		err    error
		sendNS int64
	}
	sent := make(chan result, 1)
	go func() {
		var res result
		defer func() { sent <- res }()
		for _, l := range r.links {
			for _, t := range l.tensors {
				for _, n := range mine[t.name] {
					pt, err := rowsTensor(proto.GradReduceKey(st, t.global, rep.Index, n.Lo, n.Hi), model.F32, n.Data, 1)
					if err != nil {
						res.err = err
						return
					}
					t0 := time.Now()
					err = r.Net.Send(ctx, l.peer.Worker, pt)
					res.sendNS += int64(time.Since(t0))
					if err != nil {
						res.err = fmt.Errorf("gradient of %s to replica %d: %w", t.name, l.peer.Replica, err)
						return
					}
				}
			}
		}
	}()
	var waitNS int64
	for _, t := range r.Shard.G.Tensors {
		var theirs []model.GradNode
		for _, l := range r.links {
			k := slices.IndexFunc(l.tensors, func(x reduceTensor) bool { return x.name == t.Name })
			if k < 0 {
				continue
			}
			rt := l.tensors[k]
			for _, n := range l.nodes {
				t0 := time.Now()
				v, err := recvRows(ctx, r.Net, proto.GradReduceKey(st, rt.global, l.peer.Replica, n[0], n[1]), model.F32, 1)
				waitNS += int64(time.Since(t0))
				if err != nil {
					cancel()
					<-sent
					return fmt.Errorf("gradient of %s from replica %d: %w", t.Name, l.peer.Replica, err)
				}
				theirs = append(theirs, model.GradNode{Lo: n[0], Hi: n[1], Data: v})
			}
		}
		if err := r.Shard.ReduceGradients(t.Name, theirs); err != nil {
			cancel()
			<-sent
			return err
		}
	}
	res := <-sent
	tm.WaitNS += waitNS
	tm.TransferNS += res.sendNS
	return res.err
}
