package coordinator

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/storage"
)

// Status is GET /api/status: the job, its recent steps, the plan and the peers.
type Status struct {
	Job   *JobStatus   `json:"job"`
	Steps []StepStatus `json:"steps"` // the most recent, oldest first
	Plan  *PlanStatus  `json:"plan"`
	Peers []PeerStatus `json:"peers"`
	// Router is the last step's token assignments per expert, by MoE block.
	Router map[int][]int `json:"router"`
	// Events are the job's most recent events, oldest first.
	Events []EventStatus `json:"events"`
	// Audit summarises the job's verification (docs/design.md, "Verification and credit"); absent when the job does not
	// audit its workers.
	Audit *AuditStatus `json:"audit,omitempty"`
	// Credits is the job's leaderboard: the statusCredits workers with the most verified work,
	// most first, and on GET /api/status?worker=ID also that worker, wherever it stands, so that a
	// contributor's page finds its own line.
	Credits []CreditStatus `json:"credits"`
	// Bans are the job's newest statusBans bans, oldest first, and on ?worker=ID also that
	// worker's, so that a contributor's page can say it was banned.
	Bans []BanStatus `json:"bans"`
	// Volunteer is, on GET /api/status?worker=ID, the credit of the volunteer ID names (an
	// identity, or a worker without one) summed over every job: its total.
	Volunteer *CreditStatus `json:"volunteer,omitempty"`
	// Now is the coordinator's clock, so that a page can judge last_heard without trusting its own.
	Now time.Time `json:"now"`

	// joinToken is the job's join token when it is private: the status is shown only to the admin
	// and to those who present it (statusFor). Never encoded.
	joinToken string
}

// EventStatus is one entry of the events log.
type EventStatus struct {
	ID     int64           `json:"id"`
	Time   time.Time       `json:"time"`
	Kind   string          `json:"kind"`
	Worker string          `json:"worker,omitempty"`
	Detail json.RawMessage `json:"detail"`
}

// statusEvents is how many events /api/status carries.
const statusEvents = 30

// JobStatus describes the running job.
type JobStatus struct {
	ID    string `json:"id"`
	State string `json:"state"`
	// Phase is where the job loop is with its plan (planning, recovering, loading, restoring,
	// rejoining, boundary, training, exchange, checkpointing, evaluating; coordinator/phase.go).
	Phase string `json:"phase,omitempty"`
	Step  int    `json:"step"` // steps completed
	Steps int    `json:"steps"`
	// Model is the job's model and batch in a few words, for the contributor page.
	Model string `json:"model"`
	// ModelConfig is the job's model itself: a GPU worker times a training step of it on each of
	// its devices before joining (`shoal worker --device auto`).
	ModelConfig *model.Config `json:"model_config,omitempty"`
	// Waiting says why the job waits for workers, in sizes an admin can act on ("stage 2 of 3
	// (blocks [4,8)) has no worker: waiting for one with ≥ 1.2 GiB"); absent when it does not.
	Waiting string `json:"waiting,omitempty"`
}

// StepStatus is one recorded step.
type StepStatus struct {
	Step       int      `json:"step"`
	Loss       float64  `json:"loss"`
	Aux        float64  `json:"aux"`
	ValLoss    *float64 `json:"val_loss,omitempty"`
	TokensPerS float64  `json:"tokens_per_s"`
	// Stages splits the step's time per participant (stages, then expert hosts).
	Stages []StageTiming `json:"stages,omitempty"`
}

// StageTiming is where one participant's step time went.
type StageTiming struct {
	Peer       string  `json:"peer"`
	ComputeMS  float64 `json:"compute_ms"`  // forward and backward
	WaitMS     float64 `json:"wait_ms"`     // blocked on neighbours and the coordinator
	TransferMS float64 `json:"transfer_ms"` // handing tensors to the network
}

