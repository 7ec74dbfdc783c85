package sched

import (
	"cmp"
	"container/heap"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/shoal-ml/shoal/model"
)

// Replicated plans for fleets of thousands of peers (issue 13; docs/design.md, "Replicas and
// synchronisation"). Partition cuts the model into one pipeline and keeps every other peer
// waiting; PlanReplicas turns many peers into throughput: R pipeline replicas, each with its own
// cuts and peers, share the step's M micro-batches in proportion to their speed and synchronise
// their gradients (step mode) or pseudo-gradients (outer mode, DiLoCo: Douillard et al. 2023,
// "DiLoCo: Distributed Low-Communication Training of Language Models").
//
// The estimate the planner maximises is tokens per second, M·N / (max over replicas of T_r +
// exposed synchronisation), N the tokens of a micro-batch. A replica's time for a share of m
// micro-batches, running OneFOneBDepth with depth d, is
//
//	T_r(m) = RT + (m−1)·τ + (⌈m/K⌉−1)·max(0, RT − K·τ),   K = S + d
//
// τ is the slowest stage's seconds per micro-batch, max(compute, transfer), since a stage's sends
// are buffered while it computes the next; RT is one micro-batch's round trip from the first
// stage's forward to its backward (every stage's compute, and per hop both transfers and the
// one-way latency both ways); the last term is Little's law for a pipeline whose round trip
// exceeds what K micro-batches in flight cover. The planner takes, as the coordinator does
// (coordinator/depth.go), the largest depth the stages' memory allows for the share, but no more
// than hides RT (candidate.depthAt). With equal stages, no transfers and no latency T_r is 1F1B's
// (m + S − 1)·τ.
//
// Synchronisation is counted as exposed, not overlapped with the backward pass (pessimistic).
// Step mode sums every tensor's gradient tree (model/gradtree.go) across the replicas holding it;
// the estimate is a reduce-scatter of the nodes by chunk and an all-gather of the sums, each peer
// uploading (nodes + 1)·(R−1)/R times its stage's gradient (client/replica.go sends every node to
// every other holder, nodes·(R−1) gradients: fine for a few replicas, not for hundreds). Outer
// mode is what client/outer.go sends every H steps: a reduce-scatter and an all-gather, each
// peer uploading (R−1)/R of its stage's parameters twice — 4 bytes each, or with int8 1 and a
// float32 scale per model.OuterChunk — in two message rounds, each a one-way latency to the
// slowest partner (at most the largest RTT/2 among the chosen peers: syncLatency). With a delay D (ReplicaOptions.Delay, the job's sync.delay) replicas train on
// while the exchange runs, so an exchange of X at the slowest chosen link is exposed only for
// max(0, X − D·T) per outer step, T the slowest replica's step (replicaPlanner.exposed).
//
// Memory (ReplicaStageMemory): the state, the gradient tree's buffers for the replica's share,
// outer mode's global θ and momentum (and int8's error feedback), step mode's log of the boundary
// tensors a stage sent in the step (for a stage takeover), and the activations in flight.
// Every replica has a cap on its share, and the shares respect the caps.
//
// The search is greedy (Partition's exact search is exponential in the peers). Peers that cannot
// hold the smallest stage are standbys. The rest are ranked by speed, and separately by memory
// first (which forms replicas of fewer stages), and cut into consecutive groups; each group's cuts
// come from a dynamic program over blocks, O(S·L²). This runs for every target share 1, 2, 4, …,
// M, both rankings, and pools restricted to peers of at least the median upload, since one slow
// link slows the whole reduction; groupCache reuses a group's cut when it already fits a larger
// share. Of each pool's replicas the planner keeps, for every bound on a replica's
// synchronisation time, the fastest as many as raise the estimate.
//
// Own batches (ReplicaOptions.OwnBatches, outer mode only): every replica trains a batch of its
// own each inner step, n_r micro-batches, so R is bounded by the peers and their memory, not by M.
// Replicas run free between outer steps (coordinator/round.go), but a round ends when every
// replica has done its steps, so the slowest replica's T_r(M) sets the pace: it trains M, and
// every other the most micro-batches n_r ≥ M it finishes in that time (ownShares, within its
// memory cap and MaxOwnMicroBatches), so that none waits at the round's end. The estimate is
//
//	tokens/s = Σ_r n_r·N / (max_r T_r(M) + max_r sync_r).
//
// Here the search runs over target step times rather than shares (extendOwn), over pools of at
// least the median, 75th and 90th percentile upload, and keeps replicas as above (chooseOwn).

// SyncMode is how a replicated plan's replicas agree (job spec "sync").
type SyncMode uint8

const (
	// SyncStep reduces every gradient across the replicas every step.
	SyncStep SyncMode = iota
	// SyncOuter is DiLoCo: replicas average pseudo-gradients once every ReplicaOptions.Every
	// inner steps.
	SyncOuter
)

func (m SyncMode) String() string {
	if m == SyncOuter {
		return "outer"
	}
	return "step"
}

// ReplicaOptions are the parameters of PlanReplicas and AddReplicas besides the model and the
// peers.
type ReplicaOptions struct {
	// MicroBatches is M, the job's micro-batches per step; it bounds the replicas (each computes
	// at least one), except with OwnBatches.
	MicroBatches int
	// Version is copied into the Plan.
	Version uint32
	// Sync is the synchronisation mode.
	Sync SyncMode
	// Every is H, the inner steps between outer synchronisations; required (≥ 1) for SyncOuter.
	Every int
	// Int8 sends outer pseudo-gradients as int8 with error feedback (SyncOuter only): a quarter
	// of the bytes, and 4 bytes a parameter more memory for the error.
	Int8 bool
	// OwnBatches (SyncOuter only; the job's sync.batches "own"): every replica trains a batch of
	// its own each inner step — n_r micro-batches, drawn for its replica index: M for the slowest
	// replica, more for faster ones — instead of a share of the step's M. Replicas are then not
	// bounded by M, and a step trains Σ n_r micro-batches.
	OwnBatches bool
	// Delay is D, the inner steps after an outer step's round before its result is taken up
	// (SyncOuter only, 0 ≤ D < Every; the job's sync.delay): the outer exchange runs behind D
	// inner steps of compute, and only what they do not cover is exposed (see the top of the
	// file). 0 exposes the whole exchange.
	Delay int
	// MaxStages caps each replica's stages; 0 means min(L, DefaultReplicaStages).
	MaxStages int
	// RTTSeconds are the peers' measured round-trip times, by id: a hop between peers a and b
	// takes (RTT[a] + RTT[b])/4 one way. A peer not in it counts as 0, no latency.
	RTTSeconds map[string]float64
	// Churn weighs plans by their expected goodput under departures (churn.go); the zero value
	// weighs them by speed.
	Churn Churn
}

// MaxOwnMicroBatches is the most micro-batches a replica may train of a batch of its own
// (ReplicaOptions.OwnBatches) in a step of M micro-batches of tokens tokens each: OwnShareFactor
// times M, and no more than MaxOwnTokens tokens unless M micro-batches are more. A fast replica
// trains more micro-batches than M so that it does not wait for the slowest (see the top of the
// file), but the coordinator draws and sends every replica's batch each step, and a replica that
// trains far more than the others weighs as much more in the step's loss and the outer average:
// the bound keeps a misjudged speed from turning a step into a huge one.
func MaxOwnMicroBatches(M, tokens int) int {
	n := OwnShareFactor * M
	if tokens > 0 {
		n = min(n, max(M, MaxOwnTokens/tokens))
	}
	return max(n, 1)
}

// The bounds of MaxOwnMicroBatches: 64 times the job's micro-batches, and 4 Mi tokens (16 MiB of
// int32 inputs and as much of targets at the coordinator, per replica and step).
const (
	OwnShareFactor = 64
	MaxOwnTokens   = 1 << 22
)

// DefaultReplicaStages is the default cap on a replica's stages (ReplicaOptions.MaxStages).
const DefaultReplicaStages = 16

// GradBytesPerParam is a float32 gradient: what the step-mode reduction moves per parameter and
// node, and the size of one gradient-tree buffer.
const GradBytesPerParam = 4

// OuterBytesPerParam is what a replica keeps per parameter in outer mode besides its own state,
// at the least: the global θ of the round's start (its pseudo-gradient is global θ − replica θ)
// and the outer Nesterov momentum, which every replica applies alike.
const OuterBytesPerParam = 8

