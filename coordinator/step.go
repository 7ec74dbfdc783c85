package coordinator

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// errStep is a step that failed without a worker leaving: a bad report, a deadline.
var errStep = errors.New("step failed")

// deadline is how long the next step (or evaluation) may take: deadlineFactor times the median
// of the recent step times, within the job's floor and ceiling — the ceiling until a step was
// measured. Nobody tunes a fixed timeout: a slow volunteer pool gets long deadlines, a fast one
// notices a silent peer quickly.
func (j *jobRun) deadline() time.Duration {
	lo := time.Duration(j.spec.StepDeadlineMinS * float64(time.Second))
	hi := time.Duration(j.spec.StepDeadlineMaxS * float64(time.Second))
	if len(j.stepTimes) == 0 {
		return hi
	}
	ts := slices.Clone(j.stepTimes)
	slices.Sort(ts)
	return min(max(deadlineFactor*ts[len(ts)/2], lo), hi)
}

const (
	deadlineFactor = 4
	stepTimeWindow = 20 // recent steps the median is taken over
)

// stepTokens is how many tokens a training step of the active plan trains: the job's batch, or
// with own batches every replica's n_r micro-batches of B/M rows.
func (j *jobRun) stepTokens() int {
	spec := j.spec
	if !spec.OwnBatches() {
		return spec.BatchSize * spec.Model.BlockSize
	}
	tokens := 0
	for _, rr := range j.reps {
		tokens += rr.n * (spec.BatchSize / spec.MicroBatches) * spec.Model.BlockSize
	}
	return tokens
}

// replicaBatch is the own batch of step s of the replica at position r of the active plan (outer
// mode with own batches; local/outer.go): its n_r micro-batches of B/M rows, drawn from the seed
// of its index.
func (j *jobRun) replicaBatch(r, s int) ([]int32, []int32, error) {
	spec, rr := j.spec, j.reps[r]
	return j.corpus.Batch(job.ReplicaSeed(spec.Seed, rr.index), s, rr.n*(spec.BatchSize/spec.MicroBatches), spec.Model.BlockSize)
}

// recordStep records training step s once every participant reported it — reports and elapsed
// in the participants' order, dt the step's wall time, ce, aux and norm its totals: the step row
// with its timings, the validation loss when one is due, the router statistics, the work to
// credit, the speeds measured, and the progress published. outer, when not nil, takes the outer
// step after s: after what is counted by participant (the reports are the plan's as it was), and
// before the evaluation (of the global θ after it).
func (j *jobRun) recordStep(ctx context.Context, s int, lr float64, reports []*proto.StepReport, elapsed []time.Duration, dt time.Duration, ce, aux, norm float64, outer func() error) error {
	spec := j.spec
	tokens := j.stepTokens()
	j.stepTimes = append(j.stepTimes, dt)
	if len(j.stepTimes) > stepTimeWindow {
		j.stepTimes = j.stepTimes[1:]
	}
	timings := map[string]proto.Timings{}
	var wait []time.Duration
	var sent int64
	var stages []StageTiming
	for i, r := range reports {
		id := j.participants()[i]
		timings[id] = r.Timings
		c := j.counts[id]
		c.microBatches += int64(j.microBatchesOf(i))
		c.bytesSent += r.Timings.BytesSent
		j.counts[id] = c
		stages = append(stages, StageTiming{Peer: id, ComputeMS: float64(r.Timings.ForwardNS+r.Timings.BackwardNS) / 1e6,
			WaitMS: float64(r.Timings.WaitNS) / 1e6, TransferMS: float64(r.Timings.TransferNS) / 1e6})
		if i < len(j.stages) {
			wait = append(wait, time.Duration(r.Timings.WaitNS+r.Timings.TransferNS))
		}
		sent += r.Timings.BytesSent
	}
	tb, _ := json.Marshal(timings)
	rec := storage.Step{JobID: j.rec.ID, Step: int64(s), PlanVersion: int64(j.version), Loss: ce, Aux: aux,
		Tokens: int64(tokens), Timings: tb}
	rep := local.Report{Step: s, Steps: spec.Steps, CE: ce, Aux: aux, LR: lr, GradNorm: norm,
		TokensPerS: float64(tokens) / dt.Seconds(), ValLoss: math.NaN(), StageWait: wait, BytesSent: sent}
	if err := j.recordWork(ctx, s); err != nil {
		return err
	}
	routed := map[int][]int{}
	for _, r := range reports {
		for _, br := range r.Routed {
			routed[br.Block] = br.Tokens
		}
	}
	if flagged := j.measure(reports, elapsed, routed); len(flagged) > 0 {
		j.remeasure = true
	}
	j.samplePace(s, reports, elapsed)
	j.lastStepSeconds = dt.Seconds()
	if outer != nil {
		if err := outer(); err != nil {
			return err
		}
	}
	if spec.ValEvery > 0 && (s%spec.ValEvery == 0 || s == spec.Steps-1) {
		v, err := j.evaluate(ctx, s)
		if err != nil {
			return err
		}
		rep.ValLoss, rec.ValLoss = v, &v
	}
	if _, err := j.s.db.RecordStep(ctx, rec); err != nil {
		return err
	}
	var stats []storage.RouterStat
	j.routed = map[int][]int{}
	for _, r := range reports {
		for _, br := range r.Routed {
			j.routed[br.Block] = br.Tokens
			for e, n := range br.Tokens {
				stats = append(stats, storage.RouterStat{Step: int64(s), Block: br.Block, Expert: e, Tokens: int64(n)})
			}
		}
	}
	if len(stats) > 0 {
		if err := j.s.db.RecordRouterStats(ctx, j.rec.ID, stats); err != nil {
			return err
		}
	}
	j.history = append(j.history, StepStatus{Step: s, Loss: ce, Aux: aux, ValLoss: rec.ValLoss, TokensPerS: rep.TokensPerS, Stages: stages})
	if len(j.history) > maxHistory {
		j.history = j.history[len(j.history)-maxHistory:]
	}
	j.lastReport = rep
	j.s.metrics.observeStep(rep, dt)
	return nil
}