// PlanStatus is the active plan.
type PlanStatus struct {
	Version     uint32         `json:"version"`
	Stages      []StageStatus  `json:"stages"`
	ExpertHosts []ExpertStatus `json:"expert_hosts"`
	Standby     []string       `json:"standby"`
	// Depth is the plan's pipeline depth: every stage i keeps up to min(S−i+Depth, M)
	// micro-batches in flight (sched.OneFOneBDepth) to hide link latency.
	Depth int `json:"depth"`
	// Replicas is the number of pipeline replicas sharing each step's micro-batches (Stages
	// lists theirs, replica after replica), and Sync how they agree: "step" (gradients reduced
	// every step) or "outer".
	Replicas int    `json:"replicas"`
	Sync     string `json:"sync"`
	// WarmupUntil: the plan is an outer-mode job's synchronous warm-up (job.Sync.Warmup), in step
	// mode until this step, where outer mode takes over; 0 otherwise.
	WarmupUntil int `json:"warmup_until,omitempty"`
	// OwnBatches: in outer mode every replica trains a batch of its own each step (its stages'
	// MicroBatches are [0, n_r): that batch's n_r micro-batches of B/M rows, M or more for a
	// replica faster than the slowest), rather than a share of one.
	OwnBatches bool `json:"own_batches,omitempty"`
	// Delay: in outer mode, the inner steps every outer step overlaps before the replicas take it
	// up (job.Sync.Delay); 0 when they wait for it.
	Delay int `json:"delay,omitempty"`
	// ReplicaSteps: in outer mode, the step each replica's stages compute or last computed, in
	// replica order — replicas run free between outer steps, so a fast one is ahead.
	ReplicaSteps []int `json:"replica_steps,omitempty"`
	// FromStep is the first step (0-based) the plan computes: the step its shards restored to,
	// or were kept at.
	FromStep int `json:"from_step"`
	// KeptFrom is the plan whose shards this one kept (step mode: a replica was lost and the
	// others share its micro-batches, proto.Keep): nothing was restored. 0 when the shards were
	// restored or initialised.
	KeptFrom uint32 `json:"kept_from,omitempty"`
	// Pools are the plan's stages grouped by the blocks they hold, when some blocks have more
	// than one holder (step-mode replicas): the members of a pool hold the same state at every
	// step boundary, so the loss of one costs no restore while another survives (reshare.go), and
	// any one can hand its state to a newcomer (grow.go).
	Pools []PoolStatus `json:"pools,omitempty"`
	// TookFrom are the workers that took their stage's state from others holding its blocks
	// when this plan began (taker → its givers, comma-separated in block order): nothing was
	// restored or checkpointed for them.
	TookFrom map[string]string `json:"took_from,omitempty"`
	// Dropped are the replicas dropped from the plan since it started (outer mode: a worker of
	// theirs left during a round), in the order they were; Stages no longer lists theirs.
	Dropped []DroppedReplica `json:"dropped,omitempty"`
	// LeftOut are replicas of an earlier plan that were left out of the outer step after step
	// FromStep−1 (dropped during its exchange, DroppedReplica.LeftOut), when this plan begins at
	// the step after it: its record must say so, since it replaces theirs in a replay.
	LeftOut []int `json:"left_out,omitempty"`
	// LeftOutOf: LeftOut were left out of the delayed outer step after step LeftOutOf instead
	// (DroppedReplica.LeftOutOf).
	LeftOutOf *int `json:"left_out_of,omitempty"`
	// LeftOutAt are the attempts of that outer step that left LeftOut out, in LeftOut's order,
	// and Segments its segments averaged at an earlier attempt than its last
	// (DroppedReplica.LeftOutAt, Segments).
	LeftOutAt []int             `json:"left_out_at,omitempty"`
	Segments  []local.SegmentAt `json:"segments,omitempty"`
	// Choice is the planner's reason for replicating or not: both plans' estimated tokens/s.
	// Empty for a pinned plan.
	Choice string `json:"choice,omitempty"`
}

// PoolStatus is a pool: blocks [begin, end) and the workers holding them, in plan order.
type PoolStatus struct {
	Blocks  [2]int   `json:"blocks"`
	Members []string `json:"members"`
}

