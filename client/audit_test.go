//go:build !js

package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// auditRig is a plan's workers in one process as the coordinator assigns them: each shard built
// from its proto.Assign by buildShard, as assignShard builds it, and trained by its trainer over
// a MemNetwork, driven as coordinator/step.go drives a step. Its audits fetch a worker's evidence
// as bytes, check it against the worker's commitments and recompute it with Recompute from the
// same Assign — the worker side of verification end to end, without sockets.
type auditRig struct {
	t        *testing.T
	spec     job.Spec
	stages   []string
	ids      []string // stages, then expert hosts
	assigns  map[string]*proto.Assign
	trainers map[string]*trainer
	net      *MemNetwork
	driver   Transport
}

// newAuditRig cuts spec's model into stages at cuts, with hosts[i] the experts of expert host i
// (an expert on two hosts is replicated, the first listed replica 0), and gives worker id the
// fault faults[id].
func newAuditRig(t *testing.T, spec job.Spec, cuts []int, hosts [][]ExpertRef, faults map[string]string) *auditRig {
	t.Helper()
	cfg := spec.Model
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	r := &auditRig{t: t, spec: spec, assigns: map[string]*proto.Assign{}, trainers: map[string]*trainer{}, net: NewMemNetwork()}
	t.Cleanup(r.net.Close)
	r.driver = r.net.Peer("coordinator")
	bounds := append(append([]int{0}, cuts...), cfg.NLayer)
	S := len(bounds) - 1
	stageID := func(i int) string {
		if i < 0 || i >= S {
			return ""
		}
		return fmt.Sprintf("stage-%d", i)
	}
	stageOf := func(blk int) int {
		for i := range S {
			if blk >= bounds[i] && blk < bounds[i+1] {
				return i
			}
		}
		return -1
	}
	placed := map[ExpertRef][]string{}
	for h, refs := range hosts {
		for _, ref := range refs {
			placed[ref] = append(placed[ref], fmt.Sprintf("expert-%d", h))
		}
	}
	for i := range S {
		id := stageID(i)
		a := &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: 1, Prev: stageID(i - 1), Next: stageID(i + 1), ExpertHosts: []proto.ExpertHost{},
			Shard: proto.Shard{Stage: &proto.StageShard{Index: i, Count: S, Begin: bounds[i], End: bounds[i+1], First: i == 0, Last: i == S-1}}}
		for blk := bounds[i]; blk < bounds[i+1]; blk++ {
			for e := range cfg.NExpert {
				if ws := placed[ExpertRef{blk, e}]; len(ws) > 0 {
					a.ExpertHosts = append(a.ExpertHosts, proto.ExpertHost{Block: blk, Expert: e, Workers: ws})
				}
			}
		}
		r.stages = append(r.stages, id)
		r.ids = append(r.ids, id)
		r.assigns[id] = a
	}
	for h, refs := range hosts {
		id := fmt.Sprintf("expert-%d", h)
		blk := refs[0].Block
		var es []int
		a := &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: 1, ExpertHosts: []proto.ExpertHost{}, Router: stageID(stageOf(blk))}
		for _, ref := range refs {
			es = append(es, ref.Expert)
			if ws := placed[ref]; len(ws) == 2 {
				a.ExpertHosts = append(a.ExpertHosts, proto.ExpertHost{Block: ref.Block, Expert: ref.Expert, Workers: ws})
			}
		}
		slices.Sort(es)
		a.Shard.Experts = &proto.ExpertShard{Block: blk, Experts: es, StageIndex: stageOf(blk), StageCount: S}
		r.ids = append(r.ids, id)
		r.assigns[id] = a
	}
	for _, id := range r.ids {
		a := r.assigns[id]
		if err := a.Validate(); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		b, err := buildShard(model.Host{}, spec, a, id)
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		b.sh.Init(spec.Seed)
		c, err := newConduct(faults[id])
		if err != nil {
			t.Fatal(err)
		}
		r.trainers[id] = newTrainer(b.runner, r.net.Peer(id), spec.AuditRate > 0, c)
	}
	return r
}

// rigStep is a training step as the coordinator keeps it: how it was opened, every worker's
// report as it arrived, and the update's learning rate and clip factor.
type rigStep struct {
	st      proto.StepSpec
	lr      float64
	clip    float32
	ce      float64
	reports map[string]*proto.StepReport
}