// recordWork credits step s to its participants, pending until an audit of theirs passes:
// micro-batches and the FLOPs their shard computed (shareFLOPs).
func (j *jobRun) recordWork(ctx context.Context, s int) error {
	var work []storage.Work
	for i, p := range j.participants() {
		work = append(work, storage.Work{Worker: p, Identity: j.peers[p].identity(), MicroBatches: int64(j.microBatchesOf(i)), FLOPs: j.shareFLOPs(i, j.routed)})
	}
	j.s.markTookPart(work)
	return j.s.db.RecordWork(ctx, j.rec.ID, int64(s), int64(j.version), work)
}

// afterStep takes a checkpoint every checkpoint_every steps and after the last one, then reports
// progress. boundary says whether everyone stands still after s (always in lockstep; at a round's
// end with free-running replicas, round.go): only there may a checkpoint by time be taken.
func (j *jobRun) afterStep(ctx context.Context, s int, boundary bool) error {
	done := s + 1
	rep := j.lastReport
	due := (j.spec.CheckpointEvery > 0 && done%j.spec.CheckpointEvery == 0) || done == j.spec.Steps
	if iv := j.s.cfg.CheckpointInterval; boundary && iv > 0 && time.Since(j.lastCheckpoint) >= iv {
		due = true
	}
	if boundary && !due && j.churnCheckpointDue() {
		due = true
	}
	// A departure that reshares (reshare.go) leaves the step recorded and applied: the step's
	// record goes out as for any step, and the checkpoint is asked again of the plan after it.
	var left error
	if due {
		if err := j.checkpoint(ctx, done); resharing(err) != nil {
			left, j.ckAgain = err, done
		} else if err != nil {
			return err
		} else {
			j.lastCheckpoint = time.Now()
		}
	}
	rep.Elapsed = time.Since(j.started)
	if n := done - j.firstStep; n > 0 {
		rep.ETA = time.Duration(float64(rep.Elapsed) / float64(n) * float64(j.spec.Steps-done))
	}
	j.publish()
	if j.s.cfg.OnStep != nil {
		j.s.cfg.OnStep(rep)
	}
	return left
}

// churnCheckpointDue reports whether a job under churn should checkpoint now, at Young's interval
// (sched.CheckpointInterval) for its rate of restores since it started and what its checkpoints
// have cost: under churn a restore replays everything since the newest checkpoint, and
// checkpoint_every, chosen for a quiet fleet, may be far apart — with refills and reshares taking
// no checkpoint, nothing else bounds the replay. A job that has seen departures enough to plan
// for them (churnLog.churning) but no restore yet takes one restore so far as its prior; one
// that has seen neither checkpoints as its spec says. Never more often than minCheckpointGap.
func (j *jobRun) churnCheckpointDue() bool {
	n := j.churn.failures
	if n == 0 && j.churn.churning() {
		n = 1 // departures seen, no restore yet: one so far is the prior
	}
	if n == 0 {
		return false
	}
	cost := max(j.ckCost, time.Second).Seconds() // until one is measured: a second
	rate := float64(n) / time.Since(j.started).Seconds()
	iv := sched.CheckpointInterval(cost, rate)
	if math.IsInf(iv, 1) {
		return false
	}
	return time.Since(j.lastCheckpoint) >= max(time.Duration(iv*float64(time.Second)), minCheckpointGap)
}

// minCheckpointGap bounds how often churn makes a job checkpoint: each checkpoint is an upload
// of every shard.
const minCheckpointGap = 5 * time.Second

