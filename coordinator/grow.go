package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/sched"
)

// Joins without a checkpoint (issue 30; sched.Grow). In step mode every stage of every replica
// holding the same blocks holds the same state at a step boundary (reshare.go), so a worker that
// joins can take up a stage's state from a worker that holds it — peer to peer, the way a restore
// would have given it from a checkpoint of this very step, but without one: nobody uploads, nobody
// else reloads. When the planner's plan over everyone (joiners included) puts every stage either
// on the worker that holds it now or on a worker whose blocks keepers — stages that stay on the
// blocks they hold — can hand over, each its run of them (sched.Cover), the job takes that plan at
// this step boundary: the keepers keep their shards (proto.Keep) and give the takers the state of
// those blocks (Assign.Give, Assign.From) before they are Ready. A holder the plan leaves out in
// place of a joiner hands over the same way what no keeper can, then stands by
// (proto.Assign.Standby; growable's handBack). Otherwise — some block has no holder that stays —
// a join still costs a checkpoint and a replan (sched.CheckpointReplan).
//
// A refill is the same move: a replica dropped by a departure (reshare.go) is staffed again by
// whoever joins, its stages taken up from the replicas that stayed.
//
// Outer mode refills too (outerGrowable): its replicas' own states differ, so nobody is a twin,
// but every holder of a stage's blocks keeps the global θ of the last outer step and the outer
// momentum alike, and a replica new to the job starts from just those. The replicas the rule book
// dropped (round.go) are staffed again at their own indices, their stages taking the global θ and
// the momentum from holders of their blocks (sched.Cover); the others keep their shards, and every holder
// restarts int8's average error feedback (client/handover.go). The giver's Ready names the state
// it gave (proto.Ready.Gave), which the taker's must equal.
//
// Custody (custody.go): a taker's Ready commits to the state it took, which must be its givers' —
// each giver's Ready names the state it kept, and is held to the previous plan's last step as any
// kept state is (checkKept); a taker of several givers, or of part of a giver's stage, must name
// the state composed from what each gave (handedState). A taker's state that differs is a dispute the coordinator cannot
// settle without the state itself (the giver may have sent other bits than it committed to, or
// the taker may lie): nobody is banned, the plan is abandoned, and the job restores as it did
// before handovers existed.

// growth is a plan over the workers the job has, joiners included, that the job can take up at a
// step boundary without a checkpoint: every stage kept by its worker or taken from a twin.
type growth struct {
	stages  []placement
	hosts   []hostPlacement // the active plan's expert hosts, each keeping its experts
	standby []string
	choice  string
	from    map[string][]sched.Part // taker → the givers of its blocks (sched.Cover)
	// Outer mode (weighed): what the growth adds, as a fraction of the running plan's expected
	// goodput, and how long its handovers hold every replica — which sched.GrowDeferral weighs
	// against each other (outerWeigh).
	weighed     bool
	gain, stall float64
	// later: outer mode with a delay (job.Sync.Delay), an outer step is pending at this boundary,
	// which the takers could not take up (they hold none of its round): the growth waits for the
	// first boundary after the take-up, which the round then ends at (outerRule.roundEnd:
	// jobRun.growSoon), its workers standing by (sched.Change.GrowLater).
	later bool
}