// step runs training step s on every worker at once and decides its clip factor; the update is
// apply's.
func (r *auditRig) step(ctx context.Context, s int) *rigStep {
	r.t.Helper()
	spec := r.spec
	M, T := spec.MicroBatches, spec.Model.BlockSize
	st := proto.StepSpec{Step: uint64(s), PlanVersion: 1, MicroBatches: M, Rows: spec.BatchSize / M}
	x, y := testBatch(r.t, s, spec.BatchSize, T)
	n := st.Rows * T
	for j := range M {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			r.t.Fatal(err)
		}
		if err := r.driver.Send(ctx, r.stages[0], xt); err != nil {
			r.t.Fatal(err)
		}
		if err := r.driver.Send(ctx, r.stages[len(r.stages)-1], yt); err != nil {
			r.t.Fatal(err)
		}
	}
	reports := make([]*proto.StepReport, len(r.ids))
	errs := make([]error, len(r.ids))
	var wg sync.WaitGroup
	for i, id := range r.ids {
		wg.Go(func() { reports[i], errs[i] = r.trainers[id].step(ctx, st) })
	}
	wg.Wait()
	rs := &rigStep{st: st, lr: spec.LRAt(s), reports: map[string]*proto.StepReport{}}
	for i, id := range r.ids {
		if errs[i] != nil {
			r.t.Fatalf("step %d: %s: %v", s, id, errs[i])
		}
		// As the coordinator receives it: encoded, decoded and validated, commitment included.
		b, err := proto.EncodeMessage(reports[i])
		if err != nil {
			r.t.Fatal(err)
		}
		m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
		if err != nil {
			r.t.Fatalf("step %d: %s's report: %v", s, id, err)
		}
		reports[i] = m.(*proto.StepReport)
		rs.reports[id] = reports[i]
	}
	ce, _, norm, err := proto.StepTotals(reports, M)
	if err != nil {
		r.t.Fatalf("step %d: %v", s, err)
	}
	rs.ce, rs.clip = ce, model.ClipFactor(norm, spec.Clip)
	return rs
}

// apply sends every worker the step's Clip.
func (r *auditRig) apply(rs *rigStep) {
	for _, id := range r.ids {
		r.trainers[id].apply(rs.st.Step, rs.st.PlanVersion, rs.lr, rs.clip)
	}
}

// eval runs an evaluation after step on every worker, as the coordinator interleaves them with
// training steps, and returns the last stage's cross-entropies.
func (r *auditRig) eval(ctx context.Context, step int) []float64 {
	r.t.Helper()
	T := r.spec.Model.BlockSize
	x, y := testBatch(r.t, 99, 2*data.ValRows, T)
	st := proto.StepSpec{Step: proto.EvalStep(uint64(step)), PlanVersion: 1, MicroBatches: 2, Rows: data.ValRows}
	n := st.Rows * T
	for j := range st.MicroBatches {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			r.t.Fatal(err)
		}
		r.driver.Send(ctx, r.stages[0], xt)
		r.driver.Send(ctx, r.stages[len(r.stages)-1], yt)
	}
	reports := make([]*proto.StepReport, len(r.ids))
	errs := make([]error, len(r.ids))
	var wg sync.WaitGroup
	for i, id := range r.ids {
		wg.Go(func() { reports[i], errs[i] = r.trainers[id].runner.RunEval(ctx, st) })
	}
	wg.Wait()
	for i, id := range r.ids {
		if errs[i] != nil {
			r.t.Fatalf("eval: %s: %v", id, errs[i])
		}
		if reports[i].Commit != nil {
			r.t.Fatalf("eval: %s commits", id)
		}
	}
	return reports[len(r.stages)-1].CE
}

// stateDigest is the digest of id's state now, taken from its shard (as a checkpoint would be).
func (r *auditRig) stateDigest(id string) string {
	sh := r.trainers[id].runner.shard()
	sh.Pull()
	return audit.StateDigest(model.CheckpointTensors(sh.P, sh.Opt))
}

