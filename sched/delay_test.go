package sched

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// delayPeers are n peers that each hold the default model, of slightly different speeds, on
// uplinks of link bytes/s: slow enough that an outer exchange is exposed.
func delayPeers(n int, link float64) []Peer {
	var peers []Peer
	for i := 0; i < n; i++ {
		peers = append(peers, Peer{ID: fmt.Sprintf("p%02d", i), GFLOPS: 100 + 10*float64(i), MemoryBytes: 4 << 30, LinkBytesPerS: link})
	}
	return peers
}

// A delay hides the outer exchange behind inner steps of compute (ReplicaOptions.Delay): the
// same plan's exposed synchronisation per step falls from the exchange's X/H to
// max(0, X − D·T)/H, T its compute, and its step time with it; a delay whose D steps outlast X
// leaves nothing exposed. Delay 0 is the estimate PlanReplicas planned with, bit for bit.
func TestOuterDelayHidesExchange(t *testing.T) {
	prof := mustProfile(t, model.DefaultConfig(), 2)
	for _, tc := range []struct {
		name string
		link float64
		opt  ReplicaOptions
	}{
		{"shared", 1e7, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 50, Int8: true}},
		{"own", 5e6, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 50, Int8: true, OwnBatches: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peers := delayPeers(8, tc.link)
			p, err := PlanReplicas(prof, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			e0, err := EstimateReplicas(prof, p, peers, tc.opt)
			if err != nil {
				t.Fatal(err)
			}
			if e0.Replicas < 2 || !(e0.SyncSeconds > 0) || e0.HiddenSeconds != 0 || e0.StepSeconds != p.StepSeconds {
				t.Fatalf("without a delay: %+v, plan step %v s; want 2 or more replicas whose exchange is exposed", e0, p.StepSeconds)
			}
			H := float64(tc.opt.Every)
			cover := int(math.Ceil(H * e0.SyncSeconds / e0.ComputeSeconds)) // the least delay that hides X
			if cover < 2 || cover >= tc.opt.Every {
				t.Fatalf("the exchange needs a delay of %d steps to hide; the test wants 2 to %d", cover, tc.opt.Every-1)
			}
			for _, D := range []int{1, cover / 2, cover, tc.opt.Every - 1} {
				opt := tc.opt
				opt.Delay = D
				e, err := EstimateReplicas(prof, p, peers, opt)
				if err != nil {
					t.Fatal(err)
				}
				want := max(0, H*e0.SyncSeconds-float64(D)*e0.ComputeSeconds) / H
				switch {
				case e.Replicas != e0.Replicas || e.ComputeSeconds != e0.ComputeSeconds:
					t.Errorf("delay %d: %+v; the same plan's compute was %+v", D, e, e0)
				case math.Abs(e.SyncSeconds-want) > 1e-12*e0.SyncSeconds:
					t.Errorf("delay %d: exposed sync %v s, want max(0, %v·%v − %d·%v)/%v = %v", D, e.SyncSeconds, H, e0.SyncSeconds, D, e0.ComputeSeconds, H, want)
				case math.Abs(e.SyncSeconds+e.HiddenSeconds-e0.SyncSeconds) > 1e-12*e0.SyncSeconds:
					t.Errorf("delay %d: exposed %v s + hidden %v s, want the whole exchange's %v s", D, e.SyncSeconds, e.HiddenSeconds, e0.SyncSeconds)
				case !(e.StepSeconds < e0.StepSeconds) || !(e.TokensPerS > e0.TokensPerS):
					t.Errorf("delay %d: step %v s, %v tokens/s; without %v s, %v tokens/s", D, e.StepSeconds, e.TokensPerS, e0.StepSeconds, e0.TokensPerS)
				case D >= cover && (e.SyncSeconds != 0 || e.StepSeconds != e.ComputeSeconds):
					t.Errorf("delay %d covers the exchange: exposed sync %v s, step %v s", D, e.SyncSeconds, e.StepSeconds)
				}
			}
			// The planner plans with the same estimate.
			opt := tc.opt
			opt.Delay = cover
			pd, ed := planAndEstimate(t, prof, peers, opt)
			if ed.StepSeconds != pd.StepSeconds || !(ed.TokensPerS > e0.TokensPerS) {
				t.Errorf("planned with delay %d: step %v s, estimated %+v; without a delay %v tokens/s", cover, pd.StepSeconds, ed, e0.TokensPerS)
			}
		})
	}
}

// An exchange that costs more than a second replica gains keeps a plan of shared batches on one
// replica; hidden behind a delay it no longer does, and the planner takes the replicas.
func TestOuterDelayPlansMoreReplicas(t *testing.T) {
	prof := mustProfile(t, model.DefaultConfig(), 2)
	peers := delayPeers(8, 4e6)
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true}
	p0, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	e0, err := EstimateReplicas(prof, p0, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	opt.Delay = opt.Every - 1
	_, ed := planAndEstimate(t, prof, peers, opt)
	if e0.Replicas != 1 || ed.Replicas < 2 || !(ed.TokensPerS > e0.TokensPerS) || !(ed.HiddenSeconds > 0) {
		t.Errorf("without a delay %+v; with a delay of %d %+v: want 1 replica, then more and faster", e0, opt.Delay, ed)
	}
}

