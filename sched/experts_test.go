package sched

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// unitExperts is a profile whose numbers are easy to follow: a routed token takes 1 s on a host
// of 1 GFLOPS with a free link, an expert needs 16 000 bytes of state and 10 bytes per token of
// activations, and micro-batches have 64 tokens, 2 per step.
func unitExperts(blocks []int, E int) ExpertProfile {
	return ExpertProfile{Blocks: blocks, Experts: E, TopK: 1, Tokens: 64, MicroBatches: 2,
		FLOPsPerToken: 1e9, Params: 1000, StateBytes: 16000, ActBytesPerToken: 10}
}

// wholeMem is the shard memory PlaceExperts documents, computed here on its own: state, plus
// InFlight (0: M) micro-batches of all N tokens, for a replica as for a whole expert.
func wholeMem(p ExpertProfile, inFlight int) float64 {
	if inFlight == 0 {
		inFlight = p.MicroBatches
	}
	return p.StateBytes + float64(inFlight*p.Tokens)*p.ActBytesPerToken
}

func host(id string, gflops float64, mem int64) Peer {
	return Peer{ID: id, GFLOPS: gflops, MemoryBytes: mem, LinkBytesPerS: math.Inf(1)}
}

// hostSeconds computes each host's seconds per step from placements on its own: a replica
// carries half its expert's load.
func hostSeconds(prof ExpertProfile, pl []ExpertPlacement, loads ExpertLoad, hosts []Peer) map[string]float64 {
	byID := map[string]Peer{}
	for _, h := range hosts {
		byID[h.ID] = h
	}
	out := map[string]float64{}
	for _, p := range pl {
		x := float64(prof.Tokens*prof.MicroBatches*prof.TopK) / float64(prof.Experts)
		if row, ok := loads[p.Block]; ok {
			x = row[p.Expert]
		}
		for _, id := range p.Peers {
			h := byID[id]
			out[id] += x / float64(len(p.Peers)) * (prof.FLOPsPerToken/(h.GFLOPS*1e9) + prof.SendBytesPerToken/h.LinkBytesPerS)
		}
	}
	return out
}

func span(secs map[string]float64) float64 {
	m := 0.0
	for _, s := range secs {
		m = max(m, s)
	}
	return m
}

// checkPlacement checks what every placement must satisfy: one entry per expert, by (block,
// expert), on one or two distinct known hosts, whose memory holds what they got.
func checkPlacement(t *testing.T, prof ExpertProfile, opt ExpertOptions, hosts []Peer, pl []ExpertPlacement) {
	t.Helper()
	byID := map[string]Peer{}
	for _, h := range hosts {
		byID[h.ID] = h
	}
	if len(pl) != len(prof.Blocks)*prof.Experts {
		t.Fatalf("%d placements, want %d", len(pl), len(prof.Blocks)*prof.Experts)
	}
	used := map[string]float64{}
	blocks := map[string]map[int]bool{}
	for i, p := range pl {
		if want := (ExpertPlacement{Block: prof.Blocks[i/prof.Experts], Expert: i % prof.Experts}); p.Block != want.Block || p.Expert != want.Expert {
			t.Fatalf("placement %d is %d/%d, want %d/%d", i, p.Block, p.Expert, want.Block, want.Expert)
		}
		if len(p.Peers) < 1 || len(p.Peers) > 2 || len(p.Peers) == 2 && p.Peers[0] == p.Peers[1] {
			t.Fatalf("expert %d/%d on %v", p.Block, p.Expert, p.Peers)
		}
		for _, id := range p.Peers {
			if _, ok := byID[id]; !ok {
				t.Fatalf("expert %d/%d on unknown host %q", p.Block, p.Expert, id)
			}
			used[id] += wholeMem(prof, opt.InFlight)
			if blocks[id] == nil {
				blocks[id] = map[int]bool{}
			}
			blocks[id][p.Block] = true
		}
	}
	for id, b := range used {
		if b > float64(byID[id].MemoryBytes) {
			t.Errorf("host %s holds %.0f bytes of experts, has %d", id, b, byID[id].MemoryBytes)
		}
		if opt.OneBlockPerHost && len(blocks[id]) > 1 {
			t.Errorf("host %s holds experts of blocks %v", id, blocks[id])
		}
	}
}

// optimum is the least makespan over every assignment of the whole experts to hosts that fits
// their memory, by exhaustive search.
func optimum(prof ExpertProfile, loads ExpertLoad, hosts []Peer, opt ExpertOptions) float64 {
	type item struct{ block, expert int }
	var items []item
	for _, b := range prof.Blocks {
		for e := 0; e < prof.Experts; e++ {
			items = append(items, item{b, e})
		}
	}
	pl := make([]ExpertPlacement, len(items))
	mem := make([]float64, len(hosts))
	best := math.Inf(1)
	var walk func(i int)
	walk = func(i int) {
		if i == len(items) {
			best = min(best, span(hostSeconds(prof, pl, loads, hosts)))
			return
		}
		for h := range hosts {
			need := wholeMem(prof, opt.InFlight)
			if mem[h]+need > float64(hosts[h].MemoryBytes) {
				continue
			}
			mem[h] += need
			pl[i] = ExpertPlacement{Block: items[i].block, Expert: items[i].expert, Peers: []string{hosts[h].ID}}
			walk(i + 1)
			mem[h] -= need
		}
	}
	walk(0)
	return best
}

