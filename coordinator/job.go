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
	"sort"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// errReplan abandons the current plan: a worker left or failed, a step missed its deadline. The
// job loop replans with the workers it has and every shard restarts from the newest complete
// checkpoint, replaying the steps since (docs/design.md, "Faults").
var errReplan = errors.New("replan")

// exactKernels reports whether p computes with the coordinator's own kernel family, so that a
// recomputation of its work is bit for bit (and its audit evidence may be lean). It rests on the
// kernels p said it has (Hello.Kernels): one that misreports them fails its audits.
func (p *peer) exactKernels() bool {
	return p.hello != nil && p.hello.Kernels != "" && p.hello.Kernels == kernelFamily()
}

// peer is a connected worker as the job loop sees it.
type peer struct {
	id    string
	hello *proto.Hello
	addr  string // its remote address as the hub groups them (Event.Addr)
	ready uint32 // plan version it reported Ready for
	// readyState is the state digest its Ready carried: for a shard kept from the last plan
	// (proto.Keep) in a job that audits, its commitment to the state it kept.
	readyState string
	// readyGave is, in outer mode, the digest its Ready named of the state it handed its takers
	// (proto.Ready.Gave), which each taker's readyState must equal.
	readyGave string
	// readySums are the value hashes of the tensors of the state it gave from (proto.Ready.Sums),
	// from which a taker's state is composed when it takes blocks from several givers.
	readySums []proto.KeyDigest
	// noMemory: it refused a shard for lack of memory (proto.ErrCodeMemory); plans leave it out
	// until it reconnects, so that a pinned plan it cannot hold is not assigned to it again and
	// again.
	noMemory bool
}

// placement is one stage of the active plan: blocks [begin, end) of pipeline replica replica,
// which computes micro-batches [first, first+n) of every step (all of them, [0, M), in a plan
// of one pipeline).
type placement struct {
	peer       string
	begin, end int
	replica    int
	first, n   int
}

// replicaRun is one pipeline replica of the active plan: stages [lo, hi) of jobRun.stages, which
// compute micro-batches [first, first+n) of every step. index is the replica's index in the plan
// (placement.replica): its data seed with own batches and its place in an outer step. It equals
// the replica's position in jobRun.reps until a replica is dropped (sched.DropReplica), after
// which the others keep theirs.
type replicaRun struct{ lo, hi, first, n, index int }

// replicaRuns groups a plan's stages, which come replica by replica, into its replicas.
func replicaRuns(stages []placement) []replicaRun {
	var out []replicaRun
	for i, st := range stages {
		if i == 0 || st.replica != stages[i-1].replica {
			out = append(out, replicaRun{lo: i, first: st.first, n: st.n, index: st.replica})
		}
		out[len(out)-1].hi = i + 1
	}
	return out
}

// hostPlacement is one expert host of the active plan: experts of one MoE block.
type hostPlacement struct {
	peer    string
	block   int
	experts []int // sorted
}

// jobRun is the state of the running job. Only the job loop's goroutine touches it.
type jobRun struct {
	s   *Server
	rec storage.Job
	// spec is what the current plan runs by: the job's spec (full), or during an outer-mode job's
	// synchronous warm-up its step-mode phase (job.Spec.Phase, enterPhase).
	spec job.Spec
	full job.Spec
	// warmOut: the plan being established is outer mode's first, at the warm-up's end, from the
	// plan the warm-up ended under (keepAt): its stages keep the warm-up's state.
	warmOut bool
	// growSoon: a growth waits for a delayed outer step's take-up (growth.later): the round ends
	// right after it, and the standbys are weighed again there.
	growSoon bool
	sync     syncRule // how the replicas agree on a step, from spec (drive.go)
	corpus   *data.Corpus
	vx, vy   []int32
	peers    map[string]*peer
	// phase is where the job loop is with its plan (phase.go), for itself, the rule book
	// (sched.Decide, through jobPhase.rule) and the status page.
	phase   jobPhase
	version uint32          // the active plan's version; 0 while none runs (phase.planned)
	depth   int             // the active plan's pipeline depth (planDepth)
	stages  []placement     // of the active plan, replica after replica
	reps    []replicaRun    // the active plan's pipeline replicas: one unless the plan has several
	hosts   []hostPlacement // expert hosts of the active plan
	standby []string
	step    int // next step to run = steps completed
	// restored maps complete checkpoint ids to their assembled whole-model blob.
	restored map[int64]string
	// planRestore are the checkpoint's shard blobs the active plan's workers restore from (none
	// for the seed): kept while the plan runs, whatever retention does to its checkpoint
	// meanwhile, since workers may still be fetching them and custody reads them for the digests
	// it checks.
	planRestore []string
	// blobNames are the tensors each checkpoint shard blob holds, by sha256, as its header says:
	// what restoreFor picks a stage's shards by. A blob's name is its content, so an entry never
	// goes stale; the map is cleared with each plan's restore point.
	blobNames map[string][]string
	// blobHolders are, for each tensor name, the blobs of the restore point that hold it, in the
	// checkpoint's order.
	blobHolders map[string][]string
	history     []StepStatus

	lastReport     local.Report
	lastCheckpoint time.Time
	// ckCost is what a checkpoint has taken from its request until its last shard landed (a
	// moving average): the cost the churn's checkpoint interval weighs (churnCheckpointDue).
	ckCost    time.Duration
	state     string          // for the status page
	waiting   string          // why the job waits for workers, "" when it does not (waiting.go)
	stepTimes []time.Duration // recent step durations, for the deadline and a round's length
	// roundMax is the most steps a round of the job has spanned: replicas run at most that far
	// apart (outeraudit.go keeps each outer step's commitments as long).
	roundMax  int
	routed    map[int][]int           // the last step's tokens per expert, by MoE block
	placement []sched.ExpertPlacement // the planner's expert placement, replica order kept
	// planChoice says why the plan is, or is not, replicated (chooseReplicas); "" for pinned
	// plans and where the question did not arise.
	planChoice string
	planFrom   int    // the first step of the active plan: the step its shards restored to (or kept at)
	keptFrom   uint32 // the plan whose shards the active one kept (reshare.go); 0 when restored
	// tookFrom are the active plan's takers and their givers (grow.go); nil when none.
	tookFrom map[string][]sched.Part
	// replicaAt is, during a round of free-running replicas (round.go), the step each replica's
	// stages compute or last computed; nil otherwise.
	replicaAt    []int
	ckRequested  int                  // the step of the last checkpoint requested, under plan ckVersion
	ckHolders    *ckHolders           // the workers asked for that checkpoint's shards (shardStates)
	ckAgain      int                  // a checkpoint due after this many steps that a departure cut short: asked again after the reshare (0: none)
	keepAt       keepPoint            // the plan just left at a checkpointed boundary, whose stages the next may keep
	suspect      *linkSuspect         // a reported link failure waiting for its peer's departure; nil for none
	churn        churnLog             // departures and restores seen, for the planner (churn.go)
	keepRef      *proto.CheckpointRef // the checkpoint the shards kept by the active plan's boundary replan hold; nil after a reshare
	keepUploaded map[string]bool      // the workers whose kept shard uploaded its part of keepRef themselves
	leaving      map[string]bool      // workers that asked to leave (proto.Leaving), let go at the next step boundary
	released     map[string]bool      // workers let go (drain): a Leaving from one of them is abuse
	counts       map[string]peerCount // per peer, for the status page
	// refillDue: a reshare left workers standing by — the dropped replica's, or standbys from
	// before — which a plan taking their stages' state from twins may place (joinPending).
	refillDue bool
	// rerouted is the step's reroutes (reroute.go), from the first until the boundary's reshare.
	rerouted *stepReroutes
	// lostAtLoad is, in step mode, the replicas of the plan loading whose workers left meanwhile,
	// by index (sched.Reroute while loading): the others load on, and the first step reroutes
	// their micro-batches (reroute.go). loadReroutes says whether this plan may (no stage takes
	// its state from another worker, which a departed giver would leave without one).
	lostAtLoad   map[int]*replicaLeft
	loadReroutes bool
	// outerFed is, in outer mode, the last step after which each worker's replica took part in an
	// outer step; outerLeft the same for the workers of replicas the rule book dropped, until
	// they hold a stage again. A dropped replica's steps after that outer step reached no global
	// θ: audits of only such steps that its worker abandons roll nothing back (abandon).
	outerFed, outerLeft map[string]int
	hold                jobHold // the admin's: running, paused or cancelled
	ckVersion           uint32
	started             time.Time
	firstStep           int
	// speeds is what the coordinator measured of each peer's speed (measure.go), and planSteps
	// the steps run under the active plan.
	speeds    map[string]*speed
	planSteps int
	// pace is what was measured of the active plan's replicas' paces, for shares that follow
	// them (rebalance.go).
	pace        paceTrack
	rebalanceTo *sched.Rebalance // the shares replanReason chose, for the loop to take up
	// growWait is an outer-mode grow that waits for what it adds to repay the stall of its
	// handovers (sched.GrowDeferral; joinPending); lastStepSeconds the last step's time, from
	// which a round's is estimated.
	growWait        sched.GrowDeferral
	lastStepSeconds float64
	// remeasure is set when measurement flagged a participant: replan at the next boundary.
	remeasure bool
	// lastJoinReplan is when workers that joined last got a plan, to space such replans out.
	lastJoinReplan time.Time
	// audits is the job's verification (audit.go); nil when it does not audit.
	audits *auditor
	// outerPlans are the recent plans' replicas and the outer-step refusals made under them,
	// outerBanned the workers banned for a refused contribution, outerRefused the plan of each
	// unproved refusal of one worker's contribution by another (accuser, accused), and
	// outerDisputed the workers that outer plans leave out for a dispute (outervote.go).
	outerPlans    map[uint32]*outerPlan
	outerBanned   map[string]bool
	outerRefused  map[[2]string]uint32
	outerDisputed map[string]bool
	// dropped are the replicas of the active plan dropped since it was made (sched.DropReplica),
	// in the order they were.
	dropped []droppedReplica
	// leftInEval is a step-mode departure heard during the evaluation after the step being
	// recorded, which every survivor applied: the survivors reshare from the next (evaluate).
	leftInEval *replicaLeft
	// delayed is the delayed outer step asked of every replica and not yet committed (round.go,
	// "delayed outer steps"); nil when none.
	delayed *delayedOuter
	// outerOwners are the owners of the segments of the outer step last asked
	// (proto.OuterSync.Owners): its first attempt's participants, a lost owner's segments
	// reassigned at each redo (model.OuterReassign), so that what crossed stands.
	// outerAveraged are, by worker, the segments its stage averaged and at which attempt
	// (proto.OuterDone.Averaged), as its last OuterDone of the step said.
	outerFirst    []int // the first attempt's participants
	outerOwners   []int
	outerAveraged map[string][]proto.SegmentAveraged
	// atBarrier: outer mode, a replica has finished the round under way and waits for the others
	// (drive.go, train); the round's workers are hastened meanwhile (hastenWaited).
	atBarrier bool
	// leftOutCarried are the replicas an earlier plan left out of the outer step after step
	// planFrom−1 (dropped during its exchange): the active plan, beginning at the step after it,
	// records them (PlanStatus.LeftOut), since a replay takes its record for theirs.
	leftOutCarried []int
	// leftOutCarriedAt are the attempts that left them out, and leftOutSegments the outer step's
	// segments averaged at an earlier attempt than its last (droppedReplica.leftOutAt, segments).
	leftOutCarriedAt []int
	leftOutSegments  []local.SegmentAt
	// leftOutCarriedOf is the step of the delayed outer step they were left out of
	// (PlanStatus.LeftOutOf), -1 when it is the one after planFrom−1.
	leftOutCarriedOf int
	// bannedIDs are the identities banned from the job (identity.go).
	bannedIDs map[string]bool
}

// droppedReplica is a replica of the active plan dropped at once when a worker of it left
// (sched.DropReplica): its index, its stages' blocks and micro-batches, and step, the first step
// recorded without it — from which the replay leaves it out (PlanStatus.Period).
type droppedReplica struct {
	index, step int
	stages      [][2]int
	first, n    int
	// leftOut: lost during the exchange of the outer step after step−1, and left out of it.
	leftOut bool
	// leftOutOf: lost during the exchange of the delayed outer step after step leftOutOf, before
	// its commit, and left out of it; -1 when none.
	leftOutOf int
	// leftOutAt is the attempt of that outer step that left it out (leftOut or leftOutOf), and
	// segments are the step's segments averaged at an earlier attempt than its last, once it
	// is committed (outerSegments): what a replay needs to average each segment as it was.
	leftOutAt int
	segments  []local.SegmentAt
	// ghostOf: a participant of the delayed outer step after step ghostOf, as it was asked, that
	// left before it finished its step — it owned segments of the step's exchange but gave
	// nothing (local.Ghost); -1 when none.
	ghostOf int
	// refilled: staffed by the plan (a refill, grow.go) and dropped before any step of it
	// counted — while it got ready (its takers' giver left: dropAtLoad), or during the plan's
	// first step.
	refilled bool
}

// replicaLeft is what handle returns when the rule book drops a replica of a round in flight: the
// round's driver (train) drops it, with what it holds of the round.
type replicaLeft struct {
	worker string
	index  int // the replica's index in the plan
	why    string
	// reshare: step mode (sched.Reshare) — the job loop reshares (reshare.go) rather than a
	// round's driver dropping the replica.
	reshare bool
	// reroute: step mode during a step (sched.Reroute, reshare set too): the step's driver may
	// reroute it (reroute.go); anywhere else it reshares.
	reroute bool
	// kernels is the departed worker's kernel family (proto.Hello.Kernels), "" when unknown: a
	// stage takeover needs its taker to compute the same bits (takeover.go).
	kernels string
}

func (e *replicaLeft) Error() string {
	return fmt.Sprintf("worker %s left: replica %d dropped", e.worker, e.index)
}

// Unwrap makes a drop that reaches anything but a round's driver a replan, as any departure was.
func (e *replicaLeft) Unwrap() error { return errReplan }

// errCancelled ends a job the admin cancelled.
var errCancelled = errors.New("job cancelled")

// errStopped ends the job loop of a coordinator that stops (Server.Stop): the job stays running
// in the store, for the next coordinator to resume.
var errStopped = errors.New("coordinator stopping")

