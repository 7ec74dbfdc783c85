package coordinator

import (
	"context"
	"crypto/ed25519"
	crand "crypto/rand"
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
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

// TestOuterJudge: the attacker of the evidence a refusal carries (proto.OuterEvidence). A chunk
// beyond the bound that replica 1's stage signed convicts that stage; the same chunk shown as
// another replica's worker's, under a key the plan did not record for the sender, for a tensor
// the model lacks, or a chunk within the bound convicts the accuser.
func TestOuterJudge(t *testing.T) {
	spec := job.Default()
	spec.Model = model.TinyConfig()
	spec.Steps, spec.Warmup = 40, 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	const step, plan, tensor = 7, 5, 0 // the embedding: chunks enough
	n := spec.Model.Specs()[tensor].Size()
	g, x := make([]float32, n), make([]float32, n)
	for i := range g {
		g[i] = float32(i%7) * 0.01
		x[i] = g[i] - 1e-5
	}
	x[model.OuterChunk+3] = 1e30 // chunk 1 is poisoned, chunk 0 honest
	pub, key, _ := ed25519.GenerateKey(crand.Reader)
	other, _, _ := ed25519.GenerateKey(crand.Reader)
	parts := [2][]byte{proto.AppendFloat32s(nil, x)}
	base := audit.OuterBaseLeaves(g)
	given, err := audit.OuterGivenLeaves(n, parts, false)
	if err != nil {
		t.Fatal(err)
	}
	entry := audit.OuterEntry{Tensor: tensor, Segment: [2]int{0, len(base)}, Base: audit.MerkleRoot(base), Given: audit.MerkleRoot(given)}
	sig := ed25519.Sign(key, audit.OuterBatchMessage("job-1", plan, step, 1, false, false, 1, entry.Leaf()))
	evidence := func(c int, edit func(*proto.OuterEvidence)) *proto.Error {
		e := &proto.OuterEvidence{Sender: "b", Tensor: tensor, Chunk: c, Segment: [2]int{0, len(base)}, Signature: sig,
			Base: audit.OuterBaseChunk(nil, g, c), BasePath: audit.MerklePath(base, c),
			Given: audit.OuterGivenChunk(nil, n, parts, false, c), GivenPath: audit.MerklePath(given, c), Entries: 1}
		if edit != nil {
			edit(e)
		}
		s := uint64(step)
		return &proto.Error{Code: proto.ErrCodeOuterRefused, PlanVersion: plan, Step: &s, Evidence: e}
	}
	p := &outerPlan{replicaOf: map[string]int{"a": 0, "b": 1, "c": 2}, workers: [][]string{{"a"}, {"b"}, {"c"}},
		keys: map[string][]byte{"a": other, "b": pub, "c": other}}
	if err := p.judge(spec, "job-1", evidence(1, nil), 1); !errors.Is(err, audit.ErrOuterSenderFalse) {
		t.Fatalf("the signed poison: %v, want its sender convicted", err)
	}
	for name, m := range map[string]*proto.Error{
		"honest chunk":      evidence(0, nil),
		"another's worker":  evidence(1, func(e *proto.OuterEvidence) { e.Sender = "c" }),
		"no such tensor":    evidence(1, func(e *proto.OuterEvidence) { e.Tensor = len(spec.Model.Specs()) }),
		"another tensor":    evidence(1, func(e *proto.OuterEvidence) { e.Tensor = tensor + 1 }),
		"another job's key": evidence(1, func(e *proto.OuterEvidence) { e.Signature = ed25519.Sign(key, []byte("something else")) }),
	} {
		if err := p.judge(spec, "job-1", m, 1); !errors.Is(err, audit.ErrOuterAccuserFalse) {
			t.Errorf("%s: %v, want the accuser convicted", name, err)
		}
	}
	p.keys["b"] = other
	if err := p.judge(spec, "job-1", evidence(1, nil), 1); !errors.Is(err, audit.ErrOuterAccuserFalse) {
		t.Errorf("under a key the plan did not record: %v, want the accuser convicted", err)
	}
	if err := p.judge(spec, "job-2", evidence(1, nil), 1); !errors.Is(err, audit.ErrOuterAccuserFalse) {
		t.Errorf("signed for another job: %v, want the accuser convicted", err)
	}
}
