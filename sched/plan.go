package sched

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"slices"
)

// Peer is a worker as the planner sees it. The numbers are measured by the worker (proto.Hello),
// not configured.
type Peer struct {
	ID            string  `json:"id"`
	GFLOPS        float64 `json:"gflops"`           // throughput of its backend on training kernels
	MemoryBytes   int64   `json:"memory_bytes"`     // what it may use for its shard
	LinkBytesPerS float64 `json:"link_bytes_per_s"` // upload bandwidth; +Inf on loopback
}

// Stage is one pipeline stage of a Plan, with the planner's estimates for it.
type Stage struct {
	Begin int    `json:"begin"` // blocks [Begin, End)
	End   int    `json:"end"`
	Peer  string `json:"peer"`
	// ComputeSeconds and TransferSeconds are per micro-batch, forward and backward.
	ComputeSeconds  float64 `json:"compute_seconds"`
	TransferSeconds float64 `json:"transfer_seconds"`
	// MemoryBytes is what the stage needs on its peer (Profile.StageMemory).
	MemoryBytes float64 `json:"memory_bytes"`
}

// ExpertPlacement puts expert Expert of MoE block Block (its index among all blocks) on Peers,
// peers that hold no stage (PlaceExperts). Peers is one peer holding the whole expert, or two
// replicas in replica order: replica r is sent the expert's tokens of the micro-batches of half r
// of the gradient tree's root (model.GroupHalf) and computes that half's node of its gradient,
// which the replicas exchange and add as the tree does, so both stay bit-identical to the single
// process. There are never more than two: the root has two halves.
type ExpertPlacement struct {
	Block  int      `json:"block"`
	Expert int      `json:"expert"`
	Peers  []string `json:"peers"`
}

// Replica is one pipeline replica of a replicated Plan: its own stages on its own peers,
// computing micro-batches [First, First+MicroBatches) of every step (replica r's follow replica
// r−1's).
type Replica struct {
	Stages       []Stage `json:"stages"`
	First        int     `json:"first"`
	MicroBatches int     `json:"micro_batches"`
	// StepSeconds is the replica's estimated time for its share of a step,
	// (MicroBatches + S − 1) · its slowest stage's seconds per micro-batch.
	StepSeconds float64 `json:"step_seconds"`
}

// Plan is where every shard of a job lives.
type Plan struct {
	Version      uint32 `json:"version"`
	MicroBatches int    `json:"micro_batches"`
	// Stages are the stages of a plan of one pipeline; empty when Replicas is set.
	Stages []Stage `json:"stages"`
	// Replicas are the pipeline replicas of a replicated plan, in replica (micro-batch) order;
	// empty for one pipeline (Stages). Pipelines returns either form as replicas.
	Replicas []Replica `json:"replicas,omitempty"`
	// Standby are the peers that hold nothing, fastest first: adding them would have slowed the
	// pipeline, or they do not have the memory for any stage. They replace lost peers.
	Standby []string `json:"standby"`
	// Experts places experts away from their stage (PlaceExperts); empty when they stay with the
	// stages of their blocks. Partition leaves it empty: the coordinator places experts on the
	// peers Partition left spare.
	Experts []ExpertPlacement `json:"experts"`
	// StepSeconds is the estimated step time, (M+S−1) · the slowest stage's seconds per
	// micro-batch.
	StepSeconds float64 `json:"step_seconds"`
}

// Pipelines are p's pipeline replicas: Replicas, or Stages as the one replica computing every
// micro-batch.
func (p Plan) Pipelines() []Replica {
	if len(p.Replicas) > 0 {
		return p.Replicas
	}
	return []Replica{{Stages: p.Stages, MicroBatches: p.MicroBatches, StepSeconds: p.StepSeconds}}
}

// Options are a planning request's parameters besides the model and the peers.
type Options struct {
	// MicroBatches is M, the job's micro-batches per step.
	MicroBatches int
	// Version is copied into the Plan.
	Version uint32
	// MaxStages caps S; 0 leaves it to the blocks and the peers.
	MaxStages int
	// MaxCandidates caps how many peers the exact search considers, and so S; 0 means
	// DefaultMaxCandidates. Partition lowers it further for deep models, to keep the search
	// within a fixed budget of steps. See Partition.
	MaxCandidates int
}

// DefaultMaxCandidates is the default Options.MaxCandidates: 2^12 subsets keep a plan for L 8
// well under a second on one core.
const DefaultMaxCandidates = 12

// maxCandidatesLimit bounds Options.MaxCandidates: the search's table has 2^K rows.
const maxCandidatesLimit = 20

// searchBudget bounds the inner steps of the exact search (2^K · K · (L+1)² · S_max); the number
// of candidates is lowered until the search fits it, so that a deep model stays fast.
const searchBudget = 1e8

