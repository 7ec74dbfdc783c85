package sched

import (
	"slices"
	"testing"
)

func TestDecide(t *testing.T) {
	three := []MemberReplica{{Index: 0, Peers: []string{"a"}}, {Index: 1, Peers: []string{"c"}}, {Index: 3, Peers: []string{"d"}}}
	piped := []MemberReplica{{Index: 0, Peers: []string{"a", "b"}}, {Index: 1, Peers: []string{"c"}}, {Index: 2, Peers: []string{"d"}}}
	outer := Membership{Sync: SyncOuter, Replicas: three, Phase: PhaseTraining}
	with := func(m Membership, f func(*Membership)) Membership { f(&m); return m }
	for _, tc := range []struct {
		name    string
		m       Membership
		c       Change
		want    Action
		replica int
	}{
		{"standby leaves", outer, Change{Left: "z"}, KeepGoing, -1},
		{"outer replica lost mid-round", outer, Change{Left: "c"}, DropReplica, 1},
		{"a replica keeps its index", outer, Change{Left: "d"}, DropReplica, 3},
		{"a stage of a pipeline replica", with(outer, func(m *Membership) { m.Replicas = piped }), Change{Left: "b"}, DropReplica, 0},
		{"a pipeline replica survives", with(outer, func(m *Membership) { m.Replicas = piped }), Change{Left: "c"}, DropReplica, 1},
		{"last replica", with(outer, func(m *Membership) { m.Replicas = three[:1] }), Change{Left: "a"}, Restore, -1},
		{"outer replica lost in an exchange", with(outer, func(m *Membership) { m.Phase = PhaseExchange }), Change{Left: "d"}, DropReplica, 3},
		{"a pipeline replica lost in an exchange", with(outer, func(m *Membership) { m.Phase, m.Replicas = PhaseExchange, piped }), Change{Left: "b"}, DropReplica, 0},
		{"last replica lost in an exchange", with(outer, func(m *Membership) { m.Phase, m.Replicas = PhaseExchange, three[:1] }), Change{Left: "a"}, Restore, -1},
		{"standby leaves during an exchange", with(outer, func(m *Membership) { m.Phase = PhaseExchange }), Change{Left: "z"}, KeepGoing, -1},
		{"outer at a boundary", with(outer, func(m *Membership) { m.Phase = PhaseBoundary }), Change{Left: "c"}, DropReplica, 1},
		{"a pipeline replica at a boundary", with(outer, func(m *Membership) { m.Phase, m.Replicas = PhaseBoundary, piped }), Change{Left: "b"}, DropReplica, 0},
		{"the last replica at a boundary", with(outer, func(m *Membership) { m.Phase, m.Replicas = PhaseBoundary, three[:1] }), Change{Left: "a"}, Restore, -1},
		{"outer while a restore loads", with(outer, func(m *Membership) { m.Phase, m.Restoring = PhaseLoading, true }), Change{Left: "c"}, DropReplica, 1},
		{"the last replica while a restore loads", with(outer, func(m *Membership) { m.Phase, m.Restoring, m.Replicas = PhaseLoading, true, three[:1] }), Change{Left: "a"}, Restore, -1},
		{"outer while loading", with(outer, func(m *Membership) { m.Phase = PhaseLoading }), Change{Left: "c"}, Restore, -1},
		{"step mode mid-step", with(outer, func(m *Membership) { m.Sync = SyncStep }), Change{Left: "c"}, Reroute, 1},
		{"step mode keeps the index", with(outer, func(m *Membership) { m.Sync = SyncStep }), Change{Left: "d"}, Reroute, 3},
		{"step mode at a boundary", with(outer, func(m *Membership) { m.Sync, m.Phase = SyncStep, PhaseBoundary }), Change{Left: "c"}, Reshare, 1},
		{"step mode, a stage of a pipeline replica", with(outer, func(m *Membership) { m.Sync, m.Replicas = SyncStep, piped }), Change{Left: "b"}, Reroute, 0},
		{"step mode, a pipeline replica at a boundary", with(outer, func(m *Membership) { m.Sync, m.Replicas, m.Phase = SyncStep, piped, PhaseBoundary }), Change{Left: "b"}, Reshare, 0},
		{"step mode while loading, taking state from peers", with(outer, func(m *Membership) { m.Sync, m.Phase = SyncStep, PhaseLoading }), Change{Left: "c"}, Restore, -1},
		{"step mode while loading on its own", with(outer, func(m *Membership) { m.Sync, m.Phase, m.LoadReroutes = SyncStep, PhaseLoading, true }), Change{Left: "c"}, Reroute, 1},
		{"step mode while loading, the last replica", with(outer, func(m *Membership) {
			m.Sync, m.Phase, m.LoadReroutes, m.Replicas = SyncStep, PhaseLoading, true, three[:1]
		}), Change{Left: "a"}, Restore, -1},
		{"step mode while loading beside hosts", with(outer, func(m *Membership) {
			m.Sync, m.Phase, m.LoadReroutes, m.Hosts = SyncStep, PhaseLoading, true, []string{"h"}
		}), Change{Left: "c"}, Restore, -1},
		{"step mode, last replica", with(outer, func(m *Membership) { m.Sync, m.Replicas = SyncStep, three[:1] }), Change{Left: "a"}, Restore, -1},
		{"step mode with hosts", with(outer, func(m *Membership) { m.Sync, m.Hosts = SyncStep, []string{"h"} }), Change{Left: "c"}, Reshare, 1},
		{"expert host", with(outer, func(m *Membership) { m.Sync, m.Hosts = SyncStep, []string{"h"} }), Change{Left: "h"}, Restore, -1},
		{"outer with hosts", with(outer, func(m *Membership) { m.Hosts = []string{"h"} }), Change{Left: "c"}, Restore, -1},
		{"standby leaves a step-mode plan", with(outer, func(m *Membership) { m.Sync = SyncStep }), Change{Left: "z"}, KeepGoing, -1},
		{"nobody joined", outer, Change{}, KeepGoing, -1},
		{"joins to a pinned plan", with(outer, func(m *Membership) { m.Pinned = true }), Change{Joined: 2, JoinGapElapsed: true}, KeepGoing, -1},
		{"joins too soon", outer, Change{Joined: 1}, WaitForGap, -1},
		{"joins the plan keeps out", outer, Change{Joined: 1, JoinGapElapsed: true, PlanKept: true}, Standby, -1},
		{"joins the planner places", outer, Change{Joined: 1, JoinGapElapsed: true}, CheckpointReplan, -1},
		{"joins taking state from twins", with(outer, func(m *Membership) { m.Sync = SyncStep }), Change{Joined: 1, JoinGapElapsed: true, PeerState: true}, Grow, -1},
		{"joins refilling a pinned plan", with(outer, func(m *Membership) { m.Sync, m.Pinned = SyncStep, true }), Change{Joined: 1, JoinGapElapsed: true, PeerState: true}, Grow, -1},
		{"joins to a pinned plan without twins", with(outer, func(m *Membership) { m.Sync, m.Pinned = SyncStep, true }), Change{Joined: 1, JoinGapElapsed: true}, KeepGoing, -1},
		{"joins to a full pinned plan", with(outer, func(m *Membership) { m.Sync, m.Pinned = SyncStep, true }), Change{Joined: 1, JoinGapElapsed: true, PlanKept: true}, KeepGoing, -1},
		{"outer joins refilling dropped replicas", outer, Change{Joined: 1, JoinGapElapsed: true, PeerState: true}, Grow, -1},
		{"outer joins with nothing to refill", outer, Change{Joined: 1, JoinGapElapsed: true}, CheckpointReplan, -1},
		{"step-mode joins beside expert hosts", with(outer, func(m *Membership) { m.Sync, m.Hosts = SyncStep, []string{"h"} }), Change{Joined: 1, JoinGapElapsed: true, PeerState: true}, Grow, -1},
		{"step-mode joins beside expert hosts, no peer state", with(outer, func(m *Membership) { m.Sync, m.Hosts = SyncStep, []string{"h"} }), Change{Joined: 1, JoinGapElapsed: true}, CheckpointReplan, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.m, tc.c)
			if d.Action != tc.want || d.Replica != tc.replica || d.Why == "" {
				t.Errorf("Decide = %v (replica %d, %q), want %v (replica %d)", d.Action, d.Replica, d.Why, tc.want, tc.replica)
			}
		})
	}
}

