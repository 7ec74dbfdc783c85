package sched

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/shoal-ml/shoal/model"
)

// Expert placement (docs/design.md, "Experts"; issue 6). The experts of the MoE blocks hold most of
// a model's parameters; placing them on peers other than the stages lets a job use more peers
// than it has stages, and lets many small peers (browser tabs) each hold a few experts.
//
// When experts go remote. The coordinator first cuts the model into stages (Partition), then
// passes the peers Partition left as standbys to PlaceExperts. When there are none, or they
// cannot hold every expert (KeepExpertsLocal), or no placement on them is faster than the stages
// computing their own experts (ExpertsPay), Plan.Experts stays empty and every expert stays
// with the stage of its block: placement is all or nothing, so a stage never has to reach some
// experts locally and others over the network for the same block. In a step-mode plan of pipeline
// replicas the candidates are the peers PlanReplicas left, a host serves its block's stage in
// every replica (ExpertOptions.Runs: no replicated experts, memory for every replica's gradient
// tree), and it must pay against every replica's stage (ExpertsPayReplicas).
//
// The placement problem is scheduling on uniform machines: an expert shard is a job of size
// "tokens per step", a host a machine whose speed is the tokens per second it can take (compute at
// its GFLOPS plus uploading results over its link, the cost model's conventions), and the
// objective is the makespan, the busiest host's seconds per step, which bounds the step when the
// pipeline is full. Longest processing time first (Graham 1969, "Bounds on multiprocessing timing
// anomalies", SIAM J. Appl. Math. 17(2)) is within 4/3 − 1/(3m) of the optimum on m identical
// hosts; taking each job to the host where it would finish earliest keeps it within 2m/(m+1) on
// hosts of different speeds (Gonzalez, Ibarra & Sahni 1977, "Bounds for LPT schedules on uniform
// processors", SIAM J. Comput. 6(1)).

// ExpertProfile is the cost of one expert MLP of a model's MoE blocks, per token routed to it.
// Every MoE block has E experts of one shape, so one set of numbers serves all of them. Profile
// counts the experts inside their block; this is the same model seen expert by expert.
type ExpertProfile struct {
	// Blocks are the indices (among all blocks) of the MoE blocks, ascending.
	Blocks []int
	// Experts is E, the experts of each MoE block; TopK how many of them each token is routed to.
	Experts, TopK int
	// Tokens is N = b·T, the tokens of one micro-batch; MicroBatches is M, per step; Width is C,
	// the values of a routed token's row.
	Tokens, MicroBatches, Width int
	// FLOPsPerToken is forward plus backward of one expert for one routed token: c_fc and c_proj
	// take 2·C·F each forward, and backward is twice forward (Cost.FLOPs's conventions).
	FLOPsPerToken float64
	// Params is one expert's parameter count: c_fc (F×C + F) and c_proj (C×F + C).
	Params int64
	// EvalTokens is the tokens of one evaluation pass when the job evaluates (Evaluated), every
	// one of which may be routed to an expert; 0 otherwise.
	EvalTokens int
	// StateBytes is what a host keeps per expert (or replica) whatever the tokens: the state of
	// its Params (StateBytesPerParam each), its gradient tree's node buffers (TreeBytesPerParam),
	// and the audit evidence (EvidenceBytesPerParam) when the job audits (Audited).
	StateBytes float64
	// ActBytesPerToken is what a host keeps per routed token from its forward to its backward:
	// the expert's input, hidden pre- and post-GELU, the GELU's tanh, and output (Profile's
	// estimate for an MoE block, per assignment).
	ActBytesPerToken float64
	// SendBytesPerToken is what a host uploads per routed token: the expert's output row forward
	// and the input gradient row backward, C float32 each.
	SendBytesPerToken float64
}

// NewExpertProfile returns the expert costs of cfg for micro-batches of microBatch sequences of
// cfg.BlockSize tokens, microBatches of them per step. A config without MoE blocks gives a
// profile without Blocks, for which PlaceExperts places nothing.
func NewExpertProfile(cfg model.Config, microBatch, microBatches int) (ExpertProfile, error) {
	if err := cfg.Validate(); err != nil {
		return ExpertProfile{}, fmt.Errorf("%w: %w", ErrBadInput, err)
	}
	switch {
	case microBatch < 1 || microBatch > 1<<20:
		return ExpertProfile{}, fmt.Errorf("%w: micro-batch of %d sequences", ErrBadInput, microBatch)
	case microBatches < 1:
		return ExpertProfile{}, fmt.Errorf("%w: %d micro-batches", ErrBadInput, microBatches)
	}
	C, F := float64(cfg.NEmbd), float64(cfg.Hidden())
	c, f := int64(cfg.NEmbd), int64(cfg.Hidden())
	p := ExpertProfile{
		Experts: cfg.NExpert, TopK: cfg.TopK, Tokens: microBatch * cfg.BlockSize, MicroBatches: microBatches,
		FLOPsPerToken:     3 * 4 * C * F,
		Params:            2*f*c + f + c,
		ActBytesPerToken:  4 * (2*C + 3*F),
		SendBytesPerToken: 2 * 4 * C,
		Width:             cfg.NEmbd,
	}
	p.StateBytes = (StateBytesPerParam + TreeBytesPerParam(microBatches, 0, microBatches)) * float64(p.Params)
	for i := 0; i < cfg.NLayer; i++ {
		if cfg.IsMoE(i) {
			p.Blocks = append(p.Blocks, i)
		}
	}
	return p, nil
}

// WithWire returns p for a job whose boundaries travel in w's formats: a host sends each routed
// token's output row in w.Activations and its input gradient row in w.Gradients
// (Profile.WithWire).
func (p ExpertProfile) WithWire(w model.Wire) ExpertProfile {
	p.SendBytesPerToken = float64(w.Activations.Bytes(1, p.Width) + w.Gradients.Bytes(1, p.Width))
	return p
}

// Evaluated returns p for a job that computes a validation loss in passes of rows sequences:
// an expert's activations are then those of a pass or of the micro-batches in flight, whichever
// is more (Profile.Evaluated).
func (p ExpertProfile) Evaluated(rows, blockSize int) ExpertProfile {
	p.EvalTokens = rows * blockSize
	return p
}

// Audited returns p for a job that audits its steps: each expert's parameters cost
// EvidenceBytesPerParam more (Profile.Audited).
func (p ExpertProfile) Audited() ExpertProfile {
	p.StateBytes += EvidenceBytesPerParam * float64(p.Params)
	return p
}

