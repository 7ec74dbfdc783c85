package coordinator

import (
	"context"
	"fmt"
	"slices"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/sched"
)

// Outer mode's audits (docs/design.md, "Verification and credit"). A replica's inner steps are a
// pipeline's steps of its own — its micro-batches, its norm, its clip factor, its AdamW — so each
// is committed to, cross-checked and drawn for audit like a step-mode step, replica by replica as
// each finishes a step (train runs them free): auditReplicaStep, before the replica's clip
// factor goes out. What step mode does not have is the outer step, which changes a stage's
// parameters between two of its training steps, outside any step an audit recomputes. The chain
// of custody crosses it by the stage's commitment to the change (proto.OuterBoundary, on its next
// report): the tensor digests of the parameters its last update reached, of those it starts the
// next step from, of the moments (which the outer step leaves alone) and of the global θ the
// outer step computed. The coordinator composes the state digests from them (audit.ComposeState)
// and checks:
//
//   - that the state the next step starts from is the parameters it names with those moments
//     (its Commit.State), and, without a delay, that those parameters are the global θ;
//   - that every holder of a tensor (the stages of the participating replicas computing with one
//     CPU kernel family, compared as step-mode twins are) names the same global θ. The coordinator cannot compute the global θ itself — it
//     never sees the contributions — so agreement is what it checks: a difference is a dispute
//     (event state.disputed with "outer": true) that audits the disagreeing holders' last inner
//     steps; it names no liar, but the next outer step does, since every contribution is signed
//     over the global θ its sender starts from, and a receiver holding another refuses it
//     (outervote.go);
//   - and it audits the step before the change against the state its update reached (End with
//     Moments), the end state the worker keeps for the evidence (client's trainer.beforeOuter).
//
// With a delay the take-up's arithmetic (θ + (θ_r − θ_r at the outer step), model.Rebase) is not
// checked: the parameters a replica starts from after it are its word, held to its moments and to
// the global θ its peers agree on, but not recomputed. The first commitment under a plan is held
// to the state the coordinator handed out as in step mode (custody.go), a replica's own part of
// the checkpoint or the global θ with zero moments for a replica new to it.
//
// Not drawn: the last step of a plan before a replan and the job's last step, whose end states
// no later report commits to (step mode draws them against the checkpoint's shards, which outer
// mode lays out per replica).

// outerAudit is the audit state of outer mode's replicas under the active plan.
type outerAudit struct {
	plan uint32
	prev map[int]*stepRecord // replica index → its last step, whose audits its next report decides
	// last is each worker's last step reported under plan: a worker continuing from it has
	// crossed the outer steps since with its own state.
	last map[string]int
	// globals are the global θ digests named so far, by outer step and tensor, with who named it
	// first.
	globals map[globalKey]globalClaim
}

type globalKey struct {
	step   int // the training step the outer step followed
	tensor string
}

type globalClaim struct {
	digest, worker, kernels string
}

// outerOf is the outer audit state of the active plan, made afresh for a new one.
func (a *auditor) outerOf(plan uint32) *outerAudit {
	if o := a.outer; o != nil && o.plan == plan {
		return o
	}
	a.outer = &outerAudit{plan: plan, prev: map[int]*stepRecord{}, last: map[string]int{}, globals: map[globalKey]globalClaim{}}
	return a.outer
}

