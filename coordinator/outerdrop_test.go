package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// TestOuterReplicaDropped: three whole-model replicas train own batches in outer mode (an outer
// step every 6 steps, a checkpoint every 6). Replica 0's worker dies mid-round, as it finishes
// step 7 and before it reports it — once the others are past the outer step after step 5 (they
// have finished step 6), whose exchange needed its contribution. The rule book drops the replica at once: the other two carry
// on under the same plan — no replan, no shard restored from the checkpoint after step 6, no step
// abandoned — the dropped replica's round is left out of the outer step after step 11, and
// replica 2 keeps its own data (its index). Replica 1 uploads the global θ in replica 0's stead.
// The losses and the final parameters are those of one process replaying the recorded
// membership (local.Options.Replay, as `shoal train --replay` does), bit for bit.
func TestOuterReplicaDropped(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 12, job.Sync{Every: 6, Compress: "int8", Batches: job.BatchesOwn}, 2, 2, 2)
	spec.CheckpointEvery, spec.ValEvery = 6, 4 // evaluations through the first replica left
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left")
	var c *cluster
	c = startCluster(t, spec, 3, false, killMidRound(t, &c, nil, nil))
	c.run(t)
	c.finished(t, spec.Steps)
	noRestore(t, log, "w0", 1)
	dropped := log.of("replica.dropped")
	if len(dropped) != 1 {
		t.Fatalf("replica.dropped events: %v, want one", dropped)
	}
	var ev struct{ Replica, Step, Replicas int }
	if err := json.Unmarshal([]byte(strings.TrimPrefix(dropped[0], "w0 ")), &ev); err != nil || ev.Replica != 0 || ev.Replicas != 2 || ev.Step < 6 || ev.Step > 11 {
		// The step the drop is recorded at is where the job stands when the departure is heard:
		// 6 or 7 on a quiet machine, later when the survivors run ahead first; the replay below
		// is what pins it.
		t.Fatalf("replica.dropped %s (%v): want replica 0 of w0 dropped within the round (steps 6 to 11), two left", dropped[0], err)
	}
	periods := replayOf(t, log.planList())
	b, _ := json.Marshal(periods)
	if len(periods) != 2 || periods[0].From != 0 || len(periods[1].Replicas) != 3 || periods[1].From != ev.Step || fmt.Sprint(periods[1].Dropped) != "[0]" {
		t.Fatalf("plans %s: want three replicas from step 0, then replica 0 dropped from step %d", b, ev.Step)
	}
	sameAsReplay(t, c, spec, periods)
}

// TestOuterReplicaLostInExchange: three whole-model replicas in outer mode (an outer step every 4
// steps, int8, no delay), and a fourth worker standing by. At the outer step after step 3, w2's
// worker sends its contributions to both others but its average to one of them only, and
// vanishes (client.FaultLeaveInExchange): one survivor may hold the whole average, the other
// cannot. The outer step is asked again of the two without w2's replica (an outer.redo), and both
// take it from the state they held before the first attempt — the one that held an average puts
// back what gathering it changed — with no restore and no step abandoned. The replica is dropped
// from step 4, left out of the outer step after step 3 (its step 3 counts), and the standby
// refills it from its peers; whichever plan's record starts at step 4 says it was left out (the
// refill's, when it comes at once, replaces the drop's in a replay). The losses and final
// parameters are one process's replaying that membership, bit for bit; the replay that keeps the
// replica in that outer step is another run.
func TestOuterReplicaLostInExchange(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 10, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn}, 2, 2, 2)
	spec.CheckpointEvery, spec.ValEvery = 0, 4
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left", "outer.redo")
	c := startCluster(t, spec, 3, false, faulty(2, client.FaultLeaveInExchange))
	c.joinAfterStep1(t, 3) // a standby: the pinned plan is full
	c.run(t)
	c.finished(t, spec.Steps)
	refills := len(log.of("plan")) - 1
	noRestore(t, log, "w2", 1+refills)
	if refills > 1 {
		t.Errorf("%d plans after the first, want at most the refill", refills)
	}
	if redo := log.of("outer.redo"); len(redo) != 1 {
		t.Errorf("outer.redo events: %v, want one", redo)
	}
	r2, dropped := droppedOnce(t, log, "w2")
	var ev struct {
		Replica, Step, Replicas int
		LeftOut                 bool `json:"left_out"`
	}
	if err := json.Unmarshal([]byte(dropped), &ev); err != nil || ev.Replica != r2 || ev.Replicas != 2 || ev.Step != 4 || !ev.LeftOut {
		t.Fatalf("replica.dropped %s (%v): want replica %d dropped from step 4 and left out of the outer step after step 3, two left", dropped, err, r2)
	}
	periods := replayOf(t, log.planList())
	at4 := slices.IndexFunc(periods, func(p local.Period) bool { return p.From == 4 })
	if at4 < 0 || fmt.Sprint(periods[at4].LeftOut) != fmt.Sprint([]int{r2}) {
		t.Fatalf("plans %+v: want a plan from step 4 with replica %d left out of the outer step after step 3", periods, r2)
	}
	t.Logf("the refill came %s", map[bool]string{true: "at once: its record carries the replica left out", false: "later"}[len(periods[at4].Grown) > 0])
	sameAsReplay(t, c, spec, periods)
	if len(periods[at4].Segments) > 0 {
		// The exchange went on without starting over (client/outerx.go): segments averaged
		// before the redo kept the lost replica's contribution, and the record says which.
		late := slices.Clone(periods)
		late[at4].Segments = nil
		differsFrom(t, c, spec, late, "the replay that averages every segment without the replica left out")
	}
	without := slices.Clone(periods)
	without[at4].LeftOut, without[at4].LeftOutAt, without[at4].Segments = nil, nil, nil
	differsFrom(t, c, spec, without, "the replay that keeps the replica in the outer step after step 3")
}