// checkpoint asks every shard to upload its state after done steps. Workers snapshot before they
// touch the next step and upload in the background; the checkpoint becomes complete when the
// last shard lands (Server.handleUpload).
func (j *jobRun) checkpoint(ctx context.Context, done int) error {
	// A checkpoint holds the global θ of the last outer step: a delayed one is committed first.
	if err := j.commitDelayed(ctx); err != nil {
		return err
	}
	// Replicas hold the same tensors bit for bit: the first replica's stages upload them, with the
	// expert hosts.
	all := j.participants()
	S0 := j.reps[0].hi
	idx := make([]int, 0, len(all)) // the uploading participants' indices
	for i := range all {
		if j.spec.Outer() || len(j.reps) == 1 || i < S0 || i >= len(j.stages) {
			idx = append(idx, i)
		}
	}
	parts := make([]string, len(idx))
	names := make([]string, len(idx))
	prefixes := make([][]string, len(idx))
	global := make([]bool, len(idx))
	for n, i := range idx {
		parts[n] = all[i]
		switch {
		case j.spec.Outer():
			// Every replica's state is its own (its θ_r, its AdamW moments): every stage uploads
			// its replica's part under the replica's index, the first live replica's stages the
			// global one too (every replica holds it: replica 0 may have been dropped).
			r := j.replicaOf(i)
			rr := j.reps[r]
			global[n] = r == 0
			names[n] = outerShardName(rr.index, i-rr.lo)
			prefixes[n] = outerPrefixes(r == 0, []int{rr.index}, j.spec.Sync.Compress == "int8", pendingAt(j.spec, int64(done)))
		case i < S0:
			names[n] = fmt.Sprintf("stage-%d", i)
		default:
			names[n] = fmt.Sprintf("experts-%d", i-len(j.stages))
		}
	}
	ck, err := j.s.db.BeginCheckpoint(ctx, j.rec.ID, int64(done), names)
	if err != nil {
		return err
	}
	j.ckRequested, j.ckVersion = done, j.version
	j.ckHolders = &ckHolders{id: ck.ID, workers: map[string]string{}}
	for i, p := range parts {
		j.ckHolders.workers[names[i]] = p
	}
	for i, p := range parts {
		j.s.slots.expect(ck.ID, names[i], uploadSlot{Worker: p, Job: j.rec.ID, Spec: j.spec, Step: int64(done), Shard: j.shardOf(idx[i]), Prefixes: prefixes[i]})
	}
	var live []int
	for _, rr := range j.reps {
		live = append(live, rr.index)
	}
	for i, p := range parts {
		m := &proto.Checkpoint{ID: ck.ID, Step: uint64(done), Shard: names[i], Global: global[i], GlobalReplica: j.reps[0].index, Live: live,
			UploadPath: fmt.Sprintf("/api/checkpoints/%d/shards/%s", ck.ID, names[i])}
		if err := j.s.hub.Send(p, m); err != nil {
			return j.sendFailed(p, "checkpoint request to", err)
		}
	}
	return nil
}

// shardOf is the shard of participant i of the active plan (stages in order, replica after
// replica, then expert hosts).
func (j *jobRun) shardOf(i int) proto.Shard {
	S := len(j.stages)
	if i < S {
		return stageShardAt(j.stages, j.reps, i)
	}
	h := j.hosts[i-S]
	// Its place in the first replica's pipeline (in a plan of replicas, proto.Assign.Routers
	// gives each replica's).
	r0 := j.reps[0]
	si := 0
	for k := r0.lo; k < r0.hi; k++ {
		if st := j.stages[k]; h.block >= st.begin && h.block < st.end {
			si = k - r0.lo
		}
	}
	return proto.Shard{Experts: &proto.ExpertShard{Block: h.block, Experts: slices.Clone(h.experts), StageIndex: si, StageCount: r0.hi - r0.lo}}
}

// routers are the stages holding MoE block blk, one per replica of the active plan in replica
// order, as an expert host of the block serves them: each with its replica's micro-batches and
// the depth its stages run at (as their Assigns say).
func (j *jobRun) routers(blk, depth int) []proto.ExpertRouter {
	var out []proto.ExpertRouter
	for r, rr := range j.reps {
		for k := rr.lo; k < rr.hi; k++ {
			if st := j.stages[k]; blk >= st.begin && blk < st.end {
				out = append(out, proto.ExpertRouter{Worker: st.peer, Replica: r, StageIndex: k - rr.lo, StageCount: rr.hi - rr.lo,
					First: rr.first, MicroBatches: rr.n, Depth: min(depth, rr.n-1)})
			}
		}
	}
	return out
}

