package sched

import "slices"

// Handovers: who gives a stage its state when a plan is taken up at a step boundary without a
// checkpoint (Change.PeerState). In step mode every holder of a stage's blocks holds the same
// state at a boundary, so a worker new to a stage can take it from any of them, peer to peer: a
// twin — a stage of the new plan on the same blocks whose worker holds them now and keeps them —
// or, with handBack, a holder the new plan leaves out, which gives and then stands by (a
// holder the planner put a faster joiner in place of). The coordinator's growable and the
// simulator's handover both ask Givers, so the simulator grows exactly when the coordinator
// would, from the same givers.

// MaxGive bounds the takers one giver hands its state to at a plan change: proto.MaxGive, which
// bounds Assign.Give on the wire (sched imports no wire package; the coordinator's tests hold the
// two equal).
const MaxGive = 64

// HeldStage is a stage of a plan: the peer placed on it and its blocks [Begin, End).
type HeldStage struct {
	Peer       string
	Begin, End int
}

// Givers returns, for every stage of next that its peer does not hold now (held: peer → the
// blocks it holds, only peers able to give), the peer that hands it over: a twin of next (a
// stage of the same blocks on the peer holding them now), else with handBack a holder of those
// blocks that next leaves out. Givers are spread: each stage's giver is, of its candidates, the
// one that has given least so far (the first in next's order among equals, then the leavers in
// held's order of ids), at most maxGive each. It reports false when some stage has no giver —
// nobody able holds its blocks, or each gives maxGive already — and nil, true when every stage of
// next is held by its peer already.
func Givers(held map[string][2]int, next []HeldStage, handBack bool, maxGive int) (map[string]string, bool) {
	twins := map[[2]int][]string{}
	placed := make(map[string]bool, len(next))
	for _, st := range next {
		placed[st.Peer] = true
		if b, ok := held[st.Peer]; ok && b == [2]int{st.Begin, st.End} {
			twins[b] = append(twins[b], st.Peer)
		}
	}
	leavers := map[[2]int][]string{}
	if handBack {
		ids := make([]string, 0, len(held))
		for id := range held {
			if !placed[id] {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		for _, id := range ids {
			leavers[held[id]] = append(leavers[held[id]], id)
		}
	}
	var from map[string]string
	given := map[string]int{}
	pick := func(cands []string) string {
		if len(cands) == 0 {
			return ""
		}
		g := slices.MinFunc(cands, func(a, b string) int { return given[a] - given[b] })
		if given[g] >= maxGive {
			return ""
		}
		given[g]++
		return g
	}
	for _, st := range next {
		b := [2]int{st.Begin, st.End}
		if h, ok := held[st.Peer]; ok && h == b {
			continue
		}
		g := pick(twins[b])
		if g == "" {
			g = pick(leavers[b])
		}
		if g == "" {
			return nil, false
		}
		if from == nil {
			from = map[string]string{}
		}
		from[st.Peer] = g
	}
	return from, true
}

// StandbyGivers are the givers of from (taker → giver, Givers') that hold no stage of next: holders
// next leaves out, which hand their stage over and then stand by. Sorted.
func StandbyGivers(next []HeldStage, from map[string]string) []string {
	var out []string
	for _, g := range from {
		if !slices.Contains(out, g) && !slices.ContainsFunc(next, func(st HeldStage) bool { return st.Peer == g }) {
			out = append(out, g)
		}
	}
	slices.Sort(out)
	return out
}
