package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// TestStageTakeover: step-mode replicas of several stages, cut alike, lose one worker mid-job —
// killed as step 5 is recorded, so that it never answers step 6, which the others are computing.
// The stage of its blocks in the replica beside it takes its micro-batches of step 6 over at those
// blocks alone (proto.StageTakeover): the lost stage's neighbours send the taker what they sent the
// lost stage and go on with it, the lost replica's other stages keep their run and their work, and
// step 6 completes under the same plan. From step 7 the survivors share the micro-batches under a
// new plan that keeps every shard — no checkpoint restored, no step replayed — and the losses,
// validation losses and final parameters are the single process's, bit for bit. The lost stage is
// a pipeline's last (the taker gets the targets), its first (the tokens), the first replica's (its
// taker is the replica after it), or a middle stage with neighbours both sides; killed between two
// steps (its neighbours wait on it from the step's start) or leaving mid-step once it sent a
// neighbour one tensor (client.FaultLeaveMidStep: the neighbours hold part of what it computed,
// and drop the taker's copies of it); and with every step audited, where every audit passes —
// the taker's, and its neighbours', of the step taken over among them — and a checkpoint whose
// states that step's reports commit to
// is checked shard by shard against the workers asked for it (not the participants, whose
// indices the takeover shifted).
func TestStageTakeover(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	cut := func(stages [][2]int, ns ...int) *job.Plan {
		p := &job.Plan{}
		for _, n := range ns {
			p.Replicas = append(p.Replicas, job.ReplicaPlan{Stages: stages, MicroBatches: n})
		}
		return p
	}
	two := [][2]int{{0, 2}, {2, 4}}
	three := [][2]int{{0, 1}, {1, 2}, {2, 4}}
	for _, tc := range []struct {
		name    string
		plan    *job.Plan
		kill    int // the stage (in plan order) whose worker is killed
		taker   int // the stage (in plan order) that takes it over
		prev    int // the lost stage's neighbours, -1 for none
		next    int
		shares  string // the micro-batches of the replicas left, from the next step
		standby int
		audit   float64
		midStep bool // it leaves mid-step (client.FaultLeaveMidStep), after sending a neighbour one tensor, not between steps
	}{
		{"last", cut(two, 2, 2), 3, 1, 2, -1, "[[0 4]]", 1, 0, false},
		{"first", cut(two, 2, 2), 2, 0, -1, 3, "[[0 4]]", 1, 0, false},
		{"first replica", cut(two, 2, 2), 1, 3, 0, -1, "[[0 4]]", 1, 0, false},
		{"middle", cut(three, 2, 1, 1), 4, 1, 3, 5, "[[0 2] [2 4]]", 2, 0, false},
		{"audited", cut(two, 2, 2), 3, 1, 2, -1, "[[0 4]]", 1, 1, true},
		// The first replica's stages upload the checkpoints: one of them taken over in the step
		// whose reports commit to a checkpoint's states.
		{"audited first replica", cut(two, 2, 2), 1, 3, 0, -1, "[[0 4]]", 1, 1, true},
		// Lost mid-step: its neighbours hold part of what it computed, and take the taker's
		// copies of it for nothing.
		{"mid-step last", cut(two, 2, 2), 3, 1, 2, -1, "[[0 4]]", 1, 0, true},
		{"mid-step first", cut(two, 2, 2), 2, 0, -1, 3, "[[0 4]]", 1, 0, true},
		{"mid-step middle", cut(three, 2, 1, 1), 4, 1, 3, 5, "[[0 2] [2 4]]", 2, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 10)
			spec.Plan, spec.AuditRate = tc.plan, tc.audit
			log := watch(t, "plan", "work.rerouted", "step.abandoned", "worker.left", "audit.passed", "audit.abandoned", "peer.banned")
			if tc.audit > 0 {
				// A checkpoint requested after step 4: step 5's reports, the step taken over,
				// commit to its states.
				spec.CheckpointEvery = 5
				prev := clusterConfig
				clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			}
			workers := 0
			for _, r := range tc.plan.Replicas {
				workers += len(r.Stages)
			}
			var c *cluster
			var holders []string // the workers of the first plan's stages, in plan order
			c = startCluster(t, spec, workers, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if tc.midStep && i == tc.kill {
					cfg.Fault = client.FaultLeaveMidStep
				}
			})
			var seen, killed sync.Once
			c.onStep = func(r local.Report) {
				if r.Step == 2 {
					seen.Do(func() {
						for _, st := range c.srv.status.Load().Plan.Stages {
							holders = append(holders, st.Peer)
						}
					})
				}
				if r.Step == 5 && !tc.midStep {
					killed.Do(func() { c.killHolder(t, tc.kill) })
				}
			}
			p, plans := c.runKept(t, spec, log)
			rr := log.of("work.rerouted")
			if len(rr) != 1 {
				t.Fatalf("work.rerouted events: %v, want one", rr)
			}
			var ev struct {
				Step   int  `json:"step"`
				InStep bool `json:"in_step"`
				Stage  *struct {
					Taker string `json:"taker"`
					Prev  string `json:"prev"`
					Next  string `json:"next"`
				} `json:"stage"`
			}
			json.Unmarshal([]byte(rr[0][strings.Index(rr[0], "{"):]), &ev)
			if !ev.InStep || ev.Stage == nil {
				t.Fatalf("work.rerouted %s: want a stage taken over mid-step", rr[0])
			}
			if tc.midStep && holders[tc.kill] != fmt.Sprintf("w%d", tc.kill) {
				t.Fatalf("stage %d is %s's, not the faulty w%d's", tc.kill, holders[tc.kill], tc.kill)
			}
			name := func(i int) string {
				if i < 0 {
					return ""
				}
				return holders[i]
			}
			if ev.Stage.Taker != name(tc.taker) || ev.Stage.Prev != name(tc.prev) || ev.Stage.Next != name(tc.next) {
				t.Errorf("work.rerouted %s: want taker %s, prev %q, next %q (stages %v)", rr[0], name(tc.taker), name(tc.prev), name(tc.next), holders)
			}
			if !p.Kept || p.FromStep != ev.Step+1 || len(p.Standby) != tc.standby {
				t.Errorf("second plan %s: want the shards kept (no restore) from step %d, %d standing by", plans[1], ev.Step+1, tc.standby)
			}
			if tc.audit > 0 {
				// The step taken over is audited as any other: the taker recomputed with the lost
				// run as one more leg, the neighbours as sending to the taker from the start, what
				// they sent the lost stage before matched with what they sent the taker.
				for _, w := range []string{ev.Stage.Taker, ev.Stage.Prev, ev.Stage.Next} {
					if w != "" && !slices.ContainsFunc(log.of("audit.passed"), func(e string) bool {
						return strings.HasPrefix(e, w+" ") && strings.Contains(e, fmt.Sprintf(`"step":%d}`, ev.Step))
					}) {
						t.Errorf("no audit of %s's step %d, the step taken over, passed (passed: %v)", w, ev.Step, log.of("audit.passed"))
					}
				}
			}
		})
	}
}