// audit audits id's step rs as the coordinator does once the worker committed to next, the state
// that followed: the evidence travels as bytes, must agree with the commitments, and is
// recomputed; it returns the exact comparison's verdict ("" for a pass).
func (r *auditRig) audit(ctx context.Context, id string, rs *rigStep, next string) string {
	r.t.Helper()
	b := r.trainers[id].bundle(rs.st.Step, rs.st.PlanVersion)
	if b == nil {
		r.t.Fatalf("%s holds no evidence of step %d", id, rs.st.Step)
	}
	rep := rs.reports[id]
	verdict := func(b *audit.Bundle, lean bool, sample uint64) string {
		var buf bytes.Buffer
		if err := b.Write(&buf); err != nil {
			r.t.Fatal(err)
		}
		got, err := audit.Read(&buf, 1<<30)
		if err != nil {
			r.t.Fatalf("%s's evidence of step %d: %v", id, rs.st.Step, err)
		}
		// A faulty worker commits to what it did: its evidence always agrees with its commitments.
		if err := audit.Check(got, rs.st.Step, rs.st.PlanVersion, rep.Commit, next, lean, sample); err != nil {
			r.t.Fatalf("%s's evidence of step %d contradicts its commitments: %v", id, rs.st.Step, err)
		}
		out, err := Recompute(ctx, model.Host{}, &audit.Replay{Assign: r.assigns[id], Worker: id, Spec: rs.st, Bundle: got, LR: rs.lr, Clip: rs.clip})
		if err != nil {
			r.t.Fatalf("recompute %s's step %d: %v", id, rs.st.Step, err)
		}
		return audit.Compare(out, got, rep, next, true)
	}
	whole := verdict(b, false, 0)
	// Lean evidence (proto.Audit.Lean), which leaves out the end state and what was sent, must
	// reach the same verdict from the commitments alone.
	lean := *b
	lean.Lean, lean.StateOut, lean.Sent = true, nil, nil
	if v := verdict(&lean, true, 0); (v == "") != (whole == "") {
		r.t.Fatalf("%s's step %d: the whole evidence's verdict %q, the lean evidence's %q", id, rs.st.Step, whole, v)
	}
	// And thin evidence (proto.Audit.Sample), whose large moments are sampled: every fault the
	// rig plays moves every group, so it too reaches the same verdict.
	for _, lean := range []bool{true, false} {
		thin := audit.Thin(b, 0x5eed+rs.st.Step, lean)
		if len(thin.InCVs) == 0 {
			r.t.Fatalf("%s's thin evidence of step %d samples no moment: the rig's model has no large tensor", id, rs.st.Step)
		}
		if v := verdict(thin, lean, 0x5eed+rs.st.Step); (v == "") != (whole == "") {
			r.t.Fatalf("%s's step %d: the whole evidence's verdict %q, the thin (lean %v) evidence's %q", id, rs.st.Step, whole, lean, v)
		}
	}
	return whole
}

// runAudited trains steps steps, auditing every worker's every step at the moment the coordinator
// may (after the next report, before the next Clip; the last step after its update), and returns
// the verdicts by worker and step, and the steps.
func (r *auditRig) runAudited(steps int) (map[string][]string, []*rigStep) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	verdicts := map[string][]string{}
	var done []*rigStep
	for s := range steps {
		rs := r.step(ctx, s)
		if s > 0 {
			for _, id := range r.ids {
				verdicts[id] = append(verdicts[id], r.audit(ctx, id, done[s-1], rs.reports[id].Commit.State))
			}
		}
		r.apply(rs)
		done = append(done, rs)
	}
	for _, id := range r.ids {
		verdicts[id] = append(verdicts[id], r.audit(ctx, id, done[steps-1], r.stateDigest(id)))
	}
	return verdicts, done
}

// auditSpec is the equivalence tests' job, audited.
func auditSpec() job.Spec {
	spec := testJobSpec(41)
	spec.AuditRate = 0.5
	return spec
}

// The placements the audit tests run: three stages with their own experts (a first stage without
// an MoE block, a middle and a last one with), and two stages whose experts live partly on expert
// hosts, expert 1 of block 1 replicated on two of them.
var (
	auditCutsLocal  = []int{1, 3}
	auditCutsRemote = []int{2}
	auditHosts      = [][]ExpertRef{{{1, 0}, {1, 1}}, {{1, 2}, {1, 3}, {1, 1}}, {{3, 0}, {3, 2}}}
)

