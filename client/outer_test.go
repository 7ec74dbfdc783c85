//go:build !js

package client

import (
	"context"
	"crypto/ed25519"
	crand "crypto/rand"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// TestOuterParts: what a replica sends at an outer step with int8 — full chunks and the short
// last one, codes and scales — decodes on the other side to exactly the values the sender's
// outer step uses, and what does not have the expected dtype, shape or length is refused.
func TestOuterParts(t *testing.T) {
	const n = 2*model.OuterChunk + 37
	g, r := make([]float32, n), make([]float32, n)
	for i := range g {
		g[i] = float32(math.Sin(float64(i)))
		r[i] = g[i] - float32(math.Cos(float64(i)))*1e-3
	}
	x, e := make([]float32, n), make([]float32, n)
	parts := model.OuterLayout{N: n, Int8: true}.EncodeInt8(g, r, x, e)
	m := &proto.OuterSync{Step: 7, PlanVersion: 2, Participants: []int{0, 1}}
	rt := reduceTensor{name: "w", global: 3, size: n}
	send := func(ts []proto.Tensor) Transport {
		net := NewMemNetwork()
		t.Cleanup(net.Close)
		for _, pt := range ts {
			if err := net.Peer("a").Send(context.Background(), "b", pt); err != nil {
				t.Fatal(err)
			}
		}
		return net.Peer("b")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	got := make([]float32, n)
	if _, err := recvOuter(ctx, send(outerTensors(m.PlanVersion, m.Step, 0, rt, 1, r, parts, true, false)), m.PlanVersion, m.Step, 0, rt, 1, got, true, false); err != nil {
		t.Fatal(err)
	}
	for i := range x {
		if math.Float32bits(got[i]) != math.Float32bits(x[i]) {
			t.Fatalf("value %d decoded %v, the sender's %v", i, got[i], x[i])
		}
	}
	// θ_r as float32.
	if _, err := recvOuter(ctx, send(outerTensors(m.PlanVersion, m.Step, 0, rt, 1, r, parts, false, false)), m.PlanVersion, m.Step, 0, rt, 1, got, false, false); err != nil {
		t.Fatal(err)
	}
	for i := range r {
		if got[i] != r[i] {
			t.Fatalf("θ_r value %d received %v, sent %v", i, got[i], r[i])
		}
	}
	// A part of another shape, or float32 where int8 is due, is refused.
	bad := outerTensors(m.PlanVersion, m.Step, 0, rt, 1, r, parts, true, false)
	bad[0].Shape = proto.Shape{1, uint32(2 * model.OuterChunk), 1, 1}
	bad[0].Data = append(append([]byte(nil), bad[0].Data[:4]...), bad[0].Data[8:]...)
	short, cancelShort := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelShort()
	if _, err := recvOuter(short, send(bad), m.PlanVersion, m.Step, 0, rt, 1, got, true, false); err == nil {
		t.Error("an int8 part of the wrong shape was taken")
	}
	if _, err := recvOuter(short, send(outerTensors(m.PlanVersion, m.Step, 0, rt, 1, r, parts, false, false)), m.PlanVersion, m.Step, 0, rt, 1, got, true, false); err == nil {
		t.Error("float32 taken where int8 was due")
	}
}

// TestOuterRestorePending: a stage restored from a checkpoint taken while a delayed outer step
// was pending (job.Sync.Delay) takes the step up as the uninterrupted run would: an existing
// replica from the snapshot the checkpoint holds for it (refusing a checkpoint without one), a
// replica new to the job from the global θ, whose snapshot is that θ, so that it keeps exactly the
// progress it makes; after the take-up step nothing is pending.
func TestOuterRestorePending(t *testing.T) {
	cfg := model.TinyConfig()
	spec := job.Default()
	spec.Model, spec.Steps = cfg, 10
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none", Delay: 2}
	// The outer step after step 3 is taken up after step 5: pending after 4 and 5 steps.
	stage := func(replica int) *StageRunner {
		sh, err := model.NewStageShard(cfg, 0, cfg.NLayer, nil)
		if err != nil {
			t.Fatal(err)
		}
		return &StageRunner{Shard: sh, Replica: &proto.ReplicaAssign{Index: replica}, Outer: testOuterState(t, sh.P.Specs(), spec)}
	}
	src := stage(0)
	src.Shard.Init(1)
	global, snap := model.NewParams(src.Shard.P.Specs()), model.NewParams(src.Shard.P.Specs())
	for i := range global.Slab {
		global.Slab[i] = src.Shard.P.Slab[i] + 1e-3
		snap.Slab[i] = src.Shard.P.Slab[i] - 1e-3
	}
	checkpoint := func(step int, withSnap bool) *model.Checkpoint {
		ts := model.OuterCheckpointGlobal(global, src.Outer.outer)
		ts = append(ts, model.OuterCheckpointReplica(0, src.Shard.P, src.Shard.Opt, nil)...)
		if withSnap {
			ts = append(ts, model.OuterCheckpointSnap(0, snap)...)
		}
		ck := &model.Checkpoint{Cfg: cfg, Step: step, Tensors: map[string]safetensors.Tensor{}}
		for _, tn := range ts {
			ck.Tensors[tn.Name] = tn
		}
		return ck
	}

	r0 := stage(0)
	if err := r0.outerRestore(checkpoint(5, true)); err != nil {
		t.Fatal(err)
	}
	if p := r0.Outer.pending; p == nil || p.takeUp != 5 || p.step != 3 {
		t.Fatalf("restored after 5 steps: pending %+v, want the outer step after step 3 taken up after step 5", p)
	}
	sameBits(t, "replica 0's θ_r", r0.Shard.P, src.Shard.P)
	sameBits(t, "replica 0's snapshot", r0.Outer.pending.snap, snap)
	if took, err := r0.takeUpOuter(5); err != nil || !took || r0.Outer.pending != nil {
		t.Fatalf("take-up after step 5: %v, pending %v", err, r0.Outer.pending)
	}
	want := model.NewParams(src.Shard.P.Specs())
	want.CopyFrom(src.Shard.P)
	if err := model.Rebase(want, global, snap); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "replica 0 after the take-up", r0.Shard.P, want)

	if err := stage(0).outerRestore(checkpoint(5, false)); err == nil || !strings.Contains(err.Error(), "lacks replica 0's θ") {
		t.Errorf("a pending checkpoint without the replica's snapshot: %v", err)
	}

	r1 := stage(1) // new to the job: the checkpoint has no part of replica 1
	if err := r1.outerRestore(checkpoint(4, true)); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "the new replica's θ_r", r1.Shard.P, global)
	if p := r1.Outer.pending; p == nil || p.takeUp != 5 {
		t.Fatalf("new replica restored after 4 steps: pending %+v", p)
	}
	sameBits(t, "the new replica's snapshot", r1.Outer.pending.snap, global)

	r2 := stage(0)
	if err := r2.outerRestore(checkpoint(6, false)); err != nil || r2.Outer.pending != nil {
		t.Errorf("restored after 6 steps, the take-up done: %v, pending %v", err, r2.Outer.pending)
	}
}

