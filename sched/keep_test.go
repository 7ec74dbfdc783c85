package sched

import (
	"fmt"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// TestKeepHolders: the planner's plan of two step-mode replicas of two stages, as make churn's
// join replans had it, moves the holders of a surviving replica's blocks to each other's stages;
// KeepHolders puts them back and divides the shares anew. It leaves a plan alone when nobody
// holds what it moves, and refuses a move that would cost the objective more than
// KeepHoldersLoss (a slow holder pulled into the fast replica).
func TestKeepHolders(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 8, Sync: SyncStep}
	L := prof.NumBlocks()
	half := L / 2
	peersOf := func(gflops ...float64) []Peer {
		var ps []Peer
		for i, g := range gflops {
			ps = append(ps, Peer{ID: fmt.Sprintf("p%d", i), GFLOPS: g, MemoryBytes: 8 << 30, LinkBytesPerS: 1e9})
		}
		return ps
	}
	plan := func(ids ...string) Plan {
		p := Plan{MicroBatches: 8}
		for r := range 2 {
			p.Replicas = append(p.Replicas, Replica{First: 4 * r, MicroBatches: 4, Stages: []Stage{
				{Begin: 0, End: half, Peer: ids[2*r]}, {Begin: half, End: L, Peer: ids[2*r+1]}}})
		}
		return p
	}
	where := func(p Plan) (out []string) {
		for _, rp := range p.Replicas {
			for _, s := range rp.Stages {
				out = append(out, fmt.Sprintf("%s[%d,%d)", s.Peer, s.Begin, s.End))
			}
		}
		return out
	}
	first, second := [2]int{0, half}, [2]int{half, L}

	alike := peersOf(150, 152, 154, 156)
	// p0 and p1 ran replica 0 as [first: p1, second: p0]; the planner swapped them.
	got, ok := KeepHolders(prof, plan("p0", "p1", "p2", "p3"), map[string][2]int{"p1": first, "p0": second}, alike, opt)
	if !ok {
		t.Fatal("the swapped holders were not put back")
	}
	checkReplicaPlan(t, prof, got, alike, opt)
	if w, want := fmt.Sprint(where(got)), fmt.Sprint([]string{fmt.Sprintf("p1[0,%d)", half), fmt.Sprintf("p0[%d,%d)", half, L), fmt.Sprintf("p2[0,%d)", half), fmt.Sprintf("p3[%d,%d)", half, L)}); w != want {
		t.Errorf("kept plan %s, want %s", w, want)
	}
	if got.Replicas[0].MicroBatches+got.Replicas[1].MicroBatches != 8 || got.Replicas[1].First != got.Replicas[0].MicroBatches {
		t.Errorf("shares %+v do not divide the step", got.Replicas)
	}

	// One pipeline over p2 and p3, as the planner under churn had it; p1 holds the first half and
	// p3 the second: p1 takes the first half in p2's place, p2 stands by.
	one := Plan{MicroBatches: 8, Replicas: []Replica{{MicroBatches: 8, Stages: []Stage{{Begin: 0, End: half, Peer: "p2"}, {Begin: half, End: L, Peer: "p3"}}}}}
	got, ok = KeepHolders(prof, one, map[string][2]int{"p1": first, "p3": second}, alike, opt)
	if !ok {
		t.Fatal("the holder left out did not take its blocks back")
	}
	if w, want := fmt.Sprint(where(got)), fmt.Sprint([]string{fmt.Sprintf("p1[0,%d)", half), fmt.Sprintf("p3[%d,%d)", half, L)}); w != want {
		t.Errorf("kept plan %s, want %s", w, want)
	}
	if fmt.Sprint(got.Standby) != "[p2 p0]" && fmt.Sprint(got.Standby) != "[p0 p2]" {
		t.Errorf("standby %v, want p0 and p2", got.Standby)
	}

	// Every holder where it was, or nobody holding the plan's blocks: nothing to keep.
	for name, held := range map[string]map[string][2]int{
		"in place":     {"p0": first, "p1": second},
		"other blocks": {"p0": {0, 1}},
		"none":         {},
	} {
		if _, ok := KeepHolders(prof, plan("p0", "p1", "p2", "p3"), held, alike, opt); ok {
			t.Errorf("%s: a plan was moved", name)
		}
	}

	// A fast replica (p0, p1) and a slow one (p2, p3). The slow p2 holding the second half would
	// take p1's place and slow the fast replica to the slow one's pace: a third of the
	// objective, refused.
	mixed := peersOf(300, 300, 100, 100)
	if p, ok := KeepHolders(prof, plan("p0", "p1", "p2", "p3"), map[string][2]int{"p2": second}, mixed, opt); ok {
		t.Errorf("a slow holder was moved into the fast replica: %v", where(p))
	}
}