// Partition cuts the profile's L blocks into S contiguous stages, puts each on its own peer, and
// keeps the other peers as standbys, choosing S, the cuts and the assignment that minimise the
// estimated step time
//
//	(M + S − 1) · max over stages of (compute + transfer seconds per micro-batch)
//
// subject to every stage fitting its peer's memory (Profile.StageMemory). The factor is 1F1B's:
// M micro-batches pass the slowest stage one after another, and filling and draining the
// pipeline adds S−1 more slots, the bubble (Narayanan et al. 2021). It is why more stages are not
// always better: a stage split off onto another peer shortens the slowest stage, but lengthens
// the bubble and adds transfers; a peer whose addition would not pay for that stays a standby.
//
// The search is exact. Which peer takes which stage matters — the first stage also holds the
// embedding and the most activations (S micro-batches), the last the head, MoE blocks are
// heavier than dense ones, and peers differ in speed, memory and bandwidth at once — so the
// pipeline order of the peers is searched, not fixed by sorting them by speed (a fixed order
// misses, e.g., putting a slow peer on a light first block and a fast one on a heavy rest). For
// each S, a dynamic program over (blocks covered, set of peers used) computes the smallest
// achievable slowest-stage time of the remaining blocks: the stage index is the size of the set,
// which the memory model needs. That is O(2^K · K · L² · S) for K candidate peers.
//
// With more than Options.MaxCandidates peers, the candidates are narrowed first: peers that
// cannot hold even one block become standbys, and so does any peer that at least S_max other
// peers beat or match in speed, memory and bandwidth together (one of those is always free to
// take its place, so the optimum is kept). If more remain, the candidates are taken in turn from
// the fastest, the largest-memory and the best-connected (a heuristic: the plan is then the best
// over those candidates).
//
// Ties are broken deterministically: among plans of the least step time, the fewest stages;
// then the least slowest-stage time; then the lexicographically smallest sequence (first peer's
// id, first cut, second peer's id, …). The order of peers in the input does not matter. When
// the candidates were narrowed, a peer that another matches exactly loses to the smaller id
// before the search.
//
// The error wraps ErrBadInput for invalid arguments and ErrNoPlan when nothing fits.
func Partition(prof Profile, peers []Peer, opt Options) (Plan, error) {
	L, M := prof.NumBlocks(), opt.MicroBatches
	switch {
	case L < 1:
		return Plan{}, fmt.Errorf("%w: a profile without blocks", ErrBadInput)
	case M < 1:
		return Plan{}, fmt.Errorf("%w: %d micro-batches", ErrBadInput, M)
	case len(peers) == 0:
		return Plan{}, fmt.Errorf("%w: no peers", ErrNoPlan)
	case opt.MaxStages < 0 || opt.MaxCandidates < 0 || opt.MaxCandidates > maxCandidatesLimit:
		return Plan{}, fmt.Errorf("%w: MaxStages %d, MaxCandidates %d (at most %d)", ErrBadInput, opt.MaxStages, opt.MaxCandidates, maxCandidatesLimit)
	}
	sorted := slices.Clone(peers)
	slices.SortFunc(sorted, func(a, b Peer) int { return cmp.Compare(a.ID, b.ID) })
	for i, p := range sorted {
		switch {
		case p.ID == "":
			return Plan{}, fmt.Errorf("%w: a peer without an id", ErrBadInput)
		case i > 0 && p.ID == sorted[i-1].ID:
			return Plan{}, fmt.Errorf("%w: peer id %q appears twice", ErrBadInput, p.ID)
		case !(p.GFLOPS > 0) || math.IsInf(p.GFLOPS, 0):
			return Plan{}, fmt.Errorf("%w: peer %q: GFLOPS %v", ErrBadInput, p.ID, p.GFLOPS)
		case !(p.LinkBytesPerS > 0):
			return Plan{}, fmt.Errorf("%w: peer %q: link %v bytes/s", ErrBadInput, p.ID, p.LinkBytesPerS)
		case p.MemoryBytes < 0:
			return Plan{}, fmt.Errorf("%w: peer %q: memory %d bytes", ErrBadInput, p.ID, p.MemoryBytes)
		}
	}

	maxS := L
	if opt.MaxStages > 0 {
		maxS = min(maxS, opt.MaxStages)
	}
	K := opt.MaxCandidates
	if K == 0 {
		K = DefaultMaxCandidates
	}
	K = min(K, len(sorted))
	for K > 1 && math.Ldexp(float64(K*(L+1)*(L+1)*min(maxS, K)), K) > searchBudget {
		K--
	}
	cand := candidates(prof, sorted, M, maxS, K)
	s := newSearch(prof, cand, M)
	bestS, bestObj, bestTau := 0, math.Inf(1), math.Inf(1)
	for S := 1; S <= min(maxS, len(cand)); S++ {
		tau := s.solve(S)
		if obj := float64(M+S-1) * tau; obj < bestObj {
			bestS, bestObj, bestTau = S, obj, tau
		}
	}
	if bestS == 0 {
		return Plan{}, noPlan(prof, sorted, M, len(cand))
	}
	s.solve(bestS)
	plan := Plan{Version: opt.Version, MicroBatches: M, StepSeconds: bestObj}
	used := map[string]bool{}
	for _, st := range s.reconstruct(bestS, bestTau) {
		peer := cand[st.peer]
		c, x := prof.StageSeconds(peer, st.a, st.b)
		plan.Stages = append(plan.Stages, Stage{Begin: st.a, End: st.b, Peer: peer.ID, ComputeSeconds: c,
			TransferSeconds: x, MemoryBytes: prof.StageMemory(st.a, st.b, len(plan.Stages), bestS, M)})
		used[peer.ID] = true
	}
	standby := slices.DeleteFunc(slices.Clone(sorted), func(p Peer) bool { return used[p.ID] })
	slices.SortStableFunc(standby, func(a, b Peer) int { return cmp.Compare(b.GFLOPS, a.GFLOPS) })
	for _, p := range standby {
		plan.Standby = append(plan.Standby, p.ID)
	}
	return plan, nil
}

