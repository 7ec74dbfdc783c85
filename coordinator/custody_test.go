package coordinator

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// bans makes the next test cluster recompute audits here and returns what it recorded so far of
// bans (worker and detail) and of custody errors and state disputes, in order.
func bans(t *testing.T) func() ([]string, []map[string]any, []string) {
	var mu sync.Mutex
	var who, errs []string
	var detail []map[string]any
	clusterConfig = func(cfg *Config) {
		cfg.Recompute = recomputeHere
		cfg.OnEvent = func(kind, worker, d string) {
			mu.Lock()
			defer mu.Unlock()
			switch kind {
			case "peer.banned":
				var m map[string]any
				json.Unmarshal([]byte(d), &m)
				who, detail = append(who, worker), append(detail, m)
			case "custody.error", "state.disputed":
				errs = append(errs, kind+" "+worker+" "+d)
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	return func() ([]string, []map[string]any, []string) {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), who...), append([]map[string]any(nil), detail...), append([]string(nil), errs...)
	}
}

// TestAuditPoisonStart: a worker that scales its shard ×3 right after its restore (or
// initialisation) and then trains honestly — every step it computes is the right step from the
// wrong state, so no recomputation sees it — is banned at its very first report, its commitment
// contradicting the state the coordinator handed it; the job replays without it to the
// single process's parameters. Once from the seed, once from a checkpoint (the worker takes over
// a shard after another left, and the plan's honest workers restore theirs too, cut differently
// from the checkpoint's shards: none of them is banned).
func TestAuditPoisonStart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 10)
	spec.Plan = auditPlan
	_, ref := localReports(t, spec)
	for _, tc := range []struct {
		name    string
		workers int
		faulty  int
		from    string // what the ban says the worker was handed
	}{
		// w0 stage 0, w1 stage 1, w2 the expert host, w3 a standby.
		{"seed", 4, 1, "the seed's initial weights"},
		// w0 leaves after step 5: w1 stage 0, w2 stage 1 and w3 the expert host restore from the
		// checkpoint after step 4; w4 takes w3's place once it is banned.
		{"checkpoint", 5, 3, "the checkpoint after step"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recorded := bans(t)
			faulty := fmt.Sprintf("w%d", tc.faulty)
			c := startCluster(t, spec, tc.workers, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if i == tc.faulty {
					cfg.Fault = client.FaultPoisonStart
				}
			})
			if tc.name == "checkpoint" {
				// w0 leaves after step 5, or later while an audit of its own is open: a worker
				// killed halfway through an evidence upload is judged on its cut bundle, which is
				// not what this test is about.
				var once sync.Once
				c.onStep = func(r local.Report) {
					if r.Step < 5 {
						return
					}
					for _, pa := range c.srv.auditReg.all(c.srv.status.Load().jobID(t).String()) {
						if pa.worker == "w0" {
							return
						}
					}
					once.Do(func() { c.killHolder(t, 0) })
				}
			}
			c.run(t)
			who, detail, errs := recorded()
			if len(errs) > 0 {
				t.Errorf("custody could not be checked, or states disputed: %v", errs)
			}
			if len(who) != 1 || who[0] != faulty {
				t.Fatalf("banned %v, want exactly [%s]", who, faulty)
			}
			reason, _ := detail[0]["reason"].(string)
			t.Logf("banned at step %v: %s", detail[0]["step"], reason)
			if !strings.Contains(reason, "the state it was handed") || !strings.Contains(reason, tc.from) {
				t.Errorf("ban reason %q: want the state it was handed, %s", reason, tc.from)
			}
			assertFinalCheckpoint(t, c, ref)
			if a := c.srv.status.Load().Audit; a == nil || a.Failed != 0 {
				t.Errorf("audit summary %+v: want no failed recomputation (custody needs none)", a)
			}
		})
	}
}