// A delay belongs to outer mode and is below Every; every entry point refuses another.
func TestOuterDelayValidation(t *testing.T) {
	prof := mustProfile(t, model.DefaultConfig(), 2)
	peers := delayPeers(4, 1e7)
	for _, opt := range []ReplicaOptions{
		{MicroBatches: 4, Sync: SyncOuter, Every: 20, Delay: -1},
		{MicroBatches: 4, Sync: SyncOuter, Every: 20, Delay: 20},
		{MicroBatches: 4, Sync: SyncOuter, Every: 1, Delay: 1},
		{MicroBatches: 4, Sync: SyncStep, Delay: 1},
	} {
		name := fmt.Sprintf("%s/every-%d/delay-%d", opt.Sync, opt.Every, opt.Delay)
		if _, err := PlanReplicas(prof, peers, opt); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: PlanReplicas: %v, want ErrBadInput", name, err)
		}
		if _, _, err := AddReplicas(prof, Plan{}, peers, opt); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: AddReplicas: %v, want ErrBadInput", name, err)
		}
		if _, err := EstimateReplicas(prof, Plan{}, peers, opt); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: EstimateReplicas: %v, want ErrBadInput", name, err)
		}
		if _, err := Simulate(SimConfig{Profile: prof, Options: opt, Peers: 20, Hours: 0.01}); !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: Simulate: %v, want ErrBadInput", name, err)
		}
	}
	if _, err := PlanReplicas(prof, peers, ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Delay: 19}); err != nil {
		t.Errorf("delay 19 of every 20: %v", err)
	}
}

// In the fleet simulator a hidden exchange costs no progress: the same fleet and history, whose
// outer exchange is exposed without a delay, trains more with one.
func TestSimulateDelay(t *testing.T) {
	prof := mustProfile(t, model.DefaultConfig(), 4)
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}
	cfg := SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 0.25, Seed: 42}
	a, err := Simulate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Options.Delay = opt.Every - 1
	d := simulateTwice(t, cfg)
	switch {
	case a.Delay != 0 || d.Delay != opt.Every-1:
		t.Errorf("delays recorded %d and %d, want 0 and %d", a.Delay, d.Delay, opt.Every-1)
	case !(a.Initial.SyncSeconds > 0) || a.Initial.HiddenSeconds != 0:
		t.Errorf("without a delay the first plan's exchange is not exposed: %+v", a.Initial)
	case !(d.Initial.HiddenSeconds > 0) || !(d.Initial.SyncSeconds < a.Initial.SyncSeconds):
		t.Errorf("with a delay the first plan hides nothing: %+v; without %+v", d.Initial, a.Initial)
	case !(d.Goodput > a.Goodput) || !(d.Tokens > a.Tokens) || !(d.InitialGoodput > a.InitialGoodput):
		t.Errorf("goodput %v (first plan %v), %.4g tokens with a delay; %v (%v), %.4g tokens without", d.Goodput, d.InitialGoodput, d.Tokens, a.Goodput, a.InitialGoodput, a.Tokens)
	}
	t.Logf("goodput %.4f without a delay, %.4f with %d", a.Goodput, d.Goodput, d.Delay)
}

// planAndEstimate plans replicas for peers under opt, checks the plan, and estimates it.
func planAndEstimate(t *testing.T, prof Profile, peers []Peer, opt ReplicaOptions) (Plan, Estimate) {
	t.Helper()
	p, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	checkReplicaPlan(t, prof, p, peers, opt)
	e, err := EstimateReplicas(prof, p, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	return p, e
}

// The outer exchange is priced as client/outer.go sends it: of whole-model replicas on equal
// uplinks, each sends every H steps 2·(R−1)/R of its parameters, int8 with a float32 scale per
// model.OuterChunk (OuterWire) — within 0.5% of the reduce-scatter's and the all-gather's bytes,
// segment by segment and signatures included (64 bytes a tensor a message, which the estimate
// leaves out: 0.4% of the default model's at R = 4) — and each of the two message rounds costs the
// slowest one-way latency (RTT/2): an RTT of 200 ms adds 2·0.1/H seconds a step.
func TestOuterExchangePricedAsSent(t *testing.T) {
	cfg := model.DefaultConfig()
	prof := mustProfile(t, cfg, 2)
	const link = 1e7
	peers := delayPeers(4, link)
	for i := range peers {
		peers[i].GFLOPS = 100 // equal replicas
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}
	p, err := PlanReplicas(prof, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	R := len(p.Replicas)
	for _, r := range p.Replicas {
		if len(r.Stages) != 1 {
			t.Fatalf("plan %+v: want whole-model replicas", p.Replicas)
		}
	}
	if R < 3 {
		t.Fatalf("%d replicas, want 3 or more", R)
	}
	e, err := EstimateReplicas(prof, p, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	// What participant me sends, as client/outer.go sends it.
	var most int64
	for me := range R {
		var sent int64
		for _, s := range cfg.Specs() {
			n := s.Size()
			for k := range R {
				lo, hi := model.OuterSegment(n, R, k)
				if lo == hi {
					continue
				}
				l := model.OuterLayout{N: hi - lo, Int8: true}
				b := int64(l.Bytes(0) + l.Bytes(1) + 4*16) // and its signature
				if k == me {
					b *= int64(R - 1)
				}
				sent += b
			}
		}
		most = max(most, sent)
	}
	want := float64(most) / link / float64(opt.Every)
	if math.Abs(e.SyncSeconds-want) > 5e-3*want {
		t.Errorf("%d replicas: exchange priced at %v s a step, the bytes sent take %v s", R, e.SyncSeconds, want)
	}
	opt.RTTSeconds = map[string]float64{}
	for _, q := range peers {
		opt.RTTSeconds[q.ID] = 0.2
	}
	el, err := EstimateReplicas(prof, p, peers, opt)
	if err != nil {
		t.Fatal(err)
	}
	if lat, want := el.SyncSeconds-e.SyncSeconds, 2*0.1/float64(opt.Every); math.Abs(lat-want) > 1e-12 {
		t.Errorf("an RTT of 200 ms adds %v s a step to the exchange, want two rounds of 100 ms every %d steps: %v", lat, opt.Every, want)
	}
}