// TestStageTakeoverThenAnotherLost: two workers leave in the same step, each once it has sent a
// neighbour one tensor (client.FaultLeaveMidStep). The first departure heard has its stage taken
// over (or, when a worker the takeover needs is gone already, its replica rerouted whole); the
// second cannot be (one takeover a step), and the survivors share the step again under a new plan
// that keeps every shard, the taken-over stage's replica standing by — whether the two were of
// one replica or of two. No checkpoint is restored, and the losses and final parameters are the
// single process's, bit for bit.
func TestStageTakeoverThenAnotherLost(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	three := [][2]int{{0, 1}, {1, 2}, {2, 4}}
	plan := &job.Plan{}
	for _, n := range []int{2, 1, 1} {
		plan.Replicas = append(plan.Replicas, job.ReplicaPlan{Stages: three, MicroBatches: n})
	}
	for _, tc := range []struct {
		name string
		lost [2]int // the workers (stages, in plan order) that leave
	}{
		{"one replica", [2]int{3, 4}},
		{"two replicas", [2]int{4, 7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 10)
			spec.Plan = plan
			log := watch(t, "plan", "work.rerouted", "worker.left", "peer.banned")
			c := startCluster(t, spec, 9, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if i == tc.lost[0] || i == tc.lost[1] {
					cfg.Fault = client.FaultLeaveMidStep
				}
			})
			c.run(t)
			c.finished(t, spec.Steps)
			c.sameAsLocal(t, spec)
			if b := log.of("peer.banned"); len(b) > 0 {
				t.Fatalf("honest workers banned: %v", b)
			}
			plans := log.of("plan")
			for _, p := range plans[1:] {
				if !strings.Contains(p, `"kept":true`) {
					t.Errorf("a plan restored shards from a checkpoint: %s (plans %v)", p, plans)
				}
			}
			// Which departure is heard first, and whether the other is gone by then (a taker or
			// a neighbour gone: the replica is rerouted whole instead), is the scheduler's.
			rr := log.of("work.rerouted")
			if len(rr) == 0 || !strings.Contains(rr[0], `"in_step":true`) {
				t.Errorf("work.rerouted %v: want the first departure answered in the step", rr)
			}
			t.Logf("work.rerouted: %v", rr)
		})
	}
}