// DroppedReplica is a replica dropped from the plan: its index, stages and micro-batches as the
// plan gave them, and Step, the first step recorded without it.
type DroppedReplica struct {
	Replica      int      `json:"replica"`
	Step         int      `json:"step"`
	Stages       [][2]int `json:"stages"`
	MicroBatches [2]int   `json:"micro_batches"`
	// LeftOut: lost during the exchange of the outer step after step Step−1, it was left out of
	// that step too (its step Step−1 counts in the step's loss).
	LeftOut bool `json:"left_out,omitempty"`
	// LeftOutOf: lost while the delayed outer step after step LeftOutOf was exchanged, before its
	// commit, it was left out of that step (the others took it again without it).
	LeftOutOf *int `json:"left_out_of,omitempty"`
	// LeftOutAt is the attempt of that outer step that left it out: the redo after its
	// departure (proto.OuterSync.Attempt). Segments are the step's segments that were averaged
	// at an earlier attempt than its last — over participants that still had this replica, when
	// its contribution had come (proto.OuterDone.Averaged) — so that a replay averages each
	// segment over the participants it was (local.Period.Segments).
	LeftOutAt int               `json:"left_out_at,omitempty"`
	Segments  []local.SegmentAt `json:"segments,omitempty"`
	// GhostOf: counted among the participants of the delayed outer step after step GhostOf when
	// it was asked, it left before it finished its step (Step ≤ GhostOf): it owned segments of
	// the step's exchange but gave nothing, and attempt LeftOutAt left it out (local.Ghost).
	GhostOf *int `json:"ghost_of,omitempty"`
	// Refilled: a replica this plan staffed again from its peers (a refill), dropped before any
	// step of it counted — while the plan got ready, or during its first step. A replay grows
	// it, then drops it: the grow restarted every holder's error feedback all the same.
	Refilled bool `json:"refilled,omitempty"`
}

// ExpertStatus is an expert host of the plan.
type ExpertStatus struct {
	Block    int    `json:"block"`
	Experts  []int  `json:"experts"`
	Peer     string `json:"peer"`
	PeerName string `json:"peer_name,omitempty"`
}

// StageStatus is one stage of the plan and the peer holding it.
type StageStatus struct {
	Blocks   [2]int `json:"blocks"`
	Peer     string `json:"peer"`
	PeerName string `json:"peer_name,omitempty"`
	// Replica is the pipeline replica the stage belongs to (0 in a plan of one pipeline), and
	// MicroBatches the micro-batches [first, end) of every step that replica computes.
	Replica      int    `json:"replica"`
	MicroBatches [2]int `json:"micro_batches"`
}

// PeerStatus is a connected worker.
type PeerStatus struct {
	ID      string `json:"id"`
	Name    string `json:"name,omitempty"`
	Kind    string `json:"kind"`
	Backend string `json:"backend"`
	// Device is the GPU or adapter Backend runs on, as the peer named it (proto.Hello.Device).
	Device    string    `json:"device,omitempty"`
	GFLOPS    float64   `json:"gflops"`
	Joined    time.Time `json:"joined"`
	LastHeard time.Time `json:"last_heard"`
	BytesIn   int64     `json:"bytes_in"`
	BytesOut  int64     `json:"bytes_out"`
	// MicroBatches and BytesSent count what the peer computed and sent to other peers in this
	// job's steps.
	MicroBatches int64 `json:"micro_batches"`
	BytesSent    int64 `json:"bytes_sent"`
	// Flagged says the peer delivered far below the speed it claimed (GFLOPS) in its measured
	// steps; the planner plans with PlannedGFLOPS for it instead.
	Flagged       bool    `json:"flagged,omitempty"`
	PlannedGFLOPS float64 `json:"planned_gflops,omitempty"`
}

// CreditStatus is a volunteer's credit in the job (storage.Credit), summed over the workers of
// its identity: only verified work earns credit; pending work awaits an audit, and rejected work
// was done by a worker later banned.
type CreditStatus struct {
	// Worker is the volunteer's worker whose work was recorded last.
	Worker string `json:"worker"`
	// Identity is the volunteer's fingerprint (proto.Fingerprint); absent for a worker without
	// one, whose credit is its own.
	Identity string `json:"identity,omitempty"`
	// Name is the worker's chosen name while it is connected to the job.
	Name                 string  `json:"name,omitempty"`
	VerifiedMicroBatches int64   `json:"verified_micro_batches"`
	PendingMicroBatches  int64   `json:"pending_micro_batches"`
	RejectedMicroBatches int64   `json:"rejected_micro_batches"`
	VerifiedGFLOP        float64 `json:"verified_gflop"`
	PendingGFLOP         float64 `json:"pending_gflop"`
}

// BanStatus is a worker banned from the job.
type BanStatus struct {
	Worker string `json:"worker"`
	// Identity is the banned volunteer's fingerprint, banned from the job with the worker.
	Identity string    `json:"identity,omitempty"`
	Reason   string    `json:"reason"`
	Step     int64     `json:"step"` // the step whose check caught it
	Time     time.Time `json:"time"`
}

