package sched

import (
	"math"
	"testing"
)

// TestGrowDeferral: the rent-or-buy rule. A grow that repays its stall within GrowLookahead rounds
// goes at once; one that does not waits, accumulating what waiting forgoes, and goes at the first
// weigh where that (with the lookahead) reaches its stall; stalls under GrowMinStall, and grows
// from a plan that trains nothing, go at once; a grow that adds nothing never goes.
func TestGrowDeferral(t *testing.T) {
	var d GrowDeferral
	if !d.Due(0, 0.5, 2, 1) || d.Waiting() {
		t.Fatal("a grow adding half the throughput for a 2 s stall, rounds of 1 s: want it at once")
	}
	if !d.Due(0, 0.01, GrowMinStall/2, 1) {
		t.Fatal("a stall under GrowMinStall: want the grow at once")
	}
	if !d.Due(0, math.Inf(1), 100, 1) {
		t.Fatal("a grow from a plan that trains nothing: want it at once")
	}
	if d.Due(0, 0, 100, 1) || d.Waiting() {
		t.Fatal("a grow that adds nothing went, or waits")
	}
	// A fleet's joiner: 1% more for an 8 s stall, rounds of 2.7 s. It goes once the time forgone
	// reaches the stall less the lookahead: 0.01·t + 0.01·4·2.7 ≥ 8, t ≥ 789.2 s.
	now, went := 0.0, -1.0
	for ; now < 2000; now += 2.7 {
		if d.Due(now, 0.01, 8, 2.7) {
			went = now
			break
		}
		if !d.Waiting() {
			t.Fatalf("at %.1f s: not waiting after a grow that did not go", now)
		}
	}
	if want := 8/0.01 - GrowLookahead*2.7; went < want || went > want+2.7 {
		t.Fatalf("the grow went at %.1f s, want the first round past %.1f s", went, want)
	}
	if d.Waiting() {
		t.Fatal("still waiting after the grow went")
	}
	d.Due(0, 0.01, 8, 2.7)
	d.Forget()
	if d.Waiting() {
		t.Fatal("Forget left the grow waiting")
	}
	if d.Due(10, 0.01, 8, 2.7) {
		t.Fatal("a forgotten wait counted what it had forgone")
	}
}

// TestHandoverSeconds: a giver sends its takers one after another, each taker receives over its
// own link; the longest is the stall.
func TestHandoverSeconds(t *testing.T) {
	hs := []Handover{
		{Giver: "a", Taker: "x", Bytes: 100, GiverBytesPerS: 100, TakerBytesPerS: 1000},
		{Giver: "a", Taker: "y", Bytes: 100, GiverBytesPerS: 100, TakerBytesPerS: 1000},
		{Giver: "b", Taker: "z", Bytes: 100, GiverBytesPerS: 1000, TakerBytesPerS: 20},
	}
	if got := HandoverSeconds(hs); got != 5 {
		t.Fatalf("HandoverSeconds = %v, want 5 (z's own link; a's two sends take 2)", got)
	}
	if got := HandoverSeconds(hs[:2]); got != 2 {
		t.Fatalf("HandoverSeconds = %v, want 2 (a sends twice)", got)
	}
	if got := HandoverSeconds(nil); got != 0 {
		t.Fatalf("no handover: %v", got)
	}
}

// TestDecideGrowWaits: joiners whose grow waits stand by.
func TestDecideGrowWaits(t *testing.T) {
	m := Membership{Sync: SyncOuter, Phase: PhaseBoundary, Replicas: []MemberReplica{{Index: 0, Peers: []string{"a"}}, {Index: 1, Peers: []string{"b"}}}}
	c := Change{Joined: 1, JoinGapElapsed: true, PeerState: true}
	if d := Decide(m, c); d.Action != Grow {
		t.Fatalf("%v (%s), want a grow", d.Action, d.Why)
	}
	c.GrowWaits = true
	if d := Decide(m, c); d.Action != Standby {
		t.Fatalf("%v (%s), want the joiners to stand by while the grow waits", d.Action, d.Why)
	}
}

// TestDecideGrowLater: joiners whose grow would land on a pending delayed outer step stand by,
// rather than replanning from a checkpoint.
func TestDecideGrowLater(t *testing.T) {
	m := Membership{Sync: SyncOuter, Phase: PhaseBoundary, Replicas: []MemberReplica{{Index: 0, Peers: []string{"a"}}, {Index: 1, Peers: []string{"b"}}}}
	c := Change{Joined: 1, JoinGapElapsed: true, PeerState: true, GrowLater: true}
	if d := Decide(m, c); d.Action != Standby {
		t.Fatalf("%v (%s), want the joiners to stand by until the take-up", d.Action, d.Why)
	}
}