func (p ExpertProfile) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: expert profile: %s", ErrBadInput, fmt.Sprintf(format, args...))
	}
	switch {
	case p.Experts < 1 || p.TopK < 1 || p.TopK > p.Experts:
		return bad("%d experts, top_k %d", p.Experts, p.TopK)
	case p.Tokens < 1 || p.MicroBatches < 1:
		return bad("%d tokens per micro-batch, %d micro-batches", p.Tokens, p.MicroBatches)
	case !(p.FLOPsPerToken > 0) || math.IsInf(p.FLOPsPerToken, 0):
		return bad("%v FLOPs per token", p.FLOPsPerToken)
	case p.Params < 0 || !(p.ActBytesPerToken >= 0) || !(p.SendBytesPerToken >= 0) ||
		math.IsInf(p.ActBytesPerToken, 0) || math.IsInf(p.SendBytesPerToken, 0):
		return bad("%d params, %v activation and %v send bytes per token", p.Params, p.ActBytesPerToken, p.SendBytesPerToken)
	}
	for i, b := range p.Blocks {
		if b < 0 || i > 0 && b <= p.Blocks[i-1] {
			return bad("blocks %v must be distinct, non-negative and ascending", p.Blocks)
		}
	}
	return nil
}

func (p ExpertProfile) isBlock(b int) bool {
	_, ok := slices.BinarySearch(p.Blocks, b)
	return ok
}

// ExpertLoad is the expected load of each expert: ExpertLoad[block][e] is the tokens routed to
// expert e of MoE block block per step (a token counts once for each of its top_k experts). A
// block that is absent is taken to be uniform (UniformExpertLoad): what a router does before it
// has learnt anything, and what its balancing loss pushes it towards.
type ExpertLoad map[int][]float64

// UniformExpertLoad gives every expert N·M·top_k/E tokens per step: each of the step's N·M
// tokens goes to top_k of the E experts.
func UniformExpertLoad(prof ExpertProfile) ExpertLoad {
	l := ExpertLoad{}
	for _, b := range prof.Blocks {
		l[b] = prof.uniform()
	}
	return l
}

func (p ExpertProfile) uniformLoad() float64 {
	return float64(p.Tokens) * float64(p.MicroBatches) * float64(p.TopK) / float64(p.Experts)
}

func (p ExpertProfile) uniform() []float64 {
	row := make([]float64, p.Experts)
	for e := range row {
		row[e] = p.uniformLoad()
	}
	return row
}

// RouterCounts are one step's router statistics for one MoE block: Tokens[e] tokens were routed
// to expert e over the step's micro-batches.
type RouterCounts struct {
	Block  int     `json:"block"`
	Tokens []int64 `json:"tokens"`
}

// NewExpertLoad returns the expected load from recent router statistics: for each MoE block, the
// mean of the counts given for it (the caller chooses the window, e.g. the last 20 steps); a block
// without counts gets the uniform load.
func NewExpertLoad(prof ExpertProfile, recent []RouterCounts) (ExpertLoad, error) {
	if err := prof.validate(); err != nil {
		return nil, err
	}
	sum, n := map[int][]float64{}, map[int]int{}
	for _, rc := range recent {
		switch {
		case !prof.isBlock(rc.Block):
			return nil, fmt.Errorf("%w: router counts for block %d, which is not an MoE block (%v)", ErrBadInput, rc.Block, prof.Blocks)
		case len(rc.Tokens) != prof.Experts:
			return nil, fmt.Errorf("%w: router counts for block %d have %d experts, want %d", ErrBadInput, rc.Block, len(rc.Tokens), prof.Experts)
		}
		if sum[rc.Block] == nil {
			sum[rc.Block] = make([]float64, prof.Experts)
		}
		for e, c := range rc.Tokens {
			if c < 0 {
				return nil, fmt.Errorf("%w: router counts for block %d: expert %d got %d tokens", ErrBadInput, rc.Block, e, c)
			}
			sum[rc.Block][e] += float64(c)
		}
		n[rc.Block]++
	}
	l := UniformExpertLoad(prof)
	for b, s := range sum {
		for e := range s {
			s[e] /= float64(n[b])
		}
		l[b] = s
	}
	return l, nil
}

func checkLoads(prof ExpertProfile, loads ExpertLoad) error {
	for b, row := range loads {
		switch {
		case !prof.isBlock(b):
			return fmt.Errorf("%w: load for block %d, which is not an MoE block (%v)", ErrBadInput, b, prof.Blocks)
		case len(row) != prof.Experts:
			return fmt.Errorf("%w: load for block %d has %d experts, want %d", ErrBadInput, b, len(row), prof.Experts)
		}
		for e, x := range row {
			if !(x >= 0) || math.IsInf(x, 0) {
				return fmt.Errorf("%w: load %v for expert %d of block %d", ErrBadInput, x, e, b)
			}
		}
	}
	return nil
}

// ExpertOptions are a placement request's parameters besides the profile, the loads and the
// hosts.
type ExpertOptions struct {
	// InFlight is how many micro-batches' activations an expert keeps at once: as many as the
	// stage of its block, min(S − index + depth, M) under OneFOneBDepth. 0 means M, which bounds
	// every stage's at every depth.
	InFlight int
	// ReplicateAbove is the factor by which an expert's load must exceed its fair share for it to
	// get a second replica (after FlexMoE, Nie et al. 2023, "FlexMoE: Scaling Large-scale Sparse
	// Pre-trained Model Training via Dynamic Device Placement"); e.g. 1.5. 0 disables replication.
	//
	// The fair share is the load the fastest host would carry if every host finished at once:
	// total load · v_max / Σ v, v_h being host h's tokens per second, over the hosts with memory
	// for a whole expert; for identical hosts, total load / H. An expert above it bounds the
	// makespan from below whatever the others do; split in two, it stops doing so. Nothing is
	// replicated with fewer than two such hosts.
	//
	// A replicated expert has exactly two replicas, never more: the step's gradient is a tree
	// over its micro-batches (model/gradtree.go) and replica r is sent the micro-batches of half r
	// of its root (model.GroupHalf, model.GroupEdge), whose node it computes, which is what makes
	// replicas bit-identical to the single process. Replica r gets half the expert's load in
	// expectation. A job of one micro-batch has no second half: nothing is replicated there.
	ReplicateAbove float64
	// OneBlockPerHost keeps each host to the experts of one block. proto.Assign gives a worker a
	// single shard, and an expert shard is experts of one block; without this option a host may
	// get several blocks' experts (ExpertShards then lists several shards for it).
	OneBlockPerHost bool
	// Runs are, for hosts that serve the stage of their block in every pipeline replica of a
	// step-mode plan, the micro-batches each replica computes, [first, first+n) of the step's M
	// (proto.Assign.Routers); nil, or one run, for one pipeline. The replicas' micro-batches reach
	// a host interleaved, so its gradient tree may hold every run's nodes at once
	// (model.Shard.BeginGradientsRuns): each shard's memory then counts the sum of the runs'
	// tree buffers instead of one tree over [0, M), exactly as ExpertShardMemoryRuns, the
	// worker's check of its Assign, does. Its activations are still those of InFlight
	// micro-batches, which for a host of replicas must be 0 (all M): the replicas' schedules
	// overlap, so nothing smaller bounds what it holds.
	//
	// Two or more runs exclude replicated experts (ReplicateAbove must be 0, and a placement
	// with an expert on two hosts does not fit): an expert's two replicas each compute half of
	// the root of the step's gradient tree (model.GroupHalf), which the replicas' runs cut
	// across.
	Runs [][2]int
}

