package local

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/safetensors"
)

// Outer mode in one process (job.SyncOuter; DiLoCo, Douillard et al. 2023): the reference that a
// distributed low-communication run reproduces bit for bit. model/outer.go defines the outer step;
// this is the loop around it.
//
//   - The replicas are the pinned plan's (job.Spec.PinnedReplicas), or, replaying a distributed
//     run (Options.Replay), the plan's of each period from the step it starts (replan: state by
//     replica index, a new replica from the global θ, a lost one left out — or dropped, Period.
//     Dropped, which keeps the others' indices). Replica r
//     owns micro-batches [First, First+n_r) of every step: its inner step s is a
//     model.Model.TrainStep on the rows of those micro-batches of step s's batch
//     (corpus.Batch(seed, s, B, T); micro-batch j is rows [jB/M, (j+1)B/M)), as n_r micro-batches,
//     with the job's learning rate of step s, weight decay and clip — clipped by the norm of its
//     own gradient. Each replica has its own parameters θ_r and its own AdamW state, whose bias
//     correction counts the job's steps (the replicas' inner steps are the job's steps).
//   - With own batches (sync.batches "own", job.Spec.OwnBatches) every replica trains a batch of
//     its own: n_r micro-batches of B/M rows, n_r its plan entry's micro_batches (1 ≤ n_r ≤
//     job.Spec.MaxOwnMicroBatches). Replica r's step s trains corpus.Batch(job.ReplicaSeed(seed,
//     r), s, n_r·B/M, T) as n_r micro-batches — with n_r = M a whole batch, replica 0's the plain
//     run's — so a step trains Σ n_r micro-batches, and the CE, aux and norm below weigh replica r
//     by n_r/Σn (equally when every n_r is M). A replica faster than the others trains more
//     micro-batches rather than wait for them (sched's planner chooses n_r by speed).
//   - After step s when (s+1) % H == 0, and after the job's last step (job.Spec.OuterStepAfter), every
//     replica takes part in an outer step (model.Outer.Step) and continues from the new global θ.
//   - With a delay τ (sync.delay; job.Sync.Delay) the outer step after step e overlaps training:
//     its global θ is computed from the replicas' θ_r at e as above (model.Outer.StepDelayed),
//     but every replica trains on from its own θ_r and takes up the new θ only after step
//     job.Spec.OuterTakeUpAfter(e) — e+τ, or the next outer step's if that comes first, or e itself after
//     the job's last step — as θ_r ← θ + (θ_r − θ_r at e) (model.Rebase), so that the steps in
//     between keep their progress and the next round's pseudo-gradient (θ − θ_r) carries it. The
//     take-up comes after the step's inner steps and before an outer step at the same step.
//   - The step's reported CE and aux are the mean over all micro-batches: Σ_r (n_r/Σn)·(replica
//     r's mean), added in replica order; GradNorm is the same weighted mean of the replicas'
//     norms (each before its clip). LR is the inner learning rate, tokens/s the whole step's (all
//     replicas and, on a synchronising step, the outer step): Σ n_r·(B/M)·T tokens.
//   - Validation loss (val_every, and after the last step) is the global θ's: the parameters of the
//     latest outer step — at step 0 with H > 1 still the initial ones. The last step always ends
//     with an outer step, so the final validation loss is that of the final θ.
//   - Result.Model holds the global θ (no optimizer state: the AdamW states are the replicas').
//
// A checkpoint holds everything the run continues from, so that a resumed run is the
// uninterrupted one bit for bit: the global θ under the tensors' own names (so `shoal eval` and
// `shoal sample` read it as a model), the outer momentum as optim.outer.<name> and, with int8,
// the average's error feedback as optim.outer.err.<name>; replica r's θ_r, AdamW moments and int8
// error feedback as replica.<r>.<name>, replica.<r>.optim.m.<name>, replica.<r>.optim.v.<name>
// and replica.<r>.optim.err.<name>; metadata "sync" and "replicas" (the micro-batch shares) must
// match the job's to resume. A step-mode resume refuses such a file (it has no optim.m.<name>), and
// an outer-mode resume refuses a step-mode file.

// Checkpoint names and metadata of outer mode.
const (
	metaSync     = "sync"
	metaReplicas = "replicas"
)

