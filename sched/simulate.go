package sched

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/shoal-ml/shoal/model"
)

// The fleet simulator (issue 13, docs/design.md "Scheduling"): synthetic volunteers join and leave,
// and the job runs on them as the coordinator runs it: its planner (PlanReplicas' search,
// replicaPlanner.extend, over the live peers) makes every plan, and its rule book (Decide,
// rules.go) answers every departure and join, so that the figures are the system's. Time advances
// in ticks; churn events inside a tick are applied at their own time, and between events the job
// progresses at the rate the planner estimates for its replicas. The simulator keeps the replicas
// as the planner formed them (cuts, depth and share cap), which a Plan does not carry.
//
// The model of what churn costs, and its assumptions:
//   - A departure of a peer holding no stage costs nothing. A holder's departure is noticed after
//     SimConfig.DetectSeconds (the heartbeat timeout: every departure is taken as a machine that
//     vanished, none as a closed link), or QuickDetectSeconds where the job waits on it (an outer
//     exchange, a round's end: the coordinator's Hub.Hasten), and answered as Decide says.
//   - DropReplica (outer mode, during a round): the survivors do not wait, unless the round's end
//     (every RoundSteps steps, or an outer step) comes before the departure is noticed: then they
//     wait there until it is (BarrierWaits). The lost replica's inner steps since the last outer
//     step are left out of the average, wasted. Its other peers become standbys. The survivors' shares are recomputed (with own batches each keeps
//     its n_r in the coordinator; the estimate may differ slightly).
//   - Reroute (step mode, during a step, another replica survives; the simulated plans have no
//     expert hosts): the replicas beside the lost one compute its micro-batches of the step in
//     flight on top of their own; what it had computed of the step is lost, and the step waits
//     for the departure to be noticed as far as that outlasts the rest of the step. The
//     step's first departure from replicas of several stages cut alike is a stage takeover (the
//     coordinator's): only the lost stage's work of the step is lost.
//   - Reshare (step mode at a boundary, another replica survives): the step in flight is
//     lost — the survivors compute it again with the lost replica's micro-batches — and the job
//     stands still for DetectSeconds while the departure is noticed and the survivors are told
//     their new shares; nothing is loaded, nothing rolled back, and a departure meanwhile is
//     answered as at a boundary (another reshare). The lost step's work counts in LostSeconds,
//     the wait in StallSeconds.
//   - A drop during an outer exchange (the exposed synchronisation at the end of each outer
//     period): without a delay nobody has applied the outer step yet (PhaseExchange), so the
//     replica is dropped, its round wasted, and the survivors take the outer step on without it
//     (an exchange redo): the exchange does not start over (client/outerx.go), it ends
//     DetectSeconds after the departure at the earliest, later by the lost replica's segments
//     averaged again by survivors (lostSegment). With a delay the same, from the outer step until
//     the exchange is over, beside training: the survivors wait only for what of it outlasts the
//     steps left before the take-up, and the dropped replica's contribution leaves the
//     synchronised work.
//   - Restore (the last replica; a departure while a plan loads, except an outer-mode replica of
//     a plan restoring from a checkpoint, which is dropped as the others load on): the job rolls
//     back to its newest complete checkpoint (every CheckpointEvery steps, at the start, at
//     every join replan, and once the job has restored at Young's interval for its restores so
//     far and a shard's upload: CheckpointInterval), plans afresh over the live peers and stands still while every stage
//     downloads its whole shard (StateBytesPerParam a parameter, over the peer's link) — the
//     coordinator's restore reloads every shard, kept or not. Outer mode's replica k of the new
//     plan continues from replica k's state in the checkpoint, by index.
//   - Joins are weighed at step boundaries (outer mode: round boundaries, a round being at most
//     simMaxRoundSteps steps), at most every JoinGapSeconds: when a fresh plan over everyone
//     differs from the running one, the job takes it up without a checkpoint when it can (Grow,
//     step mode: every stage of the fresh plan is on the peer holding it now or on one whose
//     twin stays and hands it over — each giver sending its takers their state one after
//     another over its uplink, and the job standing still until the last has it); otherwise it
//     checkpoints (every stage uploads its shard; the job waits for the slowest) and replans
//     from it, every shard reloading. When the fresh plan is the running one the newcomers
//     stand by.
//   - The coordinator's own link (every checkpoint's upload and restore's download pass through
//     it) is not modelled, nor the settle time before a plan; a departure while a delayed outer
//     step is exchanged (its first (sync + hidden)·H seconds) is a redo, as on the coordinator.
//   - The planner's estimate is the truth here: no noise, no stragglers, no contention beyond a
//     peer's own upload. It has the peers' drawn RTTs (ReplicaOptions.RTTSeconds), so link latency
//     is in every replica's time (see fleet.go), hidden by pipeline depth where memory allows.
//   - When the replicas' share caps (their memory) cannot cover the step, or none is left, the
//     job waits for a fresh plan at the next tick.
//   - Own batches (ReplicaOptions.OwnBatches): every replica trains a batch of its own each step,
//     n_r micro-batches (the slowest M, a faster one as many as it finishes in the slowest's
//     time: replicaPlanner.ownShares, recomputed whenever the replicas change), so a step's
//     useful work and tokens count Σ n_r micro-batches; a lost replica's wasted inner steps are
//     its n_r micro-batches each. Nothing caps the replicas at M.
//   - Outer mode with a delay (ReplicaOptions.Delay): the job progresses at the estimate's rate,
//     whose exposed synchronisation is what D inner steps of the slowest replica's compute leave
//     of each outer exchange (fleet.go), so a hidden exchange costs no progress and goodput counts
//     it as such.

// lostSegment is what a participant lost during an outer exchange of r participants adds to the
// exchange, as a share of the whole exchange's time (client/outerx.go): its
// model.OuterSegmentsPerReplica segments go to as many survivors, each of which sends the R−1
// others one more segment's average — 1/c of its all-gather, half the exchange — while every
// survivor sends its contributions to those segments again, 1/(R−1) of its reduce-scatter.
func lostSegment(r int) float64 {
	if r < 2 {
		return 0
	}
	c := float64(len(model.OuterOwners(make([]int, r))) / r)
	return 0.5/c + 0.5/float64(max(r-1, 1))
}

// PeerClass is one kind of volunteer in a fleet mix. Every range is drawn log-uniformly.
type PeerClass struct {
	Name       string     `json:"name"`
	Share      float64    `json:"share"` // fraction of the fleet
	GFLOPS     [2]float64 `json:"gflops"`
	MemoryGB   [2]float64 `json:"memory_gb"`
	UploadMbps [2]float64 `json:"upload_mbps"`
	RTTms      [2]float64 `json:"rtt_ms"`
	// QUIC: the class's peers are native workers whose links to one another move frames over
	// QUIC (shoal worker with SHOAL_QUIC=1 beyond loopback); a peer's upload is bounded by its
	// data plane (QUICBytesPerS, else DataChannelBytesPerS), as the coordinator bounds it. The
	// simulator bounds everything a peer moves so, a restore's download from the coordinator too
	// (HTTP, not the data plane): pessimistic for peers whose links are faster than the bound.
	QUIC bool `json:"quic,omitempty"`
	// Browser: the class's peers are browser tabs, which keep outer mode's state on their heap;
	// in outer mode they are offered to the planner at what it leaves (HeapOuterOffer), as the
	// coordinator offers a tab. A native worker maps it from a file.
	Browser bool `json:"browser,omitempty"`
}

// DataChannelBytesPerS and QUICBytesPerS bound the upload the planner assumes of a peer, whatever
// its link: the data plane's own cost, the rate at which a peer's CPU can move frames (the
// coordinator's replica decision, and the simulator's fleet). A WebRTC data channel costs 1.6–1.9
// ms of CPU per 64 KiB frame, both ends together (client's BenchmarkRTCThroughput: 48–59 MB/s for
// bare pion on a quiet 2-core machine, less beside training): 32 MB/s. Between two native workers
// frames move over QUIC (issue 34), about 5.4 CPU-seconds a GB for both ends
// (BenchmarkDataPlane/quic, 325–349 MB/s one way), and two step-mode replicas on one 2-core
// machine, training beside it, swap their 26 MB gradients in 283–393 ms
// (scripts/bench_replicas.sh): 66–92 MB/s each way, so 80 MB/s.
const (
	DataChannelBytesPerS = 32e6
	QUICBytesPerS        = 80e6
)

// DataPlaneBytesPerS is a peer's bound: QUICBytesPerS where its links run on QUIC,
// DataChannelBytesPerS otherwise — the one rule the coordinator and the simulated fleet apply.
func DataPlaneBytesPerS(quic bool) float64 {
	if quic {
		return QUICBytesPerS
	}
	return DataChannelBytesPerS
}