// TestAuditRareCheatReplicated: a worker that cheats on one update only — the first after it is
// asked for an audit, the step a predictable window left safest — on a stage that two step-mode
// replicas hold. Its twin applied the same summed gradient to the same state, so the two
// commitments differ at the next report: both are audited, and the cheater is banned within the
// window whatever the draws; the job replays without it to the single process's parameters. With
// draws alone it would be caught with probability audit_rate.
func TestAuditRareCheatReplicated(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 24)
	spec.AuditRate = 0.05 // a window of 20 steps: one draw at the cheated step is 1 in 20
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
		{Stages: [][2]int{{0, 4}}, MicroBatches: 2},
		{Stages: [][2]int{{0, 4}}, MicroBatches: 2},
	}}
	W := spec.AuditWindow()
	_, ref := localReports(t, spec)
	recorded := bans(t)
	// w0 replica 0, w1 replica 1 (the cheater), w2 a standby.
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 1 {
			cfg.Fault = client.FaultRareCheat
		}
	})
	c.run(t)
	who, detail, troubles := recorded()
	if len(who) != 1 || who[0] != "w1" {
		t.Fatalf("banned %v, want exactly [w1]", who)
	}
	// The twins' states differ from the cheated step on, so a step reported before the audit's
	// verdict lands (a loaded machine) is disputed again: every dispute must name w1.
	for _, e := range troubles {
		if !strings.HasPrefix(e, "state.disputed") || !strings.Contains(e, `"w1"`) {
			t.Errorf("events %v: want only state disputes that name w1", troubles)
		}
	}
	if len(troubles) == 0 {
		t.Error("no state dispute: the twins' commitments were never compared")
	}
	step, _ := detail[0]["step"].(float64)
	t.Logf("banned at step %v: %v", step, detail[0]["reason"])
	// Its first audit is of a step within the first window; it cheats on the step after.
	if int(step) > W {
		t.Errorf("caught at step %v, after the window of %d steps", step, W)
	}
	assertFinalCheckpoint(t, c, ref)
}

// TestAuditGapDraws: the draws askAuditOf makes (auditor.drawn) — at rate r, and forced where a shard's
// last W−1 steps went unaudited — leave no W consecutive steps of a worker unaudited, audit the
// share r/(1−(1−r)^W) of its steps (below the r + (1−r)/W of windows with one secret pick each),
// and audit the step after an audit (the step a worker that saw the audit would find safest) with
// probability r; a step skipped counts as unaudited, and a rollback starts the run again.
func TestAuditGapDraws(t *testing.T) {
	const r, W, steps = 0.1, 10, 200000
	a := newAuditor()
	a.rng = rand.New(rand.NewPCG(1, 2))
	draw := func(worker string, step int) bool { // as askAuditOf draws and records
		if !a.drawn(worker, step, r, W, false) {
			return false
		}
		a.audited(worker, step)
		return true
	}
	audits, gap, afterAudit, afterAuditAudited := 0, 0, 0, 0
	last := false
	for s := range steps {
		got := draw("x", 5+s)
		if last {
			afterAudit++
			if got {
				afterAuditAudited++
			}
		}
		last = got
		if got {
			audits++
			gap = 0
			continue
		}
		if gap++; gap >= W {
			t.Fatalf("step %d: %d steps in a row unaudited, want fewer than %d", 5+s, gap, W)
		}
	}
	share := float64(audits) / steps
	want := r / (1 - math.Pow(1-r, W))
	if math.Abs(share-want) > 0.005 {
		t.Errorf("audited %.4f of the steps, want %.4f", share, want)
	}
	if share >= r+(1-r)/W {
		t.Errorf("audited %.4f of the steps: no cheaper than windows (%.2f)", share, r+(1-r)/W)
	}
	if p := float64(afterAuditAudited) / float64(afterAudit); math.Abs(p-r) > 0.01 {
		t.Errorf("the step after an audit audited with probability %.4f, want r = %v", p, r)
	}
	t.Logf("audited %.4f of %d steps (r/(1−(1−r)^W) = %.4f); after an audit %.4f", share, steps, want,
		float64(afterAuditAudited)/float64(afterAudit))

	// Steps skipped (never drawn: a replan, a dispute, a replica at its open audits' bound) count
	// as unaudited: the next step drawn after W−1 of them is audited whatever the draw.
	b := newAuditor()
	b.rng = rand.New(rand.NewPCG(3, 4))
	b.audited("y", 0)
	if !b.gapDue("y", W, W) {
		t.Error("a step after W−1 steps skipped was not due")
	}
	if b.gapDue("y", W-1, W) {
		t.Error("a step before the gap's end was due")
	}
	// A rollback replays steps before the run: the run starts again at the replayed step.
	b.audited("y", 40)
	if b.gapDue("y", 12, W) || !b.gapDue("y", 12+W-1, W) {
		t.Error("a rollback did not start the run of unaudited steps again at the replayed step")
	}
}