func TestNewExpertProfile(t *testing.T) {
	for _, cfg := range []model.Config{model.TinyConfig(), model.DefaultConfig(),
		func() model.Config { c := model.TinyConfig(); c.MoEEvery = 1; c.NExpert = 8; c.TopK = 1; return c }()} {
		t.Run(fmt.Sprintf("E%d-k%d-every%d", cfg.NExpert, cfg.TopK, cfg.MoEEvery), func(t *testing.T) {
			ep, err := NewExpertProfile(cfg, 3, 4)
			if err != nil {
				t.Fatal(err)
			}
			prof, err := NewProfile(cfg, 3)
			if err != nil {
				t.Fatal(err)
			}
			var want []int
			for i := 0; i < cfg.NLayer; i++ {
				if cfg.IsMoE(i) {
					want = append(want, i)
				}
			}
			if !slices.Equal(ep.Blocks, want) || ep.Tokens != prof.Tokens || ep.MicroBatches != 4 {
				t.Fatalf("blocks %v tokens %d M %d, want %v %d 4", ep.Blocks, ep.Tokens, ep.MicroBatches, want, prof.Tokens)
			}
			// The experts are what an MoE block has beyond a dense block's MLP: a router, E−1 more
			// MLPs, and top_k of them per token instead of one (Profile's formulas).
			dense := Profile{}
			dcfg := cfg
			dcfg.MoEEvery = 0
			if dense, err = NewProfile(dcfg, 3); err != nil {
				t.Fatal(err)
			}
			b := ep.Blocks[0]
			moe, mlp := prof.Blocks[b], dense.Blocks[b]
			N, C, F, E, K := float64(ep.Tokens), float64(cfg.NEmbd), float64(cfg.Hidden()), float64(cfg.NExpert), float64(cfg.TopK)
			if got, want := moe.Params-mlp.Params, int64(cfg.NExpert*cfg.NEmbd)+int64(cfg.NExpert-1)*ep.Params; got != want {
				t.Errorf("an MoE block has %d more params than a dense one, the expert profile says %d", got, want)
			}
			if got, want := moe.FLOPs-mlp.FLOPs, 3*2*N*C*E+(K-1)*N*ep.FLOPsPerToken; math.Abs(got-want) > 1e-9*want {
				t.Errorf("an MoE block has %g more FLOPs than a dense one, the expert profile says %g", got, want)
			}
			if got, want := moe.ActBytes-mlp.ActBytes, 4*N*2*E+K*N*ep.ActBytesPerToken-4*N*(C+3*F); math.Abs(got-want) > 1e-9*math.Abs(want) {
				t.Errorf("an MoE block keeps %g more activation bytes than a dense one, the expert profile says %g", got, want)
			}
		})
	}
	if _, err := NewExpertProfile(model.TinyConfig(), 0, 1); !errors.Is(err, ErrBadInput) {
		t.Errorf("micro-batch 0: got %v, want ErrBadInput", err)
	}
}