// evaluate computes the validation loss after step s through the pipeline — the first replica's,
// since every replica holds the same parameters (outer mode: the same global θ). A worker that
// leaves meanwhile is answered as in training (phaseEvaluating): the pass goes on, or starts again
// on the next replica when the departed worker was computing it; once it is done, an outer-mode
// replica is dropped from step s+1 and a step-mode departure waits for the step's record, after
// which the survivors reshare from s+1 (leftInEval, stepRule.complete).
func (j *jobRun) evaluate(ctx context.Context, s int) (float64, error) {
	// An evaluation is of the last outer step's global θ: a delayed one is committed first.
	if err := j.commitDelayed(ctx); err != nil {
		return 0, err
	}
	defer j.enterFor(phaseEvaluating)()
	rows := j.spec.ValPassRows()
	st := proto.StepSpec{Step: proto.EvalStep(uint64(s)), PlanVersion: j.version, MicroBatches: data.ValWindows / rows, Rows: rows}
	open := &proto.StepOpen{Step: st.Step, PlanVersion: j.version, MicroBatches: st.MicroBatches,
		DeadlineMS: j.deadline().Milliseconds(), Rows: st.Rows, Eval: true}
	var left []*replicaLeft
	gone := func(rr replicaRun) bool {
		// A replica whose stage was taken over during the step (takeover.go) has no whole
		// pipeline until it stands by after it.
		if rec := j.reroutedAt(s); rec != nil && rec.takeover != nil && rec.takeover.tk.Replica == rr.index {
			return true
		}
		return slices.ContainsFunc(j.stages[rr.lo:rr.hi], func(p placement) bool {
			return slices.ContainsFunc(left, func(d *replicaLeft) bool { return d.worker == p.peer })
		})
	}
	for {
		r := slices.IndexFunc(j.reps, func(rr replicaRun) bool { return !gone(rr) })
		if r < 0 {
			return 0, fmt.Errorf("%w: every replica lost a worker during the evaluation after step %d", errReplan, s)
		}
		// The replica's stages, and the expert hosts, which serve every replica.
		rr := j.reps[r]
		parts := slices.Concat(j.participants()[rr.lo:rr.hi], j.participants()[len(j.stages):])
		reports, err := j.evalPass(ctx, parts, replicaRun{lo: rr.lo, hi: rr.hi, first: 0, n: st.MicroBatches}, open, j.vx, j.vy, &left)
		if d, ok := errors.AsType[*replicaLeft](err); ok && slices.Contains(parts, d.worker) {
			left = append(left, d)
			continue // the pass again, on another replica
		}
		if err != nil {
			return 0, err
		}
		last := reports[rr.hi-rr.lo-1]
		if len(last.CE) != st.MicroBatches {
			return 0, fmt.Errorf("%w: evaluation returned %d losses, want %d", errStep, len(last.CE), st.MicroBatches)
		}
		for _, d := range left {
			if d.reshare {
				j.leftInEval = cmp.Or(j.leftInEval, d)
			} else if p := j.replicaPos(d.index); p >= 0 {
				j.dropReplica(p, d, s+1, false)
			}
		}
		return data.ValLoss(last.CE, rows), nil
	}
}

// stepSpec is the part of a StepOpen that names a step's tensors and shapes its schedule.
func stepSpec(o *proto.StepOpen) proto.StepSpec {
	return proto.StepSpec{Step: o.Step, PlanVersion: o.PlanVersion, MicroBatches: o.MicroBatches, Rows: o.Rows}
}

// evalPass opens an evaluation on the participants parts, sends its windows (x, y) through
// replica rr, and waits for one report per participant, in their order. Training steps have their
// driver (train, drive.go); an evaluation changes no state and has no clip factor, so it needs
// none of a round's bookkeeping.
//
// A departure the rule book answers by dropping or resharing a replica (replicaLeft) of a worker
// outside parts is added to left and the pass goes on; one of parts ends it with that error.
func (j *jobRun) evalPass(ctx context.Context, parts []string, rr replicaRun, open *proto.StepOpen, x, y []int32, left *[]*replicaLeft) ([]*proto.StepReport, error) {
	for _, p := range parts {
		if err := j.s.hub.Send(p, open); err != nil {
			return nil, j.sendFailed(p, "open evaluation on", err)
		}
	}
	if err := j.sendInputs(rr, stepSpec(open), x, y); err != nil {
		return nil, err
	}
	reports := make([]*proto.StepReport, len(parts))
	failed := make([]error, len(parts)) // participants that answered with an error
	got, answered := 0, 0
	deadline := time.NewTimer(time.Duration(open.DeadlineMS) * time.Millisecond)
	defer deadline.Stop()
	for answered < len(parts) {
		ev, late, err := j.awaitEvent(ctx, deadline.C)
		if d, ok := errors.AsType[*replicaLeft](err); ok && !slices.Contains(parts, d.worker) {
			*left = append(*left, d)
			continue
		}
		if err != nil {
			return nil, err
		}
		if late {
			// The peers that did not answer in time are lost to this plan: drop them (they may
			// rejoin) and record it.
			for i, id := range parts {
				if reports[i] == nil && failed[i] == nil {
					j.s.event(j.rec.ID, "worker.deadline", id, map[string]any{"step": open.Step})
					j.s.hub.Drop(id, fmt.Errorf("no report for step %d within its %v deadline", proto.TrainingStep(open.Step), time.Duration(open.DeadlineMS)*time.Millisecond))
				}
			}
			return nil, fmt.Errorf("%w: step %d (evaluation) missed its deadline with %d of %d reports", errStep, open.Step, got, len(parts))
		}
		// A failure of the same step under an earlier plan (one abandoned when its plan changed
		// around the worker, sched.Reshare) is not this one's.
		if e, ok := ev.Msg.(*proto.Error); ok && ev.Kind == EventMessage && e.Step != nil && *e.Step == open.Step && e.PlanVersion == open.PlanVersion {
			if i := slices.Index(parts, ev.Worker); i >= 0 && reports[i] == nil && failed[i] == nil {
				failed[i] = e
				answered++
			}
			continue
		}
		rep, ok := ev.Msg.(*proto.StepReport)
		if ev.Kind != EventMessage || !ok {
			continue
		}
		if rep.Step != open.Step || rep.PlanVersion != j.version {
			j.s.log.Debug("stale report", "from", ev.Worker, "step", rep.Step, "plan", rep.PlanVersion)
			continue
		}
		i := slices.Index(parts, ev.Worker)
		if i < 0 {
			continue // a replica's stage the pass left when a worker of its replica went
		}
		if reports[i] != nil {
			j.s.hub.Drop(ev.Worker, fmt.Errorf("unexpected report for step %d", rep.Step))
			continue
		}
		if !rep.Eval {
			return nil, fmt.Errorf("%w: %s sent a report of the wrong kind", errStep, ev.Worker)
		}
		reports[i] = rep
		got++
		answered++
	}
	for i, err := range failed {
		if err == nil {
			continue
		}
		// A step lost on a link to another participant may be that participant's departure,
		// which the hub has not heard yet: a worker killed mid-step can have reported the step
		// (its own part done) while what it sent last died with its connection. Its departure is
		// the rule book's to answer (a reshare), not a failure between two that stay (a restore).
		if e, ok := err.(*proto.Error); ok && e.Peer != "" && e.Peer != parts[i] {
			if err := j.awaitDeparture(ctx, e.Peer); err != nil {
				return nil, err
			}
		}
		return nil, fmt.Errorf("%w: step %d failed on %s: %v", errStep, proto.TrainingStep(open.Step), parts[i], err)
	}
	return reports, nil
}

