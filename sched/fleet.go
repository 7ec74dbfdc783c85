package sched

import (
	"cmp"
	"container/heap"
	"fmt"
	"math"
	"math/bits"
	"slices"
)

// Replicated plans for fleets of thousands of peers (issue 13, DESIGN.md "Replicas and
// synchronisation"). Partition cuts the model into one pipeline and keeps every other peer
// waiting; PlanReplicas turns many peers into throughput: R pipeline replicas, each with its own
// cuts and peers, share the step's M micro-batches in whole micro-batches, in proportion to their
// speed, and synchronise their gradients (step mode) or pseudo-gradients (outer mode, DiLoCo:
// Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models").
//
// The estimate the planner maximises is tokens per second,
//
//	M · N / (max over replicas r of (m_r + S_r − 1) · τ_r  +  exposed synchronisation)
//
// where m_r is replica r's share, S_r its stages, τ_r its slowest stage's seconds per
// micro-batch (compute + transfer, as in Partition), and N the tokens of a micro-batch. The
// synchronisation is a ring reduction per tensor across the replicas that hold it: each peer of a
// stage sends about 2·(R−1)/R times its stage's gradient (4 bytes a parameter) over its upload,
// so the exposed time is the largest such transfer over all peers. It is taken as fully exposed,
// not overlapped with the backward pass: the reduction of a tensor can only start when the last
// replica has finished that tensor's backward, which for the first blocks is the very end of the
// step, and the replicas do not finish together (pessimistic; the overlapped part is what the
// estimate leaves as margin). In outer mode the replicas exchange pseudo-gradients once every H
// inner steps (1 byte a parameter with int8), so the same transfer counts H times less per step.
//
// The search is greedy, not exact (Partition's exact search is exponential in the peers). Peers
// that cannot hold the smallest stage are standbys. The rest are ranked by speed (then memory,
// link and id, so the input order does not matter) and cut, from the fastest, into consecutive
// groups; each group becomes a replica whose cuts come from a dynamic program over blocks in a
// fixed pipeline order of its peers (every order for up to 3 peers, else by speed and by memory),
// O(S·L²) instead of Partition's O(2^K·K·L²·S). The group size S is chosen for a target share m̂
// (minimising (m̂+S−1)·τ, the replica's time for m̂ micro-batches): large shares favour long
// pipelines, small ones short pipelines and so more replicas. This is repeated for every target
// share m̂ in 1, 2, 4, …, M and, because one slow link makes the whole reduction slow, for
// pools restricted to peers of at least the median, 75th and 90th percentile upload. Of each
// pool's replicas the planner keeps, for every bound X on a replica's synchronisation time, the
// replicas within X that are fastest for one micro-batch (S·τ), as many as raise the estimate;
// the best of all these plans wins, with exact whole-micro-batch shares (ShareMicroBatches).

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
	// at least one).
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
	// MaxStages caps each replica's stages; 0 means min(L, DefaultReplicaStages).
	MaxStages int
}

// DefaultReplicaStages is the default cap on a replica's stages (ReplicaOptions.MaxStages).
const DefaultReplicaStages = 16

// GradBytesPerParam is a float32 gradient: what the step-mode reduction moves per parameter, and
// the size of one gradient buffer.
const GradBytesPerParam = 4

// OuterBytesPerParam is what a replica keeps per parameter in outer mode besides its own state:
// the global θ of the round's start (its pseudo-gradient is global θ − replica θ) and the outer
// Nesterov momentum, which every replica applies alike.
const OuterBytesPerParam = 8

func (o ReplicaOptions) validate(L int) error {
	switch {
	case o.MicroBatches < 1:
		return fmt.Errorf("%w: %d micro-batches", ErrBadInput, o.MicroBatches)
	case o.Sync != SyncStep && o.Sync != SyncOuter:
		return fmt.Errorf("%w: sync mode %d", ErrBadInput, o.Sync)
	case o.Sync == SyncOuter && o.Every < 1:
		return fmt.Errorf("%w: outer sync every %d steps (want ≥ 1)", ErrBadInput, o.Every)
	case o.Sync == SyncStep && (o.Every != 0 || o.Int8):
		return fmt.Errorf("%w: every and int8 belong to outer sync", ErrBadInput)
	case o.MaxStages < 0:
		return fmt.Errorf("%w: MaxStages %d", ErrBadInput, o.MaxStages)
	case L < 1:
		return fmt.Errorf("%w: a profile without blocks", ErrBadInput)
	}
	return nil
}

