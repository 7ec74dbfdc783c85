package coordinator

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// Reroutes (issue 30; sched.Reroute): a step-mode replica lost during a step costs only its own
// work on the step. The replicas beside it take its micro-batches of the step on top of their own
// (sched.RerouteShares: each share stays one contiguous run, in replica order), keeping what they
// have computed; the coordinator tells every surviving stage (proto.StepReroute), sends the added
// micro-batches' tokens and targets, and collects a report of the step from each again — one that
// includes the reroute (proto.StepReport.Reroutes). No plan version changes during the step: the
// survivors' links stay up, and the reduction leaves the lost replica out. The step's gradient is
// the same tree over the same micro-batches, so its bits are the single process's. At the step's
// end the job reshares (reshare.go): the survivors share the micro-batches in proportion to their
// speed from the next step on, keeping their state, and nothing is computed again.
//
// A reroute is the driver's (drive.go), during a step in flight: a departure while the step is
// evaluated, checkpointed or at a boundary reshares as before, and so does one beside expert
// hosts (their trees fold one run per replica, which a reroute would change mid-step) or past
// proto.MaxReroutes in one step.

// stepReroutes are the reroutes of the step in flight: which workers and replicas they left out,
// and the shares each gave, for the step's audits (proto.StepSpec.Reroutes) and its cross-check.
type stepReroutes struct {
	step     int
	workers  map[string]bool // the left-out replicas' workers
	replicas map[int]bool    // their indices
	shares   [][]proto.ReplicaShare
	left     []*replicaLeft // the departures, in order: the boundary's reshare answers them
	// n is each replica's micro-batches before the first reroute, by index: the boundary's
	// reshare shares the step in proportion to them, as the planner sized them to speed.
	n map[int]int
	// unsent: the reroutes of replicas lost while the plan loaded (rerouteAtLoad), which the
	// survivors hear of once the plan's first step is open.
	unsent bool
	// takeover, when the step's one reroute took a lost stage over (takeover.go): the lost
	// stage's replica keeps its other stages to the step's end.
	takeover *takeover
}

// sharesOrNil is rec's shares, nil for no reroutes.
func (rec *stepReroutes) sharesOrNil() [][]proto.ReplicaShare {
	if rec == nil {
		return nil
	}
	return rec.shares
}

// reroutedAt is the reroutes of step s, nil if it had none.
func (j *jobRun) reroutedAt(s int) *stepReroutes {
	if r := j.rerouted; r != nil && r.step == s {
		return r
	}
	return nil
}

// canReroute reports whether the departure d during step s can be answered by a reroute.
func (j *jobRun) canReroute(d *replicaLeft, s int) bool {
	n := 0
	if r := j.reroutedAt(s); r != nil {
		if r.takeover != nil {
			return false // the lost stage's replica runs on through its taker: a reshare redoes the step
		}
		n = len(r.shares)
	}
	return d.reroute && j.sync.book() == sched.SyncStep && len(j.hosts) == 0 && len(j.reps) >= 2 &&
		j.replicaPos(d.index) >= 0 && n < proto.MaxReroutes
}

// reroute answers the departure d during step s (spec st, inputs x and y, which the group in
// flight keeps): its replica leaves the plan — its other workers stand by — and the replicas
// beside it take its micro-batches of the step. It returns the reroute it sent, whose shares the
// caller records with the step's spec.
//
// A lost stage that a pool mate can take over is (takeOver): its shares are returned likewise, and
// the step's record (j.rerouted) holds the takeover, which the caller records in the step's spec
// too (proto.StepSpec.Takeover) for its audits.
func (j *jobRun) reroute(d *replicaLeft, s int, st proto.StepSpec, x, y []int32) ([]proto.ReplicaShare, error) {
	if t := j.takeoverOf(d, s); t != nil {
		return j.takeOver(d, s, st, x, y, t)
	}
	t0 := time.Now()
	gone := j.reps[j.replicaPos(d.index)]
	rec, shares, added := j.leaveOut(d, s)
	m := &proto.StepReroute{Step: uint64(s), PlanVersion: j.version, Attempt: len(rec.shares), Shares: shares}
	// Recorded whether or not every participant hears of it (as a takeover is): a send that finds
	// another worker gone ends in a reshare that answers that one.
	defer func() { j.rerouteEvent(d, s, m.Attempt, shares, gone.n, time.Since(t0)) }()
	if err := j.sendReroute(m, d.worker); err != nil {
		return nil, err
	}
	for i, rr := range j.reps {
		for _, a := range added[2*i : 2*i+2] {
			if a[0] < a[1] {
				if err := j.sendInputRange(rr, st, x, y, a[0], a[1]); err != nil {
					return nil, err
				}
			}
		}
	}
	return shares, nil
}