// DefaultFleetMix is issue 13's mix: browser CPU 1–5 GFLOP/s, browser GPU 50–2,000, native CPU
// 50–400, native GPU 5,000–50,000; upload 10 Mb/s–1 Gb/s, RTT 20–150 ms, memory 1–24 GB. The
// shares and the per-class sub-ranges of memory and upload are this simulator's assumptions: most
// volunteers are browser tabs (which get a few GB, and home uploads); one in ten is a native GPU.
// Uploads are bounded by the data plane: 32 MB/s for a tab's data channels, 80 MB/s for native
// workers, which are assumed to run QUIC (opt-in beyond loopback today, SHOAL_QUIC=1).
func DefaultFleetMix() []PeerClass {
	return []PeerClass{
		{Name: "browser-cpu", Share: 0.45, GFLOPS: [2]float64{1, 5}, MemoryGB: [2]float64{1, 4}, UploadMbps: [2]float64{10, 100}, RTTms: [2]float64{20, 150}, Browser: true},
		{Name: "browser-gpu", Share: 0.30, GFLOPS: [2]float64{50, 2000}, MemoryGB: [2]float64{1, 8}, UploadMbps: [2]float64{10, 300}, RTTms: [2]float64{20, 150}, Browser: true},
		{Name: "native-cpu", Share: 0.15, GFLOPS: [2]float64{50, 400}, MemoryGB: [2]float64{4, 24}, UploadMbps: [2]float64{20, 1000}, RTTms: [2]float64{20, 150}, QUIC: true},
		{Name: "native-gpu", Share: 0.10, GFLOPS: [2]float64{5000, 50000}, MemoryGB: [2]float64{8, 24}, UploadMbps: [2]float64{50, 1000}, RTTms: [2]float64{20, 150}, QUIC: true},
	}
}

// LoadBytesPerParam is what a peer fetches per parameter of a stage it newly holds: the float32
// weight and AdamW's two moments (the gradient buffers start empty).
const LoadBytesPerParam = 12

// SimConfig is a fleet simulation. Zero durations and thresholds take the defaults named.
type SimConfig struct {
	Profile Profile
	Options ReplicaOptions
	// Peers is the fleet's size N at the start; arrivals keep it about N.
	Peers int
	Hours float64
	Seed  uint64
	// Mix is the fleet's mix; nil means DefaultFleetMix.
	Mix []PeerClass
	// MeanLifetimeSeconds is the mean of the exponential lifetimes (3600).
	MeanLifetimeSeconds float64
	// PlanForSpeed weighs plans by their speed alone, as the planner did before it weighed churn
	// (sched.Churn): for comparison. By default, from the first restore on, the planner weighs
	// their goodput under the fleet's churn, as the coordinator does once it has seen departures.
	PlanForSpeed bool
	// TickSeconds is the time step (10).
	TickSeconds float64
	// DetectSeconds is how long a departure takes to notice (5, the coordinator's heartbeat
	// timeout).
	DetectSeconds float64
	// QuickDetectSeconds is how long a departure takes to notice while the job waits on the
	// departed peer — an outer exchange, a round's end (coordinator: Hub.Hasten): 1.625, the
	// quick timeout (2 s) less the half interval (0.5 s) since the last beat heard, plus half the
	// sweep's quarter interval (0.125 s). Never more than DetectSeconds.
	QuickDetectSeconds float64
	// JoinGapSeconds spaces the replans for joins (10, the coordinator's join replan gap).
	JoinGapSeconds float64
	// CheckpointEvery is the job's checkpoint_every, in steps (100, the default job's; negative:
	// none but the job's start), what a restore rolls back to.
	CheckpointEvery int
	// Samples is how many samples over time the result keeps (24).
	Samples int
	// Clock returns seconds (any origin), to time the planner; nil leaves planner times 0. sched
	// has no clock of its own (doc.go).
	Clock func() float64
}

// SimSample is the fleet and the plan at one moment.
type SimSample struct {
	Hours      float64 `json:"hours"`
	Live       int     `json:"live"`
	Replicas   int     `json:"replicas"`
	Standby    int     `json:"standby"`
	StepS      float64 `json:"step_s"`
	TokensPerS float64 `json:"tokens_per_s"`
	// Goodput is the plan's useful FLOP/s over the live fleet's FLOP/s at that moment.
	Goodput float64 `json:"goodput"`
}

// SimResult is what a simulation measured.
type SimResult struct {
	Peers int     `json:"peers"`
	Hours float64 `json:"hours"`
	Seed  uint64  `json:"seed"`
	Sync  string  `json:"sync"`
	Every int     `json:"every,omitempty"`
	// OwnBatches: every replica trained a batch of its own each step (ReplicaOptions.OwnBatches).
	OwnBatches bool `json:"own_batches,omitempty"`
	// Delay is the inner steps an outer exchange ran behind before its result was taken up
	// (ReplicaOptions.Delay; 0: exposed whole).
	Delay int `json:"delay,omitempty"`
	M     int `json:"micro_batches"`

	// Steps are (inner) steps; with own batches each trained as many batches as replicas ran.
	Steps  float64 `json:"steps"`
	Tokens float64 `json:"tokens"`
	// Goodput is the useful model FLOPs over the FLOPs the live fleet offered; GoodputCapable
	// the same over the peers able to hold a shard (the smallest stage, ReplicaStageMemory).
	// Useful is every step's work that a restore did not roll back, less a dropped replica's
	// work since its last outer step.
	Goodput        float64 `json:"goodput"`
	GoodputCapable float64 `json:"goodput_capable"`
	// GoodputSynchronised counts only the work that reached an applied step (step mode: a
	// completed step) or outer step (outer mode: the work of a round whose outer step was taken),
	// over the fleet's FLOPs: the last round's work, still to be averaged, is not in it.
	GoodputSynchronised float64 `json:"goodput_synchronised"`
	// FleetFLOPS and CapableFLOPS are the time averages of the fleet's FLOP/s; UsedFLOPS of the
	// FLOP/s of the peers holding a stage of a running replica. UsefulFLOPS over UsedFLOPS is how
	// well the replicas use their own peers (bubble, links, synchronisation, churn).
	FleetFLOPS   float64 `json:"fleet_flops"`
	CapableFLOPS float64 `json:"capable_flops"`
	UsedFLOPS    float64 `json:"used_flops"`
	UsefulFLOPS  float64 `json:"useful_flops"`
	// Classes are the fleet's peer classes at the start, and what of them the first plan uses.
	Classes []SimClass `json:"classes"`
	// Initial is the first plan's estimate; InitialGoodput(Capable) its goodput without churn.
	Initial               Estimate `json:"initial"`
	InitialGoodput        float64  `json:"initial_goodput"`
	InitialGoodputCapable float64  `json:"initial_goodput_capable"`

	Joins  int `json:"joins"`
	Leaves int `json:"leaves"`
	// ReplicaLeaves are departures of a peer holding a stage of a replica: the churn events that
	// cost something. The rule book (Decide) answered Drops of them by dropping the replica, and
	// Restores by restoring from the newest checkpoint; JoinReplans are its checkpoints and
	// replans for joins, and Replans all the plans made after the first.
	ReplicaLeaves int `json:"replica_leaves"`
	Drops         int `json:"drops"`
	// Reshares are step mode's drops at a boundary (or beside expert hosts): the survivors share
	// the lost replica's micro-batches, computing the step in flight again.
	Reshares int `json:"reshares"`
	// Reroutes are step mode's drops during a step: the replicas beside the lost one compute its
	// micro-batches of the step too.
	Reroutes int `json:"reroutes"`
	// Takeovers are the reroutes taken as a stage takeover (the coordinator's: a lost stage's
	// pool mate computes its micro-batches at its blocks alone, the rest of its replica keeping
	// its work).
	Takeovers int `json:"takeovers"`
	// Grows are the joins taken in without a checkpoint (sched.Grow): their stages' state handed
	// over by the peers holding it.
	Grows int `json:"grows"`
	// Reshapes are the grows that took the planner's plan up when it was neither a refill nor an
	// extension (the coordinator's outerReshape): the replicas it kept alike kept their state, the
	// others took the global θ from their holders, and the running ones it left were left out.
	Reshapes int `json:"reshapes"`
	// HoldersKept counts the step-mode joins whose planner's plan was taken with its peers moved
	// so that holders stay on their blocks (KeepHolders): a grow, or the plan kept, instead of a
	// checkpoint and replan.
	HoldersKept int `json:"holders_kept"`
	// HandedBack counts the holders that handed their stage to a joiner the planner put in their
	// place and then stood by, at step-mode grows (Givers with hand-back; the coordinator's
	// proto.Assign.Standby) — each a join that would have taken a checkpoint and a replan.
	HandedBack int `json:"handed_back"`
	// GrowsWaited counts the boundaries at which a grow waited for what it adds to repay the
	// stall of its handovers (GrowDeferral), its joiners standing by.
	GrowsWaited int `json:"grows_waited"`
	// ReplansWaited counts the boundaries at which a join's checkpoint and replan waited for what
	// the planner's plan adds to repay its stall (Change.ReplanWaits), its joiners standing by.
	ReplansWaited int `json:"replans_waited"`
	Restores      int `json:"restores"`
	// ExchangeRedos are drops during an outer exchange, delayed or not: the survivors took the
	// outer step again without it, nothing restored.
	ExchangeRedos int `json:"exchange_redos"`
	// RedosCut are the exchange redos during another (a departure before the survivors'
	// exchange without the last one ended): it goes on without both, each adding its segments.
	RedosCut int `json:"redos_cut"`
	// BarrierWaits are departures the others waited at a barrier to notice (QuickDetectSeconds
	// from them), a stall of StallSeconds: in outer mode, during a round whose end came first; in
	// step mode, during a step whose other work was done first (Reroute).
	BarrierWaits int `json:"barrier_waits"`
	JoinReplans  int `json:"join_replans"`
	Replans      int `json:"replans"`
	// StallSeconds is the time departures stopped the job (noticing the departure; for a
	// restore, loading every shard too), RestoreLostSeconds the progress they rolled back, LostSeconds the work of dropped
	// replicas left out of outer averages, all in seconds of the job's progress; StallPerEvent
	// is their sum per replica leave. ReplanStallSeconds is the time join replans stopped the job
	// (the checkpoint's upload, then every shard's load).
	StallSeconds       float64 `json:"stall_seconds"`
	RestoreLostSeconds float64 `json:"restore_lost_seconds"`
	LostSeconds        float64 `json:"lost_seconds"`
	StallPerEvent      float64 `json:"stall_per_event"`
	ReplanStallSeconds float64 `json:"replan_stall_seconds"`

	// Replicas and standbys over time: time averages, least and most.
	ReplicasMean float64 `json:"replicas_mean"`
	ReplicasMin  int     `json:"replicas_min"`
	ReplicasMax  int     `json:"replicas_max"`
	StandbyMean  float64 `json:"standby_mean"`

	// Planner times, seconds (0 without SimConfig.Clock): the first plan, and every
	// PlanReplicas call.
	PlanFirstSeconds float64 `json:"plan_first_seconds"`
	PlanMaxSeconds   float64 `json:"plan_max_seconds"`
	PlanMeanSeconds  float64 `json:"plan_mean_seconds"`
	PlanCalls        int     `json:"plan_calls"`

	Samples []SimSample `json:"samples"`
}