// Run is the job loop: it owns the jobs' state machines and consumes the hub's events. It runs the
// stored jobs one at a time — a running or paused one first, then the queued ones, oldest first —
// and returns when the job it ran is done, unless Config.KeepServing, in which case it goes on to
// the next job and waits for submissions; it returns early when ctx ends or on an error that
// stops it.
func (s *Server) Run(ctx context.Context) error {
	pctx, stopPruning := context.WithCancel(ctx)
	pruned := make(chan struct{})
	go func() { defer close(pruned); s.pruneWorkers(pctx) }()
	defer func() { stopPruning(); <-pruned }()
	peers := map[string]*peer{} // connected workers, carried from job to job
	for {
		rec, spec, err := s.pickJob(ctx)
		if err != nil {
			return err
		}
		if rec == nil {
			if err := s.idle(ctx, peers); errors.Is(err, errStopped) {
				return nil
			} else if err != nil {
				return err
			}
			continue
		}
		err = s.runJob(ctx, rec, spec, peers)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, errStopped):
			return nil
		case errors.Is(err, errCancelled):
			continue
		case err != nil && !s.cfg.KeepServing:
			return err
		case err != nil:
			s.log.Error("job stopped", "job", rec.ID, "err", err)
			s.db.SetJobState(context.WithoutCancel(ctx), rec.ID, storage.JobFailed, err.Error())
			s.event(rec.ID, "job.failed", "", map[string]any{"error": err.Error()})
		case !s.cfg.KeepServing:
			return nil
		}
	}
}

// idle keeps the peer table while no job runs, until a job is submitted.
func (s *Server) idle(ctx context.Context, peers map[string]*peer) error {
	// The status keeps showing the last job (done, cancelled) until the next one starts.
	s.log.Info("no job to run: waiting for one (POST /api/jobs, or shoal serve --job FILE)")
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.stopping:
			return errStopped
		case <-s.submitted:
			return nil
		case c := <-s.commands:
			c.done <- errors.New("no job is running")
		case ev := <-s.hub.Events():
			switch ev.Kind {
			case EventJoined:
				peers[ev.Worker] = &peer{id: ev.Worker, hello: ev.Hello, addr: ev.Addr}
				s.remember(peers[ev.Worker])
				row := workerRow(ev.Worker, ev.Hello, storage.WorkerIdle)
				s.rec.record("worker "+ev.Worker+" joined", func(tx *storage.Tx) error {
					_, err := tx.UpsertWorker(context.Background(), row)
					return err
				})
			case EventLeft:
				delete(peers, ev.Worker)
				id := ev.Worker
				s.rec.record("worker "+id+" left", func(tx *storage.Tx) error {
					return tx.SetWorkerState(context.Background(), id, storage.WorkerGone)
				})
			case EventMessage:
				if _, ok := ev.Msg.(*proto.Leaving); ok {
					s.hub.Send(ev.Worker, &proto.Bye{Reason: proto.ByeDrain}) // nothing to hand over
				}
			}
		}
	}
}

// runJob runs one job to its end (nil), cancellation (errCancelled) or failure.
func (s *Server) runJob(ctx context.Context, rec *storage.Job, spec job.Spec, peers map[string]*peer) error {
	// The job's worker rows and events are written when it ends, whatever it ends with.
	defer s.rec.flush(context.WithoutCancel(ctx))
	corpus, err := data.Load(spec.Data, spec.DataExtensions)
	if err != nil {
		return err
	}
	if mt := corpus.MaxToken(); mt >= spec.Model.VocabSize {
		return fmt.Errorf("%s has token %d, outside the model's vocab_size %d", corpus.Source, mt, spec.Model.VocabSize)
	}
	vx, vy, err := corpus.Validation(spec.Model.BlockSize)
	if err != nil {
		return err
	}
	for _, p := range peers {
		p.ready = 0
	}
	j := &jobRun{s: s, rec: *rec, spec: spec.Phase(int(rec.Step)), full: spec, sync: newSyncRule(spec.Phase(int(rec.Step))), corpus: corpus, vx: vx, vy: vy, peers: peers,
		restored: map[int64]string{}, started: time.Now(), firstStep: -1, lastCheckpoint: time.Now(), state: "running",
		counts: map[string]peerCount{}, step: int(rec.Step),
		speeds: map[string]*speed{}}
	if rec.State == storage.JobPaused {
		j.hold, j.state = holdPaused, "paused"
	}
	// The workers already here when the job starts: their sessions count towards the departure
	// rate from now, and their departures close them (churnLog).
	for id := range peers {
		j.churn.join(id, j.started)
	}
	if spec.AuditRate > 0 {
		if s.cfg.Recompute == nil {
			s.log.Warn("the job asks for audits, but this coordinator has no recomputer: its work goes unverified", "audit_rate", spec.AuditRate)
		} else {
			j.audits = newAuditor()
			bans, err := s.db.Bans(ctx, rec.ID)
			if err != nil {
				return err
			}
			for _, b := range bans {
				j.audits.banned[b.Worker] = true
			}
		}
	}
	if err := j.loadBans(ctx); err != nil {
		return err
	}
	// From now on the hub refuses joins without the job's token before anything is recorded;
	// the workers already connected are sorted out here.
	s.joinToken.Store(&rec.JoinToken)
	defer s.joinToken.Store(nil)
	defer s.bans.setJob(nil)
	// A private job keeps only the peers that hold its join token; no job keeps those it banned.
	for id, p := range peers {
		if j.isBanned(id, p.hello) {
			s.hub.Drop(id, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job"})
			delete(peers, id)
			continue
		}
		if !j.admits(p.hello) {
			s.hub.Drop(id, &proto.Error{Code: proto.ErrCodeForbidden, Message: "this job is private: join with its link"})
			delete(peers, id)
		}
	}
	s.log.Info("job", "id", rec.ID, "steps", spec.Steps, "corpus", corpus.Source, "tokens", corpus.Len(), "private", rec.JoinToken != "")
	if rec.State == storage.JobQueued {
		if _, err := s.db.SetJobState(ctx, rec.ID, storage.JobRunning, ""); err != nil {
			return err
		}
	}
	j.publish()
	err = j.run(ctx)
	for w := range j.leaving { // asked to leave as the job ended: nothing more to hand over
		s.hub.Send(w, &proto.Bye{Reason: proto.ByeDrain})
	}
	j.s.slots.forget(func(sl uploadSlot) bool { return sl.Job == rec.ID })
	if err == nil {
		_, err = s.db.SetJobState(context.WithoutCancel(ctx), rec.ID, storage.JobDone, "")
		s.event(j.rec.ID, "job.done", "", map[string]any{"steps": spec.Steps})
		j.state = "done"
	} else if errors.Is(err, errCancelled) {
		j.state = "cancelled"
	} else if ctx.Err() == nil {
		j.state = "stopped: " + err.Error()
	}
	j.publish()
	return err
}

// isBanned reports whether an audit, or replicas refusing its outer-step contributions, banned
// worker id, or the identity of its hello h, from the job.
func (j *jobRun) isBanned(id string, h *proto.Hello) bool {
	return (j.audits != nil && j.audits.banned[id]) || j.outerBanned[id] || h != nil && j.bannedIDs[proto.Fingerprint(h.SigningKey)]
}

// admits reports whether a worker may take part: any worker in a public job, only those holding
// the join token in a private one (compared in constant time).
func (j *jobRun) admits(h *proto.Hello) bool {
	return j.rec.JoinToken == "" || h != nil && joinMatches(h.JoinToken, j.rec.JoinToken)
}

// pickJob resumes a running or queued job, or submits cfg.Job.
func (s *Server) pickJob(ctx context.Context) (*storage.Job, job.Spec, error) {
	jobs, err := s.db.ListJobs(ctx, storage.JobRunning, storage.JobPaused, storage.JobQueued)
	if err != nil {
		return nil, job.Spec{}, err
	}
	sort.Slice(jobs, func(a, b int) bool { return jobs[a].CreatedAt.Before(jobs[b].CreatedAt) })
	for _, st := range []storage.JobState{storage.JobRunning, storage.JobPaused, storage.JobQueued} {
		for _, jb := range jobs {
			if jb.State == st {
				spec, err := job.Parse(jb.Spec)
				if err != nil {
					return nil, job.Spec{}, fmt.Errorf("stored job %s: %w", jb.ID, err)
				}
				return &jb, spec, nil
			}
		}
	}
	// --job submits its job once: not again after it is done, when the coordinator restarts.
	if all, err := s.db.ListJobs(ctx); s.cfg.Job == nil || err != nil || len(all) > 0 {
		return nil, job.Spec{}, err
	}
	b, err := json.Marshal(s.cfg.Job)
	if err != nil {
		return nil, job.Spec{}, err
	}
	jb, err := s.db.CreateJob(ctx, b)
	if err != nil {
		return nil, job.Spec{}, err
	}
	s.event(jb.ID, "job.submitted", "", nil)
	return &jb, *s.cfg.Job, nil
}

// maxStepFailures is how many times one step may fail (not counting lost workers) before the job
// is paused.
const maxStepFailures = 3

func (j *jobRun) run(ctx context.Context) error {
	failedStep, failures := -1, 0
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if j.s.isStopping() {
			return j.stopAtBoundary(ctx)
		}
		if !j.phase.planned() {
			if err := j.establish(ctx); err != nil {
				if errors.Is(err, errReplan) {
					// Whatever the plan got to, its workers are assigned shards it may no longer
					// staff: the next plan starts over from the newest complete checkpoint.
					if j.phase.planned() {
						j.leave(true)
					}
					j.s.log.Warn("plan failed; planning again", "err", err)
					j.s.event(j.rec.ID, "plan.failed", "", map[string]any{"error": err.Error()})
					continue
				}
				// A served job waits for workers that fit; shoal train --workers has all it will
				// ever have, and fails with the planner's reason.
				if errors.Is(err, sched.ErrNoPlan) && j.s.cfg.KeepServing {
					if err := j.awaitJoin(ctx, err); err != nil {
						return err
					}
					continue
				}
				return err
			}
		}
		if j.step >= j.spec.Steps {
			err := j.finish(ctx)
			if errors.Is(err, errRollback) {
				// An audit of the last steps failed, or was abandoned: the job rolled back and
				// goes on.
				j.leave(true)
				continue
			}
			return err
		}
		if err := j.commands(ctx); err != nil {
			return err
		}
		if j.hold == holdCancelled {
			return errCancelled
		}
		if err := j.letGo(ctx); err != nil {
			return err
		}
		if !j.phase.planned() {
			continue
		}
		// Moving experts after the load drifted, or taking in workers that joined, happens at this
		// step boundary from a checkpoint of this very step, so nothing is replayed — or, for
		// joiners who can take their stages' state from the workers holding it, without one. Shares
		// that follow the replicas' pace move at a boundary too, every state kept (rebalance.go).
		reason, g := j.replanReason(ctx)
		var err error
		switch {
		case reason == "rebalance":
			err = j.rebalance(ctx, j.rebalanceTo)
			j.rebalanceTo = nil
		case reason != "" && g == nil:
			err = j.checkpointNow(ctx)
			if resharing(err) != nil {
				// A step-mode replica lost while the checkpoint was taken: the others reshare
				// (below) rather than replan from an older checkpoint; the replan is weighed
				// again at the next boundary.
				break
			}
			if err != nil && !errors.Is(err, errReplan) {
				return err
			} else if err == nil {
				j.s.log.Info("replanning at a step boundary", "reason", reason, "step", j.step)
				j.s.event(j.rec.ID, "replan."+reason, "", map[string]any{"step": j.step})
				j.leaveAtCheckpoint()
			}
			j.leave(false)
			continue
		case g != nil:
			err = j.grow(ctx, g)
		default:
			err = j.train(ctx) // advances j.step past every step it completes
		}
		// A departure while the survivors get ready reshares again (adopt).
		for d := resharing(err); d != nil; d = resharing(err) {
			err = j.reshare(ctx, d)
		}
		switch {
		case err == nil:
			j.churn.reached(j.step, time.Now())
		case errors.Is(err, errReplan) || errors.Is(err, errStep):
			j.churn.failed(j.step, time.Now(), len(j.participants()))
			j.s.log.Warn("step abandoned; replanning from the newest complete checkpoint", "step", j.step, "err", err)
			j.s.event(j.rec.ID, "step.abandoned", "", map[string]any{"step": j.step, "error": err.Error()})
			j.s.metrics.recovery()
			j.leave(true)
			// A step that fails again and again after replays (a diverged model, a shard that
			// cannot run) would loop forever: pause the job for an admin instead.
			if errors.Is(err, errStep) {
				if j.step == failedStep {
					failures++
				} else {
					failedStep, failures = j.step, 1
				}
				if failures >= maxStepFailures {
					reason := fmt.Sprintf("step %d failed %d times: %v", j.step, failures, err)
					j.s.db.SetJobState(context.WithoutCancel(ctx), j.rec.ID, storage.JobPaused, reason)
					j.s.event(j.rec.ID, "job.paused", "", map[string]any{"reason": reason})
					return fmt.Errorf("job paused: %s", reason)
				}
			}
		default:
			return err
		}
	}
}

// stopAtBoundary ends the job loop of a stopping coordinator at this step boundary: a
// checkpoint of this very step first, when a plan runs (bounded by the step deadline, and by
// ctx, which the caller cancels when it will wait no longer), so that the next coordinator
// resumes here rather than at the last periodic checkpoint.
func (j *jobRun) stopAtBoundary(ctx context.Context) error {
	if j.phase.planned() && j.step < j.spec.Steps {
		if err := j.checkpointNow(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			j.s.log.Warn("stopping without a checkpoint of this step: a restart resumes from the newest", "step", j.step, "err", err)
		} else {
			j.s.log.Info("stopping: checkpoint of this step taken", "step", j.step)
		}
	}
	j.s.event(j.rec.ID, "coordinator.stopped", "", map[string]any{"step": j.step})
	return errStopped
}

