package sched

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// fleetPeers draws n peers of the default mix.
func fleetPeers(n int, seed uint64) []Peer {
	var out []Peer
	for _, p := range Fleet(DefaultFleetMix(), n, 0, 3600, seed) {
		out = append(out, p.Peer)
	}
	return out
}

// oneBConfig is a ≈1B-parameter GPT-MoE (cmd/shoal's simulate --model 1b).
func oneBConfig() model.Config {
	return model.Config{VocabSize: 256, BlockSize: 512, NLayer: 24, NHead: 16, NEmbd: 1024, MLPRatio: 4,
		MoEEvery: 2, NExpert: 8, TopK: 2, AuxLossCoef: 0.01}
}

// checkReplicaPlan checks what every replicated plan must be: each replica covers the blocks
// in contiguous stages that fit their peers, shares are whole, positive, consecutive and sum to
// M, no peer is used twice, and the standbys are exactly the peers no replica holds.
func checkReplicaPlan(t *testing.T, prof Profile, p Plan, peers []Peer, opt ReplicaOptions) {
	t.Helper()
	checkReplicas(t, prof, p, peers, opt, true)
}

// checkReplicas is checkReplicaPlan, without the memory when memory is false (DropReplicas'
// plans keep their stages' old estimates). With opt.OwnBatches every replica computes n_r
// micro-batches from 0 of its own batch instead, 1 ≤ n_r ≤ MaxOwnMicroBatches.
func checkReplicas(t *testing.T, prof Profile, p Plan, peers []Peer, opt ReplicaOptions, memory bool) {
	t.Helper()
	byID := map[string]Peer{}
	for _, q := range peers {
		byID[q.ID] = q
	}
	used := map[string]bool{}
	first := 0
	for r, rp := range p.Replicas {
		if opt.OwnBatches {
			if most := MaxOwnMicroBatches(opt.MicroBatches, prof.Tokens); rp.First != 0 || rp.MicroBatches < 1 || rp.MicroBatches > most {
				t.Errorf("replica %d: first %d, %d micro-batches; want its own batch, first 0, 1 to %d", r, rp.First, rp.MicroBatches, most)
			}
		} else if rp.First != first || rp.MicroBatches < 1 {
			t.Errorf("replica %d: first %d, %d micro-batches; want first %d, at least 1", r, rp.First, rp.MicroBatches, first)
		}
		first += rp.MicroBatches
		a := 0
		for i, st := range rp.Stages {
			q, ok := byID[st.Peer]
			switch {
			case !ok:
				t.Fatalf("replica %d stage %d: unknown peer %q", r, i, st.Peer)
			case used[st.Peer]:
				t.Errorf("peer %q holds two stages", st.Peer)
			case st.Begin != a || st.End <= st.Begin:
				t.Errorf("replica %d stage %d: blocks [%d, %d), want to begin at %d", r, i, st.Begin, st.End, a)
			}
			used[st.Peer] = true
			a = st.End
			// The plan does not say the depth it assumed: the memory must be ReplicaStageMemory
			// at one depth for the replica's own micro-batches.
			need := st.MemoryBytes
			atDepth := !memory
			for d := 0; d < rp.MicroBatches && !atDepth; d++ {
				atDepth = need == ReplicaStageMemory(prof, st.Begin, st.End, i, len(rp.Stages), rp.First, rp.MicroBatches, d, opt)
			}
			if !atDepth {
				t.Errorf("replica %d stage %d: memory %v is ReplicaStageMemory at no depth (%v at 0)", r, i, need,
					ReplicaStageMemory(prof, st.Begin, st.End, i, len(rp.Stages), rp.First, rp.MicroBatches, 0, opt))
			}
			if need > float64(q.MemoryBytes) {
				t.Errorf("replica %d stage %d needs %.3g bytes, peer %q has %d", r, i, need, q.ID, q.MemoryBytes)
			}
		}
		if a != prof.NumBlocks() {
			t.Errorf("replica %d ends at block %d of %d", r, a, prof.NumBlocks())
		}
	}
	if opt.OwnBatches {
		if len(p.Replicas) == 0 {
			t.Errorf("no replicas")
		}
	} else if first != opt.MicroBatches || len(p.Replicas) == 0 {
		t.Errorf("%d replicas share %d micro-batches, want %d", len(p.Replicas), first, opt.MicroBatches)
	}
	var want []string
	for _, q := range peers {
		if !used[q.ID] {
			want = append(want, q.ID)
		}
	}
	got := slices.Clone(p.Standby)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("standby %d peers, want the %d no replica holds", len(got), len(want))
	}
}