// ExtraBytesPerParam is the memory a stage of a replicated plan needs per parameter beyond
// Profile.StageMemory: the step's gradient is summed over a fixed binary tree of the M
// micro-batches, so a peer holds up to ⌈log2 M⌉+1 gradient buffers; outer mode adds
// OuterBytesPerParam, and 4 more for int8's error feedback. It is budgeted whatever R, because
// AddReplicas and dropped replicas change R without moving stages.
func (o ReplicaOptions) ExtraBytesPerParam() float64 {
	n := GradBytesPerParam * float64(bits.Len(uint(max(o.MicroBatches, 1)-1))+1)
	if o.Sync == SyncOuter {
		n += OuterBytesPerParam
		if o.Int8 {
			n += 4
		}
	}
	return n
}

// wireBytesPerParam is what one synchronisation sends per parameter before the ring's factor.
func (o ReplicaOptions) wireBytesPerParam() float64 {
	if o.Sync == SyncOuter && o.Int8 {
		return 1
	}
	return GradBytesPerParam
}

// syncExposed is the exposed synchronisation per step of R replicas whose slowest peer needs
// worst seconds to send its stage's gradient once.
func (o ReplicaOptions) syncExposed(R int, worst float64) float64 {
	if R < 2 {
		return 0
	}
	t := 2 * float64(R-1) / float64(R) * worst
	if o.Sync == SyncOuter {
		t /= float64(o.Every)
	}
	return t
}

// ReplicaStageMemory is the memory stage index of S holding blocks [a, b) needs in a replicated
// plan: Profile.StageMemory with M = opt.MicroBatches, plus ExtraBytesPerParam per parameter.
func ReplicaStageMemory(prof Profile, a, b, index, S int, opt ReplicaOptions) float64 {
	c := prof.stageCost(a, b)
	fixed := c.StateBytes + opt.ExtraBytesPerParam()*float64(c.Params)
	return fixed + max(float64(InFlight(index, S, opt.MicroBatches, 0))*c.ActBytes, c.EvalActBytes)
}

// ShareMicroBatches divides M micro-batches among replicas whose slowest stages take tau[r]
// seconds per micro-batch over stages[r] stages: whole micro-batches, at least one each, summing
// to M, minimising the step's compute time max over r of (m_r + S_r − 1)·τ_r, which it returns.
// It gives micro-batches one at a time to the replica that would finish it first (ties to the
// lower index), which is optimal for this min-max. It panics unless len(tau) == len(stages) and
// 1 ≤ len(tau) ≤ M.
func ShareMicroBatches(tau []float64, stages []int, M int) ([]int, float64) {
	R := len(tau)
	if R != len(stages) || R < 1 || R > M {
		panic(fmt.Sprintf("sched: ShareMicroBatches of %d micro-batches over %d replicas (%d stage counts)", M, R, len(stages)))
	}
	shares := make([]int, R)
	h := &shareHeap{tau: tau, stages: stages, shares: shares}
	for r := range shares {
		shares[r] = 1
		h.idx = append(h.idx, r)
	}
	heap.Init(h)
	for n := R; n < M; n++ {
		r := h.idx[0]
		shares[r]++
		heap.Fix(h, 0)
	}
	T := 0.0
	for r := range shares {
		T = max(T, float64(shares[r]+stages[r]-1)*tau[r])
	}
	return shares, T
}

// shareHeap orders replicas by the finish time of one more micro-batch.
type shareHeap struct {
	tau    []float64
	stages []int
	shares []int
	idx    []int
}

func (h *shareHeap) next(r int) float64 { return float64(h.shares[r]+h.stages[r]) * h.tau[r] }
func (h *shareHeap) Len() int           { return len(h.idx) }
func (h *shareHeap) Less(i, j int) bool {
	a, b := h.next(h.idx[i]), h.next(h.idx[j])
	return a < b || a == b && h.idx[i] < h.idx[j]
}
func (h *shareHeap) Swap(i, j int) { h.idx[i], h.idx[j] = h.idx[j], h.idx[i] }
func (h *shareHeap) Push(x any)    { h.idx = append(h.idx, x.(int)) }
func (h *shareHeap) Pop() any {
	x := h.idx[len(h.idx)-1]
	h.idx = h.idx[:len(h.idx)-1]
	return x
}

