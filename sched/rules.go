package sched

import (
	"math"
	"slices"
)

// The rule book (issue 30): what a running job does when its membership changes — a worker
// leaves, or workers join. One pure function, Decide, that the coordinator's job loop calls on
// every departure and join and acts on, and that the fleet simulator calls for its fault path, so
// that the simulator's figures are the system's. It lists only actions the coordinator performs;
// a rule the coordinator does not implement (stage pools rerouting a lost peer's in-flight
// micro-batches within a replica) is not here, and everything it would cover restores.

// Phase is where a running plan is when its membership changes.
type Phase int

const (
	// PhaseBoundary: between steps (or outer mode's rounds) — an evaluation, a checkpoint, an
	// admin pause, the wait for a join replan's checkpoint.
	PhaseBoundary Phase = iota
	// PhaseLoading: the plan's shards are being assigned and restored; no step has run under it.
	PhaseLoading
	// PhaseTraining: a step is in flight, or in outer mode a round of free-running replicas.
	PhaseTraining
	// PhaseExchange: outer mode, an outer step without a delay is being exchanged and not yet
	// committed (proto.OuterSync): nobody has applied it, so it can be asked again without a
	// replica that leaves.
	PhaseExchange
)

// MemberReplica is one pipeline replica of the running plan as the rule book sees it.
type MemberReplica struct {
	// Index is the replica's index in the plan: its data seed with own batches and its place in
	// an outer step. A replica keeps its index when another is dropped.
	Index int
	Peers []string // its stages' workers, in pipeline order
}

// Membership is the running plan: its replicas, expert hosts and sync mode, and where it is.
type Membership struct {
	Sync     SyncMode
	Replicas []MemberReplica
	Hosts    []string // expert hosts, which serve every replica
	Phase    Phase
	// Pinned: the job states its plan, which has no place for workers that join.
	Pinned bool
	// Restoring: the plan loading (PhaseLoading) restores every shard from a checkpoint; none
	// is kept or handed over between peers, so its replicas load independently of each other.
	Restoring bool
	// LoadReroutes: step mode, the plan loading takes no stage's state from another worker, so
	// its replicas load independently: one lost meanwhile is left out, and its micro-batches of
	// the first step go to the others (Reroute).
	LoadReroutes bool
}

// Change is a membership change: a departure (Left) or joins (Joined > 0).
type Change struct {
	// Left is the worker that left; "" for joins.
	Left string
	// Joined is how many connected workers neither the plan nor its standbys hold.
	Joined int
	// JoinGapElapsed: the last replan for joins was long enough ago (they are spaced, so that a
	// wave of joins costs one checkpoint and one replan).
	JoinGapElapsed bool
	// PlanKept: the planner's plan over every connected worker is the running one, so the
	// newcomers would only stand by. Read only when JoinGapElapsed (it costs a planner call).
	PlanKept bool
	// PeerState: the planner's plan over every connected worker puts each stage on the worker
	// holding it now or on one whose blocks holders that stay can hand it, each its run (Givers;
	// step mode; expert hosts, if any, the same and keeping their experts); in outer mode, every replica dropped
	// since the plan began can be staffed again by newcomers and standbys, each stage taking the
	// global θ and the outer momentum from a holder of its blocks. Read only when JoinGapElapsed.
	PeerState bool
	// GrowWaits: PeerState, but what the grow adds has not yet repaid the stall of its handovers
	// (GrowDeferral): the newcomers stand by, and the grow is weighed again at the next boundary.
	GrowWaits bool
	// GrowLater: PeerState, but in outer mode with a delay an outer step is pending at this
	// boundary, which the takers could not take up: the newcomers stand by, and the grow is
	// weighed again at the first boundary after the take-up (which the round ends at).
	GrowLater bool
	// ReplanWaits: neither PlanKept nor PeerState — the newcomers could join only by a checkpoint
	// and a replan of everyone — but what the planner's plan adds over the running one has not yet
	// repaid the stall that costs (every stage uploads its shard, every stage of the new plan
	// loads one: ReplanSeconds; weighed as a grow is, GrowDeferral.ReplanDue): the newcomers stand
	// by, and the replan is weighed again at the next boundary.
	ReplanWaits bool
}

// Action is what the job does about a membership change.
type Action int

