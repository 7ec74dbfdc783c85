package sched

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/model"
)

var seedFlag = flag.Uint64("seed", 0, "seed for the randomised planner tests (0: from the clock)")

// testRand returns a seeded RNG and logs the seed, so that a failure can be replayed with -seed.
func testRand(t *testing.T) *rand.Rand {
	t.Helper()
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (rerun with -seed %d)", seed, seed)
	return rand.New(rand.NewPCG(seed, seed^0x5eed))
}

// exhaustive tries every S, every ordered choice of S peers and every cut, and returns the plan
// Partition must return: the least step time, then fewer stages, then the least slowest-stage
// time, then the lexicographically least (peer, end, peer, end, …) with peers by index in peers,
// which must be sorted by id.
func exhaustive(prof Profile, peers []Peer, M, maxS int) (best []cut, obj float64) {
	L := prof.NumBlocks()
	obj, bestTau := math.Inf(1), math.Inf(1)
	key := func(cs []cut) []int {
		var k []int
		for _, c := range cs {
			k = append(k, c.peer, c.b)
		}
		return k
	}
	for S := 1; S <= min(L, len(peers), maxS); S++ {
		var stages []cut
		used := make([]bool, len(peers))
		var walk func(a int)
		walk = func(a int) {
			i := len(stages)
			if i == S {
				if a != L {
					return
				}
				tau := 0.0
				for _, c := range stages {
					comp, x := prof.StageSeconds(peers[c.peer], c.a, c.b)
					tau = max(tau, comp+x)
				}
				o := float64(M+S-1) * tau
				better := o < obj || o == obj && (len(stages) < len(best) ||
					len(stages) == len(best) && (tau < bestTau || tau == bestTau && slices.Compare(key(stages), key(best)) < 0))
				if better {
					best, obj, bestTau = slices.Clone(stages), o, tau
				}
				return
			}
			for p := range peers {
				if used[p] {
					continue
				}
				for b := a + 1; b <= L; b++ {
					if prof.StageMemory(a, b, i, S, M) > float64(peers[p].MemoryBytes) {
						continue
					}
					used[p] = true
					stages = append(stages, cut{p, a, b})
					walk(b)
					stages = stages[:i]
					used[p] = false
				}
			}
		}
		walk(0)
	}
	return best, obj
}

// randomCase draws a small model and peers whose numbers come from short lists, so that ties
// (equal speeds, memories that exactly matter) are common.
func randomCase(r *rand.Rand) (Profile, []Peer, int) {
	cfg := model.TinyConfig()
	cfg.NLayer = 1 + r.IntN(8)
	cfg.MoEEvery = r.IntN(4)
	cfg.NEmbd = []int{32, 64, 128}[r.IntN(3)]
	cfg.NExpert = []int{2, 4, 8}[r.IntN(3)]
	cfg.TopK = 1 + r.IntN(2)
	prof, err := NewProfile(cfg, 1+r.IntN(4))
	if err != nil {
		panic(err)
	}
	M := 1 + r.IntN(16)
	// Memory in units of the largest single block's state, so that some peers fit one block,
	// some a few, and some the whole model.
	unit := 0.0
	for a := 0; a < prof.NumBlocks(); a++ {
		unit = max(unit, prof.StageMemory(a, a+1, 0, 1, 1))
	}
	peers := make([]Peer, 1+r.IntN(5))
	for i := range peers {
		peers[i] = Peer{
			ID:            fmt.Sprintf("p%d", r.IntN(100)*10+i), // unique, in no particular order
			GFLOPS:        []float64{0.5, 1, 2, 8, 40}[r.IntN(5)],
			MemoryBytes:   int64(unit * []float64{0.5, 1.5, 3, 6, 100}[r.IntN(5)]),
			LinkBytesPerS: []float64{1e6, 1e7, 1e9, math.Inf(1)}[r.IntN(4)],
		}
	}
	return prof, peers, M
}

