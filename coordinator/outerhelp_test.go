package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// outerJob is tinyJob(steps) in outer mode with sync y (outer lr 0.7, momentum 0.9; y's mode,
// learning rate and momentum are set here), unaudited (outer mode is not audited yet), and with
// shares a pinned plan of one whole-model replica per share of micro-batches; none lets the
// planner choose.
func outerJob(t *testing.T, steps int, y job.Sync, shares ...int) job.Spec {
	t.Helper()
	spec := tinyJob(t, steps)
	spec.AuditRate = 0
	y.Mode, y.OuterLR, y.OuterMomentum = job.SyncOuter, 0.7, 0.9
	spec.Sync = &y
	if len(shares) > 0 {
		spec.Plan = &job.Plan{}
		for _, n := range shares {
			spec.Plan.Replicas = append(spec.Plan.Replicas, job.ReplicaPlan{Stages: [][2]int{{0, spec.Model.NLayer}}, MicroBatches: n})
		}
	}
	return spec
}

// clusterLog is what a cluster's job loop told: the events of the kinds watched, each as
// "worker detail", and every plan it assigned.
type clusterLog struct {
	mu     sync.Mutex
	events map[string][]string
	plans  []PlanStatus
	// fatal: the kinds whose first event closes stop (failFast); nil once it is closed.
	fatal map[string]bool
	stop  chan struct{}
}

// failFast returns a channel closed at the first event of kinds (which must be watched): a test
// that runs its cluster until it (cluster.runUntil) fails at once instead of at its deadline,
// where such an event leaves the job unable to finish.
func (l *clusterLog) failFast(kinds ...string) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.fatal, l.stop = map[string]bool{}, make(chan struct{})
	for _, k := range kinds {
		l.fatal[k] = true
	}
	return l.stop
}

// watch records the events of kinds and every plan of the clusters the test starts next
// (clusterConfig, reset when the test ends).
func watch(t *testing.T, kinds ...string) *clusterLog {
	l := &clusterLog{events: map[string][]string{}}
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, worker, detail string) {
			if slices.Contains(kinds, kind) {
				l.mu.Lock()
				l.events[kind] = append(l.events[kind], worker+" "+detail)
				if l.fatal[kind] {
					l.fatal = nil // the first of any of them: the channel closes once
					close(l.stop)
				}
				l.mu.Unlock()
			}
		}
		cfg.OnPlan = func(p PlanStatus) {
			l.mu.Lock()
			l.plans = append(l.plans, p)
			l.mu.Unlock()
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	return l
}

// of is the events of kind so far.
func (l *clusterLog) of(kind string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.events[kind])
}

// planList is the plans so far.
func (l *clusterLog) planList() []PlanStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.plans)
}

// peers are the workers a plan's stages are on, in plan order.
func (p PlanStatus) peers() []string {
	var ws []string
	for _, st := range p.Stages {
		ws = append(ws, st.Peer)
	}
	return ws
}

// faulty names the workers w0, w1, … and makes worker i play fault (client.Fault*).
func faulty(i int, fault string) func(int, *client.WorkerConfig) {
	return func(k int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", k)
		if k == i {
			cfg.Fault = fault
		}
	}
}

// finished fails the test unless the cluster's job reported its last step, steps-1, without a
// loss that diverged.
func (c *cluster) finished(t *testing.T, steps int) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.reports); n == 0 || c.reports[n-1].Step != steps-1 {
		t.Fatalf("the job did not reach its last step: %d reports", n)
	}
	for _, r := range c.reports {
		if !(math.Abs(r.CE) < 100) {
			t.Errorf("step %d reported loss %v", r.Step, r.CE)
		}
	}
}

