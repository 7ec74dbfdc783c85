package coordinator

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/shoal-ml/shoal/proto"
)

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

// TestOuterRefusalFromNobody: an accusation counts only from a worker that held a replica of the
// plan it names, against another replica of that plan: one from outside the plan, against its own
// replica, against a replica the plan lacks, of a plan not recorded, or naming nobody changes
// nothing — no vote, no replan.
func TestOuterRefusalFromNobody(t *testing.T) {
	j := &jobRun{s: &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}, version: 5}
	p := &outerPlan{replicaOf: map[string]int{"a": 0, "b": 1, "c": 2}, workers: [][]string{{"a"}, {"b"}, {"c"}}, votes: map[int]map[int]bool{}}
	j.outerPlans = map[uint32]*outerPlan{5: p}
	one, three, self := uint32(1), uint32(3), uint32(0)
	for _, tc := range []struct {
		name   string
		worker string
		m      proto.Error
	}{
		{"outsider", "mallory", proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: 5, Accused: &one}},
		{"itself", "a", proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: 5, Accused: &self}},
		{"no such replica", "a", proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: 5, Accused: &three}},
		{"unknown plan", "a", proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: 4, Accused: &one}},
		{"nobody", "a", proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: 5}},
	} {
		if err := j.outerRefusal(context.Background(), tc.worker, &tc.m); err != nil {
			t.Errorf("%s: %v, want it ignored", tc.name, err)
		}
		if len(p.votes) != 0 {
			t.Fatalf("%s: votes %v, want none", tc.name, p.votes)
		}
	}
}
