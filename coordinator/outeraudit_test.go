package coordinator

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// auditedOuterJob is outerJob audited at rate: the recomputer is this process's.
func auditedOuterJob(t *testing.T, steps int, y job.Sync, rate float64, shares ...int) (job.Spec, *clusterLog) {
	t.Helper()
	spec := outerJob(t, steps, y, shares...)
	spec.AuditRate = rate
	log := watch(t, "peer.banned", "audit.passed", "state.disputed", "custody.error", "audit.error", "plan")
	watched := clusterConfig
	clusterConfig = func(cfg *Config) {
		watched(cfg)
		cfg.Recompute = recomputeHere
	}
	return spec, log
}

// replayed checks that the cluster's final checkpoint is, bit for bit, what one process computes
// replaying the plans it recorded (local.Options.Replay, as `shoal train --replay` does).
func replayed(t *testing.T, c *cluster, spec job.Spec, log *clusterLog) {
	t.Helper()
	var periods []local.Period
	for _, p := range log.planList() {
		periods = p.Period().Then(periods)
	}
	b, _ := json.Marshal(periods)
	t.Logf("plans %s", b)
	res, err := local.Run(context.Background(), spec, local.Options{Replay: periods})
	if err != nil {
		t.Fatal(err)
	}
	sameFinalCheckpoint(t, c, spec.Steps, res.Model, "the replay")
}

// TestOuterAudited: two honest whole-model replicas in outer mode, every inner step drawn for
// audit (rate 1), without and with a delay (the outer step taken up 2 steps later): their inner
// steps are audited — among them the steps an outer step follows, whose end state the next
// report's commitment to the outer step gives (proto.OuterBoundary) — every audit passes, nobody
// is banned, no global θ is disputed, the workers' work is verified credit, and the job's
// parameters are the single process's bit for bit: the audits change no arithmetic. Before,
// outer mode was never audited and earned no verified credit.
func TestOuterAudited(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		name     string
		compress string
		delay    int
		cuts     bool // two stages a replica, cut differently: a tensor's holders are other stages
	}{{"none", "none", 0, false}, {"int8-delay", "int8", 2, false}, {"cuts", "int8", 0, true}} {
		t.Run(tc.name, func(t *testing.T) {
			spec, log := auditedOuterJob(t, 12, job.Sync{Every: 4, Compress: tc.compress, Delay: tc.delay}, 1, 2, 2)
			workers := 2
			if tc.cuts {
				spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
					{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 3},
					{Stages: [][2]int{{0, 1}, {1, 4}}, MicroBatches: 1},
				}}
				workers = 4
			}
			_, ref := localReports(t, spec)
			c := startCluster(t, spec, workers, false, faulty(-1, ""))
			c.run(t)
			c.finished(t, spec.Steps)
			if b := log.of("peer.banned"); len(b) > 0 {
				t.Fatalf("honest workers banned: %v", b)
			}
			for _, k := range []string{"state.disputed", "custody.error", "audit.error"} {
				if e := log.of(k); len(e) > 0 {
					t.Errorf("%s: %v", k, e)
				}
			}
			passed := log.of("audit.passed")
			// The steps an outer step (or its take-up) follows: 3 and 7, or with the delay 5 and 9.
			boundary := map[int]bool{3: true, 7: true}
			if tc.delay > 0 {
				boundary = map[int]bool{5: true, 9: true}
			}
			across := 0
			for _, p := range passed {
				_, d, _ := strings.Cut(p, " ")
				var ev struct{ Step int }
				json.Unmarshal([]byte(d), &ev)
				if boundary[ev.Step] {
					across++
				}
			}
			t.Logf("%d audits passed, %d of them of a step an outer step changed the state after", len(passed), across)
			// Every step but the last of each worker (no later report commits to its end), less
			// any draw left for later while a worker had maxOpenAudits uploads open.
			if len(passed) < 4 || across < workers {
				t.Fatalf("%d audits passed, %d across an outer step: want most of them, and every worker's across one: %v", len(passed), across, passed)
			}
			a := c.srv.status.Load().Audit
			if a == nil || a.Failed != 0 || a.Passed == 0 {
				t.Errorf("audit summary %+v", a)
			}
			credits, err := c.srv.db.Credits(context.Background(), c.srv.status.Load().jobID(t))
			if err != nil {
				t.Fatal(err)
			}
			verified := 0
			for _, cr := range credits {
				if cr.VerifiedMicroBatches > 0 {
					verified++
				}
			}
			if verified != workers {
				t.Errorf("credits %+v: want every worker with verified work", credits)
			}
			assertFinalCheckpoint(t, c, ref)
		})
	}
}

