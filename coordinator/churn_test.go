package coordinator

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// TestChurnLog: the departure rate is unannounced departures over the workers' session time,
// live sessions included; announced ones (a drain, a policy pause) are no churn; a restore's cost
// runs from its failure until the job is back at the step it had reached — shared by every failure
// while it replays — and the prior is its least until one is measured.
func TestChurnLog(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var c churnLog
	if got := c.churn(t0, time.Minute); got.PerPeerRate != 0 {
		t.Fatalf("churn %+v with nothing seen", got)
	}
	c.join("a", t0)
	c.join("b", t0)
	c.leave("a", t0.Add(100*time.Second), true) // announced
	if got := c.churn(t0.Add(100*time.Second), time.Minute); got.PerPeerRate != 0 {
		t.Fatalf("churn %+v after an announced departure", got)
	}
	c.leave("stranger", t0.Add(100*time.Second), false) // never joined while measured: nothing to count
	c.join("c", t0.Add(100*time.Second))
	c.leave("b", t0.Add(150*time.Second), false)
	if got := c.churn(t0.Add(150*time.Second), time.Minute); got.PerPeerRate != 0 {
		t.Fatalf("churn %+v after one crash: one says little of a rate", got)
	}
	c.join("d", t0.Add(150*time.Second))
	c.leave("c", t0.Add(200*time.Second), false)
	c.failed(7, t0.Add(200*time.Second), 2)
	// Sessions: a 100 s, b 150 s, c 100 s, d 50 s so far.
	got := c.churn(t0.Add(200*time.Second), time.Minute)
	if got.PerPeerRate != 2.0/400 || got.RestoreSeconds != 60 {
		t.Errorf("churn %+v, want two departures per 400 peer-seconds, the prior's 60 s a restore", got)
	}
	// A recovery under way counts for what it has cost so far, interrupted at the rate of its plan
	// of two (sched.RestoreFromRecoveries): d's session is 140 s now.
	if got, want := c.churn(t0.Add(290*time.Second), time.Minute), sched.RestoreFromRecoveries(90, 2*2.0/490); got.RestoreSeconds != want || want <= 90 {
		t.Errorf("churn %+v 90 s into a recovery, want %v s a restore", got, want)
	}
	// A second failure while the job replays: one recovery, shared by both.
	c.failed(5, t0.Add(210*time.Second), 2)
	c.reached(6, t0.Add(220*time.Second))
	c.reached(7, t0.Add(300*time.Second))
	want := sched.RestoreFromRecoveries(50, 2*2.0/500)
	if got := c.churn(t0.Add(300*time.Second), time.Minute); got.RestoreSeconds != want {
		t.Errorf("churn %+v, want 100 s over two failures: %v s a restore", got, want)
	}
	// Measured, it no longer needs the prior.
	if got := c.churn(t0.Add(300*time.Second), 5*time.Minute); got.RestoreSeconds != want {
		t.Errorf("churn %+v, want the measured %v s a restore, whatever the prior", got, want)
	}
}

// TestPlanUnderChurn: four like workers on the tiny job in step mode. With no departure seen the
// planner runs one pipeline; once departures are seen — each of which restores one pipeline —
// it runs replicas, whose departures cost a step, and says why.
func TestPlanUnderChurn(t *testing.T) {
	j := churnJob(t, tinyJob(t, 4), []float64{5, 5, 5, 5}, 1<<30)
	if len(j.reps) > 1 || !strings.HasPrefix(j.planChoice, "one pipeline: ") {
		t.Fatalf("calm: %d replicas (%s), want one pipeline", len(j.reps), j.planChoice)
	}
	t.Log("calm:", j.planChoice)
	// Two departures in the four workers' 10 s each: one every 20 peer-seconds, every 5 s among
	// the four.
	departed(j, 2, 10*time.Second, time.Now())
	activate(t, j)
	if len(j.reps) < 2 || !strings.Contains(j.planChoice, "expected under churn") {
		t.Fatalf("under churn: %d replicas (%s), want replicas", len(j.reps), j.planChoice)
	}
	t.Log("under churn:", j.planChoice)
}

// TestPlanUnderChurnFewerHolders: the default job over eight CPU workers such as make churn's.
// Calm, the planner runs one pipeline over four or more of them; under make churn's churn — a
// departure every 85 peer-seconds, 29 restores in 280 s of recovery — every one of those is a sole
// holder whose loss restores, and the plan it runs has fewer sole holders: replicas, or the whole
// model on fewer workers, the others standing by.
func TestPlanUnderChurnFewerHolders(t *testing.T) {
	spec := tinyJob(t, 4)
	def := job.Default()
	spec.Model, spec.BatchSize, spec.MicroBatches = def.Model, def.BatchSize, def.MicroBatches
	j := churnJob(t, spec, []float64{207, 106, 211, 150, 180, 120, 200, 160}, 8<<30)
	calm := len(j.stages) + len(j.hosts)
	if len(j.reps) > 1 || calm < 4 {
		t.Fatalf("calm: %d stages and %d hosts (%s), want one pipeline over most of the workers", len(j.stages), len(j.hosts), j.planChoice)
	}
	t.Log("calm:", j.planChoice)
	now := time.Now()
	departed(j, 32, 340*time.Second, now)
	start := now.Add(-300 * time.Second)
	for k := range 29 {
		j.churn.failed(3, start.Add(time.Duration(k)*time.Second), calm)
	}
	j.churn.reached(3, start.Add(280*time.Second))
	activate(t, j)
	soleHolders := len(j.stages) + len(j.hosts)
	if len(j.reps) > 1 {
		soleHolders = 0
	}
	if soleHolders >= calm || !strings.Contains(j.planChoice, "expected under churn") {
		t.Fatalf("under churn: %d replicas, %d stages, %d hosts, %d standing by (%s); want fewer sole holders than %d", len(j.reps), len(j.stages), len(j.hosts), len(j.standby), j.planChoice, calm)
	}
	t.Log("under churn:", j.planChoice)
}

