package coordinator

import (
	"context"
	"encoding/json"
	"github.com/coder/websocket"
	"github.com/shoal-ml/shoal/proto"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// Stops that lose nothing (issue 33): a drained worker, and a stopping coordinator, leave at a
// step boundary after a checkpoint of that very step, so that the job resumes where it stopped —
// nothing replayed — rather than at its last periodic checkpoint (here the only one before is
// step 0's).

const stopTestToken = "stop-test-admin-token"

// stopJob is the stop tests' job: steps steps of the tiny model on plan, no checkpoint but the
// final one (so that resuming anywhere else shows), no evaluation, no audits. They are cluster
// runs: skipped with -short.
func stopJob(t *testing.T, steps int, plan *job.Plan) job.Spec {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	spec := tinyJob(t, steps)
	spec.Plan = plan
	spec.CheckpointEvery, spec.ValEvery, spec.AuditRate = 100, 0, 0
	return spec
}

// TestDrainResumesAtStep: the admin drains the worker holding stage 1 after step 4. The job
// checkpoints the step boundary it has reached, lets the worker go, and plans the spare in from
// that checkpoint: no step is computed twice, and the run equals one process's bit for bit.
func TestDrainResumesAtStep(t *testing.T) {
	spec := stopJob(t, 12, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
	want, ref := localReports(t, spec)
	log := watch(t, "admin.drain")
	watched := clusterConfig
	clusterConfig = func(cfg *Config) { watched(cfg); cfg.AdminToken = stopTestToken }
	c := startCluster(t, spec, 3, false) // two stages and a spare
	asked := drainAfter(c, 4, 1)
	c.run(t)
	if err := <-asked; err != nil {
		t.Fatalf("drain: %v", err)
	}
	c.mu.Lock()
	sameReports(t, c.reports, want) // a step computed twice would be reported twice
	c.mu.Unlock()
	resumedAtDrain(t, log)
	assertFinalCheckpoint(t, c, ref)
}

// drainAfter has the admin drain the worker of stage k of the plan once step is reported, and
// returns the answer to the request.
func drainAfter(c *cluster, step, k int) <-chan error {
	var once sync.Once
	asked := make(chan error, 1)
	c.onStep = func(r local.Report) {
		if r.Step != step {
			return
		}
		once.Do(func() {
			holder := c.srv.status.Load().Plan.Stages[k].Peer
			go func() { // the admin's request, not the job loop's: it answers at a step boundary
				req, _ := http.NewRequest("POST", c.http.URL+"/api/peers/"+holder+"/drain", nil)
				req.Header.Set("Authorization", "Bearer "+stopTestToken)
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					resp.Body.Close()
					if resp.StatusCode != http.StatusNoContent {
						err = &json.UnsupportedValueError{Str: resp.Status}
					}
				}
				asked <- err
			}()
		})
	}
	return asked
}

// TestDrainReshares: the admin drains a worker of one of two step-mode replicas after step 4.
// It goes as a departure would: the other replica takes all the micro-batches keeping its shard
// (a reshare), with no checkpoint taken for it and nothing restored, from the step the job had
// reached, and the run equals one process's bit for bit.
func TestDrainReshares(t *testing.T) {
	spec := stopJob(t, 12, &job.Plan{Replicas: []job.ReplicaPlan{{Stages: [][2]int{{0, 4}}, MicroBatches: 2}, {Stages: [][2]int{{0, 4}}, MicroBatches: 2}}})
	want, ref := localReports(t, spec)
	log := watch(t, "admin.drain", "work.rerouted")
	watched := clusterConfig
	clusterConfig = func(cfg *Config) { watched(cfg); cfg.AdminToken = stopTestToken }
	c := startCluster(t, spec, 2, false)
	asked := drainAfter(c, 4, 1)
	c.run(t)
	if err := <-asked; err != nil {
		t.Fatalf("drain: %v", err)
	}
	c.mu.Lock()
	sameReports(t, c.reports, want)
	c.mu.Unlock()
	resumedAtDrain(t, log)
	if rr := log.of("work.rerouted"); len(rr) != 1 {
		t.Errorf("work.rerouted events %v, want one", rr)
	}
	cks, err := c.srv.db.ListCheckpoints(context.Background(), uuid.MustParse(c.srv.status.Load().Job.ID))
	if err != nil {
		t.Fatal(err)
	}
	for _, ck := range cks {
		if ck.Step != int64(spec.Steps) {
			t.Errorf("a checkpoint of step %d: the drain needs none", ck.Step)
		}
	}
	assertFinalCheckpoint(t, c, ref)
}

// resumedAtDrain checks that the one worker let go (event admin.drain) went after step 4, and
// that the plan after it started at that very step: the job resumed where it was.
func resumedAtDrain(t *testing.T, log *clusterLog) {
	t.Helper()
	drains := log.of("admin.drain")
	if len(drains) != 1 {
		t.Fatalf("admin.drain events %v, want one", drains)
	}
	var at struct{ Step int }
	if err := json.Unmarshal([]byte(drains[0][strings.Index(drains[0], " ")+1:]), &at); err != nil {
		t.Fatal(err)
	}
	plans := log.planList()
	if len(plans) != 2 || plans[1].FromStep != at.Step || at.Step < 5 {
		var froms []int
		for _, p := range plans {
			froms = append(froms, p.FromStep)
		}
		t.Fatalf("let go at step %d; plans from steps %v, want the second from that step", at.Step, froms)
	}
	// The worker of the stage that stays on it keeps its shard: only the stage let go loads.
	if plans[1].KeptFrom != plans[0].Version {
		t.Errorf("the plan after the worker was let go kept nothing (kept_from %d): every stage restored", plans[1].KeptFrom)
	}
	t.Logf("let go at step %d; the next plan started there", at.Step)
}

// TestStopResumesAtStep: a coordinator told to stop (Server.Stop: what shoal serve does on
// SIGTERM) after step 4 checkpoints the step boundary it reaches and returns; a new coordinator
// on the same data directory resumes at that very step, and the two together equal one process.
func TestStopResumesAtStep(t *testing.T) {
	spec := stopJob(t, 12, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
	want, ref := localReports(t, spec)
	dir := t.TempDir()
	clusterConfig = func(cfg *Config) { cfg.DataDir = dir }
	t.Cleanup(func() { clusterConfig = nil })

	first := startCluster(t, spec, 2, false)
	var once sync.Once
	first.onStep = func(r local.Report) {
		if r.Step == 4 {
			once.Do(first.srv.Stop)
		}
	}
	first.run(t) // returns nil once stopped
	first.mu.Lock()
	done := len(first.reports)
	got := append([]local.Report(nil), first.reports...)
	first.mu.Unlock()
	ck, err := first.srv.db.LatestCheckpoint(context.Background(), first.srv.jobID())
	if err != nil {
		t.Fatal(err)
	}
	if done < 5 || done >= spec.Steps || int(ck.Step) != done {
		t.Fatalf("stopped after %d steps with the newest checkpoint at step %d: want one of the step it stopped at", done, ck.Step)
	}
	first.stop()

	second := startCluster(t, spec, 2, false)
	second.run(t)
	second.mu.Lock()
	defer second.mu.Unlock()
	if len(second.reports) == 0 || second.reports[0].Step != done {
		t.Fatalf("the second coordinator began at step %v, want %d", second.reports, done)
	}
	sameReports(t, append(got, second.reports...), want)
	assertFinalCheckpoint(t, second, ref)
}

// TestWorkerLeaveResumesAtStep: the worker holding stage 1 is asked to stop (what its first
// SIGTERM does: client.WorkerConfig.Leave) after step 4. It says so (proto.Leaving) and goes on
// computing; the coordinator checkpoints the next step boundary, lets it go, and plans the spare
// in from there: no step is computed twice, and the run equals one process's bit for bit.
func TestWorkerLeaveResumesAtStep(t *testing.T) {
	spec := stopJob(t, 12, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
	want, ref := localReports(t, spec)
	log := watch(t, "admin.drain", "worker.leaving")
	leave := make([]chan struct{}, 3)
	returned := make(chan string, 3)
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		leave[i] = make(chan struct{})
		cfg.Leave = leave[i]
	})
	var once sync.Once
	c.onStep = func(r local.Report) {
		if r.Step != 4 {
			return
		}
		once.Do(func() {
			holder := c.srv.status.Load().Plan.Stages[1].Peer
			for _, w := range c.srv.hub.Workers() {
				if w.ID == holder {
					n, _ := strconv.Atoi(w.Hello.Name)
					close(leave[n])
					returned <- w.Hello.Name
				}
			}
		})
	}
	c.run(t)
	c.mu.Lock()
	sameReports(t, c.reports, want) // a step computed twice would be reported twice
	c.mu.Unlock()
	if len(returned) != 1 {
		t.Fatal("no holder of stage 1 was asked to leave")
	}
	if asked := log.of("worker.leaving"); len(asked) != 1 {
		t.Fatalf("worker.leaving %v: want one", asked)
	}
	resumedAtDrain(t, log)
	assertFinalCheckpoint(t, c, ref)
}

// TestWorkerLeavesWhileJobWaits: a worker asked to stop while the job waits for more workers
// holds nothing to checkpoint, and is let go at once — not after its own patience runs out.
func TestWorkerLeavesWhileJobWaits(t *testing.T) {
	spec := tinyJob(t, 4)
	clusterConfig = func(cfg *Config) { cfg.MinWorkers = 2 }
	t.Cleanup(func() { clusterConfig = nil })
	leave := make(chan struct{})
	joined := make(chan struct{}, 1)
	c := startCluster(t, spec, 1, false, func(i int, cfg *client.WorkerConfig) {
		cfg.Leave = leave
		cfg.OnStatus = func(s client.Status) {
			if s.State == client.StateJoined {
				select {
				case joined <- struct{}{}:
				default:
				}
			}
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go c.srv.Run(ctx)
	select {
	case <-joined:
	case <-time.After(time.Minute):
		t.Fatal("the worker never joined")
	}
	close(leave)
	gone := make(chan struct{})
	go func() { c.workers.Wait(); close(gone) }()
	select {
	case <-gone:
	case <-time.After(time.Minute):
		t.Fatal("a worker asked to stop while the job waits was not let go")
	}
}

// TestLeavingAbused is the attacker of proto.Leaving: a standby that asks to leave, is let go
// (Bye{drain}), and asks again rather than go. It is dropped with an error saying so, the job
// records its request once, and the job trains on to one process's parameters.
func TestLeavingAbused(t *testing.T) {
	spec := stopJob(t, 8, &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}})
	_, ref := localReports(t, spec)
	log := watch(t, "worker.leaving")
	c := startCluster(t, spec, 2, false)
	told := make(chan string, 1) // what the coordinator last said before closing
	var once sync.Once
	c.onStep = func(r local.Report) {
		if r.Step != 1 {
			return
		}
		once.Do(func() {
			go func() {
				told <- abuseLeaving(t, c)
			}()
		})
	}
	c.run(t)
	if got := <-told; !strings.Contains(got, "asked to leave again") {
		t.Fatalf("the abuser was told %q before its connection closed, want a drop for asking again", got)
	}
	if n := len(log.of("worker.leaving")); n != 1 {
		t.Errorf("%d worker.leaving events for one worker's requests, want one", n)
	}
	assertFinalCheckpoint(t, c, ref)
}

// abuseLeaving joins as a standby, asks to leave, waits for the Bye that lets it go, asks again,
// and returns the text of the last message the coordinator sent before the connection closed.
func abuseLeaving(t *testing.T, c *cluster) string {
	ws, _ := rogue(t, c, testHello("leaver"))
	if ws == nil {
		return ""
	}
	defer ws.CloseNow()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	leave, _ := proto.EncodeMessage(&proto.Leaving{Reason: "again"})
	if err := ws.Write(ctx, websocket.MessageText, leave); err != nil {
		return err.Error()
	}
	last := ""
	for {
		_, b, err := ws.Read(ctx)
		if err != nil {
			return last
		}
		m, err := proto.DecodeMessage(b, proto.RoleWorker)
		if err != nil {
			continue // a heartbeat's binary form, a frame: nothing to answer
		}
		switch m := m.(type) {
		case *proto.Bye:
			last = "bye " + m.Reason
			if m.Reason == proto.ByeDrain {
				ws.Write(ctx, websocket.MessageText, leave) // and stays
			}
		case *proto.Error:
			last = m.Message
		case *proto.Heartbeat:
			hb, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: m.Seq, Ack: true})
			ws.Write(ctx, websocket.MessageText, hb)
		}
	}
}
