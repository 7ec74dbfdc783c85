package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// TestOuterPoisonRefused: in outer mode one replica's worker sends a pseudo-gradient of 1e30 at
// every outer step (SHOAL_FAULT poison-outer), signed as an honest one would be, with int8
// pseudo-gradients (a poisoned scale) and without (a poisoned θ_r), and int8 with the outer step
// overlapped with training ("delay" 2: the refusal comes when the stage takes the step up). The
// honest replica's stage refuses it before applying anything — its error names the replica and the
// bound — stays connected, and shows the coordinator the signed chunk: with only two replicas, the
// evidence bans the poisoner and nobody else, and the job runs to its end on the honest replica.
// No checkpoint the job writes holds a value that is not finite or beyond what training could
// reach, and no step's loss diverges. Before the signatures one accusation could ban nobody (the
// accuser might be the liar), so the job replanned, met the poison again and never ended; before
// the bound, the honest replica took the 1e30 into its global θ, and so did every checkpoint.
func TestOuterPoisonRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: two cluster runs of 20 s")
	}
	for _, tc := range []struct {
		name, compress string
		delay          int
	}{{"int8", "int8", 0}, {"none", "none", 0}, {"int8-delay", "int8", 2}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 8)
			spec.AuditRate = 0 // outer mode is not audited
			spec.CheckpointEvery = 2
			spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: tc.compress, Delay: tc.delay}
			spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}}
			var mu sync.Mutex
			var refusals, honestLeft, banned []string
			clusterConfig = func(cfg *Config) {
				cfg.OnEvent = func(kind, worker, detail string) {
					mu.Lock()
					defer mu.Unlock()
					var d map[string]any
					json.Unmarshal([]byte(detail), &d)
					msg, _ := d["message"].(string)
					switch {
					case kind == "outer.refused" && strings.Contains(msg, "refused replica"):
						refusals = append(refusals, worker+": "+msg)
					case kind == "peer.banned":
						banned = append(banned, worker)
					case kind == "worker.left" && worker == "w0":
						honestLeft = append(honestLeft, detail)
					}
				}
			}
			defer func() { clusterConfig = nil }()
			c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if i == 1 {
					cfg.Fault = client.FaultPoisonOuter
				}
			})
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			if err := c.srv.Run(ctx); err != nil {
				t.Errorf("the run ended with %v, want it to end well on the honest replica", err)
			}
			c.mu.Lock()
			for _, r := range c.reports {
				if !(math.Abs(r.CE) < 100) {
					t.Errorf("step %d reported loss %v", r.Step, r.CE)
				}
			}
			c.mu.Unlock()
			mu.Lock()
			defer mu.Unlock()
			if len(refusals) == 0 {
				t.Fatal("the honest replica's stage never refused the poisoned pseudo-gradient")
			}
			for _, r := range refusals {
				if !strings.HasPrefix(r, "w0: ") || !strings.Contains(r, "replica 1") || !strings.Contains(r, "AdamW steps") {
					t.Errorf("refusal %q: want w0 refusing replica 1's contribution, with the bound", r)
				}
			}
			t.Logf("%d refusals; the first: %s", len(refusals), refusals[0])
			if len(banned) != 1 || banned[0] != "w1" {
				t.Errorf("banned %v, want the poisoner w1 alone, on the evidence", banned)
			}
			if len(c.reports) == 0 || c.reports[len(c.reports)-1].Step != spec.Steps-1 {
				t.Errorf("the job did not reach its last step")
			}
			if len(honestLeft) > 0 {
				t.Errorf("the honest worker left: %v", honestLeft)
			}
			files, _ := filepath.Glob(filepath.Join(c.srv.cfg.OutDir, "*.safetensors"))
			for _, f := range files {
				b, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				ts, _, err := safetensors.Read(b)
				if err != nil {
					t.Fatal(err)
				}
				for _, tn := range ts {
					for i, v := range tn.Data {
						if !(math.Abs(float64(v)) < 1e6) {
							t.Fatalf("%s: %s[%d] = %v: the poison reached a checkpoint", filepath.Base(f), tn.Name, i, v)
						}
					}
				}
			}
			t.Logf("%d checkpoints checked", len(files))
		})
	}
}

