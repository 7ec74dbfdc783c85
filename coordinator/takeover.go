package coordinator

import (
	"slices"
	"time"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Stage takeovers (issue 30, stage pools; proto.StageTakeover, client/takeover.go): in step mode
// the stages of the replicas holding the same blocks are a pool. When a worker of a replica of
// several stages is lost mid-step — the step's first departure, every replica cut alike — the
// stage of its blocks in the replica beside it (the one before in micro-batch order, else the one
// after) takes the lost run over at those blocks alone: the lost stage's neighbours send it what
// they sent the lost stage and go on with it, and every other stage of the lost replica keeps its
// run and the work it did. A replica reroute (reroute.go) would have the replicas beside it compute
// the lost replica's micro-batches at every stage again.
//
// The step's record and the boundary after it are a reroute's: the lost replica leaves the plan at
// the boundary's reshare (its other workers stand by, and a refill staffs it again from the pool
// mates), so only the step in flight runs with a stage taken over. The step is audited as any
// other: its spec records the takeover (proto.StepSpec.Takeover), where a recomputation takes it
// up as the live pool did — after its own micro-batches — and has the lost stage's neighbours send
// to the taker from the start. What a neighbour sent the lost stage before the takeover reached it
// depends on when that was; each such tensor must be one it sent the taker too, bit for bit
// (audit.Outcome.Moved).

// takeover is a stage takeover of the step in flight, as the coordinator keeps it.
type takeover struct{ tk proto.StageTakeover }

// first and last report whether the lost stage was its replica's first, or last (it had no
// neighbour there): the taker gets the lost run's tokens, or its targets.
func (t *takeover) first() bool { return t.tk.Prev == "" }
func (t *takeover) last() bool  { return t.tk.Next == "" }

// poolsBeside returns the workers of the other replicas holding the stage that ends where
// stages[k] begins, and those holding the one that begins where it ends
// (proto.ReplicaAssign.PrevPool, NextPool).
func poolsBeside(stages []placement, k int) (prev, next []string) {
	me := stages[k]
	for _, st := range stages {
		if st.replica == me.replica {
			continue
		}
		if st.end == me.begin {
			prev = append(prev, st.peer)
		}
		if st.begin == me.end {
			next = append(next, st.peer)
		}
	}
	return prev, next
}

// cutAlike reports whether the replicas reps of stages are pipelines of two stages or more, all cut
// alike: a plan whose stages can be taken over (takeoverOf), and whose Assigns name the pools
// beside each stage (proto.ReplicaAssign.PrevPool, NextPool) — a stage keeps what it sends for
// the step only then (client: route).
func cutAlike(reps []replicaRun, stages []placement) bool {
	if len(reps) < 2 {
		return false
	}
	r0 := reps[0]
	S := r0.hi - r0.lo
	if S < 2 {
		return false
	}
	for _, q := range reps {
		if q.hi-q.lo != S {
			return false
		}
		for i := range S {
			a, b := stages[r0.lo+i], stages[q.lo+i]
			if a.begin != b.begin || a.end != b.end {
				return false
			}
		}
	}
	return true
}

// takeoverOf returns the stage takeover that answers departure d during step s (which can be
// rerouted: canReroute), or nil when a replica reroute must: a reroute came earlier in the step,
// d's replica has one stage, the replicas are not all cut alike, or a worker it needs is gone.
func (j *jobRun) takeoverOf(d *replicaLeft, s int) *takeover {
	p := j.replicaPos(d.index)
	if p < 0 || j.reroutedAt(s) != nil || len(j.reps) < 2 {
		return nil
	}
	rr := j.reps[p]
	S := rr.hi - rr.lo
	idx := slices.IndexFunc(j.stages[rr.lo:rr.hi], func(st placement) bool { return st.peer == d.worker })
	if idx < 0 || !cutAlike(j.reps, j.stages) {
		return nil
	}
	tp := p - 1
	if tp < 0 {
		tp = p + 1
	}
	lost := j.stages[rr.lo+idx]
	t := &takeover{tk: proto.StageTakeover{Begin: lost.begin, End: lost.end, Replica: d.index,
		Lost: d.worker, Taker: j.stages[j.reps[tp].lo+idx].peer, First: rr.first, MicroBatches: rr.n}}
	if idx > 0 {
		t.tk.Prev = j.stages[rr.lo+idx-1].peer
	}
	if idx < S-1 {
		t.tk.Next = j.stages[rr.lo+idx+1].peer
	}
	for _, w := range []string{t.tk.Taker, t.tk.Prev, t.tk.Next} {
		if w != "" && (j.peers[w] == nil || !j.s.hub.Connected(w)) {
			return nil
		}
	}
	// The taker must compute the lost stage's bits: what the lost stage sent its neighbours
	// before it left is what the taker sends them again, and each keeps whichever came first.
	// Only CPUs of one kernel family are known to (custody.go, twins); elsewhere the replica is
	// rerouted whole.
	h := j.peers[t.tk.Taker].hello
	if h == nil || h.Kernels != d.kernels || (d.kernels != proto.KernelsFMA && d.kernels != proto.KernelsPortable) {
		return nil
	}
	// The taker's run widens by the lost one for the step, and its gradient tree and route log
	// with it: a taker whose offer cannot hold that, by the formula it checks its own reroutes
	// and takeovers with (client: StageRunner.fits), is not asked.
	taker := j.reps[tp]
	lo, hi := min(taker.first, rr.first), max(taker.first+taker.n, rr.first+rr.n)
	need, err := sched.ReplicaShardMemory(j.spec.Model, j.spec.BatchSize/max(j.spec.MicroBatches, 1), lost.begin, lost.end, idx, S, lo, hi-lo,
		min(j.depth, taker.n-1), j.spec.ShardJob(), j.spec.ReplicaOptions())
	if err != nil || h.MemoryBytes > 0 && need > float64(j.plannedMemory(j.peers[t.tk.Taker])) {
		return nil
	}
	return t
}

// takeOver answers departure d during step s (spec st, inputs x and y) with takeover t: the lost
// stage leaves the plan, the relay carries the taker's tensors to and from the lost stage's
// neighbours, every participant hears of it (proto.StepReroute with Stage), and the taker gets the
// lost run's tokens or targets when the lost stage was a pipeline's end.
func (j *jobRun) takeOver(d *replicaLeft, s int, st proto.StepSpec, x, y []int32, t *takeover) ([]proto.ReplicaShare, error) {
	t0 := time.Now()
	p := j.replicaPos(d.index)
	tk := t.tk
	var shares []proto.ReplicaShare
	for q, rr := range j.reps {
		switch {
		case q == p:
			continue
		case slices.ContainsFunc(j.stages[rr.lo:rr.hi], func(st placement) bool { return st.peer == tk.Taker }):
			lo, hi := min(rr.first, tk.First), max(rr.first+rr.n, tk.First+tk.MicroBatches)
			shares = append(shares, proto.ReplicaShare{Replica: rr.index, First: lo, MicroBatches: hi - lo})
		default:
			shares = append(shares, proto.ReplicaShare{Replica: rr.index, First: rr.first, MicroBatches: rr.n})
		}
	}
	rec := &stepReroutes{step: s, workers: map[string]bool{d.worker: true}, replicas: map[int]bool{d.index: true}, n: map[int]int{}}
	for _, rr := range j.reps {
		rec.n[rr.index] = rr.n
	}
	rec.left = append(rec.left, d)
	rec.shares = append(rec.shares, shares)
	rec.takeover = t
	j.rerouted = rec
	j.stages = slices.DeleteFunc(j.stages, func(st placement) bool { return st.peer == d.worker })
	j.reps = replicaRuns(j.stages)
	var pairs [][2]string
	for _, w := range []string{tk.Prev, tk.Next} {
		if w != "" {
			pairs = append(pairs, [2]string{w, tk.Taker})
		}
	}
	j.s.hub.AddLinks(j.version, pairs)
	m := &proto.StepReroute{Step: uint64(s), PlanVersion: j.version, Attempt: 1, Shares: shares, Stage: &tk}
	// The takeover is the plan from here on, whether or not every participant hears of it: a
	// send that finds another worker gone ends the step in a reshare, which answers that
	// departure — and the record says what was decided for this one.
	defer func() {
		j.s.log.Warn("stage lost mid-step: its pool mate takes its micro-batches over at its blocks", "worker", d.worker, "replica", d.index,
			"blocks", [2]int{tk.Begin, tk.End}, "taker", tk.Taker, "step", s)
		j.s.event(j.rec.ID, "work.rerouted", d.worker, map[string]any{"replica": d.index, "step": s, "plan": j.version,
			"in_step": true, "attempt": m.Attempt, "replicas": len(j.reps), "stage": map[string]any{"blocks": [2]int{tk.Begin, tk.End},
				"taker": tk.Taker, "prev": tk.Prev, "next": tk.Next, "micro_batches": [2]int{tk.First, tk.First + tk.MicroBatches}},
			"recomputed": tk.MicroBatches, "seconds": time.Since(t0).Seconds(), "reason": d.why})
		j.s.metrics.recovery()
		j.publish()
	}()
	if err := j.sendReroute(m, d.worker); err != nil {
		return nil, err
	}
	if t.first() || t.last() {
		if err := j.sendRunInputs(tk.Taker, t.first(), st, x, y, tk.First, tk.First+tk.MicroBatches); err != nil {
			return nil, err
		}
	}
	return shares, nil
}

// sendRunInputs sends worker to micro-batches [lo, hi) of step st's tokens (tokens) or targets.
func (j *jobRun) sendRunInputs(to string, tokens bool, st proto.StepSpec, x, y []int32, lo, hi int) error {
	T := j.spec.Model.BlockSize
	n := st.Rows * T
	for mb := lo; mb < hi && mb < st.MicroBatches; mb++ {
		xt, yt, err := proto.TokenTensors(st, mb, T, x[mb*n:(mb+1)*n], y[mb*n:(mb+1)*n])
		if err != nil {
			return err
		}
		t := yt
		if tokens {
			t = xt
		}
		if err := j.s.hub.SendTensor(to, t); err != nil {
			return j.sendFailed(to, "inputs to", err)
		}
	}
	return nil
}

// standTakenOver takes the replica of takeover t out of the plan once the step is recorded: its
// other stages computed their run to the step's end and applied it, and stand by now, as a
// rerouted replica's workers do — before the step's evaluation, which runs through whole
// replicas, and the boundary's reshare (reshare.go), which shares the micro-batches among the
// others.
func (j *jobRun) standTakenOver(t *takeover) []string {
	var stood []string
	for _, st := range j.stages {
		if st.replica == t.tk.Replica && j.peers[st.peer] != nil {
			j.standby = append(j.standby, st.peer)
			stood = append(stood, st.peer)
		}
	}
	j.stages = slices.DeleteFunc(j.stages, func(st placement) bool { return st.replica == t.tk.Replica })
	j.reps = replicaRuns(j.stages)
	return stood
}