// growable returns the growth that the plan stages, hosts, standby (the planner's over every
// worker) is from the active plan, or nil when it is not one: step mode (stepRule.joins), the
// same expert hosts with the same experts in both plans — a host's experts have no other holder,
// so it keeps them, serving the new replicas too — and every stage of stages held already by its
// worker (same blocks) or its blocks by keepers of them (sched.Givers). Givers are spread over the
// keepers in plan order, so that no one worker sends every taker its state.
//
// With handBack, blocks no keeper holds may also be handed over by a worker that holds them now
// and that the plan leaves out (a holder the planner put a faster joiner in place of): it gives
// its state, then stands by (proto.Assign.Standby) — step mode without expert hosts only, where
// a stage's state is all of its blocks' state, and never in a pinned plan, which joiners only
// refill (joinPending).
func (j *jobRun) growable(stages []placement, hosts []hostPlacement, standby []string, handBack bool) *growth {
	if !j.phase.planned() || len(stages) == 0 || !samePlacements(nil, hosts, nil, j.hosts) {
		return nil
	}
	placed := map[string]bool{}
	for _, st := range stages {
		placed[st.peer] = true
	}
	// What each worker holds now; of those the plan leaves out, only the ones that can still
	// give (connected, not on their way out).
	held := map[string][2]int{}
	for _, st := range j.stages {
		if placed[st.peer] || j.peers[st.peer] != nil && !j.leaving[st.peer] && !j.released[st.peer] {
			held[st.peer] = [2]int{st.begin, st.end}
		}
	}
	handBack = handBack && !j.spec.Outer() && j.spec.Plan == nil && len(hosts) == 0
	from, ok := sched.Givers(held, heldStages(stages), handBack, proto.MaxGive)
	if !ok {
		return nil // nobody holds some blocks and stays (a restore is the only source), or each gives all it may
	}
	g := &growth{stages: stages, hosts: hosts, standby: standby, from: from}
	if len(g.from) == 0 {
		return nil // nothing to take up: the plan only drops workers
	}
	return g
}

// keepHolders is the planner's step-mode plan stages with its workers moved among its stages
// so that those holding a stage's blocks now stay on them — a holder it left out in place of a
// worker it chose, who then stands by (sched.KeepHolders) — the shares divided anew. It reports
// false when nothing moves back, or when the move would cost the plan more than
// sched.KeepHoldersLoss of its expected goodput. Plans with expert hosts are left alone: the
// replica planner cannot price them.
func (j *jobRun) keepHolders(stages []placement, hosts []hostPlacement) ([]placement, bool) {
	if j.spec.Outer() || j.spec.Plan != nil || len(hosts) > 0 || len(j.hosts) > 0 || len(stages) == 0 {
		return nil, false
	}
	prof, opt, err := j.outerProfile()
	if err != nil {
		return nil, false
	}
	ids := peersOf(stages)
	for _, st := range j.stages { // a holder the planner left out may keep its stage
		if !slices.Contains(ids, st.peer) && j.plannablePeer(j.peers[st.peer]) == 1 {
			ids = append(ids, st.peer)
		}
	}
	p, ok := sched.KeepHolders(prof, j.schedReplicaPlan(stages, opt.MicroBatches), heldBy(j.stages), j.boundLinks(j.schedPeers(ids)), opt)
	if !ok {
		return nil, false
	}
	var out []placement
	for r, rp := range p.Replicas {
		for _, st := range rp.Stages {
			out = append(out, placement{peer: st.Peer, begin: st.Begin, end: st.End, replica: r, first: rp.First, n: rp.MicroBatches})
		}
	}
	return out, true
}

// allHeld says whether every stage of stages is held now by its worker, its blocks the same, and
// every stage held now is among them: the same plan, but perhaps for the shares.
func (j *jobRun) allHeld(stages []placement) bool {
	if len(stages) != len(j.stages) {
		return false
	}
	now := heldBy(j.stages)
	for _, st := range stages {
		if b, ok := now[st.peer]; !ok || b != [2]int{st.begin, st.end} {
			return false
		}
	}
	return true
}

// freeWorkers are the workers standing by and those that joined (fresh) that may take a stage:
// connected, plannable, holding none, each once.
func (j *jobRun) freeWorkers(fresh []string) []string {
	var free []string
	for _, id := range append(slices.Clone(j.standby), fresh...) {
		if p := j.peers[id]; p != nil && j.plannablePeer(p) == 1 && !slices.Contains(free, id) && !j.holds(id) {
			free = append(free, id)
		}
	}
	return free
}

