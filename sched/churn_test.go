package sched

import (
	"fmt"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// TestChurnGoodput: the expected goodput of churn.go — a restore's seconds for one pipeline, a
// step for step-mode replicas, half a replica's round for outer mode — and speed alone without
// departures.
func TestChurnGoodput(t *testing.T) {
	e := Estimate{Replicas: 1, StepSeconds: 2, TokensPerS: 1000}
	c := Churn{PerPeerRate: 0.01, RestoreSeconds: 30}
	for _, tc := range []struct {
		name  string
		c     Churn
		R     int
		opt   ReplicaOptions
		peers int
		want  float64
	}{
		{"none", Churn{}, 1, ReplicaOptions{}, 8, 1000},
		{"pipeline", c, 1, ReplicaOptions{}, 4, 1000 * math.Exp(-0.04*30)},
		{"step replicas", c, 2, ReplicaOptions{}, 4, 1000 * math.Exp(-0.04*2)},
		{"outer replicas", c, 4, ReplicaOptions{Sync: SyncOuter, Every: 20}, 8, 1000 * math.Exp(-0.08*20*2/2/4)},
	} {
		e.Replicas = tc.R
		if got := tc.c.Goodput(e, tc.peers, tc.opt); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: goodput %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestRestoreFromRecoveries: the uninterrupted restore behind a measured time per failure, and
// back again; a job that never got back costs the most.
func TestRestoreFromRecoveries(t *testing.T) {
	const rate, C = 0.1, 20.0
	perFailure := (1 - math.Exp(-rate*C)) / rate
	if got := RestoreFromRecoveries(perFailure, rate); math.Abs(got-C) > 1e-9 {
		t.Errorf("C %v from %v s a failure, want %v", got, perFailure, C)
	}
	if got := RestoreFromRecoveries(10, 0.1); got != MaxRestoreSeconds {
		t.Errorf("a failure every 10 s, each costing all of it: C %v, want the most", got)
	}
	if got := RestoreFromRecoveries(7, 0); got != 7 {
		t.Errorf("no rate: C %v, want the measurement", got)
	}
}

// TestPlanReplicasUnderChurn: eight like peers on the default model in step mode. Weighed by
// speed, one pipeline wins (replicas exchange the whole gradient every step); with a departure
// every 80 peer-seconds and restores of 30 s, replicas — whose departures cost a step, not a
// restore — win, and their expected goodput beats the pipeline's.
func TestPlanReplicasUnderChurn(t *testing.T) {
	prof := mustProfile(t, model.DefaultConfig(), 2)
	var peers []Peer
	for i := range 8 {
		peers = append(peers, Peer{ID: fmt.Sprintf("w%d", i), GFLOPS: 100, MemoryBytes: 2 << 30, LinkBytesPerS: 32e6})
	}
	opt := ReplicaOptions{MicroBatches: 8}
	calm, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	opt.Churn = Churn{PerPeerRate: 1.0 / 80, RestoreSeconds: 30}
	churned, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	checkReplicaPlan(t, prof, churned, peers, opt)
	if len(calm.Pipelines()) != 1 || len(churned.Replicas) < 2 {
		t.Fatalf("%d replicas without churn, %d with it: want 1, then more", len(calm.Pipelines()), len(churned.Replicas))
	}
	one, err := EstimateReplicas(prof, calm, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	many, err := EstimateReplicas(prof, churned, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !(many.GoodputTokensPerS > one.GoodputTokensPerS) || !(one.TokensPerS > one.GoodputTokensPerS) {
		t.Errorf("goodput: %d replicas %.0f of %.0f tokens/s, one pipeline %.0f of %.0f", len(churned.Replicas),
			many.GoodputTokensPerS, many.TokensPerS, one.GoodputTokensPerS, one.TokensPerS)
	}
	t.Logf("one pipeline %d stages: %.0f tokens/s, %.0f under churn; %d replicas: %.0f, %.0f", len(calm.Pipelines()[0].Stages),
		one.TokensPerS, one.GoodputTokensPerS, len(churned.Replicas), many.TokensPerS, many.GoodputTokensPerS)
}

// TestCheckpointInterval: Young's optimum, and none without restores.
func TestCheckpointInterval(t *testing.T) {
	for _, tc := range []struct{ cost, rate, want float64 }{
		{1, 1.0 / 50, 10},    // a 1 s checkpoint, a restore every 50 s: every 10 s
		{2, 1.0 / 3600, 120}, // a 2 s checkpoint, a restore an hour: every 2 minutes
		{1, 0, math.Inf(1)},
		{0, 1, math.Inf(1)},
	} {
		if got := CheckpointInterval(tc.cost, tc.rate); math.Abs(got-tc.want) > 1e-9*tc.want && got != tc.want {
			t.Errorf("CheckpointInterval(%v, %v) = %v, want %v", tc.cost, tc.rate, got, tc.want)
		}
	}
	// Halving the interval's replay against its cost: the optimum beats both neighbours.
	cost, rate := 1.5, 1.0/40
	waste := func(tau float64) float64 { return cost/tau + rate*tau/2 }
	best := CheckpointInterval(cost, rate)
	if !(waste(best) < waste(best*0.8) && waste(best) < waste(best*1.25)) {
		t.Errorf("waste at %v: %v, at 0.8×: %v, at 1.25×: %v", best, waste(best), waste(best*0.8), waste(best*1.25))
	}
}