// checkPlan checks what every plan must satisfy: stages cover [0, L) in order on distinct
// peers whose memory holds them, every other peer is a standby, and the estimates add up.
func checkPlan(t *testing.T, prof Profile, peers []Peer, M int, plan Plan) {
	t.Helper()
	byID := map[string]Peer{}
	for _, p := range peers {
		byID[p.ID] = p
	}
	seen := map[string]bool{}
	next, slowest := 0, 0.0
	S := len(plan.Stages)
	for i, st := range plan.Stages {
		peer, ok := byID[st.Peer]
		if !ok || seen[st.Peer] || st.Begin != next || st.End <= st.Begin {
			t.Fatalf("stage %d %+v: unknown or repeated peer, or blocks not contiguous", i, st)
		}
		seen[st.Peer] = true
		next = st.End
		if need := prof.StageMemory(st.Begin, st.End, i, S, M); need != st.MemoryBytes || need > float64(peer.MemoryBytes) {
			t.Fatalf("stage %d needs %v bytes (plan says %v), peer %s has %d", i, need, st.MemoryBytes, peer.ID, peer.MemoryBytes)
		}
		slowest = max(slowest, st.ComputeSeconds+st.TransferSeconds)
	}
	if next != prof.NumBlocks() {
		t.Fatalf("stages end at block %d of %d", next, prof.NumBlocks())
	}
	for _, id := range plan.Standby {
		if seen[id] || byID[id].ID == "" {
			t.Fatalf("standby %q is used or unknown", id)
		}
		seen[id] = true
	}
	if len(seen) != len(peers) {
		t.Fatalf("%d peers in the plan, %d given", len(seen), len(peers))
	}
	if want := float64(M+S-1) * slowest; plan.StepSeconds != want {
		t.Fatalf("StepSeconds %v, want %v", plan.StepSeconds, want)
	}
}

func byID(peers []Peer) []Peer {
	s := slices.Clone(peers)
	slices.SortFunc(s, func(a, b Peer) int { return cmp.Compare(a.ID, b.ID) })
	return s
}