// mustProfile is NewProfile of cfg for micro-batches of b sequences, which a test needs to exist.
func mustProfile(t *testing.T, cfg model.Config, b int) Profile {
	t.Helper()
	p, err := NewProfile(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// samePlanShuffled checks that the same peers in another order give plan p again.
func samePlanShuffled(t *testing.T, prof Profile, peers []Peer, opt ReplicaOptions, p Plan) {
	t.Helper()
	shuffled := slices.Clone(peers)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	again, err := PlanReplicas(prof, shuffled, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(p, again) {
		t.Errorf("the plan depends on the order of the peers")
	}
}

func TestPlanReplicasFleets(t *testing.T) {
	def, large := mustProfile(t, model.DefaultConfig(), 4), mustProfile(t, model.LargeConfig(), 1)
	for _, tc := range []struct {
		name  string
		prof  Profile
		peers int
		opt   ReplicaOptions
	}{
		{"default/step", def, 500, ReplicaOptions{MicroBatches: 4}},
		{"default/outer", def, 500, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20}},
		{"large/step", large, 800, ReplicaOptions{MicroBatches: 64}},
		{"large/outer-int8", large, 800, ReplicaOptions{MicroBatches: 64, Sync: SyncOuter, Every: 50, Int8: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peers := fleetPeers(tc.peers, 7)
			p, err := PlanReplicas(tc.prof, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			checkReplicaPlan(t, tc.prof, p, peers, tc.opt)
			e, err := EstimateReplicas(tc.prof, p, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			if e.StepSeconds != p.StepSeconds || e.Replicas != len(p.Replicas) {
				t.Errorf("estimate %+v, plan step %v with %d replicas", e, p.StepSeconds, len(p.Replicas))
			}
			samePlanShuffled(t, tc.prof, peers, tc.opt, p)
			t.Logf("%d replicas, %d standbys, %+v", len(p.Replicas), len(p.Standby), e)
		})
	}
}

// With links too fast to matter and a peer per micro-batch, every peer that can hold the model
// computes one micro-batch; the standbys are exactly the peers without the memory.
func TestPlanReplicasStandbyIsWhatNothingCanUse(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 8, Sync: SyncOuter, Every: 100}
	var peers []Peer
	for i := 0; i < 8; i++ {
		peers = append(peers, Peer{ID: string(rune('a' + i)), GFLOPS: 100 + float64(i), MemoryBytes: 4 << 30, LinkBytesPerS: 1e12})
	}
	peers = append(peers, Peer{ID: "tiny-1", GFLOPS: 1000, MemoryBytes: 1 << 20, LinkBytesPerS: 1e12},
		Peer{ID: "tiny-2", GFLOPS: 5, MemoryBytes: 1 << 10, LinkBytesPerS: 1e12})
	p, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	checkReplicaPlan(t, prof, p, peers, opt)
	if got, want := p.Standby, []string{"tiny-1", "tiny-2"}; !slices.Equal(got, want) {
		t.Errorf("standby %q, want %q", got, want)
	}
	if len(p.Replicas) != 8 {
		t.Errorf("%d replicas, want 8", len(p.Replicas))
	}
	// No peer has room: ErrNoPlan.
	if _, err := PlanReplicas(prof, peers[8:], opt); err == nil {
		t.Errorf("a plan without memory")
	}
}

func TestAddReplicasOnlyAdds(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 8, Sync: SyncOuter, Every: 100}
	var peers []Peer
	for i := 0; i < 9; i++ {
		peers = append(peers, Peer{ID: fmt.Sprintf("p%d", i), GFLOPS: 100 + 10*float64(i%4), MemoryBytes: int64(1+i%3) << 30, LinkBytesPerS: 1e9})
	}
	peers = append(peers, Peer{ID: "tiny", GFLOPS: 1000, MemoryBytes: 1 << 20, LinkBytesPerS: 1e12})
	old, newcomers := peers[:3], peers[3:]
	cur, err := PlanReplicas(prof, old, opt)
	if err != nil {
		t.Fatal(err)
	}
	next, added, err := AddReplicas(prof, cur, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !added {
		t.Fatalf("new peers added no replica to %d", len(cur.Replicas))
	}
	checkReplicaPlan(t, prof, next, peers, opt)
	if len(next.Replicas) <= len(cur.Replicas) {
		t.Fatalf("%d replicas after adding, %d before", len(next.Replicas), len(cur.Replicas))
	}
	where := func(ss []Stage) (out [][3]any) {
		for _, s := range ss {
			out = append(out, [3]any{s.Begin, s.End, s.Peer})
		}
		return out
	}
	for r, rp := range cur.Replicas {
		if !reflect.DeepEqual(where(next.Replicas[r].Stages), where(rp.Stages)) {
			t.Errorf("replica %d changed its stages", r)
		}
	}
	before, _ := EstimateReplicas(prof, cur, old, opt)
	after, _ := EstimateReplicas(prof, next, peers, opt)
	if !(after.TokensPerS > before.TokensPerS) {
		t.Errorf("tokens/s %v after adding, %v before", after.TokensPerS, before.TokensPerS)
	}
	_ = newcomers
	// Nothing more to add: the same plan, false.
	again, added, err := AddReplicas(prof, next, peers, opt)
	if err != nil || added || !reflect.DeepEqual(again, next) {
		t.Errorf("adding nothing: added %v, err %v, plan changed %v", added, err, !reflect.DeepEqual(again, next))
	}
	// A replica's peer missing from peers is an error, not a guess.
	if _, _, err := AddReplicas(prof, next, newcomers, opt); err == nil {
		t.Errorf("AddReplicas without the current replicas' peers: no error")
	}
	// Dropping a peer drops its replica only, and the shares still sum to M.
	gone := next.Replicas[0].Stages[0].Peer
	dropped := DropReplicas(next, []string{gone})
	if len(dropped.Replicas) != len(next.Replicas)-1 {
		t.Fatalf("%d replicas after dropping one of %d", len(dropped.Replicas), len(next.Replicas))
	}
	var rest []Peer
	for _, q := range peers {
		if q.ID != gone {
			rest = append(rest, q)
		}
	}
	checkReplicas(t, prof, dropped, rest, opt, false)
}

func TestShareMicroBatches(t *testing.T) {
	for _, tc := range []struct {
		name   string
		tau    []float64
		stages []int
		M      int
	}{
		{"equal", []float64{1, 1}, []int{1, 1}, 4},
		{"fast and slow", []float64{1, 3}, []int{2, 1}, 9},
		{"one each", []float64{5, 1, 2}, []int{1, 4, 2}, 3},
		{"deep", []float64{0.5, 1, 0.25}, []int{4, 1, 8}, 17},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shares, T := ShareMicroBatches(tc.tau, tc.stages, tc.M)
			sum := 0
			for _, m := range shares {
				sum += m
			}
			if sum != tc.M || slices.Min(shares) < 1 {
				t.Fatalf("shares %v: want positive, summing to %d", shares, tc.M)
			}
			// Exhaustive: no division is faster.
			best := bruteShares(tc.tau, tc.stages, tc.M, 0, nil)
			if T != best {
				t.Errorf("got step %v, want %v", T, best)
			}
		})
	}
}

func bruteShares(tau []float64, stages []int, left, r int, m []int) float64 {
	if r == len(tau)-1 {
		if left < 1 {
			return 1e300
		}
		m = append(m, left)
		T := 0.0
		for i := range m {
			T = max(T, float64(m[i]+stages[i]-1)*tau[i])
		}
		return T
	}
	best := 1e300
	for k := 1; k <= left-(len(tau)-r-1); k++ {
		best = min(best, bruteShares(tau, stages, left-k, r+1, append(slices.Clone(m), k)))
	}
	return best
}

// BenchmarkPlanReplicas10000 plans a fleet of 10,000 peers of the default mix: the default job
// and the ≈1B GPT-MoE of 1,024 micro-batches, in both modes.
func BenchmarkPlanReplicas10000(b *testing.B) {
	peers := fleetPeers(10000, 1)
	def, _ := NewProfile(model.DefaultConfig(), 4)
	big, _ := NewProfile(oneBConfig(), 1)
	for _, bc := range []struct {
		name string
		prof Profile
		opt  ReplicaOptions
	}{
		{"default/step", def, ReplicaOptions{MicroBatches: 4}},
		{"default/outer", def, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20}},
		{"1b/step", big, ReplicaOptions{MicroBatches: 1024}},
		{"1b/outer", big, ReplicaOptions{MicroBatches: 1024, Sync: SyncOuter, Every: 20}},
		{"default/outer-own", def, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}},
		{"1b/outer-own", big, ReplicaOptions{MicroBatches: 1024, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := PlanReplicas(bc.prof, peers, bc.opt); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// treeBound bounds the gradient tree's buffers and nodes of any run of m micro-batches, and
// never falls as m grows (the share caps rely on both).
func TestTreeBound(t *testing.T) {
	for _, M := range []int{1, 2, 3, 4, 7, 16, 33, 64, 100} {
		for m := 1; m <= M; m++ {
			if m > 1 && treeBound(M, m) < treeBound(M, m-1) {
				t.Errorf("M %d: treeBound(%d) = %d < treeBound(%d) = %d", M, m, treeBound(M, m), m-1, treeBound(M, m-1))
			}
			for lo := 0; lo+m <= M; lo++ {
				b, n := model.TreeBuffers(M, lo, lo+m), len(model.TreeNodes(M, lo, lo+m))
				if b > treeBound(M, m) || M > 1 && n > treeBound(M, m) {
					t.Fatalf("M %d, micro-batches [%d, %d): %d buffers, %d nodes, bound %d", M, lo, lo+m, b, n, treeBound(M, m))
				}
			}
		}
	}
}

// fleetRTT is the round-trip times of Fleet(DefaultFleetMix(), n, 0, 3600, seed), by id.
func fleetRTT(n int, seed uint64) map[string]float64 {
	rtt := map[string]float64{}
	for _, p := range Fleet(DefaultFleetMix(), n, 0, 3600, seed) {
		rtt[p.ID] = p.RTTms / 1000
	}
	return rtt
}

// A replica runs each share at the largest depth its stages' memory holds for that share, up to
// what hides its round trip; the depth memory allows never rises with the share, and T_r never
// falls.
func TestReplicaDepthAt(t *testing.T) {
	big, err := NewProfile(oneBConfig(), 1)
	if err != nil {
		t.Fatal(err)
	}
	peers, _ := checkPeers(fleetPeers(1000, 3))
	rtt := fleetRTT(1000, 3)
	for _, opt := range []ReplicaOptions{
		{MicroBatches: 64, RTTSeconds: rtt},
		{MicroBatches: 64, Sync: SyncOuter, Every: 20, Int8: true, RTTSeconds: rtt},
	} {
		t.Run(opt.Sync.String(), func(t *testing.T) {
			pl := newReplicaPlanner(big, opt)
			reps := pl.extend(nil, peers)
			if len(reps) == 0 {
				t.Fatal("no replicas")
			}
			deep := 0
			for r, c := range reps {
				prevD, prevT := math.MaxInt, 0.0
				for m := 1; m <= c.cap; m++ {
					fits := func(d int) bool {
						for i, q := range c.peers {
							if pl.memory(c.cuts[i], c.cuts[i+1], i, c.S(), m, d) > float64(q.MemoryBytes) {
								return false
							}
						}
						return true
					}
					d := c.depthAt(m)
					switch {
					case !fits(d):
						t.Fatalf("replica %d, share %d: depth %d does not fit", r, m, d)
					case d < min(c.hide, m-1) && fits(d+1):
						t.Fatalf("replica %d, share %d: depth %d, but %d fits (hide %d)", r, m, d, d+1, c.hide)
					case d > prevD && prevD < m-2: // beyond m−1 a depth changes nothing
						t.Fatalf("replica %d: depth %d at share %d, %d at %d", r, d, m, prevD, m-1)
					case c.time(m) < prevT:
						t.Fatalf("replica %d: T_r(%d) = %v < T_r(%d) = %v", r, m, c.time(m), m-1, prevT)
					}
					prevD, prevT = d, c.time(m)
					if d > 0 {
						deep++
					}
				}
			}
			t.Logf("%d replicas, %d (replica, share) pairs deeper than 1F1B", len(reps), deep)
		})
	}
}

// A group cut for a smaller target share whose cap covers a larger one is as fast as the cut
// for the larger share (groupCache relies on it): the cuts that fit only get fewer as the share
// grows.
func TestGroupCutReuse(t *testing.T) {
	big, err := NewProfile(oneBConfig(), 1)
	if err != nil {
		t.Fatal(err)
	}
	peers := fleetPeers(400, 5)
	slices.SortFunc(peers, func(a, b Peer) int { return cmp.Compare(b.MemoryBytes, a.MemoryBytes) })
	for _, opt := range []ReplicaOptions{{MicroBatches: 64}, {MicroBatches: 64, Sync: SyncOuter, Every: 20}} {
		pl := newReplicaPlanner(big, opt)
		checked := 0
		for s := 0; s+8 <= len(peers); s += 8 {
			for S := 2; S <= 8; S++ {
				for small := 1; small < opt.MicroBatches; small *= 2 {
					c := pl.group(peers[s:s+S], small, opt.MicroBatches)
					if c == nil {
						continue
					}
					for large := 2 * small; large <= c.cap; large *= 2 {
						tau, cuts := pl.cut(c.peers, large)
						if cuts == nil || tau != c.tau {
							t.Fatalf("%v: peers %d..%d cut for %d micro-batches (cap %d): τ %v; cut for %d: τ %v", opt.Sync, s, s+S, small, c.cap, c.tau, large, tau)
						}
						checked++
					}
				}
			}
		}
		if checked == 0 {
			t.Errorf("%v: no group whose cap covers a larger share", opt.Sync)
		}
	}
}

// With own batches every replica trains micro-batches of a batch of its own: a fleet much larger
// than M forms many more than M replicas, each entry is first 0 and n_r micro-batches — the
// slowest replica M, the others at least M, each finishing within the slowest's time — every
// stage's memory is ReplicaStageMemory for its n_r from 0, and the estimate counts Σ n_r
// micro-batches a step.
func TestPlanReplicasOwnBatches(t *testing.T) {
	def, one := mustProfile(t, model.DefaultConfig(), 4), mustProfile(t, model.DefaultConfig(), 1)
	for _, tc := range []struct {
		name  string
		prof  Profile
		peers int
		opt   ReplicaOptions
	}{
		{"default", def, 600, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 100, Int8: true, OwnBatches: true}},
		{"16-micro-batches", one, 1000, ReplicaOptions{MicroBatches: 16, Sync: SyncOuter, Every: 500, OwnBatches: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peers := fleetPeers(tc.peers, 7)
			tc.opt.RTTSeconds = fleetRTT(tc.peers, 7)
			p, err := PlanReplicas(tc.prof, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			checkReplicaPlan(t, tc.prof, p, peers, tc.opt)
			M := tc.opt.MicroBatches
			if len(p.Replicas) <= M {
				t.Errorf("%d replicas from %d peers with own batches of %d micro-batches; want many more than M", len(p.Replicas), tc.peers, M)
			}
			n, least, most := 0, math.MaxInt, 0
			for r, rp := range p.Replicas {
				if rp.MicroBatches < M {
					t.Errorf("replica %d trains %d micro-batches, fewer than M = %d", r, rp.MicroBatches, M)
				}
				n += rp.MicroBatches
				least, most = min(least, rp.MicroBatches), max(most, rp.MicroBatches)
			}
			if least != M || most <= M {
				t.Errorf("replicas train %d to %d micro-batches: want the slowest M = %d and faster ones more", least, most, M)
			}
			e, err := EstimateReplicas(tc.prof, p, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			if e.StepSeconds != p.StepSeconds || e.Replicas != len(p.Replicas) {
				t.Errorf("estimate %+v, plan step %v with %d replicas", e, p.StepSeconds, len(p.Replicas))
			}
			if want := float64(n*tc.prof.Tokens) / e.StepSeconds; math.Abs(e.TokensPerS-want) > 1e-9*want {
				t.Errorf("tokens/s %v, want Σ n_r·N / step = %v", e.TokensPerS, want)
			}
			slowest := 0.0
			for _, rp := range p.Replicas {
				slowest = max(slowest, rp.StepSeconds)
			}
			if e.ComputeSeconds != slowest || !(e.SyncSeconds > 0) {
				t.Errorf("compute %v s, want the slowest replica's %v s; sync %v s", e.ComputeSeconds, slowest, e.SyncSeconds)
			}
			// More than a plan that shares M.
			shared := tc.opt
			shared.OwnBatches = false
			sp, err := PlanReplicas(tc.prof, peers, shared)
			if err != nil {
				t.Fatal(err)
			}
			se, _ := EstimateReplicas(tc.prof, sp, peers, shared)
			if !(e.TokensPerS > se.TokensPerS) || len(sp.Replicas) > M {
				t.Errorf("own batches: %d replicas, %.3g tokens/s; shared: %d replicas, %.3g tokens/s", len(p.Replicas), e.TokensPerS, len(sp.Replicas), se.TokensPerS)
			}
			samePlanShuffled(t, tc.prof, peers, tc.opt, p)
			t.Logf("own batches: %d replicas, %+v; shared: %d replicas, %.4g tokens/s", len(p.Replicas), e, len(sp.Replicas), se.TokensPerS)
		})
	}
}

// Identical peers that each hold the model: with own batches every one is a replica, far past M,
// and the estimated tokens/s grows with every replica, as AddReplicas adds them.
func TestOwnBatchesTokensGrowWithReplicas(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 8, Sync: SyncOuter, Every: 50, OwnBatches: true}
	var peers []Peer
	for i := 0; i < 24; i++ {
		peers = append(peers, Peer{ID: fmt.Sprintf("p%02d", i), GFLOPS: 100, MemoryBytes: 4 << 30, LinkBytesPerS: 1e8})
	}
	prev := 0.0
	for n := 1; n <= len(peers); n++ {
		p, err := PlanReplicas(prof, peers[:n], opt)
		if err != nil {
			t.Fatal(err)
		}
		checkReplicaPlan(t, prof, p, peers[:n], opt)
		e, err := EstimateReplicas(prof, p, peers[:n], opt)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Replicas) != n || !(e.TokensPerS > prev) {
			t.Fatalf("%d peers: %d replicas, %.4g tokens/s after %.4g", n, len(p.Replicas), e.TokensPerS, prev)
		}
		prev = e.TokensPerS
	}
	// AddReplicas grows a plan past M and keeps its replicas.
	cur, err := PlanReplicas(prof, peers[:6], opt)
	if err != nil {
		t.Fatal(err)
	}
	next, added, err := AddReplicas(prof, cur, peers, opt)
	if err != nil || !added {
		t.Fatalf("AddReplicas: added %v, %v", added, err)
	}
	checkReplicaPlan(t, prof, next, peers, opt)
	if len(next.Replicas) != len(peers) {
		t.Errorf("%d replicas after adding to %d, want %d", len(next.Replicas), len(cur.Replicas), len(peers))
	}
	for r, rp := range cur.Replicas {
		if next.Replicas[r].Stages[0].Peer != rp.Stages[0].Peer {
			t.Errorf("replica %d changed its peer", r)
		}
	}
	// Dropping a peer drops its replica; the others keep their batches.
	dropped := DropReplicas(next, []string{next.Replicas[3].Stages[0].Peer})
	if len(dropped.Replicas) != len(next.Replicas)-1 {
		t.Fatalf("%d replicas after dropping one of %d", len(dropped.Replicas), len(next.Replicas))
	}
	for r, rp := range dropped.Replicas {
		k := r
		if r >= 3 {
			k++ // after the dropped replica 3
		}
		if kept := next.Replicas[k]; rp.First != 0 || rp.MicroBatches != kept.MicroBatches {
			t.Errorf("after a drop, replica %d computes [%d, %d), was [0, %d)", r, rp.First, rp.First+rp.MicroBatches, kept.MicroBatches)
		}
	}
	// A plan that shares M is not one of own batches.
	shared := opt
	shared.OwnBatches = false
	sp, err := PlanReplicas(prof, peers, shared)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := EstimateReplicas(prof, sp, peers, opt); len(sp.Replicas) > 1 && !errors.Is(err, ErrBadInput) {
		t.Errorf("a shared plan of %d replicas estimated as own batches: %v", len(sp.Replicas), err)
	}
}

// Peers of two speeds that each hold the model: with own batches the replicas of the faster ones
// train about as many more micro-batches as they are faster — each within the slowest replica's
// time for M — and the plan is estimated well above the same replicas in lock-step, every one
// training M while the fast ones wait.
func TestOwnBatchesFasterReplicasTrainMore(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 50, OwnBatches: true}
	var peers []Peer
	for i := 0; i < 8; i++ {
		g := 100.0
		if i%2 == 1 {
			g = 400 // four times faster
		}
		peers = append(peers, Peer{ID: fmt.Sprintf("p%02d", i), GFLOPS: g, MemoryBytes: 4 << 30, LinkBytesPerS: 1e8})
	}
	p, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	checkReplicaPlan(t, prof, p, peers, opt)
	speed := map[string]float64{}
	for _, q := range peers {
		speed[q.ID] = q.GFLOPS
	}
	slowest := 0.0
	for _, rp := range p.Replicas {
		slowest = max(slowest, rp.StepSeconds)
	}
	fast, slow := 0, 0
	for r, rp := range p.Replicas {
		if len(rp.Stages) != 1 {
			t.Fatalf("replica %d has %d stages; each peer holds the model", r, len(rp.Stages))
		}
		switch g := speed[rp.Stages[0].Peer]; {
		case g == 100 && rp.MicroBatches == opt.MicroBatches:
			slow++
		case g == 400 && rp.MicroBatches >= 3*opt.MicroBatches:
			fast++
		default:
			t.Errorf("replica %d on a peer of %v GFLOP/s trains %d micro-batches", r, g, rp.MicroBatches)
		}
		if rp.StepSeconds > slowest {
			t.Errorf("replica %d takes %v s, beyond the step's %v s", r, rp.StepSeconds, slowest)
		}
	}
	if fast != 4 || slow != 4 {
		t.Errorf("%d fast replicas trained more, %d slow ones M; want 4 and 4", fast, slow)
	}
	own, err := EstimateReplicas(prof, p, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	// The same replicas in lock-step: every one M.
	lock := p
	lock.Replicas = slices.Clone(p.Replicas)
	for r := range lock.Replicas {
		lock.Replicas[r].MicroBatches = opt.MicroBatches
	}
	same, err := EstimateReplicas(prof, lock, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !(own.TokensPerS > 2*same.TokensPerS) || math.Abs(own.StepSeconds-same.StepSeconds) > 1e-12 {
		t.Errorf("own shares: %.4g tokens/s in %v s; every replica M: %.4g tokens/s in %v s", own.TokensPerS, own.StepSeconds, same.TokensPerS, same.StepSeconds)
	}
	t.Logf("own shares %+v; lock-step %+v", own, same)
	// A share beyond MaxOwnMicroBatches is not a plan of own batches.
	lock.Replicas[0].MicroBatches = MaxOwnMicroBatches(opt.MicroBatches, prof.Tokens) + 1
	if _, err := EstimateReplicas(prof, lock, peers, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("a replica of %d micro-batches: %v", lock.Replicas[0].MicroBatches, err)
	}
}

// Own batches belong to outer mode.
func TestOwnBatchesNeedOuterSync(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	peers := fleetPeers(50, 1)
	opt := ReplicaOptions{MicroBatches: 4, OwnBatches: true}
	if _, err := PlanReplicas(prof, peers, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("PlanReplicas: %v", err)
	}
	if _, _, err := AddReplicas(prof, Plan{}, peers, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("AddReplicas: %v", err)
	}
	if _, err := EstimateReplicas(prof, Plan{}, peers, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("EstimateReplicas: %v", err)
	}
	if _, err := Simulate(SimConfig{Profile: prof, Options: opt, Peers: 50, Hours: 0.1}); !errors.Is(err, ErrBadInput) {
		t.Errorf("Simulate: %v", err)
	}
}
