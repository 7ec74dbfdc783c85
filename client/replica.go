package client

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
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
// schedule's end (finish). A reroute (reroute.go) changes whom it reduces with and which nodes
// each sends: the replicas it leaves out are gone, and the others' nodes are those of their
// widened runs; what was received already is kept.
type reducer struct {
	r      *StageRunner
	st     proto.StepSpec
	ctx    context.Context
	cancel context.CancelFunc
	q      *nodeQueue
	sent   map[string]map[[2]int]bool // per tensor: its final nodes queued so far (the compute goroutine's)
	groups map[int][]string           // per tensor group: the tensors some link shares
	links  map[string][]*reduceLink
	// By peer: the nodes it sends this step (its link's, until a reroute widens its run), and
	// whether a reroute left its replica out.
	nodes map[string][][2]int
	gone  map[string]bool
	got   map[proto.TensorKey][]float32 // nodes received, kept for a reduction a reroute starts again
	done  chan reduceResult
	// rt is the step's route where it logs (a plan that can take a stage over): a neighbour's
	// failed link fails every wait on the stage's transport, a node's too, until its takeover
	// comes (recvNode, exchangesWith).
	rt *route
}

type reduceJob struct {
	t    reduceTensor
	node model.GradNode
	to   []*reduceLink // the links holding the tensor when it was queued, gone ones left out
	// sent, when not nil, is no node: the sender answers it with the peers whose sends failed so
	// far, once every job queued before it is sent (drained).
	sent chan map[string]error
}

type reduceResult struct {
	failed map[string]error // by peer: the first send to it that failed
	sendNS int64
}

// startReduce starts the step's exchange: the sending goroutine, fed by queue.
func (r *StageRunner) startReduce(ctx context.Context, st proto.StepSpec) *reducer {
	x := &reducer{r: r, st: st, sent: map[string]map[[2]int]bool{}, groups: map[int][]string{},
		links: map[string][]*reduceLink{}, nodes: map[string][][2]int{}, gone: map[string]bool{},
		got: map[proto.TensorKey][]float32{}}
	for i := range r.links {
		l := &r.links[i]
		x.nodes[l.peer.Worker] = l.nodes
		for _, t := range l.tensors {
			if len(x.links[t.name]) == 0 {
				g := model.TensorGroup(t.name, r.Shard.Cfg.NLayer)
				x.groups[g] = append(x.groups[g], t.name)
				x.sent[t.name] = map[[2]int]bool{}
			}
			x.links[t.name] = append(x.links[t.name], l)
		}
	}
	x.start(ctx)
	return x
}

// start starts sending under ctx: at the step's start, and again when a reroute reaches a stage
// that reported the step already (StageRunner.Reroute).
func (x *reducer) start(ctx context.Context) {
	x.ctx, x.cancel = context.WithCancel(ctx)
	x.q = newNodeQueue()
	x.done = make(chan reduceResult, 1)
	go x.send(x.q)
}