// errStayed is awaitDeparture's suspect expiring: its peer is still connected.
var errStayed = errors.New("the peer stayed")

// awaitDeparture waits up to linkGrace for participant peer, whose link a step failed on, to
// leave. It returns what the job loop makes of the departure (handle: a replicaLeft, errReplan),
// or nil if peer stays — or is no participant — and the failure is the step's own.
func (j *jobRun) awaitDeparture(ctx context.Context, peer string) error {
	if !j.holds(peer) {
		return nil
	}
	if j.suspect == nil || j.suspect.peer != peer {
		// One already waited for, of the same peer, keeps its own verdict (a replan).
		j.suspect = &linkSuspect{peer: peer, err: errStayed, until: time.Now().Add(linkGrace)}
	}
	for j.suspect != nil {
		_, _, err := j.awaitEvent(ctx, nil)
		if errors.Is(err, errStayed) {
			return nil
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// sendInputs sends replica rr's micro-batches of step st — [first, first+n) of the batch x, y,
// as many as the step has — their tokens to its first stage and their targets to its last.
func (j *jobRun) sendInputs(rr replicaRun, st proto.StepSpec, x, y []int32) error {
	T := j.spec.Model.BlockSize
	n := st.Rows * T
	first, last := j.stages[rr.lo].peer, j.stages[rr.hi-1].peer
	// One end found gone does not stop the other's inputs: a stage taken over (takeover.go)
	// leaves the rest of its replica computing the step.
	var failed error
	firstGone, lastGone := false, false
	for mb := rr.first; mb < rr.first+rr.n && mb < st.MicroBatches; mb++ {
		xt, yt, err := proto.TokenTensors(st, mb, T, x[mb*n:(mb+1)*n], y[mb*n:(mb+1)*n])
		if err != nil {
			return err
		}
		if !firstGone {
			if err := j.s.hub.SendTensor(first, xt); err != nil {
				firstGone, failed = true, cmp.Or(failed, j.sendFailed(first, "tokens to", err))
			}
		}
		if !lastGone {
			if err := j.s.hub.SendTensor(last, yt); err != nil {
				lastGone, failed = true, cmp.Or(failed, j.sendFailed(last, "targets to", err))
			}
		}
	}
	return failed
}

// awaitEvent waits (await) for the next hub event while a step or evaluation is in flight, taking
// checkpoint uploads and audit verdicts as they come, and hands the event to handle (joins,
// departures, errors) before returning it; late reports that deadline fired first. The step
// driver (train) and evalPass read reports and step failures from the events it returns.
func (j *jobRun) awaitEvent(ctx context.Context, deadline <-chan time.Time) (ev Event, late bool, err error) {
	for {
		// A link failure's wait for its peer's departure (linkSuspect) counts too; handle may
		// start one.
		woke, ev, err := j.await(ctx, listen{deadline: deadline, verdicts: true, suspect: true})
		switch {
		case woke == wokeDeadline:
			return Event{}, true, nil
		case err != nil || woke == wokeEvent:
			return ev, false, err
		}
	}
}

// microBatchesOf is how many micro-batches of a step participant i of the active plan computes:
// its replica's share for a stage, all of them for an expert host.
func (j *jobRun) microBatchesOf(i int) int {
	if i < len(j.stages) {
		return j.stages[i].n
	}
	return j.spec.MicroBatches
}

// replicaNormTol bounds how far apart two replicas of different kernel families may report one
// tensor's ‖g‖² (relative): float32 sums of squares on a GPU against the CPU's float64, 1e-6
// relative and less for the tensors of the tiny and default models (internal/devcheck's
// tolerance table, which both GPU backends are held to, states SquaredNorms'), with room to spare; a lie that moves
// a norm by less changes the clip factor by less than that.
const replicaNormTol = 1e-5

// mergeReplicas turns the reports of a replicated plan's participants into what one pipeline's
// would be, for proto.StepTotals: the cross-entropy of every micro-batch and each MoE block's
// balancing losses in micro-batch order (the replicas' in replica order), and every tensor's
// ‖g‖² — which the replicas report alike, having reduced the same gradient (StepTotals checks
// that they agree exactly). A plan of one pipeline passes through unchanged.
//
// The replicas' gradients are the same bits whatever each computes on (every holder sums the same
// tree nodes), but a GPU sums the squares in its own order: replicas of different kernel families
// report ‖g‖² a few ulps apart. Those are taken as the first replica's when they agree within
// replicaNormTol — the clip factor is the coordinator's, one for all — so that a CPU replica and a
// GPU replica can share a step; beyond it they stay apart, and StepTotals' disagreement is
// disputed (dispute). Replicas of one CPU family must agree exactly.
func (j *jobRun) mergeReplicas(reports []*proto.StepReport) []*proto.StepReport {
	if len(j.reps) < 2 {
		return reports
	}
	parts := j.participants()
	first := map[string]float64{} // tensor → the first replica's ‖g‖²
	family := map[string]string{} // tensor → that replica's kernel family
	familyOf := func(i int) string {
		if i < len(parts) {
			if p := j.peers[parts[i]]; p != nil && p.hello != nil {
				return p.hello.Kernels
			}
		}
		return ""
	}
	merged := &proto.StepReport{GradSq: map[string]float64{}}
	var out []*proto.StepReport
	blocks := map[int]*proto.BlockAux{}
	var order []int
	for _, rr := range j.reps {
		for i := rr.lo; i < rr.hi; i++ {
			r := reports[i]
			merged.CE = append(merged.CE, r.CE...)
			for _, a := range r.Aux {
				b, ok := blocks[a.Block]
				if !ok {
					b = &proto.BlockAux{Block: a.Block}
					blocks[a.Block] = b
					order = append(order, a.Block)
				}
				b.Aux = append(b.Aux, a.Aux...)
			}
			// Each replica's tensors as a report of their own, so that StepTotals compares the
			// replicas' norms tensor by tensor.
			sq, cloned := r.GradSq, false
			fam := familyOf(i)
			for name, v := range r.GradSq {
				f, seen := first[name]
				if !seen {
					first[name], family[name] = v, fam
					continue
				}
				cpu := fam == family[name] && (fam == proto.KernelsFMA || fam == proto.KernelsPortable)
				if v != f && !cpu && math.Abs(v-f) <= replicaNormTol*math.Max(math.Abs(f), math.Abs(v)) {
					if !cloned {
						sq, cloned = maps.Clone(r.GradSq), true // the report itself is the audits' evidence
					}
					sq[name] = f
				}
			}
			out = append(out, &proto.StepReport{GradSq: sq})
		}
	}
	for _, b := range order {
		merged.Aux = append(merged.Aux, *blocks[b])
	}
	// The expert hosts' reports: each holds its experts' whole gradient, once for all replicas.
	out = append(out, reports[len(j.stages):]...)
	return append(out, merged)
}

// outerTotals are an outer-mode step's loss terms and norm, and each replica's clip factor: every
// replica trained its micro-batches as a step of its own (local's outer loop), so each is totalled
// over its own micro-batches and clipped by its own norm; the step's CE, aux and norm are their
// means weighted by the replicas' shares, added in replica order.
func (j *jobRun) outerTotals(reports []*proto.StepReport) (ce, aux, norm float64, clips []float32, err error) {
	// Weighed by micro-batches: shares of M, or with own batches M each (local/outer.go).
	total := 0
	for _, rr := range j.reps {
		total += rr.n
	}
	M := float64(total)
	for r, rr := range j.reps {
		c, a, n, err := proto.StepTotals(reports[rr.lo:rr.hi], rr.n)
		if err != nil {
			return 0, 0, 0, nil, fmt.Errorf("replica %d: %w", r, err)
		}
		w := float64(rr.n) / M
		ce += w * c
		aux += w * a
		norm += w * n
		clips = append(clips, model.ClipFactor(n, j.spec.Clip))
	}
	return ce, aux, norm, clips, nil
}

// outerStep asks every stage for the outer step after step s, with every replica of the plan
// taking part — those dropped from it are not (recorded: a replay takes the same step). Without a
// delay it returns once every stage has applied it (awaitOuter).
func (j *jobRun) outerStep(ctx context.Context, s int) error {
	// The delayed outer step before it is taken up first (the last, or one whose take-up is this
	// step's): a stage takes one outer step at a time.
	if err := j.commitDelayed(ctx); err != nil {
		return err
	}
	if j.spec.OuterTakeUpAfter(s) == s {
		if err := j.awaitOuter(ctx, s); err != nil {
			return err
		}
	} else {
		j.askedDelayed(s) // committed once every stage holds it (round.go)
		for r := range j.reps {
			if err := j.outerSync(s, r, 0); err != nil {
				return err
			}
		}
	}
	j.recordOuterStep(s)
	return nil
}

// awaitOuter sees the outer step after step s, asked without a delay, through its two phases
// (proto.OuterSync): it waits until every stage of the participants holds the average
// (proto.OuterDone), then commits it (proto.OuterCommit). A replica lost before that — the rule
// book decides, in sched.PhaseExchange — is dropped and left out of the step, which is asked
// again of the others (the next attempt): no restore. Its step s counts, as it was recorded; the
// plan's status says it was left out of the outer step after it (DroppedReplica.LeftOut), so
// that a replay takes the same step. A stage that fails for any other reason, or stays silent
// past the step deadline, fails the outer step: the job replans.
func (j *jobRun) awaitOuter(ctx context.Context, s int) error {
	attempt := 0
	restore := j.enterFor(phaseExchange)
	defer func() { restore(); j.hastenWaited() }()
	j.hastenWaited()
	held := map[string]bool{}
	j.askOuter()
	deadline := time.Duration(j.spec.StepDeadlineMaxS * float64(time.Second))
	due := time.Now().Add(deadline) // each attempt has the whole of it
	// ask asks every replica for the attempt, and redo drops the replica d left and asks the
	// others for the next: a send may find a worker gone before the hub's event says so
	// (sendFailed), and the rule book answers either alike. Every replica is asked the attempt
	// before a redo asks the next: a stage asked for attempt 1 of a step it took no attempt of
	// refuses it (client: StageRunner.OuterStep), which restored every shard — the redo came
	// between two replicas' asks when a worker's departure was found by the send (make churn,
	// 2026-12-05: "asked again (attempt 1), but this stage took no attempt of it").
	var redo func(d *replicaLeft) error
	ask := func() error {
		var left *replicaLeft
		for r := range j.reps {
			err := j.outerSync(s, r, attempt)
			if d, ok := errors.AsType[*replicaLeft](err); ok && !d.reshare {
				// Another departure found so is heard again as its hub event, and redone then.
				left = cmp.Or(left, d)
			} else if err != nil {
				return err
			}
		}
		if left != nil {
			return redo(left)
		}
		return nil
	}
	redo = func(d *replicaLeft) error {
		p := j.replicaPos(d.index)
		if p < 0 {
			return nil // already dropped
		}
		j.dropReplica(p, d, s+1, true)
		j.reassignOuter()
		attempt++
		j.dropped[len(j.dropped)-1].leftOutAt = attempt
		clear(held)
		due = time.Now().Add(deadline)
		j.s.event(j.rec.ID, "outer.redo", d.worker, map[string]any{"step": s, "attempt": attempt, "participants": j.outerParticipants()})
		return ask()
	}
	if err := ask(); err != nil {
		return err
	}
	for {
		parts := j.participants()
		if !slices.ContainsFunc(parts, func(p string) bool { return !held[p] }) {
			break
		}
		timer := time.NewTimer(time.Until(due))
		ev, late, err := j.awaitEvent(ctx, timer.C)
		timer.Stop()
		if d, ok := errors.AsType[*replicaLeft](err); ok && !d.reshare {
			if err := redo(d); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		if late {
			for _, p := range parts {
				if !held[p] {
					j.s.event(j.rec.ID, "worker.deadline", p, map[string]any{"step": s, "outer": true})
					j.s.hub.Drop(p, fmt.Errorf("no answer to the outer step after step %d within its deadline", s))
				}
			}
			return fmt.Errorf("%w: the outer step after step %d missed its deadline", errStep, s)
		}
		if ev.Kind != EventMessage || !slices.Contains(parts, ev.Worker) {
			continue
		}
		switch m := ev.Msg.(type) {
		case *proto.OuterDone:
			if m.Step == uint64(s) && m.PlanVersion == j.version && m.Attempt == attempt {
				held[ev.Worker] = true
				j.outerAveraged[ev.Worker] = m.Averaged
			}
		case *proto.Error:
			if m.Step == nil || *m.Step != uint64(s) || m.PlanVersion != j.version {
				continue
			}
			l, err := j.outerFailure(ev.Worker, m, s, "outer step")
			if err != nil {
				return err
			}
			if l != nil && j.suspect == nil {
				l.by = "" // the job loop's own wait: awaitEvent returns its error as it stands
				j.suspect = l
			}
		}
	}
	j.suspect = nil
	if err := j.recordSegments(ctx, s, attempt); err != nil {
		return err
	}
	c := &proto.OuterCommit{Step: uint64(s), PlanVersion: j.version, Attempt: attempt}
	for _, p := range j.participants() {
		if err := j.s.hub.Send(p, c); err != nil {
			return fmt.Errorf("%w: outer commit to %s: %v", errReplan, p, err)
		}
	}
	return nil
}

// outerSync asks the stages of the replica at position r for attempt attempt of the outer step
// after step s, every replica of the plan taking part (outerParticipants).
func (j *jobRun) outerSync(s, r, attempt int) error {
	m := &proto.OuterSync{Step: uint64(s), PlanVersion: j.version, Participants: j.outerParticipants(), Attempt: attempt}
	if !slices.Equal(j.outerOwners, m.Participants) {
		m.Owners = j.outerOwners
		for _, q := range j.outerFirst {
			if !slices.Contains(m.Participants, q) {
				m.Lost = append(m.Lost, q)
			}
		}
	}
	rr := j.reps[r]
	for _, p := range j.participants()[rr.lo:rr.hi] {
		if err := j.s.hub.Send(p, m); err != nil {
			return j.sendFailed(p, "outer step to", err)
		}
	}
	return nil
}

// askOuter starts an outer step: its segments are its participants', one each.
func (j *jobRun) askOuter() {
	j.outerFirst = j.outerParticipants()
	j.outerOwners = model.OuterOwners(j.outerFirst)
	j.outerAveraged = map[string][]proto.SegmentAveraged{}
}

// reassignOuter gives the segments of the outer step's owners that are no longer participants
// (a replica dropped during its exchange) to those that are (model.OuterReassign).
func (j *jobRun) reassignOuter() {
	parts := j.outerParticipants()
	j.outerOwners = model.OuterReassign(j.outerOwners, func(q int) bool { return slices.Contains(parts, q) })
}

// recordSegments checks what the participants' stages said they averaged of the outer step
// after step s, whose last attempt is attempt (proto.OuterDone.Averaged): each stage the
// segments its replica owns, every one of them, each at an attempt up to the last. When the
// exchange lost replicas it records, in their dropped records, the segments averaged before the
// last attempt — over participants that still had them — for a replay (local.Period.Segments).
func (j *jobRun) recordSegments(ctx context.Context, s, attempt int) error {
	if len(j.outerFirst) < 2 {
		return nil // alone: nothing was exchanged (the stage took the step at once)
	}
	var segs []local.SegmentAt
	for _, st := range j.stages {
		var want []int
		for k, q := range j.outerOwners {
			if q == st.replica {
				want = append(want, k)
			}
		}
		got := j.outerAveraged[st.peer]
		if len(got) != len(want) || slices.ContainsFunc(got, func(a proto.SegmentAveraged) bool { return !slices.Contains(want, a.Segment) || a.Attempt > attempt }) {
			// An honest stage says exactly what it averaged: this one's record would make a
			// replay take another step than the run. It is banned (what it sent was checked
			// as it crossed, and nothing of the step is applied), and the job replans.
			err := fmt.Errorf("it said it averaged segments %v of the outer step after step %d, its replica owns %v (attempt %d)", got, s, want, attempt)
			j.s.event(j.rec.ID, "outer.averaged", st.peer, map[string]any{"step": s, "attempt": attempt, "averaged": got, "owns": want})
			j.banOuter(ctx, st.peer, err.Error())
			return fmt.Errorf("%w: %s: %v", errReplan, st.peer, err)
		}
		for _, a := range got {
			if a.Attempt < attempt {
				segs = append(segs, local.SegmentAt{Segment: a.Segment, Blocks: [2]int{st.begin, st.end}, Attempt: a.Attempt})
			}
		}
	}
	if len(segs) == 0 {
		return nil
	}
	slices.SortFunc(segs, func(a, b local.SegmentAt) int { return cmp.Or(a.Segment-b.Segment, a.Blocks[0]-b.Blocks[0]) })
	for i := range j.dropped {
		if d := &j.dropped[i]; d.leftOutAt > 0 && (d.leftOut && d.step == s+1 || d.leftOutOf == s || d.ghostOf == s) {
			d.segments = segs
		}
	}
	// The plan's record changed: published again, as a drop's is (dropReplica).
	j.publish()
	if j.s.cfg.OnPlan != nil {
		j.s.cfg.OnPlan(*j.s.status.Load().Plan)
	}
	return nil
}

// recordOuterStep records the outer step after step s as an event, with its participants.
func (j *jobRun) recordOuterStep(s int) {
	if j.outerFed == nil {
		j.outerFed = map[string]int{}
	}
	for _, st := range j.stages {
		j.outerFed[st.peer] = s
	}
	j.s.event(j.rec.ID, "outer.step", "", map[string]any{"step": s, "participants": j.outerParticipants(), "owners": j.outerOwners})
}

// outerParticipants are the indices of the active plan's replicas, ascending: the replicas of an
// outer step (a dropped one is not among them).
func (j *jobRun) outerParticipants() []int {
	parts := make([]int, len(j.reps))
	for r, rr := range j.reps {
		parts[r] = rr.index
	}
	return parts
}
