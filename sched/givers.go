package sched

import "slices"

// Handovers: who gives a stage its state when a plan is taken up at a step boundary without a
// checkpoint (Change.PeerState). In step mode every holder of a stage's blocks holds the same
// state at a boundary, so a worker new to a stage can take it from any of them, peer to peer, block
// by block: from keepers — stages of the new plan whose workers hold their blocks now and keep
// them — or, with handBack, a holder the new plan leaves out, which gives and then stands by (a
// holder the planner put a faster joiner in place of). In outer mode every holder keeps the global
// θ and the momentum alike, and a new replica's stages take those the same way (Cover). The
// coordinator's growable and the simulator's handover both ask Givers, so the simulator grows
// exactly when the coordinator would, from the same givers.

// MaxGive bounds the takers one giver hands its state to at a plan change: proto.MaxGive, which
// bounds Assign.Give on the wire (sched imports no wire package; the coordinator's tests hold the
// two equal).
const MaxGive = 64

// HeldStage is a stage of a plan: the peer placed on it and its blocks [Begin, End).
type HeldStage struct {
	Peer       string
	Begin, End int
}

// Part is what one giver hands a taker's stage: the state of blocks [Begin, End) of it, which the
// giver holds (proto.Handover).
type Part struct {
	Giver      string
	Begin, End int
}

// Cover returns the parts that hand blocks [begin, end) over from holders (in order of
// preference), or nil when some block has none able to give it: from each block on, the holder
// that covers the most of what is left, the one that has given least so far among equals (counted
// in given, at most maxGive takers each), the first of holders among those. A holder of exactly
// the blocks, or of more, gives them all at once; a cut that no holder has whole is handed over
// by several, each its run of blocks, so a new replica need not repeat a running one's cuts.
func Cover(holders []HeldStage, begin, end int, given map[string]int, maxGive int) []Part {
	var parts []Part
	for at := begin; at < end; {
		best := -1
		for i, h := range holders {
			if h.Begin > at || h.End <= at || given[h.Peer] >= maxGive {
				continue
			}
			if best < 0 {
				best = i
				continue
			}
			b := holders[best]
			if r, rb := min(h.End, end), min(b.End, end); r > rb || r == rb && given[h.Peer] < given[b.Peer] {
				best = i
			}
		}
		if best < 0 {
			return nil
		}
		h := holders[best]
		parts = append(parts, Part{Giver: h.Peer, Begin: at, End: min(h.End, end)})
		at = min(h.End, end)
	}
	for _, p := range parts {
		given[p.Giver]++
	}
	return parts
}

// Givers returns, for every stage of next that its peer does not hold now (held: peer → the
// blocks it holds, only peers able to give), the parts that hand it over (Cover): from keepers — a
// stage of next on the peer holding the same blocks now, which keeps them — where they cover it,
// else with handBack from them and holders that next leaves out. Keepers come first in next's
// order, then the leavers in held's order of ids; a giver gives at most maxGive takers. It reports false when some stage
// has no giver for some of its blocks — nobody able holds them, or each gives maxGive already —
// and nil, true when every stage of next is held by its peer already.
func Givers(held map[string][2]int, next []HeldStage, handBack bool, maxGive int) (map[string][]Part, bool) {
	var keepers, holders []HeldStage
	placed := make(map[string]bool, len(next))
	for _, st := range next {
		placed[st.Peer] = true
		if b, ok := held[st.Peer]; ok && b == [2]int{st.Begin, st.End} {
			keepers = append(keepers, st)
		}
	}
	holders = keepers
	if handBack {
		holders = slices.Clone(keepers)
		ids := make([]string, 0, len(held))
		for id := range held {
			if !placed[id] {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		for _, id := range ids {
			holders = append(holders, HeldStage{Peer: id, Begin: held[id][0], End: held[id][1]})
		}
	}
	var from map[string][]Part
	given := map[string]int{}
	for _, st := range next {
		if h, ok := held[st.Peer]; ok && h == [2]int{st.Begin, st.End} {
			continue
		}
		// Keepers alone where they suffice: a holder left out hands over only what they cannot,
		// since it then stands by and the plan waits for it too.
		parts := Cover(keepers, st.Begin, st.End, given, maxGive)
		if parts == nil && handBack {
			parts = Cover(holders, st.Begin, st.End, given, maxGive)
		}
		if parts == nil {
			return nil, false
		}
		if from == nil {
			from = map[string][]Part{}
		}
		from[st.Peer] = parts
	}
	return from, true
}

// GiversOf are the workers that give parts, once each, in order.
func GiversOf(parts []Part) []string {
	var out []string
	for _, p := range parts {
		if !slices.Contains(out, p.Giver) {
			out = append(out, p.Giver)
		}
	}
	return out
}

// StandbyGivers are the givers of from (taker → its parts, Givers') that hold no stage of next:
// holders next leaves out, which hand their stage over and then stand by. Sorted.
func StandbyGivers(next []HeldStage, from map[string][]Part) []string {
	var out []string
	for _, parts := range from {
		for _, p := range parts {
			g := p.Giver
			if !slices.Contains(out, g) && !slices.ContainsFunc(next, func(st HeldStage) bool { return st.Peer == g }) {
				out = append(out, g)
			}
		}
	}
	slices.Sort(out)
	return out
}