// TestOuterPoisonerBanned: the vote, for refusals without evidence. With three replicas, replica
// 2's worker signs its contributions falsely (SHOAL_FAULT unsigned-outer), so the honest replicas
// refuse them and can prove nothing; the two refusals, a majority of the other replicas, ban it
// (peer.banned names it and the accusers), and the job goes on with the two honest replicas to its
// end without a diverging step. With two replicas one such refusal bans nobody (the accuser could
// be the liar). A signed poison needs no vote (TestOuterPoisonRefused).
func TestOuterPoisonerBanned(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 8)
	spec.AuditRate = 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	whole := [][2]int{{0, 4}}
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: whole, MicroBatches: 2}, {Stages: whole, MicroBatches: 1}, {Stages: whole, MicroBatches: 1}}}
	var mu sync.Mutex
	var banned, refusedBy []string
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, worker, detail string) {
			mu.Lock()
			defer mu.Unlock()
			switch kind {
			case "peer.banned":
				banned = append(banned, worker+" "+detail)
			case "outer.refused":
				refusedBy = append(refusedBy, worker)
			}
		}
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 2 {
			cfg.Fault = client.FaultUnsignedOuter
		}
	})
	c.run(t)
	mu.Lock()
	defer mu.Unlock()
	if len(banned) != 1 || !strings.HasPrefix(banned[0], "w2 ") {
		t.Fatalf("banned %v, want w2 alone", banned)
	}
	t.Logf("refused by %v; %s", refusedBy, banned[0])
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.reports); n == 0 || c.reports[n-1].Step != spec.Steps-1 {
		t.Fatalf("the job did not reach its last step: %d reports", n)
	}
	for _, r := range c.reports {
		if !(math.Abs(r.CE) < 100) {
			t.Errorf("step %d reported loss %v", r.Step, r.CE)
		}
	}
}

// TestOuterFalseAccuserBanned: the attacker of the evidence. With two replicas, replica 0's worker
// (SHOAL_FAULT false-accuse) refuses replica 1's honest contribution at the first outer step and
// shows forged evidence: the honest chunk with a value of 1e30, which the sender never signed. The
// coordinator bans the accuser, not the accused, and the job runs to its end on the honest
// replica. Before the evidence existed, the accusation alone could frame nobody either, but the
// liar could stall the job forever by refusing every outer step; now it is out after one.
func TestOuterFalseAccuserBanned(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	for _, compress := range []string{"none", "int8"} {
		t.Run(compress, func(t *testing.T) {
			spec := tinyJob(t, 8)
			spec.AuditRate = 0
			spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: compress}
			whole := [][2]int{{0, 4}}
			spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: whole, MicroBatches: 2}, {Stages: whole, MicroBatches: 2}}}
			var mu sync.Mutex
			var banned []string
			clusterConfig = func(cfg *Config) {
				cfg.OnEvent = func(kind, worker, detail string) {
					if kind == "peer.banned" {
						mu.Lock()
						banned = append(banned, worker+" "+detail)
						mu.Unlock()
					}
				}
			}
			defer func() { clusterConfig = nil }()
			c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
				cfg.WorkerID = fmt.Sprintf("w%d", i)
				if i == 0 {
					cfg.Fault = client.FaultFalseAccuse
				}
			})
			c.run(t)
			mu.Lock()
			defer mu.Unlock()
			if len(banned) != 1 || !strings.HasPrefix(banned[0], "w0 ") || !strings.Contains(banned[0], "signature does not cover") {
				t.Fatalf("banned %v, want the false accuser w0 alone, for evidence its accused never signed", banned)
			}
			t.Log(banned[0])
			c.mu.Lock()
			defer c.mu.Unlock()
			if n := len(c.reports); n == 0 || c.reports[n-1].Step != spec.Steps-1 {
				t.Fatalf("the job did not reach its last step: %d reports", n)
			}
		})
	}
}