// TestOuterReplicaLostInDelayedExchange: as TestOuterReplicaLostInExchange, with a delay (every 4,
// delay 2: the outer step after step 3 is exchanged beside steps 4 and 5 and taken up after step
// 5). w2's worker vanishes in the middle of that exchange (client.FaultLeaveInExchange). A delayed
// step has two phases too: nobody applied it, so w2's replica is dropped and left out of it, and
// the two others take it again without it (an outer.redo with "delayed") while they train on —
// no restore, no step abandoned, one plan. The plan's record names the delayed step it was left
// out of (local.Period.LeftOutOf), and the losses and final parameters are one process's
// replaying that membership, bit for bit; the replay that keeps the replica in that step is
// another run. With one phase this departure restored every shard from the seed.
func TestOuterReplicaLostInDelayedExchange(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 10, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn, Delay: 2}, 2, 2, 2)
	spec.CheckpointEvery, spec.ValEvery = 0, 0
	if spec.OuterTakeUpAfter(3) != 5 {
		t.Fatalf("the test wants the outer step after step 3 taken up after step 5, not %d", spec.OuterTakeUpAfter(3))
	}
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left", "outer.redo")
	c := startCluster(t, spec, 3, false, faulty(2, client.FaultLeaveInExchange))
	c.run(t)
	c.finished(t, spec.Steps)
	noRestore(t, log, "w2", 1)
	if redo := log.of("outer.redo"); len(redo) != 1 || !strings.Contains(redo[0], `"delayed":true`) {
		t.Errorf("outer.redo events: %v, want one of the delayed step", redo)
	}
	r2, dropped := droppedOnce(t, log, "w2")
	var ev struct {
		Replica, Step, Replicas int
		LeftOutOf               *int `json:"left_out_of"`
	}
	if err := json.Unmarshal([]byte(dropped), &ev); err != nil || ev.Replica != r2 || ev.Replicas != 2 || ev.LeftOutOf == nil || *ev.LeftOutOf != 3 || ev.Step < 4 || ev.Step > 6 {
		t.Fatalf("replica.dropped %s (%v): want replica %d dropped from step 4 to 6, left out of the delayed outer step after step 3, two left", dropped, err, r2)
	}
	periods := replayOf(t, log.planList())
	at := slices.IndexFunc(periods, func(p local.Period) bool { return p.From == ev.Step })
	if at < 0 || fmt.Sprint(periods[at].LeftOut) != fmt.Sprint([]int{r2}) || periods[at].LeftOutOf == nil || *periods[at].LeftOutOf != 3 {
		b, _ := json.Marshal(periods)
		t.Fatalf("plans %s: want a plan from step %d with replica %d left out of the delayed outer step after step 3", b, ev.Step, r2)
	}
	sameAsReplay(t, c, spec, periods)
	without := slices.Clone(periods)
	without[at].LeftOut, without[at].LeftOutOf, without[at].LeftOutAt, without[at].Segments = nil, nil, nil, nil
	differsFrom(t, c, spec, without, "the replay that keeps the replica in the delayed outer step")
}

// droppedOnce is the replica worker's plan gave it first and the one replica.dropped event's
// detail, which must name worker.
func droppedOnce(t *testing.T, log *clusterLog, worker string) (int, string) {
	t.Helper()
	first := log.planList()[0]
	r := first.Stages[slices.IndexFunc(first.Stages, func(st StageStatus) bool { return st.Peer == worker })].Replica
	dropped := log.of("replica.dropped")
	if len(dropped) != 1 || !strings.HasPrefix(dropped[0], worker+" ") {
		t.Fatalf("replica.dropped events: %v, want one of %s", dropped, worker)
	}
	return r, strings.TrimPrefix(dropped[0], worker+" ")
}