func TestExpertLoad(t *testing.T) {
	prof := unitExperts([]int{1, 3}, 4)
	prof.TopK = 2
	uniform := 64.0 * 2 * 2 / 4 // N·M·top_k/E
	tests := []struct {
		name   string
		recent []RouterCounts
		want   ExpertLoad
		err    error
	}{
		{"none", nil, ExpertLoad{1: {uniform, uniform, uniform, uniform}, 3: {uniform, uniform, uniform, uniform}}, nil},
		{"one block, mean of two steps", []RouterCounts{{1, []int64{100, 20, 8, 0}}, {1, []int64{80, 40, 8, 0}}},
			ExpertLoad{1: {90, 30, 8, 0}, 3: {uniform, uniform, uniform, uniform}}, nil},
		{"not an MoE block", []RouterCounts{{2, []int64{1, 1, 1, 1}}}, nil, ErrBadInput},
		{"wrong length", []RouterCounts{{1, []int64{1, 1, 1}}}, nil, ErrBadInput},
		{"negative", []RouterCounts{{1, []int64{1, -1, 1, 1}}}, nil, ErrBadInput},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NewExpertLoad(prof, tc.recent)
			if !errors.Is(err, tc.err) || tc.err == nil && err != nil {
				t.Fatalf("error %v, want %v", err, tc.err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
	if got := UniformExpertLoad(prof); !reflect.DeepEqual(got, tests[0].want) {
		t.Errorf("UniformExpertLoad = %v, want %v", got, tests[0].want)
	}
	// Before any statistics, nil loads place as the uniform load does.
	hosts := []Peer{host("a", 1, 1<<30), host("b", 2, 1<<30), host("c", 3, 1<<30)}
	a, err := PlaceExperts(prof, nil, hosts, ExpertOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := PlaceExperts(prof, UniformExpertLoad(prof), hosts, ExpertOptions{})
	if err != nil || !reflect.DeepEqual(a, b) {
		t.Errorf("nil loads: %v; uniform loads: %v, %v", a, b, err)
	}
}

// randomExpertCase draws at most 7 experts over at most 3 hosts, loads from a short list so that
// ties are common. identical gives every host the same speed and a free link.
func randomExpertCase(r *rand.Rand, identical bool) (ExpertProfile, ExpertLoad, []Peer) {
	nb := 1 + r.IntN(2)
	prof := unitExperts([]int{0, 2}[:nb], 1+r.IntN(7/nb))
	if !identical {
		prof.SendBytesPerToken = 4e8
	}
	loads := ExpertLoad{}
	for _, b := range prof.Blocks {
		row := make([]float64, prof.Experts)
		for e := range row {
			row[e] = []float64{0, 1, 2, 3, 5, 8, 13, 7.5, 100 * r.Float64()}[r.IntN(9)]
		}
		loads[b] = row
	}
	hosts := make([]Peer, 1+r.IntN(3))
	for i := range hosts {
		hosts[i] = host(fmt.Sprintf("h%d", r.IntN(100)*10+i), 2, 1<<30)
		if !identical {
			hosts[i].GFLOPS = []float64{0.5, 1, 2, 3, 8}[r.IntN(5)]
			hosts[i].LinkBytesPerS = []float64{1e9, 4e9, math.Inf(1)}[r.IntN(3)]
		}
	}
	return prof, loads, hosts
}

// TestPlaceExpertsLPTBound compares LPT with exhaustive search: within Graham's 4/3 − 1/(3m) on
// identical hosts, within 2m/(m+1) (Gonzalez, Ibarra & Sahni 1977) on hosts of different speeds
// and links, where the worst ratio seen is logged.
func TestPlaceExpertsLPTBound(t *testing.T) {
	// Graham's instances on which the bound is tight: LPT loses exactly 1/3 − 1/(3m).
	for _, tc := range []struct {
		loads     []float64
		m         int
		got, want float64
	}{
		{[]float64{3, 3, 2, 2, 2}, 2, 7, 6},
		{[]float64{5, 5, 4, 4, 3, 3, 3}, 3, 11, 9},
	} {
		prof := unitExperts([]int{0}, len(tc.loads))
		loads := ExpertLoad{0: tc.loads}
		var hosts []Peer
		for i := range tc.m {
			hosts = append(hosts, host(fmt.Sprint("h", i), 1, 1<<30))
		}
		pl, err := PlaceExperts(prof, loads, hosts, ExpertOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got, opt := span(hostSeconds(prof, pl, loads, hosts)), optimum(prof, loads, hosts, ExpertOptions{}); got != tc.got || opt != tc.want {
			t.Errorf("loads %v on %d hosts: LPT %g, optimum %g; want %g, %g", tc.loads, tc.m, got, opt, tc.got, tc.want)
		}
	}

	r := testRand(t)
	for _, identical := range []bool{true, false} {
		worst := 1.0
		for range 600 {
			prof, loads, hosts := randomExpertCase(r, identical)
			opt := ExpertOptions{}
			pl, err := PlaceExperts(prof, loads, hosts, opt)
			if err != nil {
				t.Fatal(err)
			}
			checkPlacement(t, prof, opt, hosts, pl)
			got, opt0 := span(hostSeconds(prof, pl, loads, hosts)), optimum(prof, loads, hosts, opt)
			m := float64(len(hosts))
			bound := 4.0/3 - 1/(3*m)
			if !identical {
				bound = 2 * m / (m + 1)
			}
			if got > bound*opt0*(1+1e-12) {
				t.Fatalf("identical %v, loads %v, hosts %v: LPT makespan %g, optimum %g: ratio %.4f above %.4f",
					identical, loads, hosts, got, opt0, got/opt0, bound)
			}
			if opt0 > 0 {
				worst = max(worst, got/opt0)
			}
			secs, err := ExpertHostSeconds(prof, pl, loads, hosts, opt)
			if err != nil {
				t.Fatal(err)
			}
			if want := hostSeconds(prof, pl, loads, hosts); math.Abs(span(secs)-span(want)) > 1e-9*span(want) {
				t.Fatalf("ExpertHostSeconds %v, want %v", secs, want)
			}
		}
		t.Logf("identical hosts %v: worst LPT/optimum %.4f", identical, worst)
	}
}

func TestPlaceExpertsTies(t *testing.T) {
	prof := unitExperts([]int{1, 3}, 4)
	hosts := []Peer{host("c", 1, 1<<30), host("a", 1, 1<<30), host("b", 1, 1<<30)}
	zero := ExpertLoad{1: {0, 0, 0, 0}, 3: {0, 0, 0, 0}}
	tests := []struct {
		name  string
		loads ExpertLoad
		want  []string // host of each (block, expert), in order
	}{
		// Equal loads on equal hosts: largest first is (block, expert) order, each to the least
		// loaded host, then the one with fewer shards, then the smaller id.
		{"uniform", nil, []string{"a", "b", "c", "a", "b", "c", "a", "b"}},
		// Experts that get no tokens still spread out rather than pile onto host a.
		{"zero", zero, []string{"a", "b", "c", "a", "b", "c", "a", "b"}},
		{"heavy last", ExpertLoad{1: {1, 1, 1, 1}, 3: {1, 1, 1, 5}}, []string{"b", "c", "b", "c", "b", "c", "b", "a"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var first []ExpertPlacement
			for i := range 6 {
				perm := slices.Clone(hosts)
				rand.New(rand.NewPCG(uint64(i), 0)).Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
				pl, err := PlaceExperts(prof, tc.loads, perm, ExpertOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if i == 0 {
					first = pl
					var got []string
					for _, p := range pl {
						got = append(got, p.Peers...)
					}
					if !slices.Equal(got, tc.want) {
						t.Fatalf("got %v, want %v", got, tc.want)
					}
				} else if !reflect.DeepEqual(pl, first) {
					t.Fatalf("hosts in order %v: %v, want %v", perm, pl, first)
				}
			}
		})
	}
}

func TestPlaceExpertsMemory(t *testing.T) {
	prof := unitExperts([]int{1, 3}, 4)
	one := int64(wholeMem(prof, 0))      // room for one expert exactly
	two1 := int64(2 * wholeMem(prof, 1)) // for two with one micro-batch in flight, one with M
	tests := []struct {
		name  string
		opt   ExpertOptions
		hosts []Peer
		want  map[string]int // experts per host; nil: ErrNoPlan
	}{
		{"fast host with room for one", ExpertOptions{},
			[]Peer{host("fast", 100, one), host("b", 1, 10*one), host("c", 1, 10*one)},
			map[string]int{"fast": 1, "b": 4, "c": 3}},
		{"a host without room is skipped", ExpertOptions{},
			[]Peer{host("a", 100, one-1), host("b", 1, 4*one), host("c", 1, 4*one)},
			map[string]int{"b": 4, "c": 4}},
		{"exactly enough", ExpertOptions{},
			[]Peer{host("a", 1, 3*one), host("b", 5, 3*one), host("c", 1, 2*one+one/2)},
			map[string]int{"a": 3, "b": 3, "c": 2}},
		{"fewer micro-batches in flight need less", ExpertOptions{InFlight: 1},
			[]Peer{host("a", 1, two1), host("b", 1, two1), host("c", 1, 2*two1)},
			map[string]int{"a": 2, "b": 2, "c": 4}},
		{"all M micro-batches in flight need more", ExpertOptions{},
			[]Peer{host("a", 1, two1), host("b", 1, two1), host("c", 1, 2*two1)}, nil},
		{"too little", ExpertOptions{},
			[]Peer{host("a", 1, 3*one), host("b", 5, 3*one), host("c", 1, 2*one-1)}, nil},
		{"one block per host", ExpertOptions{OneBlockPerHost: true},
			[]Peer{host("a", 1, 10*one), host("b", 1, 10*one), host("c", 1, 10*one)},
			map[string]int{"a": 2, "b": 4, "c": 2}},
		{"one block per host, one host", ExpertOptions{OneBlockPerHost: true},
			[]Peer{host("a", 1, 10*one)}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := PlaceExperts(prof, nil, tc.hosts, tc.opt)
			if tc.want == nil {
				if !errors.Is(err, ErrNoPlan) || !strings.Contains(err.Error(), "add hosts") {
					t.Fatalf("got %v, %v; want ErrNoPlan naming the fix", pl, err)
				}
				if !KeepExpertsLocal(prof, tc.hosts, tc.opt) {
					t.Error("KeepExpertsLocal = false where PlaceExperts fails")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkPlacement(t, prof, tc.opt, tc.hosts, pl)
			got := map[string]int{}
			for _, p := range pl {
				got[p.Peers[0]]++
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("experts per host %v, want %v", got, tc.want)
			}
			if KeepExpertsLocal(prof, tc.hosts, tc.opt) {
				t.Error("KeepExpertsLocal = true where PlaceExperts succeeds")
			}
		})
	}
	if !KeepExpertsLocal(prof, nil, ExpertOptions{}) {
		t.Error("KeepExpertsLocal without spare peers = false")
	}
	if !KeepExpertsLocal(unitExperts(nil, 4), []Peer{host("a", 1, 1<<30)}, ExpertOptions{}) {
		t.Error("KeepExpertsLocal without MoE blocks = false")
	}
}

func TestPlaceExpertsReplication(t *testing.T) {
	prof := unitExperts([]int{5}, 4)
	four := []Peer{host("d", 1, 1<<30), host("c", 1, 1<<30), host("b", 1, 1<<30), host("a", 1, 1<<30)}
	// Host f is three times as fast: it would carry 3/4 of the load if both finished at once,
	// so that is the fair share.
	two := []Peer{host("s", 1, 1<<30), host("f", 3, 1<<30)}
	tests := []struct {
		name       string
		loads      []float64
		hosts      []Peer
		above      float64
		replicated bool
	}{
		// Fair share (2+3)/4 = 1.25 tokens; 1.5 × 1.25 = 1.875 < 2.
		{"above", []float64{2, 1, 1, 1}, four, 1.5, true},
		// 1.5 × 4.75/4 = 1.78125 > 1.75.
		{"below", []float64{1.75, 1, 1, 1}, four, 1.5, false},
		{"disabled", []float64{100, 1, 1, 1}, four, 0, false},
		{"one host", []float64{100, 1, 1, 1}, four[:1], 1.5, false},
		// 1.2 × 11 × 3/4 = 9.9 < 10; 1.2 × 9 × 3/4 = 8.1 > 8.
		{"fast host's share, above", []float64{10, 1, 0, 0}, two, 1.2, true},
		{"fast host's share, below", []float64{8, 1, 0, 0}, two, 1.2, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			loads := ExpertLoad{5: tc.loads}
			opt := ExpertOptions{ReplicateAbove: tc.above}
			pl, err := PlaceExperts(prof, loads, tc.hosts, opt)
			if err != nil {
				t.Fatal(err)
			}
			checkPlacement(t, prof, opt, tc.hosts, pl)
			if got := len(pl[0].Peers) == 2; got != tc.replicated {
				t.Fatalf("expert 0 on %v: replicated %v, want %v", pl[0].Peers, got, tc.replicated)
			}
			for _, p := range pl[1:] {
				if len(p.Peers) != 1 {
					t.Errorf("cool expert %d replicated on %v", p.Expert, p.Peers)
				}
			}
		})
	}

	// A job of one micro-batch replicates nothing: a replica is sent the micro-batches of half
	// the gradient tree's root, and one micro-batch has no second half.
	one := prof
	one.MicroBatches = 1
	if pl, err := PlaceExperts(one, ExpertLoad{5: {100, 1, 1, 1}}, four, ExpertOptions{ReplicateAbove: 1.5}); err != nil {
		t.Fatal(err)
	} else if len(pl[0].Peers) != 1 {
		t.Errorf("one micro-batch: hot expert replicated on %v", pl[0].Peers)
	}

	// Each replica carries half: with loads 10, 1, 1, 1 on four hosts, the shards are 5, 5, 1, 1,
	// 1; replica 0 goes first, to a, replica 1 to b, and the cool experts to c, d, c.
	loads := ExpertLoad{5: {10, 1, 1, 1}}
	opt := ExpertOptions{ReplicateAbove: 1.5}
	pl, err := PlaceExperts(prof, loads, four, opt)
	if err != nil {
		t.Fatal(err)
	}
	want := []ExpertPlacement{{5, 0, []string{"a", "b"}}, {5, 1, []string{"c"}}, {5, 2, []string{"d"}}, {5, 3, []string{"c"}}}
	if !reflect.DeepEqual(pl, want) {
		t.Fatalf("got %v, want %v", pl, want)
	}
	secs, err := ExpertHostSeconds(prof, pl, loads, four, opt)
	if err != nil {
		t.Fatal(err)
	}
	if w := map[string]float64{"a": 5, "b": 5, "c": 2, "d": 1}; !reflect.DeepEqual(secs, w) {
		t.Errorf("seconds per host %v, want %v", secs, w)
	}

	// Without memory for the replicas (one shard per host, five shards), experts stay whole.
	tight := []Peer{host("a", 1, int64(wholeMem(prof, 0))), host("b", 1, int64(wholeMem(prof, 0))),
		host("c", 1, int64(wholeMem(prof, 0))), host("d", 1, int64(wholeMem(prof, 0)))}
	pl, err = PlaceExperts(prof, loads, tight, opt)
	if err != nil {
		t.Fatal(err)
	}
	checkPlacement(t, prof, opt, tight, pl)
	if len(pl[0].Peers) != 1 {
		t.Errorf("replicated on %v without memory for the replicas", pl[0].Peers)
	}
}

func TestExpertShards(t *testing.T) {
	pl := []ExpertPlacement{
		{1, 0, []string{"a"}},
		{1, 1, []string{"b", "a"}},
		{1, 2, []string{"b"}},
		{3, 0, []string{"a"}},
		{3, 1, []string{"c", "b"}},
	}
	want := map[string][]ExpertShardSpec{
		"a": {{Block: 1, Experts: []int{0, 1}, Replicas: []int{-1, 1}}, {Block: 3, Experts: []int{0}, Replicas: []int{-1}}},
		"b": {{Block: 1, Experts: []int{1, 2}, Replicas: []int{0, -1}}, {Block: 3, Experts: []int{1}, Replicas: []int{1}}},
		"c": {{Block: 3, Experts: []int{1}, Replicas: []int{0}}},
	}
	if got := ExpertShards(pl); !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

func TestPlaceExpertsBadInput(t *testing.T) {
	prof := unitExperts([]int{1}, 2)
	ok := []Peer{host("a", 1, 1<<30)}
	tests := []struct {
		name  string
		prof  ExpertProfile
		loads ExpertLoad
		hosts []Peer
		opt   ExpertOptions
	}{
		{"duplicate host", prof, nil, []Peer{host("a", 1, 1), host("a", 1, 1)}, ExpertOptions{}},
		{"no id", prof, nil, []Peer{host("", 1, 1)}, ExpertOptions{}},
		{"zero speed", prof, nil, []Peer{host("a", 0, 1)}, ExpertOptions{}},
		{"load for a dense block", prof, ExpertLoad{0: {1, 1}}, ok, ExpertOptions{}},
		{"NaN load", prof, ExpertLoad{1: {1, math.NaN()}}, ok, ExpertOptions{}},
		{"short load", prof, ExpertLoad{1: {1}}, ok, ExpertOptions{}},
		{"negative threshold", prof, nil, ok, ExpertOptions{ReplicateAbove: -1}},
		{"replicated experts for pipeline replicas", prof, nil, ok, ExpertOptions{ReplicateAbove: 2, Runs: [][2]int{{0, 1}, {1, 2}}}},
		{"fewer in flight for pipeline replicas", prof, nil, ok, ExpertOptions{InFlight: 1, Runs: [][2]int{{0, 1}, {1, 2}}}},
		{"a run beyond M", prof, nil, ok, ExpertOptions{Runs: [][2]int{{0, 1}, {1, 3}}}},
		{"an empty run", prof, nil, ok, ExpertOptions{Runs: [][2]int{{0, 2}, {2, 2}}}},
		{"top_k above E", unitExperts([]int{1}, 2), nil, ok, ExpertOptions{}},
	}
	tests[len(tests)-1].prof.TopK = 3
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := PlaceExperts(tc.prof, tc.loads, tc.hosts, tc.opt); !errors.Is(err, ErrBadInput) {
				t.Errorf("got %v, want ErrBadInput", err)
			}
		})
	}
}

// driftSetup is 2 MoE blocks of 4 experts, uniform, on 4 equal hosts: two experts each.
func driftSetup(t *testing.T) (ExpertProfile, []Peer, ExpertOptions, []ExpertPlacement) {
	t.Helper()
	prof := unitExperts([]int{1, 3}, 4)
	hosts := []Peer{host("a", 1, 1<<30), host("b", 1, 1<<30), host("c", 1, 1<<30), host("d", 1, 1<<30)}
	opt := ExpertOptions{ReplicateAbove: 1.5}
	pl, err := PlaceExperts(prof, nil, hosts, opt)
	if err != nil {
		t.Fatal(err)
	}
	return prof, hosts, opt, pl
}

func TestReplaceExpertsDrift(t *testing.T) {
	const threshold = 0.1
	prof, hosts, opt, current := driftSetup(t)
	u := prof.uniformLoad()
	moveBytes := int64(12 * prof.Params)

	t.Run("barely changed", func(t *testing.T) {
		r := testRand(t)
		for range 50 {
			loads := ExpertLoad{}
			for _, b := range prof.Blocks {
				for range prof.Experts {
					loads[b] = append(loads[b], u*(0.98+0.04*r.Float64()))
				}
			}
			need, err := NeedsExpertReplacement(prof, current, loads, hosts, opt, threshold)
			if err != nil || need {
				t.Fatalf("loads %v: needs replacement %v, %v", loads, need, err)
			}
			pl, moved, err := ReplaceExperts(prof, current, loads, hosts, opt, threshold)
			if err != nil || moved != 0 || !reflect.DeepEqual(pl, current) {
				t.Fatalf("loads %v: replaced by %v moving %d bytes (%v)", loads, pl, moved, err)
			}
		}
	})

	t.Run("one expert hot", func(t *testing.T) {
		loads := UniformExpertLoad(prof)
		loads[1][0] = 6 * u // 6/13 of the load: its host becomes the bottleneck
		need, err := NeedsExpertReplacement(prof, current, loads, hosts, opt, threshold)
		if err != nil || !need {
			t.Fatalf("needs replacement %v, %v", need, err)
		}
		fresh, err := PlaceExperts(prof, loads, hosts, opt)
		if err != nil {
			t.Fatal(err)
		}
		pl, moved, err := ReplaceExperts(prof, current, loads, hosts, opt, threshold)
		if err != nil {
			t.Fatal(err)
		}
		checkPlacement(t, prof, opt, hosts, pl)
		got, best := span(hostSeconds(prof, pl, loads, hosts)), span(hostSeconds(prof, fresh, loads, hosts))
		freshMoved := movedBytes(prof, current, fresh)
		t.Logf("makespan %g → %g moving %d bytes; fresh placement %g moving %d bytes: %v",
			span(hostSeconds(prof, current, loads, hosts)), got, moved, best, freshMoved, pl)
		if got > (1+threshold)*best {
			t.Errorf("makespan %g, fresh placement's %g", got, best)
		}
		// Split the hot expert (its new replica) and move one cool expert off its host.
		if moved > 2*moveBytes || moved >= freshMoved {
			t.Errorf("moved %d bytes (%d experts' worth), a fresh placement moves %d", moved, moved/moveBytes, freshMoved)
		}
		if len(pl[0].Peers) != 2 || pl[0].Peers[0] != current[0].Peers[0] {
			t.Errorf("hot expert on %v, want two replicas, replica 0 where it was (%v)", pl[0].Peers, current[0].Peers)
		}
		again, err := NeedsExpertReplacement(prof, pl, loads, hosts, opt, threshold)
		if err != nil || again {
			t.Errorf("the replacement itself needs replacement: %v, %v", again, err)
		}
	})

	t.Run("host gone", func(t *testing.T) {
		left := hosts[:3]
		need, err := NeedsExpertReplacement(prof, current, nil, left, opt, threshold)
		if err != nil || !need {
			t.Fatalf("needs replacement %v, %v", need, err)
		}
		pl, moved, err := ReplaceExperts(prof, current, nil, left, opt, threshold)
		if err != nil {
			t.Fatal(err)
		}
		checkPlacement(t, prof, opt, left, pl)
		for i, p := range pl {
			if current[i].Peers[0] != "d" && !reflect.DeepEqual(p.Peers, current[i].Peers) {
				t.Errorf("expert %d/%d moved from %v to %v", p.Block, p.Expert, current[i].Peers, p.Peers)
			}
		}
		if moved != 2*moveBytes {
			t.Errorf("moved %d bytes, want %d (d's two experts)", moved, 2*moveBytes)
		}
	})
}

// TestReplaceExpertsRandom checks ReplaceExperts against its contract on random placements and
// loads: the result fits, is within the threshold of a fresh placement, and is current itself,
// with nothing moved, exactly when NeedsExpertReplacement says no.
func TestReplaceExpertsRandom(t *testing.T) {
	r := testRand(t)
	for range 300 {
		prof, loads, hosts := randomExpertCase(r, r.IntN(2) == 0)
		opt := ExpertOptions{ReplicateAbove: []float64{0, 1.2, 2}[r.IntN(3)], OneBlockPerHost: r.IntN(4) == 0}
		threshold := []float64{0, 0.05, 0.3}[r.IntN(3)]
		var current []ExpertPlacement
		for _, b := range prof.Blocks {
			for e := range prof.Experts {
				p := ExpertPlacement{Block: b, Expert: e, Peers: []string{hosts[r.IntN(len(hosts))].ID}}
				if len(hosts) > 1 && r.IntN(4) == 0 {
					p.Peers = []string{hosts[0].ID, hosts[1].ID}
				}
				current = append(current, p)
			}
		}
		need, err := NeedsExpertReplacement(prof, current, loads, hosts, opt, threshold)
		if err != nil {
			t.Fatal(err)
		}
		pl, moved, err := ReplaceExperts(prof, current, loads, hosts, opt, threshold)
		if errors.Is(err, ErrNoPlan) {
			continue // one block per host with more blocks than hosts
		}
		if err != nil {
			t.Fatal(err)
		}
		checkPlacement(t, prof, opt, hosts, pl)
		if !need && (moved != 0 || !reflect.DeepEqual(pl, current)) {
			t.Fatalf("no replacement needed, but %v became %v moving %d bytes", current, pl, moved)
		}
		if need && moved == 0 && reflect.DeepEqual(pl, current) {
			t.Fatalf("replacement needed, but %v kept", current)
		}
		fresh, err := PlaceExperts(prof, loads, hosts, opt)
		if err != nil {
			t.Fatal(err)
		}
		got, best := span(hostSeconds(prof, pl, loads, hosts)), span(hostSeconds(prof, fresh, loads, hosts))
		if got > (1+threshold)*best*(1+1e-12) {
			t.Fatalf("loads %v hosts %v: current %v replaced by %v, makespan %g; fresh %v, %g",
				loads, hosts, current, pl, got, fresh, best)
		}
	}
}

// Two native workers and two browser tabs that hold no stage take the default model's 8 experts.
// Expert 0 of block 3 got most of that block's tokens lately: it is split into two replicas on
// the native workers, and the tabs, ten times slower, take a light expert each.
func ExamplePlaceExperts() {
	prof, err := NewExpertProfile(model.DefaultConfig(), 4, 4) // batch 16 in 4 micro-batches
	if err != nil {
		panic(err)
	}
	spare := []Peer{
		{ID: "native-3", GFLOPS: 20, MemoryBytes: 8 << 30, LinkBytesPerS: 1e8},
		{ID: "native-4", GFLOPS: 20, MemoryBytes: 8 << 30, LinkBytesPerS: 1e8},
		{ID: "tab-1", GFLOPS: 2, MemoryBytes: 1 << 30, LinkBytesPerS: 1e7},
		{ID: "tab-2", GFLOPS: 2, MemoryBytes: 1 << 30, LinkBytesPerS: 1e7},
	}
	opt := ExpertOptions{ReplicateAbove: 1.2}
	if KeepExpertsLocal(prof, spare, opt) {
		fmt.Println("experts stay with their stages")
		return
	}
	loads, err := NewExpertLoad(prof, []RouterCounts{{Block: 3, Tokens: []int64{7000, 500, 400, 292}}})
	if err != nil {
		panic(err)
	}
	pl, err := PlaceExperts(prof, loads, spare, opt)
	if err != nil {
		panic(err)
	}
	for _, p := range pl {
		fmt.Printf("block %d expert %d on %v\n", p.Block, p.Expert, p.Peers)
	}
	secs, err := ExpertHostSeconds(prof, pl, loads, spare, opt)
	if err != nil {
		panic(err)
	}
	busiest := 0.0
	for _, s := range secs {
		busiest = max(busiest, s)
	}
	fmt.Printf("busiest host ≈ %.2f s per step\n", busiest)
	// Output:
	// block 1 expert 0 on [native-3]
	// block 1 expert 1 on [native-4]
	// block 1 expert 2 on [native-3]
	// block 1 expert 3 on [native-4]
	// block 3 expert 0 on [native-3 native-4]
	// block 3 expert 1 on [tab-1]
	// block 3 expert 2 on [tab-2]
	// block 3 expert 3 on [native-3]
	// busiest host ≈ 1.04 s per step
}

func TestReplaceExpertsEdges(t *testing.T) {
	prof := unitExperts([]int{1}, 2)
	hosts := []Peer{host("a", 1, 1<<30), host("b", 1, 1<<30)}
	good := []ExpertPlacement{{1, 0, []string{"a"}}, {1, 1, []string{"b"}}}
	bad := []struct {
		name      string
		current   []ExpertPlacement
		threshold float64
	}{
		{"unknown block", append(slices.Clone(good), ExpertPlacement{2, 0, []string{"a"}}), 0.1},
		{"unknown expert", append(slices.Clone(good), ExpertPlacement{1, 2, []string{"a"}}), 0.1},
		{"placed twice", append(slices.Clone(good), ExpertPlacement{1, 1, []string{"a"}}), 0.1},
		{"three replicas", []ExpertPlacement{{1, 0, []string{"a", "b", "c"}}, {1, 1, []string{"b"}}}, 0.1},
		{"no peer", []ExpertPlacement{{1, 0, nil}, {1, 1, []string{"b"}}}, 0.1},
		{"both replicas on one host", []ExpertPlacement{{1, 0, []string{"a", "a"}}, {1, 1, []string{"b"}}}, 0.1},
		{"negative threshold", good, -0.1},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NeedsExpertReplacement(prof, tc.current, nil, hosts, ExpertOptions{}, tc.threshold); !errors.Is(err, ErrBadInput) {
				t.Errorf("NeedsExpertReplacement: got %v, want ErrBadInput", err)
			}
			if _, _, err := ReplaceExperts(prof, tc.current, nil, hosts, ExpertOptions{}, tc.threshold); !errors.Is(err, ErrBadInput) {
				t.Errorf("ReplaceExperts: got %v, want ErrBadInput", err)
			}
			if _, err := ExpertHostSeconds(prof, tc.current, nil, hosts, ExpertOptions{}); tc.threshold >= 0 && !errors.Is(err, ErrBadInput) {
				t.Errorf("ExpertHostSeconds: got %v, want ErrBadInput", err)
			}
		})
	}

	// Hosts whose memory holds the eight experts only one way with one block per host: LPT's
	// reservation misses it, the current placement has it, and keeps it.
	tight := unitExperts([]int{0, 1}, 4)
	one := int64(wholeMem(tight, 0))
	hosts4 := []Peer{host("h0", 1, one), host("h1", 2, 3*one), host("h2", 4, 2*one), host("h3", 3, 2*one)}
	loads := ExpertLoad{0: {17, 18, 11, 19}, 1: {13, 17, 9, 17}}
	current := []ExpertPlacement{{0, 0, []string{"h0"}}, {0, 1, []string{"h1"}}, {0, 2, []string{"h1"}}, {0, 3, []string{"h1"}},
		{1, 0, []string{"h2"}}, {1, 1, []string{"h2"}}, {1, 2, []string{"h3"}}, {1, 3, []string{"h3"}}}
	opt := ExpertOptions{OneBlockPerHost: true}
	if _, err := PlaceExperts(tight, loads, hosts4, opt); !errors.Is(err, ErrNoPlan) {
		t.Fatalf("fresh placement: %v, want ErrNoPlan (if the reservation got better, find another case)", err)
	}
	need, err := NeedsExpertReplacement(tight, current, loads, hosts4, opt, 0.1)
	if err != nil || need {
		t.Errorf("needs replacement %v, %v; want false", need, err)
	}
	pl, moved, err := ReplaceExperts(tight, current, loads, hosts4, opt, 0.1)
	if err != nil || moved != 0 || !reflect.DeepEqual(pl, current) {
		t.Errorf("replaced by %v moving %d bytes (%v), want kept", pl, moved, err)
	}

	// A host whose memory shrank loses its experts.
	shrunk := []Peer{host("a", 1, 1<<30), host("b", 1, 0)}
	pl, moved, err = ReplaceExperts(prof, good, nil, shrunk, ExpertOptions{}, 0.1)
	if want := []ExpertPlacement{{1, 0, []string{"a"}}, {1, 1, []string{"a"}}}; err != nil || !reflect.DeepEqual(pl, want) || moved != 12*prof.Params {
		t.Errorf("got %v moving %d bytes (%v), want %v moving %d", pl, moved, err, want, 12*prof.Params)
	}
}

// TestExpertsPay: remote experts pay when their hosts get through a block's tokens no later
// than its stage would on its own; hosts in parallel can beat the stage, a slow one cannot.
func TestExpertsPay(t *testing.T) {
	prof := unitExperts([]int{1, 3}, 4) // 32 tokens per expert per step: 32 s at 1 GFLOPS
	stages := map[int]Peer{1: host("s0", 4, 1<<40), 3: host("s1", 4, 1<<40)}
	opt := ExpertOptions{OneBlockPerHost: true}
	// At home, each block's 4 experts take its 4-GFLOPS stage 4·32/4 = 32 s per step.
	tests := []struct {
		name  string
		hosts []Peer
		want  bool
	}{
		{"one host per block as fast as the stage", []Peer{host("a", 4, 1<<40), host("b", 4, 1<<40)}, true},
		{"two hosts per block as fast as the stage", []Peer{host("a", 4, 1<<40), host("b", 4, 1<<40), host("c", 4, 1<<40), host("d", 4, 1<<40)}, true},
		{"one host per block, slower than the stage", []Peer{host("a", 3.9, 1<<40), host("b", 4, 1<<40)}, false},
		{"four hosts per block, each a tenth of the stage", func() []Peer {
			var hs []Peer
			for i := range 8 {
				hs = append(hs, host(fmt.Sprintf("h%d", i), 0.4, 1<<40))
			}
			return hs
		}(), false},
		{"a slow link", []Peer{{ID: "a", GFLOPS: 4, MemoryBytes: 1 << 40, LinkBytesPerS: 1}, host("b", 4, 1<<40)}, false},
	}
	prof.SendBytesPerToken = 8
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pl, err := PlaceExperts(prof, nil, tt.hosts, opt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := ExpertsPay(prof, pl, nil, tt.hosts, stages, opt)
			if err != nil || got != tt.want {
				t.Errorf("ExpertsPay = %v, %v; want %v (placement %v)", got, err, tt.want, pl)
			}
		})
	}
	pl, _ := PlaceExperts(prof, nil, tests[0].hosts, opt)
	if _, err := ExpertsPay(prof, pl, nil, tests[0].hosts, map[int]Peer{1: stages[1]}, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("without block 3's stage: %v, want ErrBadInput", err)
	}
}