// outerGrowable (outerRule.joins) returns the growth that refills, at this boundary, every replica of an outer-mode
// plan dropped since it began (sched.DropReplica), or nil when it cannot: each at its own index,
// with its own stages and micro-batches, staffed by workers that stand by or joined (for each
// stage the fastest, by measured or announced speed, whose memory holds it), each stage taking the global θ and the outer
// momentum from holders of its blocks in replicas that stayed (sched.Cover). All of them or none: the
// replicas' indices stay 0..R-1, and with shared batches every micro-batch is trained again.
// While a delayed outer step waits to be taken up the takers would have none to take up: the
// growth is then for a later boundary (outerRule.joins: growth.later).
func (j *jobRun) outerGrowable(fresh []string) *growth {
	if !j.phase.planned() || len(j.dropped) == 0 || len(j.hosts) > 0 || len(j.stages) == 0 {
		return nil
	}
	free := j.freeWorkers(fresh)
	need := 0
	for _, d := range j.dropped {
		need += len(d.stages)
	}
	if len(free) < need {
		return nil
	}
	// The fastest first, the id among equals, so that the refill is the same whoever asks.
	slices.SortStableFunc(free, func(a, b string) int {
		fa, fb := j.effectiveGFLOPS(a), j.effectiveGFLOPS(b)
		switch {
		case fa > fb:
			return -1
		case fa < fb:
			return 1
		}
		return strings.Compare(a, b)
	})
	holders := heldStages(j.stages)
	stages := slices.Clone(j.stages)
	g := &growth{from: map[string][]sched.Part{}, choice: j.planChoice}
	given := map[string]int{}
	taken := map[string]bool{}
	for _, d := range j.dropped {
		for k, b := range d.stages {
			st := placement{begin: b[0], end: b[1], replica: d.index, first: d.first, n: d.n}
			// The fastest free worker whose memory holds the stage at depth 0, as its Assign will
			// check (outer plans place no expert hosts).
			need, err := sched.StageShardMemory(j.spec.Model, j.spec.BatchSize/max(j.spec.MicroBatches, 1), d.n, b[0], b[1], k, len(d.stages), 0, 0, j.spec.ShardJob())
			if err != nil {
				return nil
			}
			i := slices.IndexFunc(free, func(w string) bool {
				p := j.peers[w]
				return !taken[w] && p.hello != nil && need <= float64(j.plannedMemory(p))
			})
			if i < 0 {
				return nil
			}
			parts := sched.Cover(holders, b[0], b[1], given, proto.MaxGive)
			if parts == nil {
				return nil // some of these blocks no replica that stayed holds (a restore is the only source), or each holder gives all it may
			}
			st.peer = free[i]
			taken[st.peer] = true
			g.from[st.peer] = parts
			stages = append(stages, st)
		}
	}
	// Stages come replica by replica, in index order (replicaRuns).
	slices.SortStableFunc(stages, func(a, b placement) int { return a.replica - b.replica })
	g.stages = stages
	for _, id := range j.standby {
		if !taken[id] {
			g.standby = append(g.standby, id)
		}
	}
	for _, id := range fresh {
		if !taken[id] && !slices.Contains(g.standby, id) {
			g.standby = append(g.standby, id)
		}
	}
	if prof, opt, err := j.outerProfile(); err == nil {
		var ids []string
		for _, st := range stages {
			ids = append(ids, st.peer)
		}
		j.outerWeigh(g, prof, opt, j.schedReplicaPlan(j.stages, opt.MicroBatches), j.boundLinks(j.schedPeers(ids)))
	}
	return g
}