// Traffic is how many bytes each replica sends to the others over a whole job to keep the
// replicas in agreement (it receives as many), counted as model.AllReduceBytes does: a
// reduce-scatter and an all-gather of the reduced vector every time the replicas synchronise.
type Traffic struct {
	Replicas int
	Syncs    int   // synchronisations: steps (step mode) or outer steps
	PerSync  int64 // bytes each replica sends per synchronisation
	Total    int64 // Syncs × PerSync
}

// SyncTraffic is the traffic between the replicas of spec's pinned plan: in step mode the float32
// gradient every step; in outer mode the pseudo-gradient at every outer step, as float32 or as int8
// with a float32 scale per model.OuterChunk values. Zero for one replica (or no pinned replicas).
func SyncTraffic(spec job.Spec) Traffic {
	R := len(spec.PinnedReplicas())
	specs := spec.Model.Specs()
	if !spec.Outer() {
		t := Traffic{Replicas: R, Syncs: spec.Steps, PerSync: model.AllReduceBytes(model.OuterPayload(specs, false), R)}
		t.Total = int64(t.Syncs) * t.PerSync
		return t
	}
	t := Traffic{Replicas: R, PerSync: model.AllReduceBytes(model.OuterPayload(specs, spec.Sync.Compress == "int8"), R)}
	for s := 0; s < spec.Steps; s++ {
		if spec.OuterStepAfter(s) {
			t.Syncs++
		}
	}
	t.Total = int64(t.Syncs) * t.PerSync
	return t
}

// Period is the replicas of an outer-mode run from step From (0-based) until the next period's:
// what a distributed run's plan from that step ran (Options.Replay).
//
// Dropped are replicas of Replicas (by index) that left without a restore — a worker of theirs
// left during a round and the others carried on (sched.DropReplica): from From on they train
// nothing, count in no step's loss and take part in no outer step, so their round since the last
// outer step is left out of the average; the others keep their indices (their data seeds, their
// micro-batches). Their state is gone: a later period that has them again starts them from the
// global θ, as a new replica.
//
// Replan marks a period with drops that also starts a new plan at From: a replica lost at the
// very step its plan began from. Its replicas restore from the checkpoint first, as a period
// without drops does, and the drops follow. Without it such a period would be taken for a drop
// alone, which keeps the previous outer step's owners of int8's error feedback where the new
// plan's restore made it whole again (model.Outer.Participate, Restored).
//
// Grown marks a plan taken up at From without a restore (a grow: workers joined and took the
// global θ and the outer momentum from a replica's holders, peer to peer), and lists the replicas
// (by index) its newcomers staff: those start from the global θ as new replicas, every other
// replica keeps its state, and the average's error feedback restarts from zero
// (model.Outer.Grown).
//
// LeftOut are replicas lost during the exchange of the outer step after step From−1 — of Dropped,
// or of the previous period's when a new plan begins at From — they trained that step, which
// counts in its loss, but the others took the outer step again without them (client/outer.go,
// "redo"), so they are left out of it as well. With LeftOutOf they were lost during the exchange
// of the delayed outer step after step LeftOutOf instead (job.Sync.Delay), before its commit: the
// others took that step again without them, still beside training, so that step leaves them out
// (LeftOutOf < From, and the step still pending at From−1).
//
// An exchange that lost replicas goes on without starting over (client/outerx.go): the first
// attempt's participants — the others and LeftOut — each own a segment of every tensor
// (model.OuterSegment), a lost owner's segments go to survivors (model.OuterReassign), and each
// segment is averaged once, over the participants of the attempt its owner averaged it at.
// LeftOutAt are, in LeftOut's order, the attempts that left each out (1 for the first redo; 1
// when not given), and Segments the segments averaged at an earlier attempt than the last —
// which include the replicas left out since, when their contributions had come; every other
// segment is averaged over the last attempt's participants (model.Outer.StepSegments).
type Period struct {
	From      int               `json:"from_step"`
	Replicas  []job.ReplicaPlan `json:"replicas"`
	Dropped   []int             `json:"dropped,omitempty"`
	Replan    bool              `json:"replan,omitempty"`
	Grown     []int             `json:"grown,omitempty"`
	LeftOut   []int             `json:"left_out,omitempty"`
	LeftOutOf *int              `json:"left_out_of,omitempty"`
	LeftOutAt []int             `json:"left_out_at,omitempty"`
	Segments  []SegmentAt       `json:"segments,omitempty"`
	Ghosts    []Ghost           `json:"ghosts,omitempty"`
}