// churnJob is a job run of spec over workers of these GFLOP/s and memory, on a real coordinator
// and SQLite file, planned as the job loop plans (activate).
func churnJob(t *testing.T, spec job.Spec, gflops []float64, memory int64) *jobRun {
	t.Helper()
	srv := jobServer(t, spec)
	peers := map[string]*peer{}
	for i, g := range gflops {
		id := fmt.Sprintf("w%d", i)
		peers[id] = &peer{id: id, hello: &proto.Hello{Kind: proto.WorkerNative, GFLOPS: g, MemoryBytes: memory, SigningKey: make([]byte, proto.SigningKeySize)}}
	}
	j := &jobRun{s: srv, rec: storage.Job{ID: uuid.New()}, spec: spec, peers: peers, speeds: map[string]*speed{}}
	activate(t, j)
	return j
}

// departed records n unannounced departures at now of workers j's peers had been running beside
// for session, their sessions adding nothing: the rate is n over the peers' session time.
func departed(j *jobRun, n int, session time.Duration, now time.Time) {
	for id := range j.peers {
		j.churn.join(id, now.Add(-session))
	}
	for k := range n {
		id := fmt.Sprintf("gone-%d", k)
		j.churn.join(id, now)
		j.churn.leave(id, now, false)
	}
}

// TestChurnCheckpointDue: a job checkpoints for churn only once it has restored or seen
// departures enough to plan for, at Young's
// interval for its restores and its checkpoints' cost, never more often than minCheckpointGap.
func TestChurnCheckpointDue(t *testing.T) {
	now := time.Now()
	j := &jobRun{started: now.Add(-100 * time.Second), lastCheckpoint: now.Add(-30 * time.Second), ckCost: 2 * time.Second}
	if j.churnCheckpointDue() {
		t.Error("due without a restore or a departure")
	}
	// Departures enough to plan for, no restore yet: one restore so far is the prior, an
	// interval of √(2·2·100) = 20 s.
	j.churn.departures = minDepartures
	if !j.churnCheckpointDue() {
		t.Error("not due 30 s after the last checkpoint under churn, at an interval of 20 s")
	}
	j.churn.departures = 0
	// 2 restores in 100 s, a 2 s checkpoint: every √(2·2·50) ≈ 14 s.
	j.churn.failures = 2
	if !j.churnCheckpointDue() {
		t.Error("not due 30 s after the last checkpoint, at an interval of 14 s")
	}
	j.lastCheckpoint = now.Add(-10 * time.Second)
	if j.churnCheckpointDue() {
		t.Error("due 10 s after the last checkpoint, at an interval of 14 s")
	}
	// A restore a second, a cheap checkpoint: the gap still bounds them.
	j.churn.failures, j.ckCost, j.lastCheckpoint = 100, time.Millisecond, now.Add(-minCheckpointGap/2)
	if j.churnCheckpointDue() {
		t.Errorf("due within %v of the last checkpoint", minCheckpointGap)
	}
}

// TestPlanLinkBound: the replica planner bounds each peer's link by its data plane
// (dataPlaneBytesPerS). The default job over four 20-GFLOP/s native workers: where their links run
// on QUIC (80 MB/s) step-mode replicas exchanging the 26 MB gradient pay, and the planner takes
// them; on data channels (32 MB/s, as a browser's or a worker's with SHOAL_QUIC=0) one pipeline is
// faster, and so it is when one of the four is bounded so, since each exchange is as slow as its
// slowest link.
func TestPlanLinkBound(t *testing.T) {
	for _, c := range []struct {
		name     string
		quic     func(id string) bool
		replicas bool
		bound    string
	}{
		{"quic", func(string) bool { return true }, true, ""},
		{"data channels", func(string) bool { return false }, false, "through links of 32 MB/s"},
		{"one data channel", func(id string) bool { return id != "w3" }, false, "through links of 32–80 MB/s"},
	} {
		t.Run(c.name, func(t *testing.T) {
			spec := tinyJob(t, 4)
			def := job.Default()
			spec.Model, spec.BatchSize, spec.MicroBatches = def.Model, def.BatchSize, def.MicroBatches
			j := churnJob(t, spec, []float64{20, 20, 20, 20}, 8<<30)
			j.s.quicLinks = c.quic
			activate(t, j)
			t.Log(j.planChoice)
			if got := len(j.reps) > 1; got != c.replicas || !strings.Contains(j.planChoice, c.bound) {
				t.Fatalf("%d replicas (%s); want replicas %v, the reason naming %q", len(j.reps), j.planChoice, c.replicas, c.bound)
			}
		})
	}
}