func (o ReplicaOptions) validate(L int) error {
	switch {
	case o.MicroBatches < 1:
		return fmt.Errorf("%w: %d micro-batches", ErrBadInput, o.MicroBatches)
	case o.Sync != SyncStep && o.Sync != SyncOuter:
		return fmt.Errorf("%w: sync mode %d", ErrBadInput, o.Sync)
	case o.Sync == SyncOuter && o.Every < 1:
		return fmt.Errorf("%w: outer sync every %d steps (want ≥ 1)", ErrBadInput, o.Every)
	case o.Sync == SyncStep && (o.Every != 0 || o.Int8 || o.OwnBatches || o.Delay != 0):
		return fmt.Errorf("%w: every, int8, own batches and delay belong to outer sync", ErrBadInput)
	case o.Sync == SyncOuter && (o.Delay < 0 || o.Delay >= o.Every):
		return fmt.Errorf("%w: outer sync delay %d steps (want 0 ≤ delay < every = %d)", ErrBadInput, o.Delay, o.Every)
	case o.MaxStages < 0:
		return fmt.Errorf("%w: MaxStages %d", ErrBadInput, o.MaxStages)
	case L < 1:
		return fmt.Errorf("%w: a profile without blocks", ErrBadInput)
	}
	return nil
}

// OuterStateBytes is what a stage keeps per parameter in outer mode beside its own state
// (OuterStateBytesPerParam), 0 in step mode: on disk for a native worker, on the heap for a
// browser tab (HeapOuterOffer).
func (o ReplicaOptions) OuterStateBytes() float64 {
	if o.Sync != SyncOuter {
		return 0
	}
	return OuterStateBytesPerParam(o.Int8, o.Delay > 0)
}

// OuterStateBytesPerParam is what a replica's stage keeps per parameter in outer mode beside its
// own state, its arena's slots (client/outerstore.go): the global θ of the last outer step and
// its outer momentum; with int8 the replica's error feedback and the average's (laid out over the
// whole stage, though only the segments it owns are kept between outer steps) and the
// pseudo-gradient as given (an attempt's redo changes none of them: client/outerx.go); with a delay (delayed; job.Sync.Delay)
// its θ_r at the outer step it has not taken up yet; and θ_r while an evaluation runs on the
// global θ. 12 to 28 bytes: up to as much as the training state, touched once per H steps.
//
// A native worker keeps it in a file mapping, so the planner's memory model does not count it
// (ReplicaStageMemory): the kernel pages it in for the outer step and out when memory is wanted.
// A browser tab keeps it on its heap, and is offered to the planner at what the state leaves
// (HeapOuterOffer). The exchange's buffers during an outer step (the others' contributions to its
// segments, (R−1)/R of its parameters at 4 bytes a value, and the gathered average, 4 more) are
// not counted.
func OuterStateBytesPerParam(int8, delayed bool) float64 {
	b := float64(OuterBytesPerParam) + 4 // and an evaluation's copy of θ_r
	if int8 {
		b += 12
	}
	if delayed {
		b += 4
	}
	return b
}

// HeapOuterOffer is what of memory bytes a worker that keeps its outer state on its heap (a
// browser tab) offers the planner in a job of opt: memory·16/(16+outer), outer the state's bytes
// a parameter (OuterStateBytes). Every shard keeps at least 16 bytes a parameter
// (StateBytesPerParam), so a shard the planner fits in the offer has at most offer/16
// parameters, whose outer state fits in the rest. The offer is memory in step mode.
func HeapOuterOffer(memory int64, opt ReplicaOptions) int64 {
	outer := opt.OuterStateBytes()
	if outer == 0 || memory <= 0 {
		return memory
	}
	return int64(float64(memory) * StateBytesPerParam / (StateBytesPerParam + outer))
}

// treeBytesPerParam is the gradient tree of a replica computing micro-batches [first, first+n):
// its run of the step's tree in step mode; nothing in outer mode, whose inner steps sum their
// micro-batches in one chain in G (model.Shard.BeginChain).
func (o ReplicaOptions) treeBytesPerParam(first, n int) float64 {
	if o.Sync == SyncOuter {
		return 0
	}
	return TreeBytesPerParam(o.MicroBatches, first, first+n)
}

// treeBound is at least model.TreeBuffers(M, lo, lo+m) and len(model.TreeNodes(M, lo, lo+m))
// for every lo: 2·⌈log2 m⌉, 1 for m = 1 (TestTreeBound checks it), and it never falls as m
// grows, so that a share within a replica's cap needs no more than the cap was checked for.
func treeBound(M, m int) int {
	if M <= 1 {
		return model.TreeBuffers(M, 0, M)
	}
	if m <= 1 {
		return 1
	}
	return 2 * bits.Len(uint(m-1))
}

// routeBytes is what a stage of a replica of S stages with a share of n micro-batches keeps of
// the boundary tensors it sends in a step, so that a pool mate taking a lost neighbour over can
// be sent all of them again (client/takeover.go, route): in step mode, for S ≥ 2, n activations
// and n input gradients as the wire carries them. The coordinator names pools only where the
// replicas are cut alike and no expert lives on a host (coordinator/takeover.go, poolsBeside),
// which the planner cannot know before its cuts; so every step-mode stage of a pipeline replica
// is counted as pooled, and a first or last stage (which sends one way only) as sending both —
// more than a stage keeps, never less, and the same formula where the worker checks its
// assignment (ReplicaShardMemory).
func (o ReplicaOptions) routeBytes(p Profile, S, n int) float64 {
	if o.Sync != SyncStep || S < 2 {
		return 0
	}
	return float64(n) * (p.BoundaryBytes + p.GradBoundaryBytes)
}

// ReplicaStageMemory is the memory stage index of S holding blocks [a, b) needs in a replica
// computing micro-batches [first, first+n) of the step with depth extra micro-batches in flight
// (OneFOneBDepth): its state (Cost.StateBytes), the gradient tree for its micro-batches
// (TreeBytesPerParam of its run of the step's tree in step mode; none in outer mode, whose inner
// steps sum in a chain),
// (outer mode's own state is on disk or counted in a tab's offer: OuterStateBytesPerParam),
// step mode's log of the boundary tensors sent in a step (routeBytes), and the activations of
// InFlight(index, S, n, depth) micro-batches, or of an evaluation pass when that is more.
func ReplicaStageMemory(prof Profile, a, b, index, S, first, n, depth int, opt ReplicaOptions) float64 {
	c := prof.stageCost(a, b)
	fixed := c.StateBytes + opt.treeBytesPerParam(first, n)*float64(c.Params) + opt.routeBytes(prof, S, n)
	return fixed + max(float64(InFlight(index, S, n, depth))*c.ActBytes, c.EvalActBytes)
}

// ShareMicroBatches divides M micro-batches among replicas whose slowest stages take tau[r]
// seconds per micro-batch over stages[r] stages: whole micro-batches, at least one each, summing
// to M, minimising the step's compute time max over r of (m_r + S_r − 1)·τ_r (1F1B's, without
// transfers or latency), which it returns. It gives micro-batches one at a time to the replica
// that would finish it first (ties to the lower index), which is optimal for this min-max. It
// panics unless len(tau) == len(stages) and 1 ≤ len(tau) ≤ M.
func ShareMicroBatches(tau []float64, stages []int, M int) ([]int, float64) {
	R := len(tau)
	if R != len(stages) || R < 1 || R > M {
		panic(fmt.Sprintf("sched: ShareMicroBatches of %d micro-batches over %d replicas (%d stage counts)", M, R, len(stages)))
	}
	shares, T := shareBy(R, M, nil, func(r, m int) float64 { return float64(m+stages[r]-1) * tau[r] })
	return shares, T
}

// shareBy is ShareMicroBatches for any finish time f(r, m) of replica r with m micro-batches,
// non-decreasing in m, with caps on the shares (nil: none). It returns nil when the caps leave
// micro-batches over.
func shareBy(R, M int, caps []int, f func(r, m int) float64) ([]int, float64) {
	shares := make([]int, R)
	h := &shareHeap{f: f, shares: shares}
	for r := range shares {
		shares[r] = 1
		if caps == nil || caps[r] > 1 {
			h.idx = append(h.idx, r)
			h.next = append(h.next, f(r, 2))
		}
	}
	heap.Init(h)
	for n := R; n < M; n++ {
		if h.Len() == 0 {
			return nil, math.Inf(1)
		}
		r := h.idx[0]
		shares[r]++
		if caps != nil && shares[r] >= caps[r] {
			heap.Pop(h)
			continue
		}
		h.next[0] = f(r, shares[r]+1)
		heap.Fix(h, 0)
	}
	T := 0.0
	for r := range shares {
		T = max(T, f(r, shares[r]))
	}
	return shares, T
}

// shareHeap orders replicas by the finish time of one more micro-batch.
type shareHeap struct {
	f      func(r, m int) float64
	shares []int
	idx    []int
	next   []float64 // next[i]: f(idx[i], its share + 1)
}