// TestPartitionMatchesExhaustive compares Partition with exhaustive search on random small cases
// (L ≤ 8, ≤ 5 peers): the same plan, ties included, or no plan for both.
func TestPartitionMatchesExhaustive(t *testing.T) {
	r := testRand(t)
	plans, byS := 0, map[int]int{}
	for n := 0; n < 1000; n++ {
		prof, peers, M := randomCase(r)
		maxS := prof.NumBlocks()
		if r.IntN(4) == 0 {
			maxS = 1 + r.IntN(maxS)
		}
		plan, err := Partition(prof, peers, Options{MicroBatches: M, MaxStages: maxS, Version: 7})
		sorted := byID(peers)
		want, obj := exhaustive(prof, sorted, M, maxS)
		if want == nil {
			if !errors.Is(err, ErrNoPlan) {
				t.Fatalf("case %d: exhaustive search finds no plan, Partition = %+v, %v", n, plan, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("case %d: %v; exhaustive search finds %v", n, err, want)
		}
		checkPlan(t, prof, peers, M, plan)
		var got []cut
		for _, st := range plan.Stages {
			i := slices.IndexFunc(sorted, func(p Peer) bool { return p.ID == st.Peer })
			got = append(got, cut{i, st.Begin, st.End})
		}
		if !reflect.DeepEqual(got, want) || plan.StepSeconds != obj || plan.Version != 7 || plan.MicroBatches != M {
			t.Fatalf("case %d (M %d, peers %+v):\n got %v step %v\nwant %v step %v", n, M, sorted, got, plan.StepSeconds, want, obj)
		}
		plans++
		byS[len(plan.Stages)]++
	}
	t.Logf("%d plans; by number of stages: %v", plans, byS)
	if plans < 500 || plans-byS[1] < 200 {
		t.Errorf("%d of 1000 random cases had a plan, %d with more than one stage: the generator needs tuning", plans, plans-byS[1])
	}
}

// TestFixedSpeedOrderIsNotEnough shows why Partition searches the peers' pipeline order: on
// random cases, the best plan whose stages follow the peers sorted by speed is sometimes strictly
// slower than the best plan.
func TestFixedSpeedOrderIsNotEnough(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	worse := 0
	for n := 0; n < 200; n++ {
		prof, peers, M := randomCase(r)
		_, best := exhaustive(prof, byID(peers), M, prof.NumBlocks())
		if math.IsInf(best, 1) {
			continue
		}
		// Peers by speed, fastest first; exhaustive over prefixes of that order only.
		ordered := slices.Clone(peers)
		slices.SortStableFunc(ordered, func(a, b Peer) int { return cmp.Compare(b.GFLOPS, a.GFLOPS) })
		fixed := math.Inf(1)
		for S := 1; S <= min(len(ordered), prof.NumBlocks()); S++ {
			for _, p := range fixedOrderPlans(prof, ordered[:S], M) {
				fixed = min(fixed, p)
			}
		}
		if fixed > best {
			worse++
		}
	}
	t.Logf("fixed speed order strictly worse in %d of 200 cases", worse)
	if worse == 0 {
		t.Errorf("expected the fixed speed order to lose somewhere")
	}
}

// fixedOrderPlans returns the step time of every feasible cut of the blocks over peers in order.
func fixedOrderPlans(prof Profile, peers []Peer, M int) []float64 {
	L, S := prof.NumBlocks(), len(peers)
	var out []float64
	var walk func(i, a int, tau float64)
	walk = func(i, a int, tau float64) {
		if i == S {
			if a == L {
				out = append(out, float64(M+S-1)*tau)
			}
			return
		}
		for b := a + 1; b <= L; b++ {
			if prof.StageMemory(a, b, i, S, M) <= float64(peers[i].MemoryBytes) {
				c, x := prof.StageSeconds(peers[i], a, b)
				walk(i+1, b, max(tau, c+x))
			}
		}
	}
	walk(0, 0, 0)
	return out
}

func tinyProfile(t *testing.T) Profile {
	t.Helper()
	p, err := NewProfile(model.TinyConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPartitionDeterministic(t *testing.T) {
	prof := tinyProfile(t)
	r := testRand(t)
	var peers []Peer
	for i := 0; i < 9; i++ {
		peers = append(peers, Peer{ID: fmt.Sprintf("w%d", i), GFLOPS: []float64{1, 4}[i%2], MemoryBytes: 1 << 30, LinkBytesPerS: 1e7})
	}
	want, err := Partition(prof, peers, Options{MicroBatches: 8})
	if err != nil {
		t.Fatal(err)
	}
	for n := 0; n < 10; n++ {
		r.Shuffle(len(peers), func(i, j int) { peers[i], peers[j] = peers[j], peers[i] })
		got, err := Partition(prof, peers, Options{MicroBatches: 8})
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("shuffled peers: got %+v, %v\nwant %+v", got, err, want)
		}
	}
}

func TestPartitionCases(t *testing.T) {
	prof := tinyProfile(t)
	whole := prof.StageMemory(0, 4, 0, 1, 8)
	fast := func(id string) Peer { return Peer{ID: id, GFLOPS: 10, MemoryBytes: 1 << 30, LinkBytesPerS: 1e8} }
	tests := []struct {
		name    string
		peers   []Peer
		stages  string // "peer:begin-end ..."
		standby []string
	}{
		{"one-peer", []Peer{fast("a")}, "a:0-4", nil},
		// Identical peers: one block per stage is fastest here, on the smallest ids.
		{"ties-by-id", []Peer{fast("e"), fast("c"), fast("a"), fast("d"), fast("b")}, "a:0-1 b:1-2 c:2-3 d:3-4", []string{"e"}},
		// A peer a hundred times slower would be the slowest stage whatever it held.
		{"slow-peer-stands-by", []Peer{fast("a"), {ID: "slow", GFLOPS: 0.1, MemoryBytes: 1 << 30, LinkBytesPerS: 1e8}}, "a:0-4", []string{"slow"}},
		// A slow link makes every split cost more than it saves.
		{"slow-links-keep-one-stage", []Peer{{ID: "a", GFLOPS: 10, MemoryBytes: 1 << 30, LinkBytesPerS: 1e3},
			{ID: "b", GFLOPS: 10, MemoryBytes: 1 << 30, LinkBytesPerS: 1e3}}, "a:0-4", []string{"b"}},
		// The fastest peer cannot hold the model, so the pipeline splits, and the slow peer takes the
		// first stage: the last stage holds one micro-batch of activations, the first two, and only
		// the last fits the fast peer with the heavier half.
		{"memory-forces-split", []Peer{{ID: "big", GFLOPS: 1, MemoryBytes: int64(whole), LinkBytesPerS: 1e8},
			{ID: "fast", GFLOPS: 100, MemoryBytes: int64(whole * 0.6), LinkBytesPerS: 1e8},
			{ID: "tiny", GFLOPS: 100, MemoryBytes: 1 << 10, LinkBytesPerS: 1e8}}, "big:0-2 fast:2-4", []string{"tiny"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			plan, err := Partition(prof, tt.peers, Options{MicroBatches: 8})
			if err != nil {
				t.Fatal(err)
			}
			checkPlan(t, prof, tt.peers, 8, plan)
			var got []string
			for _, s := range plan.Stages {
				got = append(got, fmt.Sprintf("%s:%d-%d", s.Peer, s.Begin, s.End))
			}
			if strings.Join(got, " ") != tt.stages || !reflect.DeepEqual(plan.Standby, tt.standby) {
				t.Errorf("got %v standby %v, want %s standby %v", got, plan.Standby, tt.stages, tt.standby)
			}
		})
	}
}

// TestPartitionLargePool checks the narrowing of many peers: 4 good peers and 40 that each of
// them beats must give the plan of the 4 alone; a pool of 300 random peers must give a valid plan.
func TestPartitionLargePool(t *testing.T) {
	prof := tinyProfile(t)
	r := testRand(t)
	good := []Peer{
		{ID: "g1", GFLOPS: 20, MemoryBytes: 1 << 30, LinkBytesPerS: 1e8},
		{ID: "g2", GFLOPS: 25, MemoryBytes: 1 << 29, LinkBytesPerS: 2e8},
		{ID: "g3", GFLOPS: 15, MemoryBytes: 1 << 31, LinkBytesPerS: 1e8},
		{ID: "g4", GFLOPS: 30, MemoryBytes: 1 << 28, LinkBytesPerS: 5e7},
	}
	want, err := Partition(prof, good, Options{MicroBatches: 4})
	if err != nil {
		t.Fatal(err)
	}
	pool := slices.Clone(good)
	for i := 0; i < 40; i++ {
		pool = append(pool, Peer{ID: fmt.Sprintf("d%02d", i), GFLOPS: 1 + 14*r.Float64(),
			MemoryBytes: 1<<27 + r.Int64N(1<<27), LinkBytesPerS: 1e7 + 4e7*r.Float64()})
	}
	got, err := Partition(prof, pool, Options{MicroBatches: 4})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, prof, pool, 4, got)
	if !reflect.DeepEqual(got.Stages, want.Stages) || got.StepSeconds != want.StepSeconds {
		t.Errorf("with dominated peers added: %+v\nwant %+v", got.Stages, want.Stages)
	}

	var many []Peer
	for i := 0; i < 300; i++ {
		many = append(many, Peer{ID: fmt.Sprintf("r%03d", i), GFLOPS: 0.1 + 50*r.Float64(),
			MemoryBytes: r.Int64N(1 << 28), LinkBytesPerS: 1e5 + 1e8*r.Float64()})
	}
	plan, err := Partition(prof, many, Options{MicroBatches: 8})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, prof, many, 8, plan)
}

func TestPartitionErrors(t *testing.T) {
	prof := tinyProfile(t)
	ok := Peer{ID: "a", GFLOPS: 1, MemoryBytes: 1 << 30, LinkBytesPerS: 1e6}
	tests := []struct {
		name  string
		prof  Profile
		peers []Peer
		opt   Options
		want  error
		text  string
	}{
		{"no-blocks", Profile{}, []Peer{ok}, Options{MicroBatches: 1}, ErrBadInput, ""},
		{"no-micro-batches", prof, []Peer{ok}, Options{}, ErrBadInput, ""},
		{"no-peers", prof, nil, Options{MicroBatches: 1}, ErrNoPlan, ""},
		{"duplicate-id", prof, []Peer{ok, ok}, Options{MicroBatches: 1}, ErrBadInput, "twice"},
		{"empty-id", prof, []Peer{{GFLOPS: 1, LinkBytesPerS: 1}}, Options{MicroBatches: 1}, ErrBadInput, ""},
		{"zero-speed", prof, []Peer{{ID: "a", LinkBytesPerS: 1}}, Options{MicroBatches: 1}, ErrBadInput, "GFLOPS"},
		{"nan-link", prof, []Peer{{ID: "a", GFLOPS: 1, LinkBytesPerS: math.NaN()}}, Options{MicroBatches: 1}, ErrBadInput, "link"},
		{"too-many-candidates", prof, []Peer{ok}, Options{MicroBatches: 1, MaxCandidates: 64}, ErrBadInput, ""},
		{"too-little-memory", prof, []Peer{{ID: "a", GFLOPS: 1, MemoryBytes: 1 << 20, LinkBytesPerS: 1e6},
			{ID: "b", GFLOPS: 1, MemoryBytes: 1 << 21, LinkBytesPerS: 1e6}}, Options{MicroBatches: 1}, ErrNoPlan,
			"the 2 peers offer 3.0 MiB in all and 2.0 MiB at most on one"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Partition(tt.prof, tt.peers, tt.opt)
			if !errors.Is(err, tt.want) || !strings.Contains(fmt.Sprint(err), tt.text) {
				t.Fatalf("Partition = %v, want %v containing %q", err, tt.want, tt.text)
			}
		})
	}
}