// TestStageTakeoverCheats: a step with a stage taken over is audited like any other, so a worker
// that cheats only toward the takeover (client.FaultCheatTakeover: a bit flipped in each boundary
// tensor it sends beyond its plan neighbours) is banned — the lost stage's neighbour, for what it
// sent the taker again; the taker, for what its run of the lost stage sent that stage's
// neighbour — and the job, rolled back past the cheat, ends on the single process's parameters.
// The worker leaving is w3, the last stage of the second replica (client.FaultLeaveMidStep);
// its neighbour is w2, its taker w1.
func TestStageTakeoverCheats(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	two := [][2]int{{0, 2}, {2, 4}}
	for _, tc := range []struct {
		name  string
		cheat int
	}{
		{"neighbour", 2},
		{"taker", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 10)
			spec.AuditRate = 1
			spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: two, MicroBatches: 2}, {Stages: two, MicroBatches: 2}}}
			_, ref := localReports(t, spec)
			kinds := []string{"work.rerouted", "peer.banned", "step.disputed", "audit.passed", "audit.error", "audit.abandoned", "audit.inconclusive", "job.rollback", "state.disputed", "link.disputed"}
			log := watch(t, kinds...)
			prev := clusterConfig
			clusterConfig = func(cfg *Config) { prev(cfg); cfg.Recompute = recomputeHere }
			c := startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				switch i {
				case 3:
					cfg.Fault = client.FaultLeaveMidStep
				case tc.cheat:
					cfg.Fault = client.FaultCheatTakeover
				}
			})
			c.run(t)
			rr := log.of("work.rerouted")
			if len(rr) == 0 || !strings.HasPrefix(rr[0], "w3 ") || !strings.Contains(rr[0], `"taker":"w1"`) {
				t.Fatalf("work.rerouted %v: want w3's stage taken over by w1", rr)
			}
			banned := log.of("peer.banned")
			cheat := fmt.Sprintf("w%d", tc.cheat)
			for _, k := range kinds {
				t.Logf("%s: %v", k, log.of(k))
			}
			// Whether the taker's copy reached the neighbour first — its audit bans it — or the
			// lost stage's did, and the step is disputed before its update, is the scheduler's.
			// So is, on a loaded machine, whether the step taken over is applied at all: a
			// step abandoned and redone, or replayed from a checkpoint, takes the flipped bits
			// with it, and nothing is left to ban. Either way the cheat must leave no trace —
			// the parameters are the fault-free run's bit for bit (one flipped bit of a gradient
			// applied would change them) — and a worker banned must be the cheat.
			switch {
			case len(banned) > 1 || len(banned) == 1 && !strings.HasPrefix(banned[0], cheat+" "):
				t.Fatalf("banned %v, want %s alone", banned, cheat)
			case len(banned) == 0:
				t.Logf("%s not banned: its cheat must have gone with a step not applied", cheat)
			}
			assertFinalCheckpoint(t, c, ref)
		})
	}
}