// How many credits and bans a status carries: a public job may see thousands of workers come
// and go (and a sybil attack thousands of bans), and every dashboard and contributor poll
// carries the lists.
const (
	statusCredits = 100
	statusBans    = 100
)

// creditStatus is c as a status shows it, named from names (the connected workers' shown names).
func creditStatus(c storage.Credit, names map[string]string) CreditStatus {
	return CreditStatus{Worker: shownText(c.Worker, maxShownName), Identity: c.Identity, Name: names[c.Worker],
		VerifiedMicroBatches: c.VerifiedMicroBatches, PendingMicroBatches: c.PendingMicroBatches,
		RejectedMicroBatches: c.RejectedMicroBatches, VerifiedGFLOP: c.VerifiedFLOPs / 1e9, PendingGFLOP: c.PendingFLOPs / 1e9}
}

func banStatus(b storage.Ban) BanStatus {
	return BanStatus{Worker: shownText(b.Worker, maxShownName), Identity: b.Identity, Reason: shownText(b.Reason, maxShownText), Step: b.Step, Time: b.At}
}

// trustStatus reads the job's leaderboard and bans for publish. They are read here, when the job
// loop publishes, rather than for every request: the loop is what changes them (it records,
// verifies, rejects and discards work, and bans, then publishes), so every dashboard stream and
// contributor poll shares one read. The store's running totals make it two short index reads.
func (j *jobRun) trustStatus() ([]CreditStatus, []BanStatus) {
	// publish has no context of its own; the reads go to the read pool, which the loop's writes
	// do not block, so the bound only guards against a wedged database.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	credits, bans := []CreditStatus{}, []BanStatus{}
	cs, err := j.s.db.TopCredits(ctx, j.rec.ID, statusCredits)
	if err != nil {
		j.s.log.Warn("status: read credits", "err", err)
	}
	// Only the listed workers' names: the job loop publishes on every join and departure, and a
	// pass over every connected worker here made a wave of joins quadratic (make scale).
	names := make(map[string]string, len(cs))
	for _, c := range cs {
		if p := j.peers[c.Worker]; p != nil && p.hello != nil && p.hello.Name != "" {
			names[c.Worker] = shownText(p.hello.Name, maxShownName)
		}
	}
	for _, c := range cs {
		credits = append(credits, creditStatus(c, names))
	}
	bs, err := j.s.db.RecentBans(ctx, j.rec.ID, statusBans)
	if err != nil {
		j.s.log.Warn("status: read bans", "err", err)
	}
	for _, b := range bs {
		bans = append(bans, banStatus(b))
	}
	return credits, bans
}

// withWorker adds to st the credit and the ban of the worker or identity r names in ?worker=, when the
// published lists lack them: a contributor's page looks for its own line, and the leaderboard
// shows only the top. st's lists are the published snapshot's, shared by every request, so they
// are copied before anything is added.
func (s *Server) withWorker(r *http.Request, st *Status) {
	worker := r.URL.Query().Get("worker")
	if worker == "" || len(worker) > maxShownName || st.Job == nil {
		return
	}
	id, err := uuid.Parse(st.Job.ID)
	if err != nil {
		return
	}
	if !slices.ContainsFunc(st.Credits, func(c CreditStatus) bool { return c.Worker == worker || c.Identity == worker }) {
		if c, err := s.db.WorkerCredit(r.Context(), id, worker); err == nil {
			names := map[string]string{}
			for _, p := range st.Peers {
				if p.ID == c.Worker {
					names[c.Worker] = p.Name
				}
			}
			st.Credits = append(slices.Clip(st.Credits), creditStatus(c, names))
		}
	}
	if c, err := s.db.VolunteerTotal(r.Context(), worker); err == nil && c.VerifiedMicroBatches+c.PendingMicroBatches+c.RejectedMicroBatches > 0 {
		v := creditStatus(c, nil)
		st.Volunteer = &v
	}
	if !slices.ContainsFunc(st.Bans, func(b BanStatus) bool { return b.Worker == worker || b.Identity == worker }) {
		if b, err := s.db.WorkerBan(r.Context(), id, worker); err == nil {
			st.Bans = append(slices.Clip(st.Bans), banStatus(b))
		}
	}
}