// TestCPUFallbackTabs: the default job over two-core native workers and browser tabs computing on
// the CPU fallback, which measure about 1/45 of a native worker: the tabs get no stage and no
// experts — any share they could take would be the step's slowest — and stay standbys, while tabs
// as fast as a native worker (as WebGPU may make them) do get work.
func TestCPUFallbackTabs(t *testing.T) {
	cfg := model.DefaultConfig()
	const B, M = 16, 4
	prof, err := NewProfile(cfg, B/M)
	if err != nil {
		t.Fatal(err)
	}
	eprof, err := NewExpertProfile(cfg, B/M, M)
	if err != nil {
		t.Fatal(err)
	}
	opt := ExpertOptions{OneBlockPerHost: true, ReplicateAbove: 2}
	const native = 200.0 // client.MeasureGFLOPS of a two-core AVX-512 worker
	for _, tc := range []struct {
		natives, tabs int
		tabGFLOPS     float64
		work          bool // whether the tabs should get a stage or experts
	}{
		{1, 1, native / 45, false},
		{2, 2, native / 45, false},
		{2, 4, native / 45, false},
		{3, 8, native / 45, false},
		{2, 4, native, true},
	} {
		t.Run(fmt.Sprintf("%d natives, %d tabs at %.3g GFLOPS", tc.natives, tc.tabs, tc.tabGFLOPS), func(t *testing.T) {
			var peers []Peer
			for i := range tc.natives {
				peers = append(peers, Peer{ID: fmt.Sprintf("native-%d", i), GFLOPS: native, MemoryBytes: 8 << 30, LinkBytesPerS: 1e12})
			}
			for i := range tc.tabs {
				peers = append(peers, Peer{ID: fmt.Sprintf("tab-%d", i), GFLOPS: tc.tabGFLOPS, MemoryBytes: 1 << 30, LinkBytesPerS: 1e12})
			}
			byID := func(id string) Peer { return peers[slices.IndexFunc(peers, func(p Peer) bool { return p.ID == id })] }
			plan, err := Partition(prof, peers, Options{MicroBatches: M})
			if err != nil {
				t.Fatal(err)
			}
			working := 0
			stages := map[int]Peer{}
			for _, st := range plan.Stages {
				if strings.HasPrefix(st.Peer, "tab") {
					working++
				}
				for b := st.Begin; b < st.End; b++ {
					stages[b] = byID(st.Peer)
				}
			}
			var spare []Peer
			for _, id := range plan.Standby {
				spare = append(spare, byID(id))
			}
			// The coordinator's rule (coordinator/job.go, placeExperts), on all the spare peers.
			if !KeepExpertsLocal(eprof, spare, opt) {
				pl, err := PlaceExperts(eprof, nil, spare, opt)
				if err != nil {
					t.Fatal(err)
				}
				pays, err := ExpertsPay(eprof, pl, nil, spare, stages, opt)
				if err != nil {
					t.Fatal(err)
				}
				secs, _ := ExpertHostSeconds(eprof, pl, nil, spare, opt)
				t.Logf("step %.3f s with %d stages; experts on the spare peers: %.3f s per step at the busiest, pays: %v",
					plan.StepSeconds, len(plan.Stages), span(secs), pays)
				if pays {
					for _, p := range pl {
						for _, id := range p.Peers {
							if strings.HasPrefix(id, "tab") {
								working++
							}
						}
					}
				}
			}
			if got := working > 0; got != tc.work {
				t.Errorf("tabs at work: %v, want %v (stages %+v, standby %v)", got, tc.work, plan.Stages, plan.Standby)
			}
		})
	}
}