// TestOuterRedo: an outer step without a delay is held until it is committed, and asked again it
// starts over from the state before its first attempt (client/outer.go, "redo"). A stage whose
// first attempt failed (its partner, replica 1, never answers) takes the second, alone, to the
// bits of a stage asked alone at once: the int8 error feedback that the first attempt's encoding
// changed is put back. Until the commit θ_r is unchanged and no step may start
// (outerUncommitted); the commit moves it to the new global θ. A commit of a step not held, and a
// redo of a step never asked, are refused and change nothing.
func TestOuterRedo(t *testing.T) {
	cfg := model.TinyConfig()
	spec := job.Default()
	spec.Model, spec.Steps = cfg, 10
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	stage := func() *StageRunner { return roundDone(t, spec) }
	ctx := context.Background()
	alone := &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0}}

	ref := stage()
	theta := model.NewParams(ref.Shard.P.Specs())
	theta.CopyFrom(ref.Shard.P)
	if err := ref.OuterStep(ctx, ctx, alone); err != nil {
		t.Fatal(err)
	}
	if ref.outerUncommitted() == "" {
		t.Error("an outer step held and not committed lets a step start")
	}
	sameBits(t, "θ_r before the commit", ref.Shard.P, theta)
	if err := ref.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1, Attempt: 1}); err == nil {
		t.Error("a commit of another attempt than the one held was taken")
	}
	if err := ref.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1}); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "θ_r after the commit", ref.Shard.P, ref.Outer.global)
	if why := ref.outerUncommitted(); why != "" {
		t.Errorf("after the commit: %s", why)
	}

	r := stage()
	zero := model.NewParams(r.Shard.P.Specs())
	if err := r.OuterStep(ctx, ctx, &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0, 1}}); err == nil {
		t.Fatal("an outer step with a partner that has no link succeeded")
	}
	if r.Outer.failed != 3 || r.outerUncommitted() == "" {
		t.Fatalf("after a failed attempt: failed %d, %q", r.Outer.failed, r.outerUncommitted())
	}
	if slices.Equal(r.Outer.err.Slab, zero.Slab) {
		t.Fatal("the failed attempt left the error feedback as it was: the test shows nothing")
	}
	if err := r.OuterStep(ctx, ctx, &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0}, Owners: []int{0, 0}, Lost: []int{1}, Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	if err := r.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1, Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	seg := segmentsRef(t, stage(), false)
	sameOuter(t, "the redo's", r, seg)
	sameBits(t, "the redo's θ_r", r.Shard.P, seg.Outer.global)

	// What a hostile or confused coordinator may send: refused, nothing changed.
	h := stage()
	theta.CopyFrom(h.Shard.P)
	if err := h.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1}); err == nil {
		t.Error("a commit of an outer step never asked was taken")
	}
	// More segments, or participants, than a plan of two replicas has: refused before the
	// exchange allocates anything for them.
	for _, m := range []*proto.OuterSync{
		{Step: 3, PlanVersion: 1, Participants: []int{0, 1}, Owners: make([]int, model.OuterSegmentsPerReplica*2+1)},
		{Step: 3, PlanVersion: 1, Participants: []int{0, 1, 2}},
	} {
		if err := h.OuterStep(ctx, ctx, m); err == nil || !strings.Contains(err.Error(), "for a plan of 2 replicas") || h.Outer.x != nil {
			t.Errorf("%d participants, %d segments in a plan of 2 replicas: %v, exchange %v", len(m.Participants), len(m.SegmentOwners()), err, h.Outer.x)
		}
	}
	sameBits(t, "θ_r after what was refused", h.Shard.P, theta)
	if why := h.outerUncommitted(); why != "" {
		t.Errorf("after what was refused: %s", why)
	}
}

