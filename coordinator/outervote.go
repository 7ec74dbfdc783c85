package coordinator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
)

// Refused outer-step contributions (client/outer.go, checkGiven): a replica's stage refuses what
// another replica sends at an outer step when no honest replica could have sent it (not finite,
// or beyond what the round's AdamW steps can move a parameter), and says whom it refuses
// (proto.ErrCodeOuterRefused, Error.Accused). The coordinator sees none of the data, so an
// accusation alone proves nothing: the accuser may be the liar.
//
// Senders sign what they send (package audit, "Outer commitments"), so a refusal of a signed
// contribution comes with evidence: the refused chunk, the signature, the Merkle paths. The
// coordinator judges it at once (audit.CheckOuterEvidence) and bans whichever of the two lied —
// the worker that signed a chunk beyond the bound, or the accuser whose evidence does not show
// one. That needs no majority: it works with two replicas.
//
// A refusal without evidence — the sender's signature was missing or false, which nothing proves
// to the coordinator — is a vote: it bans a replica's workers when accusers from at least two
// other replicas, and more than half of the other replicas of that plan, refused it, so that a
// liar needs a majority of the replicas to frame an honest one. A vote that cannot settle it —
// two replicas, or a lone liar refusing an honest one — would have the job replan and meet the
// same refusal at every outer step, for ever. So when a worker refuses the same worker's
// contribution again, unproved, under a later plan, the two are in dispute: outer plans leave
// both out (they stand by; neither is banned, as either may be honest), the same as step mode
// drops both ends of a disputed link. A liar costs the job one honest worker and itself.

// outerPlan is who held which replica in one plan version, and the accusations made under it.
type outerPlan struct {
	replicaOf map[string]int       // worker → replica
	workers   [][]string           // replica → its workers (stages)
	keys      map[string][]byte    // worker → its signing key under the plan
	votes     map[int]map[int]bool // accused replica → the replicas that refused it
	// judged are the workers whose evidence under this plan was weighed: an honest stage refuses
	// once a plan (it takes no step of it again), so one judgement each bounds what a worker
	// sending refusal after refusal costs the job loop.
	judged map[string]bool
}

// outerPlansKept bounds the plan versions whose accusations are still counted: a refusal arrives
// within a plan or two of the one it was made under.
const outerPlansKept = 8

// recordOuterPlan remembers the active plan's replicas for accusations made under it.
func (j *jobRun) recordOuterPlan() {
	if !j.spec.Outer() {
		return
	}
	if j.outerPlans == nil {
		j.outerPlans = map[uint32]*outerPlan{}
	}
	p := &outerPlan{replicaOf: map[string]int{}, workers: make([][]string, len(j.reps)), keys: map[string][]byte{}, votes: map[int]map[int]bool{}}
	for r, rr := range j.reps {
		for _, st := range j.stages[rr.lo:rr.hi] {
			p.replicaOf[st.peer] = r
			p.keys[st.peer] = j.signingKey(st.peer)
			p.workers[r] = append(p.workers[r], st.peer)
		}
	}
	j.outerPlans[j.version] = p
	for v := range j.outerPlans {
		if v+outerPlansKept <= j.version {
			delete(j.outerPlans, v)
		}
	}
}

// outerRefusal weighs worker's refusal m of another replica's contribution: it records it, bans
// the accused replica's workers once enough replicas have refused it (see above), and replans
// when the refusal is of the active plan (the refusing stage takes no step of it again).
func (j *jobRun) outerRefusal(ctx context.Context, worker string, m *proto.Error) error {
	p := j.outerPlans[m.PlanVersion]
	if p == nil || m.Accused == nil {
		j.s.log.Info("outer-step refusal of an unknown plan ignored", "worker", worker, "plan", m.PlanVersion)
		return nil
	}
	accuser, ok := p.replicaOf[worker]
	accused := int(*m.Accused)
	if !ok || accused == accuser || accused >= len(p.workers) {
		j.s.log.Info("outer-step refusal from outside the plan or of no replica ignored", "worker", worker, "accused", accused)
		return nil
	}
	j.s.event(j.rec.ID, "outer.refused", worker, map[string]any{"plan": m.PlanVersion, "replica": accuser, "accused": accused, "message": m.Message, "evidence": m.Evidence != nil})
	if m.Evidence != nil {
		return j.outerEvidence(ctx, worker, m, p, accuser, accused)
	}
	if p.vote(accuser, accused) && !p.banned(accused, j) {
		var by []int
		for r := range p.votes[accused] {
			by = append(by, r)
		}
		sort.Ints(by)
		reason := fmt.Sprintf("replicas %v of plan %d refused its outer-step contribution, unsigned or beyond what honest training sends", by, m.PlanVersion)
		for _, w := range p.workers[accused] {
			j.banOuter(ctx, w, reason)
		}
		return fmt.Errorf("%w: replica %d of plan %d banned: %s", errReplan, accused, m.PlanVersion, reason)
	}
	j.outerDispute(worker, p.workers[accused], m.PlanVersion)
	if m.PlanVersion == j.version {
		return fmt.Errorf("%w: worker %s: %v", errReplan, worker, m)
	}
	return nil
}