// auditReplicaStep is the audit work of step s of the replica at position r, once all its stages
// reported it and before its clip factor goes out: the cross-checks of its commitments, the chain
// of custody (its first state under the plan, and across an outer step), the draws of its
// previous step, and the record of this one.
func (j *jobRun) auditReplicaStep(ctx context.Context, r, s int, st proto.StepSpec, clip float32, reports []*proto.StepReport, x, y []int32) error {
	a := j.audits
	if a == nil {
		return nil
	}
	rr := j.reps[r]
	parts := slices.Clone(j.participants()[rr.lo:rr.hi])
	for i, rep := range reports {
		if rep == nil || rep.Commit == nil {
			return j.ban(ctx, parts[i], s, "its report carries no commitment, and the job audits")
		}
	}
	if err := j.checkCustodyOf(ctx, s, parts, reports); err != nil {
		return err
	}
	// The replica's micro-batches, as sendInputs sent them.
	lo, hi := rr.first, min(rr.first+rr.n, st.MicroBatches)
	ends := func(int) (int, int) { return 0, len(parts) - 1 }
	if err := j.crossCheckOf(ctx, s, st, parts, reports, x, y, lo, hi, ends); err != nil {
		return err
	}
	o := a.outerOf(j.version)
	next, force, err := j.checkBoundaries(ctx, o, s, parts, reports)
	if err != nil {
		return err
	}
	if prev := o.prev[rr.index]; prev != nil && prev.spec.Step == uint64(s-1) {
		for i, w := range parts {
			if i >= len(prev.workers) || prev.workers[i] != w {
				continue
			}
			// A worker takes at most maxOpenAudits evidence uploads at once and refuses more (a
			// refusal would read as a cheat), and a free-running replica does not wait for the
			// audits between its steps: past that, the draw is left to a later step (a skipped
			// step counts as unaudited, gapDue).
			if j.openAuditsOf(w) >= maxOpenAudits {
				continue
			}
			j.askAudit(ctx, w, s-1, prev, next[i], force[w])
		}
	}
	rec := &stepRecord{plan: j.version, spec: st, lr: j.spec.LRAt(s), clip: clip, workers: parts, stages: len(parts),
		reports: make(map[string]*proto.StepReport, len(parts))}
	for i, w := range parts {
		rec.reports[w] = reports[i]
		if _, ok := a.first[w]; !ok {
			a.first[w] = s
		}
		o.last[w] = s
	}
	o.prev[rr.index] = rec
	return nil
}

// openAuditsOf counts worker's audits whose evidence has not arrived whole.
func (j *jobRun) openAuditsOf(worker string) int {
	n := 0
	for _, pa := range j.s.auditReg.snapshot(j.rec.ID.String()) {
		if pa.worker == worker && !pa.got {
			n++
		}
	}
	return n
}

// outerChangeAfter reports whether an outer step changes a stage's parameters after step t's
// update — taken then, or with a delay taken up then — and the step e it followed.
func (j *jobRun) outerChangeAfter(t int) (int, bool) {
	spec := j.spec
	if !spec.Outer() || t < 0 {
		return 0, false
	}
	for e := t; e >= 0 && e >= t-spec.Sync.Every-spec.Sync.Delay; e-- {
		if spec.OuterStepAfter(e) && spec.OuterTakeUpAfter(e) == t {
			return e, true
		}
	}
	return 0, false
}

// checkBoundaries checks, for each of the replica's stages parts that continues from its step s−1
// under the plan, the commitment to an outer step's change after it (see the top of this file).
// It returns, by stage, the digest of the state step s−1 reached — the next report's start state,
// or across a change the state before it — and the holders of a disputed global θ, whose step
// s−1 is audited whatever the draws.
func (j *jobRun) checkBoundaries(ctx context.Context, o *outerAudit, s int, parts []string, reports []*proto.StepReport) ([]string, map[string]bool, error) {
	next := make([]string, len(parts))
	var force map[string]bool
	e, change := j.outerChangeAfter(s - 1)
	for i, w := range parts {
		rep := reports[i]
		next[i] = rep.Commit.State
		last, ok := o.last[w]
		if !change || !ok || last != s-1 {
			continue // no change between its steps, or its first step here (custody)
		}
		b := rep.Commit.Boundary
		if b == nil {
			return nil, nil, j.ban(ctx, w, s, fmt.Sprintf("its report of step %d does not commit to the outer step after step %d that changed its parameters", s, e))
		}
		end, err := j.checkBoundary(w, s, e, rep.Commit.State, b)
		if err != nil {
			return nil, nil, j.ban(ctx, w, s, err.Error())
		}
		next[i] = end
		if ws := o.claimGlobal(j, w, e, b.Global); len(ws) > 0 {
			if force == nil {
				force = map[string]bool{}
			}
			force[w] = true
			j.s.event(j.rec.ID, "state.disputed", "", map[string]any{"step": e, "outer": true, "workers": append(ws, w)})
		}
	}
	return next, force, nil
}