// describeModel says what a job trains, as client.Status.Model says it to a worker's page.
func describeModel(s job.Spec) string {
	m := s.Model
	return fmt.Sprintf("GPT-MoE, %d blocks, %d channels, %d experts (top %d), batch %d×%d tokens",
		m.NLayer, m.NEmbd, m.NExpert, m.TopK, s.BatchSize, m.BlockSize)
}

// maxHistory is how many steps /api/status shows.
const maxHistory = 200

// publish snapshots the job loop's state for the status handler: the loop owns the state, the
// handler reads an immutable copy.
func (j *jobRun) publish() {
	st := &Status{
		Job: &JobStatus{ID: j.rec.ID.String(), State: shownText(j.state, maxShownText), Phase: j.phase.String(), Step: j.step, Steps: j.spec.Steps,
			Model: describeModel(j.spec), ModelConfig: &j.spec.Model, Waiting: shownText(j.waiting, maxShownText)},
		Steps:     append([]StepStatus(nil), j.history...),
		Router:    map[int][]int{},
		Audit:     j.auditSummary(),
		joinToken: j.rec.JoinToken,
	}
	st.Credits, st.Bans = j.trustStatus()
	for b, t := range j.routed {
		st.Router[b] = append([]int(nil), t...)
	}
	if j.phase.planned() {
		ps := &PlanStatus{Version: j.version, Standby: append([]string{}, j.standby...), Depth: j.depth,
			Replicas: len(j.reps), Sync: job.SyncStep, Choice: j.planChoice, FromStep: j.planFrom, KeptFrom: j.keptFrom}
		if j.full.WarmingUp(j.planFrom) {
			ps.WarmupUntil = j.full.SyncWarmup()
		}
		if j.spec.Sync != nil {
			ps.Sync, ps.OwnBatches, ps.Delay = j.spec.Sync.Mode, j.spec.OwnBatches(), j.spec.Sync.Delay
			ps.ReplicaSteps = append([]int(nil), j.replicaAt...)
		}
		for _, p := range j.stages {
			ss := StageStatus{Blocks: [2]int{p.begin, p.end}, Peer: p.peer, Replica: p.replica, MicroBatches: [2]int{p.first, p.first + p.n}}
			if pr := j.peers[p.peer]; pr != nil && pr.hello != nil {
				ss.PeerName = shownText(pr.hello.Name, maxShownName)
			}
			ps.Stages = append(ps.Stages, ss)
		}
		ps.Pools = pools(j.stages)
		if len(j.tookFrom) > 0 {
			ps.TookFrom = make(map[string]string, len(j.tookFrom))
			for t, parts := range j.tookFrom {
				ps.TookFrom[t] = strings.Join(sched.GiversOf(parts), ",")
			}
		}
		ps.LeftOut = slices.Clone(j.leftOutCarried)
		ps.LeftOutAt, ps.Segments = slices.Clone(j.leftOutCarriedAt), slices.Clone(j.leftOutSegments)
		if e := j.leftOutCarriedOf; len(ps.LeftOut) > 0 && e >= 0 {
			ps.LeftOutOf = &e
		}
		for _, d := range j.dropped {
			dr := DroppedReplica{Replica: d.index, Step: d.step, Stages: d.stages, MicroBatches: [2]int{d.first, d.first + d.n}, LeftOut: d.leftOut, Refilled: d.refilled,
				LeftOutAt: d.leftOutAt, Segments: slices.Clone(d.segments)}
			if d.ghostOf >= 0 {
				dr.GhostOf = new(int)
				*dr.GhostOf = d.ghostOf
			}
			if d.leftOutOf >= 0 {
				dr.LeftOutOf = new(int)
				*dr.LeftOutOf = d.leftOutOf
			}
			ps.Dropped = append(ps.Dropped, dr)
		}
		ps.ExpertHosts = []ExpertStatus{}
		for _, h := range j.hosts {
			es := ExpertStatus{Block: h.block, Experts: h.experts, Peer: h.peer}
			if pr := j.peers[h.peer]; pr != nil && pr.hello != nil {
				es.PeerName = shownText(pr.hello.Name, maxShownName)
			}
			ps.ExpertHosts = append(ps.ExpertHosts, es)
		}
		st.Plan = ps
	}
	j.s.status.Store(st)
	counts := maps.Clone(j.counts)
	for id, sp := range j.speeds {
		if sp.flagged {
			c := counts[id]
			c.flagged, c.plannedGFLOPS = true, sp.gflops
			counts[id] = c
		}
	}
	j.s.peerCounts.Store(&counts)
	j.s.notify()
}