// TestAuditHonestWorkersPass: every shard of both placements — first, middle and last stages,
// local and remote experts, a replicated expert host — commits to each step, and the exact
// recomputation of each step from its evidence agrees with it bit for bit. Recording changes no
// number: the losses are the single process's.
func TestAuditHonestWorkersPass(t *testing.T) {
	const steps = 3
	for _, tc := range []struct {
		name  string
		cuts  []int
		hosts [][]ExpertRef
	}{{"local experts", auditCutsLocal, nil}, {"expert hosts", auditCutsRemote, auditHosts}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := auditSpec()
			r := newAuditRig(t, spec, tc.cuts, tc.hosts, nil)
			verdicts, done := r.runAudited(steps)
			for _, id := range r.ids {
				for s, v := range verdicts[id] {
					if v != "" {
						t.Errorf("%s step %d: an honest worker fails its audit: %s", id, s, v)
					}
				}
			}
			want := referenceLosses(t, spec, tc.cuts, tc.hosts, steps)
			for s, rs := range done {
				if rs.ce != want[s] {
					t.Errorf("step %d: loss %v, the single process %v", s, rs.ce, want[s])
				}
			}
		})
	}
}

// TestAuditCatchesFaults: one worker plays each SHOAL_FAULT kind among honest ones. Its evidence
// agrees with its commitments (it commits to what it did), yet the exact recomputation of every
// step it cheated on differs, in the way the fault cheats; every honest worker — fed the faulty
// one's tensors — passes.
func TestAuditCatchesFaults(t *testing.T) {
	steps := 3
	if testing.Short() {
		steps = 2 // replay cheats from the second
	}
	tests := []struct {
		fault  string
		remote bool   // the placement with expert hosts
		worker string // the faulty one
		want   string // in the verdict
	}{
		{FaultFlipBit, true, "expert-0", "sent"}, // a replica of the replicated expert
		{FaultScaleGrad, true, "expert-2", "‖g‖²"},
		{FaultZeroAct, false, "stage-0", "sent"},
		{FaultReplay, false, "stage-2", "sent"},
		{FaultStaleWeights, false, "stage-1", "state after the update"},
		{FaultFalseNorm, true, "stage-0", "‖g‖²"}, // a stage with remote experts
		{FaultFalseLoss, true, "stage-1", "loss"}, // the last stage: CE and aux
		{FaultFalseLoss, false, "stage-1", "balancing loss"},
	}
	for _, tt := range tests {
		t.Run(tt.fault+"/"+tt.worker, func(t *testing.T) {
			cuts, hosts := auditCutsLocal, [][]ExpertRef(nil)
			if tt.remote {
				cuts, hosts = auditCutsRemote, auditHosts
			}
			r := newAuditRig(t, auditSpec(), cuts, hosts, map[string]string{tt.worker: tt.fault})
			if why := r.trainers[tt.worker].conduct.idle(r.trainers[tt.worker].runner); why != "" {
				t.Fatalf("the fault is idle on %s: %s", tt.worker, why)
			}
			verdicts, _ := r.runAudited(steps)
			for _, id := range r.ids {
				for s, v := range verdicts[id] {
					switch {
					case id != tt.worker && v != "":
						t.Errorf("honest %s step %d fails: %s", id, s, v)
					case id == tt.worker && tt.fault == FaultReplay && s == 0:
						if v != "" {
							t.Errorf("replay is honest on its first step, yet fails: %s", v)
						}
					case id == tt.worker && !strings.Contains(v, tt.want):
						t.Errorf("faulty %s step %d: verdict %q, want one about %q", id, s, v, tt.want)
					case id == tt.worker:
						t.Logf("%s step %d: %s", id, s, v)
					}
				}
			}
		})
	}
}