// TestTakeoverOfAsksOnlyATakerThatFits: the coordinator's side of a takeover's memory check. Two
// replicas of two stages cut alike, on four native workers connected to a real hub; replica 1's
// last stage is lost mid-step. Replica 0's stage of the same blocks takes it over — unless its
// offer (hello.MemoryBytes) cannot hold its run widened by the lost one, by the planner's formula
// (sched.ReplicaShardMemory), although it holds its own run: then no takeover is asked (the step's
// driver reroutes the replica whole instead, if it can). Nor is one asked of a taker of another kernel family, whose bits
// would differ from what the lost stage already sent.
func TestTakeoverOfAsksOnlyATakerThatFits(t *testing.T) {
	spec := tinyJob(t, 4)
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { srv.Close(); hs.Close() })
	url := "ws" + strings.TrimPrefix(hs.URL, "http") + "/ws"
	peers := map[string]*peer{}
	var ids []string
	for i := range 4 {
		h := testHello(fmt.Sprintf("w%d", i))
		h.Kernels = proto.KernelsFMA
		c, _ := dialWorker(t, url, h, nil)
		peers[c.ID()] = &peer{id: c.ID(), hello: &h}
		ids = append(ids, c.ID())
	}
	j := &jobRun{s: srv, rec: storage.Job{ID: uuid.New()}, spec: spec, peers: peers, speeds: map[string]*speed{}, depth: 1,
		reps: []replicaRun{{lo: 0, hi: 2, first: 0, n: 2, index: 0}, {lo: 2, hi: 4, first: 2, n: 2, index: 1}},
		stages: []placement{
			{peer: ids[0], begin: 0, end: 2, replica: 0, first: 0, n: 2}, {peer: ids[1], begin: 2, end: 4, replica: 0, first: 0, n: 2},
			{peer: ids[2], begin: 0, end: 2, replica: 1, first: 2, n: 2}, {peer: ids[3], begin: 2, end: 4, replica: 1, first: 2, n: 2},
		}}
	lost := &replicaLeft{worker: ids[3], index: 1, reshare: true, reroute: true, kernels: proto.KernelsFMA}
	taker := peers[ids[1]].hello

	b := spec.BatchSize / spec.MicroBatches
	need := func(first, n int) int64 {
		v, err := sched.ReplicaShardMemory(spec.Model, b, 2, 4, 1, 2, first, n, 1, spec.ShardJob(), spec.ReplicaOptions())
		if err != nil {
			t.Fatal(err)
		}
		return int64(math.Ceil(v))
	}
	own, widened := need(0, 2), need(0, 4)
	if own >= widened {
		t.Fatalf("the taker's own run needs %d bytes, widened %d: want the widening to need more", own, widened)
	}
	for _, c := range []struct {
		name    string
		memory  int64
		kernels string
		want    bool
	}{
		{"fits", 1 << 30, proto.KernelsFMA, true},
		{"just fits", widened, proto.KernelsFMA, true},
		{"holds its own run only", widened - 1, proto.KernelsFMA, false},
		{"another kernel family", 1 << 30, proto.KernelsPortable, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			taker.MemoryBytes, taker.Kernels = c.memory, c.kernels
			tk := j.takeoverOf(lost, 3)
			if got := tk != nil; got != c.want {
				t.Fatalf("takeover %+v with the taker offering %d bytes (its run %d, widened %d): want one %v", tk, c.memory, own, widened, c.want)
			}
			if tk != nil && (tk.tk.Taker != ids[1] || tk.tk.Prev != ids[2] || tk.tk.Next != "" || tk.tk.Lost != ids[3]) {
				t.Fatalf("takeover %+v: want %s taking %s's stage over, %s sending it", tk.tk, ids[1], ids[3], ids[2])
			}
		})
	}
}
