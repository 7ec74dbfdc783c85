package coordinator

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
	"golang.org/x/sync/semaphore"
)

// Verification of volunteered work (docs/design.md, "Verification and credit"; package audit has the protocol).
//
// Every training step's report carries the shard's commitment. After a step's reports are in,
// before its clip factor goes out:
//
//  1. crossCheck compares what each worker says it sent with what its recipient says it received,
//     and the coordinator's own tokens and targets with what the stages say they got. A worker
//     that denies what the coordinator sent it is banned; two workers that disagree about a tensor
//     between them cannot be told apart (frames are not signed), so both are dropped from the
//     plan and the step is abandoned.
//  2. pickAudits draws, with the coordinator's own randomness, which shards of the *previous* step
//     to audit: that step's update is now committed too (this report's state digest). Each shard
//     is drawn with the job's audit_rate r, independently at every step, and besides at any step
//     that ends a run of W = AuditWindow() of its steps none of which was audited (gapDue): so a
//     worker that cheats on every step is caught within W of its steps whatever the draws, and no
//     step is ever audited with less than r, whatever the worker has seen. Before that, the
//     chain of custody (custody.go) checks each shard's first commitment under a plan against the
//     state it was handed, and step-mode replicas' stages holding the same blocks against each
//     other.
//  3. The audited worker uploads its evidence (POST /api/audits/{id}); Check binds it to the
//     commitments, the coordinator recomputes the shard's step on its own cores (Config.Recompute)
//     and compares: bit for bit when the worker computes with the coordinator's kernel family,
//     within audit's tolerances otherwise. The job goes on meanwhile.
//  4. A pass vouches for the worker's pending credit up to that step. A failure — evidence that
//     contradicts the commitments, a different result, no evidence while still connected — bans
//     the worker from the job (event peer.banned), rejects its credit, discards every checkpoint
//     its work went into, and the job replays from the newest checkpoint computed without it,
//     landing on the parameters a fault-free run reaches (Determinism).
//  5. An audit left unanswered is not a verdict, but it vouches for nothing either: a worker that
//     leaves with an audit pending (its session ends, and its evidence with it), or whose uploads
//     of the evidence never complete within the wait its measured uplink allows (evidenceWait),
//     abandons the audit (event audit.abandoned). Its pending work — what no passed audit vouches
//     for — is rejected, every checkpoint holding it is discarded, and the job replays from the
//     newest checkpoint taken before its first unverified step, as for a ban but without one; a
//     worker that abandons maxAbandons audits in a job is banned. An upload that is cut — its
//     connection lost, stalled, or its bundle ending before its declared end — is never judged:
//     the audit waits for another upload, and the worker retries (client/audit.go).
//
// What a one-step cheat risks. Let r be the job's audit_rate and W its window. A cheat on one step
// t — a false update, false tensors sent, a false report — is seen only by an audit of step t
// itself: the next report commits to the cheated state, and every later step starts honestly from
// it, so later audits pass (custody.go). For a shard held by one worker, step t is audited with
// probability f = r/(1−(1−r)^W) on average (the share of its steps audited) and with at least r
// whatever it has seen: its escape probability per cheated step is 1 − f on average, at most
// 1 − r at the step it chooses best (0.85 and 0.9 at the default r = 0.1, W = 10), and k cheated
// steps escape with at most (1−r)^k. That is all sampling can do: these audits cost f of the
// shard-steps (0.154 at the default); no draw costing a fraction f of a single holder's steps
// catches the cheat on the step the cheater picks with a probability above f, and this one
// catches it with at least r; the rest of f buys the bound of W steps on a cheat of every step.
// A poisoned start state (a shard changed before its first step) is caught with certainty at its
// first report. Outer mode's inner steps have the same
// odds, replica by replica (outeraudit.go): its replicas hold different θ_r, so no twin gives a
// cheat away, and a stage that changes its state at an outer step other than the outer step does
// is caught at its next report when the change contradicts what it commits to (its start state
// not its parameters and moments, or without a delay not the global θ), and otherwise — a false
// global θ — put in dispute by its holders' disagreement and refused at the next outer step, whose
// contributions are signed over the global θ their senders start from. What remains open there:
// a delayed step's take-up is not recomputed, and a plan's last step is not drawn. A stage of step-mode replicas held
// by two workers of one CPU kernel family (twinDisputes) is caught with certainty at the next
// report when the cheat changes its state (a false update), whatever the draws — unless that
// step is the last before a replan, which is drawn as on a single holder (drawBeforeReplan); a
// cheat that changes only what it sends or reports escapes as on a single holder, except a false
// norm, which its twins' norms give away (dispute).
//
// The coordinator is its own referee: its recomputation is the one it trusts, so a disagreement
// needs no third opinion. What it cannot referee is a cross-backend comparison that a router
// near-tie pushes over tolerance (see audit's tolerances); the honest-fleet soak measures how
// often that happens.

// AuditStatus summarises the job's verification for /api/status and the dashboard.
type AuditStatus struct {
	Rate   float64 `json:"rate"`   // the job's audit_rate
	Window int     `json:"window"` // every shard is audited at least once in any this many of its consecutive steps
	Audits int64   `json:"audits"` // shard-steps recomputed so far
	Passed int64   `json:"passed"`
	Failed int64   `json:"failed"`
	// Inconclusive counts cross-family differences in jobs with compressed boundaries, which
	// audit.Compare cannot judge: neither banned nor credited.
	Inconclusive int64 `json:"inconclusive"`
	// RecomputeS is the coordinator's time spent recomputing audited steps, and ComputeShare the
	// audited shard-steps as a share of all shard-steps computed: the cost of verification.
	RecomputeS   float64 `json:"recompute_s"`
	ComputeShare float64 `json:"compute_share"`
	// EvidenceBytes is the evidence uploaded for the audits recomputed: what verification costs
	// the volunteers' uplinks.
	EvidenceBytes int64 `json:"evidence_bytes"`
}

// auditSummary is the job's AuditStatus; nil when the job does not audit.
func (j *jobRun) auditSummary() *AuditStatus {
	if j.audits == nil {
		return nil
	}
	st := j.audits.stats
	st.Rate, st.Window = j.spec.AuditRate, j.spec.AuditWindow()
	if j.audits.shardSteps > 0 {
		st.ComputeShare = float64(st.Audits) / float64(j.audits.shardSteps)
	}
	return &st
}

// errRollback abandons the step in flight because the job rolls back to an earlier checkpoint:
// errBanned when a worker was banned, errAbandoned when one left an audit unanswered.
var (
	errRollback = fmt.Errorf("%w: the job rolls back", errReplan)
	errBanned   = fmt.Errorf("%w: a worker was banned", errRollback)
	// errTakeoverCopies: in a step with a stage takeover, the taker sent a neighbour of the lost
	// stage another tensor than the lost stage had sent it under the same key (crossCheckOf);
	// the step is disputed, as a divergence between replicas is.
	errTakeoverCopies = fmt.Errorf("%w: a taker's copy differs from the lost stage's", errStep)
	errAbandoned      = fmt.Errorf("%w: a worker left an audit unanswered", errRollback)
)