// finish waits for the final checkpoint to complete (so that its assembled file exists) and ends.
func (j *jobRun) finish(ctx context.Context) error {
	wait := max(2*time.Minute, j.checkpointWait())
	deadline := time.After(wait)
	for {
		ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
		if err == nil && int(ck.Step) == j.spec.Steps {
			if err := j.finishAudits(ctx); err != nil {
				return err
			}
			if _, err := j.assembled(ctx, ck); err != nil {
				return err
			}
			return nil
		}
		woke, _, err := j.await(ctx, listen{deadline: deadline, idle: true})
		if err != nil {
			return err
		}
		if woke == wokeDeadline {
			return fmt.Errorf("the final checkpoint did not complete within %v", wait.Round(time.Second))
		}
	}
}

// establish makes a plan from the connected workers, assigns it, restores every shard from the
// newest complete checkpoint (or the seed) and waits until every stage is Ready.
func (j *jobRun) establish(ctx context.Context) error {
	// MinWorkers gathers the workers that start together into the first plan; later plans take
	// whoever is left.
	need := 1
	if j.firstStep < 0 {
		need = j.s.cfg.MinWorkers
	}
	if p := j.spec.Plan; p != nil {
		hosts := map[int]bool{}
		for _, es := range p.Experts {
			hosts[es.Host] = true
		}
		need = max(need, len(p.Stages)+len(hosts))
		// Replicas: all of them to start with; after a loss, as many as the workers left can
		// staff (plan), at least the first.
		if rs := j.spec.PinnedReplicas(); len(p.Replicas) > 0 {
			n := len(rs[0].Stages) + pinnedHostCount(p.Experts)
			if j.firstStep < 0 {
				n = pinnedHostCount(p.Experts)
				for _, r := range rs {
					n += len(r.Stages)
				}
			}
			need = max(need, n)
		}
	}
	need = max(need, 1)
	j.refillDue = false
	// The plan runs from the newest complete checkpoint, and by the spec of the phase it starts
	// in: the warm-up's step mode before its end, outer mode from there on.
	warmOut, err := j.enterPhase(ctx)
	if err != nil {
		return err
	}
	defer func() { j.warmOut = false }()
	// No links while there is no plan: the last plan's participants have nothing to say to
	// each other any more.
	j.s.hub.SetLinks(0, nil)
	if err := j.awaitWorkers(ctx, need); err != nil {
		return err
	}
	stages, hosts, standby, err := j.plan(ctx)
	if err != nil {
		return err
	}
	ver, err := j.savePlan(ctx, stages, hosts, standby)
	if err != nil {
		return err
	}
	restore, step, err := j.restorePoint(ctx)
	if err != nil {
		return err
	}
	// The last plan's restore point is needed no longer (unless a kept checkpoint's, which
	// j.restored holds).
	j.s.freeBlobs(j.planRestore...)
	j.planRestore = nil
	if restore != nil {
		j.planRestore = restore.Blobs
	}
	// Before any Assign makes the workers drop the evidence of the last plan's last step.
	if err := j.drawBeforeReplan(ctx, restore); err != nil {
		return err
	}
	// A replan at a step boundary from a checkpoint of that very step (joins, drift, a worker let
	// go) keeps every stage whose worker holds the same blocks already: only the others load.
	var keep *proto.Keep
	var held map[string][2]int
	// At the end of an outer-mode job's synchronous warm-up the replicas' stages keep the state
	// too (the warm-up's, which every replica holds alike), and start outer mode from it
	// (client warmingOut): nothing is restored.
	j.warmOut = warmOut && j.keepAt.plan != 0 && step == j.keepAt.step
	if kp := j.keepAt; kp.plan != 0 && (!j.spec.Outer() || j.warmOut) && restore != nil && step == kp.step && len(kp.hosts) == 0 {
		keep, held = &proto.Keep{FromPlan: kp.plan, Step: uint64(step)}, map[string][2]int{}
		for _, st := range kp.stages {
			held[st.peer] = [2]int{st.begin, st.end}
		}
	}
	j.keepRef, j.keepUploaded = nil, nil
	if keep != nil {
		// The state a kept shard holds, which custody knows (expectState), for the workers that
		// uploaded their shard of the checkpoint themselves: the first replica's. Another
		// replica's state is its own kernels' (a GPU's AdamW need not match the CPU's to the bit),
		// and its Ready speaks for it (expectKept).
		j.keepRef, j.keepUploaded = restore, map[string]bool{}
		if rs := replicaRuns(j.keepAt.stages); len(rs) > 0 {
			for _, st := range j.keepAt.stages[rs[0].lo:rs[0].hi] {
				j.keepUploaded[st.peer] = true
			}
		}
	}
	j.keepAt = keepPoint{}
	if err := j.adopt(ctx, ver, stages, hosts, standby, step, restore, keep, held, nil); err != nil {
		return err
	}
	return j.checkKept(ctx, step, nil, 0, nil)
}

// linkSuspect is a data-plane failure a participant reported of its link to peer, still
// connected: unless peer leaves before until, the failure is err's (awaitEvent).
type linkSuspect struct {
	peer  string
	by    string // the participant that reported the failure ("" when the job loop's own)
	err   error
	until time.Time
}

// linkGrace is how long a reported link failure waits for its peer's departure: a worker
// stopping closes its data channels a moment before its WebSocket, and a crashed one's session
// ends as soon as its TCP connection does.
const linkGrace = 3 * time.Second

// keepPoint is a plan left at a step boundary right after a checkpoint of that step: the next
// plan's workers that hold the same stages keep them (establish).
type keepPoint struct {
	plan   uint32
	step   int
	stages []placement
	hosts  []hostPlacement
}

// leaveAtCheckpoint abandons the active plan at this step boundary, whose checkpoint was just
// taken: the next plan keeps what it can of it.
func (j *jobRun) leaveAtCheckpoint() {
	j.keepAt = keepPoint{plan: j.version, step: j.step, stages: j.stages, hosts: j.hosts}
	j.leave(false)
}

// adopt makes plan ver — stages, hosts and standby, saved — the active one from step on: it
// assigns every shard, to restore from the checkpoint restore (nil: the seed), or, when keep has
// the plan and step its worker holds that very stage under (held: the blocks of each worker's
// stage there), to keep the state it holds (proto.Keep: the shard is the same, only the plan
// around it changed), or, for a taker in from (taker → giver), to take up its state from its
// giver, which keeps its own and hands it over (grow.go) — and waits until every stage and expert
// host is Ready. An expert host keeps its experts when the plan left gave it the same ones
// (client keepable: a stage's experts on hosts, and a replicated expert's hosts, unchanged too).
func (j *jobRun) adopt(ctx context.Context, ver uint32, stages []placement, hosts []hostPlacement, standby []string, step int, restore *proto.CheckpointRef, keep *proto.Keep, held map[string][2]int, from map[string][]sched.Part) error {
	keeps := func(st placement) *proto.Keep {
		if b, ok := held[st.peer]; keep != nil && ok && b == [2]int{st.begin, st.end} {
			return keep
		}
		return nil
	}
	// An expert host keeps its experts when it hosted the very same ones under the plan left,
	// which the active plan's hosts still are (a reshare keeps them all).
	prevHosts := j.hosts
	keepsHost := func(h hostPlacement) *proto.Keep {
		if keep != nil && slices.ContainsFunc(prevHosts, func(p hostPlacement) bool {
			return p.peer == h.peer && p.block == h.block && slices.Equal(p.experts, h.experts)
		}) {
			return keep
		}
		return nil
	}
	var keepFrom uint32
	for _, st := range stages {
		if keeps(st) != nil {
			keepFrom = keep.FromPlan
		}
	}
	// A replica left out of the outer step just before this plan's first step stays so in the
	// plan's record (also across plans that begin at the same step).
	var carried, carriedAt []int
	var segments []local.SegmentAt
	carriedOf := -1
	if j.planFrom == step && len(j.leftOutCarried) > 0 {
		carried, carriedOf, carriedAt, segments = j.leftOutCarried, j.leftOutCarriedOf, j.leftOutCarriedAt, j.leftOutSegments
	}
	for _, d := range j.dropped {
		switch {
		case d.leftOut && d.step == step:
			carried, carriedAt, segments = append(carried, d.index), append(carriedAt, d.leftOutAt), d.segments
		case d.leftOutOf >= 0 && d.step == step:
			carried, carriedOf, carriedAt, segments = append(carried, d.index), d.leftOutOf, append(carriedAt, d.leftOutAt), d.segments
		}
	}
	j.leftOutCarried, j.leftOutCarriedOf, j.leftOutCarriedAt, j.leftOutSegments = carried, carriedOf, carriedAt, segments
	prevStages, prevReps := j.stages, j.reps
	j.version, j.stages, j.hosts, j.standby, j.step, j.planFrom, j.keptFrom = ver, stages, hosts, standby, step, step, keepFrom
	j.tookFrom = from
	j.suspect, j.leftInEval = nil, nil
	j.lostAtLoad, j.loadReroutes, j.rerouted = nil, len(from) == 0, nil
	j.replicaAt, j.dropped, j.delayed = nil, nil, nil
	j.hastenWaited()
	for _, st := range stages {
		delete(j.outerLeft, st.peer)
	}
	// A plan whose every stage keeps its shard, or takes it from one that does, loads nothing
	// from a checkpoint: a departure while it gets ready is answered as at a boundary (another
	// reshare), the survivors still holding their state — a taker that said it has it keeps it
	// too, and the replica of one that has not stands by (reshare.go); in outer mode the replica
	// is dropped, with those that were to take their state from its worker (dropAtLoad).
	j.phase = phaseLoading
	if keepFrom != 0 && !slices.ContainsFunc(stages, func(st placement) bool { return keeps(st) == nil && len(from[st.peer]) == 0 }) &&
		!slices.ContainsFunc(hosts, func(h hostPlacement) bool { return keepsHost(h) == nil }) {
		j.phase = phaseRejoining
	}
	// In outer mode a plan that restores every shard from the checkpoint, nothing kept or
	// handed over, loads each replica on its own: one lost meanwhile is dropped from the plan's
	// first step, and the others load on (a replay restores, then drops: local.Period.Replan).
	if restore != nil && keepFrom == 0 && len(from) == 0 && j.spec.Outer() {
		j.phase = phaseRestoring
	}
	// Ready everywhere, the plan stands at its first step's boundary; a plan left meanwhile stays left.
	defer func() {
		if j.phase.planned() {
			j.phase = phaseBoundary
		}
	}()
	j.reps = replicaRuns(stages)
	j.recordOuterPlan()
	if j.firstStep < 0 {
		j.firstStep = step
	}
	if err := j.s.db.SetJobStep(ctx, j.rec.ID, int64(step)); err != nil {
		return err
	}
	specJSON, _ := json.Marshal(j.spec)
	replicas := j.replicas()
	depth := j.planDepth(stages, replicas)
	j.depth = depth
	j.planSteps = 0
	j.pace = paceTrack{off: j.pace.off, cost: j.pace.cost}
	j.growWait.Forget() // what a grow would add is weighed again from the new plan
	j.growSoon = false
	// What each worker loads, for the wait for Ready (loadWait): its restore's blobs, the state
	// it takes from its givers or gives its takers.
	loads := map[string]int64{}
	for t, parts := range from {
		for _, p := range parts {
			n := j.handoverBytes(p.Begin, p.End)
			loads[t] += n
			loads[p.Giver] += n
		}
	}
	restoreBytes := func(w string, r *proto.CheckpointRef) {
		if r == nil {
			return
		}
		for _, sha := range r.Blobs {
			if n, err := j.s.blobs.Size(sha); err == nil {
				loads[w] += n
			}
		}
	}
	// The plan's links go to the hub before any Assign: from then on only these pairs may
	// signal each other or relay frames, and only for this plan.
	handing := j.handing()
	links := planLinkPairs(stages, hosts, replicas)
	for t, parts := range from {
		for _, p := range parts {
			// A standby giver's only link, until every state has crossed; or a giver of
			// another cut than its taker's, which the plan does not link otherwise.
			links = append(links, [2]string{p.Giver, t})
		}
	}
	j.s.hub.SetLinks(ver, links)
	for k, h := range hosts {
		a := &proto.Assign{Job: j.rec.ID.String(), Spec: specJSON, PlanVersion: ver,
			Shard:       j.shardOf(len(stages) + k),
			ExpertHosts: []proto.ExpertHost{}, Restore: restore, Relay: j.s.cfg.Relay, Depth: depth}
		if rs := j.routers(h.block, depth); len(j.reps) > 1 {
			// A host of a plan of replicas serves the stage of its block in every replica.
			a.Routers = rs
		} else {
			a.Router = rs[0].Worker
		}
		for _, e := range h.experts {
			if ws := replicas[[2]int{h.block, e}]; len(ws) == 2 {
				a.ExpertHosts = append(a.ExpertHosts, proto.ExpertHost{Block: h.block, Expert: e, Workers: ws})
			}
		}
		if k := keepsHost(h); k != nil {
			a.Restore, a.Keep = nil, k
		}
		a.Restore = j.restoreFor(a.Restore, a)
		restoreBytes(h.peer, a.Restore)
		j.recordAssign(h.peer, a)
		if err := j.s.hub.Send(h.peer, a); err != nil {
			return fmt.Errorf("%w: assign %s: %v", errReplan, h.peer, err)
		}
	}
	for k, st := range stages {
		rr := j.reps[j.replicaOf(k)]
		i, S := k-rr.lo, rr.hi-rr.lo
		a := &proto.Assign{Job: j.rec.ID.String(), Spec: specJSON, PlanVersion: ver, Shard: j.shardOf(k),
			ExpertHosts: []proto.ExpertHost{}, Restore: restore, Relay: j.s.cfg.Relay, Depth: min(depth, rr.n-1)}
		if k := keeps(st); k != nil {
			a.Restore, a.Keep = nil, k
		}
		handoverOf(st.peer, a, keep, from)
		if j.assignsReplica(len(j.reps)) {
			a.Replica = &proto.ReplicaAssign{Index: st.replica, Count: len(j.reps), First: st.first, MicroBatches: st.n,
				Peers: reducePeers(stages, k)}
			for i, p := range a.Replica.Peers {
				a.Replica.Peers[i].Key = j.signingKey(p.Worker)
			}
			if !j.spec.Outer() && len(hosts) == 0 && cutAlike(j.reps, stages) {
				a.Replica.PrevPool, a.Replica.NextPool = poolsBeside(stages, k)
			}
		}
		for blk := st.begin; blk < st.end; blk++ {
			for e := 0; e < j.spec.Model.NExpert; e++ {
				if ws := replicas[[2]int{blk, e}]; len(ws) > 0 {
					a.ExpertHosts = append(a.ExpertHosts, proto.ExpertHost{Block: blk, Expert: e, Workers: ws})
				}
			}
		}
		if i > 0 {
			a.Prev = stages[k-1].peer
		}
		if i < S-1 {
			a.Next = stages[k+1].peer
		}
		a.Restore = j.restoreFor(a.Restore, a) // the checkpoint's shards this stage reads
		restoreBytes(st.peer, a.Restore)
		j.recordAssign(st.peer, a)
		if err := j.s.hub.Send(st.peer, a); err != nil {
			return fmt.Errorf("%w: assign %s: %v", errReplan, st.peer, err)
		}
	}
	for _, w := range handing {
		// Not in the plan: it hands the stage it holds to its takers, then stands by.
		k := slices.IndexFunc(prevStages, func(st placement) bool { return st.peer == w })
		sh := stageShardAt(prevStages, prevReps, k)
		a := &proto.Assign{Job: j.rec.ID.String(), Spec: specJSON, PlanVersion: ver, Shard: sh,
			ExpertHosts: []proto.ExpertHost{}, Relay: j.s.cfg.Relay, Keep: keep, Give: gifts(w, from), Standby: true}
		if err := j.s.hub.Send(w, a); err != nil {
			return fmt.Errorf("%w: assign %s: %v", errReplan, w, err)
		}
	}
	j.s.event(j.rec.ID, "plan", "", map[string]any{"version": ver, "stages": j.stageJSON(), "standby": standby, "from_step": step, "depth": depth, "replicas": len(j.reps), "choice": j.planChoice, "kept": keepFrom != 0})
	j.s.log.Info("plan", "version", ver, "stages", j.stageJSON(), "standby", standby, "from_step", step, "depth", depth, "replicas", len(j.reps), "choice", j.planChoice, "kept", keepFrom != 0)
	j.publish()
	if j.s.cfg.OnPlan != nil {
		j.s.cfg.OnPlan(*j.s.status.Load().Plan)
	}
	// Wait for every stage and expert host to report Ready under this plan, as long as what they
	// load takes (loadWait).
	wait := j.s.loadWait(loads)
	timeout := time.After(wait)
	for {
		ready, want := 0, 0
		for i, id := range j.participants() {
			if j.lostAtLoadPart(i) {
				continue // its micro-batches go to others at the first step
			}
			want++
			if p := j.peers[id]; p != nil && p.ready == ver {
				ready++
			}
		}
		for _, id := range handing {
			want++
			if p := j.peers[id]; p != nil && p.ready == ver {
				ready++
			}
		}
		if ready == want {
			if len(handing) > 0 || len(from) > 0 && !j.spec.Outer() {
				// Every state has crossed: the standby givers and their takers, and givers of
				// other blocks than their takers', are no pair of this plan any more, and the
				// hub relays and signals nothing between them. (In outer mode the momentum
				// still follows, over the link the handover opened.)
				j.s.hub.SetLinks(ver, planLinkPairs(stages, hosts, replicas))
			}
			j.rerouteAtLoad()
			return nil
		}
		woke, _, err := j.await(ctx, listen{deadline: timeout, verdicts: true})
		switch {
		case woke == wokeDeadline:
			j.leave(true)
			return fmt.Errorf("%w: workers did not become ready within %v", errReplan, wait.Round(time.Second))
		case woke == wokeVerdict && err != nil:
			j.leave(true)
			return err
		}
		if d, ok := errors.AsType[*replicaLeft](err); ok && !d.reshare && (j.phase == phaseRestoring || j.phase == phaseRejoining) {
			j.dropAtLoad(d, step)
			continue
		}
		if d, ok := errors.AsType[*replicaLeft](err); ok && d.reroute && j.phase == phaseLoading {
			// Step mode: the others load on; the first step reroutes its micro-batches.
			if j.lostAtLoad == nil {
				j.lostAtLoad = map[int]*replicaLeft{}
			}
			if j.lostAtLoad[d.index] == nil {
				j.lostAtLoad[d.index] = d
				j.s.log.Warn("replica lost while the plan loads: the others load on", "replica", d.index, "worker", d.worker)
			}
			continue
		}
		if err != nil {
			if resharing(err) == nil && ctx.Err() == nil {
				// A reshare goes on from this plan, whose other workers hold their state.
				j.leave(true)
			}
			return err
		}
	}
}