// sendReroute tells every participant of m, and that worker left.
func (j *jobRun) sendReroute(m *proto.StepReroute, left string) error {
	for _, w := range j.participants() {
		if err := j.s.hub.Send(w, m); err != nil {
			return j.sendFailed(w, "reroute to", err)
		}
		// It may be waiting on the departed worker's gradient nodes: the link shows a killed
		// process's departure only when it times out.
		if err := j.s.hub.Send(w, &proto.PeerLeft{PlanVersion: j.version, Worker: left}); err != nil {
			j.s.log.Debug("peer_left not sent", "to", w, "err", err)
		}
	}
	return nil
}

// rerouteEvent logs and publishes reroute attempt of step s around d's replica, which had
// recomputed micro-batches, with shares after it.
func (j *jobRun) rerouteEvent(d *replicaLeft, s, attempt int, shares []proto.ReplicaShare, recomputed int, took time.Duration) {
	micro := make([][2]int, len(shares))
	for i, sh := range shares {
		micro[i] = [2]int{sh.First, sh.First + sh.MicroBatches}
	}
	j.s.log.Warn("replica lost mid-step: the replicas beside it take its micro-batches", "replica", d.index, "worker", d.worker,
		"step", s, "replicas", len(j.reps), "micro_batches", micro)
	j.s.event(j.rec.ID, "work.rerouted", d.worker, map[string]any{"replica": d.index, "step": s, "plan": j.version,
		"in_step": true, "attempt": attempt, "replicas": len(j.reps), "micro_batches": micro,
		"recomputed": recomputed, "seconds": took.Seconds(), "reason": d.why})
	j.s.metrics.recovery()
	j.publish()
}

// rerouteAtLoad leaves out of the plan just loaded the replicas lost while it loaded (step mode,
// lostAtLoad): the replicas beside each take its micro-batches of the plan's first step, which
// the driver opens with their widened runs and tells them of then (sendReroutes).
func (j *jobRun) rerouteAtLoad() {
	lost := j.lostAtLoad
	j.lostAtLoad = nil
	for _, idx := range slices.Sorted(maps.Keys(lost)) {
		d := lost[idx]
		p := j.replicaPos(idx)
		if p < 0 || len(j.reps) < 2 {
			continue
		}
		n := j.reps[p].n
		rec, shares, _ := j.leaveOut(d, j.step)
		rec.unsent = true
		j.rerouteEvent(d, j.step, len(rec.shares), shares, n, 0)
	}
}

// sendReroutes tells the participants the reroutes of rec, none of which they heard yet.
func (j *jobRun) sendReroutes(rec *stepReroutes) error {
	rec.unsent = false
	for k, shares := range rec.shares {
		m := &proto.StepReroute{Step: uint64(rec.step), PlanVersion: j.version, Attempt: k + 1, Shares: shares}
		if err := j.sendReroute(m, rec.left[k].worker); err != nil {
			return err
		}
	}
	return nil
}