// TestOuterKeylessWorkerStandsBy: a worker that gives no signing key in its hello is never placed
// in an outer-mode plan — its contributions could not be verified, so its partners would refuse
// every one and, with two replicas, nothing would tell who lied: the job would replan forever. It
// stands by, however fast it says it is, and the job ends on the two workers that sign.
func TestOuterKeylessWorkerStandsBy(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 6)
	spec.AuditRate = 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 3, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	var mu sync.Mutex
	var placed, standby [][]string
	clusterConfig = func(cfg *Config) {
		cfg.OnPlan = func(p PlanStatus) {
			mu.Lock()
			defer mu.Unlock()
			var ws []string
			for _, st := range p.Stages {
				ws = append(ws, st.Peer)
			}
			placed, standby = append(placed, ws), append(standby, p.Standby)
		}
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) { cfg.GFLOPS = 1 })
	// Connected before the job plans, and claiming to be a thousand times faster.
	ws, w := rogue(t, c, proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1000, MemoryBytes: 1 << 30, Threads: 8, Name: "keyless"})
	if ws == nil {
		return
	}
	defer ws.CloseNow()
	go func() {
		for {
			if _, _, err := ws.Read(context.Background()); err != nil {
				return
			}
		}
	}()
	c.run(t)
	mu.Lock()
	defer mu.Unlock()
	if len(placed) == 0 {
		t.Fatal("no plan")
	}
	for i, ws := range placed {
		if slices.Contains(ws, w.WorkerID) || !slices.Contains(standby[i], w.WorkerID) {
			t.Fatalf("plans %v (standby %v) place the keyless worker %s, or do not list it as standing by", placed, standby, w.WorkerID)
		}
	}
	t.Logf("plans %v; the keyless worker %s stood by", placed, w.WorkerID)
}

// TestOuterDisputeStandsBy: with two replicas, replica 1's worker signs falsely (SHOAL_FAULT
// unsigned-outer), so the honest replica refuses it without proof, at every outer step: a vote of
// one, which bans nobody. Before, the job replanned and met the refusal again for ever. Now the
// second unproved refusal of the same worker, under a later plan, puts the two in dispute: both
// stand by, neither is banned (either may be honest), and the job ends on the third worker.
func TestOuterDisputeStandsBy(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 8)
	spec.AuditRate = 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8"}
	whole := [][2]int{{0, 4}}
	spec.Plan = &job.Plan{Replicas: []job.ReplicaPlan{{Stages: whole, MicroBatches: 2}, {Stages: whole, MicroBatches: 2}}}
	var mu sync.Mutex
	var disputes, banned []string
	var last []string
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, worker, detail string) {
			mu.Lock()
			defer mu.Unlock()
			switch kind {
			case "outer.disputed":
				disputes = append(disputes, worker+" "+detail)
			case "peer.banned":
				banned = append(banned, worker)
			}
		}
		cfg.OnPlan = func(p PlanStatus) {
			mu.Lock()
			defer mu.Unlock()
			last = last[:0]
			for _, st := range p.Stages {
				last = append(last, st.Peer)
			}
		}
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 1 {
			cfg.Fault = client.FaultUnsignedOuter
		}
	})
	c.run(t)
	mu.Lock()
	defer mu.Unlock()
	if len(disputes) != 1 || !strings.HasPrefix(disputes[0], `w0 {"accused":"w1"`) {
		t.Fatalf("disputes %v, want w0 against w1, once", disputes)
	}
	if len(banned) != 0 {
		t.Errorf("banned %v: a dispute bans nobody", banned)
	}
	if !slices.Equal(last, []string{"w2"}) {
		t.Errorf("the last plan holds %v, want w2 alone", last)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.reports); n == 0 || c.reports[n-1].Step != spec.Steps-1 {
		t.Fatalf("the job did not reach its last step: %d reports", n)
	}
	t.Log(disputes[0])
}