// awaitWorkers waits until need workers are connected and none has joined for Settle.
func (j *jobRun) awaitWorkers(ctx context.Context, need int) error {
	settle := time.NewTimer(j.s.cfg.Settle)
	defer settle.Stop()
	settled := false
	// n is kept as plannable() without a pass over every peer per event: at scale (make scale)
	// a wave of joins made that quadratic. An event changes only its own worker's entry
	// (handle), so the difference it makes is that entry's; onComplete may ban anyone, so it
	// counts again.
	n := j.plannable()
	defer j.setWaiting("")
	// An event changes only its own worker's entry (handle): its count before, then after.
	counted := 0
	before := func(ev Event) { counted = j.plannablePeer(j.peers[ev.Worker]) }
	for n < need || !settled {
		j.setWaiting(j.waitReason(need, n))
		woke, ev, err := j.await(ctx, listen{timer: settle.C, commands: true, stopping: true, idle: true, before: before})
		switch {
		case err != nil:
			return err
		case woke == wokeStopping:
			// No plan runs: nothing to checkpoint, and a job short of workers may wait for good.
			return j.stopAtBoundary(ctx)
		case woke == wokeCommand && j.hold == holdCancelled:
			// A job waiting for workers may wait long: the admin can pause or cancel it meanwhile.
			return errCancelled
		case woke == wokeTimer:
			settled = true
		case woke == wokeUpload:
			n = j.plannable()
		case woke == wokeEvent:
			after := j.plannablePeer(j.peers[ev.Worker])
			n += after - counted
			if after > counted { // a worker admitted (a refused one does not count)
				settle.Reset(j.s.cfg.Settle)
				settled = false
			}
		}
	}
	return nil
}

// plannablePeer is 1 for a connected worker plans may use, 0 for none or one they may not: one
// that refused a shard for lack of memory, or, in outer mode, one without a signing key, whose
// contributions to outer steps nobody could verify (its partners would refuse every one, and with
// two replicas nothing would tell who lied), or one left out for a dispute (outervote.go).
func (j *jobRun) plannablePeer(p *peer) int {
	if p == nil || p.noMemory || j.spec.Outer() && (p.hello == nil || len(p.hello.SigningKey) != proto.SigningKeySize || j.outerDisputed[p.id]) {
		return 0
	}
	return 1
}

// plannable is how many connected workers plans may use (plannablePeer).
func (j *jobRun) plannable() int {
	n := 0
	for _, p := range j.peers {
		n += j.plannablePeer(p)
	}
	return n
}

// plan cuts the model over the connected workers: the job's pinned plan in worker-id order
// (stages first, then expert hosts), or the planner's partition with the experts spread over the
// peers it left spare. The workers plans may not use (plannablePeer) stand by with the spare.
func (j *jobRun) plan(ctx0 context.Context) ([]placement, []hostPlacement, []string, error) {
	var ids, out []string
	for id, p := range j.peers {
		if j.plannablePeer(p) == 1 {
			ids = append(ids, id)
		} else {
			out = append(out, id)
		}
	}
	sort.Strings(ids)
	sort.Strings(out)
	stages, hosts, standby, err := j.planOver(ctx0, ids)
	return stages, hosts, append(standby, out...), err
}

// planOver is plan over the workers ids, in order.
func (j *jobRun) planOver(ctx0 context.Context, ids []string) ([]placement, []hostPlacement, []string, error) {
	M := j.spec.MicroBatches
	j.planChoice = ""
	if p := j.spec.Plan; p != nil && len(p.Replicas) > 0 {
		return pinnedReplicas(j.spec.PinnedReplicas(), p.Experts, j.holdersFirst(ids), M, j.spec.OwnBatches(), j.pinnedHostHolders())
	}
	if p := j.spec.Plan; p != nil {
		var out []placement
		for i, st := range p.Stages {
			out = append(out, placement{peer: ids[i], begin: st[0], end: st[1], n: M})
		}
		hosts, standby, err := pinnedHosts(p.Experts, ids[len(p.Stages):])
		return out, hosts, standby, err
	}
	prof, _, err := j.profiles()
	if err != nil {
		return nil, nil, nil, err
	}
	peers := j.schedPeers(ids)
	plan, err := sched.Partition(prof, peers, sched.Options{MicroBatches: j.spec.MicroBatches})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("plan the job over %d workers: %w", len(peers), err)
	}
	if out, spare, ok := j.chooseReplicas(prof, peers, plan); ok {
		if j.churn.churning() && len(spare) > 0 {
			// Under churn a host would be the only holder of its experts, and its loss would
			// restore every shard: the replicas keep their experts, and lose a step at most.
			j.planChoice += "; experts stay with the stages: under churn a host would be their only holder"
			j.placement = nil
			return out, nil, spare, nil
		}
		hosts, standby, err := j.placeExperts(ctx0, out, spare)
		if err != nil {
			return nil, nil, nil, err
		}
		j.planChoice += j.hostChoice(hosts, spare)
		return out, hosts, standby, nil
	}
	var out []placement
	for _, st := range plan.Stages {
		out = append(out, placement{peer: st.Peer, begin: st.Begin, end: st.End, n: M})
	}
	hosts, standby, err := j.placeExperts(ctx0, out, plan.Standby)
	if err != nil {
		return nil, nil, nil, err
	}
	return out, hosts, standby, nil
}

// holdersFirst orders ids for a pinned plan's staffing: the workers of the last plan's stages in
// its order, then the others in id order — so that a plan refilled after a loss keeps its workers
// where they were and puts newcomers in the empty places, rather than moving a holder to make room
// for a newcomer whose id sorts first.
func (j *jobRun) holdersFirst(ids []string) []string {
	in := map[string]bool{}
	for _, id := range ids {
		in[id] = true
	}
	out := make([]string, 0, len(ids))
	for _, st := range j.stages {
		if in[st.peer] {
			out = append(out, st.peer)
			delete(in, st.peer)
		}
	}
	for _, id := range ids {
		if in[id] {
			out = append(out, id)
		}
	}
	return out
}

// profiles are the job's cost profiles for the planner and expert placement: the very ones a
// worker checks its assignment's memory against (job.Spec.ShardJob: audit evidence, a validation
// pass), with the boundaries in the job's wire formats (sched.Profile.WithWire).
func (j *jobRun) profiles() (sched.Profile, sched.ExpertProfile, error) {
	prof, eprof, err := j.spec.ShardJob().Profiles(j.spec.Model, j.spec.BatchSize/j.spec.MicroBatches, j.spec.MicroBatches)
	if err != nil {
		return prof, eprof, err
	}
	return prof.WithWire(j.spec.Wire), eprof.WithWire(j.spec.Wire), nil
}

// expertOptions are how Shoal asks sched to place experts for one pipeline: one block per host (a
// worker holds one shard), and a second replica for an expert carrying twice its fair share.
var expertOptions = sched.ExpertOptions{OneBlockPerHost: true, ReplicateAbove: 2}

// planExpertOptions are the expert options for a plan of stages: expertOptions for one pipeline.
// In a step-mode plan of replicas a host serves its block's stage in every replica
// (proto.Assign.Routers), so its memory counts every replica's run of micro-batches — the very
// runs the worker checks its Assign against (sched.ExpertShardMemoryRuns) — and no expert is
// replicated: two hosts of one expert would split the step's gradient tree at its root, which
// the replicas' runs cut across (the job spec refuses it in a pinned plan too).
func planExpertOptions(stages []placement) sched.ExpertOptions {
	reps := replicaRuns(stages)
	if len(reps) < 2 {
		return expertOptions
	}
	opt := expertOptions
	opt.ReplicateAbove = 0
	for _, rr := range reps {
		opt.Runs = append(opt.Runs, [2]int{rr.first, rr.first + rr.n})
	}
	return opt
}

// placeExperts puts the experts on the spare peers by expected load — the router statistics of
// the last steps, uniform before any — LPT with replicas for hot experts (sched.PlaceExperts);
// when a placement exists already it moves as few experts as it can (sched.ReplaceExperts). A
// placement must pay (sched.ExpertsPay): while it would make the stages wait longer for their
// experts than computing them at home, the slowest spare peer is left out and the rest tried, so
// that a peer far slower than the stages (a browser tab on its CPU fallback) stays a standby
// instead of becoming the step's bottleneck. With too few spare peers, or none that pay, the
// experts stay with their stages.
//
// In a step-mode plan of replicas the hosts serve every replica (planExpertOptions), and a
// placement pays only when its busiest host of each block takes no longer for all the replicas'
// micro-batches than every replica's stage of the block would for its own share
// (sched.ExpertsPayReplicas). In outer mode no experts leave their stages: each replica trains
// its own θ between outer steps, experts included, and its workers refuse expert hosts there —
// one pipeline included, which outer mode runs as a replica.
func (j *jobRun) placeExperts(ctx context.Context, stages []placement, spare []string) ([]hostPlacement, []string, error) {
	if j.spec.Outer() {
		j.placement = nil
		return nil, spare, nil
	}
	_, prof, err := j.profiles()
	if err != nil {
		return nil, nil, err
	}
	opt := planExpertOptions(stages)
	replicated := len(opt.Runs) > 1
	stagePeers := map[int]sched.Peer{}
	replicaStages := map[int][]sched.ReplicaStage{}
	for _, st := range stages {
		p := j.schedPeers([]string{st.peer})
		for blk := st.begin; blk < st.end && len(p) == 1; blk++ {
			stagePeers[blk] = p[0]
			replicaStages[blk] = append(replicaStages[blk], sched.ReplicaStage{Peer: p[0], MicroBatches: st.n})
		}
	}
	// Fastest first, so that leaving out the last leaves out the slowest.
	peers := j.schedPeers(spare)
	slices.SortStableFunc(peers, func(a, b sched.Peer) int { return cmp.Compare(b.GFLOPS, a.GFLOPS) })
	loads := j.expertLoads(ctx, prof)
	var pl []sched.ExpertPlacement
	for n := len(peers); n > 0 && pl == nil; n-- {
		hosts := peers[:n]
		if sched.KeepExpertsLocal(prof, hosts, opt) {
			break // fewer peers hold no more
		}
		var cand []sched.ExpertPlacement
		if len(j.placement) > 0 {
			// A placement of one pipeline may replicate experts; under opt (replicas) those
			// are placed anew, whole (sched.ReplaceExperts).
			var moved int64
			if cand, moved, err = sched.ReplaceExperts(prof, j.placement, loads, hosts, opt, driftThreshold); err == nil {
				j.s.log.Info("experts re-placed", "bytes_moved", moved)
			}
		}
		if len(cand) == 0 || err != nil {
			if cand, err = sched.PlaceExperts(prof, loads, hosts, opt); err != nil {
				return nil, nil, err
			}
		}
		var pays bool
		if replicated {
			pays, err = sched.ExpertsPayReplicas(prof, cand, loads, hosts, replicaStages, opt)
		} else {
			pays, err = sched.ExpertsPay(prof, cand, loads, hosts, stagePeers, opt)
		}
		if err != nil {
			return nil, nil, err
		}
		if pays {
			pl = cand
		}
	}
	if pl == nil {
		j.placement = nil
		return nil, spare, nil
	}
	j.placement = pl
	byPeer := map[string]*hostPlacement{}
	var order []string
	for _, p := range pl {
		for _, id := range p.Peers {
			h := byPeer[id]
			if h == nil {
				h = &hostPlacement{peer: id, block: p.Block}
				byPeer[id] = h
				order = append(order, id)
			}
			h.experts = append(h.experts, p.Expert)
		}
	}
	var hosts []hostPlacement
	for _, id := range order {
		sort.Ints(byPeer[id].experts)
		hosts = append(hosts, *byPeer[id])
	}
	var rest []string
	for _, id := range spare {
		if byPeer[id] == nil {
			rest = append(rest, id)
		}
	}
	return hosts, rest, nil
}

