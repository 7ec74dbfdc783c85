package coordinator

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

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
		t.Skip("-short: three cluster runs")
	}
	for _, tc := range []struct {
		name, compress string
		delay          int
	}{{"int8", "int8", 0}, {"none", "none", 0}, {"int8-delay", "int8", 2}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := outerJob(t, 8, job.Sync{Every: 4, Compress: tc.compress, Delay: tc.delay}, 2, 2)
			spec.CheckpointEvery = 2
			log := watch(t, "outer.refused", "peer.banned", "worker.left")
			c := startCluster(t, spec, 2, false, faulty(1, client.FaultPoisonOuter))
			c.run(t)
			c.finished(t, spec.Steps)
			var refusals []string
			for _, e := range log.of("outer.refused") {
				worker, detail, _ := strings.Cut(e, " ")
				var d struct{ Message string }
				json.Unmarshal([]byte(detail), &d)
				refusals = append(refusals, worker+": "+d.Message)
			}
			if len(refusals) == 0 {
				t.Fatal("the honest replica's stage never refused the poisoned pseudo-gradient")
			}
			for _, r := range refusals {
				if !strings.HasPrefix(r, "w0: ") || !strings.Contains(r, "refused replica 1") || !strings.Contains(r, "AdamW steps") {
					t.Errorf("refusal %q: want w0 refusing replica 1's contribution, with the bound", r)
				}
			}
			t.Logf("%d refusals; the first: %s", len(refusals), refusals[0])
			if banned := log.of("peer.banned"); len(banned) != 1 || !strings.HasPrefix(banned[0], "w1 ") {
				t.Errorf("banned %v, want the poisoner w1 alone, on the evidence", banned)
			}
			for _, l := range log.of("worker.left") {
				if strings.HasPrefix(l, "w0 ") {
					t.Errorf("the honest worker left: %s", l)
				}
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
	spec := outerJob(t, 8, job.Sync{Every: 4, Compress: "int8"}, 2, 1, 1)
	log := watch(t, "peer.banned", "outer.refused")
	c := startCluster(t, spec, 3, false, faulty(2, client.FaultUnsignedOuter))
	c.run(t)
	c.finished(t, spec.Steps)
	banned := log.of("peer.banned")
	if len(banned) != 1 || !strings.HasPrefix(banned[0], "w2 ") {
		t.Fatalf("banned %v, want w2 alone", banned)
	}
	t.Logf("refusals %v; %s", log.of("outer.refused"), banned[0])
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
			spec := outerJob(t, 8, job.Sync{Every: 4, Compress: compress}, 2, 2)
			log := watch(t, "peer.banned")
			c := startCluster(t, spec, 2, false, faulty(0, client.FaultFalseAccuse))
			c.run(t)
			banned := log.of("peer.banned")
			if len(banned) != 1 || !strings.HasPrefix(banned[0], "w0 ") || !strings.Contains(banned[0], "signature does not cover") {
				t.Fatalf("banned %v, want the false accuser w0 alone, for evidence its accused never signed", banned)
			}
			t.Log(banned[0])
			c.finished(t, spec.Steps)
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
	spec := outerJob(t, 6, job.Sync{Every: 3, Compress: "int8"})
	log := watch(t)
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
	plans := log.planList()
	if len(plans) == 0 {
		t.Fatal("no plan")
	}
	for _, p := range plans {
		if slices.Contains(p.peers(), w.WorkerID) || !slices.Contains(p.Standby, w.WorkerID) {
			t.Fatalf("plan %d on %v (standby %v) places the keyless worker %s, or does not list it as standing by", p.Version, p.peers(), p.Standby, w.WorkerID)
		}
	}
	t.Logf("%d plans; the keyless worker %s stood by", len(plans), w.WorkerID)
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
	spec := outerJob(t, 8, job.Sync{Every: 4, Compress: "int8"}, 2, 2)
	log := watch(t, "outer.disputed", "peer.banned")
	c := startCluster(t, spec, 3, false, faulty(1, client.FaultUnsignedOuter))
	c.run(t)
	disputes := log.of("outer.disputed")
	if len(disputes) != 1 || !strings.HasPrefix(disputes[0], `w0 {"accused":"w1"`) {
		t.Fatalf("disputes %v, want w0 against w1, once", disputes)
	}
	if banned := log.of("peer.banned"); len(banned) != 0 {
		t.Errorf("banned %v: a dispute bans nobody", banned)
	}
	plans := log.planList()
	if last := plans[len(plans)-1]; !slices.Equal(last.peers(), []string{"w2"}) || !slices.Equal(last.Standby, []string{"w0", "w1"}) {
		t.Errorf("the last plan holds %v with %v standing by, want w2 alone with w0 and w1 standing by", last.peers(), last.Standby)
	}
	c.finished(t, spec.Steps)
	t.Log(disputes[0])
}

// TestOuterLyingOwnerBanned: the owner of a segment in the outer step's all-gather lies. Replica
// 1's worker (SHOAL_FAULT poison-average) contributes honestly but sends back an average of 1e30
// for its segment, signed; the honest replicas check every average against the participants'
// bound before they apply anything (audit.OuterBound.CheckAverage), refuse it — naming replica
// 1 and the average — and show the signed chunk (proto.OuterEvidence.Average), which bans the
// liar even with two replicas, where no vote could. The job ends on the honest replicas, and no
// checkpoint holds the poison.
func TestOuterLyingOwnerBanned(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		name   string
		shares []int
	}{{"two", []int{2, 2}}, {"three", []int{2, 1, 1}}} {
		t.Run(tc.name, func(t *testing.T) {
			spec := outerJob(t, 8, job.Sync{Every: 4, Compress: "int8"}, tc.shares...)
			spec.CheckpointEvery = 4
			log := watch(t, "peer.banned", "outer.refused")
			c := startCluster(t, spec, len(tc.shares), false, faulty(1, client.FaultPoisonAverage))
			c.run(t)
			c.finished(t, spec.Steps)
			banned := log.of("peer.banned")
			if len(banned) != 1 || !strings.HasPrefix(banned[0], "w1 ") {
				t.Fatalf("banned %v, want w1 alone", banned)
			}
			refusals := log.of("outer.refused")
			if len(refusals) == 0 {
				t.Fatal("nobody refused the poisoned average")
			}
			for _, r := range refusals {
				if !strings.Contains(r, "refused replica 1") || !strings.Contains(r, "the average of") || !strings.Contains(r, `"evidence":true`) {
					t.Errorf("refusal %q: want replica 1's average refused, with evidence", r)
				}
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
			t.Logf("refusals %v; %s; %d checkpoints checked", refusals, banned[0], len(files))
		})
	}
}