// outerExtend (outerRule.joins) returns the growth that takes workers standing by and workers
// that joined into new replicas of an outer-mode plan of own batches, keeping every replica it runs
// (issue 30, "joins without stopping"): the replica planner's AddReplicas forms them from the free
// workers when they raise the estimated goodput (churn weighed in, as the planner weighs plans),
// and each replica's own batch is sized again to the slowest. Every stage of a new replica takes
// the global θ and the outer momentum from a holder of its blocks, as a refill's does, and starts
// from them. The new replicas take the indices of the replicas dropped since the plan began, in
// order, then follow the highest, so that the indices stay 0..R-1 (a replay's replicas are by
// index): nil when they are fewer than the dropped, when none pays, or when a stage has no holder
// of its blocks to take its state from. With shared batches every replica's share of the step
// would change, and a job that pins its plan takes none; neither grows so (a join replans from a
// checkpoint, as before). While a delayed outer step waits to be taken up, the growth is for a
// later boundary (outerRule.joins: growth.later).
func (j *jobRun) outerExtend(fresh []string) *growth {
	if !j.phase.planned() || !j.spec.OwnBatches() || j.spec.Plan != nil || len(j.hosts) > 0 || len(j.stages) == 0 {
		return nil
	}
	free := j.freeWorkers(fresh)
	if len(free) == 0 {
		return nil
	}
	prof, opt, err := j.outerProfile()
	if err != nil {
		return nil
	}
	current := j.schedReplicaPlan(j.stages, opt.MicroBatches)
	var ids []string
	for _, st := range j.stages {
		ids = append(ids, st.peer)
	}
	peers := j.boundLinks(j.schedPeers(append(ids, free...))) // as chooseReplicas weighs them
	grown, ok, err := sched.AddReplicas(prof, current, peers, opt)
	if err != nil || !ok || len(grown.Replicas) <= len(j.reps) {
		return nil
	}
	added := grown.Replicas[len(j.reps):]
	// The indices: the dropped replicas' first, then new ones.
	var indices []int
	top := -1
	for _, rr := range j.reps {
		top = max(top, rr.index)
	}
	for _, d := range j.dropped {
		indices = append(indices, d.index)
		top = max(top, d.index)
	}
	slices.Sort(indices)
	indices = slices.Compact(indices)
	if len(added) < len(indices) {
		return nil
	}
	for len(indices) < len(added) {
		top++
		indices = append(indices, top)
	}
	holders := heldStages(j.stages)
	g := &growth{from: map[string][]sched.Part{}}
	given := map[string]int{}
	taken := map[string]bool{}
	for r, rp := range grown.Replicas {
		if r < len(j.reps) {
			// A replica it runs: the same workers, its own batch sized again.
			rr := j.reps[r]
			for k, st := range j.stages[rr.lo:rr.hi] {
				if k >= len(rp.Stages) || rp.Stages[k].Peer != st.peer {
					return nil // not the plan it runs: the planner's answer is not an extension
				}
				st.first, st.n = rp.First, rp.MicroBatches
				g.stages = append(g.stages, st)
			}
			continue
		}
		idx := indices[r-len(j.reps)]
		for _, s := range rp.Stages {
			parts := sched.Cover(holders, s.Begin, s.End, given, proto.MaxGive)
			if parts == nil {
				return nil // some of these blocks no replica it runs holds (a checkpoint is the only source), or each holder gives all it may
			}
			g.from[s.Peer] = parts
			taken[s.Peer] = true
			g.stages = append(g.stages, placement{peer: s.Peer, begin: s.Begin, end: s.End, replica: idx, first: rp.First, n: rp.MicroBatches})
		}
	}
	// Stages come replica by replica, in index order (replicaRuns).
	slices.SortStableFunc(g.stages, func(a, b placement) int { return a.replica - b.replica })
	for _, id := range free {
		if !taken[id] {
			g.standby = append(g.standby, id)
		}
	}
	g.choice = fmt.Sprintf("%d replicas, outer sync: %d new beside the %d running, taking the global θ from their holders (estimated step %.2f s)",
		len(grown.Replicas), len(added), len(j.reps), grown.StepSeconds)
	j.outerWeigh(g, prof, opt, current, peers)
	return g
}