// checkBoundary checks worker's commitment b to the outer step after step e, on its report of
// step s starting from state: the names are its shard's, the start state is the parameters and
// moments named, without a delay the parameters are the global θ. It returns the digest of the
// state the update of step s−1 reached.
func (j *jobRun) checkBoundary(worker string, s, e int, state string, b *proto.OuterBoundary) (string, error) {
	asg := j.audits.assigns[worker]
	if asg == nil {
		return "", fmt.Errorf("no assignment on record")
	}
	if b.After != uint64(s-1) {
		return "", fmt.Errorf("its commitment to an outer step's change is after step %d, not %d", b.After, s-1)
	}
	specs, err := shardSpecs(j.spec.Model, asg.Shard, func(int, int) bool { return false })
	if err != nil {
		return "", err
	}
	layout := model.CheckpointLayout(specs)
	params, moments := layout[:len(specs)], layout[len(specs):]
	named := func(field string, ds []proto.KeyDigest, want []safetensors.Tensor) (map[string]string, error) {
		m := make(map[string]string, len(ds))
		for _, d := range ds {
			m[d.Key] = d.Digest
		}
		if len(m) != len(want) {
			return nil, fmt.Errorf("its commitment to the outer step after step %d names %d tensors of %s, its shard has %d", e, len(m), field, len(want))
		}
		for _, t := range want {
			if _, ok := m[t.Name]; !ok {
				return nil, fmt.Errorf("its commitment to the outer step after step %d names no %s of %s", e, field, t.Name)
			}
		}
		return m, nil
	}
	endP, err := named("parameters before it", b.End, params)
	if err != nil {
		return "", err
	}
	startP, err := named("parameters after it", b.Start, params)
	if err != nil {
		return "", err
	}
	mom, err := named("moments", b.Moments, moments)
	if err != nil {
		return "", err
	}
	global, err := named("the global θ", b.Global, params)
	if err != nil {
		return "", err
	}
	union := func(p map[string]string) map[string]string {
		out := make(map[string]string, len(p)+len(mom))
		for k, v := range p {
			out[k] = v
		}
		for k, v := range mom {
			out[k] = v
		}
		return out
	}
	start, err := audit.ComposeState(layout, union(startP))
	if err != nil {
		return "", err
	}
	if start != state {
		return "", fmt.Errorf("its report of step %d starts from state %s, not the parameters and moments it says the outer step after step %d left (%s)", s, short(state), e, short(start))
	}
	if j.spec.OuterTakeUpAfter(e) == e {
		for _, t := range params {
			if startP[t.Name] != global[t.Name] {
				return "", fmt.Errorf("after the outer step after step %d its %s is not the global θ it says the step reached", e, t.Name)
			}
		}
	}
	return audit.ComposeState(layout, union(endP))
}

// claimGlobal records worker's digests of the global θ after the outer step after step e and
// returns the holders, computing with the same kernel family, that named another for one of its
// tensors.
func (o *outerAudit) claimGlobal(j *jobRun, worker string, e int, ds []proto.KeyDigest) []string {
	kernels := ""
	if p := j.peers[worker]; p != nil && p.hello != nil {
		kernels = p.hello.Kernels
	}
	for k := range o.globals {
		// Replicas run at most a round apart (train): an outer step this far back has been
		// named by every holder.
		if k.step < e-2*max(j.roundMax, sched.MinRoundSteps)-j.spec.Sync.Every {
			delete(o.globals, k)
		}
	}
	var out []string
	for _, d := range ds {
		k := globalKey{e, d.Key}
		c, ok := o.globals[k]
		if !ok {
			o.globals[k] = globalClaim{digest: d.Digest, worker: worker, kernels: kernels}
			continue
		}
		if c.digest != d.Digest && c.kernels == kernels && (kernels == proto.KernelsFMA || kernels == proto.KernelsPortable) && !slices.Contains(out, c.worker) {
			out = append(out, c.worker)
		}
	}
	return out
}
