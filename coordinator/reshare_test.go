package coordinator

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestStepReplicaReshared: step-mode replicas lose a worker mid-job — killed as step 5 is
// recorded, so that it never answers step 6, which the others are computing. The rule book
// reroutes (sched.Reroute): its replica leaves the plan, the replicas beside it take its
// micro-batches of step 6 on top of their own, keeping what they computed, and step 6 completes
// under the same plan; from step 7 the survivors share the micro-batches under a new plan that
// keeps every survivor's shard (proto.Keep) — no checkpoint restored (the newest is of step 4: a
// restore would begin the plan there), no step replayed — and the losses, validation losses and
// final parameters are the single process's, bit for bit. Beside expert hosts the rule book
// reshares instead (sched.Reshare): the survivors compute step 6 again under the new plan.
// With whole-model replicas, with replicas of two stages, whose lost replica's other worker
// stands by, and with expert hosts serving every replica, which keep their experts; and with every step audited, where the survivors' kept states are what the last
// step before the change is audited against (checkKept), and pass.
func TestStepReplicaReshared(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	whole := func(ns ...int) *job.Plan {
		p := &job.Plan{}
		for _, n := range ns {
			p.Replicas = append(p.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, 4}}, MicroBatches: n})
		}
		return p
	}
	for _, tc := range []struct {
		name    string
		plan    *job.Plan
		workers int
		kill    int // the stage (in plan order) whose worker is killed
		audit   float64
		shares  string // the micro-batches of the replicas left: of the step in flight when rerouted
		standby int
		inStep  bool // rerouted during the step, not reshared
	}{
		{"whole", whole(2, 1, 1), 3, 0, 0, "[[0 3] [3 4]]", 0, true},
		{"middle", whole(1, 2, 1), 3, 1, 0, "[[0 2] [2 4]]", 0, true},
		{"pipelines", &job.Plan{Replicas: []job.ReplicaPlan{
			{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 1}, {1, 4}}, MicroBatches: 2}}}, 4, 3, 0, "[[0 4]]", 1, true},
		{"audited", whole(2, 2), 2, 1, 1, "[[0 4]]", 0, true},
		// Two-stage replicas, every step audited: the rerouted step's recomputation runs the
		// survivors' added legs through both stages.
		{"pipelines audited", &job.Plan{Replicas: []job.ReplicaPlan{
			{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 1}, {1, 4}}, MicroBatches: 2}}}, 4, 3, 1, "[[0 4]]", 1, true},
		// An expert host serving every replica keeps its experts and serves the survivors.
		{"hosts", func() *job.Plan {
			p := whole(2, 1, 1)
			p.Experts = []job.ExpertShard{{Block: 1, Experts: []int{0, 1, 2, 3}, Host: 0}, {Block: 3, Experts: []int{1, 2}, Host: 1}}
			return p
		}(), 5, 0, 0, "[[0 2] [2 4]]", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 10)
			spec.Plan, spec.AuditRate = tc.plan, tc.audit
			log := watch(t, "plan", "work.rerouted", "step.abandoned", "worker.left", "audit.passed", "audit.abandoned", "peer.banned")
			if tc.audit > 0 {
				prev := clusterConfig
				clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			}
			var armed atomic.Bool
			var c *cluster
			c = startCluster(t, spec, tc.workers, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if tc.audit > 0 && i == tc.kill {
					// Killed once the evidence it was asked for has landed, after step 5: a
					// worker that leaves an audit open has its unverified work rolled back
					// (audit.go), which is not what this test is about.
					cfg.HTTP = &http.Client{Transport: afterUpload{http.DefaultTransport, func() {
						if armed.CompareAndSwap(true, false) {
							c.kill[i]()
						}
					}}}
				}
			})
			if tc.audit > 0 {
				c.onStep = func(r local.Report) {
					if r.Step == 5 {
						armed.Store(true)
					}
				}
			} else {
				c.killHolderAfter(t, 5, tc.kill)
			}
			p, plans := c.runKept(t, spec, log)
			// Killed after step 5 is recorded, the worker never answers step 6, which a reroute
			// completes (the new plan begins at 7) and a reshare computes again; with audits,
			// once its evidence lands, a step or two later.
			after := 0 // from the step in flight to the new plan's first
			if tc.inStep {
				after = 1
			}
			if first := 6 + after; tc.audit > 0 {
				first = p.FromStep
			} else if p.FromStep != first {
				t.Errorf("second plan %s: from step %d, want %d", plans[1], p.FromStep, first)
			}
			if !p.Kept || p.FromStep < 6 || len(p.Standby) != tc.standby {
				t.Errorf("second plan %s: want the shards kept (no restore) from the step in flight, %d standing by", plans[1], tc.standby)
			}
			rr := log.of("work.rerouted")
			var ev struct {
				Step         int      `json:"step"`
				MicroBatches [][2]int `json:"micro_batches"`
				InStep       bool     `json:"in_step"`
			}
			if len(rr) != 1 {
				t.Fatalf("work.rerouted events: %v, want one", rr)
			}
			json.Unmarshal([]byte(rr[0][strings.Index(rr[0], "{"):]), &ev)
			// With audits the kill waits for the evidence to land, which may be between two
			// steps (while the round waits for audits to drain): then it reshares, and the new
			// plan begins at the step nobody opened.
			inStep := tc.inStep && (tc.audit == 0 || ev.InStep)
			if inStep {
				after = 1
			} else {
				after = 0
			}
			if ev.Step != p.FromStep-after || ev.InStep != inStep {
				t.Errorf("work.rerouted %s at step %d (in the step: %v), the plan from %d", rr[0], ev.Step, ev.InStep, p.FromStep)
			}
			if got := fmt.Sprint(ev.MicroBatches); got != tc.shares {
				t.Errorf("shares after the change %s, want %s", got, tc.shares)
			}
			if tc.audit > 0 {
				// The last step before the change — the rerouted one — audited against the state
				// the survivor kept.
				last := fmt.Sprintf(`"step":%d}`, p.FromStep-1)
				n := 0
				for _, e := range log.of("audit.passed") {
					if strings.Contains(e, last) {
						n++
					}
				}
				if n == 0 {
					t.Errorf("no audit of step %d passed: %v", p.FromStep-1, log.of("audit.passed"))
				}
			}
		})
	}
}

