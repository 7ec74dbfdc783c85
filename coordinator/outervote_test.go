package coordinator

import "testing"

// TestOuterVote: a replica is banned for refused outer-step contributions only when at least two
// other replicas, and more than half of them, refused it — so that one liar, or a minority of
// liars, cannot frame an honest replica by accusing it; the same accuser twice counts once.
func TestOuterVote(t *testing.T) {
	plan := func(R int) *outerPlan {
		return &outerPlan{workers: make([][]string, R), votes: map[int]map[int]bool{}}
	}
	cases := []struct {
		name     string
		R        int
		accusers []int // of replica 0, in order
		want     []bool
	}{
		{"two replicas: never", 2, []int{1, 1}, []bool{false, false}},
		{"three: one liar alone", 3, []int{1, 1, 1}, []bool{false, false, false}},
		{"three: both others", 3, []int{1, 2}, []bool{false, true}},
		{"five: two of four", 5, []int{1, 2}, []bool{false, false}},
		{"five: three of four", 5, []int{3, 1, 4}, []bool{false, false, true}},
	}
	for _, tc := range cases {
		p := plan(tc.R)
		for i, a := range tc.accusers {
			if got := p.vote(a, 0); got != tc.want[i] {
				t.Errorf("%s: accusation %d (by replica %d) bans: %v, want %v", tc.name, i, a, got, tc.want[i])
			}
		}
	}
}