const (
	// KeepGoing: nothing the plan holds changed (the worker held no shard; nobody joined).
	KeepGoing Action = iota
	// DropReplica: outer mode, the departed worker's replica leaves the plan at once; the other
	// replicas carry on without a restore, and the dropped one's round is left out of the next
	// outer average (its inner steps since the last outer step are lost).
	DropReplica
	// Restore: the plan is abandoned; the job replans with the workers it has and every shard
	// restarts from the newest complete checkpoint, replaying the steps since.
	Restore
	// Standby: the newcomers stand by; the plan stays.
	Standby
	// WaitForGap: the newcomers wait until the gap since the last join replan has passed.
	WaitForGap
	// CheckpointReplan: at this step boundary the job takes a checkpoint of the step and
	// replans from it over everyone, so that nothing is replayed (every shard is reloaded).
	CheckpointReplan
	// Reshare: step mode, the departed worker's replica leaves the plan and the surviving
	// replicas share its micro-batches from the step in flight on: every survivor keeps the
	// state it holds (no restore, no replay), the step in flight is computed again by them, and
	// its gradient — summed in the same fixed order over the same micro-batches — is the same
	// bits. What is lost is the step's work in flight.
	Reshare
	// Reroute: step mode, during a step: the departed worker's replica leaves, and the replicas
	// beside it compute its micro-batches of the step in flight as well as their own
	// (RerouteShares), keeping what they have computed; nobody restarts the step. At the step's
	// end the survivors share its micro-batches from then on (a Reshare at the boundary, which
	// computes nothing again). What is lost is the departed replica's work on the step.
	Reroute
	// Grow: at this step boundary the job takes a plan over the newcomers too without a
	// checkpoint. Step mode: the planner's plan over everyone, each stage that moves to a
	// newcomer (or to another worker) taking its state from a twin that keeps it, peer to peer,
	// and every other stage keeping its own; a replica dropped earlier is refilled this way.
	// Outer mode: the replicas dropped since the plan began are staffed again at their indices,
	// each stage taking the global θ and the outer momentum from a holder of its blocks and
	// starting from them as a new replica; the others keep their own state.
	Grow
)

func (a Action) String() string {
	switch a {
	case KeepGoing:
		return "keep going"
	case DropReplica:
		return "drop replica"
	case Restore:
		return "restore"
	case Standby:
		return "standby"
	case WaitForGap:
		return "wait"
	case CheckpointReplan:
		return "checkpoint and replan"
	case Reshare:
		return "reshare"
	case Reroute:
		return "reroute"
	case Grow:
		return "grow"
	}
	return "unknown"
}

// Decision is the rule book's answer to a membership change.
type Decision struct {
	Action Action
	// Replica is the dropped replica's Index (DropReplica, Reshare), -1 otherwise.
	Replica int
	// Why says which rule applied, for the job's events.
	Why string
}