// search is the dynamic program of Partition over K candidate peers (in id order).
type search struct {
	L, M, K int
	mem     []float64 // mem[p]: peer p's memory
	cost    []Cost    // cost[a*(L+1)+b]: the summed cost of a stage holding blocks [a, b)
	secs    []float64 // secs[(p*(L+1)+a)*(L+1)+b]: its seconds per micro-batch on peer p
	// f[mask*(L+1)+a] is the smallest achievable slowest-stage time for blocks [a, L) on
	// S − |mask| more stages whose peers are not in mask (+Inf when impossible), for the S of the
	// last solve. |mask| is the index of the next stage.
	f []float64
}

func newSearch(prof Profile, peers []Peer, M int) *search {
	L, K := prof.NumBlocks(), len(peers)
	s := &search{L: L, M: M, K: K, mem: make([]float64, K), cost: make([]Cost, (L+1)*(L+1)),
		secs: make([]float64, K*(L+1)*(L+1)), f: make([]float64, (1<<K)*(L+1))}
	for a := 0; a < L; a++ {
		for b := a + 1; b <= L; b++ {
			s.cost[a*(L+1)+b] = prof.stageCost(a, b)
		}
	}
	for p, peer := range peers {
		s.mem[p] = float64(peer.MemoryBytes)
		for a := 0; a < L; a++ {
			for b := a + 1; b <= L; b++ {
				c, x := stageSeconds(s.cost[a*(L+1)+b], prof.SendBytes(a, b), peer)
				s.secs[(p*(L+1)+a)*(L+1)+b] = c + x
			}
		}
	}
	return s
}

// solve fills f for S stages and returns the optimal slowest-stage time, +Inf when no S-stage
// plan fits.
func (s *search) solve(S int) float64 {
	L, W := s.L, s.L+1
	inf := math.Inf(1)
	// Supersets have larger numbers, so counting masks down solves every mask's successors first.
	for mask := 1<<s.K - 1; mask >= 0; mask-- {
		i := bits.OnesCount(uint(mask))
		if i > S {
			continue
		}
		for a := L; a >= 0; a-- {
			switch {
			case i == S && a == L:
				s.f[mask*W+a] = 0
				continue
			case i == S || a == L:
				s.f[mask*W+a] = inf
				continue
			}
			best := inf
			last := L - (S - i - 1) // leave a block for each later stage
			for p := 0; p < s.K; p++ {
				if mask&(1<<p) != 0 {
					continue
				}
				next := (mask | 1<<p) * W
				for b := a + 1; b <= last; b++ {
					// Memory only grows with b: once it does not fit, nothing longer does.
					if stageMemory(s.cost[a*W+b], i, S, s.M, 0) > s.mem[p] {
						break
					}
					if v := max(s.secs[(p*W+a)*W+b], s.f[next+b]); v < best {
						best = v
					}
				}
			}
			s.f[mask*W+a] = best
		}
	}
	return s.f[0]
}

type cut struct{ peer, a, b int }