func (s *Server) recentEvents(ctx context.Context, st *Status) []EventStatus {
	out := []EventStatus{}
	if st.Job == nil {
		return out
	}
	id, err := uuid.Parse(st.Job.ID)
	if err != nil {
		return out
	}
	s.rec.flush(ctx) // the job loop's writes so far (recorder.go)
	evs, err := s.db.ListEvents(ctx, storage.EventFilter{JobID: id, Limit: statusEvents, Newest: true})
	if err != nil {
		return out
	}
	for _, e := range evs { // the newest ones, in id order
		out = append(out, EventStatus{ID: e.ID, Time: e.Time, Kind: shownText(e.Kind, maxShownName), Worker: shownText(e.WorkerID, maxShownName),
			Detail: boundDetail(e.Message)})
	}
	return out
}

func (s *Server) peerStatus() []PeerStatus {
	out := []PeerStatus{}
	for _, w := range s.hub.Workers() {
		ps := PeerStatus{ID: w.ID, Joined: w.Joined, LastHeard: w.LastHeard, BytesIn: w.BytesIn, BytesOut: w.BytesOut}
		if counts := s.peerCounts.Load(); counts != nil {
			if c, ok := (*counts)[w.ID]; ok {
				ps.MicroBatches, ps.BytesSent = c.microBatches, c.bytesSent
				ps.Flagged, ps.PlannedGFLOPS = c.flagged, c.plannedGFLOPS
			}
		}
		if w.Hello != nil {
			ps.Name, ps.Kind, ps.Backend, ps.GFLOPS = shownText(w.Hello.Name, maxShownName), shownText(string(w.Hello.Kind), maxShownName),
				shownText(string(w.Hello.Backend), maxShownName), w.Hello.GFLOPS
			ps.Device = shownText(w.Hello.Device, maxShownName)
		}
		out = append(out, ps)
	}
	return out
}

// peerCount is what a peer did for the job: micro-batches computed, tensor bytes sent.
type peerCount struct {
	microBatches, bytesSent int64
	// flagged: the peer delivered far below its claimed speed (measure.go); the planner uses
	// plannedGFLOPS for it instead.
	flagged       bool
	plannedGFLOPS float64
}

// Who sees what (issue 14). GET /api/status, /api/steps, /api/sample and /api/jobs are open, so
// that anyone may look at a public job before lending it a machine. A private job (one with a
// join token) is shown only to the admin and to requests that present its join token — the
// contributor page opened from the job's link sends it as the X-Shoal-Join header; ?join=TOKEN
// works too. Everyone else is shown no job: no steps, plan, peers or events, as if none ran. The
// token itself is in no response but the admin's POST /api/jobs, and no response names a peer's
// network address.

// JoinHeader carries a private job's join token on the open read-only endpoints.
const JoinHeader = "X-Shoal-Join"

// presentedJoin is the join token r presents, if any: the header, else ?join=.
func presentedJoin(r *http.Request) string {
	if t := r.Header.Get(JoinHeader); t != "" {
		return t
	}
	return r.URL.Query().Get("join")
}

// joinMatches compares a presented join token with a job's in constant time (over digests, so
// that not even the length leaks). An empty job token matches nothing: it is a public job's.
func joinMatches(presented, token string) bool {
	if token == "" || presented == "" {
		return false
	}
	x, y := sha256.Sum256([]byte(presented)), sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(x[:], y[:]) == 1
}

// mayView reports whether r may see a job whose join token is token ("" for a public job).
func (s *Server) mayView(r *http.Request, token string) bool {
	return token == "" || s.auth.authorized(r) || joinMatches(presentedJoin(r), token)
}

// viewableJob is the running job's id if r may see it, uuid.Nil when no job runs or r may not
// see it (a private job without its token).
func (s *Server) viewableJob(r *http.Request) uuid.UUID {
	st := s.status.Load()
	if st == nil || st.Job == nil || !s.mayView(r, st.joinToken) {
		return uuid.Nil
	}
	id, err := uuid.Parse(st.Job.ID)
	if err != nil {
		return uuid.Nil
	}
	return id
}