func (o ExpertOptions) validate() error {
	switch {
	case o.InFlight < 0:
		return fmt.Errorf("%w: %d micro-batches in flight", ErrBadInput, o.InFlight)
	case !(o.ReplicateAbove >= 0) || math.IsInf(o.ReplicateAbove, 0):
		return fmt.Errorf("%w: ReplicateAbove %v", ErrBadInput, o.ReplicateAbove)
	case len(o.Runs) > 1 && o.ReplicateAbove != 0:
		return fmt.Errorf("%w: ReplicateAbove %v for hosts of %d pipeline replicas: an expert's two replicas split the step's micro-batches at the gradient tree's root, which the pipeline replicas' runs cut across; set it to 0",
			ErrBadInput, o.ReplicateAbove, len(o.Runs))
	case len(o.Runs) > 1 && o.InFlight != 0:
		return fmt.Errorf("%w: %d micro-batches in flight for hosts of %d pipeline replicas: their schedules overlap, so only all M bound what a host holds; set InFlight to 0",
			ErrBadInput, o.InFlight, len(o.Runs))
	}
	return nil
}

// replicable reports whether an expert may have two replicas under o: not on hosts serving
// several pipeline replicas (Runs).
func (o ExpertOptions) replicable() bool { return len(o.Runs) < 2 }

// expertMoveBytesPerParam is what moving an expert to another host transfers per parameter at a
// step boundary: the float32 weight and AdamW's two float32 moments. The gradient accumulator is
// zero between steps, so unlike StateBytesPerParam it does not travel.
const expertMoveBytesPerParam = 12

// PlaceExperts places every expert of every MoE block of prof on hosts, the peers that hold no
// stage, by expected load (nil: uniform), host speed and memory, and returns one ExpertPlacement
// per expert, sorted by (block, expert).
//
// It is LPT (Graham 1969): the shards are taken by load, largest first (ties by block, expert,
// replica), and each goes to the host where it would finish earliest — (the host's load + its
// load) · the host's seconds per token, compute at its GFLOPS plus upload over its link — among
// the hosts with memory left for it; ties go to the host holding fewer shards (so that experts
// with no load spread out), then to the smaller id. Hot experts (ExpertOptions.ReplicateAbove)
// are first split into two replicas of half the load each; both replicas are placed like any
// shard, on different hosts, replica 0 first, so the order is deterministic. With
// OneBlockPerHost, each host is first given the block it may serve (reserveBlocks), and LPT then
// runs within each block's hosts; should that not fit, it is tried again reserving hosts by
// memory rather than speed.
//
// A shard's memory is its state (ExpertProfile.StateBytes) plus its activations for InFlight
// micro-batches at the worst case: all N tokens of a micro-batch routed to the expert, for a
// replica too (its token group is whole micro-batches, half of the step's).
// Routing is dropless, so nothing smaller is safe, and a placement that fits whatever the router
// does never has to move because the load shifted. Hosts without memory for a shard get none.
// With replicas that do not fit, the experts are placed whole; when even that fails, the error
// wraps ErrNoPlan (LPT fills memory greedily; with shards of one size that fails only when the
// hosts cannot hold them all, but with OneBlockPerHost it may miss a packing that exists).
// Invalid arguments wrap ErrBadInput.
func PlaceExperts(prof ExpertProfile, loads ExpertLoad, hosts []Peer, opt ExpertOptions) ([]ExpertPlacement, error) {
	l, err := newLayout(prof, loads, hosts, opt)
	if err != nil {
		return nil, err
	}
	if len(prof.Blocks) == 0 {
		return nil, nil
	}
	hot := l.hotLimit()
	// Two replicas take more memory than the expert they split; without room for them, placing
	// every expert whole is better than no placement. Reserving the fastest hosts first may
	// leave a block without the memory it needs where reserving the largest first would not.
	replicate, byMemory := []bool{false}, []bool{false}
	for _, b := range prof.Blocks {
		for e := 0; e < prof.Experts; e++ {
			if l.expertLoad(b, e) > hot {
				replicate = []bool{true, false}
			}
		}
	}
	if opt.OneBlockPerHost {
		byMemory = []bool{false, true}
	}
	var first error
	for _, rep := range replicate {
		for _, mem := range byMemory {
			l, _ := newLayout(prof, loads, hosts, opt)
			for _, b := range prof.Blocks {
				for e := 0; e < prof.Experts; e++ {
					x := l.expertLoad(b, e)
					l.addExpert(b, e, x, rep && x > hot)
				}
			}
			if opt.OneBlockPerHost {
				l.reserveBlocks(mem)
			}
			err := l.lpt(l.unplaced())
			if err == nil {
				return l.placements(), nil
			}
			if first == nil {
				first = err
			}
		}
	}
	return nil, first
}

// KeepExpertsLocal reports whether the experts should stay with the stages of their blocks: when
// the model has no MoE blocks, when there are no spare peers (every peer holds a stage), or when
// the spare peers cannot hold every expert. The coordinator then leaves Plan.Experts empty and
// does not call PlaceExperts; otherwise PlaceExperts succeeds on spare with the same options.
func KeepExpertsLocal(prof ExpertProfile, spare []Peer, opt ExpertOptions) bool {
	if len(prof.Blocks) == 0 || len(spare) == 0 {
		return true
	}
	_, err := PlaceExperts(prof, nil, spare, opt)
	return err != nil
}