func (h *shareHeap) Len() int { return len(h.idx) }
func (h *shareHeap) Less(i, j int) bool {
	a, b := h.next[i], h.next[j]
	return a < b || a == b && h.idx[i] < h.idx[j]
}
func (h *shareHeap) Swap(i, j int) {
	h.idx[i], h.idx[j] = h.idx[j], h.idx[i]
	h.next[i], h.next[j] = h.next[j], h.next[i]
}
func (h *shareHeap) Push(x any) { panic("sched: shareHeap grows only in shareBy") }
func (h *shareHeap) Pop() any {
	n := len(h.idx) - 1
	x := h.idx[n]
	h.idx, h.next = h.idx[:n], h.next[:n]
	return x
}

// Estimate is the planner's estimate of a replicated plan's step.
type Estimate struct {
	Replicas int `json:"replicas"`
	// ComputeSeconds is max over replicas of T_r(m_r) (see fleet.go); with own batches the
	// slowest replica's T_r(M).
	ComputeSeconds float64 `json:"compute_seconds"`
	// SyncSeconds is the exposed synchronisation per step (amortised over Every in outer mode,
	// less what Delay inner steps of compute hide).
	SyncSeconds float64 `json:"sync_seconds"`
	// HiddenSeconds is the synchronisation per step that Delay inner steps of compute hide
	// (outer mode; 0 without a delay): SyncSeconds + HiddenSeconds is the whole exchange,
	// amortised over Every.
	HiddenSeconds float64 `json:"hidden_seconds,omitempty"`
	// StepSeconds is their sum.
	StepSeconds float64 `json:"step_seconds"`
	// TokensPerS is M·N / StepSeconds: the tokens of the step's batch, or of its R batches
	// (Σ n_r·N) with own batches.
	TokensPerS float64 `json:"tokens_per_s"`
	// FLOPsPerS is the model's FLOPs of the step (Profile, forward and backward; Σ n_r
	// micro-batches with own batches) / StepSeconds: the useful FLOP/s.
	FLOPsPerS float64 `json:"flops_per_s"`
	// GoodputTokensPerS is TokensPerS under ReplicaOptions.Churn (Churn.Goodput): what the
	// planner maximises. TokensPerS when no departures are expected.
	GoodputTokensPerS float64 `json:"goodput_tokens_per_s"`
}

// EstimateReplicas returns the estimate PlanReplicas maximises for plan p (either form, see
// Plan.Pipelines), from its stages' times and shares and the upload of its peers, which peers
// must hold. A plan without replicas has a zero estimate.
func EstimateReplicas(prof Profile, p Plan, peers []Peer, opt ReplicaOptions) (Estimate, error) {
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return Estimate{}, err
	}
	pl := newReplicaPlanner(prof, opt)
	byID := make(map[string]Peer, len(peers))
	for _, q := range peers {
		byID[q.ID] = q
	}
	reps, err := pl.fromPlan(p, byID)
	if err != nil {
		return Estimate{}, err
	}
	if len(reps) == 0 || len(p.Stages) == 0 && len(p.Replicas) == 0 {
		return Estimate{}, nil
	}
	shares := make([]int, len(reps))
	for r, rp := range p.Pipelines() {
		if pl.own && (rp.First != 0 || rp.MicroBatches < 1 || rp.MicroBatches > pl.most) {
			return Estimate{}, fmt.Errorf("%w: replica %d computes micro-batches [%d, %d); with own batches every replica computes [0, n) of its batch, n at most %d", ErrBadInput, r, rp.First, rp.First+rp.MicroBatches, pl.most)
		}
		shares[r] = rp.MicroBatches
	}
	return pl.estimate(reps, shares), nil
}

// PlanReplicas plans R pipeline replicas of prof's blocks over peers, choosing R, each replica's
// peers, cuts and share of the M = opt.MicroBatches micro-batches to maximise the estimated
// tokens per second (see the comment at the top of fleet.go for the estimate and the search).
// Every stage fits its peer's memory, ReplicaStageMemory for its replica's micro-batches at the
// depth the estimate assumes; the plan's Replicas are in replica order (replica r computes
// micro-batches [First, First+MicroBatches), after replica r−1's; with opt.OwnBatches every
// replica has First 0 and n_r ≥ M of a batch of its own, and R is not bounded by M); StepSeconds is the estimate's
// step time; Standby lists every peer that no replica uses, fastest first. The same peers give
// the same plan in any input order. It plans 10,000 peers in well under a second
// (BenchmarkPlanReplicas10000).
//
// The error wraps ErrBadInput for invalid arguments and ErrNoPlan when no replica fits.
func PlanReplicas(prof Profile, peers []Peer, opt ReplicaOptions) (Plan, error) {
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return Plan{}, err
	}
	sorted, err := checkPeers(peers)
	if err != nil {
		return Plan{}, err
	}
	pl := newReplicaPlanner(prof, opt)
	chosen := pl.extend(nil, sorted)
	if len(chosen) == 0 {
		return Plan{}, noPlan(prof, sorted, opt.MicroBatches, len(sorted))
	}
	return pl.plan(chosen, sorted), nil
}

// AddReplicas is PlanReplicas at a step boundary of a running plan: it forms new replicas from
// the peers that hold no stage of current (its standbys and peers that joined), keeping every
// replica of current with its stages and peers — only the shares change — when that raises the
// estimated tokens per second. peers are the live peers: those of current's replicas (their
// uploads price the synchronisation; each must be present) and the candidates; a candidate is
// any peer of peers that holds no stage. It returns current unchanged and false when no new
// replica pays. current may be a one-pipeline plan (Plan.Stages) or have no replicas at all.
func AddReplicas(prof Profile, current Plan, peers []Peer, opt ReplicaOptions) (Plan, bool, error) {
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return Plan{}, false, err
	}
	sorted, err := checkPeers(peers)
	if err != nil {
		return Plan{}, false, err
	}
	if current.MicroBatches != 0 && current.MicroBatches != opt.MicroBatches {
		return Plan{}, false, fmt.Errorf("%w: current plan has %d micro-batches, options %d", ErrBadInput, current.MicroBatches, opt.MicroBatches)
	}
	pl := newReplicaPlanner(prof, opt)
	byID := make(map[string]Peer, len(sorted))
	for _, q := range sorted {
		byID[q.ID] = q
	}
	base, err := pl.fromPlan(current, byID)
	if err != nil {
		return Plan{}, false, err
	}
	held := map[string]bool{}
	for _, c := range base {
		for _, q := range c.peers {
			held[q.ID] = true
		}
	}
	free := slices.DeleteFunc(slices.Clone(sorted), func(q Peer) bool { return held[q.ID] })
	chosen := pl.extend(base, free)
	if len(chosen) == len(base) {
		return current, false, nil
	}
	if len(base) > 0 {
		if !(pl.objective(chosen) > pl.objective(base)) {
			return current, false, nil
		}
	}
	return pl.plan(chosen, sorted), true, nil
}

// DropReplicas returns p without the replicas that hold any of the peers gone: their other
// peers join the standbys (after the old ones), gone peers leave Standby, and the survivors'
// shares are divided anew (ShareMicroBatches on their stages' times, max(compute, transfer)); in
// a plan of own batches (two or more replicas, each with First 0 and n_r micro-batches of its
// own) every survivor keeps its batch. Stages and peers of the surviving replicas do not change. A plan knows neither its peers'
// memory nor their latency, so the new shares are not checked against the memory a larger share
// needs (its tree and activations): the coordinator's assignment check has the last word, and
// AddReplicas or PlanReplicas, which know the peers, respect each replica's cap. With no
// survivor, Replicas is empty and the caller must replan.
func DropReplicas(p Plan, gone []string) Plan {
	isGone := map[string]bool{}
	for _, id := range gone {
		isGone[id] = true
	}
	out := Plan{Version: p.Version, MicroBatches: p.MicroBatches}
	var freed []string
	var keep []Replica
	for _, r := range p.Pipelines() {
		lost := slices.ContainsFunc(r.Stages, func(s Stage) bool { return isGone[s.Peer] })
		if !lost {
			keep = append(keep, r)
			continue
		}
		for _, s := range r.Stages {
			if !isGone[s.Peer] {
				freed = append(freed, s.Peer)
			}
		}
	}
	for _, id := range p.Standby {
		if !isGone[id] {
			out.Standby = append(out.Standby, id)
		}
	}
	out.Standby = append(out.Standby, freed...)
	if len(keep) > 0 && ownForm(p) {
		// Own batches: every survivor keeps its batch of n_r micro-batches. (Without the peers,
		// the survivors' n_r are not re-derived from the new slowest: PlanReplicas or
		// AddReplicas do that.)
		for _, rp := range keep {
			rp.Stages = slices.Clone(rp.Stages)
			rp.StepSeconds = float64(rp.MicroBatches+len(rp.Stages)-1) * replicaTau(rp.Stages)
			out.StepSeconds = max(out.StepSeconds, rp.StepSeconds)
			out.Replicas = append(out.Replicas, rp)
		}
		return out
	}
	if len(keep) == 0 || p.MicroBatches < len(keep) {
		return out
	}
	tau, S := make([]float64, len(keep)), make([]int, len(keep))
	for r, rp := range keep {
		tau[r], S[r] = replicaTau(rp.Stages), len(rp.Stages)
	}
	shares, T := ShareMicroBatches(tau, S, p.MicroBatches)
	first := 0
	for r := range keep {
		rp := keep[r]
		rp.Stages = slices.Clone(rp.Stages)
		rp.First, rp.MicroBatches = first, shares[r]
		rp.StepSeconds = float64(shares[r]+S[r]-1) * tau[r]
		first += shares[r]
		out.Replicas = append(out.Replicas, rp)
	}
	out.StepSeconds = T // compute only: synchronisation needs the peers' links (EstimateReplicas)
	return out
}

