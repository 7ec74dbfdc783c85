package sched

import "math"

// When to grow (issue 30, "joins without stopping"; issue 31, synchronised goodput). A grow — a
// refill of dropped replicas, or new replicas beside the running ones — takes joiners in without a
// checkpoint, but it still holds every replica at the boundary while the takers receive their
// stages' state (the global θ, 4 bytes a parameter, over the slower of the giver's and the
// taker's links; the outer momentum follows while they train, OuterGrowStall). On a fleet that is
// seconds, and joins come every few seconds:
// taking each in at once held the simulated default job (1,000 peers) still for over a third of
// its time. What a grow adds, though, is a few percent of the job's throughput from each joiner,
// and a joiner that waits a round as a standby loses that little. So a grow waits until what the
// waiting has forgone repays the stall — the rent-or-buy rule (ski rental): with joiners arriving
// steadily, it grows about every √(2·stall/(gain rate)) seconds, which costs at most twice the
// best schedule in hindsight, whatever the arrivals. A grow that already repays its stall within
// the next round goes at once, which is every grow on a quiet fleet or a fast link.
//
// A join the job cannot take up from peers — the planner's plan over everyone has another shape —
// costs more: a checkpoint (every stage uploads its shard) and a replan (every stage of the new
// plan loads one), tens of seconds on a fleet, with every replica held meanwhile. It was taken at
// every join gap the planner's plan differed, and on the simulated default job (1,000 peers, outer
// mode) those replans held the fleet still for 11–16% of its time, for plans a percent or two
// better. So it is weighed by the same rule (ReplanDue): it goes once what the new plan adds has
// repaid its stall — at once when that is large, as after departures the running plan could not
// refill, or when the shards move in under a second.

// GrowLookahead is how many rounds ahead a grow is counted when it is first weighed: one that
// repays its stall within them goes at once, since waiting could only lose what it adds. (On a
// fleet a joiner adds a fraction of a percent a round against seconds of stall, and waits; in a
// job of a few workers one adds a third or a half, and goes.)
const GrowLookahead = 4

// GrowMinStall is the shortest stall weighed: a grow whose handovers take less goes at once. The
// estimate counts bytes over links, not the new plan's Assigns and links, which take a round of
// messages whatever moves; against those a shorter handover is noise.
const GrowMinStall = 1.0

// GrowDeferral is a job's grow that waits (see above): what its waiting has forgone so far.
type GrowDeferral struct {
	waiting bool
	forgone float64 // seconds of the job's whole throughput forgone while it waited
	last    float64 // when it was last weighed, in the caller's seconds
}

// Due weighs, at now (seconds), a grow that would raise the job's throughput by the fraction gain
// and hold every replica stall seconds, next being the time to the next chance to grow (a round):
// true when the time forgone by waiting since it was first weighed, with GrowLookahead rounds'
// more, repays the stall; it then forgets the wait. Otherwise the grow waits, and Waiting says so.
func (d *GrowDeferral) Due(now, gain, stall, next float64) bool {
	if !(gain > 0) || math.IsInf(gain, 1) || stall < GrowMinStall {
		*d = GrowDeferral{}
		return gain > 0 // nothing to weigh: a grow that adds something and holds nobody long, or one from nothing
	}
	if d.waiting {
		d.forgone += gain * max(now-d.last, 0)
	}
	d.waiting, d.last = true, now
	if d.forgone+gain*GrowLookahead*max(next, 0) >= stall {
		*d = GrowDeferral{}
		return true
	}
	return false
}

// ReplanDue is Due for a join's checkpoint and replan: gain what the planner's plan adds over the
// running one, stall its ReplanSeconds. A replan that holds nobody for long (under GrowMinStall)
// goes at once whatever its gain, as every replan did before it was weighed: the planner chose its
// plan. One that would hold the job for longer and adds nothing waits. (A plan the replica planner
// cannot price — expert hosts, a pipeline's — is not weighed: it goes, as before.)
func (d *GrowDeferral) ReplanDue(now, gain, stall, next float64) bool {
	if stall < GrowMinStall {
		*d = GrowDeferral{}
		return true
	}
	return d.Due(now, gain, stall, next)
}

// ReplanDominates says whether a join's checkpoint and replan beats a grow outright: it adds at
// least as much (replanGain ≥ growGain, each a fraction of the running plan's throughput) and
// holds the job for less (replanStall < growStall, seconds). Then the grow is not taken. A grow
// that takes the planner's very plan from peers (an outer-mode reshape) adds what the replan
// would; its handovers go over the givers' uplinks, a few givers to many takers one after
// another, and on the simulated 1B fleet took 1.5–1.8× the replan's checkpoint and reload.
func ReplanDominates(growGain, growStall, replanGain, replanStall float64) bool {
	return replanGain >= growGain && replanStall < growStall
}

// Waiting says whether a grow waits: the boundaries after it must weigh it again even when nobody
// new joined (its joiners stand by).
func (d *GrowDeferral) Waiting() bool { return d.waiting }