// TestAuditEvidenceTimeline: the evidence of step s is held from Clip(s) to Clip(s+1) — through
// the next step, when the coordinator asks for it — and only for its plan; a new assignment drops
// it. Steps of a job that does not audit commit to nothing and keep nothing.
func TestAuditEvidenceTimeline(t *testing.T) {
	ctx := context.Background()
	r := newAuditRig(t, auditSpec(), []int{2}, nil, nil)
	tr := r.trainers["stage-1"]
	s0 := r.step(ctx, 0)
	if tr.bundle(0, 1) != nil {
		t.Fatal("evidence of step 0 before its Clip")
	}
	start := s0.reports["stage-1"].Commit.State
	if start != r.stateDigest("stage-1") {
		t.Fatal("the first commitment is not to the initial state")
	}
	r.apply(s0)
	// An evaluation is no part of any step's traffic or evidence: the audits below pass.
	r.eval(ctx, 0)
	b := tr.bundle(0, 1)
	if b == nil || tr.bundle(0, 2) != nil || tr.bundle(1, 1) != nil {
		t.Fatal("after Clip(0): want the evidence of step 0 of plan 1, and only it")
	}
	if audit.StateDigest(b.StateIn) != start || audit.StateDigest(b.StateOut) != r.stateDigest("stage-1") {
		t.Fatal("evidence of step 0: wrong start or end state")
	}
	s1 := r.step(ctx, 1)
	if tr.bundle(0, 1) == nil {
		t.Fatal("the evidence of step 0 is gone during step 1")
	}
	if s1.reports["stage-1"].Commit.State == start {
		t.Fatal("step 1 commits to the state before the update")
	}
	for _, id := range r.ids {
		if v := r.audit(ctx, id, s0, s1.reports[id].Commit.State); v != "" {
			t.Fatalf("%s step 0: %s", id, v)
		}
	}
	r.apply(s1)
	if tr.bundle(0, 1) != nil || tr.bundle(1, 1) == nil {
		t.Fatal("after Clip(1): want the evidence of step 1 only")
	}
	tr.dropEvidence()
	if tr.bundle(1, 1) != nil {
		t.Fatal("evidence kept after a new assignment")
	}

	spec := auditSpec()
	spec.AuditRate = 0
	off := newAuditRig(t, spec, []int{2}, nil, nil)
	for _, id := range off.ids {
		if tr := off.trainers[id]; tr.net != nil {
			t.Fatalf("%s: a job without audits records through a stepNet", id)
		}
	}
	rs := off.step(ctx, 0)
	off.apply(rs)
	for id, rep := range rs.reports {
		if rep.Commit != nil || off.trainers[id].bundle(0, 1) != nil {
			t.Fatalf("%s: commitment or evidence in a job that does not audit", id)
		}
	}
}

// TestRecomputeRefusesIncompleteEvidence: a recomputation that needs a tensor the evidence lacks
// fails at once, naming it, rather than waiting for it; a start state that is not the shard's is
// refused.
func TestRecomputeRefusesIncompleteEvidence(t *testing.T) {
	// A recomputation that waited would wait for ever: the deadline only bounds the test.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r := newAuditRig(t, auditSpec(), []int{2}, nil, nil)
	rs := r.step(ctx, 0)
	r.apply(rs)
	replay := func(id string, change func(b *audit.Bundle)) error {
		b := r.trainers[id].bundle(0, 1)
		c := *b
		c.Recv, c.StateIn = slices.Clone(b.Recv), slices.Clone(b.StateIn)
		change(&c)
		_, err := Recompute(ctx, nil, &audit.Replay{Assign: r.assigns[id], Worker: id, Spec: rs.st, Bundle: &c, LR: rs.lr, Clip: rs.clip})
		return err
	}
	for _, id := range r.ids {
		err := replay(id, func(b *audit.Bundle) { b.Recv = b.Recv[:len(b.Recv)-1] })
		if !errors.Is(err, ErrNotInEvidence) {
			t.Errorf("%s without its last received tensor: err = %v, want ErrNotInEvidence", id, err)
		}
	}
	if err := replay("stage-0", func(b *audit.Bundle) { b.StateIn = b.StateIn[1:] }); err == nil || !strings.Contains(err.Error(), "start state") {
		t.Errorf("a start state short of a tensor: err = %v", err)
	}
	if err := replay("stage-0", func(b *audit.Bundle) { b.StateIn = append(b.StateIn, b.StateIn[0]) }); err == nil {
		t.Error("a start state with a tensor twice was taken")
	}
	if err := replay("stage-0", func(b *audit.Bundle) { b.Step = 5 }); err == nil {
		t.Error("evidence of another step was taken")
	}
}

// auditWorker joins a worker session as hub.join does, with fault.
func (h *testHub) auditWorker(id, fault string) *session {
	h.t.Helper()
	return h.joinWith(id, func(cfg *WorkerConfig, _ *proto.Hello) { cfg.Fault = fault })
}

