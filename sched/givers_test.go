package sched

import (
	"maps"
	"slices"
	"testing"
)

// TestGivers: a stage new to its peer takes its state from a keeper that holds its blocks, givers
// spread over the keepers; without one, from a holder the plan leaves out only with handBack;
// never from a holder that moves; at most maxGive takers a giver. A cut no holder has whole is
// handed over block by block by holders of its runs (Cover), the fewest parts first.
func TestGivers(t *testing.T) {
	held := map[string][2]int{"a": {0, 2}, "b": {2, 4}, "c": {0, 2}, "d": {2, 4}}
	st := func(p string, b, e int) HeldStage { return HeldStage{Peer: p, Begin: b, End: e} }
	one := func(g string, b, e int) []Part { return []Part{{Giver: g, Begin: b, End: e}} }
	tests := []struct {
		name     string
		next     []HeldStage
		handBack bool
		max      int
		want     map[string][]Part // nil: every stage held already
		ok       bool
	}{
		{"all held", []HeldStage{st("a", 0, 2), st("b", 2, 4)}, false, MaxGive, nil, true},
		{"from twins, spread", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("c", 0, 2), st("x", 0, 2), st("y", 0, 2)}, false, MaxGive,
			map[string][]Part{"x": one("a", 0, 2), "y": one("c", 0, 2)}, true},
		{"a twin gives at most max", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 0, 2), st("y", 0, 2)}, false, 1, nil, false},
		{"no twin, no hand-back", []HeldStage{st("a", 0, 2), st("x", 2, 4)}, false, MaxGive, nil, false},
		{"no twin: a holder left out hands back", []HeldStage{st("a", 0, 2), st("x", 2, 4)}, true, MaxGive, map[string][]Part{"x": one("b", 2, 4)}, true},
		{"twins before holders left out", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 2, 4)}, true, MaxGive, map[string][]Part{"x": one("b", 2, 4)}, true},
		{"a holder moved gives nothing it does not hold", []HeldStage{st("a", 2, 4), st("x", 0, 2)}, true, MaxGive,
			map[string][]Part{"a": one("b", 2, 4), "x": one("c", 0, 2)}, true},
		{"blocks nobody holds", []HeldStage{st("x", 0, 3), st("b", 3, 4)}, false, MaxGive, nil, false},
		// A new cut: a stage of all four blocks from a keeper of each half; a stage of blocks
		// [1,3) from the two halves' keepers, one block each; a stage inside a held one from
		// its keeper alone.
		{"a whole stage from two keepers", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 0, 4)}, false, MaxGive,
			map[string][]Part{"x": {{Giver: "a", Begin: 0, End: 2}, {Giver: "b", Begin: 2, End: 4}}}, true},
		{"a straddling cut", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 1, 3)}, false, MaxGive,
			map[string][]Part{"x": {{Giver: "a", Begin: 1, End: 2}, {Giver: "b", Begin: 2, End: 3}}}, true},
		{"a stage inside a held one", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 0, 1), st("y", 1, 2)}, false, MaxGive,
			map[string][]Part{"x": one("a", 0, 1), "y": one("a", 1, 2)}, true},
		{"a split cut with hand-back", []HeldStage{st("a", 0, 2), st("x", 0, 4)}, true, MaxGive,
			map[string][]Part{"x": {{Giver: "a", Begin: 0, End: 2}, {Giver: "b", Begin: 2, End: 4}}}, true},
		{"a split cut, half of it unheld", []HeldStage{st("a", 0, 2), st("x", 0, 4)}, false, MaxGive, nil, false},
		// A keeper that has given more still gives before a holder left out, which would then
		// stand by for it.
		{"keepers before leavers, however much they gave", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 2, 4), st("y", 2, 4)}, true, MaxGive,
			map[string][]Part{"x": one("b", 2, 4), "y": one("b", 2, 4)}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := Givers(held, tt.next, tt.handBack, tt.max)
			if ok != tt.ok || !maps.EqualFunc(got, tt.want, slices.Equal) {
				t.Errorf("Givers = %v, %v; want %v, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}

// TestCover: the fewest parts first — a holder covering the rest of the blocks wins over one
// covering less — and among holders covering alike, the one that has given least; each giver's
// count grows once per taker; a holder that gives maxGive already is passed over.
func TestCover(t *testing.T) {
	holders := []HeldStage{{Peer: "a", Begin: 0, End: 1}, {Peer: "b", Begin: 0, End: 3}, {Peer: "c", Begin: 1, End: 4}, {Peer: "d", Begin: 3, End: 4}}
	given := map[string]int{}
	if got, want := Cover(holders, 0, 4, given, MaxGive), []Part{{"b", 0, 3}, {"c", 3, 4}}; !slices.Equal(got, want) {
		t.Errorf("Cover [0,4) = %v, want %v", got, want)
	}
	if given["b"] != 1 || given["c"] != 1 || given["a"] != 0 {
		t.Errorf("given %v after one taker", given)
	}
	// c and d both cover block 3; d has given least.
	if got, want := Cover(holders, 3, 4, given, MaxGive), []Part{{"d", 3, 4}}; !slices.Equal(got, want) {
		t.Errorf("Cover [3,4) = %v, want %v", got, want)
	}
	// b gives at most 1 taker: a and c cover [0,3) between them.
	if got, want := Cover(holders, 0, 3, map[string]int{"b": 1}, 1), []Part{{"a", 0, 1}, {"c", 1, 3}}; !slices.Equal(got, want) {
		t.Errorf("Cover [0,3) with b at its bound = %v, want %v", got, want)
	}
	if got := Cover(holders[:1], 0, 2, map[string]int{}, MaxGive); got != nil {
		t.Errorf("Cover of a block nobody holds = %v, want nil", got)
	}
}