// outerReshape (outerRule.joins) returns the growth that takes up the planner's plan stages and
// standby (over every worker, joiners included) at this boundary without a checkpoint, when
// neither a refill nor an extension can (issue 30, "joins without stopping"; the simulator's
// reshape): every replica of stages that runs now alike — the same workers over the same blocks —
// keeps its state and its index (proto.Keep), its own batch sized again, as long as that index is
// one of the plan's 0..R−1; every other replica of stages is new, at the indices the kept ones
// leave free, in order, its stages taking the global θ and the outer momentum from a holder of
// their blocks in a kept replica and starting from them, as a refill's do. The running replicas
// the plan does not keep leave it here: their round since the last outer step is left out of the
// next average, as a dropped replica's is (a replay's period lists only the kept ones' indices
// outside Grown, so it starts the others afresh and leaves those beyond R out), and their workers
// stand by or take a new replica's stage — from a giver, like anyone new, since the state they
// hold is another replica's. nil with expert hosts, shared batches or a pinned plan (whose
// replicas' shares or places would change under them), when nothing new is taken in, when no
// replica is kept, or when a new stage has no holder of its blocks to take its state from.
func (j *jobRun) outerReshape(stages []placement, hosts []hostPlacement, standby []string) *growth {
	if !j.phase.planned() || !j.spec.OwnBatches() || j.spec.Plan != nil || len(hosts) > 0 || len(j.hosts) > 0 || len(j.stages) == 0 || len(stages) == 0 {
		return nil
	}
	alike := func(sts []placement) string {
		var b strings.Builder
		for _, st := range sts {
			fmt.Fprintf(&b, "%s[%d,%d) ", st.peer, st.begin, st.end)
		}
		return b.String()
	}
	running := map[string]int{} // a running replica's stages → its index
	for _, rr := range j.reps {
		running[alike(j.stages[rr.lo:rr.hi])] = rr.index
	}
	planned := replicaRuns(stages)
	R := len(planned)
	index := make([]int, R) // each planned replica's index in the new plan; -1: new
	inUse := map[int]bool{}
	var holders []sched.HeldStage // the kept replicas' stages: the givers
	for k, pr := range planned {
		index[k] = -1
		if i, ok := running[alike(stages[pr.lo:pr.hi])]; ok && i < R && !inUse[i] {
			index[k], inUse[i] = i, true
			holders = append(holders, heldStages(stages[pr.lo:pr.hi])...)
		}
	}
	if len(inUse) == 0 || len(inUse) == R {
		return nil
	}
	var free []int
	for i := range R {
		if !inUse[i] {
			free = append(free, i)
		}
	}
	g := &growth{from: map[string][]sched.Part{}, standby: slices.Clone(standby)}
	given := map[string]int{}
	for k, pr := range planned {
		idx := index[k]
		if idx < 0 {
			idx, free = free[0], free[1:]
		}
		for _, st := range stages[pr.lo:pr.hi] {
			st.replica = idx
			if index[k] < 0 {
				parts := sched.Cover(holders, st.begin, st.end, given, proto.MaxGive)
				if parts == nil {
					return nil // some of these blocks no kept replica holds (a checkpoint is the only source), or each holder gives all it may
				}
				g.from[st.peer] = parts
			}
			g.stages = append(g.stages, st)
		}
	}
	// Stages come replica by replica, in index order (replicaRuns).
	slices.SortStableFunc(g.stages, func(a, b placement) int { return a.replica - b.replica })
	prof, opt, err := j.outerProfile()
	if err != nil {
		return nil
	}
	var ids []string
	seen := map[string]bool{}
	for _, st := range append(slices.Clone(j.stages), g.stages...) {
		if !seen[st.peer] {
			seen[st.peer] = true
			ids = append(ids, st.peer)
		}
	}
	g.choice = fmt.Sprintf("%d replicas, outer sync: %d kept, %d new taking the global θ from their holders, %d of the running left at the boundary",
		R, len(inUse), R-len(inUse), len(j.reps)-len(inUse))
	j.outerWeigh(g, prof, opt, j.schedReplicaPlan(j.stages, opt.MicroBatches), j.boundLinks(j.schedPeers(ids)))
	if !g.weighed {
		return nil // adds nothing the planner can price: a checkpoint and replan, weighed as one (replanWeigh)
	}
	return g
}

// outerWeigh sets what outer-mode growth g adds to the running plan current (as the replica
// planner weighs plans over peers, under prof and opt) and how long its handovers hold the job:
// each taker receives the global θ and the outer momentum of its stage's blocks from its giver,
// over the slower of their data-plane bounds (boundLinks).
func (j *jobRun) outerWeigh(g *growth, prof sched.Profile, opt sched.ReplicaOptions, current sched.Plan, peers []sched.Peer) {
	grown := j.schedReplicaPlan(g.stages, opt.MicroBatches)
	g.gain, _ = sched.ReplicasGain(prof, current, grown, peers, opt)
	link := linksOf(peers)
	var hs []sched.Handover
	for _, st := range g.stages {
		for _, p := range g.from[st.peer] {
			hs = append(hs, sched.Handover{Giver: p.Giver, Taker: st.peer, Bytes: sched.OuterHandoverBytes(prof.StageParams(p.Begin, p.End)),
				GiverBytesPerS: link[p.Giver], TakerBytesPerS: link[st.peer]})
		}
	}
	// The global θ holds everyone; the momentum follows while they train, and holds the next
	// outer step only when the round is shorter than its handover.
	round := float64(max(j.sync.roundEnd(j, j.step)-j.step, 1)) * j.lastStepSeconds
	g.stall = sched.OuterGrowStall(sched.HandoverSeconds(hs), round)
	// A gain the planner cannot price (a plan of shared batches with a replica missing is no
	// plan of its shares) is not weighed: the growth goes at once, as before.
	g.weighed = g.gain > 0
}

