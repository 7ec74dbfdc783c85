package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// recomputeHere is the coordinator's recomputer in tests, as cmd/shoal wires it.
func recomputeHere(ctx context.Context, r *audit.Replay) (*audit.Outcome, error) {
	return client.Recompute(ctx, model.Host{}, r)
}

// auditPlan pins two stages and an expert host of block 3, in worker-id order: w0 stage 0, w1
// stage 1 (the last: it reports the loss), w2 the expert host, w3 a standby that takes the place
// of whoever is banned.
var auditPlan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}, Experts: []job.ExpertShard{{Block: 3, Experts: []int{0, 1}, Host: 0}}}

// TestAuditCatchesEveryFault: one worker misbehaves on every step it computes (SHOAL_FAULT), in
// each way the issue names, among honest ones, with the job's default audit rate. Each is caught
// within the audit window, banned (event peer.banned names it and why), earns no credit, and the
// job rolls back and replays without it to exactly the parameters of the fault-free single
// process.
func TestAuditCatchesEveryFault(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: seven cluster runs")
	}
	spec := tinyJob(t, 12)
	spec.Plan = auditPlan
	if spec.AuditRate != job.Default().AuditRate || spec.AuditWindow() < 2 {
		t.Fatalf("audit rate %v, window %d: the test is of the default", spec.AuditRate, spec.AuditWindow())
	}
	_, ref := localReports(t, spec)
	cases := []struct {
		fault  string
		worker int // w0 stage 0, w1 last stage, w2 expert host
	}{
		{"flip-bit", 1}, {"scale-grad", 2}, {"zero-act", 0}, {"replay", 1},
		{"stale-weights", 0}, {"false-norm", 2}, {"false-loss", 1},
		// Not a step's result: a poisoned checkpoint, caught against the state committed to.
		{"false-checkpoint", 0},
	}
	for _, tc := range cases {
		t.Run(tc.fault, func(t *testing.T) {
			faulty := fmt.Sprintf("w%d", tc.worker)
			var mu sync.Mutex
			var banned []map[string]any
			var bannedWho []string
			clusterConfig = func(cfg *Config) {
				cfg.Recompute = recomputeHere
				cfg.OnEvent = func(kind, worker, detail string) {
					if kind != "peer.banned" {
						return
					}
					var d map[string]any
					json.Unmarshal([]byte(detail), &d)
					mu.Lock()
					defer mu.Unlock()
					banned = append(banned, d)
					bannedWho = append(bannedWho, worker)
				}
			}
			defer func() { clusterConfig = nil }()
			c := startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if i == tc.worker {
					cfg.Fault = tc.fault
				}
			})
			c.run(t)
			mu.Lock()
			defer mu.Unlock()
			if len(bannedWho) != 1 || bannedWho[0] != faulty {
				t.Fatalf("banned %v, want exactly [%s]", bannedWho, faulty)
			}
			step, _ := banned[0]["step"].(float64)
			reason, _ := banned[0]["reason"].(string)
			t.Logf("%s: banned at step %v: %s", tc.fault, step, reason)
			// Cheating from step 0, the worker is audited within its first W steps whatever the
			// draws; replay cheats from step 1, and its first audit may fall on step 0: then
			// within the W steps after it.
			w := spec.AuditWindow()
			if tc.fault == "replay" {
				w *= 2
			}
			if int(step) >= w {
				t.Errorf("caught at step %v, after the audit windows of its first %d steps", step, w)
			}
			if reason == "" {
				t.Error("peer.banned gives no reason")
			}
			assertFinalCheckpoint(t, c, ref)
			credits, err := c.srv.db.Credits(context.Background(), c.srv.status.Load().jobID(t))
			if err != nil {
				t.Fatal(err)
			}
			verified := 0
			for _, cr := range credits {
				if cr.Worker == faulty && (cr.VerifiedMicroBatches != 0 || cr.PendingMicroBatches != 0 || cr.RejectedMicroBatches == 0) {
					t.Errorf("the banned worker's credit: %+v, want only rejected work", cr)
				}
				if cr.Worker != faulty && cr.VerifiedMicroBatches > 0 {
					verified++
				}
			}
			if verified == 0 {
				t.Errorf("no honest worker has verified credit: %+v", credits)
			}
			st := c.srv.status.Load()
			// A poisoned checkpoint is caught by its comparison with the commitments, not by an
			// audit's recomputation.
			if a := st.Audit; a == nil || a.Passed < 1 || (a.Failed < 1) != (tc.fault == "false-checkpoint") {
				t.Errorf("audit summary %+v, want passes and the failure", a)
			}
		})
	}
}