// TestOuterDelayedRedo: a delayed outer step (every 4, delay 2: the step after step 3 is taken up
// after step 5) has the undelayed step's two phases beside training. Its exchange over, the stage
// holds the average (a stage alone takes the step into its global θ at once: nobody can be left
// out of it), and nothing is taken up until the commit; the take-up waits for the commit and for
// the take-up step. Asked again (a participant lost), the
// stage ends the first attempt, puts back what it changed and exchanges again from the snapshot of
// θ_r it took at the outer step — not from the θ_r it has trained to since — to the bits of a
// stage asked alone at once. A commit or a redo of a delayed step never asked is refused.
func TestOuterDelayedRedo(t *testing.T) {
	cfg := model.TinyConfig()
	spec := job.Default()
	spec.Model, spec.Steps = cfg, 10
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Delay: 2}
	if spec.OuterTakeUpAfter(3) != 5 {
		t.Fatalf("the test wants the outer step after step 3 taken up after step 5, not %d", spec.OuterTakeUpAfter(3))
	}
	stage := func() *StageRunner { return roundDone(t, spec) }
	ctx := context.Background()
	alone := &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0}}
	clone := func(p *model.Params) *model.Params {
		c := model.NewParams(p.Specs())
		c.CopyFrom(p)
		return c
	}

	ref := stage()
	theta0 := clone(ref.Shard.P)
	if err := ref.OuterStep(ctx, ctx, alone); err != nil {
		t.Fatal(err)
	}
	if err := ref.Outer.pending.wait(); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "θ_r before the commit", ref.Shard.P, theta0)
	if took, err := ref.takeUpOuter(5); took || err != nil || ref.Outer.pending == nil {
		t.Fatalf("a take-up before the commit: took %v, %v", took, err)
	}
	if err := ref.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1, Attempt: 1}); err == nil {
		t.Error("a commit of another attempt than the one held was taken")
	}
	if err := ref.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1}); err != nil {
		t.Fatal(err)
	}
	if took, _ := ref.takeUpOuter(4); took {
		t.Error("taken up after step 4, before its take-up step")
	}
	if took, err := ref.takeUpOuter(5); !took || err != nil || ref.Outer.pending != nil {
		t.Fatalf("the take-up after the commit: took %v, %v", took, err)
	}
	sameBits(t, "θ_r taken up (no progress since the outer step)", ref.Shard.P, ref.Outer.global)

	r := stage()
	zero := model.NewParams(r.Shard.P.Specs())
	snap := clone(r.Shard.P)
	if err := r.OuterStep(ctx, ctx, &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0, 1}}); err != nil {
		t.Fatal(err) // delayed: the exchange runs on, and fails there
	}
	if err := r.Outer.pending.wait(); err == nil {
		t.Fatal("an outer step with a partner that has no link succeeded")
	}
	if slices.Equal(r.Outer.err.Slab, zero.Slab) {
		t.Fatal("the failed attempt left the error feedback as it was: the test shows nothing")
	}
	for i := range r.Shard.P.Slab { // steps 4 and 5, trained meanwhile
		r.Shard.P.Slab[i] += 1e-3
	}
	trained := clone(r.Shard.P)
	if err := r.OuterStep(ctx, ctx, &proto.OuterSync{Step: 3, PlanVersion: 1, Participants: []int{0}, Owners: []int{0, 0}, Lost: []int{1}, Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	if err := r.Outer.pending.wait(); err != nil {
		t.Fatal(err)
	}
	if err := r.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1, Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	ref = segmentsRef(t, stage(), true)
	sameOuter(t, "the redo's", r, ref)
	if took, err := r.takeUpOuter(5); !took || err != nil {
		t.Fatalf("the redo's take-up: took %v, %v", took, err)
	}
	want := clone(trained)
	if err := model.Rebase(want, ref.Outer.global, snap); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "the redo's θ_r taken up", r.Shard.P, want)

	// What a hostile or confused coordinator may send: refused, nothing changed.
	h := stage()
	theta := clone(h.Shard.P)
	if err := h.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1}); err == nil {
		t.Error("a commit of a delayed outer step never asked was taken")
	}
	sameBits(t, "θ_r after what was refused", h.Shard.P, theta)
	if h.Outer.pending != nil {
		t.Error("what was refused left a step pending")
	}
	// A commit before this stage's exchange is over (it has not answered outer_done) is refused
	// at once, not waited out.
	h.Outer.pending = &pendingOuter{step: 3, takeUp: 5, snap: theta, done: make(chan struct{})}
	refused := make(chan error, 1)
	go func() { refused <- h.CommitOuter(&proto.OuterCommit{Step: 3, PlanVersion: 1}) }()
	select {
	case err := <-refused:
		if err == nil || h.Outer.pending.committed {
			t.Errorf("a commit while the exchange runs: %v, committed %v", err, h.Outer.pending.committed)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a commit while the exchange runs waits for it")
	}
}