// TestReplanDue: a join's checkpoint and replan is weighed as a grow is — it waits until what the
// planner's plan adds repays its stall — except that a replan that adds nothing by the objective
// but holds nobody for long goes at once, as every replan did before it was weighed.
func TestReplanDue(t *testing.T) {
	var d GrowDeferral
	if !d.ReplanDue(0, 0, GrowMinStall/2, 1) || d.Waiting() {
		t.Fatal("a replan of a sub-second stall that adds nothing: want it at once")
	}
	if d.ReplanDue(0, 0, 30, 1) || d.Waiting() {
		t.Fatal("a replan of 30 s that adds nothing went, or waits to be weighed again")
	}
	if !d.ReplanDue(0, 2, 30, 5) {
		t.Fatal("a replan that doubles the throughput for 30 s, rounds of 5 s: want it at once")
	}
	// 2% more for 30 s, rounds of 1 s: 0.02·t + 0.02·4 ≥ 30, t ≥ 1496 s.
	went := -1.0
	for now := 0.0; now < 3000; now++ {
		if d.ReplanDue(now, 0.02, 30, 1) {
			went = now
			break
		}
	}
	if want := 30/0.02 - GrowLookahead; went < want || went > want+1 {
		t.Fatalf("the replan went at %v s, want the first round past %v s", went, want)
	}
}

// TestReplanSeconds: the running stages upload their shards, then the new plan's load theirs,
// every stage over its own link at once.
func TestReplanSeconds(t *testing.T) {
	running := []ShardMove{{Params: 1e6, BytesPerS: 12e6}, {Params: 3e6, BytesPerS: 12e6}}
	next := []ShardMove{{Params: 4e6, BytesPerS: 6e6}}
	if got := ReplanSeconds(running, next); got != 3+8 {
		t.Fatalf("ReplanSeconds = %v, want 11 (3 s to upload the larger shard, 8 to load the whole model at half the speed)", got)
	}
	if got := ShardSeconds([]ShardMove{{Params: 1e6}}); got != 12 {
		t.Fatalf("a link of no speed: %v s, want 12 (1 MB/s)", got)
	}
	if got := ShardSeconds([]ShardMove{{Params: 1e6, BytesPerS: math.Inf(1)}}); got != 0 {
		t.Fatalf("an unbounded link: %v s, want 0", got)
	}
	// An outer-mode shard holds the global part and its replica's: what the client's restore
	// reads (client: newBlobLayout's prefixes), 5 or 7 float32s a parameter.
	for _, c := range []struct {
		opt  ReplicaOptions
		want float64
	}{
		{ReplicaOptions{Sync: SyncStep}, 12},
		{ReplicaOptions{Sync: SyncOuter}, 20},
		{ReplicaOptions{Sync: SyncOuter, Int8: true}, 28},
	} {
		if got := c.opt.StateBytesPerParam(); got != c.want {
			t.Errorf("%+v: %v bytes a parameter, want %v", c.opt, got, c.want)
		}
		if got := ShardSeconds([]ShardMove{{Params: 1e6, BytesPerS: 1e6, PerParam: c.opt.StateBytesPerParam()}}); got != c.want {
			t.Errorf("%+v: a shard of 1e6 parameters at 1 MB/s takes %v s, want %v", c.opt, got, c.want)
		}
	}
}

// TestDecideReplanWaits: joiners the job could take in only by a checkpoint and replan stand by
// while that replan waits to repay its stall, and go to it once it has.
func TestDecideReplanWaits(t *testing.T) {
	for _, sync := range []SyncMode{SyncStep, SyncOuter} {
		m := Membership{Sync: sync, Phase: PhaseBoundary, Replicas: []MemberReplica{{Index: 0, Peers: []string{"a"}}, {Index: 1, Peers: []string{"b"}}}}
		c := Change{Joined: 1, JoinGapElapsed: true}
		if d := Decide(m, c); d.Action != CheckpointReplan {
			t.Fatalf("%v: %v (%s), want a checkpoint and replan", sync, d.Action, d.Why)
		}
		c.ReplanWaits = true
		if d := Decide(m, c); d.Action != Standby {
			t.Fatalf("%v: %v (%s), want the joiners to stand by while the replan waits", sync, d.Action, d.Why)
		}
		m.Pinned = true
		if d := Decide(m, c); d.Action != KeepGoing {
			t.Fatalf("%v, pinned: %v (%s), want the pinned plan kept", sync, d.Action, d.Why)
		}
	}
}

// TestReplanDominates: a replan beats a grow only when it adds at least as much and holds the job
// for less; a grow that adds less but holds for less, or as much for as long, is weighed as
// before.
func TestReplanDominates(t *testing.T) {
	for _, tc := range []struct {
		gg, gs, rg, rs float64
		want           bool
	}{
		{2.78, 3636, 2.78, 2506, true}, // the simulated 1B fleet's reshape against its replan
		{1, 100, 1.5, 50, true},
		{1, 100, 1.5, 100, false},
		{1, 100, 0.9, 50, false},
		{1, 50, 1.5, 100, false},
	} {
		if got := ReplanDominates(tc.gg, tc.gs, tc.rg, tc.rs); got != tc.want {
			t.Errorf("grow %.2f for %.0f s, replan %.2f for %.0f s: %v, want %v", tc.gg, tc.gs, tc.rg, tc.rs, got, tc.want)
		}
	}
}