// TestAuditEvidenceWithinBudget audits every shard's every step with room for one bundle at a
// time (Config.AuditMemory 1 byte): uploads wait for the verdict before theirs instead of piling
// up in memory, the job still ends, and nobody honest is banned for the wait.
func TestAuditEvidenceWithinBudget(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 6)
	spec.Plan = auditPlan
	spec.AuditRate = 1
	troubles := auditTroubles(t, func(cfg *Config) { cfg.AuditMemory = 1 })
	c := startCluster(t, spec, 4, false)
	c.run(t)
	if bans := troubles(); len(bans) > 0 {
		t.Fatalf("honest workers' audits went wrong: %v", bans)
	}
	c.srv.evidence.mu.Lock()
	defer c.srv.evidence.mu.Unlock()
	if c.srv.evidence.peak != 1 || c.srv.evidence.used != 0 {
		t.Fatalf("evidence held at once: peak %d, now %d bytes; want 1 (one bundle at a time), then 0", c.srv.evidence.peak, c.srv.evidence.used)
	}
}

// TestByteBudget: acquire waits for room and gives up with its context; what is larger than
// the budget takes all of it.
func TestByteBudget(t *testing.T) {
	b := newByteBudget(10)
	ctx := context.Background()
	if n, err := b.acquire(ctx, 6); n != 6 || err != nil {
		t.Fatalf("acquire 6 of 10: %d, %v", n, err)
	}
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := b.acquire(short, 5); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("acquire 5 with 4 free: %v, want to wait until the deadline", err)
	}
	got := make(chan int64)
	go func() {
		n, _ := b.acquire(ctx, 100) // more than the budget: all of it, once free
		got <- n
	}()
	select {
	case n := <-got:
		t.Fatalf("took %d while 6 were held", n)
	case <-time.After(20 * time.Millisecond):
	}
	b.release(6)
	if n := <-got; n != 10 {
		t.Fatalf("an oversize acquire took %d, want the whole budget", n)
	}
	b.release(10)
	if b.used != 0 || b.peak != 10 {
		t.Fatalf("used %d, peak %d", b.used, b.peak)
	}
}

// TestAuditReplicas: a plan of two step-mode pipeline replicas is audited like one pipeline — a
// replica's stage commits to the gradient-tree nodes it receives from the other replica and sends
// to it, and a recomputation replays them — so honest workers earn verified credit, and a worker
// that lies is caught, banned, and the job replays without it to the single process's
// parameters. A lie that makes the replicas disagree — a false norm, or a gradient node sent
// other than the sender used — would fail the step at every try; the coordinator disputes it
// instead (every participant's unapplied step recomputed) and bans the liar.
func TestAuditReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 8)
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
		{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 3},
		{Stages: [][2]int{{0, 4}}, MicroBatches: 1},
	}}
	spec.AuditRate = 1
	want, ref := localReports(t, spec)
	for _, tc := range []struct {
		name, fault string
		worker      int
	}{{"honest", "", -1}, {"false-loss", "false-loss", 1}, {"false-norm", "false-norm", 1}, {"flip-bit", "flip-bit", 2}} {
		t.Run(tc.name, func(t *testing.T) {
			// Workers in id order: w0, w1 replica 0's stages (w1 the last: it reports the loss
			// of micro-batches 0–2), w2 replica 1, w3 a standby.
			c, verified := auditedRun(t, spec, want, ref, 4, tc.fault, tc.worker)
			if a := c.srv.status.Load().Audit; a == nil || a.Passed < 3 {
				t.Errorf("audit summary %+v, want passes on every replica's workers", a)
			}
			if !verified["w0"] || (!verified["w2"] && tc.worker != 2) {
				t.Errorf("verified work %v: want it for both replicas' workers", verified)
			}
		})
	}
}