// Ghost is a replica of Dropped that a delayed outer step, the one after step Of, counted among
// its participants when it was asked — so the replica owned segments of that step's exchange —
// but that left before it finished its step: it gave nothing, and attempt At of the step left
// it out (Of ≥ From, the step still ahead of the drop).
type Ghost struct {
	Replica int `json:"replica"`
	Of      int `json:"of"`
	At      int `json:"at"`
}

// SegmentAt is segment Segment of an outer step's reduce-scatter, over the tensors of blocks
// Blocks (a stage's: model.Config.BlockOf), averaged at attempt Attempt of the step
// (proto.OuterDone.Averaged).
type SegmentAt struct {
	Segment int    `json:"segment"`
	Blocks  [2]int `json:"blocks"`
	Attempt int    `json:"attempt"`
}

// maxReplicas bounds a replay's segments and attempts: proto.MaxReplicas, which this package
// does not import.
const maxReplicas = 1 << 12

// leftOutAt is the attempt that left the period's i-th LeftOut out.
func (p Period) leftOutAt(i int) int {
	if i < len(p.LeftOutAt) && p.LeftOutAt[i] > 0 {
		return p.LeftOutAt[i]
	}
	return 1
}

// leftOutStep is the step whose outer step the period's LeftOut are left out of.
func (p Period) leftOutStep() int {
	if p.LeftOutOf != nil {
		return *p.LeftOutOf
	}
	return p.From - 1
}

// Then is periods with p recorded after them: the steps from p.From on are p's, so a period
// restored to an earlier step replaces whatever ran from there.
func (p Period) Then(periods []Period) []Period {
	i := len(periods)
	for i > 0 && periods[i-1].From >= p.From {
		i--
	}
	return append(periods[:i], p)
}

// Replicas are the period's replicas with their first micro-batches: in turn, or with own
// batches (job.Spec.OwnBatches) each from the first of its own batch.
func (p Period) replicas(own bool) []job.Replica {
	var rs []job.Replica
	first := 0
	for _, r := range p.Replicas {
		rs = append(rs, job.Replica{Stages: r.Stages, First: first, MicroBatches: r.MicroBatches})
		if !own {
			first += r.MicroBatches
		}
	}
	return rs
}