// BenchmarkShardDigest is the cost of one expected digest of the chain of custody: the default
// model's first stage of two (blocks [0,2), its experts at home), from the seed and from a
// whole-model checkpoint file.
func BenchmarkShardDigest(b *testing.B) {
	cfg := model.DefaultConfig()
	sh := proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}
	m, err := model.NewModel(cfg)
	if err != nil {
		b.Fatal(err)
	}
	m.P.Init(cfg, 1)
	path := filepath.Join(b.TempDir(), "ck.safetensors")
	if err := model.SaveCheckpoint(path, cfg, 10, m.P, m.Opt); err != nil {
		b.Fatal(err)
	}
	for _, src := range []struct {
		name string
		open func() ([]*os.File, error)
	}{{"seed", nil}, {"checkpoint", openFiles(path)}} {
		b.Run(src.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := shardDigest(cfg, 1, src.open, sh, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestShardDigestOneTensorAtATime: the expected digest, hashed one tensor at a time, is the
// digest of the state a worker builds and commits to (audit.StateDigest of the whole shard) —
// from the seed, from a checkpoint, and in outer mode from a replica's part of one or, for a
// replica the checkpoint lacks, from the global θ with zero moments.
func TestShardDigestOneTensorAtATime(t *testing.T) {
	cfg := model.TinyConfig()
	sh := proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}
	hosts := []proto.ExpertHost{{Block: 1, Expert: 2, Workers: []string{"h"}}}
	specs, err := shardSpecs(cfg, sh, func(blk, e int) bool { return blk == 1 && e == 2 })
	if err != nil {
		t.Fatal(err)
	}
	// want is the digest of the shard's state built whole: parameters p, moments m and v (nil:
	// zero) taken by name from src.
	want := func(src map[string][]float32, pre string) string {
		p, opt := model.NewParams(specs), model.NewAdamW(specs)
		for i, tt := range p.Tensors {
			copy(tt.Data, src[pre+tt.Name])
			copy(opt.M.Tensors[i].Data, src[pre+"optim.m."+tt.Name])
			copy(opt.V.Tensors[i].Data, src[pre+"optim.v."+tt.Name])
		}
		return audit.StateDigest(model.CheckpointTensors(p, opt))
	}
	// The whole model from the seed, with moments of some values, as a checkpoint file holds it
	// (and, under a replica's prefix, replica 1's part of an outer-mode one).
	m, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.P.Init(cfg, 3)
	for i := range m.Opt.M.Slab {
		m.Opt.M.Slab[i], m.Opt.V.Slab[i] = float32(i%7)*1e-3, float32(i%5)*1e-4
	}
	whole := model.CheckpointTensors(m.P, m.Opt)
	src := map[string][]float32{}
	var file []safetensors.Tensor
	for _, tt := range whole {
		src[tt.Name] = tt.Data
		file = append(file, tt)
	}
	for _, tt := range whole {
		r := safetensors.Tensor{Name: model.ReplicaPrefix(1) + tt.Name, Shape: tt.Shape, Data: make([]float32, len(tt.Data))}
		for i, v := range tt.Data {
			r.Data[i] = v * 0.5
		}
		src[r.Name] = r.Data
		file = append(file, r)
	}
	if !strings.HasPrefix(whole[len(m.P.Tensors)].Name, "optim.m.") {
		t.Fatalf("moments named %q: the test's names are wrong", whole[len(m.P.Tensors)].Name)
	}
	path := filepath.Join(t.TempDir(), "ck.safetensors")
	if err := safetensors.WriteFile(path, file, nil); err != nil {
		t.Fatal(err)
	}
	open := openFiles(path)
	stepPath := filepath.Join(t.TempDir(), "step.safetensors")
	if err := safetensors.WriteFile(stepPath, whole, nil); err != nil {
		t.Fatal(err)
	}
	openStep := openFiles(stepPath)

	seeded := model.NewParams(specs)
	seeded.Init(cfg, 3)
	fromSeed := map[string][]float32{}
	for _, tt := range seeded.Tensors {
		fromSeed[tt.Name] = tt.Data
	}
	global := map[string][]float32{}
	for _, tt := range m.P.Tensors {
		global[tt.Name] = tt.Data
	}
	for _, c := range []struct {
		name    string
		open    func() ([]*os.File, error)
		replica int
		want    string
	}{
		{"seed", nil, -1, want(fromSeed, "")},
		{"checkpoint", open, -1, want(src, "")},
		{"replica's part", open, 1, want(src, model.ReplicaPrefix(1))},
		{"new replica: the global θ, zero moments", open, 2, want(global, "")},
		{"the warm-up's checkpoint: its parameters and moments", openStep, 2, want(src, "")},
	} {
		got, err := shardDigestOf(cfg, 3, c.open, sh, hosts, c.replica)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got != c.want {
			t.Errorf("%s: digest %s, the whole state's %s", c.name, got, c.want)
		}
	}
	if _, err := shardDigestOf(cfg, 3, open, proto.Shard{Stage: &proto.StageShard{Index: 1, Count: 2, Begin: 2, End: 4, Last: true}}, nil, -1); err != nil {
		t.Errorf("the last stage: %v", err)
	}
}

// openFiles opens the files paths, as shardDigest reads a checkpoint's shards.
func openFiles(paths ...string) func() ([]*os.File, error) {
	return func() ([]*os.File, error) {
		var fs []*os.File
		for _, p := range paths {
			f, err := os.Open(p)
			if err != nil {
				return nil, err
			}
			fs = append(fs, f)
		}
		return fs, nil
	}
}