// TestSessionAudit runs the protocol through real worker sessions (relayed, so without WebRTC):
// the reports carry commitments; an Audit between the next report and the next Clip uploads the
// evidence to its path with the worker's credential; it checks against the commitments and
// recomputes to the honest worker's bits and not to the faulty one's, from the whole evidence (s0)
// and from lean evidence (s1: no end state, nothing sent); an Audit of a step no longer held is
// ignored.
func TestSessionAudit(t *testing.T) {
	h := newTestHub(t)
	spec := auditSpec()
	p := twoStagePlan(t, spec, "s0", "s1", true)
	sessions := map[string]*session{"s0": h.auditWorker("s0", ""), "s1": h.auditWorker("s1", FaultFalseLoss)}
	type upload struct {
		path, auth string
		body       []byte
	}
	uploads := make(chan upload, 8)
	h.mu.Lock()
	h.onHTTP = func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		uploads <- upload{r.URL.Path, r.Header.Get("Authorization"), b}
		w.WriteHeader(http.StatusNoContent)
	}
	h.mu.Unlock()
	h.start(p)
	M, B, T := spec.MicroBatches, spec.BatchSize, spec.Model.BlockSize
	open := func(step uint64) (proto.StepSpec, map[string]*proto.StepReport) {
		st := proto.StepSpec{Step: step, PlanVersion: p.version, MicroBatches: M, Rows: B / M}
		for _, id := range p.stages {
			h.send(id, &proto.StepOpen{Step: step, PlanVersion: p.version, LR: spec.LR, MicroBatches: M, DeadlineMS: 30_000, Rows: st.Rows})
		}
		x, y := testBatch(t, int(step), B, T)
		n := st.Rows * T
		for j := range M {
			xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
			if err != nil {
				t.Fatal(err)
			}
			h.direct("s0", xt)
			h.direct("s1", yt)
		}
		reps := map[string]*proto.StepReport{}
		for len(reps) < 2 {
			m := h.next()
			rep, ok := m.m.(*proto.StepReport)
			if !ok {
				t.Fatalf("%s sent %s during step %d", m.from, m.m.Type(), step)
			}
			if rep.Commit == nil {
				t.Fatalf("%s's report of step %d commits to nothing", m.from, step)
			}
			reps[m.from] = rep
		}
		return st, reps
	}
	clipOf := func(reps map[string]*proto.StepReport) float32 {
		_, _, norm, err := proto.StepTotals([]*proto.StepReport{reps["s0"], reps["s1"]}, M)
		if err != nil {
			t.Fatal(err)
		}
		return model.ClipFactor(norm, spec.Clip)
	}
	st0, reps0 := open(0)
	clip0 := clipOf(reps0)
	for _, id := range p.stages {
		h.send(id, &proto.Clip{Step: 0, PlanVersion: p.version, Factor: float64(clip0)})
	}
	_, reps1 := open(1)
	// Both are asked for thin evidence (proto.Audit.Sample), as the coordinator asks: s0 for
	// evidence that is not lean (with its end state's sampled groups and what it sent), s1 for
	// lean evidence.
	const sample = 0xfeed
	for i, id := range p.stages {
		h.send(id, &proto.Audit{Step: 0, PlanVersion: p.version, UploadPath: proto.AuditPath(int64(i + 1)), Lean: i == 1, Sample: sample})
	}
	got := map[string]upload{}
	for len(got) < 2 {
		select {
		case u := <-uploads:
			got[u.path] = u
		case <-time.After(30 * time.Second):
			t.Fatalf("uploads: got %d of 2", len(got))
		}
	}
	for i, id := range p.stages {
		u, ok := got[proto.AuditPath(int64(i+1))]
		if !ok {
			t.Fatalf("no upload from %s", id)
		}
		if u.auth != "Bearer "+sessions[id].welcome.Session {
			t.Errorf("%s uploaded with %q, not its session credential", id, u.auth)
		}
		b, err := audit.Read(bytes.NewReader(u.body), 1<<30)
		if err != nil {
			t.Fatalf("%s's evidence: %v", id, err)
		}
		lean := id == "s1"
		if b.Lean != lean || lean && (b.StateOut != nil || b.Sent != nil) || !lean && b.StateOut == nil || b.Sample != sample || len(b.OutCVs) == 0 || len(b.InCVs) == 0 {
			t.Fatalf("%s's evidence: lean %v (%d end tensors, %d sent), sample %d, %d and %d tensors' chaining values, asked lean %v",
				id, b.Lean, len(b.StateOut), len(b.Sent), b.Sample, len(b.InCVs), len(b.OutCVs), lean)
		}
		if err := audit.Check(b, 0, p.version, reps0[id].Commit, reps1[id].Commit.State, lean, sample); err != nil {
			t.Fatalf("%s's evidence: %v", id, err)
		}
		out, err := Recompute(context.Background(), nil, &audit.Replay{Assign: p.assigns[id], Worker: id, Spec: st0, Bundle: b, LR: spec.LR, Clip: clip0})
		if err != nil {
			t.Fatal(err)
		}
		verdict := audit.Compare(out, b, reps0[id], reps1[id].Commit.State, true)
		switch {
		case id == "s0" && verdict != "":
			t.Errorf("honest s0 fails its audit: %s", verdict)
		case id == "s1" && !strings.Contains(verdict, "loss"):
			t.Errorf("s1 (false-loss) passes its audit: %q", verdict)
		}
	}
	// Step 0's evidence goes at Clip(1): an Audit of it now uploads nothing, and the worker
	// carries on.
	clip1 := clipOf(reps1)
	for _, id := range p.stages {
		h.send(id, &proto.Clip{Step: 1, PlanVersion: p.version, Factor: float64(clip1)})
		h.send(id, &proto.Audit{Step: 0, PlanVersion: p.version, UploadPath: proto.AuditPath(9)})
	}
	open(2)
	select {
	case u := <-uploads:
		t.Fatalf("evidence uploaded to %s for a step no longer held", u.path)
	default:
	}
}