// ownForm reports whether p's replicas train batches of their own (ReplicaOptions.OwnBatches):
// two or more, each computing micro-batches from 0 of its own, which no plan sharing M can be
// (its second replica starts after the first's). One replica of all M is both forms alike.
func ownForm(p Plan) bool {
	if len(p.Replicas) < 2 {
		return false
	}
	for _, r := range p.Replicas {
		if r.First != 0 {
			return false
		}
	}
	return true
}

func replicaTau(stages []Stage) float64 {
	tau := 0.0
	for _, s := range stages {
		tau = max(tau, s.ComputeSeconds, s.TransferSeconds)
	}
	return tau
}

// checkPeers validates peers as Partition does and returns them sorted by id.
func checkPeers(peers []Peer) ([]Peer, error) {
	sorted := slices.Clone(peers)
	slices.SortFunc(sorted, func(a, b Peer) int { return cmp.Compare(a.ID, b.ID) })
	for i, p := range sorted {
		switch {
		case p.ID == "":
			return nil, fmt.Errorf("%w: a peer without an id", ErrBadInput)
		case i > 0 && p.ID == sorted[i-1].ID:
			return nil, fmt.Errorf("%w: peer id %q appears twice", ErrBadInput, p.ID)
		case !(p.GFLOPS > 0) || math.IsInf(p.GFLOPS, 0):
			return nil, fmt.Errorf("%w: peer %q: GFLOPS %v", ErrBadInput, p.ID, p.GFLOPS)
		case !(p.LinkBytesPerS > 0):
			return nil, fmt.Errorf("%w: peer %q: link %v bytes/s", ErrBadInput, p.ID, p.LinkBytesPerS)
		case p.MemoryBytes < 0:
			return nil, fmt.Errorf("%w: peer %q: memory %d bytes", ErrBadInput, p.ID, p.MemoryBytes)
		}
	}
	return sorted, nil
}

// fasterPeer orders peers by speed, then memory, then link (all descending), then id.
func fasterPeer(a, b Peer) int {
	if c := cmp.Compare(b.GFLOPS, a.GFLOPS); c != 0 {
		return c
	}
	if c := cmp.Compare(b.MemoryBytes, a.MemoryBytes); c != 0 {
		return c
	}
	if c := cmp.Compare(b.LinkBytesPerS, a.LinkBytesPerS); c != 0 {
		return c
	}
	return cmp.Compare(a.ID, b.ID)
}

// replicaPlanner holds what every replica of one planning request shares.
type replicaPlanner struct {
	prof    Profile
	opt     ReplicaOptions
	L, M    int
	own     bool // opt.OwnBatches: every replica computes n_r ≥ M micro-batches of its own batch
	most    int  // the largest share: M, or with own batches MaxOwnMicroBatches
	maxS    int
	cost    []Cost    // cost[a*(L+1)+b]: blocks [a, b)
	send    []float64 // send[a*(L+1)+b]: SendBytes(a, b)
	params  []float64 // params[a*(L+1)+b]
	fixed   []float64 // fixed[a*(L+1)+b]: the state, what depends on neither share nor depth
	trees   []float64 // trees[m]: treeBytes(m), filled lazily (< 0: not yet)
	minNeed float64   // the least memory of any stage
	needLB  float64   // a lower bound on a whole replica's memory: state, extra and a tree of one micro-batch, no activations
	minSend float64   // the least any stage of a pipeline of 2 or more sends per micro-batch
	flops   float64   // the whole model's FLOPs per micro-batch
	f       []float64 // dynamic program scratch
	ch      []int
}

func newReplicaPlanner(prof Profile, opt ReplicaOptions) *replicaPlanner {
	L := prof.NumBlocks()
	W := L + 1
	pl := &replicaPlanner{prof: prof, opt: opt, L: L, M: opt.MicroBatches, own: opt.OwnBatches,
		cost: make([]Cost, W*W), send: make([]float64, W*W), params: make([]float64, W*W), fixed: make([]float64, W*W),
		most: opt.MicroBatches, minNeed: math.Inf(1)}
	if pl.own {
		pl.most = MaxOwnMicroBatches(pl.M, prof.Tokens)
	}
	pl.trees = make([]float64, pl.most+1)
	for i := range pl.trees {
		pl.trees[i] = -1
	}
	pl.maxS = min(L, DefaultReplicaStages)
	if opt.MaxStages > 0 {
		pl.maxS = min(L, opt.MaxStages)
	}
	for a := 0; a < L; a++ {
		for b := a + 1; b <= L; b++ {
			c := prof.stageCost(a, b)
			pl.cost[a*W+b], pl.send[a*W+b], pl.params[a*W+b] = c, prof.SendBytes(a, b), float64(c.Params)
			pl.fixed[a*W+b] = c.StateBytes
		}
		pl.minNeed = min(pl.minNeed, pl.memory(a, a+1, 0, 1, pl.minShare(), 0))
	}
	all := pl.cost[L]
	pl.needLB = all.StateBytes + pl.treeBytes(pl.minShare())*float64(all.Params)
	pl.flops = all.FLOPs
	pl.minSend = min(prof.BoundaryBytes, prof.GradBoundaryBytes)
	pl.f = make([]float64, (pl.maxS+1)*W)
	pl.ch = make([]int, (pl.maxS+1)*W)
	return pl
}

// minShare is the least share a replica computes: 1, or M with own batches (the slowest replica
// of a plan trains M, the others as many more as they finish in its time).
func (pl *replicaPlanner) minShare() int {
	if pl.own {
		return pl.M
	}
	return 1
}

// treeBytes is the gradient tree per parameter of a replica with a share of m micro-batches,
// wherever its run falls: treeBound in step mode, nothing in outer mode (treeBytesPerParam).
func (pl *replicaPlanner) treeBytes(m int) float64 {
	m = min(max(m, 1), pl.most)
	if pl.trees[m] < 0 {
		if pl.opt.Sync == SyncOuter {
			pl.trees[m] = 0
		} else {
			pl.trees[m] = GradBytesPerParam * float64(treeBound(pl.M, m))
		}
	}
	return pl.trees[m]
}

// memory is ReplicaStageMemory, on the precomputed sums, for a share of up to m micro-batches
// anywhere in the step.
func (pl *replicaPlanner) memory(a, b, index, S, m, depth int) float64 {
	k := a*(pl.L+1) + b
	return pl.fixed[k] + pl.treeBytes(m)*pl.params[k] + pl.route(S, m) + max(float64(InFlight(index, S, m, depth))*pl.cost[k].ActBytes, pl.cost[k].EvalActBytes)
}

// route is routeBytes for a stage of S with a share of up to m micro-batches.
func (pl *replicaPlanner) route(S, m int) float64 {
	return pl.opt.routeBytes(pl.prof, S, min(max(m, 1), pl.most))
}

// candidate is a replica as the planner builds it: peers in pipeline order, the cuts, and its
// times (see the top of the file).
type candidate struct {
	peers []Peer
	cuts  []int   // S+1 boundaries, 0 … L
	tau   float64 // the slowest stage's max(compute, transfer) per micro-batch
	rt    float64 // one micro-batch's round trip through the pipeline: RT
	hide  int     // the depth that hides RT (K·τ ≥ RT), the most any share needs
	cap   int     // the largest share its stages' memory allows (at depth 0)
	grad  float64 // seconds its slowest peer needs to upload its stage's parameters at 4 bytes each
	lat   float64 // the largest one-way latency of a hop from one of its peers (RTT/2)
	// room holds, per stage whose activations cost memory, what depthAt needs: the micro-batches
	// in flight its memory holds are (free − tree(m)·params)/act.
	room []stageRoom
	pl   *replicaPlanner // for treeBytes
}

// stageRoom is one stage's memory in units of its activations, for candidate.depthAt.
type stageRoom struct {
	free   float64 // (peer memory − state − outer extra) / activation bytes
	params float64 // parameters / activation bytes
	inv    float64 // 1 / activation bytes, for the route log (routeBytes)
	back   int     // S − index: the micro-batches in flight at depth 0 before the share caps them
}

