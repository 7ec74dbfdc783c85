package sched

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// The fleet simulator (issue 13, docs/design.md "Scheduling"): synthetic volunteers join and leave,
// and the real planner (PlanReplicas, AddReplicas, DropReplicas' rule) keeps the job running on
// them. Time advances in ticks; churn events inside a tick are applied at their own time, and
// between events the job progresses at the rate the planner estimates for the replicas then
// running. At tick boundaries (the simulator's step boundaries) loaded replicas start, new peers
// form new replicas, and now and then the whole plan is compared with a fresh one. The planner
// is PlanReplicas' and AddReplicas' own search (replicaPlanner.extend), called on the live peers
// as those would call it; the simulator keeps its replicas as the planner formed them (cuts,
// depth and share cap), which a Plan does not carry.
//
// The model of what churn costs, and its assumptions:
//   - A peer that leaves is noticed after SimConfig.DetectSeconds (the heartbeat timeout). Its
//     replica is dropped until a later AddReplicas or replan; its other peers become standbys.
//   - Step mode: the lost replica's micro-batches of the step in flight are recomputed by the
//     surviving replicas in their tree positions (so the result stays the single process's).
//     The step ends late by the detection time not already covered by the survivors' own work,
//     plus the time the survivors need for the lost share: that is the stall.
//   - Outer mode: the survivors do not wait; the lost replica's inner steps since the last outer
//     synchronisation are left out of the average, wasted. Its stall is that lost work, in
//     seconds of the job's progress.
//   - A new replica loads its stages' weights and Adam moments (LoadBytesPerParam a parameter)
//     over its peers' links, without stopping the others, and starts at the first tick boundary
//     after. A full replan stops the job while the peers whose stage changed load what they did
//     not hold: the largest such load is its stall.
//   - The planner's estimate is the truth here: no noise, no stragglers, no contention beyond a
//     peer's own upload. It has the peers' drawn RTTs (ReplicaOptions.RTTSeconds), so link latency
//     is in every replica's time (see fleet.go), hidden by pipeline depth where memory allows.
//   - When a departure leaves survivors whose share caps (their memory) cannot cover the step,
//     the job waits for a full replan at the next tick.
//   - Own batches (ReplicaOptions.OwnBatches): every running replica trains a batch of its own
//     each step, n_r micro-batches (the slowest M, a faster one as many as it finishes in the
//     slowest's time: replicaPlanner.ownShares, recomputed whenever the running replicas change),
//     so a step's useful work and tokens count Σ n_r micro-batches; a lost replica's wasted inner
//     steps are its n_r micro-batches each. Nothing caps the replicas at M.
//   - Outer mode with a delay (ReplicaOptions.Delay): the job progresses at the estimate's rate,
//     whose exposed synchronisation is what D inner steps of the slowest replica's compute leave
//     of each outer exchange (fleet.go), so a hidden exchange costs no progress and goodput counts
//     it as such. What a departure wastes is unchanged: a replica's inner steps since the last
//     outer round's end, the D steps before it took up that round's result included (they belong
//     to its next pseudo-gradient). As without a delay, a departure during the exchange itself is
//     not modelled: the exchange completes with the replicas that took part.

// PeerClass is one kind of volunteer in a fleet mix. Every range is drawn log-uniformly.
type PeerClass struct {
	Name       string     `json:"name"`
	Share      float64    `json:"share"` // fraction of the fleet
	GFLOPS     [2]float64 `json:"gflops"`
	MemoryGB   [2]float64 `json:"memory_gb"`
	UploadMbps [2]float64 `json:"upload_mbps"`
	RTTms      [2]float64 `json:"rtt_ms"`
}