// maxAbandons is how many audits a worker may abandon in one job (leave with them pending, or
// never complete their upload) before it is banned. The first costs it only the work no audit
// vouches for, as a crash or a lost connection would; a worker that abandons again is taken for
// one that leaves whenever its work is checked, and every abandonment costs the job a replay.
const maxAbandons = 2

// stepRecord is what the audits of a step need from it once the next step has run.
type stepRecord struct {
	plan    uint32
	spec    proto.StepSpec
	lr      float64
	clip    float32
	workers []string // participants, in plan order
	stages  int      // how many of them are stages (the rest are expert hosts)
	reports map[string]*proto.StepReport
}

// pendingAudit is an audit asked of a worker, waiting for its evidence or its verdict.
type pendingAudit struct {
	id       int64
	job      string
	worker   string
	step     int
	rec      *stepRecord
	assign   *proto.Assign
	next     string // the state digest the worker committed to after the step
	exact    bool
	sample   uint64 // the seed of the thin evidence asked (proto.Audit.Sample)
	maxBytes int64
	bytes    int64 // the evidence's size, once received
	asked    time.Time
	// Guarded by the registry's lock: busy while its evidence is being received or checked, got
	// once it was received whole; left once the worker's session ended (its evidence went with
	// it); tries counts the uploads begun.
	busy, got bool
	left      bool
	tries     int
	// unapplied: a dispute's audit (dispute), of a step that was never applied; it earns no
	// credit, since the step is computed again.
	unapplied bool
}

// auditResult is the verdict on one audit, from the goroutine that checked it.
type auditResult struct {
	id      int64
	reason  string // "" when the work is the recomputed one
	elapsed time.Duration
	err     error // the coordinator could not check (its own failure): no verdict
}

// auditor is the job loop's audit state; the upload handler reaches pending audits through the
// server's registry (auditRegistry).
type auditor struct {
	rng        *rand.Rand
	unaudited  map[string]int // worker → the first step of its current run of unaudited steps (gapDue)
	custody    *custody       // the states the active plan's shards started from (custody.go)
	prev       *stepRecord    // the last step run, whose audits the next report decides
	assigns    map[string]*proto.Assign
	first      map[string]int // worker → the first step it computed since the job (re)started here
	banned     map[string]bool
	abandons   map[string]int // worker → audits it abandoned in this job
	ckCommit   *ckCommit      // the checkpoint whose shards still await the check against commitments
	outer      *outerAudit    // outer mode's replicas, audited each at its own pace (outeraudit.go)
	stats      AuditStatus
	shardSteps int64
}

func newAuditor() *auditor {
	var seed [16]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return &auditor{rng: rand.New(rand.NewPCG(binary.LittleEndian.Uint64(seed[:8]), binary.LittleEndian.Uint64(seed[8:]))),
		unaudited: map[string]int{}, assigns: map[string]*proto.Assign{}, first: map[string]int{}, banned: map[string]bool{}, abandons: map[string]int{}}
}

// auditRegistry holds the audits waiting for evidence, for the upload handler.
type auditRegistry struct {
	mu      sync.Mutex
	next    int64
	pending map[int64]*pendingAudit
}

func (r *auditRegistry) add(a *pendingAudit) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pending == nil {
		r.pending = map[int64]*pendingAudit{}
	}
	r.next++
	a.id = r.next
	r.pending[a.id] = a
	return a.id
}

// take marks audit id busy for worker and returns it; the error says why not.
func (r *auditRegistry) take(id int64, worker string) (*pendingAudit, int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	a, ok := r.pending[id]
	switch {
	case !ok || a.left || a.worker != worker:
		// One answer for an audit that does not exist and another worker's: which audits are
		// pending, and whose, is nobody else's business. An audit of a session that ended is
		// abandoned: the worker's new session holds none of that evidence.
		return nil, http.StatusConflict, fmt.Errorf("no audit %d is waiting for your evidence", id)
	case a.got:
		return nil, http.StatusConflict, fmt.Errorf("the evidence of audit %d was received already", id)
	case a.busy:
		// Most often the coordinator has not yet seen the end of an upload that was cut: the
		// worker tries again.
		return nil, http.StatusServiceUnavailable, fmt.Errorf("the evidence of audit %d is being received already", id)
	}
	a.busy = true
	a.tries++
	return a, 0, nil
}

// leave marks the audits of worker abandoned: its session ended.
func (r *auditRegistry) leave(worker string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, a := range r.pending {
		if a.worker == worker {
			a.left = true
		}
	}
}

// snapshot returns copies of the pending audits of job, their state as of now.
func (r *auditRegistry) snapshot(job string) []pendingAudit {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []pendingAudit
	for _, a := range r.pending {
		if a.job == job {
			out = append(out, *a)
		}
	}
	slices.SortFunc(out, func(a, b pendingAudit) int { return cmp.Compare(a.id, b.id) })
	return out
}

// received marks audit id's evidence received whole: no other upload is taken.
func (r *auditRegistry) received(id, bytes int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if a, ok := r.pending[id]; ok {
		a.got, a.bytes = true, bytes
	}
}

// release makes an audit whose upload failed take another upload.
func (r *auditRegistry) release(id int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if a, ok := r.pending[id]; ok {
		a.busy = false
	}
}

func (r *auditRegistry) done(id int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.pending, id)
}

// all returns the pending audits of job.
func (r *auditRegistry) all(job string) []*pendingAudit {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*pendingAudit
	for _, a := range r.pending {
		if a.job == job {
			out = append(out, a)
		}
	}
	return out
}

// kernelFamily is the arithmetic this process computes with: the SIMD kernels fuse each
// multiply-add, the portable ones round the product first (kernels/doc.go). Two CPUs of one
// family compute the same bits.
func kernelFamily() string {
	if kernels.ISA() == "purego" {
		return proto.KernelsPortable
	}
	return proto.KernelsFMA
}

// recordAssign remembers the assignment a worker holds: its audits recompute with it.
func (j *jobRun) recordAssign(worker string, a *proto.Assign) {
	if j.audits != nil {
		j.audits.assigns[worker] = a
		j.expectState(worker, a)
	}
}