// SimClass is one class of the fleet at the start: its peers and FLOP/s, those able to hold a
// shard, and those the first plan gives a stage.
type SimClass struct {
	Name         string  `json:"name"`
	Peers        int     `json:"peers"`
	FLOPS        float64 `json:"flops"`
	CapablePeers int     `json:"capable_peers"`
	CapableFLOPS float64 `json:"capable_flops"`
	UsedPeers    int     `json:"used_peers"`
	UsedFLOPS    float64 `json:"used_flops"`
}

// SimPeer is a synthetic volunteer.
type SimPeer struct {
	Peer
	Class   string  `json:"class"`
	Browser bool    `json:"browser,omitempty"` // PeerClass.Browser
	RTTms   float64 `json:"rtt_ms"`
	JoinS   float64 `json:"join_s"`
	LeaveS  float64 `json:"leave_s"`
}

// Fleet draws the peers of a simulation: n at time 0 and Poisson arrivals at rate n / mean
// lifetime until hours, each with an exponential lifetime. It is deterministic in seed.
func Fleet(mix []PeerClass, n int, hours, meanLifetime float64, seed uint64) []SimPeer {
	r := rand.New(rand.NewPCG(seed, seed^0x5ee9f1ee7))
	total := 0.0
	for _, c := range mix {
		total += c.Share
	}
	logU := func(lo, hi float64) float64 { return lo * math.Pow(hi/lo, r.Float64()) }
	draw := func(i int, at float64) SimPeer {
		u, k := r.Float64()*total, 0
		for k < len(mix)-1 && u >= mix[k].Share {
			u -= mix[k].Share
			k++
		}
		c := mix[k]
		return SimPeer{Peer: Peer{ID: fmt.Sprintf("p%07d", i), GFLOPS: logU(c.GFLOPS[0], c.GFLOPS[1]),
			MemoryBytes:   int64(logU(c.MemoryGB[0], c.MemoryGB[1]) * 1e9),
			LinkBytesPerS: min(logU(c.UploadMbps[0], c.UploadMbps[1])*1e6/8, DataPlaneBytesPerS(c.QUIC))},
			Class: c.Name, Browser: c.Browser, RTTms: logU(c.RTTms[0], c.RTTms[1]), JoinS: at, LeaveS: at + r.ExpFloat64()*meanLifetime}
	}
	var out []SimPeer
	for i := 0; i < n; i++ {
		out = append(out, draw(i, 0))
	}
	end := hours * 3600
	for t := r.ExpFloat64() * meanLifetime / float64(max(n, 1)); t < end; t += r.ExpFloat64() * meanLifetime / float64(max(n, 1)) {
		out = append(out, draw(len(out), t))
	}
	return out
}

type simRep struct {
	c   *candidate
	ids []int // indices of its peers
	// work is the micro-batches it computed since the last outer synchronisation (or since it
	// started): what an outer average loses with it.
	work float64
	// sent is the work it gave the last outer step: with a delay, what that step leaves out when
	// the replica is lost before its commit.
	sent float64
	// givers are, while the refill that staffed it gets ready, the peers its stages take their
	// state from: one's departure drops it too (the coordinator's dropAtLoad). nil otherwise.
	givers []string
	// index is its index in the job's replicas (a replay's; the coordinator keeps the indices
	// 0..R−1, those of replicas dropped since the plan began free for a refill or new replicas).
	index int
}

type simEvent struct {
	t    float64
	join bool
	peer int
}

// simSnapshot is the job's progress at its newest complete checkpoint, which a restore rolls
// back to: steps, tokens, useful and synchronised FLOPs, and each replica's work since its last
// outer step (outer mode's checkpoint holds every replica's state, by index).
type simSnapshot struct {
	steps, tokens, useful, synced float64
	work                          []float64
}