// replanWeigh is what a join's checkpoint and replan to the planner's plan stages would add to
// the running plan (sched.ReplicasGain, as the replica planner weighs plans) and how long it would
// hold every replica (sched.ReplanSeconds: the running stages upload their shards, the new ones
// load theirs, over their data-plane bounds); ok is false for a plan the replica planner cannot
// price — expert hosts, or either plan not replicas over the workers — which is not weighed.
func (j *jobRun) replanWeigh(stages []placement, hosts []hostPlacement) (gain, stall float64, ok bool) {
	if len(hosts) > 0 || len(j.hosts) > 0 || len(stages) == 0 || len(j.stages) == 0 {
		return 0, 0, false
	}
	prof, opt, err := j.outerProfile()
	if err != nil {
		return 0, 0, false
	}
	var ids []string
	for _, st := range append(slices.Clone(j.stages), stages...) {
		if !slices.Contains(ids, st.peer) {
			ids = append(ids, st.peer)
		}
	}
	peers := j.boundLinks(j.schedPeers(ids))
	gain, ok = sched.ReplicasGain(prof, j.schedReplicaPlan(j.stages, opt.MicroBatches), j.schedReplicaPlan(stages, opt.MicroBatches), peers, opt)
	if !ok {
		return 0, 0, false
	}
	link := linksOf(peers)
	moves := func(sts []placement) []sched.ShardMove {
		out := make([]sched.ShardMove, len(sts))
		for i, st := range sts {
			out[i] = sched.ShardMove{Params: float64(prof.StageParams(st.begin, st.end)), BytesPerS: link[st.peer], PerParam: opt.StateBytesPerParam()}
		}
		return out
	}
	return gain, sched.ReplanSeconds(moves(j.stages), moves(stages)), true
}

// linksOf is each of peers' link bound, by id.
func linksOf(peers []sched.Peer) map[string]float64 {
	link := make(map[string]float64, len(peers))
	for _, q := range peers {
		link[q.ID] = q.LinkBytesPerS
	}
	return link
}

// schedReplicaPlan is stages (a plan's, replica by replica) as the replica planner's Plan.
func (j *jobRun) schedReplicaPlan(stages []placement, M int) sched.Plan {
	p := sched.Plan{MicroBatches: M}
	for _, rr := range replicaRuns(stages) {
		r := sched.Replica{First: rr.first, MicroBatches: rr.n}
		for _, st := range stages[rr.lo:rr.hi] {
			r.Stages = append(r.Stages, sched.Stage{Begin: st.begin, End: st.end, Peer: st.peer})
		}
		p.Replicas = append(p.Replicas, r)
	}
	return p
}

// outerProfile is the replica planner's view of the job: its profile and options, churn weighed
// in, as chooseReplicas and outerExtend plan.
func (j *jobRun) outerProfile() (sched.Profile, sched.ReplicaOptions, error) {
	opt := j.spec.ReplicaOptions()
	p, _, err := j.spec.ShardJob().Profiles(j.spec.Model, j.spec.BatchSize/j.spec.MicroBatches, j.spec.MicroBatches)
	if err != nil {
		return sched.Profile{}, opt, err
	}
	opt.Churn = j.churn.churn(time.Now(), j.restorePrior())
	return p.WithWire(j.spec.Wire), opt, nil
}