// TestRunWorkerRefusesUnknownFault: a fault kind that does not exist stops the worker before it
// joins, naming the kinds there are.
func TestRunWorkerRefusesUnknownFault(t *testing.T) {
	err := RunWorker(context.Background(), WorkerConfig{Coordinator: "http://127.0.0.1:1", Fault: "flip-bits", GFLOPS: 1,
		Logger: slog.New(slog.DiscardHandler)})
	if err == nil || !strings.Contains(err.Error(), FaultFlipBit) || !strings.Contains(err.Error(), FaultFalseLoss) {
		t.Fatalf("err = %v, want one listing the kinds", err)
	}
}

// TestFaultSparesEvaluations: a faulty worker misbehaves on training steps only; an evaluation
// through it is the honest one.
func TestFaultSparesEvaluations(t *testing.T) {
	ctx := context.Background()
	honest := newAuditRig(t, auditSpec(), []int{2}, nil, nil).eval(ctx, 0)
	for _, kind := range []string{FaultZeroAct, FaultFlipBit, FaultFalseLoss} {
		got := newAuditRig(t, auditSpec(), []int{2}, nil, map[string]string{"stage-0": kind, "stage-1": kind}).eval(ctx, 0)
		if !slices.Equal(got, honest) {
			t.Errorf("%s: evaluation %v, honest %v", kind, got, honest)
		}
	}
}

// TestRunWorkerStopsWhenBanned: a worker the coordinator bans — ending its connection, or
// refusing its hello — stops with the coordinator's reason instead of rejoining: it would only be
// refused again (or banned again under a fresh id), and its operator must look at why.
func TestRunWorkerStopsWhenBanned(t *testing.T) {
	for _, tc := range []struct {
		name   string
		refuse bool // the hello itself, not a later drop
	}{{"dropped", false}, {"hello refused", true}} {
		t.Run(tc.name, func(t *testing.T) {
			checkConnLeaks(t)
			var hellos atomic.Int32
			url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, hello *proto.Hello) {
				ban := &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: audit of step 3: sent activation differs"}
				if hellos.Add(1) > 1 || tc.refuse {
					fakeSend(ctx, t, ws, ban)
					return
				}
				fakeSend(ctx, t, ws, &proto.Welcome{WorkerID: "w-1", HeartbeatMS: 1000, Loopback: true, Session: fakeSession(1)})
				fakeSend(ctx, t, ws, ban)
				ws.Close(websocket.StatusPolicyViolation, "banned")
			})
			ctx, cancel := context.WithTimeout(context.Background(), connWait)
			defer cancel()
			err := RunWorker(ctx, WorkerConfig{Coordinator: url, GFLOPS: 1, MemoryBytes: 1 << 28, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond,
				Logger: slog.New(slog.DiscardHandler)})
			var pe *proto.Error
			if !errors.As(err, &pe) || pe.Code != proto.ErrCodeBanned || !strings.Contains(err.Error(), "audit of step 3") {
				t.Fatalf("RunWorker: %v, want the ban and its reason", err)
			}
			if n := hellos.Load(); n != 1 {
				t.Errorf("%d hellos: a banned worker knocked again", n)
			}
		})
	}
}
