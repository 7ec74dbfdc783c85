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
