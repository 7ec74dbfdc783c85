package coordinator

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestStepReplicaRefilled: three whole-model step-mode replicas lose one worker mid-job (the
// others reshare its micro-batches, reshare.go); a fresh worker then joins and takes the lost
// replica's place at a step boundary with the state of a replica that stayed, peer to peer
// (sched.Grow: Assign.Give, Assign.From) — no checkpoint restored, none taken for the join, no
// step replayed: every plan after the first keeps its workers' shards and starts at the step the
// last one reached. The losses, validation losses and final parameters are the single
// process's, bit for bit. With every step audited too, where the taker's state must be its
// giver's (checkKept) and its first report commit to it (custody), and nobody is banned. And with
// the joiner killed while it takes up its state: the others, who still hold theirs, reshare again
// — still no restore. And beside expert hosts serving every replica: they keep their experts
// through the reshare and the join, and serve the new replica too.
func TestStepReplicaRefilled(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		name  string
		audit float64
		// loseTaker kills the joiner as soon as a plan names it, while it takes up its state:
		// the others still hold theirs, and the job reshares again rather than restoring.
		loseTaker bool
		// pipes: two replicas of two stages; the killed worker's mate stands by, and with the
		// joiner takes up both stages of the replica again.
		pipes bool
		// hosts: the whole-model replicas' experts of blocks 1 and 3 on two hosts (w3, w4).
		hosts bool
		// loseGiver: the joiner's giver, w0, leaves without a word when the plan has it hand
		// its state over (client.FaultLeaveOnGive): the joiner's replica has nothing to keep and
		// stands by with the giver's gone, and the job reshares rather than restoring.
		loseGiver bool
	}{{"plain", 0, false, false, false, false}, {"audited", 1, false, false, false, false}, {"taker-lost", 0, true, false, false, false},
		{"pipelines", 0, false, true, false, false}, {"hosts", 0, false, false, true, false}, {"giver-lost", 0, false, false, false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 16)
			spec.AuditRate = tc.audit
			spec.Plan = &job.Plan{}
			workers, joiner, kill := 3, 3, 1
			if tc.pipes {
				workers, joiner, kill = 4, 4, 2
				for range 2 {
					spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 2})
				}
			} else {
				for _, n := range []int{2, 1, 1} {
					spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, 4}}, MicroBatches: n})
				}
			}
			if tc.hosts {
				workers, joiner = 5, 5
				spec.Plan.Experts = []job.ExpertShard{{Block: 1, Experts: []int{0, 1, 2, 3}, Host: 0}, {Block: 3, Experts: []int{1, 2}, Host: 1}}
			}
			joinerID := fmt.Sprintf("w%d", joiner)
			log := watch(t, "plan", "pool.joined", "work.rerouted", "step.abandoned", "peer.banned", "audit.abandoned", "audit.passed", "state.disputed")
			if tc.audit > 0 {
				prev := clusterConfig
				clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			}
			var c *cluster
			if tc.loseTaker {
				var once sync.Once
				prev := clusterConfig
				clusterConfig = func(cfg *Config) {
					prev(cfg)
					onPlan := cfg.OnPlan
					cfg.OnPlan = func(p PlanStatus) {
						onPlan(p)
						if slices.Contains(p.peers(), joinerID) {
							once.Do(func() { c.kill[joiner]() })
						}
					}
				}
			}
			var armed, killed atomic.Bool
			var joinOnce sync.Once
			c = startCluster(t, spec, workers, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if tc.loseGiver && i == 0 {
					cfg.Fault = client.FaultLeaveOnGive
				}
				if tc.audit > 0 && i == 1 {
					// Killed once the evidence it was asked for has landed (TestStepReplicaReshared).
					cfg.HTTP = &http.Client{Transport: afterUpload{http.DefaultTransport, func() {
						if armed.CompareAndSwap(true, false) {
							killed.Store(true)
							c.kill[i]()
						}
					}}}
				}
			})
			c.onStep = func(r local.Report) {
				switch {
				case r.Step == 3 && tc.audit == 0:
					c.killHolder(t, kill)
					killed.Store(true)
				case r.Step == 3:
					armed.Store(true)
				case killed.Load() && len(log.of("work.rerouted")) > 0:
					// The replica is gone and the others share its work: a fresh worker comes.
					joinOnce.Do(func() { c.startWorker(joiner) })
				}
			}
			c.run(t)
			c.finished(t, spec.Steps)
			if ab := log.of("audit.abandoned"); len(ab) > 0 {
				t.Skipf("the killed worker left an audit open (%v): the job rolled back", ab)
			}
			// What went wrong first, before the comparison that fails on its consequence (a step
			// replayed after a restore).
			plans := log.planList()
			for _, k := range []string{"peer.banned", "step.abandoned", "state.disputed"} {
				if e := log.of(k); len(e) > 0 {
					t.Errorf("%s: %v (plans %+v, reroutes %v)", k, e, plans, log.of("work.rerouted"))
				}
			}
			c.sameAsLocal(t, spec)
			for i, p := range plans[1:] {
				if p.KeptFrom != plans[i].Version || p.FromStep < plans[i].FromStep {
					t.Errorf("plan %d %+v after %d from step %d: want it kept from the one before, never going back", p.Version, p, plans[i].Version, plans[i].FromStep)
				}
			}
			if tc.loseGiver {
				// The grow's plan (w3 taking from w0), then the reshare without w0's replica and
				// w3's, which never got its state: w2 alone, keeping its shard.
				grow := slices.IndexFunc(plans, func(p PlanStatus) bool { return p.TookFrom[joinerID] == "w0" })
				if grow < 0 || grow+1 >= len(plans) || fmt.Sprint(plans[grow+1].peers()) != "[w2]" {
					t.Errorf("plans %+v: want a grow with %s taking from w0, then w2 alone", plans, joinerID)
				}
				return
			}
			if tc.loseTaker {
				// The grow's plan, then the reshare without the joiner.
				if len(plans) != 4 || !slices.Contains(plans[2].peers(), "w3") || slices.Contains(plans[3].peers(), "w3") || plans[3].Replicas != 2 {
					t.Errorf("plans %+v: want the first, the reshared one, the refilled one and one without the lost joiner", plans)
				}
				return
			}
			joined := log.of("pool.joined")
			if tc.pipes {
				// w2 held [0,2) of replica 1; its mate w3 ([2,4)) stood by, stale, and takes up
				// [0,2) from w0 while the joiner w4 takes [2,4) from w1.
				if len(joined) != 1 || !strings.Contains(joined[0], `"takers":[["w3","w0"],["w4","w1"]]`) || len(plans) != 3 || plans[2].Replicas != 2 {
					t.Errorf("pool.joined %v, plans %+v: want w3 and w4 to take up replica 1's stages from replica 0", joined, plans)
				}
				return
			}
			if len(joined) != 1 || !strings.Contains(joined[0], `"takers":[["`+joinerID+`",`) {
				t.Fatalf("pool.joined events %v, want %s taking its state from a replica (plans %+v)", joined, joinerID, plans)
			}
			if len(plans) != 3 {
				t.Fatalf("plans %+v: want the first, the reshared one and the refilled one", plans)
			}
			last := plans[2]
			if last.Replicas != 3 || !slices.Contains(last.peers(), joinerID) {
				t.Errorf("refilled plan %+v: want three replicas, %s among them", last, joinerID)
			}
			if tc.hosts {
				// The hosts stayed hosts, each with its experts, through both changes of plan.
				for _, p := range plans {
					if hs := fmt.Sprint(p.ExpertHosts); len(p.ExpertHosts) != 2 || p.ExpertHosts[0].Peer != "w3" || p.ExpertHosts[1].Peer != "w4" {
						t.Errorf("plan %d's hosts %s: want w3 and w4 throughout", p.Version, hs)
					}
				}
			}
			// People see it: the pool and who took from whom (PlanStatus, shoal status).
			if g := last.TookFrom[joinerID]; (g != "w0" && g != "w2") || len(last.TookFrom) != 1 ||
				len(last.Pools) != 1 || len(last.Pools[0].Members) != 3 || last.Pools[0].Blocks != [2]int{0, 4} {
				t.Errorf("refilled plan's status: took from %v, pools %+v; want w3 from a pool mate, one pool of three", last.TookFrom, last.Pools)
			}
			if tc.audit > 0 {
				// w3's steps are audited from the state it took up, and pass.
				n := 0
				for _, e := range log.of("audit.passed") {
					if strings.HasPrefix(e, "w3 ") {
						n++
					}
				}
				if n == 0 {
					t.Errorf("no audit of w3 passed: %v", log.of("audit.passed"))
				}
			}
		})
	}
}
