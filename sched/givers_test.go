package sched

import (
	"maps"
	"testing"
)

// TestGivers: a stage new to its peer takes its state from a twin that keeps the same blocks,
// givers spread over the twins; without a twin, from a holder the plan leaves out only with
// handBack; never from a holder of other blocks; at most maxGive takers a giver.
func TestGivers(t *testing.T) {
	held := map[string][2]int{"a": {0, 2}, "b": {2, 4}, "c": {0, 2}, "d": {2, 4}}
	st := func(p string, b, e int) HeldStage { return HeldStage{Peer: p, Begin: b, End: e} }
	tests := []struct {
		name     string
		next     []HeldStage
		handBack bool
		max      int
		want     map[string]string // nil: every stage held already
		ok       bool
	}{
		{"all held", []HeldStage{st("a", 0, 2), st("b", 2, 4)}, false, MaxGive, nil, true},
		{"from twins, spread", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("c", 0, 2), st("x", 0, 2), st("y", 0, 2)}, false, MaxGive,
			map[string]string{"x": "a", "y": "c"}, true},
		{"a twin gives at most max", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 0, 2), st("y", 0, 2)}, false, 1, nil, false},
		{"no twin, no hand-back", []HeldStage{st("a", 0, 2), st("x", 2, 4)}, false, MaxGive, nil, false},
		{"no twin: a holder left out hands back", []HeldStage{st("a", 0, 2), st("x", 2, 4)}, true, MaxGive, map[string]string{"x": "b"}, true},
		{"twins before holders left out", []HeldStage{st("a", 0, 2), st("b", 2, 4), st("x", 2, 4)}, true, MaxGive, map[string]string{"x": "b"}, true},
		{"a holder moved gives nothing it does not hold", []HeldStage{st("a", 2, 4), st("x", 0, 2)}, true, MaxGive, map[string]string{"a": "b", "x": "c"}, true},
		{"blocks nobody holds", []HeldStage{st("x", 0, 3), st("b", 3, 4)}, true, MaxGive, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := Givers(held, tt.next, tt.handBack, tt.max)
			if ok != tt.ok || !maps.Equal(got, tt.want) {
				t.Errorf("Givers = %v, %v; want %v, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}