// ExpertsPay reports whether placements on hosts make the step no slower than keeping every
// expert with the stage of its block, whose peers stages gives by MoE block. A stage waits for
// its block's experts (it dispatches their tokens and combines what comes back before it moves
// on), so a block's experts cost the stage the busiest of their hosts' times; kept at home they
// cost the stage's peer the block's whole expert work at its own speed. Remote experts pay when,
// block by block, the first is no larger than the second: several hosts working in parallel, or
// a host faster than the stage, and their memory off the stage. A peer far slower than the stages
// — a browser tab on its CPU fallback, about 1/45 of a two-core native worker — never pays; the
// coordinator then keeps it a standby. Host times are ExpertHostSeconds (compute and upload); a
// host holding experts of several blocks counts its whole time against each.
func ExpertsPay(prof ExpertProfile, placements []ExpertPlacement, loads ExpertLoad, hosts []Peer, stages map[int]Peer, opt ExpertOptions) (bool, error) {
	secs, err := ExpertHostSeconds(prof, placements, loads, hosts, opt)
	if err != nil {
		return false, err
	}
	l, err := newLayout(prof, loads, hosts, opt) // for the loads alone
	if err != nil {
		return false, err
	}
	remote := map[int]float64{} // per block: its busiest host's seconds per step
	for _, p := range placements {
		for _, id := range p.Peers {
			remote[p.Block] = max(remote[p.Block], secs[id])
		}
	}
	for _, b := range prof.Blocks {
		st, ok := stages[b]
		if !ok || !(st.GFLOPS > 0) || math.IsInf(st.GFLOPS, 0) {
			return false, fmt.Errorf("%w: no stage peer with a throughput for MoE block %d", ErrBadInput, b)
		}
		work := 0.0 // tokens routed to the block's experts per step
		for e := 0; e < prof.Experts; e++ {
			work += l.expertLoad(b, e)
		}
		if home := work * prof.FLOPsPerToken / (st.GFLOPS * 1e9); remote[b] > home {
			return false, nil
		}
	}
	return true, nil
}

// ReplicaStage is the stage holding an MoE block in one pipeline replica of a step-mode plan: its
// peer, and the replica's share of the step's micro-batches.
type ReplicaStage struct {
	Peer         Peer
	MicroBatches int
}

// ExpertsPayReplicas is ExpertsPay for hosts that serve the stage of their block in every
// pipeline replica of a step-mode plan (ExpertOptions.Runs); stages gives, for each MoE block,
// every replica's stage of it. A host then computes the whole step's expert work of its block, every
// replica's micro-batches, while at home replica r's stage would compute only its share, n_r of
// the M micro-batches, at its own speed. Remote experts pay when, block by block, the busiest
// host of the block takes no longer than every replica's stage would at home: n_r/M of the
// block's work at GFLOPS_r is the whole block's at GFLOPS_r·M/n_r, so it is ExpertsPay against a
// stage of the largest GFLOPS_r·M/n_r, the replica whose share at home would be done first.
// Replicas step together, so a host slower than that would make that replica wait on its
// experts longer than it now takes; the stricter test keeps a placement from slowing any of
// them. The shares of each block's stages must add up to the profile's M, as a step-mode plan's
// do.
func ExpertsPayReplicas(prof ExpertProfile, placements []ExpertPlacement, loads ExpertLoad, hosts []Peer, stages map[int][]ReplicaStage, opt ExpertOptions) (bool, error) {
	if err := prof.validate(); err != nil {
		return false, err
	}
	eq := map[int]Peer{}
	for _, b := range prof.Blocks {
		sum := 0
		for r, st := range stages[b] {
			if st.MicroBatches < 1 || !(st.Peer.GFLOPS > 0) || math.IsInf(st.Peer.GFLOPS, 0) {
				return false, fmt.Errorf("%w: MoE block %d: replica %d's stage computes %d micro-batches at %v GFLOPS", ErrBadInput, b, r, st.MicroBatches, st.Peer.GFLOPS)
			}
			sum += st.MicroBatches
			if g := st.Peer.GFLOPS * float64(prof.MicroBatches) / float64(st.MicroBatches); g > eq[b].GFLOPS {
				eq[b] = Peer{ID: st.Peer.ID, GFLOPS: g, MemoryBytes: st.Peer.MemoryBytes, LinkBytesPerS: st.Peer.LinkBytesPerS}
			}
		}
		if sum != prof.MicroBatches {
			return false, fmt.Errorf("%w: MoE block %d: its stages compute %d micro-batches in all, the step has %d", ErrBadInput, b, sum, prof.MicroBatches)
		}
	}
	return ExpertsPay(prof, placements, loads, hosts, eq, opt)
}

// ExpertShardSpec is what one host holds of one MoE block: experts Experts (ascending), and for
// each the replica it holds, Replicas[i] ∈ {0, 1}, or −1 for the whole expert. It is
// proto.ExpertShard plus the replica indices, which the host needs for model.Expert.SetReplica.
type ExpertShardSpec struct {
	Block    int   `json:"block"`
	Experts  []int `json:"experts"`
	Replicas []int `json:"replicas"`
}

// ExpertShards groups placements by host: each host's shards, one per block it holds experts of,
// by block. A host holds several blocks' experts only without ExpertOptions.OneBlockPerHost.
func ExpertShards(placements []ExpertPlacement) map[string][]ExpertShardSpec {
	type key struct {
		host  string
		block int
	}
	byKey := map[key]*ExpertShardSpec{}
	for _, p := range placements {
		for r, h := range p.Peers {
			k := key{h, p.Block}
			s := byKey[k]
			if s == nil {
				s = &ExpertShardSpec{Block: p.Block}
				byKey[k] = s
			}
			if len(p.Peers) == 1 {
				r = -1
			}
			s.Experts = append(s.Experts, p.Expert)
			s.Replicas = append(s.Replicas, r)
		}
	}
	out := map[string][]ExpertShardSpec{}
	for k, s := range byKey {
		idx := make([]int, len(s.Experts))
		for i := range idx {
			idx[i] = i
		}
		slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(s.Experts[a], s.Experts[b]) })
		spec := ExpertShardSpec{Block: s.Block}
		for _, i := range idx {
			spec.Experts = append(spec.Experts, s.Experts[i])
			spec.Replicas = append(spec.Replicas, s.Replicas[i])
		}
		out[k.host] = append(out[k.host], spec)
	}
	for _, specs := range out {
		slices.SortFunc(specs, func(a, b ExpertShardSpec) int { return cmp.Compare(a.Block, b.Block) })
	}
	return out
}

// ExpertHostSeconds is each host's estimated busy time per step under placements and loads
// (nil: uniform): its tokens per step times its seconds per token. The largest is the makespan
// PlaceExperts minimises. A placement that does not fit the hosts, or misses an expert, is an
// error wrapping ErrBadInput.
func ExpertHostSeconds(prof ExpertProfile, placements []ExpertPlacement, loads ExpertLoad, hosts []Peer, opt ExpertOptions) (map[string]float64, error) {
	l, err := newLayout(prof, loads, hosts, opt)
	if err != nil {
		return nil, err
	}
	intact, err := l.adopt(placements)
	if err != nil {
		return nil, err
	}
	if !intact {
		return nil, fmt.Errorf("%w: the placement misses an expert, or does not fit the hosts", ErrBadInput)
	}
	out := map[string]float64{}
	for h, p := range l.hosts {
		out[p.ID] = l.finish(h)
	}
	return out, nil
}