// checkReplay checks that periods can replay spec: from step 0, in increasing steps within the
// job, each sharing all of the step's micro-batches among at least one replica — or with own
// batches, each replica training 1 to job.Spec.MaxOwnMicroBatches micro-batches of its own batch.
func checkReplay(spec job.Spec, periods []Period) error {
	for i, p := range periods {
		switch {
		case i == 0 && p.From != spec.SyncWarmup():
			return fmt.Errorf("replay: the first plan is from step %d, want %d (the warm-up's end, or 0 without one)", p.From, spec.SyncWarmup())
		case i > 0 && p.From <= periods[i-1].From:
			return fmt.Errorf("replay: plan %d is from step %d, not after the previous one's %d", i, p.From, periods[i-1].From)
		case p.From >= spec.Steps:
			return fmt.Errorf("replay: plan %d is from step %d of a job of %d", i, p.From, spec.Steps)
		case len(p.Replicas) == 0:
			return fmt.Errorf("replay: plan %d has no replicas", i)
		}
		for k, r := range p.Dropped {
			if r < 0 || r >= len(p.Replicas) || (k > 0 && r <= p.Dropped[k-1]) {
				return fmt.Errorf("replay: plan %d drops replicas %v: want distinct indices of its %d replicas, ascending", i, p.Dropped, len(p.Replicas))
			}
		}
		for k, r := range p.LeftOut {
			n := len(p.Replicas)
			if i > 0 {
				n = max(n, len(periods[i-1].Replicas))
			}
			if r < 0 || r >= n || (k > 0 && r <= p.LeftOut[k-1]) {
				return fmt.Errorf("replay: plan %d leaves replicas %v out of an outer step: want distinct indices of its replicas or the previous plan's, ascending", i, p.LeftOut)
			}
			if e := p.leftOutStep(); e < 0 || !spec.OuterStepAfter(e) {
				return fmt.Errorf("replay: plan %d leaves replicas out of an outer step after step %d, which takes none", i, e)
			}
		}
		if len(p.LeftOutAt) > len(p.LeftOut) {
			return fmt.Errorf("replay: plan %d gives %d attempts for %d replicas left out", i, len(p.LeftOutAt), len(p.LeftOut))
		}
		for _, a := range p.LeftOutAt {
			if a < 0 || a > maxReplicas {
				return fmt.Errorf("replay: plan %d leaves a replica out at attempt %d", i, a)
			}
		}
		for _, g := range p.Ghosts {
			if !slices.Contains(p.Dropped, g.Replica) || g.Of < p.From || g.At < 1 || g.At > maxReplicas || !spec.OuterStepAfter(g.Of) {
				return fmt.Errorf("replay: plan %d has a ghost %+v of an outer step: want a replica it drops, of an outer step from step %d on", i, g, p.From)
			}
		}
		for _, g := range p.Segments {
			if len(p.LeftOut)+len(p.Ghosts) == 0 || g.Segment < 0 || g.Segment >= maxReplicas || g.Attempt < 0 || g.Attempt > maxReplicas || g.Blocks[0] < 0 || g.Blocks[0] >= g.Blocks[1] || g.Blocks[1] > spec.Model.NLayer {
				return fmt.Errorf("replay: plan %d has segment %+v of an outer step (its replicas left out: %v)", i, g, p.LeftOut)
			}
		}
		if e := p.LeftOutOf; e != nil && (len(p.LeftOut) == 0 || *e >= p.From || spec.OuterTakeUpAfter(*e) < p.From-1 || spec.OuterTakeUpAfter(*e) == *e) {
			return fmt.Errorf("replay: plan %d leaves replicas %v out of the delayed outer step after step %d, which is no delayed step pending at step %d", i, p.LeftOut, *e, p.From)
		}
		for k, r := range p.Grown {
			if r < 0 || r >= len(p.Replicas) || (k > 0 && r <= p.Grown[k-1]) {
				return fmt.Errorf("replay: plan %d grows replicas %v: want distinct indices of its %d replicas, ascending", i, p.Grown, len(p.Replicas))
			}
		}
		if len(p.Dropped) >= len(p.Replicas) {
			return fmt.Errorf("replay: plan %d drops all its replicas", i)
		}
		n := 0
		for k, r := range p.Replicas {
			if r.MicroBatches < 1 {
				return fmt.Errorf("replay: plan %d gives replica %d %d micro-batches", i, k, r.MicroBatches)
			}
			if most := spec.MaxOwnMicroBatches(); spec.OwnBatches() && r.MicroBatches > most {
				return fmt.Errorf("replay: plan %d gives replica %d %d micro-batches of its own batch, at most %d", i, k, r.MicroBatches, most)
			}
			n += r.MicroBatches
		}
		if !spec.OwnBatches() && n != spec.MicroBatches {
			return fmt.Errorf("replay: plan %d shares %d micro-batches, the job has %d", i, n, spec.MicroBatches)
		}
	}
	return nil
}

// outerRun is the state of an outer-mode run in one process.
type outerRun struct {
	spec     job.Spec
	replicas []job.Replica
	global   *model.Model   // the global θ; its optimizer is unused
	models   []*model.Model // θ_r with their AdamW states, in replica order
	errs     []*model.Params
	outer    *model.Outer
	// snaps are the replicas' θ_r at an outer step not yet taken up (job.Sync.Delay), in replica
	// order, taken up after step takeUp; nil when none is pending.
	snaps  []*model.Params
	takeUp int
	// replay are the periods still to come (Options.Replay), the next first.
	replay []Period
	// ghosts are the ghosts of a delayed outer step still ahead (Period.Ghosts), with the
	// segments their period recorded of it.
	ghosts        []Ghost
	ghostSegments []SegmentAt
	// dropped marks, by index, the replicas of the current period dropped from it
	// (Period.Dropped); their models, error feedback and snapshots are nil.
	dropped []bool
	// batch is the corpus's batch of B rows of step s for a data seed (job.ReplicaSeed): with own
	// batches every replica but the first draws its own, of n_r·B/M rows.
	batch func(seed uint64, s, B int) (x, y []int32, err error)
}