// statusFor is GET /api/status for r: the whole status, or, for a private job r may not see, the
// status of a coordinator that runs no job and has no peers.
func (s *Server) statusFor(r *http.Request) Status {
	snap := s.status.Load()
	if !s.mayView(r, snap.joinToken) {
		return Status{Peers: []PeerStatus{}, Events: []EventStatus{}, Credits: []CreditStatus{}, Bans: []BanStatus{},
			Now: time.Now().UTC()}
	}
	st := *snap
	st.Peers = s.peerStatus()
	st.Events = s.recentEvents(r.Context(), &st)
	if st.Credits == nil { // the status before any job ran
		st.Credits = []CreditStatus{}
	}
	if st.Bans == nil {
		st.Bans = []BanStatus{}
	}
	s.withWorker(r, &st)
	st.Now = time.Now().UTC()
	return st
}

// Bounds on the strings a status shows that peers chose or caused: worker names (proto allows
// 256 bytes), error texts and reasons in events, a whole event's detail.
const (
	maxShownName   = 256
	maxShownText   = 512
	maxEventDetail = 16 << 10
)

// addrPattern finds IPv4 and bracketed IPv6 addresses, with a port or without, in error texts
// ("read tcp 192.0.2.1:8470->198.51.100.7:51234: connection reset by peer"): a peer's network
// address is shown to nobody.
var addrPattern = regexp.MustCompile(`\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(?:%[^\]]*)?\](?::\d{1,5})?`)

// shownText makes a peer-controlled string fit to show: valid UTF-8, no network addresses, no
// control characters (they forge log lines and terminal output) or bidirectional overrides (they
// reorder what a page shows), at most max bytes (cut at a rune, marked with "…"). It does not
// escape HTML: JSON carries text, and the pages insert it as text.
func shownText(s string, max int) string {
	clean := len(s) <= max && utf8.ValidString(s) && !addrPattern.MatchString(s)
	for _, r := range s {
		if !clean {
			break
		}
		clean = !hiddenRune(r)
	}
	if clean {
		return s
	}
	s = addrPattern.ReplaceAllString(strings.ToValidUTF8(s, "\uFFFD"), "[address]")
	var b strings.Builder
	for _, r := range s {
		switch {
		case r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0x2028 || r == 0x2029:
			r = ' '
		case hiddenRune(r):
			r = '\uFFFD'
		}
		if b.Len()+utf8.RuneLen(r) > max-len("…") {
			b.WriteString("…")
			break
		}
		b.WriteRune(r)
	}
	return b.String()
}

// hiddenRune reports control characters and the bidirectional formatting characters.
func hiddenRune(r rune) bool {
	return r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0x2028 || r == 0x2029 ||
		(r >= 0x202a && r <= 0x202e) || (r >= 0x2066 && r <= 0x2069) || r == 0x200e || r == 0x200f || r == 0x061c
}

// boundDetail is an event's detail (a JSON object of the job loop's) as a status shows it: every
// string passed through shownText, and the whole at most maxEventDetail bytes (beyond, only
// {"truncated": true, "bytes": N}).
func boundDetail(raw json.RawMessage) json.RawMessage {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber() // numbers as written: a float64 would round large ids
	var v any
	if err := dec.Decode(&v); err != nil {
		return json.RawMessage(`{}`)
	}
	b, err := json.Marshal(boundValue(v))
	if err != nil {
		return json.RawMessage(`{}`)
	}
	if len(b) > maxEventDetail {
		b, _ = json.Marshal(map[string]any{"truncated": true, "bytes": len(b)})
	}
	return b
}

func boundValue(v any) any {
	switch v := v.(type) {
	case string:
		return shownText(v, maxShownText)
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[shownText(k, maxShownName)] = boundValue(x)
		}
		return out
	case []any:
		for i, x := range v {
			v[i] = boundValue(x)
		}
		return v
	}
	return v
}