// crossCheck checks the commitments of step s's reports against each other and against the
// coordinator's own tensors (x, y: the step's tokens and targets).
func (j *jobRun) crossCheck(ctx context.Context, s int, st proto.StepSpec, reports []*proto.StepReport, x, y []int32) error {
	parts := j.participants()
	for i, r := range reports {
		if r.Commit == nil {
			return j.ban(ctx, parts[i], s, "its report carries no commitment, and the job audits")
		}
	}
	if err := j.checkCustody(ctx, s, reports); err != nil {
		return err
	}
	// The coordinator's tensors: tokens to the first stage, targets to the last, of the replica
	// computing the micro-batch.
	ends := func(mb int) (int, int) {
		first, last := 0, len(j.stages)-1
		for _, rr := range j.reps {
			if mb >= rr.first && mb < rr.first+rr.n {
				first, last = rr.lo, rr.hi-1
			}
		}
		// A stage taken over at a pipeline's end (takeover.go): its taker got the lost run's
		// tokens or targets, and the lost stage's replica has no stage there now.
		if r := j.reroutedAt(s); r != nil && r.takeover != nil {
			t := r.takeover
			if mb >= t.tk.First && mb < t.tk.First+t.tk.MicroBatches {
				taker := slices.IndexFunc(j.stages, func(st placement) bool { return st.peer == t.tk.Taker })
				if t.first() {
					first = taker
				}
				if t.last() {
					last = taker
				}
			}
		}
		return first, last
	}
	return j.crossCheckOf(ctx, s, st, parts, reports, x, y, 0, st.MicroBatches, ends)
}

// crossCheckOf is crossCheck of the participants parts and their reports (each with a
// commitment), in the same order, whose micro-batches [lo, hi) of x and y the coordinator sent:
// micro-batch mb's tokens to parts[first] and targets to parts[last] (ends).
func (j *jobRun) crossCheckOf(ctx context.Context, s int, st proto.StepSpec, parts []string, reports []*proto.StepReport, x, y []int32, lo, hi int, ends func(mb int) (first, last int)) error {
	recv := make([]map[string]string, len(parts))
	for i, r := range reports {
		recv[i] = make(map[string]string, len(r.Commit.Recv))
		for _, d := range r.Commit.Recv {
			recv[i][d.Key] = d.Digest
		}
	}
	T := j.spec.Model.BlockSize
	n := st.Rows * T
	for mb := lo; mb < hi; mb++ {
		xt, yt, err := proto.TokenTensors(st, mb, T, x[mb*n:(mb+1)*n], y[mb*n:(mb+1)*n])
		if err != nil {
			return err
		}
		first, last := ends(mb)
		for _, c := range []struct {
			i int
			t proto.Tensor
		}{{first, xt}, {last, yt}} {
			k := proto.KeyID(c.t.Key)
			if recv[c.i][k] != audit.TensorDigest(c.t) {
				return j.ban(ctx, parts[c.i], s, fmt.Sprintf("it commits to %v other than the coordinator sent", c.t.Key))
			}
			delete(recv[c.i], k)
		}
	}
	index := map[string]int{}
	for i, p := range parts {
		index[p] = i
	}
	// A step rerouted around a lost replica (reroute.go): what survivors sent to its workers went
	// nowhere now checked, what they received from them was committed to by nobody here, and a
	// gradient node sent before a reroute widened its sender's run may never have been taken —
	// its receiver took the larger node it merged into. What was taken must still have been
	// sent as committed.
	rec := j.reroutedAt(s)
	var tk *proto.StageTakeover
	if rec != nil && rec.takeover != nil {
		tk = &rec.takeover.tk
		// A neighbour of the lost stage sends its taker again what it sent the lost stage, the
		// same tensor under the same key: two different ones contradict each other, whoever
		// received them.
		for i, r := range reports {
			to := map[string]string{}
			for _, d := range r.Commit.Sent {
				if d.To == tk.Lost || d.To == tk.Taker {
					if prev, ok := to[d.Key]; ok && prev != d.Digest {
						return j.ban(ctx, parts[i], s, fmt.Sprintf("it commits to sending %s to %s and to %s, which took its stage over, as two different tensors", d.Key, tk.Lost, tk.Taker))
					}
					to[d.Key] = d.Digest
				}
			}
		}
	}
	for i, r := range reports {
		for _, d := range r.Commit.Sent {
			to, ok := index[d.To]
			if !ok && rec != nil && rec.workers[d.To] {
				continue
			}
			if !ok || to == i {
				return j.ban(ctx, parts[i], s, fmt.Sprintf("it commits to sending %s to %s, which is not its neighbour", d.Key, d.To))
			}
			got, ok := recv[to][d.Key]
			if !ok && rec != nil && gradNode(d.Key) {
				continue
			}
			if ok && got != d.Digest && tk != nil && parts[i] == tk.Taker && (d.To == tk.Prev || d.To == tk.Next) {
				// The lost stage's neighbour kept the lost stage's copy, which came first, and
				// the taker computed another: the taker lies, or the lost stage did — which only
				// a recomputation of the taker tells (dispute), not the link.
				return fmt.Errorf("%w: step %d: %s and %s, which %s took over, sent %s two different tensors (%s)", errTakeoverCopies, s, tk.Taker, tk.Lost, tk.Taker, d.To, d.Key)
			}
			if !ok || got != d.Digest {
				// One of the two is lying, or the link corrupts; which cannot be told here.
				j.s.event(j.rec.ID, "link.disputed", parts[i], map[string]any{"step": s, "to": d.To, "tensor": d.Key})
				j.s.hub.Drop(parts[i], fmt.Errorf("step %d: %s says it received other than you say you sent", s, d.To))
				j.s.hub.Drop(d.To, fmt.Errorf("step %d: %s says it sent other than you say you received", s, parts[i]))
				return fmt.Errorf("%w: step %d: %s and %s disagree about tensor %s", errStep, s, parts[i], d.To, d.Key)
			}
			delete(recv[to], d.Key)
		}
	}
	for i := range recv {
		for k := range recv[i] {
			if rec != nil && rec.fromLeftOut(k) {
				continue
			}
			return j.ban(ctx, parts[i], s, fmt.Sprintf("it commits to receiving %s, which nobody sent", k))
		}
	}
	return nil
}

// pickAudits decides, after step s's reports and before its clip, which shards of step s−1 to
// audit, and asks them for their evidence; the workers in force are audited whatever the draws.
func (j *jobRun) pickAudits(ctx context.Context, s int, reports []*proto.StepReport, force map[string]bool) {
	a := j.audits
	prev := a.prev
	if prev == nil || prev.plan != j.version || prev.spec.Step != uint64(s-1) {
		return // a replan in between: the workers dropped that evidence with their old shard
	}
	for i, w := range j.participants() {
		if i >= len(prev.workers) || prev.workers[i] != w || reports[i].Commit == nil {
			continue
		}
		j.askAudit(ctx, w, s-1, prev, reports[i].Commit.State, force[w])
	}
}

// askAudit draws whether to audit worker's step and asks for the evidence if so. next is the
// state digest the worker committed to after the step.
func (j *jobRun) askAudit(ctx context.Context, worker string, step int, rec *stepRecord, next string, force bool) {
	j.askAuditOf(ctx, worker, step, rec, next, force, j.audits.assigns[worker])
}