// replan switches to the replicas of period p before its first step s, as a distributed run
// does when it replans after losing (or gaining) a worker: replica r of the new plan continues
// from replica r's state, as the coordinator's restore gives it (model.Checkpoint.IntoOuterReplica
// by index); a replica beyond the old ones, or one dropped before, starts from the global θ with
// zero AdamW moments and error feedback; replicas beyond the new ones are left out, and so out of
// the round's average, and so are those p drops (Period.Dropped). A grown period (Period.Grown)
// restores nothing: its newcomers' replicas start afresh, and the average's error feedback
// restarts.
func (o *outerRun) replan(p Period, s int) error {
	if len(p.Ghosts) > 0 {
		o.ghosts, o.ghostSegments = p.Ghosts, p.Segments
	}
	restore := (len(p.Dropped) == 0 || p.Replan) && len(p.Grown) == 0
	if len(p.Grown) > 0 {
		o.outer.Grown()
	}
	if restore {
		// The checkpoint a new plan restores from lacks the segments of the average's error
		// feedback whose owners were dropped before it (model.Outer.Forget).
		o.outer.Forget(func(r int) bool { return r < len(o.models) && o.models[r] != nil })
	}
	o.replicas = p.replicas(o.spec.OwnBatches())
	R := len(o.replicas)
	for len(o.models) < R {
		o.models = append(o.models, nil)
		if o.errs != nil {
			o.errs = append(o.errs, nil)
		}
		if o.snaps != nil {
			o.snaps = append(o.snaps, nil)
		}
	}
	o.models = o.models[:R]
	if o.errs != nil {
		o.errs = o.errs[:R]
	}
	if o.snaps != nil {
		o.snaps = o.snaps[:R]
	}
	for _, r := range p.Grown {
		o.models[r] = nil // started afresh below, whatever ran at this index before
	}
	o.drop(p.Dropped)
	if restore {
		// A new plan: its replicas restore the outer state from a checkpoint, which holds the
		// average's error feedback whole. Dropping a replica replans nothing.
		o.outer.Restored()
	}
	for r := range R {
		if o.models[r] == nil && !o.dropped[r] {
			if err := o.fresh(r, s); err != nil {
				return err
			}
		}
	}
	return nil
}

// drop marks the replicas of the current period that rs drops, and forgets their state.
func (o *outerRun) drop(rs []int) {
	o.dropped = make([]bool, len(o.replicas))
	for _, r := range rs {
		o.dropped[r] = true
		o.models[r] = nil
		if o.errs != nil {
			o.errs[r] = nil
		}
		if o.snaps != nil {
			o.snaps[r] = nil
		}
	}
}

// fresh makes replica r a new one before step s: the global θ, zero AdamW moments and error
// feedback, and with an outer step pending the global θ as its snapshot, so that taking the step
// up keeps exactly the progress it makes until then.
func (o *outerRun) fresh(r, s int) error {
	m, err := o.newModel()
	if err != nil {
		return err
	}
	if err := m.P.CopyFrom(o.global.P); err != nil {
		return err
	}
	m.Step = s
	m.Push()
	o.models[r] = m
	if o.errs != nil {
		o.errs[r] = model.NewParams(o.global.P.Specs())
	}
	if o.snaps != nil {
		sn, err := o.clone(o.global.P)
		if err != nil {
			return err
		}
		o.snaps[r] = sn
	}
	return nil
}

// clone is a copy of p.
func (o *outerRun) clone(p *model.Params) (*model.Params, error) {
	c := model.NewParams(p.Specs())
	return c, c.CopyFrom(p)
}

func (o *outerRun) newModel() (*model.Model, error) {
	m, err := model.NewModel(o.spec.Model)
	if err != nil {
		return nil, err
	}
	m.Init(o.spec.Seed)
	m.SetWire(o.spec.Wire) // the boundaries quantise as every split of the job does
	// A replica's inner step is its own: its micro-batches are summed in one chain, as its
	// workers' stages sum theirs (model.Shard.BeginChain).
	m.Chain = true
	return m, nil
}

func (o *outerRun) model() *model.Model { return o.global }

func (o *outerRun) rows() int {
	if !o.spec.OwnBatches() {
		return o.spec.BatchSize
	}
	n := 0
	for r, rp := range o.replicas {
		if !o.dropped[r] {
			n += rp.MicroBatches
		}
	}
	return n * (o.spec.BatchSize / o.spec.MicroBatches)
}

// planAt takes up the replayed period that begins at step s, if any, once.
func (o *outerRun) planAt(s int) error {
	if len(o.replay) == 0 || o.replay[0].From != s {
		return nil
	}
	if err := o.replan(o.replay[0], s); err != nil {
		return err
	}
	o.replay = o.replay[1:]
	return nil
}