// Simulate runs cfg and reports what it measured. It is deterministic in cfg (planner times
// aside, which come from cfg.Clock).
func Simulate(cfg SimConfig) (SimResult, error) {
	def := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&cfg.MeanLifetimeSeconds, 3600)
	def(&cfg.TickSeconds, 10)
	def(&cfg.DetectSeconds, 5)
	def(&cfg.QuickDetectSeconds, 1.625)
	cfg.QuickDetectSeconds = min(cfg.QuickDetectSeconds, cfg.DetectSeconds)
	def(&cfg.JoinGapSeconds, 10)
	if cfg.CheckpointEvery == 0 {
		cfg.CheckpointEvery = 100
	}
	if cfg.Samples == 0 {
		cfg.Samples = 24
	}
	if cfg.Mix == nil {
		cfg.Mix = DefaultFleetMix()
	}
	opt, prof := cfg.Options, cfg.Profile
	switch {
	case cfg.Peers < 1 || !(cfg.Hours > 0) || math.IsInf(cfg.Hours, 0):
		return SimResult{}, fmt.Errorf("%w: simulate %d peers for %v hours", ErrBadInput, cfg.Peers, cfg.Hours)
	case cfg.TickSeconds < 0 || cfg.DetectSeconds < 0 || cfg.QuickDetectSeconds < 0 || cfg.JoinGapSeconds < 0:
		return SimResult{}, fmt.Errorf("%w: tick %v s, detect %v s (%v s waited on), join gap %v s", ErrBadInput, cfg.TickSeconds, cfg.DetectSeconds, cfg.QuickDetectSeconds, cfg.JoinGapSeconds)
	}
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return SimResult{}, err
	}
	clock := cfg.Clock
	if clock == nil {
		clock = func() float64 { return 0 }
	}
	peers := Fleet(cfg.Mix, cfg.Peers, cfg.Hours, cfg.MeanLifetimeSeconds, cfg.Seed)
	for i := range peers {
		if peers[i].Browser {
			peers[i].MemoryBytes = HeapOuterOffer(peers[i].MemoryBytes, opt)
		}
	}
	if opt.RTTSeconds == nil {
		opt.RTTSeconds = make(map[string]float64, len(peers))
		for _, p := range peers {
			opt.RTTSeconds[p.ID] = p.RTTms / 1000
		}
	}
	pl := newReplicaPlanner(prof, opt)
	W := pl.L + 1
	M := opt.MicroBatches
	outer := opt.Sync == SyncOuter
	byID := make(map[string]int, len(peers))
	var events []simEvent
	for i, p := range peers {
		byID[p.ID] = i
		if p.JoinS > 0 {
			events = append(events, simEvent{p.JoinS, true, i})
		}
		events = append(events, simEvent{p.LeaveS, false, i})
	}
	slices.SortFunc(events, func(a, b simEvent) int {
		if c := cmp.Compare(a.t, b.t); c != 0 {
			return c
		}
		return cmp.Compare(a.peer, b.peer)
	})

	res := SimResult{Peers: cfg.Peers, Hours: cfg.Hours, Seed: cfg.Seed, Sync: opt.Sync.String(), M: M}
	if outer {
		res.Every, res.OwnBatches, res.Delay = opt.Every, opt.OwnBatches, opt.Delay
	}
	alive := make([]bool, len(peers))
	fresh := make([]bool, len(peers))     // joined and not yet weighed by a plan or the rule book
	holder := make([]*simRep, len(peers)) // the replica a peer holds a stage of
	var fleet, capable, used float64      // live FLOP/s; used: of the replicas' peers
	capableOf := func(i int) bool { return float64(peers[i].MemoryBytes) >= pl.minNeed }
	setAlive := func(i int, on bool) {
		alive[i] = on
		s := peers[i].GFLOPS * 1e9
		if !on {
			s = -s
		}
		fleet += s
		if capableOf(i) {
			capable += s
		}
	}
	for i, p := range peers {
		if p.JoinS == 0 {
			setAlive(i, true)
		}
	}
	live := func() []Peer {
		var out []Peer
		for i, on := range alive {
			if on {
				out = append(out, peers[i].Peer)
			}
		}
		return out
	}

	var reps []*simRep
	var est Estimate // of the replicas
	var shares []int
	cands := func(rs []*simRep) []*candidate {
		out := make([]*candidate, len(rs))
		for i, r := range rs {
			out[i] = r.c
		}
		return out
	}
	stuck := false // the replicas' caps do not cover the step: replan
	refresh := func() {
		est, shares = Estimate{}, nil
		used = 0
		for _, r := range reps {
			for _, i := range r.ids {
				used += peers[i].GFLOPS * 1e9
			}
		}
		stuck = false
		if len(reps) > 0 {
			shares = pl.shares(cands(reps))
			est = pl.estimate(cands(reps), shares)
			stuck = shares == nil
		}
	}
	held := func() int {
		n := 0
		for _, r := range reps {
			n += len(r.ids)
		}
		return n
	}
	heldCount := 0
	// adopt makes cs the plan: every replica from scratch, as the coordinator's new plan is.
	refillUntil := 0.0        // when the last refill was ready: until then its takers need their givers
	var droppedCuts [][]int   // the cuts of outer-mode replicas dropped since the plan began (refill)
	var droppedIdx []int      // and their indices
	var droppedN []int        // and their shares of micro-batches
	var growWait GrowDeferral // a grow that waits to repay its stall (growwait.go)
	adopt := func(cs []*candidate) {
		growWait.Forget() // a new plan: what a grow would add is weighed again from it
		droppedCuts, droppedIdx, droppedN = nil, nil, nil
		for _, r := range reps {
			for _, i := range r.ids {
				holder[i] = nil
			}
		}
		reps = nil
		for k, c := range cs {
			r := &simRep{c: c, index: k}
			for _, q := range c.peers {
				i := byID[q.ID]
				r.ids = append(r.ids, i)
				holder[i] = r
			}
			reps = append(reps, r)
		}
		heldCount = held()
	}
	// shardSeconds is the longest a stage of cs takes to move its shard (weights and AdamW's
	// moments; in outer mode its replica's and the global state, StateBytesPerParam) over its
	// peer's link: a checkpoint's upload, or a restore's download.
	shards := func(cs []*candidate) []ShardMove {
		var out []ShardMove
		for _, c := range cs {
			for i, q := range c.peers {
				out = append(out, ShardMove{Params: pl.params[c.cuts[i]*W+c.cuts[i+1]], BytesPerS: q.LinkBytesPerS, PerParam: cfg.Options.StateBytesPerParam()})
			}
		}
		return out
	}
	shardSeconds := func(cs []*candidate) float64 { return ShardSeconds(shards(cs)) }
	// sameShape: replicas of the same cuts, in any order, whoever holds them.
	sameShape := func(a, b []*candidate) bool {
		key := func(cs []*candidate) []string {
			out := make([]string, len(cs))
			for i, c := range cs {
				out[i] = fmt.Sprint(c.cuts)
			}
			slices.Sort(out)
			return out
		}
		return slices.Equal(key(a), key(b))
	}
	samePlan := func(a, b []*candidate) bool {
		return slices.EqualFunc(a, b, func(x, y *candidate) bool {
			return slices.Equal(x.cuts, y.cuts) && slices.EqualFunc(x.peers, y.peers, func(p, q Peer) bool { return p.ID == q.ID })
		})
	}
	// handover is, when cs can be taken up from cur without a checkpoint (Change.PeerState: step
	// mode, every stage of cs on the peer holding it now or handed over block by block by keepers
	// — stages that stay on the blocks they hold — or, with handBack and without one, by holders
	// cs leaves out, as the coordinator's growable: Givers), the longest the handovers take — each
	// giver sends each of its takers its part of the stage's state over its uplink, one after
	// another, and each taker receives its parts over its own — and the givers that stand by
	// after; -1 when cs cannot be taken up so.
	handover := func(cs, cur []*candidate, handBack bool) (float64, []string) {
		if outer {
			return -1, nil
		}
		held := map[string][2]int{}
		links := map[string]float64{}
		for _, c := range cur {
			for i, q := range c.peers {
				held[q.ID] = [2]int{c.cuts[i], c.cuts[i+1]}
				links[q.ID] = q.LinkBytesPerS
			}
		}
		var next []HeldStage
		var takerLink []float64
		for _, c := range cs {
			for i, q := range c.peers {
				next = append(next, HeldStage{Peer: q.ID, Begin: c.cuts[i], End: c.cuts[i+1]})
				takerLink = append(takerLink, q.LinkBytesPerS)
			}
		}
		from, ok := Givers(held, next, handBack, MaxGive)
		if !ok {
			return -1, nil
		}
		given := map[string]float64{} // seconds of sending, by giver
		longest, takers := 0.0, 0
		for k, st := range next {
			parts, ok := from[st.Peer]
			if !ok {
				continue
			}
			taken := 0.0
			for _, p := range parts {
				bytes := LoadBytesPerParam * pl.params[p.Begin*W+p.End]
				given[p.Giver] += bytes / links[p.Giver]
				taken += bytes
				longest = max(longest, given[p.Giver])
			}
			longest = max(longest, taken/takerLink[k])
			takers++
		}
		if takers == 0 {
			return -1, nil
		}
		return longest, StandbyGivers(next, from)
	}
	// heldBlocks is, by peer, the blocks it holds in the running plan.
	heldBlocks := func() map[string][2]int {
		out := map[string][2]int{}
		for _, c := range cands(reps) {
			for i, q := range c.peers {
				out[q.ID] = [2]int{c.cuts[i], c.cuts[i+1]}
			}
		}
		return out
	}
	var planTimes []float64
	// plan is PlanReplicas' search over all live peers, as the coordinator's planner runs it.
	plan := func() []*candidate {
		sorted, err := checkPeers(live())
		if err != nil {
			panic(fmt.Sprintf("sched: the simulator's own peers: %v", err)) // a bug
		}
		t0 := clock()
		out := pl.extend(nil, sorted)
		planTimes = append(planTimes, clock()-t0)
		return out
	}
	// The first plan, loaded before the clock starts.
	first := plan()
	if len(first) == 0 {
		sorted, _ := checkPeers(live())
		return SimResult{}, fmt.Errorf("first plan: %w", noPlan(prof, sorted, M, len(sorted)))
	}
	adopt(first)
	refresh()
	for _, c := range cfg.Mix {
		res.Classes = append(res.Classes, SimClass{Name: c.Name})
	}
	for i, p := range peers {
		if p.JoinS > 0 {
			continue
		}
		k := slices.IndexFunc(res.Classes, func(c SimClass) bool { return c.Name == p.Class })
		c := &res.Classes[k]
		g := p.GFLOPS * 1e9
		c.Peers++
		c.FLOPS += g
		if capableOf(i) {
			c.CapablePeers++
			c.CapableFLOPS += g
		}
		if holder[i] != nil {
			c.UsedPeers++
			c.UsedFLOPS += g
		}
	}
	res.Initial = est
	if fleet > 0 {
		res.InitialGoodput = est.FLOPsPerS / fleet
	}
	if capable > 0 {
		res.InitialGoodputCapable = est.FLOPsPerS / capable
	}

	end := cfg.Hours * 3600
	H, CE := float64(opt.Every), float64(max(cfg.CheckpointEvery, 0))
	// A round (coordinator/round.go) is at most simMaxRoundSteps steps, and ends at an outer step;
	// joins are weighed between rounds (outer mode) or steps.
	roundLen := func() float64 {
		if !outer {
			return 1
		}
		return min(H, float64(RoundSteps(est.StepSeconds)))
	}
	cursor, paused := 0.0, 0.0
	loading := false   // the pause is a plan loading its shards (not a reshare's wait)
	restoring := false // that plan restores every shard from a checkpoint (not a grow's handover)
	var steps, tokens, useful, synced float64
	var fleetInt, capInt, usedInt, repInt, standbyInt float64
	snapshot := func() simSnapshot {
		sn := simSnapshot{steps: steps, tokens: tokens, useful: useful, synced: synced}
		for _, r := range reps {
			sn.work = append(sn.work, r.work)
		}
		return sn
	}
	ck := snapshot() // the job's start: its seed is its first checkpoint
	res.ReplicasMin = math.MaxInt
	liveCount := 0
	for _, on := range alive {
		if on {
			liveCount++
		}
	}
	// advance moves the clock to `to`: the replicas progress at the estimate's rate outside
	// stalls, synchronise at every outer step and are checkpointed every CheckpointEvery steps.
	advance := func(to float64) {
		dt := to - cursor
		if dt <= 0 {
			return
		}
		fleetInt += fleet * dt
		capInt += capable * dt
		usedInt += used * dt
		repInt += float64(len(reps)) * dt
		standbyInt += float64(liveCount-heldCount) * dt
		if active := to - max(cursor, paused); est.StepSeconds > 0 && active > 0 {
			s := active / est.StepSeconds
			n := float64(microBatches(shares)) // M, or with own batches Σ n_r
			// Once the job has restored, the coordinator checkpoints at Young's interval too
			// (churnCheckpointDue): its cost a checkpoint's upload, its rate the restores so far.
			churnCE := math.Inf(1)
			if res.Restores > 0 && cursor > 0 {
				tau := CheckpointInterval(max(shardSeconds(cands(reps)), 1), float64(res.Restores)/cursor)
				churnCE = max(tau, simMinCheckpointGap) / est.StepSeconds
			}
			for s > 0 {
				next := math.Inf(1) // the next outer step or checkpoint, in steps
				if outer {
					next = (math.Floor(steps/H) + 1) * H
				}
				if CE > 0 {
					next = min(next, (math.Floor(steps/CE)+1)*CE)
				}
				next = min(next, max(ck.steps+churnCE, steps))
				ds, reached := s, s >= next-steps
				if reached {
					ds = next - steps
				}
				if outer {
					for k, r := range reps {
						r.work += ds * float64(shares[k])
					}
				} else {
					synced += (math.Floor(steps+ds) - math.Floor(steps)) * n * pl.flops
				}
				useful += ds * n * pl.flops
				tokens += ds * n * float64(prof.Tokens)
				steps += ds
				s -= ds
				if !reached {
					break
				}
				steps = next
				if outer && math.Mod(steps, H) == 0 {
					for _, r := range reps {
						synced += r.work * pl.flops
						r.sent, r.work = r.work, 0
					}
				}
				if CE > 0 && math.Mod(steps, CE) == 0 || steps >= ck.steps+churnCE {
					ck = snapshot()
				}
			}
		}
		cursor = to
	}
	// exchanging reports whether the outer exchange is under way, a departed replica's
	// contribution in flight: the exposed synchronisation at the end of each outer period, or with
	// a delay the whole exchange from the outer step on, beside the next inner steps — the
	// survivors then take the step again without the departed replica (Decide: a delayed outer
	// step has two phases too).
	exchanging := func() bool {
		if !outer || est.StepSeconds <= 0 {
			return false
		}
		if opt.Delay > 0 {
			return math.Mod(steps, H) < (est.SyncSeconds+est.HiddenSeconds)*H/est.StepSeconds
		}
		return math.Mod(steps, H)/H >= 1-est.SyncSeconds/est.StepSeconds
	}
	// membership is the plan as the rule book sees it at time now: a replan's stall is loading,
	// the rest a step or round in flight (the coordinator's own work between rounds is brief).
	membership := func(now float64) Membership {
		// A simulated plan's load restores every shard from the checkpoint (no handovers): a
		// step-mode replica lost meanwhile is left out and its first step rerouted.
		m := Membership{Sync: opt.Sync, Phase: PhaseTraining, LoadReroutes: true}
		for k, r := range reps {
			mr := MemberReplica{Index: k}
			for _, i := range r.ids {
				mr.Peers = append(mr.Peers, peers[i].ID)
			}
			m.Replicas = append(m.Replicas, mr)
		}
		if paused > now {
			m.Phase = PhaseLoading
			m.Restoring = restoring
			if !loading {
				m.Phase = PhaseBoundary // a reshare's wait: the survivors hold their state
			}
		} else if opt.Delay == 0 && exchanging() {
			m.Phase = PhaseExchange // an outer step exchanged, not yet committed
		}
		return m
	}
	// replan adopts a fresh plan over the live peers at time now, stalled for stall seconds more
	// than its shards take to load: every stage restores its whole shard from the checkpoint, and
	// a plan still loading is abandoned. Outer mode's replica k continues from work[k], its state
	// by index; any beyond start anew. It returns the time it adds to the job's stalls, within the
	// run.
	replan := func(now, stall float64, cs []*candidate, work []float64) float64 {
		before := min(max(paused, now), end)
		adopt(cs)
		for k, r := range reps {
			if k < len(work) {
				r.work = work[k]
			}
		}
		for i := range fresh {
			fresh[i] = false
		}
		paused = now + stall + shardSeconds(cs)
		loading, restoring = true, true
		res.Replans++
		refresh()
		return min(paused, end) - before
	}
	// restore is the rule book's Restore at time now: back to the newest complete checkpoint,
	// then a fresh plan after the departure is noticed. From the job's first restore on, the
	// planner weighs plans by their goodput under the fleet's churn (sched.Churn), as the
	// coordinator does once it has seen departures, a restore costing what the ones so far did
	// (the progress rolled back and the stall).
	var restoreStall float64
	restore := func(now float64) {
		res.Restores++
		lost := 0.0
		if est.FLOPsPerS > 0 {
			lost = (useful - ck.useful) / est.FLOPsPerS
			res.RestoreLostSeconds += lost
		}
		if !cfg.PlanForSpeed && cfg.MeanLifetimeSeconds > 0 {
			// This restore's stall is not known until its plan is made: the ones before it stand.
			cost := lost + cfg.DetectSeconds + shardSeconds(cands(reps))
			if res.Restores > 1 {
				cost = (res.RestoreLostSeconds + restoreStall) / float64(res.Restores-1)
			}
			pl.opt.Churn = Churn{PerPeerRate: 1 / cfg.MeanLifetimeSeconds, RestoreSeconds: cost}
		}
		steps, tokens, useful, synced = ck.steps, ck.tokens, ck.useful, ck.synced
		stall := replan(now, cfg.DetectSeconds, plan(), ck.work)
		restoreStall += stall
		res.StallSeconds += stall
	}
	// drop takes replica r out of the plan, its work lost (FLOPs) wasted; its peers stand by.
	drop := func(r *simRep, lost float64) {
		useful -= lost
		if est.FLOPsPerS > 0 {
			res.LostSeconds += lost / est.FLOPsPerS
		}
		for _, k := range r.ids {
			holder[k] = nil
		}
		reps = slices.DeleteFunc(reps, func(x *simRep) bool { return x == r })
		heldCount = held()
	}
	// dropOut is drop in outer mode, where a refill may staff the replica again: its cuts, index
	// and share (the coordinator's dropped replica, whose n a refill's takers must hold) are kept.
	dropOut := func(r *simRep, lost float64) {
		n := 1
		if k := slices.Index(reps, r); k >= 0 && k < len(shares) {
			n = shares[k]
		}
		drop(r, lost)
		droppedCuts = append(droppedCuts, r.c.cuts)
		droppedIdx = append(droppedIdx, r.index)
		droppedN = append(droppedN, n)
	}
	tookOverAt := -1.0 // the step of the last stage takeover: one per step
	// redoUntil is when the outer exchange the survivors took again after a departure ends: a
	// departure before then cuts that exchange too, and it starts again without that replica as
	// well (the coordinator's redo after a redo; a cascade when replicas leave every few seconds).
	redoUntil := math.Inf(-1)
	leave := func(now float64, i int) {
		setAlive(i, false)
		liveCount--
		fresh[i] = false
		r := holder[i]
		if r == nil {
			return // the rule book: it held nothing, keep going
		}
		res.ReplicaLeaves++
		m := membership(now)
		d := Decide(m, Change{Left: peers[i].ID})
		switch d.Action {
		case DropReplica:
			res.Drops++
			redoing := outer && now < redoUntil
			if m.Phase == PhaseExchange || redoing && opt.Delay == 0 {
				// Nobody applied the outer step: the survivors take it on without the replica,
				// once its departure is noticed (its round is wasted). The exchange goes on
				// (client/outerx.go): what it adds is the lost replica's segments, averaged
				// again by the survivors they go to (lostSegment).
				res.ExchangeRedos++
				if redoing {
					res.RedosCut++
				}
				dropOut(r, r.work*pl.flops)
				before := min(max(paused, now), end)
				if paused <= now {
					loading = false
				}
				// Each departure's segments go to survivors of their own, who average them
				// beside the rest: the exchange ends when the last of them is done.
				extra := lostSegment(len(reps)+1) * est.SyncSeconds * H
				paused = max(paused, now+cfg.QuickDetectSeconds+extra)
				redoUntil = max(redoUntil, paused)
				res.StallSeconds += min(paused, end) - before
				refresh()
				return
			}
			if m.Phase == PhaseLoading {
				// A restore's plan loading: the others load on without it.
				dropOut(r, r.work*pl.flops)
				refresh()
				return
			}
			if exchanging() && m.Phase != PhaseBoundary || redoing {
				// A delayed outer step not yet committed: the survivors take it again without the
				// replica's contribution (which the step no longer counts) beside their training,
				// once its departure is noticed; they wait only for what of the redo outlasts the
				// steps left before the take-up. (At a boundary — a refill getting ready — nobody
				// exchanges.)
				res.ExchangeRedos++
				if redoing {
					res.RedosCut++
				}
				synced -= r.sent * pl.flops
				dropOut(r, r.work*pl.flops)
				left := max(float64(opt.Delay)-math.Mod(steps, H), 0) * est.StepSeconds
				// The exchange goes on beside training (client/outerx.go): what is left of it,
				// or the departure's detection if that is longer, and the lost replica's
				// segments again.
				whole := (est.SyncSeconds + est.HiddenSeconds) * H
				rest := max(whole-math.Mod(steps, H)*est.StepSeconds, cfg.QuickDetectSeconds)
				done := rest + lostSegment(len(reps)+1)*whole
				redoUntil = max(redoUntil, now+done)
				if wait := done - left; wait > 0 {
					before := min(max(paused, now), end)
					if paused <= now {
						loading = false
					}
					paused = max(paused, now+wait)
					res.StallSeconds += min(paused, end) - before
				}
				refresh()
				return
			}
			// The replica's inner steps since the last outer synchronisation are wasted.
			dropOut(r, r.work*pl.flops)
			if outer && paused <= now && est.StepSeconds > 0 {
				// Every replica stands still at the round's end until all have finished it: when
				// that comes before the departure is noticed, they wait there for it (the
				// coordinator hastens the round's workers from its end on: QuickDetectSeconds).
				// The stall is taken from now, the same progress lost.
				rl := roundLen()
				toEnd := (math.Floor(steps/rl)+1)*rl - steps
				if wait := cfg.QuickDetectSeconds - toEnd*est.StepSeconds; wait > 0 {
					res.BarrierWaits++
					loading = false
					paused = now + wait
					res.StallSeconds += min(paused, end) - now
				}
			}
			if m.Phase == PhaseBoundary && refillUntil > now {
				// A refill getting ready: the replicas whose stages were to take their state
				// from the departed peer have nothing to start from, and go too.
				for _, t := range slices.Clone(reps) {
					if slices.Contains(t.givers, peers[i].ID) {
						res.Drops++
						dropOut(t, t.work*pl.flops)
					}
				}
			}
			refresh()
		case Reroute:
			// The replicas beside it compute its micro-batches of the step in flight too: what
			// it had computed of them is lost, and the step waits for the departure to be
			// noticed (the coordinator hastens a step's workers: QuickDetectSeconds) as far as
			// that outlasts the survivors' own part of it. While the plan loads no step is in
			// flight: the others load on without it.
			res.Reroutes++
			k := slices.Index(reps, r)
			if k >= len(shares) {
				// The replicas' caps did not cover the step (stuck, waiting for the tick's
				// replan): no step was in flight, so nothing of it is lost.
				drop(r, 0)
				refresh()
				return
			}
			frac := steps - math.Floor(steps)
			if wait := cfg.QuickDetectSeconds - (1-frac)*est.StepSeconds; paused <= now && wait > 0 {
				res.BarrierWaits++
				loading = false
				paused = now + wait
				res.StallSeconds += min(paused, end) - now
			}
			n, share := float64(microBatches(shares)), float64(shares[k])
			tokens -= frac * share * float64(prof.Tokens)
			steps -= frac * share / n
			// A stage taken over (the coordinator's takeoverOf: the step's first departure,
			// replicas of two stages or more cut alike) loses only that stage's work of the
			// step; the taker's extra leg takes as long as the replicas' would have.
			lost := pl.flops
			if st := slices.Index(r.ids, i); math.Floor(steps) != tookOverAt && st >= 0 && cutAlike(reps) {
				tookOverAt = math.Floor(steps)
				lost = pl.cost[r.c.cuts[st]*(pl.L+1)+r.c.cuts[st+1]].FLOPs
				res.Takeovers++
			}
			drop(r, frac*share*lost)
			refresh()
		case Reshare:
			res.Reshares++
			frac := steps - math.Floor(steps)
			n := float64(microBatches(shares))
			tokens -= frac * n * float64(prof.Tokens)
			steps = math.Floor(steps)
			drop(r, frac*n*pl.flops) // the step in flight
			before := min(max(paused, now), end)
			if paused <= now {
				loading = false
			}
			paused = max(paused, now+cfg.DetectSeconds)
			res.StallSeconds += min(paused, end) - before
			refresh()
		case KeepGoing:
		default:
			restore(now)
		}
	}

	// refill is, in outer mode, the replicas that staff again every replica dropped since the plan
	// began, each with its cuts, on the live peers holding nothing (fastest first, each stage on
	// the first whose memory holds it), and the longest the handovers take: each stage's givers —
	// holders of its blocks in replicas that stayed (Cover) — send its takers the global θ (4 bytes a
	// parameter; the momentum follows while they train, OuterGrowStall) one after another over its
	// uplink, and each taker receives over its own, as the coordinator's outerGrowable does. nil
	// when they cannot all be staffed.
	// holdersOf is the running replicas' stages, in replica order: who can give a new stage of
	// their blocks the global θ and the outer momentum (a refill's, an extension's).
	holdersOf := func(rs []*simRep) []HeldStage {
		var out []HeldStage
		for _, r := range rs {
			for k, q := range r.c.peers {
				out = append(out, HeldStage{Peer: q.ID, Begin: r.c.cuts[k], End: r.c.cuts[k+1]})
			}
		}
		return out
	}
	// coverFrom is the handovers of the global θ of blocks [b, e) to taker q from holders, as
	// the coordinator chooses them (Cover: each block from a holder of it, the one covering most
	// of what is left, the one that has given least among equals), and its givers; false when
	// some block has none.
	coverFrom := func(holders []HeldStage, given map[string]int, b, e int, q Peer) ([]Handover, []string, bool) {
		parts := Cover(holders, b, e, given, MaxGive)
		if parts == nil {
			return nil, nil, false
		}
		W := pl.L + 1
		var hs []Handover
		for _, p := range parts {
			g := peers[byID[p.Giver]]
			hs = append(hs, Handover{Giver: p.Giver, Taker: q.ID, Bytes: OuterHandoverBytes(int64(pl.params[p.Begin*W+p.End])),
				GiverBytesPerS: g.LinkBytesPerS, TakerBytesPerS: q.LinkBytesPerS})
		}
		return hs, GiversOf(parts), true
	}
	// gainOf is what plan grown adds to base, as a fraction of base's objective (ReplicasGain's,
	// on the simulator's candidates).
	gainOf := func(base, grown []*candidate) float64 {
		a, b := pl.objective(base), pl.objective(grown)
		switch {
		case a > 0:
			return b/a - 1
		case b > 0:
			return math.Inf(1)
		}
		return 0
	}

	// takeUp makes the new replicas cs, at indices, each stage taking the global θ and the outer
	// momentum from holders of its blocks (coverFrom: an outer-mode grow's handovers); nil when a
	// block has no giver. It returns them and the handovers.
	takeUp := func(cs []*candidate, indices []int, holders []HeldStage) ([]*simRep, []Handover) {
		given := map[string]int{}
		var hs []Handover
		var out []*simRep
		for n, c := range cs {
			r := &simRep{c: c, index: indices[n]}
			for k, q := range c.peers {
				h, gs, ok := coverFrom(holders, given, c.cuts[k], c.cuts[k+1], q)
				if !ok {
					return nil, nil
				}
				hs = append(hs, h...)
				r.ids = append(r.ids, byID[q.ID])
				r.givers = append(r.givers, gs...)
			}
			out = append(out, r)
		}
		return out, hs
	}
	// extend is, in outer mode with own batches, the coordinator's outerExtend: new replicas from
	// the live peers holding nothing, beside the running ones, when they raise the objective
	// (AddReplicas' extend), at least as many as were dropped since the plan began (they take
	// those indices), each stage taking the global θ and the outer momentum from a holder of its
	// blocks; and the longest the handovers take. nil when none pays or cannot be staffed so.
	// With a delay the coordinator takes it at the boundary after the pending outer step's
	// take-up (its round ends there), which this coarse clock does not tell from the round's end.
	extend := func() ([]*simRep, float64, float64) {
		if !outer || !opt.OwnBatches || len(reps) == 0 {
			return nil, -1, 0
		}
		sorted, err := checkPeers(live())
		if err != nil {
			return nil, -1, 0
		}
		free := slices.DeleteFunc(sorted, func(q Peer) bool { return holder[byID[q.ID]] != nil })
		base := cands(reps)
		chosen := pl.extend(base, free)
		if len(chosen) <= len(base) || len(chosen)-len(base) < len(droppedCuts) || !(pl.objective(chosen) > pl.objective(base)) {
			return nil, -1, 0
		}
		// The new replicas' indices: the dropped replicas' first, then past the highest.
		indices := slices.Sorted(slices.Values(droppedIdx))
		top := -1
		for _, r := range reps {
			top = max(top, r.index)
		}
		for _, i := range indices {
			top = max(top, i)
		}
		for len(indices) < len(chosen)-len(base) {
			top++
			indices = append(indices, top)
		}
		out, hs := takeUp(chosen[len(base):], indices, holdersOf(reps))
		if out == nil {
			return nil, -1, 0
		}
		return out, HandoverSeconds(hs), gainOf(base, chosen)
	}
	// reshape is the planner's plan cs taken up at a boundary without a checkpoint (outer mode,
	// own batches; the coordinator's outerReshape): every replica of cs that runs now, alike (the same peers over the same cuts),
	// keeps its state and index; each other replica of cs is new, its stages taking the global θ
	// and the outer momentum from a holder of their blocks in a kept replica, as a grow's do; the
	// running replicas cs does not keep leave it at the boundary, their indices taken by the new
	// ones (so there must be at least as many new replicas as indices freed). The result is cs's
	// replicas, kept first, the longest the handovers take, and what cs adds to the running plan.
	reshape := func(cs []*candidate) ([]*simRep, float64, float64) {
		if !outer || !opt.OwnBatches || len(reps) == 0 || len(cs) == 0 {
			return nil, -1, 0
		}
		key := func(c *candidate) string {
			var b strings.Builder
			fmt.Fprint(&b, c.cuts)
			for _, q := range c.peers {
				b.WriteString(" " + q.ID)
			}
			return b.String()
		}
		running := map[string]*simRep{}
		for _, r := range reps {
			running[key(r.c)] = r
		}
		var fresh []*candidate
		var kept []*simRep
		for _, c := range cs {
			if r := running[key(c)]; r != nil {
				kept = append(kept, r)
				continue
			}
			fresh = append(fresh, c)
		}
		// A kept replica keeps its index, so it must be one of cs's 0..len(cs)−1; one that is not
		// starts afresh as a new replica would.
		inUse := map[int]bool{}
		kept = slices.DeleteFunc(kept, func(r *simRep) bool {
			if r.index >= len(cs) {
				fresh = append(fresh, r.c)
				return true
			}
			inUse[r.index] = true
			return false
		})
		if len(kept) == 0 || len(fresh) == 0 {
			return nil, -1, 0
		}
		var free []int
		for i := range len(cs) {
			if !inUse[i] {
				free = append(free, i)
			}
		}
		added, hs := takeUp(fresh, free, holdersOf(kept))
		if added == nil {
			return nil, -1, 0
		}
		res := append(slices.Clone(kept), added...)
		gain := gainOf(cands(reps), cs)
		if !(gain > 0) {
			return nil, -1, 0 // a checkpoint and replan, weighed as one
		}
		return res, HandoverSeconds(hs), gain
	}
	refill := func() ([]*simRep, float64, float64) {
		if !outer || len(droppedCuts) == 0 {
			return nil, -1, 0
		}
		var free []int
		for i, on := range alive {
			if on && holder[i] == nil {
				free = append(free, i)
			}
		}
		slices.SortStableFunc(free, func(a, b int) int { return cmp.Compare(peers[b].GFLOPS, peers[a].GFLOPS) })
		holders := holdersOf(reps)
		given := map[string]int{}
		var hs []Handover
		used := map[int]bool{}
		var out []*simRep
		for d, cuts := range droppedCuts {
			c := &candidate{cuts: cuts}
			r := &simRep{c: c, index: droppedIdx[d]}
			for k := 0; k+1 < len(cuts); k++ {
				b := [2]int{cuts[k], cuts[k+1]}
				// The fastest free peer whose memory holds the stage at the dropped replica's
				// share, at depth 0, as the coordinator's refill checks (outerGrowable).
				taker := -1
				for _, i := range free {
					if !used[i] && pl.memory(b[0], b[1], k, len(cuts)-1, droppedN[d], 0) <= float64(peers[i].MemoryBytes) {
						taker = i
						break
					}
				}
				if taker < 0 {
					return nil, -1, 0
				}
				h, gs, ok := coverFrom(holders, given, b[0], b[1], peers[taker].Peer)
				if !ok {
					return nil, -1, 0
				}
				used[taker] = true
				c.peers = append(c.peers, peers[taker].Peer)
				r.ids = append(r.ids, taker)
				hs = append(hs, h...)
				r.givers = append(r.givers, gs...)
			}
			if !pl.finish(c, 1, pl.most) {
				return nil, -1, 0
			}
			out = append(out, r)
		}
		return out, HandoverSeconds(hs), gainOf(cands(reps), append(cands(reps), cands(out)...))
	}
	lastJoinReplan := math.Inf(-1)
	lastBoundary := 0.0
	next := 0
	nextSample := 0.0
	sample := func(now float64) {
		g := 0.0
		if fleet > 0 && paused <= now {
			g = est.FLOPsPerS / fleet
		}
		res.Samples = append(res.Samples, SimSample{Hours: now / 3600, Live: liveCount, Replicas: len(reps),
			Standby: liveCount - heldCount, StepS: est.StepSeconds, TokensPerS: est.TokensPerS, Goodput: g})
	}
	for t0 := 0.0; t0 < end; t0 += cfg.TickSeconds {
		t1 := min(t0+cfg.TickSeconds, end)
		for ; next < len(events) && events[next].t < t1; next++ {
			e := events[next]
			if e.t >= end {
				break
			}
			advance(e.t)
			if e.join {
				setAlive(e.peer, true)
				fresh[e.peer] = true
				liveCount++
				res.Joins++
			} else if alive[e.peer] {
				res.Leaves++
				leave(e.t, e.peer)
			}
		}
		advance(t1)
		now := t1
		res.ReplicasMin = min(res.ReplicasMin, len(reps))
		res.ReplicasMax = max(res.ReplicasMax, len(reps))
		if now >= nextSample {
			sample(now)
			nextSample += end / float64(cfg.Samples)
		}
		if now >= end {
			break
		}
		if stuck || len(reps) == 0 {
			// The replicas left cannot run the step (or none is left): the next plan waits for
			// the peers to allow one.
			if cs := plan(); len(cs) > 0 {
				res.ReplanStallSeconds += replan(now, 0, cs, nil)
			}
			continue
		}
		// Joins, weighed at a step boundary (a round's, in outer mode) by the rule book: the
		// coordinator asks its planner for a plan over everyone, and when it differs takes a
		// checkpoint of the step (every stage uploads its shard) and replans from it.
		boundary := math.Floor(steps / roundLen())
		joined := 0
		for _, f := range fresh {
			if f {
				joined++
			}
		}
		// Outer mode staffs its dropped replicas again from peers standing by too (the
		// coordinator's refillDue), not only from fresh ones.
		if refillable := outer && len(droppedCuts) > 0 && liveCount > heldCount; (joined == 0 && !refillable && !growWait.Waiting()) || boundary == lastBoundary || paused > now {
			continue
		}
		lastBoundary = boundary
		c := Change{Joined: max(joined, 1), JoinGapElapsed: now-lastJoinReplan >= cfg.JoinGapSeconds}
		var cs []*candidate
		var added, reshaped []*simRep
		hand := -1.0
		var handedBack []string // the holders that hand their stages back and stand by (HandedBack)
		replanning := false     // the planner's plan needs a checkpoint and replan, weighed (ReplanWaits)
		if c.JoinGapElapsed {
			cs = plan()
			takenUp := func(cs []*candidate) bool { h, _ := handover(cs, cands(reps), false); return h >= 0 }
			if !outer && !samePlan(cs, cands(reps)) && !takenUp(cs) {
				// Step mode: the planner's plan with its peers moved so that holders stay on
				// their blocks, when that makes it the running plan or one taken up from twins
				// (the coordinator's keepHolders).
				held := heldBlocks()
				sorted, _ := checkPeers(live()) // as plan() has them, which checked them already
				if moved, ok := pl.keepHolders(cs, held, sorted); ok {
					// Every stage on its holder, as many as now: the running plan, whatever
					// the shares or the replicas' order (the coordinator's allHeld).
					same, n := true, 0
					for _, c := range moved {
						for i, q := range c.peers {
							b, ok := held[q.ID]
							same = same && ok && b == [2]int{c.cuts[i], c.cuts[i+1]}
							n++
						}
					}
					if same && n == len(held) {
						cs = cands(reps)
						res.HoldersKept++
					} else if takenUp(moved) {
						cs = moved
						res.HoldersKept++
					}
				}
			}
			// Outer mode keeps a plan of the running one's shape whoever would staff it, and
			// staffs its dropped replicas again when the planner too would run that shape (the
			// coordinator's joinPending).
			c.PlanKept = len(cs) == 0 || samePlan(cs, cands(reps)) || outer && sameShape(cs, cands(reps))
			if !c.PlanKept {
				// A refill or an extension holds every replica for its handovers: it waits until
				// what it adds has repaid that (GrowDeferral), its joiners standing by.
				round := roundLen() * est.StepSeconds
				// takes says whether a grow found (ok) is taken: not when a checkpoint and replan
				// to the planner's plan beats it outright (ReplanDominates), as the coordinator
				// weighs them.
				takes := func(ok bool, h, gain float64) bool {
					return ok && !(len(cs) > 0 && ReplanDominates(gain, OuterGrowStall(h, round), gainOf(cands(reps), cs), ReplanSeconds(shards(cands(reps)), shards(cs))))
				}
				if add, h, gain := refill(); takes(add != nil && sameShape(cs, append(cands(reps), cands(add)...)), h, gain) {
					h = OuterGrowStall(h, round)
					added, hand, c.PeerState = add, h, true
					c.GrowWaits = !growWait.Due(now, gain, h, round)
				} else if add, h, gain := extend(); takes(add != nil, h, gain) {
					h = OuterGrowStall(h, round)
					added, hand, c.PeerState = add, h, true
					c.GrowWaits = !growWait.Due(now, gain, h, round)
				} else if rs, h, gain := reshape(cs); takes(rs != nil, h, gain) {
					h = OuterGrowStall(h, round)
					reshaped, hand, c.PeerState = rs, h, true
					c.GrowWaits = !growWait.Due(now, gain, h, round)
				} else {
					if joined > 0 {
						hand, handedBack = handover(cs, cands(reps), true)
						c.PeerState = hand >= 0
					}
					if c.PeerState {
						growWait.Forget()
					} else {
						// A checkpoint and replan of everyone: weighed as a grow is.
						replanning = true
						c.ReplanWaits = !growWait.ReplanDue(now, gainOf(cands(reps), cs), ReplanSeconds(shards(cands(reps)), shards(cs)), round)
						if c.ReplanWaits {
							res.ReplansWaited++
						}
					}
				}
				if c.GrowWaits {
					res.GrowsWaited++
				}
			}
			if joined == 0 && !c.PeerState && !(replanning && !c.ReplanWaits) {
				continue // standbys the planner would not place as the dropped replicas were, nor replan for: no join to weigh
			}
		}
		switch Decide(membership(now), c).Action {
		case Grow:
			if reshaped != nil {
				lastJoinReplan = now
				res.Grows++
				res.Reshapes++
				before := min(max(paused, now), end)
				for _, r := range reps {
					for _, i := range r.ids {
						holder[i] = nil
					}
				}
				reps = reshaped
				for _, r := range reps {
					for _, i := range r.ids {
						holder[i] = r
					}
				}
				heldCount = held()
				droppedCuts, droppedIdx, droppedN = nil, nil, nil
				growWait.Forget()
				for i := range fresh {
					fresh[i] = false
				}
				paused = max(paused, now+hand)
				refillUntil = paused
				loading = false
				res.ReplanStallSeconds += min(paused, end) - before
				refresh()
				break
			}
			if added != nil {
				// The refilled replicas start from the global θ; the others keep their round.
				lastJoinReplan = now
				res.Grows++
				before := min(max(paused, now), end)
				for _, r := range added {
					for _, i := range r.ids {
						holder[i] = r
					}
				}
				reps = append(reps, added...)
				heldCount = held()
				droppedCuts, droppedIdx, droppedN = nil, nil, nil
				for i := range fresh {
					fresh[i] = false
				}
				paused = max(paused, now+hand)
				refillUntil = paused
				loading = false // the survivors hold their state: a departure meanwhile is a boundary's
				res.ReplanStallSeconds += min(paused, end) - before
				refresh()
				break
			}
			// The takers wait for their state, and the others for them: the plan starts when
			// every stage is Ready. Nothing is uploaded, nothing else reloads or replays.
			lastJoinReplan = now
			res.Grows++
			res.HandedBack += len(handedBack)
			before := min(max(paused, now), end)
			adopt(cs)
			for i := range fresh {
				fresh[i] = false
			}
			paused = max(paused, now+hand)
			loading, restoring = true, false
			res.ReplanStallSeconds += min(paused, end) - before
			refresh()
		case Standby:
			for i := range fresh {
				fresh[i] = false
			}
		case CheckpointReplan:
			lastJoinReplan = now
			res.JoinReplans++
			up := shardSeconds(cands(reps))
			ck = snapshot()
			res.ReplanStallSeconds += replan(now, up, cs, ck.work)
		}
	}
	if len(res.Samples) == 0 || res.Samples[len(res.Samples)-1].Hours < cfg.Hours {
		sample(end)
	}

	res.Steps = steps
	res.Tokens = tokens
	res.UsefulFLOPS = useful / end
	res.FleetFLOPS, res.CapableFLOPS, res.UsedFLOPS = fleetInt/end, capInt/end, usedInt/end
	if fleetInt > 0 {
		res.Goodput = useful / fleetInt
		res.GoodputSynchronised = synced / fleetInt
	}
	if capInt > 0 {
		res.GoodputCapable = useful / capInt
	}
	if res.ReplicaLeaves > 0 {
		res.StallPerEvent = (res.StallSeconds + res.LostSeconds + res.RestoreLostSeconds) / float64(res.ReplicaLeaves)
	}
	res.ReplicasMean, res.StandbyMean = repInt/end, standbyInt/end
	res.PlanFirstSeconds = planTimes[0]
	res.PlanCalls, res.PlanMaxSeconds, res.PlanMeanSeconds = stats(planTimes)
	return res, nil
}

// simMinCheckpointGap is the coordinator's minCheckpointGap, in seconds.
const simMinCheckpointGap = 5

func stats(xs []float64) (n int, most, mean float64) {
	for _, x := range xs {
		most = max(most, x)
		mean += x
	}
	if len(xs) > 0 {
		mean /= float64(len(xs))
	}
	return len(xs), most, mean
}

// cutAlike reports whether reps are two replicas or more of two stages or more, all cut alike:
// the plans whose lost stage the coordinator takes over (coordinator/takeover.go).
func cutAlike(reps []*simRep) bool {
	if len(reps) < 2 || len(reps[0].c.cuts) < 3 {
		return false
	}
	for _, r := range reps[1:] {
		if !slices.Equal(r.c.cuts, reps[0].c.cuts) {
			return false
		}
	}
	return true
}