func (j *jobRun) schedPeers(ids []string) []sched.Peer {
	var peers []sched.Peer
	for _, id := range ids {
		if p := j.peers[id]; p != nil {
			peers = append(peers, sched.Peer{ID: id, GFLOPS: j.effectiveGFLOPS(id), MemoryBytes: j.plannedMemory(p), LinkBytesPerS: linkOrInf(p.hello.LinkBytesPerS)})
		}
	}
	return peers
}

// dataPlaneBytesPerS is peer id's data-plane bound: sched.QUICBytesPerS when the hub believes
// its links to native workers run on QUIC (Hub.QUICLinks), sched.DataChannelBytesPerS otherwise
// (where the figures come from is said there). The replica decision (chooseReplicas, and the grows
// it plans) bounds each peer's upload by it. The bound belongs to a link, and a link is QUIC only
// when both ends are native and offer it; the planner's model is per peer, and an exchange takes
// as long as its slowest member (sched.EstimateReplicas), so a peer's bound by its own kind gives
// each exchange its slowest link's: a browser bounds every link it is on at the data channel's
// rate.
//
// Without the bound the planner believed that step-mode replicas of the default job, which move
// its whole gradient every step, cost nothing, and chose plans that ran at half the speed of one
// pipeline. A peer's claimed link can only lower it. One pipeline's cuts (sched.Partition) still
// see the links as measured: a stage boundary moves a micro-batch's activations, a few hundred
// KiB, where replicas move the whole model.
func (j *jobRun) dataPlaneBytesPerS(id string) float64 {
	return sched.DataPlaneBytesPerS(j.s.quicLinks(id))
}

// boundLinks is peers with each link bounded by its data plane (dataPlaneBytesPerS), as the
// replica planner weighs them.
func (j *jobRun) boundLinks(peers []sched.Peer) []sched.Peer {
	peers = slices.Clone(peers)
	for i := range peers {
		peers[i].LinkBytesPerS = min(peers[i].LinkBytesPerS, j.dataPlaneBytesPerS(peers[i].ID))
	}
	return peers
}

// replicaGain is how much faster the planner must estimate a replicated plan than the one
// pipeline it would otherwise run before it replicates: the estimate leaves out expert hosts —
// one pipeline usually leaves more spare peers to host experts than replicas do — and a
// replicated step is harder to keep busy.
const replicaGain = 1.1

// chooseReplicas decides whether the job runs as pipeline replicas: it plans them
// (sched.PlanReplicas) over peers, estimates both that plan and single — the one pipeline
// Partition chose — the same way (sched.EstimateReplicas, synchronisation included, expert hosts
// left out of both), and takes the replicas when they are estimated replicaGain faster. It
// returns their stages and the peers they leave, from which placeExperts then draws expert hosts
// in step mode, as it does for one pipeline. Either way j.planChoice says what was weighed, for
// the plan event, `shoal status` and `shoal train --workers` (plan adds what became of the
// experts, hostChoice).
func (j *jobRun) chooseReplicas(prof sched.Profile, peers []sched.Peer, single sched.Plan) ([]placement, []string, bool) {
	j.planChoice = ""
	opt := j.spec.ReplicaOptions()
	if (opt.MicroBatches < 2 && !opt.OwnBatches) || len(peers) < 2 {
		return nil, nil, false
	}
	peers = j.boundLinks(peers)
	// Departures weigh in (sched.Churn): one pipeline's every loss restores, a replica's costs a
	// step (step mode) or its round (outer mode).
	opt.Churn = j.churn.churn(time.Now(), j.restorePrior())
	one, err := sched.EstimateReplicas(prof, single, peers, opt)
	if err != nil {
		j.s.log.Warn("estimate the single pipeline", "err", err)
		return nil, nil, false
	}
	churned := ""
	if opt.Churn.PerPeerRate > 0 {
		churned = fmt.Sprintf(" (expected under churn, %s: %.0f for one pipeline)", opt.Churn, one.GoodputTokensPerS)
	}
	rp, err := sched.PlanReplicas(prof, peers, opt)
	if err == nil && len(rp.Pipelines()) == 1 && opt.Churn.PerPeerRate > 0 {
		// Under churn the replica planner may prefer one pipeline of its own over Partition's:
		// fewer holders, whose departures restore less often, for less speed.
		if few, err := sched.EstimateReplicas(prof, rp, peers, opt); err == nil && few.GoodputTokensPerS >= replicaGain*one.GoodputTokensPerS {
			p := rp.Pipelines()[0]
			j.planChoice = fmt.Sprintf("one pipeline of %d workers: estimated %.0f tokens/s against %.0f for %d (expected under churn, %s: %.0f against %.0f)",
				len(p.Stages), few.TokensPerS, one.TokensPerS, len(single.Stages), opt.Churn, few.GoodputTokensPerS, one.GoodputTokensPerS)
			var out []placement
			for _, st := range p.Stages {
				out = append(out, placement{peer: st.Peer, begin: st.Begin, end: st.End, first: p.First, n: p.MicroBatches})
			}
			return out, rp.Standby, true
		}
	}
	if err != nil || len(rp.Replicas) < 2 {
		why := fmt.Sprintf("no replicated plan was estimated faster than one pipeline (%.0f tokens/s%s)", one.TokensPerS, churned)
		if opt.Sync == sched.SyncStep {
			why += fmt.Sprintf(": step-mode replicas exchange the whole gradient (%.0f MB) every step, %s",
				float64(prof.StageParams(0, prof.NumBlocks()))*sched.GradBytesPerParam/1e6, linkBounds(peers))
		}
		j.planChoice = "one pipeline: " + why
		return nil, nil, false
	}
	many, err := sched.EstimateReplicas(prof, rp, peers, opt)
	if err != nil {
		j.s.log.Warn("estimate the replicated plan", "err", err)
		return nil, nil, false
	}
	syncShare := func(e sched.Estimate) string {
		return fmt.Sprintf("%.0f%% of it synchronising", 100*e.SyncSeconds/e.StepSeconds)
	}
	if opt.Churn.PerPeerRate > 0 {
		churned = fmt.Sprintf(" (expected under churn, %s: %.0f against %.0f)", opt.Churn, many.GoodputTokensPerS, one.GoodputTokensPerS)
	}
	if many.GoodputTokensPerS < replicaGain*one.GoodputTokensPerS {
		j.planChoice = fmt.Sprintf("one pipeline: %d replicas were estimated at %.0f tokens/s (%s) against %.0f for one pipeline%s",
			len(rp.Replicas), many.TokensPerS, syncShare(many), one.TokensPerS, churned)
		return nil, nil, false
	}
	j.planChoice = fmt.Sprintf("%d replicas, %s sync: estimated %.0f tokens/s (%s) against %.0f for one pipeline%s",
		len(rp.Replicas), opt.Sync, many.TokensPerS, syncShare(many), one.TokensPerS, churned)
	var out []placement
	for r, rep := range rp.Replicas {
		for _, st := range rep.Stages {
			out = append(out, placement{peer: st.Peer, begin: st.Begin, end: st.End, replica: r, first: rep.First, n: rep.MicroBatches})
		}
	}
	return out, rp.Standby, true
}

// hostChoice is what plan adds to a step-mode replicated plan's j.planChoice about its experts:
// the hosts placeExperts gave them out of the spare peers, or why they stay with the stages. Outer
// mode never moves them (placeExperts), and says nothing of it.
func (j *jobRun) hostChoice(hosts []hostPlacement, spare []string) string {
	moe := false
	for i := 0; i < j.spec.Model.NLayer; i++ {
		moe = moe || j.spec.Model.IsMoE(i)
	}
	switch {
	case !moe || j.spec.Outer():
		return ""
	case len(hosts) == 1:
		return "; experts on 1 host, serving every replica"
	case len(hosts) > 1:
		return fmt.Sprintf("; experts on %d hosts, each serving every replica", len(hosts))
	case len(spare) == 0:
		return "; experts stay with the stages: no spare peer to host them"
	case len(spare) == 1:
		return "; experts stay with the stages: the spare peer holds no placement that pays"
	}
	return fmt.Sprintf("; experts stay with the stages: the %d spare peers hold no placement that pays", len(spare))
}

// driftThreshold is how much faster a fresh expert placement must be before experts move, and
// driftEvery how often (in steps) the router statistics are compared with the placement.
const (
	driftThreshold = 0.2
	driftEvery     = 20
)

// expertLoads is the expected load per expert from the router statistics of the last steps.
func (j *jobRun) expertLoads(ctx context.Context, prof sched.ExpertProfile) sched.ExpertLoad {
	stats, err := j.s.db.ListRouterStats(ctx, j.rec.ID, int64(max(j.step-20, 0)), int64(j.step))
	if err != nil || len(stats) == 0 {
		return sched.UniformExpertLoad(prof)
	}
	idx := map[[2]int64]int{}
	var counts []sched.RouterCounts
	for _, st := range stats {
		k := [2]int64{st.Step, int64(st.Block)}
		i, ok := idx[k]
		if !ok {
			i = len(counts)
			idx[k] = i
			counts = append(counts, sched.RouterCounts{Block: st.Block, Tokens: make([]int64, prof.Experts)})
		}
		if st.Expert < prof.Experts {
			counts[i].Tokens[st.Expert] = st.Tokens
		}
	}
	loads, err := sched.NewExpertLoad(prof, counts)
	if err != nil {
		return sched.UniformExpertLoad(prof)
	}
	return loads
}

// driftPending reports whether the router's load has drifted enough from the current expert
// placement that moving experts pays. The move happens at the step boundary, from a checkpoint
// taken there (checkpointNow), so that nothing is replayed.
func (j *jobRun) driftPending(ctx context.Context) bool {
	// Checked every driftEvery steps: the placement follows a trend, not one step's routing.
	if j.spec.Plan != nil || len(j.placement) == 0 || !j.phase.planned() || j.step%driftEvery != 0 {
		return false
	}
	_, prof, err := j.profiles()
	if err != nil {
		return false
	}
	var ids []string
	for _, h := range j.hosts {
		ids = append(ids, h.peer)
	}
	need, err := sched.NeedsExpertReplacement(prof, j.placement, j.expertLoads(ctx, prof), j.schedPeers(ids), planExpertOptions(j.stages), driftThreshold)
	return err == nil && need
}

// replicas maps every hosted (block, expert) to its hosts in replica order: the planner's order
// when it placed them, the host order of a pinned plan otherwise.
func (j *jobRun) replicas() map[[2]int][]string {
	out := map[[2]int][]string{}
	if len(j.placement) > 0 && j.spec.Plan == nil {
		for _, p := range j.placement {
			out[[2]int{p.Block, p.Expert}] = p.Peers
		}
		return out
	}
	for _, h := range j.hosts {
		for _, e := range h.experts {
			k := [2]int{h.block, e}
			out[k] = append(out[k], h.peer)
		}
	}
	return out
}

// participants are the workers of the active plan: stages in order, then expert hosts.
func (j *jobRun) participants() []string {
	var out []string
	for _, st := range j.stages {
		out = append(out, st.peer)
	}
	for _, h := range j.hosts {
		out = append(out, h.peer)
	}
	return out
}

// planLinkPairs are the pairs of workers that exchange tensors under a plan: neighbouring
// stages, each stage and the hosts of its blocks' experts, and the replicas of an expert.
func planLinkPairs(stages []placement, hosts []hostPlacement, replicas map[[2]int][]string) [][2]string {
	var out [][2]string
	for i := 1; i < len(stages); i++ {
		if stages[i].replica == stages[i-1].replica {
			out = append(out, [2]string{stages[i-1].peer, stages[i].peer})
		}
	}
	for i := range stages {
		for _, p := range reducePeers(stages, i) {
			if p.Worker > stages[i].peer {
				out = append(out, [2]string{stages[i].peer, p.Worker})
			}
		}
	}
	for _, h := range hosts {
		for _, st := range stages {
			if h.block >= st.begin && h.block < st.end {
				out = append(out, [2]string{st.peer, h.peer})
			}
		}
	}
	for _, ws := range replicas {
		for a := range ws {
			for b := a + 1; b < len(ws); b++ {
				out = append(out, [2]string{ws[a], ws[b]})
			}
		}
	}
	return out
}

func linkOrInf(v float64) float64 {
	if v <= 0 {
		return 1e12 // unmeasured: loopback, in effect
	}
	return v
}