// auditTroubles makes the next test cluster recompute audits here (and take also's settings)
// and returns what it recorded so far of bans, inconclusive audits and audit errors, as
// "kind worker detail"; the cluster config is reset when the test ends.
func auditTroubles(t *testing.T, also func(*Config)) func() []string {
	var mu sync.Mutex
	var events []string
	clusterConfig = func(cfg *Config) {
		cfg.Recompute = recomputeHere
		if also != nil {
			also(cfg)
		}
		cfg.OnEvent = func(kind, worker, detail string) {
			if kind == "peer.banned" || kind == "audit.inconclusive" || kind == "audit.error" {
				mu.Lock()
				defer mu.Unlock()
				events = append(events, kind+" "+worker+" "+detail)
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(events)
	}
}

// auditedRun runs spec (AuditRate 1) on workers w0, w1, … with worker running fault ("" none),
// and checks what every audited run must show: honest, the reports want and no ban or failed
// audit; faulty, exactly that worker banned; either way the final checkpoint equal to ref. It
// returns the cluster and the workers with verified credit.
func auditedRun(t *testing.T, spec job.Spec, want []local.Report, ref *model.Model, workers int, fault string, worker int) (*cluster, map[string]bool) {
	t.Helper()
	troubles := auditTroubles(t, nil)
	c := startCluster(t, spec, workers, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == worker {
			cfg.Fault = fault
		}
	})
	c.run(t)
	events := troubles()
	if fault == "" {
		if len(events) > 0 {
			t.Fatalf("honest workers: %v", events)
		}
		sameReports(t, c.reports, want)
	} else if len(events) != 1 || !strings.HasPrefix(events[0], fmt.Sprintf("peer.banned w%d ", worker)) {
		t.Fatalf("events %v, want w%d banned", events, worker)
	} else {
		t.Log(events[0])
	}
	assertFinalCheckpoint(t, c, ref)
	credits, err := c.srv.db.Credits(context.Background(), c.srv.status.Load().jobID(t))
	if err != nil {
		t.Fatal(err)
	}
	verified := map[string]bool{}
	for _, cr := range credits {
		if cr.VerifiedMicroBatches > 0 {
			verified[cr.Worker] = true
		}
	}
	return c, verified
}

// TestAuditReplicasExpertHost: an expert host serving two pipeline replicas is audited like any
// shard — its recomputation follows both replicas' schedules from the recorded traffic — and
// passes when honest; one that flips a bit of what it sends is banned, and the job's final
// parameters are still the single process's.
func TestAuditReplicasExpertHost(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, 8)
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{
		{Stages: [][2]int{{0, 2}, {2, 4}}, MicroBatches: 3},
		{Stages: [][2]int{{0, 4}}, MicroBatches: 1},
	}, Experts: []job.ExpertShard{{Block: 3, Host: 0, Experts: []int{0, 2}}}}
	spec.AuditRate = 1
	want, ref := localReports(t, spec)
	for _, tc := range []struct {
		name, fault string
		worker      int
	}{{"honest", "", -1}, {"flip-bit", "flip-bit", 3}} {
		t.Run(tc.name, func(t *testing.T) {
			// Workers in id order: w0, w1 replica 0's stages, w2 replica 1's, w3 the expert host,
			// w4 a standby (which takes over from a banned one).
			_, verified := auditedRun(t, spec, want, ref, 5, tc.fault, tc.worker)
			if tc.fault == "" && !verified["w3"] {
				t.Errorf("verified work %v: want it for the expert host", verified)
			}
		})
	}
}