// send sends each queued node to every link it names. A link that fails is not the step's failure
// here: its peer may have left, which a reroute answers; the sends to it go on being tried (so
// that what is committed to is what the schedule sends), and close reports the failures of peers
// that stayed.
func (x *reducer) send(q *nodeQueue) {
	res := reduceResult{failed: map[string]error{}}
	defer func() { x.done <- res }()
	idx := x.r.Replica.Index
	for {
		j, ok := q.next(x.ctx)
		if !ok {
			return
		}
		if j.sent != nil {
			j.sent <- maps.Clone(res.failed)
			continue
		}
		for _, l := range j.to {
			pt, err := rowsTensor(gradReduceKey(x.st, j.t.global, idx, j.node.Lo, j.node.Hi), model.F32, j.node.Data, 1)
			if err == nil {
				t0 := time.Now()
				err = x.r.Net.Send(x.ctx, l.peer.Worker, pt)
				res.sendNS += int64(time.Since(t0))
			}
			if err != nil && res.failed[l.peer.Worker] == nil {
				res.failed[l.peer.Worker] = fmt.Errorf("gradient of %s to replica %d: %w", j.t.name, l.peer.Replica, err)
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

// queueAll queues every tensor's final nodes not queued yet: at the end of the stage's
// micro-batches, before anything is received.
func (x *reducer) queueAll() error {
	for g := range x.groups {
		if err := x.queueFinal(g); err != nil {
			return err
		}
	}
	return nil
}

func (x *reducer) queueFinal(group int) error {
	for _, name := range x.groups[group] {
		ns, err := x.r.Shard.FinalGradNodes(name)
		if err != nil {
			return err
		}
		var to []*reduceLink
		for _, l := range x.links[name] {
			if !x.gone[l.peer.Worker] {
				to = append(to, l)
			}
		}
		for _, n := range ns {
			k := [2]int{n.Lo, n.Hi}
			if x.sent[name][k] {
				continue
			}
			x.sent[name][k] = true
			x.q.push(reduceJob{t: x.links[name][0].tensor(name), node: n, to: to})
		}
	}
	return nil
}

// unanswered waits until every node queued so far is sent and says whether a send failed to a
// peer that no reroute or takeover has answered yet (answered).
func (x *reducer) unanswered() bool {
	if x.done == nil {
		return false
	}
	ch := make(chan map[string]error, 1)
	x.q.push(reduceJob{sent: ch})
	select {
	case failed := <-ch:
		for p := range failed {
			if !x.answered(p) {
				return true
			}
		}
	case <-x.ctx.Done():
	}
	return false
}

// close stops queueing; abort also stops sending. Either waits for the goroutine and returns the
// sends' error: the first failure of a send to a peer a reroute has not left out. A second close
// returns nil.
func (x *reducer) close(abort bool) (int64, error) {
	if x.done == nil {
		return 0, nil
	}
	if abort {
		x.cancel()
	}
	x.q.close()
	res := <-x.done
	x.done = nil
	x.cancel()
	for _, l := range x.r.links {
		if err := res.failed[l.peer.Worker]; err != nil && !x.gone[l.peer.Worker] {
			return res.sendNS, &PeerError{Peer: l.peer.Worker, Err: err}
		}
	}
	return res.sendNS, nil
}

// errRerouted ends a reduction that a reroute interrupted: the step takes it up and reduces again.
var errRerouted = errors.New("the step was rerouted")

// rerouteGrace is how long a stage waiting for the nodes of a peer whose link failed waits for
// the reroute that its departure brings before it reports the failure as the step's.
const rerouteGrace = 10 * time.Second

// finish receives the nodes of the peers a reroute has not left out and completes every tensor's
// gradient (model.Shard.ReduceGradients). A reroute heard meanwhile (wake) ends it with
// errRerouted; the nodes received so far are kept.
func (x *reducer) finish(tm *proto.Timings, wake <-chan struct{}) error {
	r := x.r
	var waitNS int64
	defer func() { tm.WaitNS += waitNS }()
	for _, t := range r.Shard.G.Tensors {
		var theirs []model.GradNode
		for _, l := range x.links[t.Name] {
			if x.gone[l.peer.Worker] {
				continue
			}
			rt := l.tensor(t.Name)
			for _, n := range x.nodes[l.peer.Worker] {
				key := gradReduceKey(x.st, rt.global, l.peer.Replica, n[0], n[1])
				v, ok := x.got[key]
				if !ok {
					t0 := time.Now()
					var err error
					v, err = x.recvNode(key, l, wake)
					waitNS += int64(time.Since(t0))
					if err != nil {
						if errors.Is(err, errRerouted) {
							return err
						}
						return fmt.Errorf("gradient of %s from replica %d: %w", t.Name, l.peer.Replica, err)
					}
					x.got[key] = v
				}
				theirs = append(theirs, model.GradNode{Lo: n[0], Hi: n[1], Data: v})
			}
		}
		if err := r.Shard.ReduceGradients(t.Name, theirs); err != nil {
			return err
		}
	}
	return nil
}

// recvNode receives the node key from link l's peer. A reroute heard meanwhile ends it with
// errRerouted; so does a failure of the link to the peer, if a reroute follows within
// rerouteGrace, and otherwise with the link's failure.
func (x *reducer) recvNode(key proto.TensorKey, l *reduceLink, wake <-chan struct{}) ([]float32, error) {
	ctx, cancel := context.WithCancelCause(x.ctx)
	defer cancel(nil)
	var down <-chan struct{}
	if w := baseNet(x.r.Net); w != nil {
		down = w.peerDone(l.peer.Worker)
	}
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-wake:
			cancel(errRerouted)
			return
		case <-down:
		case <-stop:
			return
		}
		t := time.NewTimer(rerouteGrace)
		defer t.Stop()
		select {
		case <-wake:
			cancel(errRerouted)
		case <-t.C:
			cancel(&PeerError{Peer: l.peer.Worker, Err: ErrPeerGone})
		case <-stop:
		}
	}()
	v, err := recvRows(ctx, x.r.Net, key, model.F32, 1)
	if err != nil && x.ctx.Err() == nil {
		if c := context.Cause(ctx); c != nil && !errors.Is(c, context.Canceled) {
			return nil, c
		}
		// Another peer's link failed, not the node's sender's: the transport ends every wait on
		// any link's failure. A pool mate or a neighbour lost mid-step is answered by a reroute
		// or a stage takeover: wait for it, as for the sender's own link above, and the step
		// takes it up and receives again (errRerouted). One answered already whose link failed
		// again since it was forgotten is forgotten again.
		var pe *PeerError
		if errors.As(err, &pe) && pe.Peer != l.peer.Worker && x.exchangesWith(pe.Peer) {
			if x.answered(pe.Peer) {
				x.r.forgetPeer(pe.Peer)
				return nil, errRerouted
			}
			if rerouteWithin(x.ctx, wake) {
				return nil, errRerouted
			}
		}
	}
	return v, err
}

// rerouteWithin waits rerouteGrace (and ctx) for a reroute or takeover (wake, nil for none) and
// reports whether one came.
func rerouteWithin(ctx context.Context, wake <-chan struct{}) bool {
	if wake == nil {
		return false
	}
	t := time.NewTimer(rerouteGrace)
	defer t.Stop()
	select {
	case <-wake:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// exchangesWith reports whether the stage exchanges tensors with peer this step: a pool mate it
// reduces with, or a neighbour on its route.
func (x *reducer) exchangesWith(peer string) bool {
	_, pool := x.nodes[peer]
	return pool || x.rt != nil && x.rt.neighbour(peer)
}

// answered reports whether a reroute or a takeover this step has taken peer's place already.
func (x *reducer) answered(peer string) bool {
	return x.gone[peer] || x.rt != nil && x.rt.replaced(peer)
}

// nodeQueue is the nodes waiting to be sent, in the order they became final: unbounded, so that
// queueing never blocks the backward (a step has at most 2M−1 nodes of each tensor).
type nodeQueue struct {
	mu     sync.Mutex
	jobs   []reduceJob
	closed bool
	ready  chan struct{} // holds a token while jobs or closed may have changed
}

func newNodeQueue() *nodeQueue { return &nodeQueue{ready: make(chan struct{}, 1)} }

func (q *nodeQueue) push(j reduceJob) {
	q.mu.Lock()
	q.jobs = append(q.jobs, j)
	q.mu.Unlock()
	q.signal()
}

func (q *nodeQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.signal()
}

func (q *nodeQueue) signal() {
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// next is the next job, or false once the queue is closed and empty or ctx ends.
func (q *nodeQueue) next(ctx context.Context) (reduceJob, bool) {
	for {
		q.mu.Lock()
		if len(q.jobs) > 0 {
			j := q.jobs[0]
			q.jobs[0] = reduceJob{}
			q.jobs = q.jobs[1:]
			q.mu.Unlock()
			return j, true
		}
		closed := q.closed
		q.mu.Unlock()
		if closed {
			return reduceJob{}, false
		}
		select {
		case <-q.ready:
		case <-ctx.Done():
			return reduceJob{}, false
		}
	}
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