// step is one step of outer mode (see "Outer mode in one process" above): every replica's inner
// step, then the outer step when one is due.
func (o *outerRun) step(s int, x, y []int32, h model.Hyper) (model.StepResult, error) {
	spec := o.spec
	T, M := spec.Model.BlockSize, spec.MicroBatches
	rows := spec.BatchSize / M
	var out model.StepResult
	if err := o.planAt(s); err != nil {
		return out, err
	}
	// The replicas' inner steps are independent (each its own model and micro-batches), so they
	// run side by side, one lane per thread; their results are combined in replica order.
	n := len(o.replicas)
	xs, ys := make([][]int32, n), make([][]int32, n)
	for r, rp := range o.replicas {
		xs[r], ys[r] = x, y
		if o.dropped[r] {
			continue
		}
		if spec.OwnBatches() && (r > 0 || rp.MicroBatches != M) {
			var err error
			if xs[r], ys[r], err = o.batch(job.ReplicaSeed(spec.Seed, r), s, rp.MicroBatches*rows); err != nil {
				return out, err
			}
		}
	}
	srs, errs := make([]model.StepResult, n), make([]error, n)
	lanes := min(n, kernels.Threads())
	kernels.Lanes(lanes, func(l int) {
		for r := l; r < n; r += lanes {
			if o.dropped[r] {
				continue
			}
			rp := o.replicas[r]
			lo, hi := rp.First*rows*T, (rp.First+rp.MicroBatches)*rows*T
			hr := h
			hr.MicroBatches = rp.MicroBatches
			srs[r], errs[r] = o.models[r].TrainStep(xs[r][lo:hi], ys[r][lo:hi], rp.MicroBatches*rows, hr)
		}
	})
	// The step's terms are the replicas' weighted by their micro-batches: shares of M, or with
	// own batches n_r each (M each: an equal weight).
	total := 0
	for r, rp := range o.replicas {
		if !o.dropped[r] {
			total += rp.MicroBatches
		}
	}
	for r, rp := range o.replicas {
		if o.dropped[r] {
			continue
		}
		if errs[r] != nil {
			return out, fmt.Errorf("replica %d: %w", r, errs[r])
		}
		sr := srs[r]
		w := float64(rp.MicroBatches) / float64(total)
		out.CE += w * sr.CE
		out.Aux += w * sr.Aux
		out.GradNorm += w * sr.GradNorm
	}
	if o.snaps != nil && s == o.takeUp {
		for r, m := range o.models {
			if m == nil {
				continue
			}
			if err := model.Rebase(m.P, o.global.P, o.snaps[r]); err != nil {
				return out, fmt.Errorf("replica %d: %w", r, err)
			}
			m.Push()
		}
		o.snaps = nil
	}
	if spec.OuterStepAfter(s) {
		// The participants are the replicas not dropped, in index order, as the coordinator's
		// outer step names them.
		var ps, es []*model.Params
		var who []int
		var leftOut []int // lost during this outer step's exchange (Period.LeftOut)
		at := map[int]int{}
		var segs []SegmentAt
		for _, p := range o.replay {
			if p.leftOutStep() == s {
				leftOut = append(leftOut, p.LeftOut...)
				for i, r := range p.LeftOut {
					at[r] = p.leftOutAt(i)
				}
				if len(p.Segments) > 0 {
					segs = p.Segments
				}
			}
		}
		var ghosts []int // asked, gone before they finished the step (Period.Ghosts)
		for _, g := range o.ghosts {
			if g.Of == s {
				ghosts, at[g.Replica] = append(ghosts, g.Replica), g.At
				if len(o.ghostSegments) > 0 {
					segs = o.ghostSegments
				}
			}
		}
		for r, m := range o.models {
			if m == nil || slices.Contains(leftOut, r) {
				continue
			}
			ps, who = append(ps, m.P), append(who, r)
			if o.errs != nil {
				es = append(es, o.errs[r])
			}
		}
		takeUp := spec.OuterTakeUpAfter(s)
		var snaps []*model.Params
		if takeUp != s {
			snaps = make([]*model.Params, len(o.models))
			for r, m := range o.models {
				if m == nil {
					continue
				}
				var err error
				if snaps[r], err = o.clone(m.P); err != nil {
					return out, err
				}
			}
		}
		var err error
		switch {
		case len(leftOut) > 0 || len(ghosts) > 0:
			err = o.segmentsStep(who, at, segs)
		case takeUp == s:
			o.outer.Participate(model.OuterOwners(who))
			err = o.outer.Step(o.global.P, ps, es)
		default:
			o.outer.Participate(model.OuterOwners(who))
			err = o.outer.StepDelayed(o.global.P, ps, es)
		}
		if err != nil {
			return out, fmt.Errorf("outer step: %w", err)
		}
		if takeUp == s && len(leftOut)+len(ghosts) > 0 {
			for _, r := range who {
				if err := o.models[r].P.CopyFrom(o.global.P); err != nil {
					return out, err
				}
			}
		}
		if takeUp != s {
			o.snaps, o.takeUp = snaps, takeUp
		}
	}
	o.global.Step = s + 1
	return out, nil
}