// outerDispute records worker's unproved refusal, under plan, of the contributions of the
// workers accused, and leaves worker and any of them it refused under an earlier plan out of outer
// plans (see the top of this file).
func (j *jobRun) outerDispute(worker string, accused []string, plan uint32) {
	if j.outerRefused == nil {
		j.outerRefused, j.outerDisputed = map[[2]string]uint32{}, map[string]bool{}
	}
	for _, w := range accused {
		k := [2]string{worker, w}
		if v, ok := j.outerRefused[k]; ok && v != plan && !j.outerDisputed[w] {
			j.outerDisputed[worker], j.outerDisputed[w] = true, true
			j.s.log.Warn("outer-step dispute: both stand by", "accuser", worker, "accused", w)
			j.s.event(j.rec.ID, "outer.disputed", worker, map[string]any{"accused": w, "plans": []uint32{v, plan}})
		}
		j.outerRefused[k] = plan
	}
}

// outerEvidence judges a refusal that comes with evidence (m.Evidence) and bans the one it
// convicts: the worker that signed the refused chunk, or the accuser. Either way the refusing
// stage takes no step of its plan again, so the job replans when that plan is the active one.
func (j *jobRun) outerEvidence(ctx context.Context, worker string, m *proto.Error, p *outerPlan, accuser, accused int) error {
	if p.judged[worker] {
		return nil
	}
	if p.judged == nil {
		p.judged = map[string]bool{}
	}
	p.judged[worker] = true
	err := p.judge(j.spec, j.rec.ID.String(), m, accused)
	switch {
	case errors.Is(err, audit.ErrOuterSenderFalse):
		j.banOuter(ctx, m.Evidence.Sender, fmt.Sprintf("replica %d's outer-step contribution after step %d, refused by replica %d: %v", accused, *m.Step, accuser, err))
	case errors.Is(err, audit.ErrOuterAccuserFalse):
		j.banOuter(ctx, worker, fmt.Sprintf("refused replica %d's outer-step contribution after step %d: %v", accused, *m.Step, err))
	}
	if m.PlanVersion == j.version {
		return fmt.Errorf("%w: worker %s: %v", errReplan, worker, m)
	}
	return nil
}

// judge weighs the evidence of m, a refusal of replica accused's contribution under this plan of
// job spec: audit.CheckOuterEvidence, once the evidence names a stage of that replica and a
// tensor of the model.
func (p *outerPlan) judge(spec job.Spec, jobID string, m *proto.Error, accused int) error {
	e := m.Evidence
	specs := spec.Model.Specs()
	switch {
	case !slices.Contains(p.workers[accused], e.Sender):
		return fmt.Errorf("%w: worker %s is no stage of replica %d", audit.ErrOuterAccuserFalse, e.Sender, accused)
	case e.Tensor >= len(specs):
		return fmt.Errorf("%w: tensor %d of a model of %d", audit.ErrOuterAccuserFalse, e.Tensor, len(specs))
	}
	return audit.CheckOuterEvidence(spec, jobID, m.PlanVersion, *m.Step, accused, e, p.keys[e.Sender], specs[e.Tensor].Size())
}

// vote records that replica accuser refused replica accused's contribution, and reports whether
// the refusals of accused now ban it: from at least two replicas, and more than half of the
// others.
func (p *outerPlan) vote(accuser, accused int) bool {
	if p.votes[accused] == nil {
		p.votes[accused] = map[int]bool{}
	}
	p.votes[accused][accuser] = true
	n, others := len(p.votes[accused]), len(p.workers)-1
	return n >= 2 && 2*n > others
}

// banned reports whether replica r's workers of this plan are banned already.
func (p *outerPlan) banned(r int, j *jobRun) bool {
	for _, w := range p.workers[r] {
		if !j.outerBanned[w] {
			return false
		}
	}
	return true
}

// banOuter bans worker from the job for a refused outer-step contribution: recorded, told, dropped
// and never planned again. Nothing is rolled back: what it sent beyond the limit never reached a
// replica's parameters, and what it sent within it counted no more than an honest round could.
func (j *jobRun) banOuter(ctx context.Context, worker, reason string) {
	if j.outerBanned[worker] {
		return
	}
	if j.outerBanned == nil {
		j.outerBanned = map[string]bool{}
	}
	j.outerBanned[worker] = true
	j.s.log.Warn("worker banned", "worker", worker, "reason", reason)
	if err := j.recordBan(ctx, worker, reason, j.step); err != nil {
		j.s.log.Error("record a ban", "worker", worker, "err", err)
	}
	j.s.event(j.rec.ID, "peer.banned", worker, map[string]any{"reason": reason, "step": j.step})
	j.s.hub.Drop(worker, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: " + reason})
	delete(j.peers, worker)
}