func (c *candidate) S() int { return len(c.peers) }

// oneBatch is the replica's time for one micro-batch, RT.
func (c *candidate) oneBatch() float64 { return c.rt }

// depthAt is the depth the replica runs a share of m ≤ cap micro-batches at: the largest its
// stages' memory allows for that share (as the coordinator chooses it, coordinator/depth.go),
// but no more than hides the round trip. A stage i of S holds InFlight(i, S, m, d) =
// min(S−i+d, m) activations; it limits the depth only when it cannot hold all m. Beyond m−1 no
// depth changes anything; below, the depth memory allows never rises with m (the tree and the
// activations in flight only grow), so T_r stays non-decreasing in m.
func (c *candidate) depthAt(m int) int {
	d := min(c.hide, m-1)
	if d <= 0 {
		return 0
	}
	tree, route := c.pl.treeBytes(m), c.pl.route(c.S(), m)
	for _, r := range c.room {
		if x := r.free - tree*r.params - route*r.inv; x < float64(m) {
			d = min(d, int(math.Floor(x))-r.back)
		}
	}
	return max(d, 0)
}

// eff is the replica's seconds per micro-batch in steady state for a share of m: τ, or RT/K
// when its K in flight cannot hide the round trip.
func (c *candidate) eff(m int) float64 {
	m = min(max(m, 1), max(c.cap, 1))
	return max(c.tau, c.rt/float64(c.S()+c.depthAt(m)))
}

// time is T_r(m), the replica's time for m micro-batches.
func (c *candidate) time(m int) float64 {
	t := c.rt + float64(m-1)*c.tau
	if m <= 1 || c.rt <= float64(c.S())*c.tau {
		return t
	}
	K := c.S() + c.depthAt(m)
	if waves := (m - 1) / K; waves > 0 {
		t += float64(waves) * max(0, c.rt-float64(K)*c.tau)
	}
	return t
}

func (pl *replicaPlanner) rtt(q Peer) float64 { return pl.opt.RTTSeconds[q.ID] }

// finish computes c's times, cap and what its depth depends on from its peers and cuts: the cap
// is the largest share up to capTarget whose memory fits every stage at depth 0. It reports
// false when not even a share of mhat fits.
func (pl *replicaPlanner) finish(c *candidate, mhat, capTarget int) bool {
	S, W := c.S(), pl.L+1
	c.tau, c.rt, c.grad, c.lat, c.pl = 0, 0, 0, 0, pl
	for i, q := range c.peers {
		k := c.cuts[i]*W + c.cuts[i+1]
		comp, x := stageSeconds(pl.cost[k], pl.send[k], q)
		c.tau = max(c.tau, comp, x)
		c.rt += comp
		if i+1 < S {
			n := c.peers[i+1]
			c.rt += pl.prof.BoundaryBytes/q.LinkBytesPerS + pl.prof.GradBoundaryBytes/n.LinkBytesPerS + (pl.rtt(q)+pl.rtt(n))/2
		}
		c.grad = max(c.grad, GradBytesPerParam*pl.params[k]/q.LinkBytesPerS)
		// A hop from q to a partner b takes (RTT[q] + RTT[b])/4 one way: at most the larger
		// RTT/2.
		c.lat = max(c.lat, pl.rtt(q)/2)
	}
	fits := func(m int) bool {
		for i, q := range c.peers {
			if pl.memory(c.cuts[i], c.cuts[i+1], i, S, m, 0) > float64(q.MemoryBytes) {
				return false
			}
		}
		return true
	}
	mhat, capTarget = min(max(mhat, 1), pl.most), min(max(capTarget, mhat, 1), pl.most)
	c.hide, c.room = 0, nil
	if !fits(mhat) {
		c.cap = 0
		return false
	}
	lo, hi := mhat, capTarget // fits(lo); find the largest
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	c.cap = lo
	if c.rt > float64(S)*c.tau && c.cap > 1 {
		c.hide = c.cap - 1
		if c.tau > 0 {
			c.hide = min(c.hide, int(math.Ceil(c.rt/c.tau))-S)
		}
		c.hide = max(c.hide, 0)
		c.room = make([]stageRoom, 0, S)
		for i, q := range c.peers {
			k := c.cuts[i]*W + c.cuts[i+1]
			if act := pl.cost[k].ActBytes; act > 0 {
				c.room = append(c.room, stageRoom{free: (float64(q.MemoryBytes) - pl.fixed[k]) / act, params: pl.params[k] / act, inv: 1 / act, back: S - i})
			}
		}
	}
	return true
}

// group returns the best replica over exactly the peers given (nil when none fits a share of
// mhat): the cuts minimising the slowest stage's max(compute, transfer), over both pipeline
// orders of 2 peers, else the order they come in and the order by memory; of these,
// the one of least T_r(mhat).
func (pl *replicaPlanner) group(peers []Peer, mhat, capTarget int) *candidate {
	S := len(peers)
	var orders [][]Peer
	if S <= 2 {
		orders = permutations(peers)
	} else {
		// Insertion sort by memory, descending, stable: the groups are small.
		byMem := slices.Clone(peers)
		for i := 1; i < len(byMem); i++ {
			for j := i; j > 0 && byMem[j].MemoryBytes > byMem[j-1].MemoryBytes; j-- {
				byMem[j], byMem[j-1] = byMem[j-1], byMem[j]
			}
		}
		orders = [][]Peer{peers, byMem}
	}
	var best *candidate
	bestT := math.Inf(1)
	for _, o := range orders {
		_, cuts := pl.cut(o, mhat)
		if cuts == nil {
			continue
		}
		c := &candidate{peers: o, cuts: cuts}
		if !pl.finish(c, mhat, capTarget) {
			continue
		}
		if t := c.time(mhat); t < bestT {
			best, bestT = c, t
		}
	}
	if best != nil {
		best.peers = slices.Clone(best.peers)
	}
	return best
}

func permutations(ps []Peer) [][]Peer {
	if len(ps) <= 1 {
		return [][]Peer{ps}
	}
	var out [][]Peer
	for i := range ps {
		rest := append(slices.Clone(ps[:i]), ps[i+1:]...)
		for _, p := range permutations(rest) {
			out = append(out, append([]Peer{ps[i]}, p...))
		}
	}
	return out
}

// cut is the dynamic program over block cuts for peers in this pipeline order: the least
// slowest-stage max(compute, transfer) per micro-batch with every stage in its peer's memory for
// a share of mhat at depth 0, and the S+1 boundaries (nil when nothing fits). f[i][a] is the
// least slowest-stage time of blocks [a, L) on stages i… ; the smallest end b achieving it is
// kept, so the result is deterministic.
func (pl *replicaPlanner) cut(peers []Peer, mhat int) (float64, []int) {
	S, L, W := len(peers), pl.L, pl.L+1
	if S > L {
		return 0, nil
	}
	inf := math.Inf(1)
	f, ch := pl.f[:(S+1)*W], pl.ch[:(S+1)*W]
	for a := 0; a <= L; a++ {
		f[S*W+a] = inf
	}
	f[S*W+L] = 0
	tree, route := pl.treeBytes(mhat), pl.route(S, mhat)
	for i := S - 1; i >= 0; i-- {
		q := peers[i]
		mem, g := float64(q.MemoryBytes), q.GFLOPS*1e9
		inFlight := float64(InFlight(i, S, min(mhat, pl.M), 0))
		last := L - (S - i - 1)
		for a := 0; a <= L; a++ {
			best, arg := inf, -1
			if a >= i && a < last {
				for b := a + 1; b <= last; b++ {
					k := a*W + b
					c := &pl.cost[k]
					// memory's formula.
					if pl.fixed[k]+tree*pl.params[k]+route+max(inFlight*c.ActBytes, c.EvalActBytes) > mem {
						break // memory only grows with b
					}
					comp := c.FLOPs / g
					if comp >= best {
						break // and so does compute
					}
					next := f[(i+1)*W+b]
					if next >= best {
						continue
					}
					if v := max(comp, pl.send[k]/q.LinkBytesPerS, next); v < best {
						best, arg = v, b
					}
				}
			}
			f[i*W+a], ch[i*W+a] = best, arg
		}
	}
	if math.IsInf(f[0], 1) {
		return 0, nil
	}
	cuts := []int{0}
	for i, a := 0, 0; i < S; i++ {
		a = ch[i*W+a]
		cuts = append(cuts, a)
	}
	return f[0], cuts
}