// Decide is the rule book: what the job does about change c to the running plan m.
//
// A departure of a worker the plan does not hold changes nothing. In step mode, a worker of a
// replica lost during a step or at a boundary is dropped with its replica, and the others share
// its micro-batches, provided another replica survives: during a step the replicas beside it take
// its share of the step in flight on top of their own (Reroute), at a boundary — or when expert
// hosts serve the replicas — the survivors compute the step again under new shares (Reshare); expert hosts, which serve every
// replica, keep their experts and serve the survivors' new shares (an expert host's own departure
// restores: nobody else holds its experts). In outer mode, a worker of a
// replica lost while the replicas run free in a round is dropped with its replica, provided
// another replica survives and no expert host serves the replicas (outer plans have none) — even
// while a delayed outer step is half asked (some replicas asked it as they finished the step
// before it, others not yet): the coordinator asks the next attempt of those asked, and the rest
// that attempt as they finish. An outer step without a delay is taken in two phases
// (proto.OuterSync): while it is exchanged and not yet committed (PhaseExchange) nobody has applied
// it, so a replica lost then is dropped too and the others take the step again without it; so is
// one lost while a plan restores from a checkpoint (Restoring), the others loading on, and one
// lost at a boundary — paused, checkpointing, or while a refill's plan gets ready (the others
// hold their state) — which the others go on without from that step. A delayed outer step
// asked of every replica has the same two phases, beside training: a replica lost before its
// commit is dropped, and the others take that step again without it while they train on (no
// restore). Every other departure of a holder restores from the newest complete checkpoint.
//
// Joins wait for the join gap, then stand by when the planner would keep the plan; they join it without a checkpoint
// (Grow) when every stage of the planner's plan over everyone is held now by its worker or by a
// twin that stays and can hand it over (step mode; expert hosts stay and serve the new replicas too) — which refills a pinned plan
// that lost replicas too — or, in outer mode, when they can staff again every replica dropped
// since the plan began — unless such a grow would hold every replica longer than what it adds has
// repaid so far (GrowWaits: they stand by, GrowDeferral), or while a delayed outer step is
// pending (GrowLater: they stand by until its take-up); otherwise the job checkpoints and
// replans (never a pinned one) — once what the planner's plan adds has repaid the stall of the
// checkpoint and the reload (ReplanWaits: they stand by until then).
func Decide(m Membership, c Change) Decision {
	if c.Left == "" {
		switch {
		case c.Joined == 0:
			return Decision{Action: KeepGoing, Replica: -1, Why: "no worker waits for a place in the plan"}
		case !c.JoinGapElapsed:
			return Decision{Action: WaitForGap, Replica: -1, Why: "joins are spaced: the last join replan was too recent"}
		case c.PlanKept && m.Pinned:
			return Decision{Action: KeepGoing, Replica: -1, Why: "the pinned plan is fully staffed: it has no place for the newcomers"}
		case c.PlanKept:
			return Decision{Action: Standby, Replica: -1, Why: "the planner keeps the plan: the newcomers stand by"}
		case c.PeerState && c.GrowLater:
			return Decision{Action: Standby, Replica: -1, Why: "a delayed outer step is pending, which the takers could not take up: the newcomers stand by until the boundary after its take-up"}
		case c.PeerState && c.GrowWaits:
			return Decision{Action: Standby, Replica: -1, Why: "a grow would hold every replica for its handovers longer than what it adds has repaid so far: the newcomers stand by until it does"}
		case c.PeerState:
			return Decision{Action: Grow, Replica: -1, Why: "the newcomers take their stages' state from the workers holding it: no checkpoint, the others keep theirs"}
		case m.Pinned:
			return Decision{Action: KeepGoing, Replica: -1, Why: "a pinned plan is replanned for joins only to refill it from peers"}
		case c.ReplanWaits:
			return Decision{Action: Standby, Replica: -1, Why: "a checkpoint and replan would hold every replica longer than what the planner's plan adds has repaid so far: the newcomers stand by until it does"}
		}
		return Decision{Action: CheckpointReplan, Replica: -1, Why: "the planner places the newcomers: checkpoint this step and replan from it"}
	}
	r := slices.IndexFunc(m.Replicas, func(r MemberReplica) bool { return slices.Contains(r.Peers, c.Left) })
	if r < 0 && !slices.Contains(m.Hosts, c.Left) {
		return Decision{Action: KeepGoing, Replica: -1, Why: "the worker held no shard of the plan"}
	}
	restore := func(why string) Decision { return Decision{Action: Restore, Replica: -1, Why: why} }
	switch {
	case r < 0:
		return restore("an expert host left: its experts have no other holder")
	case m.Sync != SyncOuter:
		switch {
		case len(m.Replicas) < 2:
			return restore("the last replica left")
		case m.Phase == PhaseLoading && m.LoadReroutes && len(m.Hosts) == 0:
			return Decision{Action: Reroute, Replica: m.Replicas[r].Index, Why: "step mode while the plan loads: the other replicas load on, and those beside it take its micro-batches of the first step"}
		case m.Phase == PhaseLoading:
			return restore("step mode while the plan loads: a survivor takes its state from another worker, or expert hosts serve every replica")
		case m.Phase == PhaseTraining && len(m.Hosts) == 0:
			return Decision{Action: Reroute, Replica: m.Replicas[r].Index, Why: "step mode, during a step: the replicas beside it compute its micro-batches of the step too, keeping their own work"}
		}
		return Decision{Action: Reshare, Replica: m.Replicas[r].Index, Why: "step mode: the other replicas share its micro-batches from the step in flight, each keeping its state"}
	case m.Phase == PhaseLoading && m.Restoring && len(m.Replicas) >= 2 && len(m.Hosts) == 0:
		return Decision{Action: DropReplica, Replica: m.Replicas[r].Index, Why: "outer mode while a restore loads: the other replicas load on without it, from the same checkpoint"}
	case m.Phase == PhaseExchange && len(m.Replicas) >= 2 && len(m.Hosts) == 0:
		return Decision{Action: DropReplica, Replica: m.Replicas[r].Index, Why: "outer mode, during an outer exchange: the others take the outer step again without it (it is left out of it, and of the rounds after)"}
	case m.Phase == PhaseBoundary && len(m.Replicas) >= 2 && len(m.Hosts) == 0:
		return Decision{Action: DropReplica, Replica: m.Replicas[r].Index, Why: "outer mode at a boundary (paused, checkpointing, or a refill getting ready): the others go on from this step without it; its inner steps since the last outer step are left out"}
	case m.Phase != PhaseTraining:
		return restore("outer mode outside a round: the plan is loading from a checkpoint or the seed")
	case len(m.Replicas) < 2:
		return restore("the last replica left")
	case len(m.Hosts) > 0:
		return restore("expert hosts serve every replica")
	}
	return Decision{Action: DropReplica, Replica: m.Replicas[r].Index, Why: "outer mode: the other replicas carry on; the replica's round is left out of the next outer average"}
}

