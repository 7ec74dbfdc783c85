package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/safetensors"
)

// TestOuterPoisonRefused: in outer mode one replica's worker sends a pseudo-gradient of 1e30 at
// every outer step (SHOAL_FAULT poison-outer), with int8 pseudo-gradients (a poisoned scale) and
// without (a poisoned θ_r), and int8 with the outer step overlapped with training ("delay" 2: the
// refusal comes when the stage takes the step up). The honest replica's stage refuses it before
// applying anything — its error names the replica and the bound — and stays connected; no
// checkpoint the job writes holds a value that is not finite or beyond what training could
// reach, and no step's loss diverges.
// One accusation bans nobody (TestOuterPoisonerBanned): with two replicas the job replans and
// meets the poison again, so the run is cut short. Before the bound, the honest
// replica took the 1e30 into its global θ, and so did every checkpoint after it.
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
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err := c.srv.Run(ctx)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("the run ended with %v, want it cut short: a job that took the poison diverges", err)
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
			if len(banned) > 0 {
				t.Errorf("banned %v on one accusation", banned)
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

// TestOuterPoisonerBanned: with three replicas, the two honest ones both refuse the poisoner's
// contribution (SHOAL_FAULT poison-outer on replica 2's worker); two accusers and a majority of
// the other replicas ban it (peer.banned names it and the accusers), and the job goes on with the
// two honest replicas to its end without a diverging step. With two replicas (TestOuterPoisonRefused)
// one accusation bans nobody: the accuser could be the liar.
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
			cfg.Fault = client.FaultPoisonOuter
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