// NeedsExpertReplacement reports whether current should be replaced (ReplaceExperts): when it no
// longer fits (a host is gone or lacks the memory, an expert is missing), or when, under loads,
// its makespan exceeds that of a fresh PlaceExperts by more than the fraction threshold (0.1:
// 10 %). Moving an expert costs sending its weights and Adam moments and a pause at the step
// boundary; like Petals' rebalancing rule (Borzunov et al. 2023), it is done only when it clearly
// pays, not at every wobble of the router.
func NeedsExpertReplacement(prof ExpertProfile, current []ExpertPlacement, loads ExpertLoad, hosts []Peer, opt ExpertOptions, threshold float64) (bool, error) {
	if !(threshold >= 0) || math.IsInf(threshold, 0) {
		return false, fmt.Errorf("%w: threshold %v", ErrBadInput, threshold)
	}
	cur, err := newLayout(prof, loads, hosts, opt)
	if err != nil {
		return false, err
	}
	intact, err := cur.adopt(current)
	if err != nil {
		return false, err
	}
	if !intact {
		return true, nil
	}
	fresh, err := PlaceExperts(prof, loads, hosts, opt)
	if errors.Is(err, ErrNoPlan) {
		return false, nil // LPT's greedy packing fails where current fits: keep it
	} else if err != nil {
		return false, err
	}
	f, _ := newLayout(prof, loads, hosts, opt)
	if _, err := f.adopt(fresh); err != nil {
		return false, err
	}
	return cur.makespan() > (1+threshold)*f.makespan(), nil
}

// ReplaceExperts revises current for new loads or hosts, moving as few experts as it can, and
// returns the new placements with the bytes moved: 12 per parameter (weights and AdamW moments;
// gradients are zero between steps) for each expert or replica that lands on a host that did not
// hold it.
//
// It starts from current. Shards on hosts that are gone or no longer fit, and experts current
// lacks, are placed by LPT on what remains — moves that cannot be avoided. If that is within
// threshold of a fresh PlaceExperts (the test of NeedsExpertReplacement), it is returned: when
// current is still good, nothing moves. Otherwise a local search moves shards off the busiest
// host while that lowers its finish time: a shard to another host, two shards swapped, or a hot
// whole expert split into two replicas (the new replica 1 on another host, replica 0 staying),
// until the makespan is the fresh placement's or nothing helps. Its result is returned if it is
// within threshold of the fresh placement; if the search gets stuck above that, the fresh
// placement is returned: a full reshuffle then clearly pays.
//
// Replicas of experts that have cooled are kept (they do no harm: two halves of the load) until
// a fresh placement replaces them.
func ReplaceExperts(prof ExpertProfile, current []ExpertPlacement, loads ExpertLoad, hosts []Peer, opt ExpertOptions, threshold float64) ([]ExpertPlacement, int64, error) {
	if !(threshold >= 0) || math.IsInf(threshold, 0) {
		return nil, 0, fmt.Errorf("%w: threshold %v", ErrBadInput, threshold)
	}
	l, err := newLayout(prof, loads, hosts, opt)
	if err != nil {
		return nil, 0, err
	}
	if _, err := l.adopt(current); err != nil {
		return nil, 0, err
	}
	forced := l.lpt(l.unplaced())
	fresh, ferr := PlaceExperts(prof, loads, hosts, opt)
	switch {
	case ferr != nil && !errors.Is(ferr, ErrNoPlan):
		return nil, 0, ferr
	case forced != nil && ferr != nil:
		return nil, 0, forced
	case forced != nil:
		return fresh, movedBytes(prof, current, fresh), nil
	case ferr != nil:
		// A greedy fresh placement does not fit, but the adjusted current one does.
		p := l.placements()
		return p, movedBytes(prof, current, p), nil
	}
	f, _ := newLayout(prof, loads, hosts, opt)
	if _, err := f.adopt(fresh); err != nil {
		return nil, 0, err
	}
	target := (1 + threshold) * f.makespan()
	if l.makespan() > target {
		l.improve(f.makespan())
	}
	if l.makespan() > target {
		return fresh, movedBytes(prof, current, fresh), nil
	}
	p := l.placements()
	return p, movedBytes(prof, current, p), nil
}

func movedBytes(prof ExpertProfile, from, to []ExpertPlacement) int64 {
	type key struct{ block, expert int }
	had := map[key][]string{}
	for _, p := range from {
		had[key{p.Block, p.Expert}] = p.Peers
	}
	var n int64
	for _, p := range to {
		for _, h := range p.Peers {
			if !slices.Contains(had[key{p.Block, p.Expert}], h) {
				n += expertMoveBytesPerParam * prof.Params
			}
		}
	}
	return n
}

// expertShard is a whole expert or one replica of it, the unit the layout places.
type expertShard struct {
	block, expert int
	replica       int     // −1: the whole expert; r: replica r, holding token group r
	sibling       int     // the other replica's index; −1 for a whole expert
	load          float64 // tokens per step it computes
}

// layout is an assignment of shards to hosts under construction, with each host's load. Every
// shard needs the same memory (shardMem), so a host's memory is a number of slots.
type layout struct {
	prof     ExpertProfile
	loads    ExpertLoad
	opt      ExpertOptions
	hosts    []Peer        // by id
	perToken []float64     // seconds per routed token on each host
	shards   []expertShard // in the order they were added
	on       []int         // each shard's host; −1 while unplaced
	reserved []int         // with OneBlockPerHost, the block each host may hold; nil: any
	held     [][]int       // each host's shards, ascending
	load     []float64     // each host's tokens per step, summed over held in order
	slots    []int         // how many shards each host's memory holds
}

