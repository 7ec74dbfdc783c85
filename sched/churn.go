package sched

import "fmt"

// Churn is what the planner knows of departures: how often a peer leaves without warning, and
// what a departure costs a plan in which nobody else holds the departed peer's state. Plans are
// weighed by their expected goodput — the tokens per second that reach an applied step — rather
// than by their speed alone (docs/design.md, "Churn-aware planning"):
//
//	goodput = TokensPerS / (1 + Λ·C)
//
// Λ = PerPeerRate · the plan's peers is the plan's rate of departures, and C the seconds of the
// plan's work each one costs (a renewal argument: every 1/Λ seconds of work a departure adds C
// seconds in which nothing is applied, or work is thrown away):
//
//   - one pipeline: RestoreSeconds — every stage is its holder's alone, so its loss restores every
//     shard from the newest checkpoint and replays the steps since;
//   - step-mode replicas: one step, the step in flight, which the survivors recompute after a
//     reshare (the rule book's Reshare; nothing is restored, nothing else is replayed);
//   - outer-mode replicas: the departed replica's share of the round in flight — on average half a
//     round of one replica's work, a 1/R share of the plan's (its round is left out of the average).
//
// The zero Churn (no departure seen) weighs plans by their speed alone, as before.
type Churn struct {
	// PerPeerRate is unannounced departures per peer-second (a killed process, a closed tab).
	PerPeerRate float64 `json:"per_peer_rate"`
	// RestoreSeconds is what a restore costs: the time from a departure until the job is back at
	// the step it had reached (reload, replay).
	RestoreSeconds float64 `json:"restore_seconds"`
}

// departureCost is C above for a plan of R replicas taking stepSeconds a step.
func (c Churn) departureCost(R int, stepSeconds float64, opt ReplicaOptions) float64 {
	switch {
	case R < 2:
		return c.RestoreSeconds
	case opt.Sync == SyncOuter:
		return float64(opt.Every) * stepSeconds / 2 / float64(R)
	default:
		return stepSeconds
	}
}

// Goodput is e's expected goodput under c for a plan of peers peers and e.Replicas replicas (see
// Churn): e.TokensPerS when no departures are expected.
func (c Churn) Goodput(e Estimate, peers int, opt ReplicaOptions) float64 {
	if c.PerPeerRate <= 0 || peers <= 0 {
		return e.TokensPerS
	}
	return e.TokensPerS / (1 + c.PerPeerRate*float64(peers)*c.departureCost(e.Replicas, e.StepSeconds, opt))
}

func (c Churn) String() string {
	if c.PerPeerRate <= 0 {
		return "no departures seen"
	}
	return fmt.Sprintf("a departure every %.0f peer-seconds, a restore costing %.0f s", 1/c.PerPeerRate, c.RestoreSeconds)
}