// segmentsStep takes the outer step whose exchange lost the replicas at says were left out
// (Period.LeftOut, LeftOutAt), which trained the step, over the survivors who and those: each
// segment averaged over the participants of the attempt segs records for it, or the last
// attempt's (model.Outer.StepSegments), θ_r left as it is.
func (o *outerRun) segmentsStep(who []int, at map[int]int, segs []SegmentAt) error {
	var first []int
	for r := range o.models {
		if slices.Contains(who, r) || at[r] > 0 {
			first = append(first, r)
		}
	}
	var ps, es []*model.Params
	for _, r := range first {
		if o.models[r] == nil {
			// A ghost: it gave nothing, so nothing of it is in any average, but it owned
			// segments; what stands in for it is never read.
			ps = append(ps, o.global.P)
			if o.errs != nil {
				es = append(es, model.NewParams(o.global.P.Specs()))
			}
			continue
		}
		ps = append(ps, o.models[r].P)
		if o.errs != nil {
			es = append(es, o.errs[r])
		}
	}
	last := 0
	for _, a := range at {
		last = max(last, a)
	}
	// in(a) are the participants of attempt a, by position in first.
	in := func(a int) []int {
		var out []int
		for i, r := range first {
			if at[r] == 0 || at[r] > a {
				out = append(out, i)
			}
		}
		return out
	}
	var lost [][]int
	owners := model.OuterOwners(first)
	owners0 := owners
	for a := 1; a <= last; a++ {
		live := in(a)
		owners = model.OuterReassign(owners, func(q int) bool {
			i := slices.Index(first, q)
			return slices.Contains(live, i)
		})
		if owners == nil {
			return fmt.Errorf("replay: no replica of the outer step is left at attempt %d", a)
		}
		lost = append(lost, owners)
	}
	cfg := o.spec.Model
	blocks := make([]int, len(o.global.P.Tensors))
	for ti, t := range o.global.P.Tensors {
		blocks[ti], _ = cfg.BlockOf(t.Name)
	}
	set := func(ti, k int) []int {
		a := last
		for _, g := range segs {
			if g.Segment == k && g.Blocks[0] <= blocks[ti] && blocks[ti] < g.Blocks[1] {
				a = g.Attempt
			}
		}
		return in(a)
	}
	return o.outer.StepSegments(o.global.P, ps, es, owners0, lost, set)
}

// newOuterRun builds the global model and the replicas at step 0: every θ_r the global θ,
// optimizer states and error feedback zero.
func newOuterRun(spec job.Spec, replay []Period) (*outerRun, error) {
	reps := spec.PinnedReplicas()
	var dropped []int
	if len(replay) > 0 {
		if err := checkReplay(spec, replay); err != nil {
			return nil, err
		}
		reps, dropped = replay[0].replicas(spec.OwnBatches()), replay[0].Dropped
		replay = replay[1:]
	}
	if len(reps) == 0 {
		return nil, fmt.Errorf("sync mode %q in one process needs the replicas pinned: add \"plan\": {\"replicas\": [...]} to the job (each replica's stages and micro_batches), or replay a distributed run's (--replay)", job.SyncOuter)
	}
	o := &outerRun{spec: spec, replicas: reps, replay: replay}
	g, err := o.newModel()
	if err != nil {
		return nil, err
	}
	o.global = g
	int8 := spec.Sync.Compress == "int8"
	o.outer = model.NewOuter(g.P.Specs(), spec.Sync.OuterLR, spec.Sync.OuterMomentum, int8)
	for range reps {
		m, err := o.newModel()
		if err != nil {
			return nil, err
		}
		o.models = append(o.models, m)
		if int8 {
			o.errs = append(o.errs, model.NewParams(g.P.Specs()))
		}
	}
	o.drop(dropped)
	return o, nil
}