func newLayout(prof ExpertProfile, loads ExpertLoad, hosts []Peer, opt ExpertOptions) (*layout, error) {
	if err := prof.validate(); err != nil {
		return nil, err
	}
	if err := opt.validate(); err != nil {
		return nil, err
	}
	if err := checkLoads(prof, loads); err != nil {
		return nil, err
	}
	for _, r := range opt.Runs {
		if r[0] < 0 || r[1] <= r[0] || r[1] > prof.MicroBatches {
			return nil, fmt.Errorf("%w: a pipeline replica's run of micro-batches [%d, %d) of %d", ErrBadInput, r[0], r[1], prof.MicroBatches)
		}
	}
	sorted := slices.Clone(hosts)
	slices.SortFunc(sorted, func(a, b Peer) int { return cmp.Compare(a.ID, b.ID) })
	for i, p := range sorted {
		switch {
		case p.ID == "":
			return nil, fmt.Errorf("%w: a host without an id", ErrBadInput)
		case i > 0 && p.ID == sorted[i-1].ID:
			return nil, fmt.Errorf("%w: host id %q appears twice", ErrBadInput, p.ID)
		case !(p.GFLOPS > 0) || math.IsInf(p.GFLOPS, 0):
			return nil, fmt.Errorf("%w: host %q: GFLOPS %v", ErrBadInput, p.ID, p.GFLOPS)
		case !(p.LinkBytesPerS > 0):
			return nil, fmt.Errorf("%w: host %q: link %v bytes/s", ErrBadInput, p.ID, p.LinkBytesPerS)
		case p.MemoryBytes < 0:
			return nil, fmt.Errorf("%w: host %q: memory %d bytes", ErrBadInput, p.ID, p.MemoryBytes)
		}
	}
	l := &layout{prof: prof, loads: loads, opt: opt, hosts: sorted, perToken: make([]float64, len(sorted)),
		held: make([][]int, len(sorted)), load: make([]float64, len(sorted)), slots: make([]int, len(sorted))}
	need := l.shardMem()
	for h, p := range sorted {
		l.perToken[h] = prof.FLOPsPerToken/(p.GFLOPS*1e9) + prof.SendBytesPerToken/p.LinkBytesPerS
		l.slots[h] = int(min(math.Floor(float64(p.MemoryBytes)/need), 1<<30))
	}
	return l, nil
}

func (l *layout) expertLoad(block, e int) float64 {
	if row, ok := l.loads[block]; ok {
		return row[e]
	}
	return l.prof.uniformLoad()
}

// shardMem is the memory of a whole expert or of one replica: its state, and its activations for
// InFlight micro-batches of the most tokens it can get (see PlaceExperts), and for a host of
// several pipeline replicas every run's gradient-tree nodes (ExpertOptions.Runs).
func (l *layout) shardMem() float64 {
	inFlight := l.opt.InFlight
	if inFlight == 0 {
		inFlight = l.prof.MicroBatches
	}
	return l.prof.runsMemory(inFlight, l.opt.Runs)
}

// runsMemory is expertMemory for a host serving pipeline replicas that compute the runs of
// micro-batches runs (ExpertOptions.Runs): beside one tree over [0, M), which StateBytes counts,
// each run's tree buffers at once, 4 bytes a parameter each. It is ExpertShardMemoryRuns's
// formula for one expert, in the same order of operations, so that a host's slots here and the
// worker's check of its Assign (client checkMemory) agree to the last bit. No runs, or one,
// change nothing.
func (p ExpertProfile) runsMemory(inFlight int, runs [][2]int) float64 {
	need := p.expertMemory(inFlight)
	if len(runs) < 2 {
		return need
	}
	extra := -model.TreeBuffers(p.MicroBatches, 0, p.MicroBatches)
	for _, r := range runs {
		extra += model.TreeBuffers(p.MicroBatches, r[0], r[1])
	}
	return need + 4*float64(max(extra, 0))*float64(p.Params)
}

// expertMemory is the memory of one expert (or replica) keeping inFlight micro-batches'
// activations. A replica is sent whole micro-batches (model.GroupEdge: those of half the step's),
// any of whose tokens may all come its way, so its activation memory per micro-batch is a whole
// expert's.
func (p ExpertProfile) expertMemory(inFlight int) float64 {
	return p.StateBytes + float64(max(inFlight*p.Tokens, p.EvalTokens))*p.ActBytesPerToken
}

// hotLimit is the load above which an expert gets a second replica: ReplicateAbove times the fair
// share (ExpertOptions.ReplicateAbove); +Inf when replication is off or impossible.
func (l *layout) hotLimit() float64 {
	if l.opt.ReplicateAbove == 0 || l.prof.MicroBatches < 2 {
		return math.Inf(1)
	}
	usable, speeds, fastest := 0, 0.0, 0.0
	for h := range l.hosts {
		if l.slots[h] > 0 {
			v := 1 / l.perToken[h]
			usable, speeds, fastest = usable+1, speeds+v, max(fastest, v)
		}
	}
	if usable < 2 {
		return math.Inf(1)
	}
	total := 0.0
	for _, b := range l.prof.Blocks {
		for e := 0; e < l.prof.Experts; e++ {
			total += l.expertLoad(b, e)
		}
	}
	return l.opt.ReplicateAbove * total * fastest / speeds
}

// addExpert adds expert e of block as one unplaced whole shard, or as two replicas of half its
// load.
func (l *layout) addExpert(block, e int, load float64, replicate bool) {
	if !replicate {
		l.shards = append(l.shards, expertShard{block: block, expert: e, replica: -1, sibling: -1, load: load})
		l.on = append(l.on, -1)
		return
	}
	n := len(l.shards)
	for r := range 2 {
		l.shards = append(l.shards, expertShard{block: block, expert: e, replica: r, sibling: n + 1 - r, load: load / 2})
		l.on = append(l.on, -1)
	}
}

func (l *layout) unplaced() []int {
	var out []int
	for s, h := range l.on {
		if h < 0 {
			out = append(out, s)
		}
	}
	return out
}

func (l *layout) finish(h int) float64 { return l.load[h] * l.perToken[h] }

// refresh recomputes host h's load over its shards in index order, so that a host's load is the
// same float64 however its shards got there.
func (l *layout) refresh(h int) {
	l.load[h] = 0
	for _, s := range l.held[h] {
		l.load[h] += l.shards[s].load
	}
}

func (l *layout) assign(s, h int) {
	l.on[s] = h
	i, _ := slices.BinarySearch(l.held[h], s)
	l.held[h] = slices.Insert(l.held[h], i, s)
	l.refresh(h)
}

func (l *layout) unassign(s int) {
	h := l.on[s]
	l.on[s] = -1
	i, _ := slices.BinarySearch(l.held[h], s)
	l.held[h] = slices.Delete(l.held[h], i, i+1)
	l.refresh(h)
}

// ok reports whether host h's shards fit it: its memory, never both replicas of an expert, and
// with OneBlockPerHost one block.
func (l *layout) ok(h int) bool {
	if len(l.held[h]) > l.slots[h] {
		return false
	}
	for _, s := range l.held[h] {
		sh := l.shards[s]
		if sh.sibling >= 0 && l.on[sh.sibling] == h {
			return false
		}
		if l.opt.OneBlockPerHost && sh.block != l.shards[l.held[h][0]].block {
			return false
		}
	}
	return true
}