// leaveOut takes the replica of departure d out of the plan during step s (or before its first,
// s): its other workers stand by, and the replicas beside it take its micro-batches
// (sched.RerouteShares). It returns the step's reroutes so far, the shares after this one, and
// by survivor, in order, the runs it adds before and after its own.
func (j *jobRun) leaveOut(d *replicaLeft, s int) (*stepReroutes, []proto.ReplicaShare, [][2]int) {
	p := j.replicaPos(d.index)
	runs := make([][2]int, len(j.reps))
	lost := make([]bool, len(j.reps))
	for r, rr := range j.reps {
		runs[r] = [2]int{rr.first, rr.first + rr.n}
	}
	lost[p] = true
	out := sched.RerouteShares(runs, lost)
	gone := j.reps[p]
	rec := j.reroutedAt(s)
	if rec == nil {
		rec = &stepReroutes{step: s, workers: map[string]bool{}, replicas: map[int]bool{}, n: map[int]int{}}
		for _, rr := range j.reps {
			rec.n[rr.index] = rr.n
		}
		j.rerouted = rec
	}
	rec.replicas[gone.index] = true
	rec.left = append(rec.left, d)
	for _, pl := range j.stages[gone.lo:gone.hi] {
		rec.workers[pl.peer] = true
		if pl.peer != d.worker && j.peers[pl.peer] != nil {
			j.standby = append(j.standby, pl.peer)
		}
	}
	// The survivors' placements take their widened runs; the replicas keep the indices their
	// workers know them by until the boundary's reshare renumbers them.
	olds := slices.Clone(j.reps)
	var stages []placement
	var shares []proto.ReplicaShare
	var added [][2]int // by survivor, in order: the micro-batches it takes up
	k := 0
	for r, rr := range olds {
		if r == p {
			continue
		}
		lo, hi := out[k][0], out[k][1]
		k++
		for _, pl := range j.stages[rr.lo:rr.hi] {
			pl.first, pl.n = lo, hi-lo
			stages = append(stages, pl)
		}
		shares = append(shares, proto.ReplicaShare{Replica: rr.index, First: lo, MicroBatches: hi - lo})
		added = append(added, [2]int{lo, rr.first}, [2]int{rr.first + rr.n, hi})
	}
	j.stages = stages
	j.reps = replicaRuns(j.stages)
	rec.shares = append(rec.shares, shares)
	return rec, shares, added
}

// sendInputRange sends micro-batches [lo, hi) of step st's inputs x and y to replica rr: tokens
// to its first stage, targets to its last.
func (j *jobRun) sendInputRange(rr replicaRun, st proto.StepSpec, x, y []int32, lo, hi int) error {
	rr.first, rr.n = lo, hi-lo
	return j.sendInputs(rr, st, x, y)
}

// fromLeftOut reports whether the committed tensor of key id (proto.KeyID) is a gradient node
// that a replica rec left out sent, or may have: a node a survivor received from it before it
// left, which nobody's report commits to sending.
func (rec *stepReroutes) fromLeftOut(id string) bool {
	f := strings.Split(id, ".")
	if len(f) != 4 {
		return false
	}
	kind, err1 := strconv.Atoi(f[0])
	replica, err2 := strconv.Atoi(f[3])
	return err1 == nil && err2 == nil && proto.Kind(kind) == proto.KindGradReduce && rec.replicas[replica]
}

// gradNode reports whether the committed tensor of key id is a gradient node: in a rerouted step
// a survivor may send nodes its partners never take (those of its run before the reroute widened
// it, which they now take merged into larger ones).
func gradNode(id string) bool {
	kind, _, ok := strings.Cut(id, ".")
	return ok && kind == strconv.Itoa(int(proto.KindGradReduce))
}

// lostAtLoadPart reports whether participant i of the active plan is a stage of a replica lost
// while the plan loaded.
func (j *jobRun) lostAtLoadPart(i int) bool {
	return i < len(j.stages) && j.lostAtLoad[j.stages[i].replica] != nil
}

// lostAtLoadWorker reports whether worker w holds a stage of a replica lost while the plan
// loaded.
func (j *jobRun) lostAtLoadWorker(w string) bool {
	for i, st := range j.stages {
		if st.peer == w {
			return j.lostAtLoadPart(i)
		}
	}
	return false
}
