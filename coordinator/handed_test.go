package coordinator

import (
	"testing"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// TestHandedState: the state a taker of several givers must name is composed from what each giver
// said it gave (proto.Ready.Sums) for the blocks it gave, and equals the digest of the state the
// taker holds once it has them — in step mode (the givers' kept states, parameters and both
// moments) and in outer mode (their global θ, the taker's moments zero); from one twin it is the
// twin's own word. A giver whose hashes are not of the state it committed to is refused, as is a
// giver with no hashes at all.
func TestHandedState(t *testing.T) {
	for _, outer := range []bool{false, true} {
		spec := job.Default()
		spec.Model = model.TinyConfig()
		spec.AuditRate = 1
		if outer {
			spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9}
		}
		cfg := spec.Model
		L := cfg.NLayer
		// shard is a stage of blocks [lo, hi) whose every value is a function of seed: its state
		// (step mode) or its global θ (outer mode, which a giver gives).
		shard := func(lo, hi int, seed uint64) *model.Shard {
			sh, err := model.NewStageShard(cfg, lo, hi, nil)
			if err != nil {
				t.Fatal(err)
			}
			sh.Init(seed)
			for i, m := range sh.Opt.M.Tensors {
				for k := range m.Data {
					m.Data[k], sh.Opt.V.Tensors[i].Data[k] = float32(seed)+float32(k%7), float32(seed)+float32(k%5)
				}
			}
			return sh
		}
		// state is what a holder of sh hands over, as its Ready names it: in outer mode its
		// parameters stand for the global θ and the moments are zero.
		state := func(sh *model.Shard) []safetensors.Tensor {
			ts := model.CheckpointTensors(sh.P, sh.Opt)
			if outer {
				n := len(sh.P.Tensors)
				for i := n; i < len(ts); i++ {
					ts[i].Data = make([]float32, len(ts[i].Data))
				}
			}
			return ts
		}
		a, b := shard(0, L/2, 1), shard(L/2, L, 2)
		ready := func(sh *model.Shard) *peer {
			ts := state(sh)
			p := &peer{readySums: audit.TensorSums(ts)}
			if outer {
				p.readyGave, p.readySums = audit.StateDigest(ts), p.readySums[:len(sh.P.Tensors)]
			} else {
				p.readyState = audit.StateDigest(ts)
			}
			return p
		}
		stage := func(lo, hi int) proto.Shard {
			return proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: lo, End: hi, First: lo == 0, Last: hi == L}}
		}
		j := &jobRun{spec: spec, peers: map[string]*peer{"a": ready(a), "b": ready(b)}, audits: newAuditor()}
		j.audits.assigns["a"] = &proto.Assign{Shard: stage(0, L/2)}
		j.audits.assigns["b"] = &proto.Assign{Shard: stage(L/2, L)}
		taker := &proto.Assign{Shard: stage(0, L), From: []proto.Handover{
			{Worker: "a", FromPlan: 1, Step: 9, Begin: 0, End: L / 2}, {Worker: "b", FromPlan: 1, Step: 9, Begin: L / 2, End: L}}}

		// The taker's state once it holds the givers' blocks.
		whole := shard(0, L, 3)
		from := map[string][]float32{}
		for _, g := range []*model.Shard{a, b} {
			for _, st := range state(g) {
				from[st.Name] = st.Data
			}
		}
		ts := state(whole)
		for i := range ts {
			if d, ok := from[ts[i].Name]; ok {
				ts[i].Data = d
			}
		}
		want := audit.StateDigest(ts)
		if got, err := j.handedState(taker); err != nil || got != want {
			t.Fatalf("outer %v: from two givers %s, %v; want %s", outer, got, err, want)
		}
		// One twin: its own word.
		twin := &proto.Assign{Shard: stage(0, L/2), From: []proto.Handover{{Worker: "a", FromPlan: 1, Step: 9, Begin: 0, End: L / 2}}}
		if got, err := j.handedState(twin); err != nil || got != audit.StateDigest(state(a)) {
			t.Fatalf("outer %v: from a twin %s, %v", outer, got, err)
		}
		// A part of one holder's stage: composed from its hashes.
		part := &proto.Assign{Shard: stage(L/2, L/2+1), From: []proto.Handover{{Worker: "b", FromPlan: 1, Step: 9, Begin: L / 2, End: L/2 + 1}}}
		pb := shard(L/2, L/2+1, 4)
		pts := state(pb)
		for i := range pts {
			pts[i].Data = from[pts[i].Name]
		}
		if got, err := j.handedState(part); err != nil || got != audit.StateDigest(pts) {
			t.Fatalf("outer %v: a part of b's stage %s, %v; want %s", outer, got, err, audit.StateDigest(pts))
		}
		// b's hashes are not of the state it committed to: refused.
		lie := *j.peers["b"]
		lie.readySums = append([]proto.KeyDigest(nil), lie.readySums...)
		lie.readySums[0].Digest = j.peers["a"].readySums[0].Digest
		j.peers["b"] = &lie
		if _, err := j.handedState(taker); err == nil {
			t.Errorf("outer %v: a giver whose hashes are not of its word was believed", outer)
		}
		lie.readySums = nil
		if _, err := j.handedState(taker); err == nil {
			t.Errorf("outer %v: a giver with no hashes was believed", outer)
		}
	}
}