// Period is the plan's replicas from the step it starts at, as local.Options.Replay takes them:
// what a single process needs to compute the same steps in outer mode, where the replicas are
// part of what is computed. After a replica was dropped it is the period from the latest drop:
// every replica of the plan at its index, those dropped listed as such.
func (p PlanStatus) Period() local.Period {
	per := local.Period{From: p.FromStep}
	byIndex := map[int]*job.ReplicaPlan{}
	n := 0
	for k, st := range p.Stages {
		if k == 0 || st.Replica != p.Stages[k-1].Replica {
			byIndex[st.Replica] = &job.ReplicaPlan{MicroBatches: st.MicroBatches[1] - st.MicroBatches[0]}
			n = max(n, st.Replica+1)
		}
		r := byIndex[st.Replica]
		r.Stages = append(r.Stages, st.Blocks)
	}
	for _, d := range p.Dropped {
		byIndex[d.Replica] = &job.ReplicaPlan{Stages: d.Stages, MicroBatches: d.MicroBatches[1] - d.MicroBatches[0]}
		n = max(n, d.Replica+1)
		per.From = max(per.From, d.Step)
		per.Dropped = append(per.Dropped, d.Replica)
	}
	slices.Sort(per.Dropped)
	at := map[int]int{} // by replica left out, the attempt that left it out
	for _, d := range p.Dropped {
		if d.GhostOf != nil && d.Step == per.From {
			per.Ghosts = append(per.Ghosts, local.Ghost{Replica: d.Replica, Of: *d.GhostOf, At: d.LeftOutAt})
			if len(d.Segments) > 0 {
				per.Segments = slices.Clone(d.Segments)
			}
			continue
		}
		switch {
		case d.LeftOut && d.Step == per.From:
			per.LeftOut = append(per.LeftOut, d.Replica)
		case d.LeftOutOf != nil && d.Step == per.From:
			// Of a delayed outer step, which a period names (local.Period.LeftOutOf).
			per.LeftOut = append(per.LeftOut, d.Replica)
			e := *d.LeftOutOf
			per.LeftOutOf = &e
		default:
			continue
		}
		at[d.Replica] = d.LeftOutAt
		if len(d.Segments) > 0 {
			per.Segments = slices.Clone(d.Segments)
		}
	}
	if per.From == p.FromStep {
		per.LeftOut = append(per.LeftOut, p.LeftOut...)
		for i, r := range p.LeftOut {
			if i < len(p.LeftOutAt) {
				at[r] = p.LeftOutAt[i]
			}
		}
		if len(p.Segments) > 0 {
			per.Segments = slices.Clone(p.Segments)
		}
		if p.LeftOutOf != nil {
			e := *p.LeftOutOf
			per.LeftOutOf = &e
		}
	}
	slices.Sort(per.LeftOut)
	per.LeftOut = slices.Compact(per.LeftOut)
	for _, r := range per.LeftOut {
		per.LeftOutAt = append(per.LeftOutAt, at[r])
	}
	// A replica lost at the step its plan began from: the period is the plan's too, and a
	// replay restores before it drops (local.Period.Replan) — unless the plan restored nothing
	// (a refill, KeptFrom), which a replay grows before it drops.
	per.Replan = len(per.Dropped) > 0 && per.From == p.FromStep && p.KeptFrom == 0
	// A plan taken up without a restore (outer mode: replicas refilled from peers, grow.go) is
	// replayed so, from its first step: the replicas of its takers start from the global θ, the
	// others keep their state.
	if p.KeptFrom != 0 && per.From == p.FromStep {
		for _, st := range p.Stages {
			if p.TookFrom[st.Peer] != "" && !slices.Contains(per.Grown, st.Replica) {
				per.Grown = append(per.Grown, st.Replica)
			}
		}
		for _, d := range p.Dropped {
			if d.Refilled && d.Step == per.From && !slices.Contains(per.Grown, d.Replica) {
				per.Grown = append(per.Grown, d.Replica)
			}
		}
		slices.Sort(per.Grown)
	}
	for r := range n {
		if rp := byIndex[r]; rp != nil {
			per.Replicas = append(per.Replicas, *rp)
		}
	}
	return per
}

// pools groups stages by the blocks they hold, in plan order, when any blocks have more than one
// holder; nil otherwise.
func pools(stages []placement) []PoolStatus {
	var out []PoolStatus
	at := map[[2]int]int{}
	shared := false
	for _, st := range stages {
		b := [2]int{st.begin, st.end}
		i, ok := at[b]
		if !ok {
			i = len(out)
			at[b] = i
			out = append(out, PoolStatus{Blocks: b})
		}
		out[i].Members = append(out[i].Members, st.peer)
		shared = shared || len(out[i].Members) > 1
	}
	if !shared {
		return nil
	}
	return out
}