// TestOuterAuditScaleGrad: in outer mode (two whole-model replicas, an outer step every 4 steps,
// audit rate 0.2) replica 1's worker scales its inner steps' gradients by 1+1e-3 (SHOAL_FAULT
// scale-grad), or reports its losses ×0.9 (false-loss): an audit of one of its inner steps
// recomputes it and bans it, and the job rolls back and ends without it on exactly the parameters
// one process computes replaying the plans recorded. Before, outer mode's steps were never
// audited: the scaled gradients went into every outer step, the false losses into the record.
func TestOuterAuditScaleGrad(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs and their replays")
	}
	for _, fault := range []string{client.FaultScaleGrad, client.FaultFalseLoss} {
		t.Run(fault, func(t *testing.T) {
			spec, log := auditedOuterJob(t, 10, job.Sync{Every: 4, Compress: "int8"}, 0.2, 2, 2)
			c := startCluster(t, spec, 2, false, faulty(1, fault))
			c.run(t)
			c.finished(t, spec.Steps)
			banned := log.of("peer.banned")
			if len(banned) != 1 || !strings.HasPrefix(banned[0], "w1 ") || !strings.Contains(banned[0], "audit of step") {
				t.Fatalf("banned %v, want w1 alone, on an audit of one of its steps", banned)
			}
			t.Log(banned[0])
			replayed(t, c, spec, log)
		})
	}
}

// TestOuterAuditPoisonStart: in outer mode a worker that scales its shard ×3 right after
// initialising it and then trains honestly (SHOAL_FAULT poison-start) is banned at its first
// report, its commitment contradicting the seed's initial weights; the job ends without it on the
// parameters one process computes replaying the plans recorded. Before, outer mode had no chain
// of custody: the poisoned replica went into every outer step.
func TestOuterAuditPoisonStart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec, log := auditedOuterJob(t, 8, job.Sync{Every: 4, Compress: "none"}, 0.1, 2, 2)
	c := startCluster(t, spec, 2, false, faulty(1, client.FaultPoisonStart))
	c.run(t)
	c.finished(t, spec.Steps)
	banned := log.of("peer.banned")
	if len(banned) != 1 || !strings.HasPrefix(banned[0], "w1 ") || !strings.Contains(banned[0], "the state it was handed") ||
		!strings.Contains(banned[0], "the seed's initial weights") || !strings.Contains(banned[0], `"step":0`) {
		t.Fatalf("banned %v, want w1 alone at its first report (step 0), for a state other than the seed's", banned)
	}
	t.Log(banned[0])
	replayed(t, c, spec, log)
}

// TestOuterAuditedReplan: the chain of custody across a replan in outer mode, audited (rate 0.5).
// A worker joins while a delayed outer step is pending (every 4, delay 3), and the planner makes
// it a third replica at the checkpoint after 6 steps (TestOuterReplicaJoinsPending): the two
// replicas there restore their own parts of the checkpoint and take the pending step up from
// its snapshots (a change each commits to, proto.OuterBoundary), the new one starts from the
// global θ with zero moments. Each first commitment is the state the coordinator computes from
// the checkpoint the same way (shardDigestOf), every audit passes, nobody is banned, and the
// losses are those of one process replaying the plans.
func TestOuterAuditedReplan(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec, log := auditedOuterJob(t, 12, job.Sync{Every: 4, Compress: "int8", Delay: 3}, 0.5)
	spec.CheckpointEvery, spec.ValEvery = 6, 0
	spec.BatchSize, spec.MicroBatches = 12, 6
	c := startCluster(t, spec, 2, false, slowWorkers)
	c.joinAfterStep1(t, 2)
	c.run(t)
	c.finished(t, spec.Steps)
	if b := log.of("peer.banned"); len(b) > 0 {
		t.Fatalf("honest workers banned: %v", b)
	}
	for _, k := range []string{"state.disputed", "custody.error", "audit.error"} {
		if e := log.of(k); len(e) > 0 {
			t.Errorf("%s: %v", k, e)
		}
	}
	passed := map[string]int{}
	for _, p := range log.of("audit.passed") {
		w, _, _ := strings.Cut(p, " ")
		passed[w]++
	}
	t.Logf("audits passed: %v", passed)
	for _, w := range []string{"w0", "w1", "w2"} {
		if passed[w] == 0 {
			t.Errorf("no audit of %s passed: %v", w, passed)
		}
	}
	var periods []local.Period
	for _, p := range log.planList() {
		periods = p.Period().Then(periods)
	}
	if len(periods) != 2 || len(periods[1].Replicas) != 3 || periods[1].From != 6 {
		b, _ := json.Marshal(periods)
		t.Fatalf("plans %s: want 2 replicas from step 0, then 3 from step 6", b)
	}
	replayed(t, c, spec, log)
}

