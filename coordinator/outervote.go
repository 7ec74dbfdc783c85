package coordinator

import (
	"context"
	"fmt"
	"sort"

	"github.com/shoal-ml/shoal/proto"
)

// Refused outer-step contributions (client/outer.go, checkGiven): a replica's stage refuses what
// another replica sends at an outer step when no honest replica could have sent it (not finite,
// or beyond what the round's AdamW steps can move a parameter), and says whom it refuses
// (proto.ErrCodeOuterRefused, Error.Accused). The coordinator sees none of the data, so one
// accusation proves nothing: the accuser may be the liar. It bans a replica's workers when
// accusers from at least two other replicas, and more than half of the other replicas of that
// plan, refused it: a liar then needs a majority of the replicas to frame an honest one. With two
// replicas no accusation can reach that; the job replans and meets the poison again, which the
// refusal keeps out of every replica's parameters (see README).

// outerPlan is who held which replica in one plan version, and the accusations made under it.
type outerPlan struct {
	replicaOf map[string]int       // worker → replica
	workers   [][]string           // replica → its workers (stages)
	votes     map[int]map[int]bool // accused replica → the replicas that refused it
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
	p := &outerPlan{replicaOf: map[string]int{}, workers: make([][]string, len(j.reps)), votes: map[int]map[int]bool{}}
	for r, rr := range j.reps {
		for _, st := range j.stages[rr.lo:rr.hi] {
			p.replicaOf[st.peer] = r
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
	j.s.event(j.rec.ID, "outer.refused", worker, map[string]any{"plan": m.PlanVersion, "replica": accuser, "accused": accused, "message": m.Message})
	if p.vote(accuser, accused) && !p.banned(accused, j) {
		var by []int
		for r := range p.votes[accused] {
			by = append(by, r)
		}
		sort.Ints(by)
		reason := fmt.Sprintf("replicas %v of plan %d refused its outer-step contribution as beyond what honest training sends", by, m.PlanVersion)
		for _, w := range p.workers[accused] {
			j.banOuter(ctx, w, reason)
		}
		return fmt.Errorf("%w: replica %d of plan %d banned: %s", errReplan, accused, m.PlanVersion, reason)
	}
	if m.PlanVersion == j.version {
		return fmt.Errorf("%w: worker %s: %v", errReplan, worker, m)
	}
	return nil
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
	if err := j.s.db.Ban(ctx, j.rec.ID, worker, reason, int64(j.step)); err != nil {
		j.s.log.Error("record a ban", "worker", worker, "err", err)
	}
	j.s.event(j.rec.ID, "peer.banned", worker, map[string]any{"reason": reason, "step": j.step})
	j.s.hub.Drop(worker, &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: " + reason})
	delete(j.peers, worker)
}