// fits reports whether unplaced shard s may go to host h.
func (l *layout) fits(s, h int) bool {
	sh := l.shards[s]
	switch {
	case len(l.held[h]) >= l.slots[h]:
		return false
	case sh.sibling >= 0 && l.on[sh.sibling] == h:
		return false
	case l.opt.OneBlockPerHost && len(l.held[h]) > 0 && l.shards[l.held[h][0]].block != sh.block:
		return false
	case l.reserved != nil && l.reserved[h] != sh.block:
		return false
	}
	return true
}

// reserveBlocks decides, for OneBlockPerHost, which block's experts each host may take before LPT
// runs: left to itself, LPT would spread the first block over every host and find none left for
// the next. Hosts go fastest first (ties by id) to the block that needs them most: one that cannot
// yet hold its shards, then the one with the most load per speed, then the most load, then the
// first. With byMemory, hosts go largest memory first (ties fastest, then by id) instead.
func (l *layout) reserveBlocks(byMemory bool) {
	need, work := map[int]int{}, map[int]float64{}
	for _, s := range l.shards {
		need[s.block]++
		work[s.block] += s.load
	}
	order := make([]int, len(l.hosts))
	for h := range order {
		order[h] = h
	}
	slices.SortStableFunc(order, func(a, b int) int {
		if byMemory && l.hosts[a].MemoryBytes != l.hosts[b].MemoryBytes {
			return cmp.Compare(l.hosts[b].MemoryBytes, l.hosts[a].MemoryBytes)
		}
		return cmp.Compare(l.perToken[a], l.perToken[b])
	})
	room, speed := map[int]int{}, map[int]float64{}
	l.reserved = make([]int, len(l.hosts))
	for _, h := range order {
		l.reserved[h] = -1
		slots := l.slots[h]
		if slots == 0 {
			continue
		}
		best := -1
		for _, b := range l.prof.Blocks {
			if best < 0 {
				best = b
				continue
			}
			short, bestShort := room[b] < need[b], room[best] < need[best]
			ratio := func(b int) float64 {
				if speed[b] == 0 {
					return math.Inf(1)
				}
				return work[b] / speed[b]
			}
			if short != bestShort {
				if short {
					best = b
				}
				continue
			}
			if r, rb := ratio(b), ratio(best); r > rb || r == rb && work[b] > work[best] {
				best = b
			}
		}
		l.reserved[h] = best
		room[best] += slots
		speed[best] += 1 / l.perToken[h]
	}
}

// lpt places the given unplaced shards, largest load first, each where it finishes earliest.
func (l *layout) lpt(todo []int) error {
	todo = slices.Clone(todo)
	slices.SortFunc(todo, func(a, b int) int {
		x, y := l.shards[a], l.shards[b]
		if c := cmp.Compare(y.load, x.load); c != 0 {
			return c
		}
		if c := cmp.Compare(x.block, y.block); c != 0 {
			return c
		}
		if c := cmp.Compare(x.expert, y.expert); c != 0 {
			return c
		}
		return cmp.Compare(x.replica, y.replica)
	})
	for _, s := range todo {
		best, bestT := -1, math.Inf(1)
		for h := range l.hosts {
			if !l.fits(s, h) {
				continue
			}
			t := (l.load[h] + l.shards[s].load) * l.perToken[h]
			if best < 0 || t < bestT || t == bestT && len(l.held[h]) < len(l.held[best]) {
				best, bestT = h, t
			}
		}
		if best < 0 {
			return l.noRoom(s)
		}
		l.assign(s, best)
	}
	return nil
}

func (l *layout) noRoom(s int) error {
	sh := l.shards[s]
	need, free := l.shardMem(), 0.0
	for h, p := range l.hosts {
		free = max(free, float64(p.MemoryBytes)-float64(len(l.held[h]))*need)
	}
	what, runs := "expert", ""
	if sh.replica >= 0 {
		what = fmt.Sprintf("replica %d of expert", sh.replica)
	}
	if len(l.opt.Runs) > 1 {
		runs = fmt.Sprintf(", and the gradient-tree nodes of the %d pipeline replicas it serves", len(l.opt.Runs))
	}
	return fmt.Errorf("%w: %s %d of block %d needs %s (weights, gradients and Adam state, and activations of up to %d tokens per micro-batch%s), "+
		"and the most any of the %d hosts has left is %s: add hosts or memory, or lower the micro-batch size",
		ErrNoPlan, what, sh.expert, sh.block, fmtBytes(need), l.prof.Tokens, runs, len(l.hosts), fmtBytes(max(free, 0)))
}

func (l *layout) makespan() float64 {
	m := 0.0
	for h := range l.hosts {
		m = max(m, l.finish(h))
	}
	return m
}

// adopt places the shards of current: a replicated expert as its two replicas, in current's
// replica order. Shards on hosts that are gone, or on hosts they no longer fit, and experts
// current lacks (added whole, or replicated when hot), are left unplaced; so is, whole, an
// expert current replicates where the options allow no replicas (ExpertOptions.Runs: a plan of
// one pipeline that becomes one of several). intact reports that nothing was.
func (l *layout) adopt(current []ExpertPlacement) (intact bool, err error) {
	type key struct{ block, expert int }
	byKey := map[key][]string{}
	for _, p := range current {
		k := key{p.Block, p.Expert}
		switch {
		case !l.prof.isBlock(p.Block) || p.Expert < 0 || p.Expert >= l.prof.Experts:
			return false, fmt.Errorf("%w: placement of expert %d of block %d, which the model does not have", ErrBadInput, p.Expert, p.Block)
		case byKey[k] != nil:
			return false, fmt.Errorf("%w: expert %d of block %d placed twice", ErrBadInput, p.Expert, p.Block)
		case len(p.Peers) < 1 || len(p.Peers) > model.ExpertGroups:
			return false, fmt.Errorf("%w: expert %d of block %d on %d peers: want 1, or %d replicas", ErrBadInput, p.Expert, p.Block, len(p.Peers), model.ExpertGroups)
		case len(p.Peers) == 2 && p.Peers[0] == p.Peers[1]:
			return false, fmt.Errorf("%w: expert %d of block %d has both replicas on %q", ErrBadInput, p.Expert, p.Block, p.Peers[0])
		}
		byKey[k] = p.Peers
	}
	index := map[string]int{}
	for h, p := range l.hosts {
		index[p.ID] = h
	}
	intact = true
	hot := math.NaN() // computed when first needed
	for _, b := range l.prof.Blocks {
		for e := 0; e < l.prof.Experts; e++ {
			x := l.expertLoad(b, e)
			peers, ok := byKey[key{b, e}]
			if !ok {
				if math.IsNaN(hot) {
					hot = l.hotLimit()
				}
				l.addExpert(b, e, x, x > hot)
				intact = false
				continue
			}
			if len(peers) == 2 && !l.opt.replicable() {
				l.addExpert(b, e, x, false)
				intact = false
				continue
			}
			first := len(l.shards)
			l.addExpert(b, e, x, len(peers) == 2)
			for r, id := range peers {
				if h, ok := index[id]; ok {
					l.assign(first+r, h)
				} else {
					intact = false
				}
			}
		}
	}
	for h := range l.hosts {
		if !l.ok(h) {
			for _, s := range slices.Clone(l.held[h]) {
				l.unassign(s)
			}
			intact = false
		}
	}
	return intact, nil
}