// grow takes up growth g at this step boundary (see the top of this file): a new plan version
// from j.step, every stage kept or handed over, no checkpoint.
func (j *jobRun) grow(ctx context.Context, g *growth) error {
	t0 := time.Now()
	from, step := j.version, j.step
	takers := slices.Sorted(maps.Keys(g.from))
	var left []string // the workers of the replicas the plan leaves (outerReshape)
	if j.spec.Outer() {
		// The replicas the plan leaves (outerReshape) are left out of the next average, as a
		// dropped replica is: their workers' steps since the last outer step they fed reach no
		// global θ, so an audit of only such steps that one abandons rolls nothing back (audit.go:
		// abandon). A worker that holds a stage again is held to its new stage instead (adopt).
		for _, st := range j.stages {
			if slices.ContainsFunc(g.stages, func(n placement) bool { return n.peer == st.peer && len(g.from[n.peer]) == 0 }) {
				continue
			}
			left = append(left, st.peer)
			if len(g.from[st.peer]) == 0 { // a taker holds a stage again (adopt)
				j.leftOutAfter(st.peer, j.outerFed)
			}
		}
	}
	// The workers' blocks now: a taker holds none (or another replica's), a keeper its own.
	ver, err := j.keepPlan(ctx, g.stages, g.hosts, g.standby, heldBy(j.stages), g.from, func(ver uint32) {
		j.refillDue = false
		j.s.log.Info("workers join, taking their state from the workers that hold it", "takers", takers, "step", step, "plan", ver)
		j.planChoice = g.choice
	})
	if err != nil {
		return err
	}
	pairs := make([][2]string, 0, len(takers))
	for _, w := range takers {
		pairs = append(pairs, [2]string{w, strings.Join(sched.GiversOf(g.from[w]), ",")})
	}
	detail := map[string]any{"step": step, "plan": ver, "from_plan": from, "takers": pairs,
		"replicas": len(j.reps), "seconds": time.Since(t0).Seconds()}
	if handing := j.handing(); len(handing) > 0 {
		// Holders the plan left out for the takers: they gave their stages and stand by.
		detail["handed_back"] = handing
	}
	if len(left) > 0 {
		// What the reshape cost beyond its handovers: these workers' replicas' rounds since the
		// last outer step, left out of the next average.
		slices.Sort(left)
		detail["left_out"] = left
	}
	j.s.event(j.rec.ID, "pool.joined", "", detail)
	return nil
}

// gifts are what giver hands its takers in from (taker → its parts): each taker's blocks that
// giver gives, the takers in order of ids.
func gifts(giver string, from map[string][]sched.Part) []proto.Gift {
	var out []proto.Gift
	for _, t := range slices.Sorted(maps.Keys(from)) {
		for _, p := range from[t] {
			if p.Giver == giver {
				out = append(out, proto.Gift{Worker: t, Begin: p.Begin, End: p.End})
			}
		}
	}
	return out
}

// handoverOf sets a's source of state when its worker takes it from givers (from: taker → its
// parts), or what a giver hands of its kept state to its takers.
func handoverOf(worker string, a *proto.Assign, keep *proto.Keep, from map[string][]sched.Part) {
	if len(from) == 0 || keep == nil || a.Shard.Stage == nil {
		return
	}
	if parts, ok := from[worker]; ok {
		a.Restore, a.Keep = nil, nil
		a.From = make([]proto.Handover, len(parts))
		for i, p := range parts {
			a.From[i] = proto.Handover{Worker: p.Giver, FromPlan: keep.FromPlan, Step: keep.Step, Begin: p.Begin, End: p.End}
		}
		return
	}
	if a.Keep != nil {
		a.Give = gifts(worker, from)
	}
}

// disputeHandover checks a taker's Ready state against the state its givers handed it
// (handedState); a difference abandons the plan (see the top of this file).
func (j *jobRun) disputeHandover(taker string, asg *proto.Assign, state string) error {
	want, err := j.handedState(asg)
	if err == nil && want == state {
		return nil
	}
	workers := append(proto.Givers(asg.From), taker)
	detail := map[string]any{"handover": true, "workers": workers}
	if len(asg.From) > 0 {
		detail["step"] = asg.From[0].Step
	}
	if err != nil {
		detail["why"] = err.Error()
		j.s.event(j.rec.ID, "state.disputed", "", detail)
		return fmt.Errorf("%w: worker %s took up its state from %v: %v", errReplan, taker, proto.Givers(asg.From), err)
	}
	j.s.event(j.rec.ID, "state.disputed", "", detail)
	return fmt.Errorf("%w: worker %s took up another state from %v than they committed to", errReplan, taker, proto.Givers(asg.From))
}