// form builds replicas greedily from pool (in the order given), at most maxR, sizing each for a
// target share of mhat micro-batches. A position where no group fits loses its peer to the
// standbys. A replica that needs longer for one micro-batch (RT) than the step of those formed
// so far would take can never shorten the step; after a few such, or a few positions where
// nothing fits, the rest of the pool is not tried. memo caches the groups of the pool.
func (pl *replicaPlanner) form(pool []Peer, memSum []float64, mhat, maxR int, memo *groupCache) []*candidate {
	var out []*candidate
	var inv, a, fill float64
	bound := math.Inf(1)
	for s, useless := 0, 0; s < len(pool) && len(out) < maxR && useless < 8; {
		c := pl.bestGroup(pool, memSum, s, mhat, bound, memo)
		if c == nil {
			s++
			if len(out) > 0 {
				useless++ // past the replicas that help, the slower rest rarely fits better
			}
			continue
		}
		s += c.S()
		if c.oneBatch() >= bound {
			useless++
			continue
		}
		out = append(out, c)
		e := c.eff(mhat)
		inv += 1 / e
		a += c.rt/e - 1
		fill = max(fill, c.oneBatch())
		bound = max((float64(pl.M)+a)/inv, fill)
	}
	return out
}

// groupBound is what a group of consecutive peers, grown one at a time, needs for lowerBounds.
type groupBound struct{ sumG, maxG, minLink float64 }

func (g *groupBound) add(q Peer) {
	g.sumG += q.GFLOPS * 1e9
	g.maxG = max(g.maxG, q.GFLOPS*1e9)
	g.minLink = min(g.minLink, q.LinkBytesPerS)
}

// lowerBounds bound from below a group of S peers' time for one micro-batch through every block
// (rt: every block computed once, at best at the fastest peer's speed) and its time per further
// micro-batch (tau: perfectly balanced compute, and with several stages every stage sending at
// least minSend).
func (pl *replicaPlanner) lowerBounds(g groupBound, S int) (rt, tau float64) {
	tau = pl.flops / g.sumG
	if S > 1 {
		tau = max(tau, pl.minSend/g.minLink)
	}
	return pl.flops / g.maxG, tau
}

// bestGroup is the replica starting at pool[s] of the size S minimising T_r(mhat).
func (pl *replicaPlanner) bestGroup(pool []Peer, memSum []float64, s, mhat int, bound float64, memo *groupCache) *candidate {
	var best *candidate
	bestObj := math.Inf(1)
	g, worse := groupBound{minLink: math.Inf(1)}, 0
	for S := 1; S <= pl.maxS && s+S <= len(pool); S++ {
		g.add(pool[s+S-1])
		if memSum[s+S]-memSum[s] < pl.needLB {
			continue
		}
		rtLB, lb := pl.lowerBounds(g, S)
		if rtLB >= bound {
			continue // useless: see form
		}
		if rtLB+float64(mhat-1)*lb >= bestObj {
			if worse++; worse >= 3 {
				break
			}
			continue
		}
		c := pl.cachedGroup(memo, pool, s, S, mhat)
		if c == nil {
			continue
		}
		if obj := c.time(mhat); obj < bestObj {
			best, bestObj, worse = c, obj, 0
		} else if worse++; worse >= 3 {
			break
		}
	}
	return best
}

// groupCache holds the groups bestGroup formed in one ranked pool, by first position, size and
// target share (nil: none fits).
type groupCache struct {
	byKey  map[[3]int]*candidate
	shares []int // the target shares, ascending
}

// cachedGroup is group(pool[s:s+S], mhat, M), from memo when it can. A group cut for a smaller
// share whose cap covers mhat is the cut for mhat too: the cuts that fit only get fewer as the
// share grows (its tree and the activations in flight grow), so the smaller share's optimum,
// still feasible, is still optimal. And peers that fit no cut for a smaller share fit none for
// mhat.
func (pl *replicaPlanner) cachedGroup(memo *groupCache, pool []Peer, s, S, mhat int) *candidate {
	key := [3]int{s, S, mhat}
	if c, ok := memo.byKey[key]; ok {
		return c
	}
	for i := slices.Index(memo.shares, mhat) - 1; i >= 0; i-- {
		c, ok := memo.byKey[[3]int{s, S, memo.shares[i]}]
		if !ok {
			continue
		}
		if c == nil || c.cap >= mhat {
			memo.byKey[key] = c
			return c
		}
		break
	}
	c := pl.group(pool[s:s+S], mhat, pl.most)
	memo.byKey[key] = c
	return c
}

// extend returns base followed by the new replicas from free that raise the estimate most (see
// the top of the file); base alone when none does.
func (pl *replicaPlanner) extend(base []*candidate, free []Peer) []*candidate {
	maxR := pl.M - len(base)
	if pl.own {
		maxR = len(free) // bounded by the peers, not by M
	}
	if maxR <= 0 {
		return base
	}
	var usable []Peer
	for _, q := range free {
		if float64(q.MemoryBytes) >= pl.minNeed {
			usable = append(usable, q)
		}
	}
	if len(usable) == 0 {
		return base
	}
	slices.SortFunc(usable, fasterPeer)
	// Link thresholds: all peers, then those of at least the median upload.
	links := make([]float64, len(usable))
	for i, q := range usable {
		links[i] = q.LinkBytesPerS
	}
	slices.Sort(links)
	thresholds := []float64{0}
	qs := []float64{0.5}
	if pl.own {
		// The step waits for the slowest replica, which a single slow link makes slow: pools of
		// the faster links form replicas that are fast together.
		qs = []float64{0.5, 0.75, 0.9}
	}
	for _, f := range qs {
		if x := links[int(f*float64(len(links)-1))]; x > thresholds[len(thresholds)-1] {
			thresholds = append(thresholds, x)
		}
	}
	var mhats []int
	for m := 1; m < pl.M && !pl.own; m *= 2 { // own batches: every replica computes all M
		mhats = append(mhats, m)
	}
	mhats = append(mhats, pl.M)

	best := base
	bestObj := pl.objective(base)
	for _, x := range thresholds {
		pool := usable
		if x > 0 {
			pool = slices.DeleteFunc(slices.Clone(usable), func(q Peer) bool { return q.LinkBytesPerS < x })
		}
		// Two rankings: by speed, and by memory first (peers that hold more together, so fewer
		// stages a replica; speed breaks ties, and within a class memory varies more than speed).
		byMem := slices.Clone(pool)
		slices.SortFunc(byMem, func(a, b Peer) int {
			if c := cmp.Compare(b.MemoryBytes, a.MemoryBytes); c != 0 {
				return c
			}
			return fasterPeer(a, b)
		})
		for _, ranked := range [][]Peer{pool, byMem} {
			memSum := make([]float64, len(ranked)+1)
			for i, q := range ranked {
				memSum[i+1] = memSum[i] + float64(q.MemoryBytes)
			}
			memo := &groupCache{byKey: map[[3]int]*candidate{}, shares: mhats}
			if pl.own {
				if set, obj := pl.extendOwn(base, ranked, memSum, maxR, memo); obj > bestObj {
					best, bestObj = set, obj
				}
				continue
			}
			for _, mhat := range mhats {
				news := pl.form(ranked, memSum, mhat, min(maxR, max(1, pl.M/mhat)), memo)
				if len(news) == 0 {
					continue
				}
				if set, obj := pl.choose(base, news, mhat); obj > bestObj {
					best, bestObj = set, obj
				}
			}
		}
	}
	return best
}

// extendOwn is extend's search over one ranked pool with own batches. The step takes the slowest
// replica's T_r(M) and every other replica trains as many micro-batches as it finishes in that
// time, so each replica should be as small as it can be: for every target step time T* in a
// geometric series from an eighth of the fastest single peer's batch of M upward, formOwn builds
// replicas of the fewest peers that finish M within T*, and chooseOwn keeps the best of them. A
// larger target lets slower replicas in, which the faster ones no longer wait for, so the series
// goes on until six targets in a row (a factor of 64, the largest share's OwnShareFactor) do no
// better than the best so far.
func (pl *replicaPlanner) extendOwn(base []*candidate, ranked []Peer, memSum []float64, maxR int, memo *groupCache) ([]*candidate, float64) {
	maxG := 0.0
	for _, q := range ranked {
		maxG = max(maxG, q.GFLOPS*1e9)
	}
	var best []*candidate
	bestObj, worse := 0.0, 0
	t0 := float64(pl.M) * pl.flops / maxG
	for j := -3; j <= 20 && worse < 6; j++ {
		news := pl.formOwn(ranked, memSum, math.Ldexp(t0, j), maxR, memo)
		if len(news) == 0 {
			continue
		}
		set, obj := pl.chooseOwn(base, news, pl.M)
		if obj > bestObj {
			best, bestObj, worse = set, obj, 0
		} else {
			worse++
		}
	}
	return best, bestObj
}