// afterUpload is a worker's HTTP transport that calls done after every audit upload the
// coordinator accepted.
type afterUpload struct {
	http.RoundTripper
	done func()
}

func (a afterUpload) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := a.RoundTripper.RoundTrip(r)
	if err == nil && r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/api/audits/") && resp.StatusCode/100 == 2 {
		a.done()
	}
	return resp, err
}

// TestReshareAttacks: a survivor of a reshare lies about the state it kept. One commits in its
// Ready to a state it does not hold (false-kept); one poisons the shard it keeps and commits to
// the poisoned state (poison-kept), after which nothing it computes is wrong. Either way its twin
// — the other survivor holding the same blocks on the same kernels — kept another state, so the
// last step before the change is audited on both against what each kept (checkKept): the
// liar's evidence contradicts its commitment, the poisoner's recomputation differs. Both are
// banned whatever the audit draws (the job's rate is 1%), and the job, rolled back to before the
// lie, ends with the single process's parameters. (A lone survivor's false Ready is caught at
// its first report by the chain of custody; its poisoned one only by the draw, as a cheat on that
// step would be.)
//
// Three replicas also check what two never did: a gradient node goes to two replicas under one
// key, which a commitment must be able to say (proto.Commit, TestCommitSentToSeveral).
func TestReshareAttacks(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, fault := range []string{client.FaultFalseKept, client.FaultPoisonKept} {
		t.Run(fault, func(t *testing.T) {
			spec := tinyJob(t, 10)
			spec.AuditRate = 0.01
			spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
				{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 1}, {Stages: [][2]int{{0, 4}}, MicroBatches: 1}}}
			_, ref := localReports(t, spec)
			log := watch(t, "work.rerouted", "peer.banned", "audit.abandoned")
			prev := clusterConfig
			clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			c := startCluster(t, spec, 3, false, faulty(1, fault))
			c.killHolderAfter(t, 5, 0)
			c.run(t)
			if ab := log.of("audit.abandoned"); len(ab) > 0 {
				t.Skipf("the killed worker left an audit open (%v): the job rolled back instead of resharing", ab)
			}
			if rr := log.of("work.rerouted"); len(rr) != 1 {
				t.Fatalf("work.rerouted events %v, want one", rr)
			}
			banned := log.of("peer.banned")
			if len(banned) != 1 || !strings.HasPrefix(banned[0], "w1 ") {
				t.Fatalf("banned %v, want w1 alone", banned)
			}
			t.Logf("banned: %s", banned[0])
			assertFinalCheckpoint(t, c, ref)
		})
	}
}