// killMidRound is the workers' tweak of a test that loses replica 0 of three mid-round: worker i is
// named wi, and w0 is killed as it finishes step 7 of the first plan — once w1 and w2 have finished
// step 6, so that the outer step after step 5 had its contribution — after which then runs (c is
// read when the kill comes: the cluster the tweak is given to).
func killMidRound(t *testing.T, c **cluster, then func(), more func(i int, cfg *client.WorkerConfig)) func(i int, cfg *client.WorkerConfig) {
	var once sync.Once
	var past sync.WaitGroup // w1 and w2 finished step 6
	past.Add(2)
	pastOnce := []*sync.Once{{}, {}, {}}
	return func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if more != nil {
			more(i, cfg)
		}
		cfg.OnStatus = func(s client.Status) {
			if s.LastStep == nil || s.PlanVersion != 1 || i > 2 {
				return
			}
			if i > 0 && s.LastStep.Step >= 6 {
				pastOnce[i].Do(past.Done)
			}
			if i == 0 && s.LastStep.Step == 7 {
				once.Do(func() {
					done := make(chan struct{})
					go func() { past.Wait(); close(done) }()
					select {
					case <-done:
					case <-time.After(time.Minute):
						t.Error("the other replicas never finished step 6")
					}
					(*c).kill[0]()
					if then != nil {
						then()
					}
				})
			}
		}
	}
}

// replayOf is the membership plans recorded, as shoal train --replay takes it.
func replayOf(t *testing.T, plans []PlanStatus) []local.Period {
	t.Helper()
	var periods []local.Period
	for _, p := range plans {
		periods = p.Period().Then(periods)
	}
	b, _ := json.Marshal(periods)
	t.Logf("plans %s", b)
	return periods
}

// sameAsReplay fails the test unless the cluster's losses and final parameters are those of one
// process replaying periods, bit for bit. A restore replays steps: each step's last report is the
// one that stands.
func sameAsReplay(t *testing.T, c *cluster, spec job.Spec, periods []local.Period) {
	t.Helper()
	var want []local.Report
	res, err := local.Run(context.Background(), spec, local.Options{Replay: periods, OnStep: func(r local.Report) { want = append(want, r) }})
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	var got []local.Report
	for _, r := range c.reports {
		got = append(got[:min(len(got), r.Step)], r)
	}
	c.mu.Unlock()
	sameReports(t, got, want)
	sameFinalCheckpoint(t, c, spec.Steps, res.Model, "the replay")
}

// sameFinalCheckpoint fails the test unless the cluster's final checkpoint after steps holds
// ref's parameters bit for bit (who names ref in the message).
func sameFinalCheckpoint(t *testing.T, c *cluster, steps int, ref *model.Model, who string) {
	t.Helper()
	m, _, err := model.LoadModel(filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(steps)))
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range ref.P.Tensors {
		for k, v := range m.P.Tensors[i].Data {
			if v != tt.Data[k] {
				t.Fatalf("final checkpoint %s[%d] = %v, %s %v", tt.Name, k, v, who, tt.Data[k])
			}
		}
	}
}

// slowWorkers names worker i "wi" and has it claim a browser tab's CPU speed, so that the planner
// gives each worker a replica of its own.
func slowWorkers(i int, cfg *client.WorkerConfig) {
	cfg.GFLOPS, cfg.WorkerID = 1, fmt.Sprintf("w%d", i)
}

// joinAfterStep1 starts worker i ("wi") once step 1 is recorded, and holds the job loop until
// the hub has it, however slow the machine: the planner then takes it in, or stands it by, at the
// next round's end.
func (c *cluster) joinAfterStep1(t *testing.T, i int) {
	var joined sync.Once
	id := fmt.Sprintf("w%d", i)
	c.onStep = func(r local.Report) {
		if r.Step != 1 {
			return
		}
		joined.Do(func() {
			c.startWorker(i)
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				for _, w := range c.srv.hub.Workers() {
					if w.ID == id {
						return
					}
				}
			}
			t.Errorf("%s never joined", id)
		})
	}
}

// noRestore fails the test unless worker alone left, no step was abandoned and the job ran plans
// plans in all: a departure answered without a restore.
func noRestore(t *testing.T, log *clusterLog, worker string, plans int) {
	t.Helper()
	if left := log.of("worker.left"); len(left) != 1 || !strings.HasPrefix(left[0], worker+" ") {
		t.Fatalf("workers left: %v, want %s", left, worker)
	}
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	if ps := log.of("plan"); len(ps) != plans {
		t.Errorf("plans: %v, want %d: a restore would add one", ps, plans)
	}
}

// jobServer is a coordinator of spec on a real SQLite file and no HTTP, closed when the test
// ends: for tests that drive a job run by hand.
func jobServer(t *testing.T, spec job.Spec) *Server {
	t.Helper()
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}