// askAuditOf is askAudit of a step worker computed under assignment asg: an earlier plan's, when
// the plan changed around a kept shard (reshare.go).
func (j *jobRun) askAuditOf(ctx context.Context, worker string, step int, rec *stepRecord, next string, force bool, asg *proto.Assign) {
	a := j.audits
	a.shardSteps++
	if !a.drawn(worker, step, j.spec.AuditRate, j.spec.AuditWindow(), force) {
		return
	}
	p := j.peers[worker]
	if asg == nil || p == nil {
		return
	}
	a.audited(worker, step)
	exact := p.exactKernels()
	// Bit for bit, the commitments bind what a recomputation yields: the evidence can be lean.
	// Either way it is thin: its large moments sampled by a seed drawn now, after the worker
	// committed.
	pa := &pendingAudit{job: j.rec.ID.String(), worker: worker, step: step, rec: rec, assign: asg, next: next, exact: exact,
		sample: a.sample(), maxBytes: j.evidenceBytes(asg, exact), asked: time.Now()}
	id := j.s.auditReg.add(pa)
	m := &proto.Audit{Step: uint64(step), PlanVersion: rec.plan, UploadPath: proto.AuditPath(id), Lean: exact, Sample: pa.sample}
	if err := j.s.hub.Send(worker, m); err != nil {
		j.s.auditReg.done(id)
		return
	}
	j.s.log.Debug("audit asked", "worker", worker, "step", step, "id", id, "exact", exact)
}

// sample is the seed of an audit's thin evidence (proto.Audit.Sample): never 0, and drawn when
// the audit is asked, so that a worker cannot know which groups of its state will be looked at
// when it commits to them. It comes from crypto/rand, not the auditor's rng: the worker sees the
// seed, and a PCG's whole output can be predicted from a few of its words — the audits it draws
// too.
func (a *auditor) sample() uint64 {
	var b [8]byte
	if _, err := crand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return binary.LittleEndian.Uint64(b[:]) | 1
}

// drawn is the draw of worker's step: forced, due (gapDue), or at rate. The caller records the
// audit (audited) once it asks for it.
func (a *auditor) drawn(worker string, step int, rate float64, W int, force bool) bool {
	due := a.gapDue(worker, step, W) // first, whatever else decides: it starts a worker's run
	return force || due || a.rng.Float64() < rate
}

// gapDue reports whether worker's step must be audited because its last W−1 steps drawn were
// not: the draws at rate r may leave a shard unaudited for any number of steps, and this bound is
// what catches a worker faulty on every step within W of its steps whatever the draws. It forces
// an audit only where the draws left a gap of W−1 (a step skipped — a replan, a dispute, a replica
// at maxOpenAudits — counts as unaudited), which is the least a bound of W costs on top of the
// draws: r/(1−(1−r)^W) of the shard-steps in all, 0.154 at the default r = 0.1, W = 10, where
// tiling the steps into windows of W with one secret pick each cost r + (1−r)/W = 0.19 for the
// same two guarantees. A worker learns from the rule only that a step is sure to be audited; no
// step is ever safer than r. A step before the current run (a rollback replays it) starts the run
// there again.
func (a *auditor) gapDue(worker string, step, W int) bool {
	if W <= 0 {
		return false
	}
	since, ok := a.unaudited[worker]
	if !ok || step < since {
		since = step
		a.unaudited[worker] = since
	}
	return step-since >= W-1
}

// audited records that worker's step is audited: its run of unaudited steps starts after it.
func (a *auditor) audited(worker string, step int) {
	if s, ok := a.unaudited[worker]; !ok || step+1 > s {
		a.unaudited[worker] = step + 1
	}
}

// evidenceBytes bounds a bundle of the shard of asg: two states of its tensors (parameters and
// two moments each) and the step's traffic, which is at most every activation and gradient of the
// step crossing the shard a few times over. A lean bundle (proto.Audit.Lean) has one state and
// of the gradient-tree nodes only those received.
func (j *jobRun) evidenceBytes(asg *proto.Assign, lean bool) int64 {
	cfg := j.spec.Model
	var params int64
	specs, err := shardSpecs(cfg, asg.Shard, hostedBy(asg.ExpertHosts))
	if err != nil {
		specs = cfg.Specs() // the whole model's: a bound all the same
	}
	for _, sp := range specs {
		params += int64(sp.Size())
	}
	rows := int64(j.spec.BatchSize)
	if r := asg.Replica; r != nil && j.spec.OwnBatches() && j.spec.MicroBatches > 0 {
		// An outer-mode replica's own batch: n_r micro-batches of B/M rows, up to 64·M of them.
		rows = max(rows, int64(r.MicroBatches)*int64(j.spec.BatchSize/j.spec.MicroBatches))
	}
	act := rows * int64(cfg.BlockSize) * int64(cfg.NEmbd) * 4
	moe := int64(max(cfg.NumMoE(), 1)) * int64(max(cfg.TopK, 1))
	// A replica's stage also receives the other replicas' gradient-tree nodes and sends its own
	// to each of them (client/replica.go): a node is at most the shard's gradient.
	var nodes int64
	if r := asg.Replica; r != nil && !j.spec.Outer() {
		M := j.spec.MicroBatches
		mine := int64(len(model.TreeNodes(M, r.First, r.First+r.MicroBatches)))
		if lean {
			mine = 0
		}
		for _, p := range r.Peers {
			nodes += mine + int64(len(model.TreeNodes(M, p.First, p.First+p.MicroBatches)))
		}
	}
	states := int64(2)
	if lean {
		states = 1
	}
	return states*3*4*params + act*(4+4*moe) + 4*params*nodes + 1<<20
}

// maxOpenAudits bounds the audits waiting for evidence or a verdict: each holds a shard's
// evidence in the coordinator's memory while it waits for the one recomputation at a time, so the
// job waits for verdicts rather than run ahead of its auditor.
const maxOpenAudits = 4 // a worker takes this many evidence uploads at once (client.maxAuditSpills)

// auditBackpressure waits, before a step opens, until fewer than maxOpenAudits audits are open.
func (j *jobRun) auditBackpressure(ctx context.Context) error {
	if j.audits == nil {
		return nil
	}
	if err := j.auditTimeouts(ctx); err != nil {
		return err
	}
	return j.awaitAudits(ctx, func() bool { return len(j.s.auditReg.all(j.rec.ID.String())) >= maxOpenAudits })
}