// reconstruct returns, for the S of the last solve, the lexicographically first (peer, end)
// sequence whose slowest stage takes at most tau. Comparing with the overall tau, rather than
// with each suffix's own optimum, matters: a suffix may be slower than its best as long as it
// stays within tau, and a smaller peer id there is still preferred.
func (s *search) reconstruct(S int, tau float64) []cut {
	W := s.L + 1
	var out []cut
	mask, a := 0, 0
	for i := 0; i < S; i++ {
		found := false
		for p := 0; p < s.K && !found; p++ {
			if mask&(1<<p) != 0 {
				continue
			}
			next := (mask | 1<<p) * W
			for b := a + 1; b <= s.L-(S-i-1); b++ {
				if stageMemory(s.cost[a*W+b], i, S, s.M, 0) > s.mem[p] {
					break
				}
				if max(s.secs[(p*W+a)*W+b], s.f[next+b]) <= tau {
					out = append(out, cut{p, a, b})
					mask, a, found = mask|1<<p, b, true
					break
				}
			}
		}
		if !found {
			panic("sched: reconstruct found no stage within the optimum") // solve and reconstruct disagree: a bug
		}
	}
	return out
}

// candidates returns the peers the exact search considers, in id order: all of them when there
// are at most K, else a narrowed set (see Partition).
func candidates(prof Profile, peers []Peer, M, maxS, K int) []Peer {
	if len(peers) <= K {
		return peers
	}
	// The least memory any stage needs: one block, holding one micro-batch's activations.
	L := prof.NumBlocks()
	need := math.Inf(1)
	for a := 0; a < L; a++ {
		need = min(need, stageMemory(prof.stageCost(a, a+1), 0, 1, M, 0))
	}
	var usable []Peer
	for _, p := range peers {
		if float64(p.MemoryBytes) >= need {
			usable = append(usable, p)
		}
	}
	// A peer that maxS others dominate is never needed: a plan uses at most maxS peers, so one
	// dominating peer is always free to replace it, no slower and with no less memory.
	var kept []Peer
	for _, q := range usable {
		n := 0
		for _, p := range usable {
			if p.ID != q.ID && dominates(p, q) {
				if n++; n >= maxS {
					break
				}
			}
		}
		if n < maxS {
			kept = append(kept, q)
		}
	}
	if len(kept) <= K {
		return kept
	}
	// Still too many: take turns picking from three rankings, so that neither fast peers without
	// memory nor large peers without speed crowd out the others.
	rankings := [][]Peer{slices.Clone(kept), slices.Clone(kept), slices.Clone(kept)}
	keys := []func(Peer) float64{
		func(p Peer) float64 { return p.GFLOPS },
		func(p Peer) float64 { return float64(p.MemoryBytes) },
		func(p Peer) float64 { return p.LinkBytesPerS },
	}
	for r := range rankings {
		slices.SortStableFunc(rankings[r], func(a, b Peer) int { return cmp.Compare(keys[r](b), keys[r](a)) })
	}
	picked := map[string]bool{}
	var out []Peer
	for i := 0; len(out) < K; i++ {
		p := rankings[i%3][i/3]
		if !picked[p.ID] {
			picked[p.ID] = true
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b Peer) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// dominates reports whether p can take q's place in any plan at no loss: at least as fast, as
// well connected and as large, and better somewhere or equal with a smaller id (so that two
// identical peers do not both survive by dominating each other).
func dominates(p, q Peer) bool {
	if p.GFLOPS < q.GFLOPS || p.LinkBytesPerS < q.LinkBytesPerS || p.MemoryBytes < q.MemoryBytes {
		return false
	}
	if p.GFLOPS > q.GFLOPS || p.LinkBytesPerS > q.LinkBytesPerS || p.MemoryBytes > q.MemoryBytes {
		return true
	}
	return p.ID < q.ID
}

// noPlan explains why nothing fits, in the sizes an admin can act on.
func noPlan(prof Profile, peers []Peer, M, considered int) error {
	L := prof.NumBlocks()
	all := prof.stageCost(0, L)
	need := math.Inf(1)
	for a := 0; a < L; a++ {
		need = min(need, stageMemory(prof.stageCost(a, a+1), 0, 1, M, 0))
	}
	var total, largest int64
	for _, p := range peers {
		total += p.MemoryBytes
		largest = max(largest, p.MemoryBytes)
	}
	searched := ""
	if considered < len(peers) {
		// The search's table has 2^K rows; a model this deep needs a longer pipeline than it can
		// consider. Say so rather than blame the peers alone.
		searched = fmt.Sprintf(" (the search considered %d of them, so at most %d stages)", considered, considered)
	}
	return fmt.Errorf("%w: the model's weights, gradients and Adam state (and audit evidence, when the job audits) take %s plus %s of activations per micro-batch, "+
		"and the smallest stage needs %s; the %d peers offer %s in all and %s at most on one%s: add peers with more memory, "+
		"or lower the micro-batch size",
		ErrNoPlan, fmtBytes(all.StateBytes), fmtBytes(all.ActBytes), fmtBytes(need),
		len(peers), fmtBytes(float64(total)), fmtBytes(float64(largest)), searched)
}

func fmtBytes(b float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	i := 0
	for b >= 1024 && i < len(units)-1 {
		b /= 1024
		i++
	}
	return fmt.Sprintf("%.1f %s", b, units[i])
}