// Forget drops a waiting grow: the plan changed under it, or it can no longer be made.
func (d *GrowDeferral) Forget() { *d = GrowDeferral{} }

// Handover is one stage's state handed from a giver to a taker at a grow.
type Handover struct {
	Giver, Taker                   string
	Bytes                          float64
	GiverBytesPerS, TakerBytesPerS float64
}

// HandoverSeconds is how long handovers hs hold a grow: each giver sends its takers one after
// another over its link, each taker receives its parts over its own; the longest. Links of no speed are
// taken at 1 MB/s.
func HandoverSeconds(hs []Handover) float64 {
	sent, taken := map[string]float64{}, map[string]float64{}
	longest := 0.0
	for _, h := range hs {
		up, down := h.GiverBytesPerS, h.TakerBytesPerS
		if !(up > 0) {
			up = 1e6
		}
		if !(down > 0) {
			down = 1e6
		}
		// A taker of several givers' parts (Cover) receives them all over its one link.
		sent[h.Giver] += h.Bytes / up
		taken[h.Taker] += h.Bytes / down
		longest = max(longest, sent[h.Giver], taken[h.Taker])
	}
	return longest
}

// ShardMove is one stage's shard of params parameters moved over its worker's link, PerParam
// bytes a parameter (ReplicaOptions.StateBytesPerParam; 0: LoadBytesPerParam, step mode's).
type ShardMove struct {
	Params    float64
	BytesPerS float64
	PerParam  float64
}

// ShardSeconds is how long moving shards takes, every stage over its own link at once: the
// longest. Links of no speed are taken at 1 MB/s.
func ShardSeconds(shards []ShardMove) float64 {
	t := 0.0
	for _, m := range shards {
		bps := m.BytesPerS
		if !(bps > 0) {
			bps = 1e6
		}
		per := m.PerParam
		if !(per > 0) {
			per = LoadBytesPerParam
		}
		t = max(t, per*m.Params/bps)
	}
	return t
}

// StateBytesPerParam is what a stage's shard in a checkpoint holds a parameter, which a
// checkpoint uploads and a restore downloads (coordinator: restoreFor; client: restore): step
// mode's weight and AdamW's two moments, 12; in outer mode the global part — θ and the outer
// momentum, and with Int8 the average's error feedback — and its replica's — θ_r, its two
// moments, and with Int8 its error feedback: 20, or 28 with Int8. (A checkpoint taken while a
// delayed outer step is pending holds each replica's snapshot too, 4 more, left out here.)
func (o ReplicaOptions) StateBytesPerParam() float64 {
	if o.Sync != SyncOuter {
		return LoadBytesPerParam
	}
	if o.Int8 {
		return 28
	}
	return 20
}

// ReplanSeconds is how long a join's checkpoint and replan holds every replica: the running
// plan's stages upload their shards (the checkpoint), then the new plan's stages load theirs.
func ReplanSeconds(running, next []ShardMove) float64 {
	return ShardSeconds(running) + ShardSeconds(next)
}

// OuterHandoverBytes is what a taker of blocks holding params parameters receives at an
// outer-mode grow before it is Ready, holding every replica: the global θ, float32. The outer
// momentum (as many bytes again) follows while everyone trains, since nobody reads it before the
// next outer step (client: giveState, takeState); OuterGrowStall counts what of it the round
// does not hide.
func OuterHandoverBytes(params int64) float64 { return GradBytesPerParam * float64(params) }

// OuterGrowStall is how long an outer-mode grow holds the job: its handovers of the global θ,
// theta seconds (HandoverSeconds of OuterHandoverBytes), and then what of the momentum's as many
// bytes a round of round seconds does not hide — the next outer step waits for it.
func OuterGrowStall(theta, round float64) float64 { return theta + max(0, theta-round) }

// ReplicasGain is how much more a grown plan of replicas (AddReplicas, current with dropped
// replicas staffed again, or the planner's plan over everyone) is expected to train than current,
// as a fraction of current's objective (its expected goodput, churn weighed in): +Inf when current
// trains nothing. ok is false when either plan is not one of replicas over peers, which the
// replica planner cannot price.
func ReplicasGain(prof Profile, current, grown Plan, peers []Peer, opt ReplicaOptions) (gain float64, ok bool) {
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return 0, false
	}
	sorted, err := checkPeers(peers)
	if err != nil {
		return 0, false
	}
	byID := make(map[string]Peer, len(sorted))
	for _, q := range sorted {
		byID[q.ID] = q
	}
	pl := newReplicaPlanner(prof, opt)
	objective := func(p Plan) (float64, bool) {
		cs, err := pl.fromPlan(p, byID)
		if err != nil {
			return 0, false
		}
		return pl.objective(cs), true
	}
	a, ok := objective(current)
	if !ok {
		return 0, false
	}
	b, ok := objective(grown)
	if !ok {
		return 0, false
	}
	if a <= 0 {
		if b > 0 {
			return math.Inf(1), true
		}
		return 0, true
	}
	return b/a - 1, true
}