func (j *jobRun) stageJSON() []map[string]any {
	var out []map[string]any
	for _, st := range j.stages {
		m := map[string]any{"peer": st.peer, "blocks": [2]int{st.begin, st.end}}
		if len(j.reps) > 1 {
			m["replica"], m["micro_batches"] = st.replica, [2]int{st.first, st.first + st.n}
		}
		out = append(out, m)
	}
	return out
}

func (j *jobRun) savePlan(ctx context.Context, stages []placement, hosts []hostPlacement, standby []string) (uint32, error) {
	var st, hs []map[string]any
	for _, p := range stages {
		st = append(st, map[string]any{"peer": p.peer, "begin": p.begin, "end": p.end})
	}
	for _, h := range hosts {
		hs = append(hs, map[string]any{"peer": h.peer, "block": h.block, "experts": h.experts})
	}
	b, _ := json.Marshal(map[string]any{"stages": st, "expert_hosts": hs, "standby": standby, "micro_batches": j.spec.MicroBatches})
	rec, err := j.s.db.SavePlan(ctx, j.rec.ID, b)
	if err != nil {
		return 0, err
	}
	return uint32(rec.Version), nil
}

// enterPhase sets the spec and sync rule the next plan runs by: the phase (job.Spec.Phase) of
// the step it restores to, the newest complete checkpoint's. Only an outer-mode job with a
// synchronous warm-up has two: step mode until step W, whose checkpoint outer mode starts from.
//
// It reports whether the plan is the first of outer mode after the warm-up's step mode, at its
// end: the one whose stages may keep the warm-up's state (warmOut).
func (j *jobRun) enterPhase(ctx context.Context) (bool, error) {
	done := 0
	ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
	switch {
	case err == nil:
		done = int(ck.Step)
	case !errors.Is(err, storage.ErrNotFound):
		return false, err
	}
	spec := j.full.Phase(done)
	if spec.Outer() == j.spec.Outer() {
		return false, nil
	}
	out := spec.Outer() && done == j.full.SyncWarmup()
	j.spec, j.sync = spec, newSyncRule(spec)
	j.s.log.Info("sync mode for the next plan", "mode", spec.Sync.Mode, "from_step", done, "warmup", j.full.SyncWarmup())
	return out, nil
}