// RerouteShares is a step's micro-batches after the replicas at the positions lost left during
// it: the runs of the survivors, in order, each its old run (runs: contiguous, in replica order)
// widened by the lost runs next to it. A lost run between two survivors is split between them in
// proportion to their old runs' lengths (which the planner sized to their speed), one at an end
// goes whole to its one neighbour. So every survivor keeps what it computed, each run stays
// contiguous, and the runs still tile the step: the gradient tree sums the same nodes
// (model.Shard.ExtendGradients). nil when nobody survives.
func RerouteShares(runs [][2]int, lost []bool) [][2]int {
	var out [][2]int
	var pos []int // out's replica positions
	for i, r := range runs {
		if !lost[i] {
			out = append(out, r)
			pos = append(pos, i)
		}
	}
	if len(out) == 0 {
		return nil
	}
	out[0][0] = runs[0][0]
	out[len(out)-1][1] = runs[len(runs)-1][1]
	for k := 0; k+1 < len(out); k++ {
		lo, hi := out[k][1], out[k+1][0]
		if lo == hi {
			continue
		}
		a, b := runs[pos[k]][1]-runs[pos[k]][0], runs[pos[k+1]][1]-runs[pos[k+1]][0]
		cut := lo + int(math.Round(float64(hi-lo)*float64(a)/float64(a+b)))
		out[k][1], out[k+1][0] = cut, cut
	}
	return out
}

// A round of outer mode's free-running replicas ends with all of them standing still
// (coordinator/round.go, roundEnd): at an outer step without a delay, an evaluation, a
// checkpoint, and at least every RoundSteps steps, so that admin commands, joins and checkpoints
// by time wait no longer than a round. Every round's end is a barrier: a replica that vanished
// shortly before it holds all the others there until its departure is noticed. At fleet scale a
// replica leaves every few seconds, so a round of 20 steps of 0.07 s (10,000 simulated peers)
// waited at nearly every end: 0.61 of the fleet's work synchronised with departures noticed in
// 1.6 s there (docs/benchmarks.md). So a round is bounded by time too, as long as RoundSeconds.
const (
	// MinRoundSteps is the fewest steps a round is bounded at, whatever its steps take.
	MinRoundSteps = 20
	// RoundSeconds is how long, at the steps' measured pace, a round may run.
	RoundSeconds = 30
	// MaxRoundSteps bounds RoundSteps (replicas run at most a round apart: what the coordinator
	// keeps of each outer step's commitments is bounded by it).
	MaxRoundSteps = 2000
)

// RoundSteps is the most steps a round of outer mode runs before every replica stands still,
// for steps of stepSeconds each (0: not measured yet).
func RoundSteps(stepSeconds float64) int {
	n := MinRoundSteps
	if stepSeconds > 0 {
		n = max(n, int(RoundSeconds/stepSeconds))
	}
	return min(n, MaxRoundSteps)
}