// TestExpertsPayReplicas: hosts serving every pipeline replica compute the whole step's expert
// work of their block, and pay only when they take no longer than every replica's stage would
// for its own share at home — against the replica whose share would be done first, not the
// slowest.
func TestExpertsPayReplicas(t *testing.T) {
	prof := unitExperts([]int{1}, 4)
	prof.MicroBatches = 4 // 64 tokens per expert per step, 256 for the block: 256 s at 1 GFLOPS
	runs := [][2]int{{0, 3}, {3, 4}}
	opt := ExpertOptions{OneBlockPerHost: true, Runs: runs}
	stage := func(id string, gflops float64, n int) ReplicaStage {
		return ReplicaStage{Peer: host(id, gflops, 1<<40), MicroBatches: n}
	}
	one := func(gflops float64) []Peer { return []Peer{host("h", gflops, 1<<40)} }
	tests := []struct {
		name   string
		stages []ReplicaStage
		hosts  []Peer
		want   bool
	}{
		// Replica 0 computes 3 of 4 micro-batches at 4 GFLOPS: 3/4·256/4 = 48 s at home;
		// replica 1 computes 1 at 4 GFLOPS: 16 s. A host takes 256/G s for both.
		{"unequal shares, as fast as the lighter replica needs", []ReplicaStage{stage("r0", 4, 3), stage("r1", 4, 1)}, one(16), true},
		{"unequal shares, a little slower", []ReplicaStage{stage("r0", 4, 3), stage("r1", 4, 1)}, one(15.9), false},
		{"unequal shares, fast enough for the heavier replica only", []ReplicaStage{stage("r0", 4, 3), stage("r1", 4, 1)}, one(6), false},
		{"unequal shares, two hosts in parallel", []ReplicaStage{stage("r0", 4, 3), stage("r1", 4, 1)},
			[]Peer{host("a", 8, 1<<40), host("b", 8, 1<<40)}, true},
		// Shares by speed: replica 0 at 8 GFLOPS takes 3 (24 s at home), replica 1 at 2 GFLOPS
		// takes 1 (32 s): the faster replica's 24 s is the bar, 256/24 ≈ 10.67 GFLOPS.
		{"shares by speed, as fast as the faster replica needs", []ReplicaStage{stage("r0", 8, 3), stage("r1", 2, 1)}, one(10.7), true},
		{"shares by speed, fast enough for the slower replica only", []ReplicaStage{stage("r0", 8, 3), stage("r1", 2, 1)}, one(10.6), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pl, err := PlaceExperts(prof, nil, tt.hosts, opt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := ExpertsPayReplicas(prof, pl, nil, tt.hosts, map[int][]ReplicaStage{1: tt.stages}, opt)
			if err != nil || got != tt.want {
				t.Errorf("ExpertsPayReplicas = %v, %v; want %v (placement %v)", got, err, tt.want, pl)
			}
		})
	}
	pl, _ := PlaceExperts(prof, nil, one(16), opt)
	for name, stages := range map[string]map[int][]ReplicaStage{
		"no stage for the block":        {},
		"shares short of M":             {1: {stage("r0", 4, 2), stage("r1", 4, 1)}},
		"a replica of no micro-batches": {1: {stage("r0", 4, 4), stage("r1", 4, 0)}},
		"a stage without a speed":       {1: {stage("r0", 4, 3), stage("r1", 0, 1)}},
	} {
		if _, err := ExpertsPayReplicas(prof, pl, nil, one(16), stages, opt); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: %v, want ErrBadInput", name, err)
		}
	}
}

