package sched

import (
	"fmt"
	"math"
)

// Churn is what the planner knows of departures: how often a peer leaves without warning, and
// what a departure costs a plan in which nobody else holds the departed peer's state. Plans are
// weighed by their expected goodput — the tokens per second that reach an applied step — rather
// than by their speed alone (docs/design.md, "Churn-aware planning"):
//
//	goodput = TokensPerS · e^(−Λ·C)
//
// Λ = PerPeerRate · the plan's peers is the plan's rate of departures, and C the seconds of the
// plan's work each one costs:
//
//   - one pipeline: RestoreSeconds — every stage is its holder's alone, so its loss restores every
//     shard from the newest checkpoint and replays the steps since;
//   - step-mode replicas: one step, the step in flight, which the survivors recompute after a
//     reshare (the rule book's Reshare; nothing is restored, nothing else is replayed);
//   - outer-mode replicas: the departed replica's share of the round in flight — on average half a
//     round of one replica's work, a 1/R share of the plan's (its round is left out of the average).
//
// Departures do not wait for the job: one during a recovery starts it again. With departures a
// Poisson process, a recovery of C seconds takes (e^(ΛC) − 1)/Λ on average, and the share of the
// time the plan trains is e^(−ΛC) — not 1/(1 + ΛC), which counts each departure once and, at a
// departure every 10 s and a 20 s restore, promises a third of the speed where the job keeps none.
// For a step-mode replica's C of a second or two, the two agree.
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
	return e.TokensPerS * math.Exp(-c.PerPeerRate*float64(peers)*c.departureCost(e.Replicas, e.StepSeconds, opt))
}

// RestoreFromRecoveries is a restore's uninterrupted cost C, from what a job measured: perFailure
// seconds of recovery per failure — a recovery shared by every departure that started it again —
// at rate departures per second of the plans it ran. Departures at rate Λ into recoveries of C
// seconds make (1 − e^(−ΛC))/Λ seconds a failure (see Churn), so C = −ln(1 − Λ·perFailure)/Λ;
// a job that never got back (Λ·perFailure near 1) gets MaxRestoreSeconds.
func RestoreFromRecoveries(perFailure, rate float64) float64 {
	if rate <= 0 {
		return perFailure
	}
	x := rate * perFailure
	if x >= 1-1e-9 {
		return MaxRestoreSeconds
	}
	return min(-math.Log1p(-x)/rate, MaxRestoreSeconds)
}

// MaxRestoreSeconds caps a restore's estimated cost: a day, for a job that never got back.
const MaxRestoreSeconds = 86400

func (c Churn) String() string {
	if c.PerPeerRate <= 0 {
		return "no departures seen"
	}
	return fmt.Sprintf("a departure every %.0f peer-seconds, a restore costing %.0f s", 1/c.PerPeerRate, c.RestoreSeconds)
}

// CheckpointInterval is how often a job that restores rate times a second should checkpoint when
// a checkpoint costs it cost seconds: Young's first-order optimum √(2·cost/rate) (J. W. Young,
// "A first order approximation to the optimum checkpoint interval", CACM 1974), which balances the
// checkpoints' cost against the work a restore replays — on average half an interval. +Inf when
// the job has not restored (rate 0): the job's own checkpoint_every stands alone.
func CheckpointInterval(cost, rate float64) float64 {
	if !(rate > 0) || !(cost > 0) {
		return math.Inf(1)
	}
	return math.Sqrt(2 * cost / rate)
}