// TestOuterBoundaryChecks: the coordinator's checks of a commitment to an outer step's change
// (checkBoundary), on a shard's real state: the honest one passes and gives the digest of the
// state before the change; a start state that is not the parameters and moments named, starting
// other than from the global θ without a delay, another step, or a tensor left out are refused.
func TestOuterBoundaryChecks(t *testing.T) {
	spec := outerJob(t, 8, job.Sync{Every: 4, Compress: "none"}, 1)
	j := &jobRun{spec: spec, audits: newAuditor()}
	j.audits.assigns["w"] = &proto.Assign{Shard: proto.Shard{Stage: &proto.StageShard{Begin: 0, End: spec.Model.NLayer}}}
	specs := spec.Model.StageSpecs(0, spec.Model.NLayer, true)
	p, opt := model.NewParams(specs), model.NewAdamW(specs)
	p.Init(spec.Model, 1)
	for i := range opt.M.Tensors {
		for k := range opt.M.Tensors[i].Data {
			opt.M.Tensors[i].Data[k], opt.V.Tensors[i].Data[k] = float32(k)*1e-3, float32(i)*1e-4
		}
	}
	before := model.CheckpointTensors(p, opt)
	end := audit.StateDigest(before)
	endSums := audit.TensorSums(before)
	n := len(p.Tensors)
	global := model.NewParams(specs)
	global.Init(spec.Model, 2) // the outer step's result: other values
	after := model.CheckpointTensors(global, opt)
	state := audit.StateDigest(after)
	honest := func() *proto.OuterBoundary {
		return &proto.OuterBoundary{After: 3, End: slices.Clone(endSums[:n]), Start: audit.TensorSums(after[:n]),
			Moments: slices.Clone(endSums[n:]), Global: audit.TensorSums(model.CheckpointTensors(global, nil))}
	}
	got, err := j.checkBoundary("w", 4, 3, state, honest())
	if err != nil || got != end {
		t.Fatalf("the honest commitment: %s, %v; want the state before the change %s", got, err, end)
	}
	for _, tc := range []struct {
		name  string
		state string
		alter func(b *proto.OuterBoundary)
		want  string
	}{
		{"start state other than named", end, nil, "starts from state"},
		{"not the global θ", state, func(b *proto.OuterBoundary) { b.Global[0].Digest = b.End[0].Digest }, "is not the global θ"},
		{"another step", state, func(b *proto.OuterBoundary) { b.After = 2 }, "after step 2, not 3"},
		{"a tensor left out", state, func(b *proto.OuterBoundary) { b.Moments = b.Moments[1:] }, "names"},
	} {
		b := honest()
		if tc.alter != nil {
			tc.alter(b)
		}
		if _, err := j.checkBoundary("w", 4, 3, tc.state, b); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}

// TestOuterGlobalClaims: holders of a tensor computing with one CPU kernel family that name
// different global θ after an outer step are in dispute (claimGlobal names the earlier one);
// holders of different families, or of different outer steps, are not compared.
func TestOuterGlobalClaims(t *testing.T) {
	j := &jobRun{spec: outerJob(t, 8, job.Sync{Every: 4, Compress: "none"}, 1), peers: map[string]*peer{}}
	for w, k := range map[string]string{"a": proto.KernelsFMA, "b": proto.KernelsFMA, "c": proto.KernelsPortable} {
		j.peers[w] = &peer{id: w, hello: &proto.Hello{Kernels: k}}
	}
	o := (&auditor{}).outerOf(1)
	d1, d2 := strings.Repeat("A", proto.DigestLen), strings.Repeat("B", proto.DigestLen)
	if ws := o.claimGlobal(j, "a", 3, []proto.KeyDigest{{Key: "x", Digest: d1}}); len(ws) > 0 {
		t.Fatalf("the first claim disputed: %v", ws)
	}
	if ws := o.claimGlobal(j, "c", 3, []proto.KeyDigest{{Key: "x", Digest: d2}}); len(ws) > 0 {
		t.Errorf("another kernel family's holder disputed: %v", ws)
	}
	if ws := o.claimGlobal(j, "b", 7, []proto.KeyDigest{{Key: "x", Digest: d2}}); len(ws) > 0 {
		t.Errorf("another outer step's claim disputed: %v", ws)
	}
	if ws := o.claimGlobal(j, "b", 3, []proto.KeyDigest{{Key: "x", Digest: d2}}); !slices.Equal(ws, []string{"a"}) {
		t.Errorf("a twin's different global θ: disputed %v, want [a]", ws)
	}
}