// restorePoint is where every shard starts: the newest complete checkpoint — every shard blob of
// it, of which each Assign names those its shard reads (restoreFor) — or the job seed at step 0.
func (j *jobRun) restorePoint(ctx context.Context) (*proto.CheckpointRef, int, error) {
	ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
	if errors.Is(err, storage.ErrNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	ref := &proto.CheckpointRef{Step: uint64(ck.Step)}
	for _, sh := range ck.Shards {
		if !sh.Landed() {
			return nil, 0, fmt.Errorf("checkpoint %d: shard %s has not landed", ck.ID, sh.Name)
		}
		if !slices.Contains(ref.Blobs, sh.SHA256) {
			ref.Blobs = append(ref.Blobs, sh.SHA256)
		}
	}
	if len(ref.Blobs) == 0 {
		return nil, 0, fmt.Errorf("checkpoint %d has no shards", ck.ID)
	}
	j.blobNames, j.blobHolders = map[string][]string{}, map[string][]string{}
	for _, sha := range ref.Blobs {
		names, err := j.s.blobTensors(sha)
		if err != nil {
			return nil, 0, fmt.Errorf("checkpoint %d: %w", ck.ID, err)
		}
		j.blobNames[sha] = names
		for _, n := range names {
			j.blobHolders[n] = append(j.blobHolders[n], sha)
		}
	}
	return ref, int(ck.Step), nil
}

// assembled returns the whole-model blob of a complete checkpoint, assembling it once (and again
// if the blob was collected meanwhile: nothing in the store references it).
func (j *jobRun) assembled(ctx context.Context, ck storage.Checkpoint) (string, error) {
	if sha, ok := j.restored[ck.ID]; ok {
		if has, err := j.s.blobs.Has(sha); err == nil && has {
			return sha, nil
		}
	}
	sha, err := j.s.assemble(ctx, ck)
	if err != nil {
		return "", err
	}
	j.restored[ck.ID] = sha
	return sha, nil
}

// onComplete handles a checkpoint whose last shard landed.
func (j *jobRun) onComplete(ctx context.Context, id int64) {
	ck, err := j.s.db.Checkpoint(ctx, id)
	if err != nil || ck.JobID != j.rec.ID {
		return
	}
	// The whole-model file is assembled when a restore or an export needs it; only with OutDir
	// (shoal train --workers --out) is it written at once, since the user asked for the files.
	if j.s.cfg.OutDir != "" {
		if _, err := j.assembled(ctx, ck); err != nil {
			j.s.log.Error("assemble checkpoint", "id", id, "err", err)
			return
		}
	}
	j.s.slots.forget(func(sl uploadSlot) bool { return sl.Job == j.rec.ID && sl.Step < ck.Step })
	if d := ck.CompletedAt.Sub(ck.CreatedAt); d > 0 {
		if j.ckCost == 0 {
			j.ckCost = d
		} else {
			j.ckCost = (j.ckCost + d) / 2
		}
	}
	j.s.log.Info("checkpoint complete", "id", id, "step", ck.Step)
	j.s.metrics.checkpointCompleted(ck.CompletedAt)
	j.s.event(j.rec.ID, "checkpoint.complete", "", map[string]any{"id": id, "step": ck.Step})
	j.retain(ctx)
	j.publish()
}

// handleIdle takes an event while no step is running.
func (j *jobRun) handleIdle(ev Event) {
	if err := j.handle(ev); err != nil {
		j.s.log.Warn("while idle", "err", err)
	}
	if !j.phase.planned() {
		// No plan holds anything to checkpoint: a worker asking to leave goes at once rather
		// than wait for a step boundary that may be long in coming (a job short of workers).
		j.letGo(context.Background())
	}
}

// handle updates the peer table from an event. A worker of the active plan leaving, or
// reporting an error, abandons the plan (errReplan).
func (j *jobRun) handle(ev Event) error {
	switch ev.Kind {
	case EventJoined:
		if j.isBanned(ev.Worker, ev.Hello) {
			j.s.hub.Drop(ev.Worker, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job"})
			return nil
		}
		if !j.admits(ev.Hello) {
			j.s.hub.Drop(ev.Worker, &proto.Error{Code: proto.ErrCodeForbidden, Message: "this job is private: join with its link"})
			j.s.event(j.rec.ID, "worker.refused", ev.Worker, map[string]any{"reason": "no join token"})
			return nil
		}
		j.peers[ev.Worker] = &peer{id: ev.Worker, hello: ev.Hello, addr: ev.Addr}
		j.churn.join(ev.Worker, time.Now())
		j.s.remember(j.peers[ev.Worker])
		// The worker's row and its join event in one transaction: each costs an fsync, and a
		// wave of joins is recorded at the pace of the job loop's writes (make scale).
		j.s.recordJoin(j.rec.ID, ev.Worker, ev.Hello, map[string]any{"name": ev.Hello.Name, "kind": ev.Hello.Kind, "backend": ev.Hello.Backend, "gflops": ev.Hello.GFLOPS})
		j.publish()
	case EventLeft:
		if _, ok := j.peers[ev.Worker]; ok {
			j.churn.leave(ev.Worker, time.Now(), j.released[ev.Worker] || j.leaving[ev.Worker])
		}
		if j.suspect != nil && j.suspect.peer == ev.Worker {
			j.suspect = nil // the failure was its departure's
		}
		kernels := ""
		if p := j.peers[ev.Worker]; p != nil && p.hello != nil {
			kernels = p.hello.Kernels
		}
		delete(j.peers, ev.Worker)
		j.s.auditReg.leave(ev.Worker) // its evidence went with its session
		id := ev.Worker
		j.s.rec.record("worker "+id+" left", func(tx *storage.Tx) error {
			return tx.SetWorkerState(context.Background(), id, storage.WorkerGone)
		})
		reason := ""
		if ev.Err != nil {
			reason = ev.Err.Error()
		}
		j.s.event(j.rec.ID, "worker.left", ev.Worker, map[string]any{"reason": reason})
		j.publish()
		if j.handingOver(ev.Worker) {
			// Its taker has no other source of the state than a checkpoint.
			return fmt.Errorf("%w: worker %s left while it handed its stage over: %s", errReplan, ev.Worker, reason)
		}
		switch d := sched.Decide(j.membership(), sched.Change{Left: ev.Worker}); d.Action {
		case sched.KeepGoing:
		case sched.DropReplica, sched.Reshare, sched.Reroute:
			return &replicaLeft{worker: ev.Worker, index: d.Replica, why: d.Why, reshare: d.Action != sched.DropReplica, reroute: d.Action == sched.Reroute, kernels: kernels}
		default:
			return fmt.Errorf("%w: worker %s left: %s (%s)", errReplan, ev.Worker, reason, d.Why)
		}
	case EventMessage:
		switch m := ev.Msg.(type) {
		case *proto.Leaving:
			// A worker already let go that asks again is not leaving: it would only have the job
			// record its request again and again.
			if j.released[ev.Worker] {
				j.s.hub.Drop(ev.Worker, fmt.Errorf("asked to leave again after it was let go"))
				return nil
			}
			// Let go at the next step boundary (letGo), where its state can be checkpointed.
			if j.leaving == nil {
				j.leaving = map[string]bool{}
			}
			if !j.leaving[ev.Worker] {
				j.leaving[ev.Worker] = true
				j.s.event(j.rec.ID, "worker.leaving", ev.Worker, map[string]any{"reason": m.Reason, "step": j.step})
			}
		case *proto.Ready:
			if p := j.peers[ev.Worker]; p != nil {
				p.ready, p.readyState, p.readyGave, p.readySums = m.PlanVersion, m.State, m.Gave, m.Sums
			}
		case *proto.Error:
			if m.Code == proto.ErrCodeOuterRefused {
				return j.outerRefusal(context.Background(), ev.Worker, m) // handle has no context: a ban is one short write
			}
			// Only a participant's errors concern the job; anyone else's text stays out of the
			// event log (it is public on the dashboard) and changes nothing.
			if !j.holds(ev.Worker) || j.lostAtLoadWorker(ev.Worker) {
				j.s.log.Debug("error from a worker outside the plan ignored", "worker", ev.Worker, "code", m.Code, "err", m.Message)
				return nil
			}
			j.s.event(j.rec.ID, "worker.error", ev.Worker, map[string]any{"code": m.Code, "message": m.Message})
			// A step failure a worker reports late, for a step already abandoned, changes nothing;
			// one for the step in flight is weighed by the step driver (train, or evalPass), which waits
			// for every participant's answer to tell the failed from the silent.
			if m.Step != nil {
				return nil
			}
			// A data-plane failure of an earlier plan's links: such reports cross a new Assign on
			// the wire whenever one worker tears down its old links before its neighbour has
			// heard of the new plan; taking them for the new plan's failures replanned again and
			// again.
			if m.Code == proto.ErrCodeStep && m.PlanVersion != 0 && m.PlanVersion != j.version {
				j.s.log.Info("data-plane failure of an earlier plan ignored", "worker", ev.Worker, "err", m.Message)
				return nil
			}
			// A link to a worker the plan no longer holds failed — a stage taken over mid-step
			// (takeover.go), whose neighbours' links to it fail as it goes: nothing waits on it.
			if m.Code == proto.ErrCodeStep && m.Peer != "" && m.PlanVersion == j.version && j.phase.planned() && !j.holds(m.Peer) {
				if r := j.rerouted; r != nil && r.workers[m.Peer] {
					j.s.log.Info("data-plane failure of a link to a stage taken over", "worker", ev.Worker, "peer", m.Peer, "err", m.Message)
					return nil
				}
			}
			// A link to a worker that has left failed: its departure, which the hub has queued if
			// the job loop has not heard it yet, is what the rule book answers. A worker that is
			// leaving may close its links before its session: the failure waits a little for the
			// departure (linkSuspect) before it is taken for a failure between two that stay.
			if m.Code == proto.ErrCodeStep && m.Peer != "" && j.holds(m.Peer) {
				if !j.s.hub.Connected(m.Peer) {
					j.s.log.Info("data-plane failure of a link to a worker that left", "worker", ev.Worker, "peer", m.Peer, "err", m.Message)
					return nil
				}
				if j.suspect == nil {
					j.suspect = &linkSuspect{peer: m.Peer, err: fmt.Errorf("%w: worker %s: %v", errReplan, ev.Worker, m), until: time.Now().Add(linkGrace)}
					j.s.log.Info("data-plane failure: waiting for the peer's departure", "worker", ev.Worker, "peer", m.Peer, "err", m.Message)
				}
				return nil
			}
			// A worker refusing its shard for lack of memory would refuse it again: plans leave it
			// out from now on (a planner's plan never exceeds a worker's announced memory, a
			// pinned plan may).
			if m.Code == proto.ErrCodeMemory {
				if m.PlanVersion != 0 && m.PlanVersion != j.version {
					return nil
				}
				if p := j.peers[ev.Worker]; p != nil {
					p.noMemory = true
				}
			}
			if j.holds(ev.Worker) {
				return fmt.Errorf("%w: worker %s: %v", errReplan, ev.Worker, m)
			}
		}
	}
	return nil
}

func (j *jobRun) holds(id string) bool {
	if !j.phase.planned() {
		return false
	}
	if j.handingOver(id) {
		return true
	}
	for _, p := range j.participants() {
		if p == id {
			return true
		}
	}
	return false
}

func workerRow(id string, h *proto.Hello, state storage.WorkerState) storage.Worker {
	kind := storage.WorkerNative
	if h.Kind == proto.WorkerBrowser {
		kind = storage.WorkerBrowser
	}
	return storage.Worker{ID: id, Kind: kind, Backend: string(h.Backend), GFLOPS: h.GFLOPS, MemoryBytes: h.MemoryBytes, State: state}
}

// recordJoin records a worker that joined the job (idle) and its worker.joined event, in one
// transaction; a failure to record is reported, never fatal.
func (s *Server) recordJoin(jobID uuid.UUID, id string, h *proto.Hello, detail map[string]any) {
	b, _ := json.Marshal(detail)
	row := workerRow(id, h, storage.WorkerIdle)
	s.rec.record("worker "+id+" joined", func(tx *storage.Tx) error {
		if _, err := tx.UpsertWorker(context.Background(), row); err != nil {
			return err
		}
		_, err := tx.AppendEvent(context.Background(), storage.Event{JobID: jobID, Kind: "worker.joined", WorkerID: id, Message: b})
		return err
	})
	if s.cfg.OnEvent != nil {
		s.cfg.OnEvent("worker.joined", id, string(b))
	}
}

// event appends to the events log; a failure to log is reported, never fatal.
func (s *Server) event(jobID uuid.UUID, kind, worker string, msg any) {
	b, _ := json.Marshal(msg)
	if msg == nil {
		b = []byte("{}")
	}
	s.rec.record("event "+kind, func(tx *storage.Tx) error {
		_, err := tx.AppendEvent(context.Background(), storage.Event{JobID: jobID, Kind: kind, WorkerID: worker, Message: b})
		return err
	})
	if s.cfg.OnEvent != nil {
		s.cfg.OnEvent(kind, worker, string(b))
	}
}

// retain applies the checkpoint retention (Config.KeepCheckpoints, KeepEvery), drops pending
// checkpoints older than the newest complete one, and collects the blobs that no checkpoint
// references and the job loop does not hold (Server.collectBlobs): the blobs of the checkpoints
// it deletes at once.
func (j *jobRun) retain(ctx context.Context) {
	// Blobs are collected after every checkpoint, retention or not: refused and superseded
	// uploads and old assembled files must not fill the disk (issue 14).
	defer func() { j.s.collectBlobs(ctx, j.heldBlobs()) }()
	keep := j.s.cfg.KeepCheckpoints
	cks, err := j.s.db.ListCheckpoints(ctx, j.rec.ID)
	if err != nil {
		return
	}
	var complete []storage.Checkpoint
	for _, ck := range cks {
		if ck.State == storage.CheckpointComplete {
			complete = append(complete, ck)
		}
	}
	sort.Slice(complete, func(a, b int) bool { return complete[a].Step > complete[b].Step })
	// A pending checkpoint older than the newest complete one will never be restored from: a
	// shard of it was lost with its worker or coordinator.
	for _, ck := range cks {
		// Discarded ones (a rollback past them after a ban) are kept as the record of what the
		// banned worker's work went into.
		if ck.State != storage.CheckpointComplete && ck.State != storage.CheckpointDiscarded && len(complete) > 0 && ck.Step < complete[0].Step {
			if err := j.s.db.DeleteCheckpoint(ctx, ck.ID); err == nil {
				j.freeCheckpoint(ck) // the shards that did land
			}
		}
	}
	if keep <= 0 {
		return
	}
	for i, ck := range complete {
		if i < keep || (j.s.cfg.KeepEvery > 0 && ck.Step%int64(j.s.cfg.KeepEvery) == 0) {
			continue
		}
		if err := j.s.db.DeleteCheckpoint(ctx, ck.ID); err != nil {
			j.s.log.Warn("retention", "checkpoint", ck.ID, "err", err)
			continue
		}
		j.freeCheckpoint(ck)
		delete(j.restored, ck.ID)
		j.s.event(j.rec.ID, "checkpoint.deleted", "", map[string]any{"id": ck.ID, "step": ck.Step})
	}
}

// freeCheckpoint frees the blobs of a checkpoint just deleted: its landed shards and its
// assembled file. Another checkpoint of the same bytes, j.restored and the active plan's restore
// point keep theirs (Server.removeFreed).
func (j *jobRun) freeCheckpoint(ck storage.Checkpoint) {
	for _, sh := range ck.Shards {
		j.s.freeBlobs(sh.SHA256)
	}
	j.s.freeBlobs(j.restored[ck.ID])
}

// heldBlobs are the blobs the job loop holds that no checkpoint row names: the assembled files
// of the complete checkpoints it restored from or assembled, and the active plan's restore point.
func (j *jobRun) heldBlobs() map[string]bool {
	held := make(map[string]bool, len(j.restored)+1)
	for _, sha := range j.restored {
		held[sha] = true
	}
	for _, sha := range j.planRestore {
		held[sha] = true
	}
	return held
}

// replanReason says why the plan should change at this step boundary: "drift" (the router's load
// moved away from the expert placement), "rebalance" (the replicas' shares follow their measured
// pace, every state kept: rebalance.go, j.rebalanceTo), "join" (workers wait for work), or "" to
// carry on.
func (j *jobRun) replanReason(ctx context.Context) (string, *growth) {
	if j.full.Phase(j.step).Outer() != j.spec.Outer() {
		// The synchronous warm-up is over: outer mode starts from its checkpoint (enterPhase).
		return "warmup", nil
	}
	switch {
	case j.remeasure:
		j.remeasure = false
		if j.spec.Plan == nil {
			return "measured", nil
		}
	case j.driftPending(ctx):
		return "drift", nil
	}
	if v := j.rebalanceDue(); v != nil {
		j.rebalanceTo = v
		return "rebalance", nil
	}
	switch act, g := j.joinPending(ctx); act {
	case sched.Grow:
		j.lastJoinReplan = time.Now()
		return "grow", g
	case sched.CheckpointReplan:
		j.lastJoinReplan = time.Now()
		return "join", nil
	}
	return "", nil
}

// joinPending is what the rule book (sched.Decide) says of the workers that joined after the plan
// was made and wait for work: join replans are spaced at least joinReplanGap apart, so that a wave
// of joins costs one replan, not one per worker; a worker that would only stand by costs no
// replan — the planner is asked first, and when its plan keeps every stage and expert host where
// they are, the newcomers join the standbys. When every stage of the planner's plan is held now or
// can be handed over by a twin that stays, they take it up at this step boundary without a
// checkpoint (sched.Grow, grow.go: g); otherwise the coordinator checkpoints there
// (checkpointNow) and replans from it (sched.CheckpointReplan), so that nothing is replayed. A
// pinned plan is only ever refilled (grow).
func (j *jobRun) joinPending(ctx context.Context) (sched.Action, *growth) {
	if !j.phase.planned() {
		return sched.KeepGoing, nil
	}
	var fresh []string
	for id := range j.peers {
		if !j.holds(id) && !slices.Contains(j.standby, id) {
			fresh = append(fresh, id)
		}
	}
	c := sched.Change{Joined: len(fresh), JoinGapElapsed: time.Since(j.lastJoinReplan) >= j.s.cfg.joinReplanGap()}
	// The workers of a replica a reshare dropped stand by with a stale state: they wait for a
	// place too, but only one they can take up from twins is worth a change of plan (a
	// checkpoint and replan for them would cost more than it gives).
	// So do the workers of a grow that waits (below): it is weighed again at every boundary.
	refill := len(fresh) == 0 && (j.refillDue || j.growWait.Waiting() || j.growSoon) && len(j.standby) > 0
	var g *growth
	replanning := false // the newcomers join only by a checkpoint and replan, weighed (c.ReplanWaits)
	if (len(fresh) > 0 || refill) && c.JoinGapElapsed {
		saved, choice := j.placement, j.planChoice
		stages, hosts, standby, err := j.plan(ctx)
		newChoice := j.planChoice
		j.placement, j.planChoice = saved, choice
		if err == nil {
			c.PlanKept, g = j.sync.joins(j, fresh, stages, hosts, standby, newChoice)
			if g != nil && g.weighed && !c.PlanKept && j.spec.Plan == nil {
				// A checkpoint and replan to the planner's plan that adds as much for a shorter
				// stall beats the grow outright (sched.ReplanDominates): an outer-mode reshape's
				// handovers, a few givers to many takers over their uplinks, can take longer
				// than every stage uploading its shard and the new ones loading theirs.
				if gain, stall, ok := j.replanWeigh(stages, hosts); ok && sched.ReplanDominates(g.gain, g.stall, gain, stall) {
					j.s.log.Info("a checkpoint and replan beats the grow", "step", j.step, "grow_gain", g.gain, "grow_stall_s", g.stall, "replan_gain", gain, "replan_stall_s", stall)
					g = nil
				}
			}
			c.PeerState = g != nil
		}
		// An outer-mode grow holds every replica for its handovers: it waits, its workers standing
		// by, until what it adds has repaid that (sched.GrowDeferral) — and, with a delayed
		// outer step pending, until the boundary after its take-up, which the round ends at.
		j.growSoon = g != nil && g.later
		switch {
		case g != nil && g.later:
			c.GrowLater = true
			if len(fresh) > 0 {
				takers := slices.Sorted(maps.Keys(g.from))
				j.s.log.Info("a grow waits for the delayed outer step's take-up", "step", j.step, "takers", takers)
				j.s.event(j.rec.ID, "grow.waiting", "", map[string]any{"step": j.step, "until": "take-up", "takers": takers})
			}
			g = nil
		case g != nil && g.weighed:
			waiting := j.growWait.Waiting()
			round := float64(max(j.spec.Sync.Every, 1)) * j.lastStepSeconds
			c.GrowWaits = !j.growWait.Due(time.Since(j.started).Seconds(), g.gain, g.stall, round)
			if c.GrowWaits && !waiting {
				j.s.log.Info("a grow waits until what it adds repays its handovers", "step", j.step,
					"gain", g.gain, "stall_s", g.stall, "round_s", round)
				j.s.event(j.rec.ID, "grow.waiting", "", map[string]any{"step": j.step, "gain": g.gain,
					"stall_s": g.stall, "round_s": round, "takers": slices.Sorted(maps.Keys(g.from))})
			}
		case g == nil && !c.PlanKept && j.spec.Plan == nil:
			// Only a checkpoint and a replan of everyone takes the newcomers in: weighed as a
			// grow is (sched.GrowDeferral.ReplanDue), its workers standing by meanwhile.
			gain, stall, ok := j.replanWeigh(stages, hosts)
			if !ok {
				j.growWait.Forget()
				break
			}
			replanning = true
			waiting := j.growWait.Waiting()
			round := float64(max(j.sync.roundEnd(j, j.step)-j.step, 1)) * j.lastStepSeconds // to the next boundary
			c.ReplanWaits = !j.growWait.ReplanDue(time.Since(j.started).Seconds(), gain, stall, round)
			if c.ReplanWaits && !waiting {
				j.s.log.Info("a join replan waits until what it adds repays its checkpoint and reload", "step", j.step,
					"gain", gain, "stall_s", stall, "round_s", round)
				j.s.event(j.rec.ID, "replan.waiting", "", map[string]any{"step": j.step, "gain": gain,
					"stall_s": stall, "round_s": round, "workers": slices.Sorted(slices.Values(append(slices.Clone(fresh), j.standby...)))})
			}
		case g == nil:
			j.growWait.Forget()
		}
	}
	if refill {
		if !c.PeerState && !(replanning && !c.ReplanWaits) {
			// Asked once per reshare: the planner is not called again at every boundary for
			// standbys it would not place from twins.
			j.refillDue = !c.JoinGapElapsed
			return sched.KeepGoing, nil
		}
		c.Joined = len(j.standby)
	}
	d := sched.Decide(j.membership(), c)
	switch d.Action {
	case sched.Standby:
		if len(fresh) == 0 {
			break // a grow that waits, of workers standing by already
		}
		sort.Strings(fresh)
		j.standby = append(j.standby, fresh...)
		j.s.log.Info("workers joined as standbys; the plan stays", "workers", fresh)
		j.publish()
	case sched.Grow:
		return d.Action, g
	}
	return d.Action, nil
}

// samePlacements reports whether stages and hosts are the plan of a and ahosts.
func samePlacements(stages []placement, hosts []hostPlacement, a []placement, ahosts []hostPlacement) bool {
	return slices.EqualFunc(stages, a, func(x, y placement) bool { return x == y }) &&
		slices.EqualFunc(hosts, ahosts, func(x, y hostPlacement) bool {
			return x.peer == y.peer && x.block == y.block && slices.Equal(x.experts, y.experts)
		})
}

// sameShape reports whether stages are a's replicas and cuts, whoever holds them.
func sameShape(stages, a []placement) bool {
	return slices.EqualFunc(stages, a, func(x, y placement) bool {
		return x.begin == y.begin && x.end == y.end && x.replica == y.replica && x.first == y.first && x.n == y.n
	})
}

// membership is the active plan as the rule book (sched.Decide) sees it.
func (j *jobRun) membership() sched.Membership {
	m := sched.Membership{Sync: j.sync.book(), Phase: j.phase.rule(), Pinned: j.spec.Plan != nil, Restoring: j.phase == phaseRestoring}
	if !j.phase.planned() {
		return m
	}
	for _, rr := range j.reps {
		if j.lostAtLoad[rr.index] != nil {
			continue // out already: its micro-batches go to others at the first step
		}
		r := sched.MemberReplica{Index: rr.index}
		for _, st := range j.stages[rr.lo:rr.hi] {
			r.Peers = append(r.Peers, st.peer)
		}
		m.Replicas = append(m.Replicas, r)
	}
	m.LoadReroutes = j.loadReroutes
	for _, h := range j.hosts {
		m.Hosts = append(m.Hosts, h.peer)
	}
	return m
}

// checkpointNow makes sure the newest complete checkpoint is the current step, taking one and
// waiting for its shards if need be.
func (j *jobRun) checkpointNow(ctx context.Context) error {
	if ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID); err == nil && int(ck.Step) == j.step {
		return nil
	}
	if j.ckRequested != j.step || j.ckVersion != j.version {
		if err := j.checkpoint(ctx, j.step); err != nil {
			return err
		}
		j.lastCheckpoint = time.Now()
	}
	deadline := time.NewTimer(j.checkpointWait())
	defer deadline.Stop()
	defer j.enterFor(phaseCheckpointing)()
	for {
		if ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID); err == nil && int(ck.Step) == j.step {
			return nil
		}
		woke, _, err := j.await(ctx, listen{deadline: deadline.C})
		if d, ok := errors.AsType[*replicaLeft](err); ok && !d.reshare {
			// Outer mode: the replica is dropped from this step on, and the checkpoint, which
			// waits on its shards, is asked again of the replicas left (leftAtBoundary).
			if err := j.leftAtBoundary(ctx, err); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err // a step-mode replica lost (resharing) is the caller's to reshare
		}
		if woke == wokeDeadline {
			return fmt.Errorf("%w: the checkpoint after step %d did not complete in time", errReplan, j.step)
		}
	}
}