// syncMeta is what a checkpoint records of the replicas and their synchronisation, to refuse
// resuming under another.
func (o *outerRun) syncMeta() (sync, shares string) {
	b, _ := json.Marshal(o.spec.Sync)
	var ns []int
	for _, r := range o.replicas {
		ns = append(ns, r.MicroBatches)
	}
	c, _ := json.Marshal(ns)
	return string(b), string(c)
}

// save writes the run's whole state after g.Step steps atomically to path.
func (o *outerRun) save(path string) error {
	g := o.global
	o.outer.Forget(func(r int) bool { return r < len(o.models) && o.models[r] != nil })
	ts := model.OuterCheckpointGlobal(g.P, o.outer)
	for r, m := range o.models {
		if m == nil {
			continue // dropped: its state is gone
		}
		var e *model.Params
		if o.errs != nil {
			e = o.errs[r]
		}
		ts = append(ts, model.OuterCheckpointReplica(r, m.P, m.Opt, e)...)
		if o.snaps != nil {
			ts = append(ts, model.OuterCheckpointSnap(r, o.snaps[r])...)
		}
	}
	meta := model.CheckpointMeta(g.Cfg, g.Step)
	meta[metaSync], meta[metaReplicas] = o.syncMeta()
	if err := safetensors.WriteFile(path, ts, meta); err != nil {
		return fmt.Errorf("save checkpoint %s: %w", path, err)
	}
	return nil
}

// load restores the run's whole state from a checkpoint save wrote.
func (o *outerRun) load(path string) error {
	ts, meta, err := safetensors.ReadFile(path)
	if err != nil {
		return fmt.Errorf("load checkpoint: %w", err)
	}
	cfg, err := model.ParseConfig([]byte(meta["config"]))
	if err != nil {
		return fmt.Errorf("checkpoint config: %w", err)
	}
	if cfg != o.spec.Model {
		return errors.New("its model config differs from the job's")
	}
	step, err := strconv.Atoi(meta["step"])
	if err != nil || step < 0 || step > o.spec.Steps {
		return fmt.Errorf("step %q is not a step count of this job", meta["step"])
	}
	sync, shares := o.syncMeta()
	if _, ok := meta[metaSync]; !ok {
		return fmt.Errorf("not an outer-mode checkpoint (no replica or outer optimizer state): cannot continue a %q job exactly from it", job.SyncOuter)
	}
	if meta[metaSync] != sync || meta[metaReplicas] != shares {
		return fmt.Errorf("written under sync %s with replica shares %s; the job has sync %s and shares %s", meta[metaSync], meta[metaReplicas], sync, shares)
	}
	ck := &model.Checkpoint{Cfg: cfg, Step: step, Tensors: make(map[string]safetensors.Tensor, len(ts))}
	for _, t := range ts {
		ck.Tensors[t.Name] = t
	}
	if err := ck.IntoOuterGlobal(o.global.P, o.outer); err != nil {
		return err
	}
	for r, m := range o.models {
		if m == nil {
			continue // dropped
		}
		var e *model.Params
		if o.errs != nil {
			e = o.errs[r]
		}
		has, err := ck.IntoOuterReplica(r, m.P, m.Opt, e)
		if err != nil {
			return err
		}
		if !has {
			return fmt.Errorf("checkpoint lacks replica %d's state", r)
		}
		m.Step = step
		m.Push()
	}
	o.snaps = nil
	if e, pending := o.spec.OuterPending(step); pending {
		o.takeUp = o.spec.OuterTakeUpAfter(e)
		for r, m := range o.models {
			if m == nil {
				o.snaps = append(o.snaps, nil)
				continue
			}
			sn := model.NewParams(o.global.P.Specs())
			has, err := ck.IntoOuterSnap(r, sn)
			if err != nil {
				return err
			}
			if !has {
				return fmt.Errorf("checkpoint after step %d lacks replica %d's θ at the outer step after step %d, which it takes up after step %d", step, r, e, o.takeUp)
			}
			o.snaps = append(o.snaps, sn)
		}
	}
	o.global.Step = step
	o.global.Push()
	return nil
}