// DefaultFleetMix is issue 13's mix: browser CPU 1–5 GFLOP/s, browser GPU 50–2,000, native CPU
// 50–400, native GPU 5,000–50,000; upload 10 Mb/s–1 Gb/s, RTT 20–150 ms, memory 1–24 GB. The
// shares and the per-class sub-ranges of memory and upload are this simulator's assumptions: most
// volunteers are browser tabs (which get a few GB, and home uploads); one in ten is a native GPU.
func DefaultFleetMix() []PeerClass {
	return []PeerClass{
		{Name: "browser-cpu", Share: 0.45, GFLOPS: [2]float64{1, 5}, MemoryGB: [2]float64{1, 4}, UploadMbps: [2]float64{10, 100}, RTTms: [2]float64{20, 150}},
		{Name: "browser-gpu", Share: 0.30, GFLOPS: [2]float64{50, 2000}, MemoryGB: [2]float64{1, 8}, UploadMbps: [2]float64{10, 300}, RTTms: [2]float64{20, 150}},
		{Name: "native-cpu", Share: 0.15, GFLOPS: [2]float64{50, 400}, MemoryGB: [2]float64{4, 24}, UploadMbps: [2]float64{20, 1000}, RTTms: [2]float64{20, 150}},
		{Name: "native-gpu", Share: 0.10, GFLOPS: [2]float64{5000, 50000}, MemoryGB: [2]float64{8, 24}, UploadMbps: [2]float64{50, 1000}, RTTms: [2]float64{20, 150}},
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
	// TickSeconds is the time step (10).
	TickSeconds float64
	// DetectSeconds is how long a departure takes to notice (5, the coordinator's heartbeat
	// timeout).
	DetectSeconds float64
	// AddEverySeconds is how often standbys are offered to AddReplicas (60).
	AddEverySeconds float64
	// ReplanEverySeconds is how often the plan is compared with a fresh PlanReplicas (600).
	ReplanEverySeconds float64
	// ReplanThreshold: the plan is replaced when its estimate falls below this fraction of the
	// fresh plan's (0.8), Petals' rule, which keeps moves rare.
	ReplanThreshold float64
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
	Loading    int     `json:"loading"` // replicas loading their stages
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
	Goodput        float64 `json:"goodput"`
	GoodputCapable float64 `json:"goodput_capable"`
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
	// ReplicaLeaves are departures of a peer holding a stage of a running replica: the churn
	// events that cost something. LoadingLosses are departures from a replica still loading.
	ReplicaLeaves int `json:"replica_leaves"`
	LoadingLosses int `json:"loading_losses"`
	// StallSeconds is the time the job stood still for departures (step mode); LostSeconds the
	// work left out of outer averages, in seconds of progress; StallPerEvent their sum per
	// replica leave. ReplanStallSeconds is the time replans stopped the job for loading.
	StallSeconds       float64 `json:"stall_seconds"`
	LostSeconds        float64 `json:"lost_seconds"`
	StallPerEvent      float64 `json:"stall_per_event"`
	ReplanStallSeconds float64 `json:"replan_stall_seconds"`
	Replans            int     `json:"replans"`
	Adds               int     `json:"adds"` // AddReplicas calls that added replicas

	// Replicas and standbys over time: time averages, least and most.
	ReplicasMean float64 `json:"replicas_mean"`
	ReplicasMin  int     `json:"replicas_min"`
	ReplicasMax  int     `json:"replicas_max"`
	StandbyMean  float64 `json:"standby_mean"`

	// Planner times, seconds (0 without SimConfig.Clock): the first plan, and every
	// PlanReplicas and AddReplicas call.
	PlanFirstSeconds float64 `json:"plan_first_seconds"`
	PlanMaxSeconds   float64 `json:"plan_max_seconds"`
	PlanMeanSeconds  float64 `json:"plan_mean_seconds"`
	PlanCalls        int     `json:"plan_calls"`
	AddMaxSeconds    float64 `json:"add_max_seconds"`
	AddMeanSeconds   float64 `json:"add_mean_seconds"`
	AddCalls         int     `json:"add_calls"`

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
	Class  string  `json:"class"`
	RTTms  float64 `json:"rtt_ms"`
	JoinS  float64 `json:"join_s"`
	LeaveS float64 `json:"leave_s"`
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
			LinkBytesPerS: logU(c.UploadMbps[0], c.UploadMbps[1]) * 1e6 / 8},
			Class: c.Name, RTTms: logU(c.RTTms[0], c.RTTms[1]), JoinS: at, LeaveS: at + r.ExpFloat64()*meanLifetime}
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
	c       *candidate
	ids     []int // indices of its peers
	readyAt float64
	// work is the micro-batches it computed since the last outer synchronisation (or since it
	// started): what an outer average loses with it.
	work float64
}