// differsFrom fails the test when the replay of periods (what, a membership the run did not have)
// ends with the run's parameters: the test would show nothing.
func differsFrom(t *testing.T, c *cluster, spec job.Spec, periods []local.Period, what string) {
	t.Helper()
	res, err := local.Run(context.Background(), spec, local.Options{Replay: periods})
	if err != nil {
		t.Fatal(err)
	}
	m, _, err := model.LoadModel(filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(spec.Steps)))
	if err != nil {
		t.Fatal(err)
	}
	if slices.Equal(m.P.Tensors[0].Data, res.Model.P.Tensors[0].Data) {
		t.Errorf("%s ends with the same parameters: the test shows nothing", what)
	}
}

// TestOuterReplicaLostWhileRestoring: two replicas in outer mode; a third worker joins, and the
// planner makes it a third replica from a checkpoint at a round's end — a plan that restores every
// shard from that checkpoint. w0 dies once it has restored its shard and before it says it is
// ready, while the others restore: its replica is dropped from the plan's first step and the
// other two load on (the rule book: outer mode while a restore loads) — no second restore, no
// step abandoned. The plan's record marks the drop at the step it began from ("replan": restore,
// then drop), and the losses and final parameters are one process's replaying that, bit for bit.
// The coordinator's PeerLeft reaches the survivors before their new links exist; they do not wait
// out an ICE timeout for w0.
func TestOuterReplicaLostWhileRestoring(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 12, job.Sync{Every: 4, Compress: "int8"})
	spec.CheckpointEvery, spec.ValEvery = 6, 0
	spec.BatchSize, spec.MicroBatches = 12, 6 // three replicas of 2 beat two of 3
	log := watch(t, "plan", "replica.dropped", "step.abandoned", "worker.left")
	var c *cluster
	var killed sync.Once
	c = startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		slowWorkers(i, cfg)
		if i != 0 {
			return
		}
		cfg.OnStatus = killBeforeReady(t, &c, &killed, 0, "w0", 2)
	})
	c.joinAfterStep1(t, 2)
	c.run(t)
	c.finished(t, spec.Steps)
	noRestore(t, log, "w0", 2) // the first, and the join's
	plans := log.planList()
	second := plans[len(plans)-1]
	r0 := slices.IndexFunc(second.Dropped, func(d DroppedReplica) bool { return d.Step == second.FromStep })
	if second.Version != 2 || len(second.Dropped) != 1 || r0 < 0 {
		t.Fatalf("the last plan: version %d, dropped %+v: want plan 2 with w0's replica dropped from its first step %d", second.Version, second.Dropped, second.FromStep)
	}
	periods := replayOf(t, plans)
	if len(periods) != 2 || len(periods[1].Replicas) != 3 || !periods[1].Replan || len(periods[1].Dropped) != 1 {
		t.Fatalf("plans %+v: want 2 replicas from step 0, then 3 restored from a checkpoint with one dropped at once", periods)
	}
	sameAsReplay(t, c, spec, periods)
}

// killBeforeReady is the OnStatus of worker i (id) of the cluster *cp (set by the time it is
// called), which dies once its shard of plan version is loaded — its Ready not sent yet: that
// follows the call — and waits there until the coordinator has seen it go, so that it never says
// it is ready.
func killBeforeReady(t *testing.T, cp **cluster, once *sync.Once, i int, id string, version uint32) func(client.Status) {
	return func(s client.Status) {
		if s.PlanVersion != version {
			return
		}
		c := *cp
		once.Do(func() {
			c.kill[i]()
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				if !slices.ContainsFunc(c.srv.hub.Workers(), func(w WorkerInfo) bool { return w.ID == id }) {
					return
				}
			}
			t.Errorf("the coordinator never saw %s go", id)
		})
	}
}