// TestRerouteShares: the runs of the replicas lost mid-step go to their surviving neighbours, split
// in proportion to the neighbours' own runs; every survivor keeps its run, and the runs still tile
// the step in replica order.
func TestRerouteShares(t *testing.T) {
	for _, tc := range []struct {
		name string
		runs [][2]int
		lost []bool
		want [][2]int
	}{
		{"middle, equal neighbours", [][2]int{{0, 4}, {4, 8}, {8, 12}}, []bool{false, true, false}, [][2]int{{0, 6}, {6, 12}}},
		{"middle, a faster left", [][2]int{{0, 6}, {6, 9}, {9, 12}}, []bool{false, true, false}, [][2]int{{0, 8}, {8, 12}}},
		{"first", [][2]int{{0, 4}, {4, 8}, {8, 12}}, []bool{true, false, false}, [][2]int{{0, 8}, {8, 12}}},
		{"last", [][2]int{{0, 4}, {4, 8}, {8, 12}}, []bool{false, false, true}, [][2]int{{0, 4}, {4, 12}}},
		{"two beside each other", [][2]int{{0, 2}, {2, 4}, {4, 6}, {6, 8}}, []bool{false, true, true, false}, [][2]int{{0, 4}, {4, 8}}},
		{"both ends", [][2]int{{0, 2}, {2, 4}, {4, 6}}, []bool{true, false, true}, [][2]int{{0, 6}}},
		{"one micro-batch between", [][2]int{{0, 3}, {3, 4}, {4, 7}}, []bool{false, true, false}, [][2]int{{0, 4}, {4, 7}}},
		{"everyone", [][2]int{{0, 2}, {2, 4}}, []bool{true, true}, nil},
	} {
		got := RerouteShares(tc.runs, tc.lost)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: RerouteShares(%v, %v) = %v, want %v", tc.name, tc.runs, tc.lost, got, tc.want)
		}
	}
}