// formOwn is form with own batches for a target step time: at each position of pool the replica
// of the fewest peers whose T_r(M) is within target (none: the position's peer is skipped). A
// slower replica does not hold the faster ones back — they train more micro-batches in the
// longer step (ownShares) — until the step outlasts a faster one's time for its largest share
// (its cap, or MaxOwnMicroBatches): from there on that one would wait. So a replica is useless
// when its T_r(M) reaches the least such time of those formed so far. Eight positions in a row
// without a replica end the pool.
func (pl *replicaPlanner) formOwn(pool []Peer, memSum []float64, target float64, maxR int, memo *groupCache) []*candidate {
	var out []*candidate
	bound := math.Inf(1)
	for s, misses := 0, 0; s < len(pool) && len(out) < maxR && misses < 8; {
		c := pl.ownGroup(pool, memSum, s, target, bound, memo)
		if c == nil {
			s++
			if len(out) > 0 {
				misses++
			}
			continue
		}
		s += c.S()
		misses = 0
		out = append(out, c)
		bound = min(bound, c.time(min(c.cap, pl.most)))
	}
	return out
}

// ownGroup is the replica starting at pool[s] of the fewest peers whose T_r(M) is at most target
// and below bound; nil when none.
func (pl *replicaPlanner) ownGroup(pool []Peer, memSum []float64, s int, target, bound float64, memo *groupCache) *candidate {
	M := float64(pl.M)
	g := groupBound{minLink: math.Inf(1)}
	for S := 1; S <= pl.maxS && s+S <= len(pool); S++ {
		g.add(pool[s+S-1])
		if memSum[s+S]-memSum[s] < pl.needLB {
			continue
		}
		rtLB, lb := pl.lowerBounds(g, S)
		if t := rtLB + (M-1)*lb; t > target || t >= bound {
			continue // T_r(M) ≥ RT + (M−1)·τ: out of reach at this size
		}
		c := pl.cachedGroup(memo, pool, s, S, pl.M)
		if c != nil && c.time(pl.M) <= target && c.time(pl.M) < bound {
			return c
		}
	}
	return nil
}

// syncFactor is what the synchronisation of R replicas uploads per step, in units of a peer's
// stage gradient (4 bytes a parameter), for a replica contributing nodes gradient-tree nodes.
func (pl *replicaPlanner) syncFactor(R, nodes int) float64 {
	if R < 2 {
		return 0
	}
	ring := float64(R-1) / float64(R)
	if pl.opt.Sync == SyncOuter {
		return 2 * ring * OuterWire(pl.opt.Int8) / float64(pl.opt.Every)
	}
	return float64(nodes+1) * ring
}

// OuterWire is what an outer step's exchange sends per parameter, in units of 4 bytes: float32,
// or int8 with a float32 scale per model.OuterChunk values (model.OuterLayout).
func OuterWire(int8 bool) float64 {
	if int8 {
		return (1 + 4.0/model.OuterChunk) / 4
	}
	return 1
}

// outerRounds are the message rounds of an outer step's exchange: the reduce-scatter and the
// all-gather (client/outer.go).
const outerRounds = 2

// syncLatency is the latency a step of R replicas spends on synchronisation, amortised, when its
// slowest one-way hop takes lat seconds: outerRounds of it every Every steps in outer mode; none
// counted in step mode.
func (pl *replicaPlanner) syncLatency(R int, lat float64) float64 {
	if R < 2 || pl.opt.Sync != SyncOuter {
		return 0
	}
	return outerRounds * lat / float64(pl.opt.Every)
}

// exposed is the part of a synchronisation of sync seconds a step (the slowest replica's
// exchange amortised over Every: c.grad·syncFactor) that replicas whose step computes for compute
// seconds (the slowest's T_r) do not hide: all of it, except in outer mode with a Delay, where
// the exchange of an outer step, Every·sync, runs behind Delay inner steps and only
// max(0, Every·sync − Delay·compute) of it is exposed, per step divided by Every (see the top of
// the file). Without a delay it returns sync itself, so that such estimates stay bit for bit
// what they were.
func (pl *replicaPlanner) exposed(sync, compute float64) float64 {
	if pl.opt.Delay == 0 {
		return sync
	}
	H := float64(pl.opt.Every)
	return max(0, H*sync-float64(pl.opt.Delay)*compute) / H
}

// byKey is a copy of cs sorted by key, ties by first peer id: an order independent of the peers'.
func byKey(cs []*candidate, key func(*candidate) float64) []*candidate {
	cs = slices.Clone(cs)
	slices.SortStableFunc(cs, func(a, b *candidate) int {
		if c := cmp.Compare(key(a), key(b)); c != 0 {
			return c
		}
		return cmp.Compare(a.peers[0].ID, b.peers[0].ID)
	})
	return cs
}

// syncBounds are the distinct synchronisation times of cs, ascending — at most 32 of them
// (quantiles), which keeps a scan over them O(32·R).
func syncBounds(cs []*candidate) []float64 {
	syncs := make([]float64, len(cs))
	for i, c := range cs {
		syncs[i] = c.grad
	}
	slices.Sort(syncs)
	syncs = slices.Compact(syncs)
	if len(syncs) > 32 {
		var q []float64
		for i := 1; i <= 32; i++ {
			q = append(q, syncs[i*(len(syncs)-1)/32])
		}
		syncs = slices.Compact(q)
	}
	return syncs
}

// takeWithin is base and the first k of news (in their order) whose synchronisation time is
// within x: the set a scan of choose or chooseOwn found best.
func takeWithin(base, news []*candidate, x float64, k int) []*candidate {
	out := slices.Clone(base)
	for _, c := range news {
		if len(out)-len(base) == k {
			break
		}
		if c.grad <= x {
			out = append(out, c)
		}
	}
	return out
}

// choose picks from news the replicas to add to base: for every bound on a replica's
// synchronisation time, those within it that are fastest for one micro-batch, as many as
// maximise the estimate. Small M is evaluated with exact shares, large M with continuous ones at
// each replica's pace for a share of mhat, the share news were formed for (then the chosen set's
// exact estimate is returned).
func (pl *replicaPlanner) choose(base, news []*candidate, mhat int) ([]*candidate, float64) {
	news = byKey(news, (*candidate).oneBatch)
	syncs := syncBounds(news)
	exact := pl.M <= 64
	var baseInv, baseA, baseFill, baseSync, baseLat, baseCap float64
	for _, c := range base {
		e := c.eff(mhat)
		baseInv += 1 / e
		baseA += c.rt/e - 1
		baseFill = max(baseFill, c.oneBatch())
		baseSync, baseLat = max(baseSync, c.grad), max(baseLat, c.lat)
		baseCap += float64(c.cap)
	}
	tokens := float64(pl.M) * float64(pl.prof.Tokens)
	bestObj, bestX, bestK := pl.objective(base), 0.0, 0
	set := slices.Clone(base)
	for _, x := range syncs {
		inv, a, fill, worst, lat, caps, k := baseInv, baseA, baseFill, baseSync, baseLat, baseCap, 0
		set = set[:len(base)]
		for _, c := range news {
			if len(base)+k >= pl.M {
				break
			}
			if c.grad > x {
				continue
			}
			e := c.eff(mhat)
			inv += 1 / e
			a += c.rt/e - 1
			fill = max(fill, c.oneBatch())
			worst, lat = max(worst, c.grad), max(lat, c.lat)
			caps += float64(c.cap)
			k++
			R := len(base) + k
			var obj float64
			if exact {
				set = append(set, c)
				obj = pl.objective(set)
			} else if caps >= float64(pl.M) {
				T := max((float64(pl.M)+a)/inv, fill)
				obj = tokens / (T + pl.exposed(worst*pl.syncFactor(R, treeBound(pl.M, (pl.M+R-1)/R))+pl.syncLatency(R, lat), T))
			}
			if obj > bestObj {
				bestObj, bestX, bestK = obj, x, k
			}
		}
	}
	out := takeWithin(base, news, bestX, bestK)
	return out, pl.objective(out)
}