// handedState is the digest of the state a taker assigned asg starts from, by its givers' word:
// from one giver of the same blocks, the state that giver's Ready named (in step mode its kept
// state; in outer mode the global θ with zero moments: Gave); otherwise composed, tensor by
// tensor, from the value hashes each giver's Ready listed (proto.Ready.Sums) for the blocks it
// gave — each giver's list held to its own word first, so that a giver cannot give one state
// and commit to another.
func (j *jobRun) handedState(asg *proto.Assign) (string, error) {
	if len(asg.From) == 0 || asg.Shard.Stage == nil {
		return "", errors.New("no handover")
	}
	outer := j.spec.Outer()
	word := func(p *peer) string {
		if outer {
			return p.readyGave // outer mode: the global θ with zero moments, not the giver's own state
		}
		return p.readyState
	}
	cfg := j.spec.Model
	if f := asg.From[0]; len(asg.From) == 1 {
		ga := j.audits.assigns[f.Worker]
		if g := j.peers[f.Worker]; g != nil && ga != nil && ga.Shard.Stage != nil &&
			ga.Shard.Stage.Begin == asg.Shard.Stage.Begin && ga.Shard.Stage.End == asg.Shard.Stage.End {
			return word(g), nil // a twin: its whole state
		}
	}
	// layoutOf is the state tensors of a shard: its parameters, then both moments.
	layoutOf := func(a *proto.Assign) ([]safetensors.Tensor, int, error) {
		specs, err := shardSpecs(cfg, a.Shard, hostedBy(a.ExpertHosts))
		return model.CheckpointLayout(specs), len(specs), err
	}
	// zeroMoments sets, in outer mode, the hashes of layout's moments (after its n parameters) to
	// zeros': what a giver's Gave and a taker's first state hold, whatever a giver lists.
	zero := map[int]string{} // by size
	zeroMoments := func(layout []safetensors.Tensor, n int, sums map[string]string) {
		if !outer {
			return
		}
		for _, t := range layout[n:] {
			size := safetensors.Elements(t.Shape)
			if _, ok := zero[size]; !ok {
				zero[size] = zeroSum(size)
			}
			sums[t.Name] = zero[size]
		}
	}
	sums := map[string]string{}
	for _, f := range asg.From {
		g, ga := j.peers[f.Worker], j.audits.assigns[f.Worker]
		if g == nil || ga == nil {
			return "", fmt.Errorf("giver %s: gone, or not assigned", f.Worker)
		}
		layout, n, err := layoutOf(ga)
		if err != nil {
			return "", fmt.Errorf("giver %s: %w", f.Worker, err)
		}
		named := make(map[string]string, len(layout))
		for _, d := range g.readySums {
			named[d.Key] = d.Digest
		}
		zeroMoments(layout, n, named)
		if d, err := audit.ComposeState(layout, named); err != nil || d != word(g) {
			return "", fmt.Errorf("giver %s: the hashes of what it gave (%d) are not of the state it committed to (%v)", f.Worker, len(g.readySums), err)
		}
		for _, t := range layout {
			if blk, ok := cfg.BlockOf(model.StateParam(t.Name)); ok && blk >= f.Begin && blk < f.End {
				sums[t.Name] = named[t.Name]
			}
		}
	}
	layout, n, err := layoutOf(asg)
	if err != nil {
		return "", err
	}
	zeroMoments(layout, n, sums) // a taker's moments start at zero (grown)
	return audit.ComposeState(layout, sums)
}

// zeroSum is the value hash (audit.NewValueHash) of n float32 zeros: a fresh moment's.
func zeroSum(n int) string {
	h := audit.NewValueHash()
	for left := 4 * n; left > 0; left -= len(zeroBytes) {
		h.Write(zeroBytes[:min(left, len(zeroBytes))])
	}
	return proto.EncodeDigest(h.Sum(nil))
}

// zeroBytes are float32 zeros' bytes, read and never written: pages the kernel backs with its one
// zero page.
var zeroBytes [4 << 20]byte

// peersOf are the workers of stages, in order.
func peersOf(stages []placement) []string {
	out := make([]string, len(stages))
	for i, st := range stages {
		out[i] = st.peer
	}
	return out
}