// commands takes the admin's actions at a step boundary: pause (and wait here until resumed),
// resume, checkpoint now. Each is recorded as an event.
func (j *jobRun) commands(ctx context.Context) error {
	for {
		if j.hold != holdPaused {
			select {
			case c := <-j.s.commands:
				c.done <- j.do(ctx, c)
				continue
			default:
				return nil
			}
		}
		woke, _, err := j.await(ctx, listen{commands: true, stopping: true})
		switch {
		case woke == wokeStopping:
			return j.stopAtBoundary(ctx)
		case woke == wokeEvent:
			if err != nil && j.phase.planned() {
				if err := j.leftAtBoundary(ctx, err); err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					if j.phase.planned() {
						j.leave(true) // replan once resumed
					}
				}
			}
			if err := j.letGo(ctx); err != nil { // a paused job is at a step boundary
				return err
			}
		case err != nil:
			return err
		}
	}
}

// leftAtBoundary answers a departure err reported at a step boundary where no step or round is
// under way (a paused job, a checkpoint of the step awaited), as the rule book does there (sched.Decide, PhaseBoundary): a step-mode
// replica's survivors reshare (reshare.go), again for a departure meanwhile; an outer-mode replica
// is dropped from this step on, the others keeping their state. It returns nil once answered, and
// any other error (a departure the rule book restores from, a reshare that failed) as it is.
func (j *jobRun) leftAtBoundary(ctx context.Context, err error) error {
	d, ok := errors.AsType[*replicaLeft](err)
	switch {
	case !ok:
		return err
	case d.reshare:
		for d := resharing(err); d != nil; d = resharing(err) {
			err = j.reshare(ctx, d)
		}
		j.publish() // the reshared plan stands at the boundary, still paused
		return err
	}
	if p := j.replicaPos(d.index); p >= 0 {
		j.dropReplica(p, d, j.step, false)
	}
	// A checkpoint of this very step asked at the round's end may wait on the dropped replica's
	// shards (and its stages gather int8's error feedback there): ask it again of those left.
	if j.ckRequested == j.step && j.ckVersion == j.version {
		if ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID); err != nil || int(ck.Step) != j.step {
			return j.checkpoint(ctx, j.step)
		}
	}
	return nil
}

// do carries out an admin's command, wherever the job loop takes one.
func (j *jobRun) do(ctx context.Context, c command) error {
	if c.kind == "drain" {
		return j.drain(ctx, c.worker)
	}
	return j.command(ctx, c.kind)
}

// letGo lets the workers that asked to leave (proto.Leaving) go at this step boundary, as an
// admin's drain does.
func (j *jobRun) letGo(ctx context.Context) error {
	for w := range j.leaving {
		delete(j.leaving, w)
		if err := j.drain(ctx, w); err != nil && ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return nil
}

// drain lets worker go for good at this step boundary. A worker of a step-mode replica goes
// by a reshare (reshare.go). Any other participant's state goes into a checkpoint of this very
// step first (bounded by the step deadline), so that the replan its departure brings restores
// from here, not from the last periodic checkpoint, and nothing is replayed — and the stages
// that stay where they were keep their shards (keepPoint); anyone else goes at once.
func (j *jobRun) drain(ctx context.Context, worker string) error {
	held := j.holds(worker)
	// A worker of a step-mode replica goes as a departure would (sched.Reshare): the others share
	// its micro-batches keeping their shards, and no checkpoint is needed.
	var d sched.Decision
	if held {
		d = sched.Decide(j.membership(), sched.Change{Left: worker})
	}
	checkpointed := false
	if d.Action == sched.Reshare {
		held = false
	}
	if held {
		if err := j.checkpointNow(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			j.s.log.Warn("draining without a checkpoint of this step", "worker", worker, "step", j.step, "err", err)
		} else {
			checkpointed = true
		}
	}
	j.s.event(j.rec.ID, "admin.drain", worker, map[string]any{"step": j.step})
	if j.released == nil {
		j.released = map[string]bool{}
	}
	j.released[worker] = true
	err := j.s.hub.Send(worker, &proto.Bye{Reason: proto.ByeDrain})
	if held {
		// Plan without it now, rather than open a step its departure would fail: it is out of
		// the peer table already, so the planner cannot pick it again before it has gone.
		delete(j.peers, worker)
		if checkpointed {
			j.leaveAtCheckpoint()
		} else {
			j.leave(true)
		}
	}
	if d.Action == sched.Reshare {
		delete(j.peers, worker)
		if err := j.reshare(ctx, &replicaLeft{worker: worker, index: d.Replica, why: "let go at a step boundary: " + d.Why, reshare: true}); err != nil {
			j.s.log.Warn("resharing after a worker was let go failed; replanning", "worker", worker, "err", err)
			j.leave(true)
			return err
		}
	}
	return err
}

func (j *jobRun) command(ctx context.Context, kind string) error {
	switch kind {
	case "pause":
		if j.hold == holdPaused {
			return errors.New("the job is already paused")
		}
		if _, err := j.s.db.SetJobState(ctx, j.rec.ID, storage.JobPaused, "paused by the admin"); err != nil {
			return err
		}
		j.hold, j.state = holdPaused, "paused"
	case "resume":
		if j.hold != holdPaused {
			return errors.New("the job is not paused")
		}
		if _, err := j.s.db.SetJobState(ctx, j.rec.ID, storage.JobRunning, ""); err != nil {
			return err
		}
		j.hold, j.state = holdRunning, "running"
	case "cancel":
		if _, err := j.s.db.SetJobState(ctx, j.rec.ID, storage.JobCancelled, "cancelled by the admin"); err != nil {
			return err
		}
		j.s.event(j.rec.ID, "admin.cancel", "", map[string]any{"step": j.step})
		j.hold = holdCancelled
		return nil
	case "checkpoint":
		if !j.phase.planned() {
			return errors.New("no plan is running: nothing to checkpoint")
		}
		if err := j.checkpoint(ctx, j.step); err != nil {
			return err
		}
		j.lastCheckpoint = time.Now()
	default:
		return fmt.Errorf("unknown command %q", kind)
	}
	j.s.event(j.rec.ID, "admin."+kind, "", map[string]any{"step": j.step})
	j.s.log.Info("admin action", "action", kind, "step", j.step)
	j.publish()
	return nil
}

// replicaOf is the replica of stage k of the active plan.
func (j *jobRun) replicaOf(k int) int {
	for r, rr := range j.reps {
		if k >= rr.lo && k < rr.hi {
			return r
		}
	}
	return 0
}

// pinnedHosts staffs a pinned plan's expert hosts with the spare workers rest, in order (host k
// is rest[k]), and returns them with the workers left over.
func pinnedHosts(experts []job.ExpertShard, rest []string) ([]hostPlacement, []string, error) {
	byHost := map[int]*hostPlacement{}
	var order []int
	for _, es := range experts {
		if es.Host >= len(rest) {
			return nil, nil, fmt.Errorf("%w: the pinned plan needs expert host %d, %d workers are spare", errReplan, es.Host, len(rest))
		}
		h, ok := byHost[es.Host]
		if !ok {
			h = &hostPlacement{peer: rest[es.Host], block: es.Block}
			byHost[es.Host] = h
			order = append(order, es.Host)
		}
		if h.block != es.Block {
			return nil, nil, fmt.Errorf("pinned plan: expert host %d holds experts of blocks %d and %d; a host holds one block", es.Host, h.block, es.Block)
		}
		h.experts = append(h.experts, es.Experts...)
	}
	sort.Ints(order)
	var hosts []hostPlacement
	for _, k := range order {
		h := byHost[k]
		sort.Ints(h.experts)
		hosts = append(hosts, *h)
	}
	return hosts, rest[len(order):], nil
}

// pinnedHostCount is how many workers a pinned plan's expert hosts take (host k is the k-th
// spare worker).
func pinnedHostCount(experts []job.ExpertShard) int {
	n := 0
	for _, es := range experts {
		n = max(n, es.Host+1)
	}
	return n
}

// pinnedReplicas staffs a pinned plan's replicas with the workers ids, in id order, replica after
// replica, then its expert hosts, which serve every replica. When the workers do not suffice for
// all of them — a worker was lost — the leading replicas that can be staffed beside the hosts
// run, and the micro-batches are shared among them in proportion to their pinned shares (each
// keeps at least one): the step computes the same thing whatever the replicas
// (model/gradtree.go), so the job goes on with fewer. With own batches (outer mode) every replica
// keeps all M micro-batches of its own batch. The workers left over stand by. A host of the
// running plan still among ids (held: by host index) stays that host — its experts have no other
// holder, and a plan refilled after a loss keeps them where they are (growable) — and the others
// staff the stages.
func pinnedReplicas(rs []job.Replica, experts []job.ExpertShard, ids []string, M int, own bool, held map[int]string) ([]placement, []hostPlacement, []string, error) {
	reserved := map[string]bool{}
	for _, w := range held {
		if slices.Contains(ids, w) {
			reserved[w] = true
		}
	}
	all := ids
	ids = slices.DeleteFunc(slices.Clone(ids), func(w string) bool { return reserved[w] })
	used, kept, nh := 0, 0, pinnedHostCount(experts)
	for _, r := range rs {
		if used+len(r.Stages)+nh > len(all) {
			break
		}
		used += len(r.Stages)
		kept++
	}
	if kept == 0 {
		return nil, nil, nil, fmt.Errorf("%w: the pinned plan's first replica needs %d workers and its expert hosts %d, %d are connected", errReplan, len(rs[0].Stages), nh, len(all))
	}
	shares := make([]int, kept)
	for i := range shares {
		shares[i] = rs[i].MicroBatches
	}
	if kept < len(rs) && !own {
		shares = sched.WeightedShares(shares, M)
	}
	var out []placement
	k, first := 0, 0
	for r := range kept {
		for _, st := range rs[r].Stages {
			out = append(out, placement{peer: ids[k], begin: st[0], end: st[1], replica: r, first: first, n: shares[r]})
			k++
		}
		if !own {
			first += shares[r]
		}
	}
	// Host h is rest[h]: its holder where it has one, the next spare worker otherwise.
	spare := ids[k:]
	var rest []string
	for h := range nh {
		if w := held[h]; reserved[w] {
			rest = append(rest, w)
		} else if len(spare) > 0 {
			rest, spare = append(rest, spare[0]), spare[1:]
		}
	}
	hosts, standby, err := pinnedHosts(experts, append(rest, spare...))
	return out, hosts, standby, err
}

// pinnedHostHolders are the workers of the running pinned plan's expert hosts, by host index (a
// pinned plan's hosts are placed in host order: pinnedHosts); nil when it has none.
func (j *jobRun) pinnedHostHolders() map[int]string {
	p := j.spec.Plan
	if p == nil || !j.phase.planned() || len(j.hosts) == 0 {
		return nil
	}
	var idx []int
	for _, es := range p.Experts {
		if !slices.Contains(idx, es.Host) {
			idx = append(idx, es.Host)
		}
	}
	slices.Sort(idx)
	if len(idx) != len(j.hosts) {
		return nil
	}
	out := map[int]string{}
	for i, h := range idx {
		out[h] = j.hosts[i].peer
	}
	return out
}

// signingKey is worker's signing key (proto.Hello.SigningKey), nil when it gave none.
func (j *jobRun) signingKey(worker string) []byte {
	if p := j.peers[worker]; p != nil && p.hello != nil {
		return p.hello.SigningKey
	}
	return nil
}

// reducePeers are the stages of other replicas holding a tensor stage k holds too: blocks in
// common, or both first (the embedding), or both last (the head).
func reducePeers(stages []placement, k int) []proto.ReducePeer {
	me := stages[k]
	last := func(i int) bool { return i+1 == len(stages) || stages[i+1].replica != stages[i].replica }
	var out []proto.ReducePeer
	for i, st := range stages {
		if st.replica == me.replica {
			continue
		}
		overlap := st.begin < me.end && me.begin < st.end
		if overlap || (st.begin == 0 && me.begin == 0) || (last(i) && last(k)) {
			out = append(out, proto.ReducePeer{Worker: st.peer, Replica: st.replica, First: st.first, MicroBatches: st.n,
				Begin: st.begin, End: st.end})
		}
	}
	return out
}

// linkBounds says, for a plan choice, what the replica planner assumed the peers' links could
// carry (boundLinks): "through links of 80 MB/s", or "of 32–80 MB/s" where they differ.
func linkBounds(peers []sched.Peer) string {
	lo, hi := math.Inf(1), 0.0
	for _, p := range peers {
		lo, hi = min(lo, p.LinkBytesPerS), max(hi, p.LinkBytesPerS)
	}
	if lo == hi {
		return fmt.Sprintf("through links of %.0f MB/s", lo/1e6)
	}
	return fmt.Sprintf("through links of %.0f–%.0f MB/s", lo/1e6, hi/1e6)
}

// handing are the workers the active plan leaves out that hand the stage they held to a taker
// while it loads, then stand by (sched.StandbyGivers): their Ready is waited for, and a departure
// or an error of theirs meanwhile fails the plan, as a participant's would (handingOver).
func (j *jobRun) handing() []string {
	return sched.StandbyGivers(heldStages(j.stages), j.tookFrom)
}

// handingOver says whether worker id hands its stage over under the plan getting ready.
func (j *jobRun) handingOver(id string) bool {
	return (j.phase == phaseLoading || j.phase == phaseRejoining) && slices.Contains(j.handing(), id)
}

// stageShardAt is stage i of stages, a plan's placements cut into replica runs reps, as its Assign
// gives it: its place in its replica.
func stageShardAt(stages []placement, reps []replicaRun, i int) proto.Shard {
	rr := replicaRun{lo: 0, hi: len(stages)}
	for _, r := range reps {
		if i >= r.lo && i < r.hi {
			rr = r
		}
	}
	st, k, n := stages[i], i-rr.lo, rr.hi-rr.lo
	return proto.Shard{Stage: &proto.StageShard{Index: k, Count: n, Begin: st.begin, End: st.end, First: k == 0, Last: k == n-1}}
}

// heldStages are stages as sched sees who holds which blocks.
func heldStages(stages []placement) []sched.HeldStage {
	out := make([]sched.HeldStage, len(stages))
	for i, st := range stages {
		out[i] = sched.HeldStage{Peer: st.peer, Begin: st.begin, End: st.end}
	}
	return out
}