// Estimate is the planner's estimate of a replicated plan's step.
type Estimate struct {
	Replicas int `json:"replicas"`
	// ComputeSeconds is max over replicas of (m_r + S_r − 1)·τ_r.
	ComputeSeconds float64 `json:"compute_seconds"`
	// SyncSeconds is the exposed synchronisation per step (amortised over Every in outer mode).
	SyncSeconds float64 `json:"sync_seconds"`
	// StepSeconds is their sum.
	StepSeconds float64 `json:"step_seconds"`
	// TokensPerS is M·N / StepSeconds.
	TokensPerS float64 `json:"tokens_per_s"`
	// FLOPsPerS is the model's FLOPs of the step (Profile, forward and backward) / StepSeconds:
	// the useful FLOP/s.
	FLOPsPerS float64 `json:"flops_per_s"`
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
		shares[r] = rp.MicroBatches
	}
	return pl.estimate(reps, shares), nil
}

// PlanReplicas plans R pipeline replicas of prof's blocks over peers, choosing R, each replica's
// peers, cuts and share of the M = opt.MicroBatches micro-batches to maximise the estimated
// tokens per second (see the comment at the top of fleet.go for the estimate and the search).
// Every stage fits its peer's memory, ReplicaStageMemory; the plan's Replicas are in replica
// order (replica r computes micro-batches [First, First+MicroBatches), after replica r−1's),
// fastest first; StepSeconds is the estimate's step time; Standby lists every peer that no
// replica uses, fastest first. The same peers give the same plan in any input order. It plans
// 10,000 peers in tens of milliseconds (BenchmarkPlanReplicas10000).
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
		before := pl.estimate(base, pl.shares(base))
		after := pl.estimate(chosen, pl.shares(chosen))
		if !(after.TokensPerS > before.TokensPerS) {
			return current, false, nil
		}
	}
	return pl.plan(chosen, sorted), true, nil
}

// DropReplicas returns p without the replicas that hold any of the peers gone: their other
// peers join the standbys (after the old ones), gone peers leave Standby, and the survivors'
// shares are divided anew (ShareMicroBatches on their stages' times). Stages and peers of the
// surviving replicas do not change. With no survivor, Replicas is empty and the caller must
// replan.
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