// TestFalseReroutes: a worker whose reports say the step includes a reroute the coordinator never
// sent (false-reroutes) is dropped at its first report, as a protocol breaker; its departure is
// rerouted around like any other — the other replica takes its micro-batches of the step — and
// the job ends on the single process's parameters.
func TestFalseReroutes(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 6)
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}}
	log := watch(t, "worker.left", "work.rerouted", "peer.banned")
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 1 {
			cfg.Fault = client.FaultFalseReroutes
		}
	})
	c.run(t)
	c.finished(t, spec.Steps)
	c.sameAsLocal(t, spec)
	dropped := false
	for _, e := range log.of("worker.left") {
		if strings.HasPrefix(e, "w1 ") && strings.Contains(e, "reroutes") {
			dropped = true
		}
	}
	if !dropped {
		t.Errorf("the liar was not dropped for its report: %v", log.of("worker.left"))
	}
	if len(log.of("work.rerouted")) == 0 {
		t.Errorf("its departure was not rerouted around: %v", log.of("worker.left"))
	}
}

// TestStepReplicaLostWhileLoading: three whole-model replicas in step mode; w0 dies once its shard
// is initialised and before it says it is ready. The rule book (step mode while the plan loads,
// nobody taking state from another worker) leaves its replica out: the others load on, the plan's
// first step opens with their runs widened over its micro-batches and tells them so (a reroute at
// step 0), and at step 1 they share the step again under a kept plan. No restore, no step
// abandoned, and the losses and final parameters are the single process's, bit for bit.
func TestStepReplicaLostWhileLoading(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 6)
	spec.Plan = &job.Plan{}
	for _, n := range []int{2, 1, 1} {
		spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, 4}}, MicroBatches: n})
	}
	log := watch(t, "plan", "work.rerouted", "step.abandoned", "worker.left")
	var c *cluster
	var killed sync.Once
	c = startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i != 0 {
			return
		}
		cfg.OnStatus = killBeforeReady(t, &c, &killed, 0, "w0", 1)
	})
	c.run(t)
	c.finished(t, spec.Steps)
	c.sameAsLocal(t, spec)
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	plans := log.of("plan")
	if len(plans) != 2 || !strings.Contains(plans[1], `"kept":true`) || !strings.Contains(plans[1], `"from_step":1`) {
		t.Fatalf("plans %v: want the first, then one from step 1 keeping every shard", plans)
	}
	rr := log.of("work.rerouted")
	if len(rr) != 1 || !strings.HasPrefix(rr[0], "w0 ") || !strings.Contains(rr[0], `"step":0`) || !strings.Contains(rr[0], `"micro_batches":[[0,3],[3,4]]`) {
		t.Fatalf("work.rerouted %v: want w0's replica rerouted at step 0 to [[0,3],[3,4]]", rr)
	}
}

// keptPlan is the plan event of a plan that kept the survivors' shards.
type keptPlan struct {
	FromStep int      `json:"from_step"`
	Kept     bool     `json:"kept"`
	Replicas int      `json:"replicas"`
	Standby  []string `json:"standby"`
}

// runKept runs c's job, which loses a worker mid-job, and checks what every such run must give:
// the single process's bits, nobody banned, no step abandoned, and two plans — the first and the
// one after the departure — of which it returns the second, parsed, and both. A run whose lost
// worker left an audit open is skipped: its unverified work rolls back (audit.go), which is not
// what these tests are about.
func (c *cluster) runKept(t *testing.T, spec job.Spec, log *clusterLog) (keptPlan, []string) {
	t.Helper()
	c.run(t)
	c.finished(t, spec.Steps)
	if ab := log.of("audit.abandoned"); len(ab) > 0 {
		t.Skipf("the lost worker left an audit open (%v): the job rolled back", ab)
	}
	// What went wrong first, before the comparison that fails on its consequence.
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v (plans %v, reroutes %v, workers left %v)", ab, log.of("plan"), log.of("work.rerouted"), log.of("worker.left"))
	}
	c.sameAsLocal(t, spec)
	if b := log.of("peer.banned"); len(b) > 0 {
		t.Fatalf("honest workers banned: %v", b)
	}
	plans := log.of("plan")
	if len(plans) != 2 {
		t.Fatalf("plans: %v, want the first and the one after the departure", plans)
	}
	var p keptPlan
	if err := json.Unmarshal([]byte(strings.TrimPrefix(plans[1], " ")), &p); err != nil {
		t.Fatal(err)
	}
	return p, plans
}