// TestDelayedCommitNeedsEveryStage: the coordinator commits a delayed outer step only once every
// participant's stage said it holds the latest attempt's average: a worker that answers early, twice,
// for another attempt or under another plan cannot make it commit the others before they hold it.
// A stage's failure on its link to a worker gone is nothing (its redo mends it; one on a link to a
// worker still connected is a suspect, whose departure may follow: the cluster tests above), and
// a refusal or a failure of no link fails the plan.
func TestDelayedCommitNeedsEveryStage(t *testing.T) {
	spec := outerJob(t, 100, job.Sync{Every: 4, Compress: "int8", Delay: 2}, 2, 2, 2)
	srv := jobServer(t, spec)
	peers := map[string]*peer{}
	for _, id := range []string{"w0", "w1", "w2"} {
		peers[id] = &peer{id: id, hello: &proto.Hello{Kind: proto.WorkerNative, GFLOPS: 10, MemoryBytes: 1 << 30}}
	}
	j := &jobRun{s: srv, rec: storage.Job{ID: uuid.New()}, spec: spec, sync: outerRule{}, peers: peers, speeds: map[string]*speed{},
		phase: phaseTraining, version: 3, step: 4,
		reps: []replicaRun{{lo: 0, hi: 1, n: 2, index: 0}, {lo: 1, hi: 2, n: 2, index: 1}, {lo: 2, hi: 3, n: 2, index: 2}},
		stages: []placement{{peer: "w0", begin: 0, end: 4, replica: 0, n: 2}, {peer: "w1", begin: 0, end: 4, replica: 1, n: 2},
			{peer: "w2", begin: 0, end: 4, replica: 2, n: 2}}}
	j.askedDelayed(3)
	j.delayed.attempt = 1
	done := func(w string, step uint64, ver uint32, attempt int) bool {
		return j.delayedDone(w, &proto.OuterDone{Step: step, PlanVersion: ver, Attempt: attempt})
	}
	switch {
	case done("w0", 3, 3, 1), done("w0", 3, 3, 1):
		t.Fatal("one stage's answer, twice, committed the step")
	case done("w1", 3, 3, 0), done("w1", 3, 2, 1), done("w1", 7, 3, 1):
		t.Fatal("an answer for another attempt, plan or step counted")
	case done("w1", 3, 3, 1):
		t.Fatal("committed with w2's stage yet to answer")
	case !done("w2", 3, 3, 1):
		t.Fatal("every participant's stage answered, and no commit")
	}
	// What any of the job loop's waits reads (await: noteDelayed) counts, not only the round's.
	j.askedDelayed(3)
	for _, w := range []string{"w0", "w1"} {
		j.noteDelayed(Event{Kind: EventMessage, Worker: w, Msg: &proto.OuterDone{Step: 3, PlanVersion: 3}})
	}
	j.noteDelayed(Event{Kind: EventMessage, Worker: "w2", Msg: &proto.OuterDone{Step: 3, PlanVersion: 2}})
	if j.delayedComplete() || !j.delayed.done["w0"] || !j.delayed.done["w1"] {
		t.Fatalf("answers heard by any wait: done %v; want w0's and w1's, not w2's of another plan", j.delayed.done)
	}
	step := uint64(3)
	j.noteDelayed(Event{Kind: EventMessage, Worker: "w2", Msg: &proto.Error{Code: proto.ErrCodeStep, Step: &step, PlanVersion: 3, Message: "x"}})
	if _, err := j.takeFailures(); !errors.Is(err, errReplan) {
		t.Errorf("a failure heard by any wait: %v, want it weighed (a replan)", err)
	}
	if _, err := j.takeFailures(); err != nil {
		t.Errorf("a failure weighed twice: %v", err)
	}
	// A replica left out of the delayed step is not held to have fed it: an audit it abandons of
	// a step since the outer step it fed before rolls nothing back (audit.go's abandon).
	j.outerFed = map[string]int{"w0": -1, "w2": -1}
	j.askedDelayed(3)
	j.recordOuterStep(3) // every replica's stage fed the step after step 3, as recorded
	j.dropReplica(2, &replicaLeft{worker: "w2", index: 2, why: "test"}, 5, false)
	if e, ok := j.outerLeft["w2"]; !ok || e != -1 || j.dropped[len(j.dropped)-1].leftOutOf != 3 {
		t.Errorf("w2 left out of the delayed outer step after step 3: it fed up to step %d (%v), left out of %d; want -1, 3", e, ok, j.dropped[len(j.dropped)-1].leftOutOf)
	}
	j.askedDelayed(3)
	fail := func(code proto.ErrorCode, peer string) (*linkSuspect, error) {
		return j.delayedFailure("w0", &proto.Error{Code: code, Step: &step, PlanVersion: 3, Peer: peer, Message: "x"})
	}
	if l, err := fail(proto.ErrCodeStep, "w9"); l != nil || err != nil {
		t.Errorf("a failure on a link to a worker gone: suspect %v, %v; want nothing (its redo mends it)", l, err)
	}
	if _, err := fail(proto.ErrCodeOuterRefused, "w1"); !errors.Is(err, errReplan) {
		t.Errorf("a refusal: %v, want a replan", err)
	}
	if _, err := fail(proto.ErrCodeStep, ""); !errors.Is(err, errReplan) {
		t.Errorf("a failure of no link: %v, want a replan", err)
	}
}