func replicaTau(stages []Stage) float64 {
	tau := 0.0
	for _, s := range stages {
		tau = max(tau, s.ComputeSeconds+s.TransferSeconds)
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
	maxS    int
	cost    []Cost    // cost[a*(L+1)+b]: blocks [a, b)
	send    []float64 // send[a*(L+1)+b]: SendBytes(a, b)
	params  []float64 // params[a*(L+1)+b]
	fixed   []float64 // fixed[a*(L+1)+b]: the memory that does not depend on the micro-batches in flight
	extra   float64   // ExtraBytesPerParam
	minNeed float64   // the least memory of any stage
	needLB  float64   // a lower bound on a whole replica's memory: state and extra, no activations
	minSend float64   // the least any stage of a pipeline of 2 or more sends per micro-batch
	flops   float64   // the whole model's FLOPs per micro-batch
	f       []float64 // dynamic program scratch
	ch      []int
}

func newReplicaPlanner(prof Profile, opt ReplicaOptions) *replicaPlanner {
	L := prof.NumBlocks()
	W := L + 1
	pl := &replicaPlanner{prof: prof, opt: opt, L: L, M: opt.MicroBatches, extra: opt.ExtraBytesPerParam(),
		cost: make([]Cost, W*W), send: make([]float64, W*W), params: make([]float64, W*W), fixed: make([]float64, W*W),
		minNeed: math.Inf(1)}
	pl.maxS = min(L, DefaultReplicaStages)
	if opt.MaxStages > 0 {
		pl.maxS = min(L, opt.MaxStages)
	}
	for a := 0; a < L; a++ {
		for b := a + 1; b <= L; b++ {
			c := prof.stageCost(a, b)
			pl.cost[a*W+b], pl.send[a*W+b], pl.params[a*W+b] = c, prof.SendBytes(a, b), float64(c.Params)
			pl.fixed[a*W+b] = c.StateBytes + pl.extra*float64(c.Params)
		}
		pl.minNeed = min(pl.minNeed, pl.memory(a, a+1, 0, 1))
	}
	all := pl.cost[L]
	pl.needLB = all.StateBytes + pl.extra*float64(all.Params)
	pl.flops = all.FLOPs
	pl.minSend = min(prof.BoundaryBytes, prof.GradBoundaryBytes)
	pl.f = make([]float64, (pl.maxS+1)*W)
	pl.ch = make([]int, (pl.maxS+1)*W)
	return pl
}

// memory is ReplicaStageMemory on the precomputed sums.
func (pl *replicaPlanner) memory(a, b, index, S int) float64 {
	k := a*(pl.L+1) + b
	return pl.fixed[k] + max(float64(InFlight(index, S, pl.M, 0))*pl.cost[k].ActBytes, pl.cost[k].EvalActBytes)
}

// candidate is a replica as the planner builds it: peers in pipeline order and the cuts.
type candidate struct {
	peers []Peer
	cuts  []int // S+1 boundaries, 0 … L
	tau   float64
	sync  float64 // seconds its slowest peer needs to send its stage's gradient once
}

func (c *candidate) S() int            { return len(c.peers) }
func (c *candidate) oneBatch() float64 { return float64(len(c.peers)) * c.tau }

// group returns the best replica over exactly the peers given (nil when none fits): the cuts
// minimising the slowest stage, over every pipeline order of up to 3 peers, else the speed
// order they come in and the order by memory.
func (pl *replicaPlanner) group(peers []Peer) *candidate {
	S := len(peers)
	var orders [][]Peer
	if S <= 3 {
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
	for _, o := range orders {
		tau, cuts := pl.cut(o)
		if cuts != nil && (best == nil || tau < best.tau) {
			best = &candidate{peers: slices.Clone(o), cuts: cuts, tau: tau}
		}
	}
	if best != nil {
		W := pl.L + 1
		for i, q := range best.peers {
			best.sync = max(best.sync, pl.opt.wireBytesPerParam()*pl.params[best.cuts[i]*W+best.cuts[i+1]]/q.LinkBytesPerS)
		}
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
// slowest-stage seconds per micro-batch with every stage in its peer's memory, and the S+1
// boundaries (nil when nothing fits). f[i][a] is the least slowest-stage time of blocks [a, L)
// on stages i… ; the smallest end b achieving it is kept, so the result is deterministic.
func (pl *replicaPlanner) cut(peers []Peer) (float64, []int) {
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
	for i := S - 1; i >= 0; i-- {
		q := peers[i]
		mem, g := float64(q.MemoryBytes), q.GFLOPS*1e9
		inFlight := float64(InFlight(i, S, pl.M, 0))
		last := L - (S - i - 1)
		for a := 0; a <= L; a++ {
			best, arg := inf, -1
			if a >= i && a < last {
				for b := a + 1; b <= last; b++ {
					k := a*W + b
					c := &pl.cost[k]
					// stageMemory's formula, plus the extra (fixed holds both parts that do not
					// depend on the micro-batches in flight).
					if pl.fixed[k]+max(inFlight*c.ActBytes, c.EvalActBytes) > mem {
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
					if v := max(comp+pl.send[k]/q.LinkBytesPerS, next); v < best {
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

// form builds replicas greedily from pool (ranked by fasterPeer), at most maxR, sizing each for
// a target share of mhat micro-batches. A position where no group fits loses its peer to the
// standbys. A replica that needs longer for one micro-batch (S·τ) than the step of those formed
// so far would take can never shorten the step; after a few such, the slower rest of the pool
// is not tried. memo caches groups by (first index, size) within the pool.
func (pl *replicaPlanner) form(pool []Peer, memSum []float64, mhat, maxR int, memo map[[2]int]*candidate) []*candidate {
	var out []*candidate
	var inv, s1, fill float64
	bound := math.Inf(1)
	for s, useless := 0, 0; s < len(pool) && len(out) < maxR && useless < 8; {
		c := pl.bestGroup(pool, memSum, s, mhat, bound, memo)
		if c == nil {
			s++
			continue
		}
		s += c.S()
		if c.oneBatch() >= bound {
			useless++
			continue
		}
		out = append(out, c)
		inv += 1 / c.tau
		s1 += float64(c.S() - 1)
		fill = max(fill, c.oneBatch())
		bound = max((float64(pl.M)+s1)/inv, fill)
	}
	return out
}

// bestGroup is the replica starting at pool[s] of the size S minimising (mhat+S−1)·τ.
func (pl *replicaPlanner) bestGroup(pool []Peer, memSum []float64, s, mhat int, bound float64, memo map[[2]int]*candidate) *candidate {
	var best *candidate
	bestObj := math.Inf(1)
	sumG, minLink, worse := 0.0, math.Inf(1), 0
	for S := 1; S <= pl.maxS && s+S <= len(pool); S++ {
		q := pool[s+S-1]
		sumG += q.GFLOPS * 1e9
		minLink = min(minLink, q.LinkBytesPerS)
		if memSum[s+S]-memSum[s] < pl.needLB {
			continue
		}
		lb := pl.flops / sumG // perfectly balanced compute
		if S > 1 {
			lb = max(lb, pl.minSend/minLink) // every stage sends at least minSend
		}
		if float64(S)*lb >= bound {
			continue // useless: see form
		}
		if float64(mhat+S-1)*lb >= bestObj {
			if worse++; worse >= 3 {
				break
			}
			continue
		}
		key := [2]int{s, S}
		c, ok := memo[key]
		if !ok {
			c = pl.group(pool[s : s+S])
			memo[key] = c
		}
		if c == nil {
			continue
		}
		if obj := float64(mhat+S-1) * c.tau; obj < bestObj {
			best, bestObj, worse = c, obj, 0
		} else if worse++; worse >= 3 {
			break
		}
	}
	return best
}

// extend returns base followed by the new replicas from free that raise the estimate most (see
// the top of the file); base alone when none does.
func (pl *replicaPlanner) extend(base []*candidate, free []Peer) []*candidate {
	maxR := pl.M - len(base)
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
	// Link thresholds: all peers, then those of at least the median, 75th and 90th percentile
	// upload (only the median in outer mode, where synchronisation is rare).
	links := make([]float64, len(usable))
	for i, q := range usable {
		links[i] = q.LinkBytesPerS
	}
	slices.Sort(links)
	thresholds := []float64{0}
	qs := []float64{0.5, 0.75, 0.9}
	if pl.opt.Sync == SyncOuter {
		qs = qs[:1]
	}
	for _, f := range qs {
		if x := links[int(f*float64(len(links)-1))]; x > thresholds[len(thresholds)-1] {
			thresholds = append(thresholds, x)
		}
	}
	var mhats []int
	for m := 1; m < pl.M; m *= 2 {
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
		memSum := make([]float64, len(pool)+1)
		for i, q := range pool {
			memSum[i+1] = memSum[i] + float64(q.MemoryBytes)
		}
		memo := map[[2]int]*candidate{}
		for _, mhat := range mhats {
			news := pl.form(pool, memSum, mhat, min(maxR, max(1, pl.M/mhat)), memo)
			if len(news) == 0 {
				continue
			}
			if set, obj := pl.choose(base, news); obj > bestObj {
				best, bestObj = set, obj
			}
		}
	}
	return best
}

// choose picks from news the replicas to add to base: for every bound on a replica's
// synchronisation time, those within it that are fastest for one micro-batch, as many as
// maximise the estimate. Small M is evaluated with exact shares, large M with continuous ones
// (then the chosen set's exact estimate is returned).
func (pl *replicaPlanner) choose(base, news []*candidate) ([]*candidate, float64) {
	news = slices.Clone(news)
	slices.SortStableFunc(news, func(a, b *candidate) int {
		if c := cmp.Compare(a.oneBatch(), b.oneBatch()); c != 0 {
			return c
		}
		return cmp.Compare(a.peers[0].ID, b.peers[0].ID)
	})
	syncs := make([]float64, len(news))
	for i, c := range news {
		syncs[i] = c.sync
	}
	slices.Sort(syncs)
	syncs = slices.Compact(syncs)
	if len(syncs) > 32 { // quantiles keep the scan O(32·R)
		var q []float64
		for i := 1; i <= 32; i++ {
			q = append(q, syncs[i*(len(syncs)-1)/32])
		}
		syncs = slices.Compact(q)
	}
	exact := pl.M <= 64
	var baseInv, baseS1, baseFill, baseSync float64
	for _, c := range base {
		baseInv += 1 / c.tau
		baseS1 += float64(c.S() - 1)
		baseFill = max(baseFill, c.oneBatch())
		baseSync = max(baseSync, c.sync)
	}
	tokens := float64(pl.M) * float64(pl.prof.Tokens)
	bestObj, bestX, bestK := pl.objective(base), 0.0, 0
	set := slices.Clone(base)
	for _, x := range syncs {
		inv, s1, fill, worst, k := baseInv, baseS1, baseFill, baseSync, 0
		set = set[:len(base)]
		for _, c := range news {
			if len(base)+k >= pl.M {
				break
			}
			if c.sync > x {
				continue
			}
			inv += 1 / c.tau
			s1 += float64(c.S() - 1)
			fill = max(fill, c.oneBatch())
			worst = max(worst, c.sync)
			k++
			R := len(base) + k
			var obj float64
			if exact {
				set = append(set, c)
				obj = pl.objective(set)
			} else {
				T := max((float64(pl.M)+s1)/inv, fill)
				obj = tokens / (T + pl.opt.syncExposed(R, worst))
			}
			if obj > bestObj {
				bestObj, bestX, bestK = obj, x, k
			}
		}
	}
	out := slices.Clone(base)
	for _, c := range news {
		if len(out)-len(base) == bestK {
			break
		}
		if c.sync <= bestX {
			out = append(out, c)
		}
	}
	return out, pl.objective(out)
}

// objective is the estimated tokens per second of replicas with exact shares; 0 for none.
func (pl *replicaPlanner) objective(reps []*candidate) float64 {
	if len(reps) == 0 || len(reps) > pl.M {
		return 0
	}
	return pl.estimate(reps, pl.shares(reps)).TokensPerS
}

func (pl *replicaPlanner) shares(reps []*candidate) []int {
	if len(reps) == 0 {
		return nil
	}
	tau, S := make([]float64, len(reps)), make([]int, len(reps))
	for r, c := range reps {
		tau[r], S[r] = c.tau, c.S()
	}
	shares, _ := ShareMicroBatches(tau, S, pl.M)
	return shares
}

func (pl *replicaPlanner) estimate(reps []*candidate, shares []int) Estimate {
	e := Estimate{Replicas: len(reps)}
	worst := 0.0
	for r, c := range reps {
		e.ComputeSeconds = max(e.ComputeSeconds, float64(shares[r]+c.S()-1)*c.tau)
		worst = max(worst, c.sync)
	}
	e.SyncSeconds = pl.opt.syncExposed(len(reps), worst)
	e.StepSeconds = e.ComputeSeconds + e.SyncSeconds
	if e.StepSeconds > 0 {
		e.TokensPerS = float64(pl.M) * float64(pl.prof.Tokens) / e.StepSeconds
		e.FLOPsPerS = float64(pl.M) * pl.flops / e.StepSeconds
	}
	return e
}

// fromPlan turns p's replicas into candidates, with the uploads of byID.
func (pl *replicaPlanner) fromPlan(p Plan, byID map[string]Peer) ([]*candidate, error) {
	var out []*candidate
	W := pl.L + 1
	for r, rp := range p.Pipelines() {
		if len(rp.Stages) == 0 {
			continue
		}
		c := &candidate{cuts: []int{rp.Stages[0].Begin}, tau: replicaTau(rp.Stages)}
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
			c.sync = max(c.sync, pl.opt.wireBytesPerParam()*pl.params[st.Begin*W+st.End]/q.LinkBytesPerS)
		}
		if c.cuts[0] != 0 || c.cuts[len(c.cuts)-1] != pl.L {
			return nil, fmt.Errorf("%w: replica %d covers blocks [%d, %d) of %d", ErrBadInput, r, c.cuts[0], c.cuts[len(c.cuts)-1], pl.L)
		}
		out = append(out, c)
	}
	if len(out) > pl.M {
		return nil, fmt.Errorf("%w: %d replicas for %d micro-batches", ErrBadInput, len(out), pl.M)
	}
	return out, nil
}

// plan materialises replicas (in replica order) as a Plan; every peer of all that no replica
// holds is a standby, fastest first.
func (pl *replicaPlanner) plan(reps []*candidate, all []Peer) Plan {
	shares := pl.shares(reps)
	e := pl.estimate(reps, shares)
	p := Plan{Version: pl.opt.Version, MicroBatches: pl.M, StepSeconds: e.StepSeconds}
	used := map[string]bool{}
	first, W := 0, pl.L+1
	for r, c := range reps {
		rp := Replica{First: first, MicroBatches: shares[r], StepSeconds: float64(shares[r]+c.S()-1) * c.tau}
		first += shares[r]
		for i, q := range c.peers {
			a, b := c.cuts[i], c.cuts[i+1]
			comp, x := stageSeconds(pl.cost[a*W+b], pl.send[a*W+b], q)
			rp.Stages = append(rp.Stages, Stage{Begin: a, End: b, Peer: q.ID, ComputeSeconds: comp, TransferSeconds: x,
				MemoryBytes: pl.memory(a, b, i, c.S())})
			used[q.ID] = true
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