// improve is the local search of ReplaceExperts. Each step takes the busiest host (ties to the
// smaller id) and applies the change that leaves it and the one other host the change touches
// with the lowest finish time, as long as that is below the busiest host's: a shard moved to
// another host, two shards swapped (one lighter), or a hot whole expert split into two replicas;
// among equally good changes, the one that moves fewer shards, then the first found. Each step
// replaces the largest finish time by two smaller ones, so the search ends. It stops early once
// the makespan is down to stopAt (the fresh placement's: no use moving more to beat it), and the
// steps it took after first reaching its lowest makespan bought nothing, so they are undone.
//
// A change is judged from the loads of the two hosts alone, in O(1); a step costs O(k·n) for k
// shards on the busiest host and n in all.
func (l *layout) improve(stopAt float64) {
	hot := l.hotLimit()
	var undos []func()
	spans := []float64{l.makespan()}
	defer func() {
		first := slices.Index(spans, slices.Min(spans))
		for k := len(undos) - 1; k >= first; k-- {
			undos[k]()
		}
	}()
	type change struct {
		kind  int // 0 move i to g, 1 swap i and j (on g), 2 split i with its new replica on g
		i, j  int
		g     int
		moves int
		worst float64 // the larger of the two hosts' finish times after the change
	}
	sameBlock := func(h, block, except int) bool { // h holds only block, shard except aside
		if !l.opt.OneBlockPerHost {
			return true
		}
		for _, s := range l.held[h] {
			if s != except && l.shards[s].block != block {
				return false
			}
		}
		return true
	}
	for range 4*len(l.shards) + 4 { // the cap only bounds the work
		if spans[len(spans)-1] <= stopAt {
			return
		}
		b := 0
		for h := range l.hosts {
			if l.finish(h) > l.finish(b) {
				b = h
			}
		}
		limit := l.finish(b) * (1 - 1e-9) // better by more than rounding
		var best *change
		consider := func(c change, lb, lg float64) {
			c.worst = max(lb*l.perToken[b], lg*l.perToken[c.g])
			if c.worst < limit && (best == nil || c.worst < best.worst || c.worst == best.worst && c.moves < best.moves) {
				best = &c
			}
		}
		for _, i := range l.held[b] {
			si := l.shards[i]
			for g := range l.hosts {
				if g == b || len(l.held[g]) >= l.slots[g] || !sameBlock(g, si.block, -1) || si.sibling >= 0 && l.on[si.sibling] == g {
					continue
				}
				consider(change{kind: 0, i: i, g: g, moves: 1}, l.load[b]-si.load, l.load[g]+si.load)
				if si.replica < 0 && si.load > hot {
					consider(change{kind: 2, i: i, g: g, moves: 1}, l.load[b]-si.load/2, l.load[g]+si.load/2)
				}
			}
			for j, sj := range l.shards {
				g := l.on[j]
				if g < 0 || g == b || !(sj.load < si.load) || !sameBlock(g, si.block, j) || !sameBlock(b, sj.block, i) ||
					si.sibling >= 0 && l.on[si.sibling] == g || sj.sibling >= 0 && l.on[sj.sibling] == b {
					continue
				}
				consider(change{kind: 1, i: i, j: j, g: g, moves: 2}, l.load[b]-si.load+sj.load, l.load[g]-sj.load+si.load)
			}
		}
		if best == nil {
			return
		}
		var undo func()
		switch c := *best; c.kind {
		case 0:
			l.unassign(c.i)
			l.assign(c.i, c.g)
			undo = func() { l.unassign(c.i); l.assign(c.i, b) }
		case 1:
			l.unassign(c.i)
			l.unassign(c.j)
			l.assign(c.i, c.g)
			l.assign(c.j, b)
			undo = func() { l.unassign(c.i); l.unassign(c.j); l.assign(c.i, b); l.assign(c.j, c.g) }
		case 2:
			undo = l.split(c.i, c.g)
		}
		// The estimate took the loads' differences; the sums in order must agree that it helps.
		if max(l.finish(b), l.finish(best.g)) >= limit {
			undo()
			return
		}
		undos = append(undos, undo)
		spans = append(spans, l.makespan())
	}
}

// split makes whole shard i, on its host, replica 0 of its expert and puts a new replica 1 on
// host g, each with half the load; it returns the undo.
func (l *layout) split(i, g int) func() {
	b, was := l.on[i], l.shards[i]
	n := len(l.shards)
	l.unassign(i)
	l.shards[i].replica, l.shards[i].sibling, l.shards[i].load = 0, n, was.load/2
	l.shards = append(l.shards, expertShard{block: was.block, expert: was.expert, replica: 1, sibling: i, load: was.load / 2})
	l.on = append(l.on, -1)
	l.assign(i, b)
	l.assign(n, g)
	return func() {
		l.unassign(n)
		l.shards, l.on = l.shards[:n], l.on[:n]
		l.unassign(i)
		l.shards[i] = was
		l.assign(i, b)
	}
}

// placements returns one ExpertPlacement per expert, by (block, expert), with its hosts in
// replica order.
func (l *layout) placements() []ExpertPlacement {
	idx := make([]int, len(l.shards))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		x, y := l.shards[a], l.shards[b]
		if c := cmp.Compare(x.block, y.block); c != 0 {
			return c
		}
		if c := cmp.Compare(x.expert, y.expert); c != 0 {
			return c
		}
		return cmp.Compare(x.replica, y.replica)
	})
	var out []ExpertPlacement
	for _, s := range idx {
		sh := l.shards[s]
		if n := len(out); n > 0 && out[n-1].Block == sh.block && out[n-1].Expert == sh.expert {
			out[n-1].Peers = append(out[n-1].Peers, l.hosts[l.on[s]].ID)
			continue
		}
		out = append(out, ExpertPlacement{Block: sh.block, Expert: sh.expert, Peers: []string{l.hosts[l.on[s]].ID}})
	}
	return out
}