// chooseOwn is choose with own batches: for every bound on a replica's synchronisation time,
// of the news within it those fastest for a batch of M (T_r(M)), as many as maximise
// Σ n_r·N / (max_r T_r(M) + synchronisation). The scan takes n_r continuous, a replica's
// (T − RT)/e + 1 micro-batches in a step of T at its steady pace e (at least M each), so that
// the sum is kept incrementally, O(R) a bound; the chosen set's exact estimate (ownShares) is
// returned.
func (pl *replicaPlanner) chooseOwn(base, news []*candidate, _ int) ([]*candidate, float64) {
	news = byKey(news, func(c *candidate) float64 { return c.time(pl.M) })
	syncs := syncBounds(news)
	type pace struct{ t, inv, a float64 } // T_r(M), 1/e, RT/e − 1
	paceOf := func(c *candidate) pace {
		e := c.eff(pl.M)
		return pace{c.time(pl.M), 1 / e, c.rt/e - 1}
	}
	paces := make([]pace, len(news))
	for i, c := range news {
		paces[i] = paceOf(c)
	}
	var baseT, baseSync, baseLat, baseInv, baseA float64
	for _, c := range base {
		p := paceOf(c)
		baseT, baseInv, baseA = max(baseT, p.t), baseInv+p.inv, baseA+p.a
		baseSync, baseLat = max(baseSync, c.grad), max(baseLat, c.lat)
	}
	N, M := float64(pl.prof.Tokens), float64(pl.M)
	bestObj, bestX, bestK := pl.objective(base), 0.0, 0
	for _, x := range syncs {
		T, worst, lat, inv, a, k := baseT, baseSync, baseLat, baseInv, baseA, 0
		for i, c := range news {
			if c.grad > x {
				continue
			}
			p := paces[i]
			T, worst, lat, inv, a = max(T, p.t), max(worst, c.grad), max(lat, c.lat), inv+p.inv, a+p.a
			k++
			R := len(base) + k
			n := max(float64(R)*M, T*inv-a)
			if obj := n * N / (T + pl.exposed(worst*pl.syncFactor(R, 0)+pl.syncLatency(R, lat), T)); obj > bestObj {
				bestObj, bestX, bestK = obj, x, k
			}
		}
	}
	out := takeWithin(base, news, bestX, bestK)
	return out, pl.objective(out)
}

// objective is the estimated tokens per second of replicas with exact shares; 0 for none, or
// when their caps do not cover the step.
func (pl *replicaPlanner) objective(reps []*candidate) float64 {
	if len(reps) == 0 || len(reps) > pl.M && !pl.own {
		return 0
	}
	shares := pl.shares(reps)
	if shares == nil {
		return 0
	}
	return pl.estimate(reps, shares).GoodputTokensPerS
}

// shares divides the step among reps by their T_r, within their caps; nil when the caps do not
// cover the step. With own batches (ownShares) the slowest replica trains M and every other as
// many as it finishes in that time; nil when a cap is less than M.
func (pl *replicaPlanner) shares(reps []*candidate) []int {
	if pl.own && len(reps) > 0 {
		return pl.ownShares(reps)
	}
	if len(reps) == 0 || len(reps) > pl.M {
		return nil
	}
	caps := make([]int, len(reps))
	for r, c := range reps {
		caps[r] = max(c.cap, 1)
	}
	shares, _ := shareBy(len(reps), pl.M, caps, func(r, m int) float64 { return reps[r].time(m) })
	return shares
}

// ownShares are the shares of own batches: the step takes T* = max_r T_r(M), the slowest replica's
// time for a batch of M micro-batches, and replica r trains the most micro-batches n_r ≥ M it
// finishes within T* (T_r never falls as the share grows), up to its cap and the largest share,
// so that no replica waits for another. nil when a replica cannot hold M.
func (pl *replicaPlanner) ownShares(reps []*candidate) []int {
	slowest := 0.0
	for _, c := range reps {
		if c.cap < pl.M {
			return nil
		}
		slowest = max(slowest, c.time(pl.M))
	}
	shares := make([]int, len(reps))
	for r, c := range reps {
		lo, hi := pl.M, min(c.cap, pl.most) // T_r(lo) ≤ T*; find the largest
		if hi > lo && c.time(hi) <= slowest {
			lo = hi
		}
		for lo < hi {
			mid := lo + (hi-lo+1)/2
			if c.time(mid) <= slowest {
				lo = mid
			} else {
				hi = mid - 1
			}
		}
		shares[r] = lo
	}
	return shares
}

// estimate is the estimate of reps with these shares (nil: none).
func (pl *replicaPlanner) estimate(reps []*candidate, shares []int) Estimate {
	if shares == nil {
		return Estimate{}
	}
	e := Estimate{Replicas: len(reps)}
	first := 0
	lat := 0.0
	for _, c := range reps {
		lat = max(lat, c.lat)
	}
	for r, c := range reps {
		e.ComputeSeconds = max(e.ComputeSeconds, c.time(shares[r]))
		if len(reps) > 1 {
			nodes := 0
			if pl.opt.Sync == SyncStep {
				nodes = len(model.TreeNodes(pl.M, first, first+shares[r]))
			}
			e.SyncSeconds = max(e.SyncSeconds, c.grad*pl.syncFactor(len(reps), nodes)+pl.syncLatency(len(reps), lat))
		}
		first += shares[r]
	}
	if whole := e.SyncSeconds; pl.opt.Delay > 0 {
		e.SyncSeconds = pl.exposed(whole, e.ComputeSeconds)
		e.HiddenSeconds = whole - e.SyncSeconds
	}
	e.StepSeconds = e.ComputeSeconds + e.SyncSeconds
	if e.StepSeconds > 0 {
		n := float64(microBatches(shares)) // M, or with own batches Σ n_r
		e.TokensPerS = n * float64(pl.prof.Tokens) / e.StepSeconds
		e.FLOPsPerS = n * pl.flops / e.StepSeconds
	}
	peers := 0
	for _, c := range reps {
		peers += len(c.peers)
	}
	e.GoodputTokensPerS = pl.opt.Churn.Goodput(e, peers, pl.opt)
	return e
}

// microBatches is how many micro-batches a step of these shares trains: M when they share one
// batch, Σ n_r with own batches.
func microBatches(shares []int) int {
	n := 0
	for _, m := range shares {
		n += m
	}
	return n
}

// fromPlan turns p's replicas into candidates, with the peers of byID: their times, depth and
// cap as the planner computes them, the cap no less than the share the plan gives.
func (pl *replicaPlanner) fromPlan(p Plan, byID map[string]Peer) ([]*candidate, error) {
	var out []*candidate
	for r, rp := range p.Pipelines() {
		if len(rp.Stages) == 0 {
			continue
		}
		c := &candidate{cuts: []int{rp.Stages[0].Begin}}
		for _, st := range rp.Stages {
			q, ok := byID[st.Peer]
			if !ok {
				return nil, fmt.Errorf("%w: peer %q of replica %d is not among the peers", ErrBadInput, st.Peer, r)
			}
			if st.Begin < 0 || st.End > pl.L || st.Begin >= st.End || st.Begin != c.cuts[len(c.cuts)-1] {
				return nil, fmt.Errorf("%w: replica %d: stage [%d, %d) of %d blocks", ErrBadInput, r, st.Begin, st.End, pl.L)
			}
			c.peers = append(c.peers, q)
			c.cuts = append(c.cuts, st.End)
		}
		if c.cuts[0] != 0 || c.cuts[len(c.cuts)-1] != pl.L {
			return nil, fmt.Errorf("%w: replica %d covers blocks [%d, %d) of %d", ErrBadInput, r, c.cuts[0], c.cuts[len(c.cuts)-1], pl.L)
		}
		pl.finish(c, 1, pl.most)
		c.cap = max(c.cap, rp.MicroBatches, 1)
		out = append(out, c)
	}
	if len(out) > pl.M && !pl.own {
		return nil, fmt.Errorf("%w: %d replicas for %d micro-batches", ErrBadInput, len(out), pl.M)
	}
	return out, nil
}

// plan materialises replicas (in replica order) as a Plan; every peer of all that no replica
// holds is a standby, fastest first. Each stage's MemoryBytes is ReplicaStageMemory for its
// replica's very micro-batches at the replica's depth: at most what its cap was checked for.
func (pl *replicaPlanner) plan(reps []*candidate, all []Peer) Plan {
	shares := pl.shares(reps)
	if shares == nil {
		panic("sched: a chosen set of replicas whose caps do not cover the step") // a bug: objective 0 is never chosen
	}
	e := pl.estimate(reps, shares)
	p := Plan{Version: pl.opt.Version, MicroBatches: pl.M, StepSeconds: e.StepSeconds}
	used := map[string]bool{}
	first, W := 0, pl.L+1
	for r, c := range reps {
		rp := Replica{First: first, MicroBatches: shares[r], StepSeconds: c.time(shares[r])}
		for i, q := range c.peers {
			a, b := c.cuts[i], c.cuts[i+1]
			comp, x := stageSeconds(pl.cost[a*W+b], pl.send[a*W+b], q)
			rp.Stages = append(rp.Stages, Stage{Begin: a, End: b, Peer: q.ID, ComputeSeconds: comp, TransferSeconds: x,
				MemoryBytes: ReplicaStageMemory(pl.prof, a, b, i, c.S(), first, shares[r], c.depthAt(shares[r]), pl.opt)})
			used[q.ID] = true
		}
		if !pl.own { // own batches: every replica computes [0, n_r) of its own
			first += shares[r]
		}
		p.Replicas = append(p.Replicas, rp)
	}
	standby := slices.DeleteFunc(slices.Clone(all), func(q Peer) bool { return used[q.ID] })
	slices.SortFunc(standby, fasterPeer)
	for _, q := range standby {
		p.Standby = append(p.Standby, q.ID)
	}
	return p
}