// TestExpertMemoryRuns: a host of several pipeline replicas (ExpertOptions.Runs) is given
// experts by the very test the worker applies to its Assign (client checkMemory: n experts fit
// when n ≤ ⌊offer / ExpertShardMemoryRuns(…, 1, runs, …)⌋), to the byte; more runs' gradient-tree
// nodes need more memory.
func TestExpertMemoryRuns(t *testing.T) {
	cfg := model.TinyConfig() // 2 MoE blocks of 4 experts
	const microBatch, M = 2, 4
	job := ShardJob{EvalRows: 16}
	_, prof, err := job.Profiles(cfg, microBatch, M)
	if err != nil {
		t.Fatal(err)
	}
	prev := 0.0
	for _, runs := range [][][2]int{nil, {{0, 2}, {2, 4}}, {{0, 3}, {3, 4}}, {{0, 1}, {1, 2}, {2, 3}, {3, 4}}} {
		per, err := ExpertShardMemoryRuns(cfg, microBatch, M, 1, runs, job)
		if err != nil {
			t.Fatal(err)
		}
		if per < prev {
			t.Errorf("runs %v: %.0f bytes an expert, less than %.0f for fewer nodes", runs, per, prev)
		}
		prev = per
		workerFits := func(offer int64) bool { return !(float64(prof.Experts) > math.Floor(float64(offer)/per)) }
		// The least offer the worker accepts for a whole block's experts.
		least := int64(math.Ceil(float64(prof.Experts) * per))
		for workerFits(least - 1) {
			least--
		}
		for !workerFits(least) {
			least++
		}
		opt := ExpertOptions{OneBlockPerHost: true, Runs: runs}
		for _, offer := range []int64{least - 1, least} {
			hosts := []Peer{host("a", 1, offer), host("b", 1, offer)}
			pl, err := PlaceExperts(prof, nil, hosts, opt)
			if got, want := err == nil, workerFits(offer); got != want {
				t.Errorf("runs %v, %d bytes a host: placed %v (%v), the worker accepts %v", runs, offer, got, err, want)
			}
			if err != nil && !strings.Contains(err.Error(), "add hosts") {
				t.Errorf("runs %v: %v, want an error naming the fix", runs, err)
			}
			if err == nil {
				checkPlacement(t, prof, ExpertOptions{OneBlockPerHost: true}, hosts, pl)
			}
		}
	}
}