// roundDone is replica 0's whole-model stage of spec after a round: its global θ the seed's, its
// θ_r moved from it (a pseudo-gradient to send).
func roundDone(t *testing.T, spec job.Spec) *StageRunner {
	t.Helper()
	sh, err := model.NewStageShard(spec.Model, 0, spec.Model.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	sh.Init(1)
	r := &StageRunner{Shard: sh, Replica: &proto.ReplicaAssign{Index: 0, Count: 2}, Outer: testOuterState(t, sh.P.Specs(), spec)}
	if err := r.Outer.global.CopyFrom(sh.P); err != nil {
		t.Fatal(err)
	}
	for i := range sh.P.Slab {
		sh.P.Slab[i] += 1e-3 * float32(math.Sin(float64(i)))
	}
	return r
}

// segmentsRef is stage r after the outer step the redos above end with, as the single process
// defines it (model.Outer.StepSegments): replicas 0 and 1 asked, each owning a segment; replica
// 1 lost before anything of it came, its segment given to replica 0, which averages both alone.
// Without delayed, r's θ_r ends as the new global θ.
func segmentsRef(t *testing.T, r *StageRunner, delayed bool) *StageRunner {
	t.Helper()
	o := r.Outer
	other := model.NewParams(r.Shard.P.Specs())
	other.CopyFrom(o.global)
	errs := []*model.Params{o.err, model.NewParams(r.Shard.P.Specs())}
	alone := func(ti, k int) []int { return []int{0} }
	if err := o.outer.StepSegments(o.global, []*model.Params{r.Shard.P, other}, errs, []int{0, 1}, [][]int{{0, 0}}, alone); err != nil {
		t.Fatal(err)
	}
	if !delayed {
		r.Shard.P.CopyFrom(o.global)
	}
	return r
}

// sameOuter fails the test unless r's outer state (global θ, momentum, error feedback) is ref's,
// bit for bit.
func sameOuter(t *testing.T, what string, r, ref *StageRunner) {
	t.Helper()
	sameBits(t, what+" global θ", r.Outer.global, ref.Outer.global)
	sameBits(t, what+" momentum", r.Outer.outer.V, ref.Outer.outer.V)
	sameBits(t, what+" error feedback", r.Outer.err, ref.Outer.err)
}

// sameBits fails the test unless a holds b's values bit for bit (what names a).
func sameBits(t *testing.T, what string, a, b *model.Params) {
	t.Helper()
	for i := range a.Slab {
		if math.Float32bits(a.Slab[i]) != math.Float32bits(b.Slab[i]) {
			t.Fatalf("%s: value %d is %v, want %v", what, i, a.Slab[i], b.Slab[i])
		}
	}
}

// TestOuterBatchForgeries: what a sender hands an owner of a tensor is signed once, in a batch
// (proto.OuterBatchSig, proto.OuterSigEntry): the owner takes both of its segments, checking the
// batch's signature once. A segment that names another entry of its batch, a batch whose leaves
// were changed after signing, or an entry that miscounts its batch is refused as unsigned — its
// sender broke the protocol, which nothing proves to the coordinator — and so is the same batch
// signed by another key than the sender's.
func TestOuterBatchForgeries(t *testing.T) {
	cfg := model.TinyConfig()
	spec := job.Default()
	spec.Model, spec.Steps = cfg, 10
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	const plan, step = 1, 3
	pubA, keyA, _ := ed25519.GenerateKey(crand.Reader)
	_, other, _ := ed25519.GenerateKey(crand.Reader)
	owners := model.OuterOwners([]int{0, 1})
	// A tensor of which the owner, replica 0, holds two segments.
	var tensor reduceTensor
	var segs []int
	for i, s := range cfg.Specs() {
		segs = segs[:0]
		for k, q := range owners {
			if lo, hi := model.OuterSegment(s.Size(), len(owners), k); q == 0 && lo < hi {
				segs = append(segs, k)
			}
		}
		if len(segs) >= 2 {
			tensor = reduceTensor{name: s.Name, global: i, size: s.Size()}
			segs = segs[:2]
			break
		}
	}
	if len(segs) < 2 {
		t.Fatal("no tensor of the tiny model has two segments an owner")
	}

	for _, tc := range []struct {
		name  string
		key   ed25519.PrivateKey
		forge func(a *StageRunner, b *outerBatch, entries []proto.Tensor)
		from  int // the first segment refused, and every one after it
	}{
		{"honest", keyA, nil, 2},
		{"another entry", keyA, func(_ *StageRunner, b *outerBatch, entries []proto.Tensor) {
			entries[1] = proto.OuterSigEntry{Entry: 0, Entries: 2, First: b.first}.Tensor(entries[1].Key)
		}, 1},
		{"a leaf changed after signing", keyA, func(_ *StageRunner, b *outerBatch, _ []proto.Tensor) { b.leaves[1][0] ^= 1 }, 0},
		{"an entry that miscounts", keyA, func(_ *StageRunner, b *outerBatch, entries []proto.Tensor) {
			entries[1] = proto.OuterSigEntry{Entry: 1, Entries: 3, First: b.first}.Tensor(entries[1].Key)
		}, 1},
		{"another key", other, nil, 0},
		// Signed, but with more entries than the tensor has segments: leaves that sign nothing
		// it sends, for this stage to hold.
		{"more entries than segments", keyA, func(a *StageRunner, b *outerBatch, entries []proto.Tensor) {
			for len(b.leaves) <= min(len(owners), model.OuterLayout{N: tensor.size}.Chunks()) {
				b.leaves = append(b.leaves, [32]byte{byte(len(b.leaves))})
			}
			if err := a.signBatch(b, plan, step, 1, false); err != nil {
				t.Fatal(err)
			}
			for i := range entries {
				entries[i] = proto.OuterSigEntry{Entry: i, Entries: len(b.leaves), First: b.first}.Tensor(entries[i].Key)
			}
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			net := NewMemNetwork()
			a, b := roundDone(t, spec), roundDone(t, spec)
			a.Replica.Index = 1
			// θ_r a few steps of this early round could reach.
			for i, v := range a.Outer.global.Slab {
				a.Shard.P.Slab[i] = v + 1e-5*float32(math.Sin(float64(i)))
			}
			a.Outer.key = tc.key
			a.setNet(net.Peer("a"))
			b.setNet(net.Peer("b"))
			b.links = []reduceLink{{peer: proto.ReducePeer{Worker: "a", Replica: 1, Key: pubA}, tensors: []reduceTensor{tensor}}}
			base := audit.OuterBaseLeaves(a.Outer.global.Tensors[tensor.global].Data)

			// What a sends: each segment's frames, its entry, and the batch's signature first.
			batch := &outerBatch{}
			var frames [][]proto.Tensor
			for _, k := range segs {
				lo, hi := model.OuterSegment(tensor.size, len(owners), k)
				pts := a.outerFrames(plan, step, k, tensor, 1, a.Shard.P.Tensors[tensor.global].Data[lo:hi], [2][]byte{}, false)
				e, err := a.outerEntry(tensor, outerSeg{lo, hi}, pts, base)
				if err != nil {
					t.Fatal(err)
				}
				batch.add(k, e)
				frames = append(frames, pts)
			}
			if err := a.signBatch(batch, plan, step, 1, false); err != nil {
				t.Fatal(err)
			}
			var entries []proto.Tensor
			for _, k := range segs {
				entries = append(entries, a.entryFrame(batch, plan, step, k, tensor, 1, false))
			}
			if tc.forge != nil {
				tc.forge(a, batch, entries)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			send := []proto.Tensor{a.batchFrame(batch, plan, step, tensor, 1, false)}
			for i := range segs {
				send = append(append(send, frames[i]...), entries[i])
			}
			for _, pt := range send {
				if err := a.Net.Send(ctx, "b", pt); err != nil {
					t.Fatal(err)
				}
			}

			hs := batchHeaders{segs: len(owners)}
			bound := audit.NewOuterBound(spec, step, false)
			g := b.Outer.global.Tensors[tensor.global].Data
			for i, k := range segs {
				lo, hi := model.OuterSegment(tensor.size, len(owners), k)
				x := make([]float32, hi-lo)
				err := b.takeOuter(ctx, &hs, plan, step, k, 1, bound, g, tensor.name, outerSeg{lo, hi}, x, base)
				var refusal *outerRefusal
				switch {
				case i >= tc.from && (!errors.As(err, &refusal) || refusal.evidence != nil || !strings.Contains(err.Error(), "not signed")):
					t.Fatalf("segment %d: %v, want it refused as unsigned, without evidence", k, err)
				case i < tc.from && err != nil:
					t.Fatalf("segment %d: %v", k, err)
				case i < tc.from && !slices.Equal(x, a.Shard.P.Tensors[tensor.global].Data[lo:hi]):
					t.Fatalf("segment %d: not what was sent", k)
				}
			}
			// Once, or never where the batch is refused before its leaves are kept.
			if n, want := b.Outer.verifies.Load(), int64(1); n != want && !(tc.name == "more entries than segments" && n == 0) {
				t.Errorf("the batch's signature checked %d times, want once", n)
			}
		})
	}
}