type simEvent struct {
	t    float64
	join bool
	peer int
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
	def(&cfg.AddEverySeconds, 60)
	def(&cfg.ReplanEverySeconds, 600)
	def(&cfg.ReplanThreshold, 0.8)
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
	case cfg.TickSeconds < 0 || cfg.DetectSeconds < 0 || cfg.ReplanThreshold < 0 || cfg.ReplanThreshold > 1:
		return SimResult{}, fmt.Errorf("%w: tick %v s, detect %v s, replan threshold %v", ErrBadInput, cfg.TickSeconds, cfg.DetectSeconds, cfg.ReplanThreshold)
	}
	if err := opt.validate(prof.NumBlocks()); err != nil {
		return SimResult{}, err
	}
	clock := cfg.Clock
	if clock == nil {
		clock = func() float64 { return 0 }
	}
	peers := Fleet(cfg.Mix, cfg.Peers, cfg.Hours, cfg.MeanLifetimeSeconds, cfg.Seed)
	if opt.RTTSeconds == nil {
		opt.RTTSeconds = make(map[string]float64, len(peers))
		for _, p := range peers {
			opt.RTTSeconds[p.ID] = p.RTTms / 1000
		}
	}
	pl := newReplicaPlanner(prof, opt)
	W := pl.L + 1
	M := opt.MicroBatches
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
	if opt.Sync == SyncOuter {
		res.Every, res.OwnBatches, res.Delay = opt.Every, opt.OwnBatches, opt.Delay
	}
	alive := make([]bool, len(peers))
	holder := make([]*simRep, len(peers)) // the replica a peer holds a stage of
	var fleet, capable, used float64      // live FLOP/s; used: of the running replicas' peers
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
	var est Estimate // of the running replicas
	var shares []int
	running := func(now float64) []*simRep {
		var out []*simRep
		for _, r := range reps {
			if r.readyAt <= now {
				out = append(out, r)
			}
		}
		return out
	}
	cands := func(rs []*simRep) []*candidate {
		out := make([]*candidate, len(rs))
		for i, r := range rs {
			out[i] = r.c
		}
		return out
	}
	var run []*simRep
	stuck := false // the running replicas' caps do not cover the step: replan
	refresh := func(now float64) {
		run = running(now)
		est, shares = Estimate{}, nil
		used = 0
		for _, r := range run {
			for _, i := range r.ids {
				used += peers[i].GFLOPS * 1e9
			}
		}
		stuck = false
		if len(run) > 0 {
			shares = pl.shares(cands(run))
			est = pl.estimate(cands(run), shares)
			stuck = shares == nil
		}
	}
	adopt := func(cs []*candidate, readyAt func(c *candidate) float64) {
		for _, c := range cs {
			if holder[byID[c.peers[0].ID]] != nil {
				continue // an existing replica (AddReplicas keeps them first)
			}
			r := &simRep{c: c, readyAt: readyAt(c)}
			for _, q := range c.peers {
				i := byID[q.ID]
				r.ids = append(r.ids, i)
				holder[i] = r
			}
			reps = append(reps, r)
		}
	}
	loadSeconds := func(c *candidate) float64 {
		t := 0.0
		for i, q := range c.peers {
			t = max(t, LoadBytesPerParam*pl.params[c.cuts[i]*W+c.cuts[i+1]]/q.LinkBytesPerS)
		}
		return t
	}
	var planTimes, addTimes []float64
	timed := func(times *[]float64, f func() error) error {
		t0 := clock()
		err := f()
		*times = append(*times, clock()-t0)
		return err
	}

	// plan is PlanReplicas' search over all live peers.
	plan := func() []*candidate {
		sorted, err := checkPeers(live())
		if err != nil {
			panic(fmt.Sprintf("sched: the simulator's own peers: %v", err)) // a bug
		}
		return pl.extend(nil, sorted)
	}
	// The first plan, loaded before the clock starts.
	var first []*candidate
	timed(&planTimes, func() error { first = plan(); return nil })
	if len(first) == 0 {
		sorted, _ := checkPeers(live())
		return SimResult{}, fmt.Errorf("first plan: %w", noPlan(prof, sorted, M, len(sorted)))
	}
	adopt(first, func(*candidate) float64 { return 0 })
	refresh(0)
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
	cursor, paused, steps, tokens := 0.0, 0.0, 0.0, 0.0
	var useful, fleetInt, capInt, usedInt, repInt, standbyInt float64
	res.ReplicasMin = math.MaxInt
	nLive := func() int {
		n := 0
		for _, on := range alive {
			if on {
				n++
			}
		}
		return n
	}
	liveCount := nLive()
	held := func() int {
		n := 0
		for _, r := range reps {
			n += len(r.ids)
		}
		return n
	}
	heldCount := held()
	advance := func(to float64) {
		dt := to - cursor
		if dt <= 0 {
			return
		}
		fleetInt += fleet * dt
		capInt += capable * dt
		usedInt += used * dt
		repInt += float64(len(run)) * dt
		standbyInt += float64(liveCount-heldCount) * dt
		if est.StepSeconds > 0 {
			active := to - max(cursor, paused)
			if active > 0 {
				s := active / est.StepSeconds
				if opt.Sync == SyncOuter {
					// Work since the last outer synchronisation, which may fall inside this span.
					H := float64(opt.Every)
					since := s
					if math.Floor((steps+s)/H) > math.Floor(steps/H) {
						since = steps + s - math.Floor((steps+s)/H)*H
						for _, r := range reps {
							r.work = 0
						}
					}
					for k, r := range run {
						r.work += since * float64(shares[k])
					}
				}
				steps += s
				n := float64(microBatches(shares)) // M, or with own batches Σ n_r
				useful += s * n * pl.flops
				tokens += s * n * float64(prof.Tokens)
			}
		}
		cursor = to
	}
	free := func(r *simRep) {
		for _, i := range r.ids {
			holder[i] = nil
		}
		reps = slices.DeleteFunc(reps, func(x *simRep) bool { return x == r })
		heldCount = held()
	}
	leave := func(now float64, i int) {
		setAlive(i, false)
		liveCount--
		r := holder[i]
		if r == nil {
			return
		}
		k := slices.Index(run, r)
		if k < 0 {
			res.LoadingLosses++
			free(r)
			return
		}
		res.ReplicaLeaves++
		var survivors []*candidate
		for _, x := range run {
			if x != r {
				survivors = append(survivors, x.c)
			}
		}
		if opt.Sync == SyncOuter {
			// The replica's inner steps since the last outer synchronisation are wasted.
			lost := r.work * pl.flops
			useful -= lost
			if est.FLOPsPerS > 0 {
				res.LostSeconds += lost / est.FLOPsPerS
			}
		} else if len(survivors) > 0 && shares != nil {
			// The survivors redo the lost share after their own, once the loss is noticed.
			remaining := (1 - (steps - math.Floor(steps))) * est.StepSeconds
			stall := max(0, cfg.DetectSeconds-remaining) + redo(survivors, shares[k])
			paused = max(paused, now) + stall
			res.StallSeconds += stall
		} else {
			paused = max(paused, now) + cfg.DetectSeconds
			res.StallSeconds += cfg.DetectSeconds
		}
		free(r)
		refresh(now)
	}

	lastAdd, lastReplan := 0.0, 0.0
	standbyChanged := false
	next := 0
	nextSample := 0.0
	sample := func(now float64) {
		g := 0.0
		if fleet > 0 {
			g = est.FLOPsPerS / fleet
		}
		loading := len(reps) - len(run)
		res.Samples = append(res.Samples, SimSample{Hours: now / 3600, Live: liveCount, Replicas: len(run), Loading: loading,
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
				liveCount++
				res.Joins++
				standbyChanged = true
			} else if alive[e.peer] {
				res.Leaves++
				if holder[e.peer] != nil {
					standbyChanged = true
				}
				leave(e.t, e.peer)
			}
		}
		advance(t1)
		now := t1
		// Step boundary: loaded replicas start.
		if len(running(now)) != len(run) {
			refresh(now)
		}
		res.ReplicasMin = min(res.ReplicasMin, len(run))
		res.ReplicasMax = max(res.ReplicasMax, len(run))
		if now >= nextSample {
			sample(now)
			nextSample += end / float64(cfg.Samples)
		}
		if now >= end {
			break
		}
		// A full replan when the plan has fallen well behind a fresh one, or cannot run.
		if now-lastReplan >= cfg.ReplanEverySeconds || stuck {
			lastReplan = now
			var fresh []*candidate
			timed(&planTimes, func() error { fresh = plan(); return nil })
			if len(fresh) > 0 {
				freshTokens := pl.objective(fresh)
				cur := pl.objective(cands(reps))
				if cur < cfg.ReplanThreshold*freshTokens || stuck {
					// Peers whose stage changed load the blocks they did not hold.
					old := map[int][2]int{}
					for _, r := range reps {
						for s, i := range r.ids {
							old[i] = [2]int{r.c.cuts[s], r.c.cuts[s+1]}
						}
					}
					stall := 0.0
					for _, c := range fresh {
						for s, q := range c.peers {
							i := byID[q.ID]
							a, b := c.cuts[s], c.cuts[s+1]
							moved := pl.params[a*W+b]
							if o, ok := old[i]; ok && max(o[0], a) < min(o[1], b) {
								moved -= pl.params[max(o[0], a)*W+min(o[1], b)]
							}
							stall = max(stall, LoadBytesPerParam*moved/peers[i].LinkBytesPerS)
						}
					}
					for _, r := range slices.Clone(reps) {
						free(r)
					}
					adopt(fresh, func(*candidate) float64 { return now })
					heldCount = held()
					paused = max(paused, now) + stall
					res.ReplanStallSeconds += stall
					res.Replans++
					refresh(now)
					standbyChanged = false
					continue
				}
			}
		}
		// New peers and freed standbys form new replicas.
		if standbyChanged && now-lastAdd >= cfg.AddEverySeconds && (len(reps) < M || pl.own) {
			lastAdd, standbyChanged = now, false
			base := cands(reps)
			var chosen []*candidate
			timed(&addTimes, func() error {
				var free []Peer
				for i, on := range alive {
					if on && holder[i] == nil {
						free = append(free, peers[i].Peer)
					}
				}
				chosen = pl.extend(base, free)
				return nil
			})
			if len(chosen) > len(base) && pl.objective(chosen) > pl.objective(base) {
				res.Adds++
				adopt(chosen[len(base):], func(c *candidate) float64 { return now + loadSeconds(c) })
				heldCount = held()
			}
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
	}
	if capInt > 0 {
		res.GoodputCapable = useful / capInt
	}
	if res.ReplicaLeaves > 0 {
		res.StallPerEvent = (res.StallSeconds + res.LostSeconds) / float64(res.ReplicaLeaves)
	}
	res.ReplicasMean, res.StandbyMean = repInt/end, standbyInt/end
	res.PlanFirstSeconds = planTimes[0]
	res.PlanCalls, res.PlanMaxSeconds, res.PlanMeanSeconds = stats(planTimes)
	res.AddCalls, res.AddMaxSeconds, res.AddMeanSeconds = stats(addTimes)
	return res, nil
}

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

// redo is the time replicas need for n more micro-batches, given out one at a time to the one
// that finishes it first (T_r of its extra share).
func redo(reps []*candidate, n int) float64 {
	k := make([]int, len(reps))
	T := 0.0
	for ; n > 0; n-- {
		best, bestT := -1, math.Inf(1)
		for r, c := range reps {
			if t := c.time(k[r] + 1); t < bestT {
				best, bestT = r, t
			}
		}
		k[best]++
		T = max(T, bestT)
	}
	return T
}