// TestReplaceExpertsForReplicas: a placement made for one pipeline, with a replicated expert, is
// revised for hosts of pipeline replicas (ExpertOptions.Runs) into one where every expert is
// whole; the replicated one is not intact there.
func TestReplaceExpertsForReplicas(t *testing.T) {
	prof := unitExperts([]int{1}, 2)
	prof.MicroBatches = 4
	hosts := []Peer{host("a", 1, 1<<30), host("b", 1, 1<<30)}
	current := []ExpertPlacement{{1, 0, []string{"a", "b"}}, {1, 1, []string{"b"}}}
	opt := ExpertOptions{Runs: [][2]int{{0, 2}, {2, 4}}}
	if need, err := NeedsExpertReplacement(prof, current, nil, hosts, opt, 0.1); err != nil || !need {
		t.Errorf("NeedsExpertReplacement = %v, %v; want true", need, err)
	}
	if _, err := ExpertHostSeconds(prof, current, nil, hosts, opt); !errors.Is(err, ErrBadInput) {
		t.Errorf("ExpertHostSeconds of a replicated expert for replicas: %v, want ErrBadInput", err)
	}
	pl, _, err := ReplaceExperts(prof, current, nil, hosts, opt, 0.1)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pl {
		if len(p.Peers) != 1 {
			t.Errorf("expert %d/%d on %v: want one host", p.Block, p.Expert, p.Peers)
		}
	}
	checkPlacement(t, prof, ExpertOptions{}, hosts, pl)
	// For one pipeline the same placement fits.
	if _, err := ExpertHostSeconds(prof, current, nil, hosts, ExpertOptions{}); err != nil {
		t.Errorf("ExpertHostSeconds of a replicated expert for one pipeline: %v", err)
	}
}