// awaitAudits runs the job loop's audit work — verdicts, uploads, hub events, evidence timeouts —
// while waiting holds; a verdict's ban (errBanned) or a replan ends it early.
func (j *jobRun) awaitAudits(ctx context.Context, waiting func() bool) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for waiting() {
		woke, _, err := j.await(ctx, listen{timer: tick.C, verdicts: true})
		if err != nil {
			return err
		}
		if woke == wokeTimer {
			if err := j.auditTimeouts(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// dispute settles a step whose holders of one tensor reported different norms (cause, wrapping
// proto.ErrReplicasDiverged): every holder summed the same gradient-tree nodes, so somebody
// computed or reported falsely, or sent its peers other nodes than it used — and, unsettled, one
// such peer would fail the step again at every try and stop the job. No clip factor has gone out:
// the step is not applied anywhere. The commitments are cross-checked first (a worker whose
// traffic nobody else saw is banned there); then every participant is asked for the evidence of
// the unapplied step, and each is recomputed (judge) up to its report and what it sent. The
// workers whose recomputation differs are banned, and errBanned rolls the job back without them;
// when none differs — a difference too small for a comparison across kernel families to judge —
// the step fails as before. Without audits the job cannot tell who lied: the step fails.
//
// A step with a stage takeover whose taker sent a neighbour of the lost stage another tensor than
// the lost stage had (errTakeoverCopies) is disputed the same way: a taker whose recomputation
// differs is banned; when none differs, the lost stage sent what an honest one would not, its
// neighbour computed with it, and the step fails.
func (j *jobRun) dispute(ctx context.Context, s int, st proto.StepSpec, lr float64, reports []*proto.StepReport, x, y []int32, cause error) error {
	failed := fmt.Errorf("%w: step %d: %v", errStep, s, cause)
	if j.audits == nil || j.spec.Outer() {
		return failed
	}
	if err := j.crossCheck(ctx, s, st, reports, x, y); err != nil && !errors.Is(err, errTakeoverCopies) {
		return err
	}
	j.s.event(j.rec.ID, "step.disputed", "", map[string]any{"step": s, "reason": cause.Error()})
	parts := j.participants()
	rec := &stepRecord{plan: j.version, spec: st, lr: lr, clip: 1, workers: parts, reports: map[string]*proto.StepReport{}}
	ids := map[int64]bool{}
	for i, w := range parts {
		rec.reports[w] = reports[i]
		asg, p := j.audits.assigns[w], j.peers[w]
		if asg == nil || p == nil {
			continue
		}
		exact := p.exactKernels()
		pa := &pendingAudit{job: j.rec.ID.String(), worker: w, step: s, rec: rec, assign: asg, exact: exact,
			sample: j.audits.sample(), maxBytes: j.evidenceBytes(asg, exact), asked: time.Now(), unapplied: true}
		id := j.s.auditReg.add(pa)
		if err := j.s.hub.Send(w, &proto.Audit{Step: uint64(s), PlanVersion: j.version, UploadPath: proto.AuditPath(id), Unapplied: true,
			Lean: exact, Sample: pa.sample}); err != nil {
			j.s.auditReg.done(id)
			continue
		}
		ids[id] = true
	}
	open := func() bool {
		for _, pa := range j.s.auditReg.all(j.rec.ID.String()) {
			if ids[pa.id] {
				return true
			}
		}
		return false
	}
	// onAudit bans a worker whose recomputation differs, and so returns errBanned.
	if err := j.awaitAudits(ctx, open); err != nil {
		return err
	}
	return failed
}

// finishAudits audits the job's last step on every shard — its update is committed by the final
// checkpoint's shards, which an audit thereby checks against a recomputation: the model the job
// hands over is verified, not only sampled — and waits for every audit still open. It returns errBanned when one failed: the job
// rolls back and goes on.
func (j *jobRun) finishAudits(ctx context.Context) error {
	a := j.audits
	if a == nil {
		return nil
	}
	if prev := a.prev; prev != nil && prev.plan == j.version && int(prev.spec.Step) == j.spec.Steps-1 {
		ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
		if err != nil {
			return err
		}
		digests, err := j.shardStates(ck)
		if err != nil {
			return err
		}
		for _, w := range prev.workers {
			if d, ok := digests[w]; ok {
				j.askAudit(ctx, w, int(prev.spec.Step), prev, d, true)
			}
		}
		a.prev = nil
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for len(j.s.auditReg.all(j.rec.ID.String())) > 0 {
		woke, _, err := j.await(ctx, listen{timer: tick.C, verdicts: true, idle: true})
		if err != nil {
			return err
		}
		if woke == wokeTimer {
			if err := j.auditTimeouts(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// shardStates is the state digest of each participant's shard in checkpoint ck, which the active
// plan took (its shards are named by participant).
//
// A checkpoint this plan requested maps each shard to the worker asked for it then (ckHolders):
// a stage taken over since (takeover.go) shifted the participants' indices.
func (j *jobRun) shardStates(ck storage.Checkpoint) (map[string]string, error) {
	if h := j.ckHolders; h != nil && h.id == ck.ID {
		out, err := shardStatesOf(j.s.blobs, ck, nil, 0, h.workers)
		return out, err
	}
	return shardStatesOf(j.s.blobs, ck, j.participants(), len(j.stages), nil)
}

// ckHolders is, for checkpoint id, the worker asked for each of its shards, by name.
type ckHolders struct {
	id      int64
	workers map[string]string
}

// shardStatesOf is the state digest of each shard in checkpoint ck taken by a plan of
// participants parts, of which the first stages are stages: stage-i is participant i, experts-n
// participant stages+n.
func shardStatesOf(blobs *storage.BlobStore, ck storage.Checkpoint, parts []string, stages int, holders map[string]string) (map[string]string, error) {
	out := map[string]string{}
	for _, sh := range ck.Shards {
		if holders != nil {
			w, ok := holders[sh.Name]
			if !ok {
				continue
			}
			d, err := uploadedDigest(blobs, sh)
			if err != nil {
				return nil, err
			}
			out[w] = d
			continue
		}
		i := -1
		if k, ok := strings.CutPrefix(sh.Name, "stage-"); ok {
			i, _ = strconv.Atoi(k)
		} else if k, ok := strings.CutPrefix(sh.Name, "experts-"); ok {
			if n, err := strconv.Atoi(k); err == nil {
				i = stages + n
			}
		}
		if i < 0 || i >= len(parts) {
			continue
		}
		d, err := uploadedDigest(blobs, sh)
		if err != nil {
			return nil, err
		}
		out[parts[i]] = d
	}
	return out, nil
}

// uploadedDigest is the state digest of checkpoint shard sh, as uploaded.
func uploadedDigest(blobs *storage.BlobStore, sh storage.Shard) (string, error) {
	f, err := blobs.OpenVerified(sh.SHA256)
	if err != nil {
		return "", err
	}
	b, err := io.ReadAll(f)
	f.Close()
	if err != nil {
		return "", err
	}
	ts, _, err := safetensors.Read(b)
	if err != nil {
		return "", err
	}
	return audit.StateDigest(ts), nil
}

// ckCommit is what the workers committed to about a checkpoint requested under the active plan:
// the state each started the checkpoint's step from is the state it uploaded.
type ckCommit struct {
	step   int
	plan   uint32
	states map[string]string // worker → Commit.State of its report of the checkpoint's step
}

// noteCheckpointCommits records, from step s's reports, the states a checkpoint taken before
// step s must hold, and checks it if it is complete already.
func (j *jobRun) noteCheckpointCommits(ctx context.Context, s int, reports []*proto.StepReport) error {
	// A checkpoint whose shards landed after the report that committed to them is checked at the
	// next step's reports.
	if cc := j.audits.ckCommit; cc != nil {
		if ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID); err == nil && int(ck.Step) == cc.step {
			if err := j.checkCheckpoint(ctx, ck); err != nil {
				return err
			}
		} else if cc.plan != j.version || s > cc.step+8 {
			j.audits.ckCommit = nil // abandoned, or never completing
		}
	}
	if j.ckRequested != s || j.ckVersion != j.version {
		return nil
	}
	cc := &ckCommit{step: s, plan: j.version, states: map[string]string{}}
	for i, w := range j.participants() {
		cc.states[w] = reports[i].Commit.State
	}
	j.audits.ckCommit = cc
	ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
	if err == nil && int(ck.Step) == s {
		return j.checkCheckpoint(ctx, ck)
	}
	return nil
}

// checkCheckpoint checks a complete checkpoint against the states its workers committed to, once
// both are in: a worker that uploads other than the state it computed from is banned, and nothing
// is ever restored from the poisoned checkpoint (the ban discards it).
func (j *jobRun) checkCheckpoint(ctx context.Context, ck storage.Checkpoint) error {
	cc := j.audits.ckCommit
	if cc == nil || int(ck.Step) != cc.step || cc.plan != j.version {
		return nil
	}
	j.audits.ckCommit = nil
	got, err := j.shardStates(ck)
	if err != nil {
		return err
	}
	for _, w := range j.participants() {
		if d, ok := got[w]; ok && d != cc.states[w] {
			return j.ban(ctx, w, cc.step, fmt.Sprintf("its shard of the checkpoint after step %d is not the state it committed to", cc.step-1))
		}
	}
	return nil
}

// auditTimeouts settles the audits whose evidence will not come: a worker still connected that
// never began to upload it within its wait is treated as one whose work is false (banned); one
// that left, or whose every upload was cut until its wait ran out, abandoned the audit (abandon).
// An upload in progress is held to its own pace instead (paceReader), and a worker with one is
// not settled until that upload ends: its verdict may vouch for work.
func (j *jobRun) auditTimeouts(ctx context.Context) error {
	now := time.Now()
	var order []string
	gone := map[string][]pendingAudit{}
	uploading := map[string]bool{}
	for _, pa := range j.s.auditReg.snapshot(j.rec.ID.String()) {
		if pa.busy {
			uploading[pa.worker] = true
			continue
		}
		// As long as a step may take, and as the evidence takes at the worker's measured pace.
		limit := max(j.deadline(), j.s.evidenceWait(pa.worker, pa.maxBytes))
		_, connected := j.peers[pa.worker]
		switch {
		case pa.left || !connected:
		case now.Sub(pa.asked) < limit:
			continue
		case pa.tries == 0:
			j.s.auditReg.done(pa.id)
			if err := j.fail(ctx, &pa, fmt.Sprintf("no evidence of step %d within %v", pa.step, limit)); err != nil {
				return err
			}
			continue
		}
		if gone[pa.worker] == nil {
			order = append(order, pa.worker)
		}
		gone[pa.worker] = append(gone[pa.worker], pa)
	}
	for _, w := range order {
		if uploading[w] {
			continue
		}
		if err := j.abandon(ctx, w, gone[w]); err != nil {
			return err
		}
	}
	return nil
}

// abandon settles the audits pas that worker abandoned: its pending work is rejected, every
// checkpoint holding it is discarded and the job rolls back to before it (errAbandoned); at its
// maxAbandons-th abandonment it is banned instead (errBanned).
func (j *jobRun) abandon(ctx context.Context, worker string, pas []pendingAudit) error {
	a := j.audits
	steps := make([]int, 0, len(pas))
	why := "it left before showing its evidence"
	for _, pa := range pas {
		j.s.auditReg.done(pa.id)
		steps = append(steps, pa.step)
		if !pa.left && j.peers[pa.worker] != nil {
			why = fmt.Sprintf("its uploads of the evidence (%d) never completed within the wait", pa.tries)
		}
	}
	if e, ok := j.outerLeft[worker]; ok && j.spec.Outer() && !slices.ContainsFunc(steps, func(s int) bool { return s <= e }) {
		// Outer mode: the worker's replica was dropped, and every step it was asked to show fed
		// no outer step — its round was left out of the average — so nothing the job holds
		// depends on what it withheld: leaving evaded nothing. Its unverified work stays
		// unverified, as any departed worker's does; nothing rolls back, and no abandonment
		// counts against it.
		j.s.event(j.rec.ID, "audit.abandoned", worker, map[string]any{"steps": steps, "reason": why, "left_out": true})
		j.publish()
		return nil
	}
	a.abandons[worker]++
	n := a.abandons[worker]
	detail := map[string]any{"steps": steps, "reason": why, "abandons": n}
	if n >= maxAbandons {
		detail["banned"] = true
		j.s.event(j.rec.ID, "audit.abandoned", worker, detail)
		return j.ban(ctx, worker, steps[0], fmt.Sprintf("abandoned %d audits (the last of step %d: %s)", n, steps[0], why))
	}
	j.s.log.Warn("audit abandoned: the worker's unverified work is rejected", "worker", worker, "steps", steps, "reason", why)
	rows, first, err := j.s.db.RejectPendingWork(ctx, j.rec.ID, worker)
	if err != nil {
		return err
	}
	detail["rejected_steps"] = rows
	if rows == 0 {
		// Nothing of its work is unverified: no checkpoint holds work that is not vouched for.
		j.s.event(j.rec.ID, "audit.abandoned", worker, detail)
		j.publish()
		return nil
	}

	target, discarded, err := j.rollback(ctx, int(first), worker)
	if err != nil {
		return err
	}
	detail["rejected_from_step"], detail["rollback_to_step"] = first, target
	j.s.event(j.rec.ID, "audit.abandoned", worker, detail)
	j.s.event(j.rec.ID, "job.rollback", "", map[string]any{"to_step": target, "from_step": j.step, "checkpoints_discarded": discarded, "abandoned": worker})
	j.publish()
	return errAbandoned
}

// onAudit takes a verdict.
func (j *jobRun) onAudit(ctx context.Context, r auditResult) error {
	var pa *pendingAudit
	for _, p := range j.s.auditReg.all(j.rec.ID.String()) {
		if p.id == r.id {
			pa = p
		}
	}
	if pa == nil {
		return nil
	}
	j.s.auditReg.done(r.id)
	a := j.audits
	if r.err != nil {
		j.s.log.Error("audit could not be checked", "worker", pa.worker, "step", pa.step, "err", r.err)
		j.s.event(j.rec.ID, "audit.error", pa.worker, map[string]any{"step": pa.step, "error": r.err.Error()})
		return nil
	}
	a.stats.Audits++
	a.stats.RecomputeS += r.elapsed.Seconds()
	a.stats.EvidenceBytes += pa.bytes
	if strings.HasPrefix(r.reason, audit.Inconclusive) {
		// A difference across kernel families that compressed boundaries make unjudgeable:
		// neither a ban nor credit.
		a.stats.Inconclusive++
		j.s.event(j.rec.ID, "audit.inconclusive", pa.worker, map[string]any{"step": pa.step, "reason": strings.TrimPrefix(r.reason, audit.Inconclusive)})
		j.publish()
		return nil
	}
	if r.reason == "" {
		a.stats.Passed++
		if pa.unapplied {
			j.s.event(j.rec.ID, "audit.passed", pa.worker, map[string]any{"step": pa.step, "exact": pa.exact, "recompute_ms": r.elapsed.Milliseconds(), "evidence_bytes": pa.bytes, "disputed": true})
			return nil
		}
		if _, err := j.s.db.VerifyWork(ctx, j.rec.ID, pa.worker, int64(pa.step)); err != nil {
			j.s.log.Warn("verify work", "err", err)
		}
		j.s.event(j.rec.ID, "audit.passed", pa.worker, map[string]any{"step": pa.step, "exact": pa.exact, "recompute_ms": r.elapsed.Milliseconds(), "evidence_bytes": pa.bytes})
		j.publish()
		return nil
	}
	a.stats.Failed++
	return j.fail(ctx, pa, r.reason)
}

// fail bans the worker of a failed audit.
func (j *jobRun) fail(ctx context.Context, pa *pendingAudit, reason string) error {
	return j.ban(ctx, pa.worker, pa.step, fmt.Sprintf("audit of step %d: %s", pa.step, reason))
}

// ban bans worker from the job for reason (found at step), rejects its credit, discards every
// checkpoint its work went into and returns errBanned: the job replans and replays from the
// newest checkpoint computed without it.
func (j *jobRun) ban(ctx context.Context, worker string, step int, reason string) error {
	a := j.audits
	if a.banned[worker] {
		return errBanned
	}
	a.banned[worker] = true
	j.s.log.Warn("worker banned", "worker", worker, "step", step, "reason", reason)
	if err := j.recordBan(ctx, worker, reason, step); err != nil {
		return err
	}
	if err := j.s.db.RejectWork(ctx, j.rec.ID, worker); err != nil {
		return err
	}
	j.s.event(j.rec.ID, "peer.banned", worker, map[string]any{"reason": reason, "step": step})
	j.s.hub.Drop(worker, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: " + reason})
	delete(j.peers, worker)
	// Its work since it joined is suspect, and through the gradients it reached every shard: go
	// back to the newest checkpoint taken before its first step here (the seed when none is).
	since, ok := a.first[worker]
	if !ok {
		since = 0 // it worked before this coordinator started: assume from the beginning
	}
	target, n, err := j.rollback(ctx, since, worker)
	if err != nil {
		return err
	}
	j.s.event(j.rec.ID, "job.rollback", "", map[string]any{"to_step": target, "from_step": j.step, "checkpoints_discarded": n, "banned": worker})
	j.publish()
	return errBanned
}

// rollback takes the job back to the newest checkpoint taken at or before step since (the seed
// when none is): every later checkpoint is discarded, and the pending work after it, since it is
// replayed. worker's audits, and every audit of a step to be replayed, are dropped. It returns
// the step the job goes back to and how many checkpoints were discarded; the caller's error
// (errRollback) makes the job replan and restore from there.
func (j *jobRun) rollback(ctx context.Context, since int, worker string) (int, int, error) {
	a := j.audits
	target := 0
	if ck, err := j.s.db.LatestCheckpointAtMost(ctx, j.rec.ID, int64(since)); err == nil {
		target = int(ck.Step)
	}
	n, err := j.s.db.DiscardCheckpointsAfter(ctx, j.rec.ID, int64(target))
	if err != nil {
		return 0, 0, err
	}
	if err := j.s.db.DiscardWork(ctx, j.rec.ID, int64(target)); err != nil {
		return 0, 0, err
	}
	// Audits of steps being replayed judge work that no longer counts, and worker's other audits
	// will never see its evidence.
	for _, pa := range j.s.auditReg.all(j.rec.ID.String()) {
		if pa.step >= target || pa.worker == worker {
			j.s.auditReg.done(pa.id)
		}
	}
	for w, f := range a.first {
		if f >= target {
			delete(a.first, w)
		}
	}
	// The runs of unaudited steps start from the replay again: a worker that stays (one that
	// abandoned an audit may come back) is audited within W of its steps as in a fresh job.
	for w, since := range a.unaudited {
		if since >= target {
			delete(a.unaudited, w)
		}
	}
	a.prev, a.outer = nil, nil
	// The assembled files go with the map (the one the replan restores from is assembled again,
	// the same bytes under the same name); nothing else would collect them for an hour.
	for _, sha := range j.restored {
		j.s.freeBlobs(sha)
	}
	j.restored = map[int64]string{}
	return target, n, nil
}

// afterReports is the audit work of a step whose reports are in: cross-checks, the previous
// step's audits, and the record of this one. It runs before the clip goes out.
func (j *jobRun) afterReports(ctx context.Context, s int, st proto.StepSpec, lr float64, clip float32, reports []*proto.StepReport, x, y []int32) error {
	// Step-mode replicas are audited like one pipeline: a replica's stage receives the other
	// replicas' gradient-tree nodes and sends its own through the same transport as activations,
	// so its commitment and evidence carry them, and a recomputation (client.Recompute) replays
	// them. Outer mode's replicas are audited each as it finishes a step (outerRule.finished:
	// auditReplicaStep, outeraudit.go).
	if j.audits == nil || j.spec.Outer() {
		return nil
	}
	if err := j.crossCheck(ctx, s, st, reports, x, y); errors.Is(err, errTakeoverCopies) {
		return j.dispute(ctx, s, st, lr, reports, x, y, err)
	} else if err != nil {
		return err
	}
	j.pickAudits(ctx, s, reports, j.twinDisputes(s, reports))
	rec := &stepRecord{plan: j.version, spec: st, lr: lr, clip: clip, workers: j.participants(), stages: len(j.stages), reports: map[string]*proto.StepReport{}}
	for i, w := range rec.workers {
		rec.reports[w] = reports[i]
		if _, ok := j.audits.first[w]; !ok {
			j.audits.first[w] = s
		}
	}
	j.audits.prev = rec
	return j.noteCheckpointCommits(ctx, s, reports)
}

// handleAudit is POST /api/audits/{id}: a worker's evidence of an audited step. It is taken only
// from the worker asked (its session credential), bounded by the size the job's shard allows,
// and checked in the background; the verdict goes to the job loop.
func (s *Server) handleAudit(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		http.Error(w, "bad audit id", http.StatusBadRequest)
		return
	}
	worker, ok := s.hub.SessionWorker(bearerToken(r))
	if !ok {
		w.Header().Set("WWW-Authenticate", `Bearer realm="shoal-worker"`)
		http.Error(w, "evidence refused: send the session credential of a connected worker", http.StatusUnauthorized)
		return
	}
	pa, status, err := s.auditReg.take(id, worker)
	if err != nil {
		http.Error(w, err.Error(), status)
		return
	}
	if r.ContentLength > pa.maxBytes+(8<<20) {
		s.auditReg.release(id)
		http.Error(w, fmt.Sprintf("evidence of at most %d bytes, this upload says %d", pa.maxBytes, r.ContentLength), http.StatusRequestEntityTooLarge)
		return
	}
	// Room for the bundle before a byte of it is read: the evidence waiting for the one
	// recomputation at a time is what grows a coordinator's memory. The audit is taken (busy)
	// meanwhile, so its wait does not count against the worker (auditTimeouts).
	held, err := s.evidence.acquire(r.Context(), pa.maxBytes)
	if err != nil {
		s.auditReg.release(id)
		http.Error(w, "the coordinator has no room for evidence now: upload again", http.StatusServiceUnavailable)
		return
	}
	rc := http.NewResponseController(w)
	// One upload gets the whole wait the worker's uplink allows, however late it began.
	body := &paceReader{r: http.MaxBytesReader(w, r.Body, pa.maxBytes+(8<<20)), rc: rc, stall: s.uploadStall(),
		until: time.Now().Add(s.evidenceWait(worker, pa.maxBytes))}
	body.extend()
	b, err := audit.Read(body, pa.maxBytes)
	rc.SetReadDeadline(time.Time{})
	if err != nil {
		s.evidence.release(held)
		// A body that arrived whole, as long as it said it was, was not cut: a bundle that ends
		// early within it is malformed.
		whole := r.ContentLength >= 0 && body.n >= r.ContentLength
		if uploadCut(err) && !whole {
			// Not a verdict: the worker uploads again (client/audit.go), within its wait.
			s.log.Info("audit upload cut short: waiting for another", "worker", worker, "audit", id, "bytes", body.n, "err", err)
			s.auditReg.release(id)
			http.Error(w, "the upload ended before the evidence did: upload it again: "+err.Error(), http.StatusRequestTimeout)
			return
		}
		// Malformed evidence is a failed audit: an honest worker's bundle always reads.
		s.log.Warn("audit evidence refused", "worker", worker, "audit", id, "err", err)
		if errors.Is(err, audit.ErrFormat) {
			s.auditReg.received(id, body.n) // judged: another upload would change nothing
			s.verdict(auditResult{id: id, reason: "malformed evidence: " + err.Error()})
		} else {
			s.auditReg.release(id)
		}
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.auditReg.received(id, body.n)
	s.metrics.evidenceBytes.Add(body.n)
	s.uplinks.record(worker, body.n, body.took())
	w.WriteHeader(http.StatusNoContent)
	go func() {
		defer s.evidence.release(held)
		s.judge(pa, b)
	}()
}

// uploadCut reports whether reading evidence failed because the upload stopped — its connection
// lost or stalled, or its stream ending before the bundle's declared end — rather than on what
// the bundle says. A body longer than its audit allows is not cut: no honest bundle is.
func uploadCut(err error) bool {
	var short *audit.ShortError
	var tooLarge *http.MaxBytesError
	return errors.As(err, &short) && !errors.As(short.Err, &tooLarge)
}

// byteBudget is room for a number of bytes, taken and given back by those who hold them. The
// waiting is x/sync/semaphore's, which is first come, first served: a large bundle waiting for
// room is not starved by a stream of small ones slipping past it. used and peak are kept for
// the tests that check what was held.
type byteBudget struct {
	sem   *semaphore.Weighted
	total int64

	mu         sync.Mutex
	used, peak int64
}

func newByteBudget(total int64) *byteBudget {
	total = max(total, 1)
	return &byteBudget{sem: semaphore.NewWeighted(total), total: total}
}

// acquire takes n bytes — the whole budget when n is more, so that what is larger than the
// budget still goes, alone — waiting until they are free or ctx ends, and returns what it took.
func (b *byteBudget) acquire(ctx context.Context, n int64) (int64, error) {
	n = min(max(n, 0), b.total)
	if err := b.sem.Acquire(ctx, n); err != nil {
		return 0, err
	}
	b.mu.Lock()
	b.used += n
	b.peak = max(b.peak, b.used)
	b.mu.Unlock()
	return n, nil
}

// release gives back n bytes that acquire took.
func (b *byteBudget) release(n int64) {
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
	b.sem.Release(n)
}

// judge checks evidence against the commitments and the recomputation, one audit at a time (the
// coordinator lends its spare cores, not all of them at once), and hands the verdict to the job
// loop.
func (s *Server) judge(pa *pendingAudit, b *audit.Bundle) {
	rep := pa.rec.reports[pa.worker]
	if err := audit.Check(b, pa.rec.spec.Step, pa.rec.plan, rep.Commit, pa.next, pa.exact, pa.sample); err != nil {
		s.verdict(auditResult{id: pa.id, reason: "evidence contradicts the commitments: " + err.Error()})
		return
	}
	s.recomputeMu.Lock()
	defer s.recomputeMu.Unlock()
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	out, err := s.cfg.Recompute(ctx, &audit.Replay{Assign: pa.assign, Worker: pa.worker, Spec: pa.rec.spec, Bundle: b, LR: pa.rec.lr, Clip: pa.rec.clip,
		Unapplied: pa.unapplied})
	elapsed := time.Since(t0)
	if err != nil {
		// Evidence that checks against the commitments but cannot be recomputed (a shard the
		// recomputer refuses, inputs a stage cannot take) is the coordinator's problem to look at,
		// not proof against the worker.
		s.verdict(auditResult{id: pa.id, err: fmt.Errorf("recompute: %w", err), elapsed: elapsed})
		return
	}
	s.verdict(auditResult{id: pa.id, reason: audit.Compare(out, b, rep, pa.next, pa.exact), elapsed: elapsed})
}

func (s *Server) verdict(r auditResult) {
	// The loop drains this channel while a job runs; a verdict for a job that ended is dropped
	// with it.
	select {
	case s.auditResults <- r:
	case <-time.After(time.Minute):
	}
}
