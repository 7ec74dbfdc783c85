package sched

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// simulateTwice runs cfg twice and checks that the runs agree: a seed is a fleet and its history.
func simulateTwice(t *testing.T, cfg SimConfig) SimResult {
	t.Helper()
	a, err := Simulate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Simulate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Errorf("two runs of seed %d differ", cfg.Seed)
	}
	return a
}

func TestSimulateFleetDeterministic(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, opt := range []ReplicaOptions{{MicroBatches: 4}, {MicroBatches: 4, Sync: SyncOuter, Every: 20}} {
		t.Run(opt.Sync.String(), func(t *testing.T) {
			cfg := SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 0.5, Seed: 42}
			a := simulateTwice(t, cfg)
			switch {
			case a.Steps <= 0 || a.Goodput <= 0 || a.Goodput > 1 || a.GoodputCapable < a.Goodput:
				t.Errorf("steps %v, goodput %v, capable %v", a.Steps, a.Goodput, a.GoodputCapable)
			case a.Joins == 0 || a.Leaves == 0:
				t.Errorf("no churn: %d joins, %d leaves", a.Joins, a.Leaves)
			case len(a.Samples) < 2 || a.ReplicasMax < 1:
				t.Errorf("%d samples, at most %d replicas", len(a.Samples), a.ReplicasMax)
			}
			cfg.Seed = 43
			c, err := Simulate(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if reflect.DeepEqual(a, c) {
				t.Errorf("seeds 42 and 43 simulate the same")
			}
		})
	}
}

func TestFleetMix(t *testing.T) {
	peers := Fleet(DefaultFleetMix(), 2000, 1, 3600, 5)
	if !reflect.DeepEqual(peers, Fleet(DefaultFleetMix(), 2000, 1, 3600, 5)) {
		t.Fatal("Fleet is not deterministic")
	}
	initial, classes := 0, map[string]int{}
	for _, p := range peers {
		if p.JoinS == 0 {
			initial++
			classes[p.Class]++
		}
		if p.GFLOPS < 1 || p.GFLOPS > 50000 || p.MemoryBytes < 1e9 || p.MemoryBytes > 24e9 ||
			p.LinkBytesPerS < 10e6/8 || p.LinkBytesPerS > 1e9/8 || p.LeaveS <= p.JoinS {
			t.Fatalf("peer out of the mix: %+v", p)
		}
	}
	// About as many arrive in an hour as there are peers (mean lifetime one hour).
	if arrivals := len(peers) - initial; initial != 2000 || arrivals < 1800 || arrivals > 2200 {
		t.Errorf("%d initial peers, %d arrivals in an hour", initial, len(peers)-initial)
	}
	if classes["native-gpu"] < 150 || classes["browser-cpu"] < 800 {
		t.Errorf("classes %v", classes)
	}
}

// TestFleetDataPlaneBound: a simulated peer's upload is bounded by its data plane, as the
// coordinator's replica decision bounds a worker's — a tab's at the data channel's 32 MB/s, a
// native worker's on QUIC at 80 MB/s — and uploads under the bound are the ones drawn.
func TestFleetDataPlaneBound(t *testing.T) {
	mix := DefaultFleetMix()
	quic := slices.Clone(mix)
	for i := range quic {
		quic[i].QUIC = true
	}
	peers := Fleet(mix, 3000, 1, 3600, 5)
	raw := Fleet(quic, 3000, 1, 3600, 5)
	clamped := map[float64]int{}
	for i, p := range peers {
		bound := DataChannelBytesPerS
		if strings.HasPrefix(p.Class, "native") {
			bound = QUICBytesPerS
		}
		// raw bounds every class at QUIC's rate, the highest: under the bound, the draw itself.
		want := min(raw[i].LinkBytesPerS, bound)
		if p.LinkBytesPerS > bound || p.LinkBytesPerS != want {
			t.Fatalf("%s peer %s: upload %.0f B/s, want %.0f (bound %.0f)", p.Class, p.ID, p.LinkBytesPerS, want, bound)
		}
		if p.LinkBytesPerS == bound {
			clamped[bound]++
		}
	}
	// The mix's uploads reach past both bounds: browser GPUs up to 300 Mb/s, natives to 1 Gb/s.
	if clamped[DataChannelBytesPerS] == 0 || clamped[QUICBytesPerS] == 0 {
		t.Errorf("peers at the bounds: %v; want some at each", clamped)
	}
}

// With own batches the simulator keeps more replicas than micro-batches and counts each running
// replica's batch each step (its n_r micro-batches: M or more).
func TestSimulateOwnBatches(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 500, Int8: true, OwnBatches: true}
	cfg := SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 0.5, Seed: 42}
	a := simulateTwice(t, cfg)
	batch := float64(opt.MicroBatches * prof.Tokens)
	most := float64(MaxOwnMicroBatches(opt.MicroBatches, prof.Tokens) * prof.Tokens) // a replica's largest batch
	switch {
	case !a.OwnBatches || a.Sync != "outer":
		t.Errorf("sync %q, own batches %v", a.Sync, a.OwnBatches)
	case a.ReplicasMin <= opt.MicroBatches || a.Initial.Replicas <= opt.MicroBatches:
		t.Errorf("replicas: at least %d, first plan %d; want more than M = %d", a.ReplicasMin, a.Initial.Replicas, opt.MicroBatches)
	case a.Goodput <= 0 || a.Goodput > 1 || a.GoodputCapable < a.Goodput:
		t.Errorf("goodput %v, capable %v", a.Goodput, a.GoodputCapable)
	case a.Tokens < float64(a.ReplicasMin)*a.Steps*batch*0.99 || a.Tokens > float64(a.ReplicasMax)*a.Steps*most*1.01:
		t.Errorf("%.4g tokens in %.4g steps of %d to %d replicas, each M to %v tokens", a.Tokens, a.Steps, a.ReplicasMin, a.ReplicasMax, most)
	}
	// The first plan's estimate counts every replica's batch a step: the slowest's M
	// micro-batches, the faster ones' more.
	if e := a.Initial; e.TokensPerS*e.StepSeconds < float64(e.Replicas)*batch*(1-1e-9) || e.TokensPerS*e.StepSeconds > float64(e.Replicas)*most {
		t.Errorf("first plan: %v tokens/s × %v s for %d replicas of %v to %v tokens", e.TokensPerS, e.StepSeconds, e.Replicas, batch, most)
	}
	shared := cfg
	shared.Options.OwnBatches = false
	s, err := Simulate(shared)
	if err != nil {
		t.Fatal(err)
	}
	if !(a.Tokens > s.Tokens) || s.ReplicasMax > opt.MicroBatches {
		t.Errorf("own batches: %.4g tokens, shared: %.4g tokens with at most %d replicas", a.Tokens, s.Tokens, s.ReplicasMax)
	}
}

// The simulator answers churn as the coordinator does (Decide): in step mode every departure of a
// holder restores from a checkpoint; in outer mode one from a replica during a round drops it, and
// peers standing by or joining staff the dropped replicas again without a checkpoint; only work
// that reached an applied step or outer step counts as synchronised.
func TestSimulateFollowsRuleBook(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, opt := range []ReplicaOptions{{MicroBatches: 4}, {MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}} {
		t.Run(opt.Sync.String(), func(t *testing.T) {
			a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 3, Seed: 42})
			t.Logf("%d replica leaves: %d drops, %d restores; %d grows, %d join replans; goodput %.4f, synchronised %.4f", a.ReplicaLeaves, a.Drops, a.Restores, a.Grows, a.JoinReplans, a.Goodput, a.GoodputSynchronised)
			switch {
			case a.ReplicaLeaves == 0 || a.Drops+a.Restores < a.ReplicaLeaves ||
				opt.Sync == SyncStep && a.Drops+a.Restores != a.ReplicaLeaves:
				// Every departure from a replica drops it or restores; in outer mode a refill's
				// giver lost while the refill gets ready takes the replicas it gave to with it.
				t.Errorf("%d replica leaves: %d drops, %d restores", a.ReplicaLeaves, a.Drops, a.Restores)
			case opt.Sync == SyncStep && a.Drops != 0:
				t.Errorf("step mode dropped %d replicas", a.Drops)
			case opt.Sync == SyncOuter && a.Drops == 0:
				t.Error("outer mode dropped no replica")
			case opt.Sync == SyncOuter && a.Grows == 0:
				// The coordinator staffs dropped replicas again from peers (outerGrowable).
				t.Error("outer mode refilled no dropped replica")
			case !(a.GoodputSynchronised > 0) || a.GoodputSynchronised > a.Goodput*(1+1e-9):
				t.Errorf("goodput %v, synchronised %v", a.Goodput, a.GoodputSynchronised)
			case a.Restores > 0 && !(a.StallSeconds > 0):
				t.Errorf("%d restores stalled %v s", a.Restores, a.StallSeconds)
			}
		})
	}
}

// TestSimulateDelayed: with a delay, a holder lost while a delayed outer step is exchanged (from
// the outer step until its exchange is over, beside the next inner steps) is dropped, and the
// survivors take the step again without it — a delayed step has two phases, as the coordinator's
// does: no restore, and the lost replica's contribution leaves the synchronised work; and joins
// still grow from peers (after the pending step's take-up, where the coordinator's round ends for
// them) instead of replanning.
func TestSimulateDelayed(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true, Delay: 10}
	a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 3, Seed: 42})
	t.Logf("%d replica leaves: %d drops, %d restores, %d redos; %d grows, %d join replans; synchronised %.4f of %.4f", a.ReplicaLeaves, a.Drops, a.Restores, a.ExchangeRedos, a.Grows, a.JoinReplans, a.GoodputSynchronised, a.Goodput)
	switch {
	case 3*a.ExchangeRedos < a.ReplicaLeaves:
		// At τ 10 of H 20 the exchange, mostly hidden, is in flight for much of every round: a
		// good share of the departures lands in it (counting only its exposed part, a fifth did).
		t.Errorf("%d of %d departures during a delayed exchange redone: want a third or more", a.ExchangeRedos, a.ReplicaLeaves)
	case a.Restores > 0:
		// A delayed step with one phase restored every such departure (as many as the redos).
		t.Errorf("%d restores: want none, every departure dropped and its step redone", a.Restores)
	case !(a.GoodputSynchronised < a.Goodput):
		t.Errorf("synchronised %v of %v: the left-out contributions must leave the synchronised work", a.GoodputSynchronised, a.Goodput)
	case a.Grows <= a.JoinReplans:
		// Refused while a step was pending, joins replanned from checkpoints (2 grows, 100 join
		// replans here).
		t.Errorf("%d grows, %d join replans: want joins grown from peers after the take-up", a.Grows, a.JoinReplans)
	case a.Drops == 0:
		t.Error("no replica dropped")
	}
}

// TestSimulateReplansWeighed: on a fleet a join the job can take in only by a checkpoint and a
// replan of everyone waits until what the planner's plan adds repays that stall (ReplanWaits),
// as a grow does. Taken at every join gap instead (27 join replans here), the replans held the
// job still for 9% of the run, for plans a percent or two better.
func TestSimulateReplansWeighed(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true}
	a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 3, Seed: 42})
	t.Logf("%d join replans (%d waited), %d grows: stalled %.0f s; synchronised %.4f", a.JoinReplans, a.ReplansWaited, a.Grows, a.ReplanStallSeconds, a.GoodputSynchronised)
	if a.ReplansWaited == 0 || a.JoinReplans > 10 || a.ReplanStallSeconds > 0.05*3*3600 {
		t.Errorf("%d join replans, %d boundaries waited, %.0f s stalled: want replans that repaid their stall, a few, under 5%% of the run", a.JoinReplans, a.ReplansWaited, a.ReplanStallSeconds)
	}
}

// TestSimulateReshapes: in outer mode with own batches, a join whose plan is neither a refill nor
// an extension — the planner's plan keeps fewer replicas than the indices in use, or moves a
// replica to faster peers — is taken up as the coordinator's outerReshape takes it: the replicas
// the plan keeps alike keep their state, the others take the global θ from their holders, and no
// checkpoint is taken or restored. On this fleet the build before replanned four joins from a
// checkpoint; now none.
func TestSimulateReshapes(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 1000, Int8: true, OwnBatches: true}
	a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 1, Seed: 2})
	t.Logf("%d join replans, %d grows: stalled %.0f s; synchronised %.4f", a.JoinReplans, a.Grows, a.ReplanStallSeconds, a.GoodputSynchronised)
	if a.JoinReplans > 0 || a.Grows == 0 || a.Restores > 0 {
		t.Errorf("%d join replans, %d grows, %d restores: want every join taken up from peers", a.JoinReplans, a.Grows, a.Restores)
	}
}

// TestSimulateRedosCut: a departure while the survivors take an outer exchange again without an
// earlier one cuts that redo too, which starts again without both — on the coordinator as here.
// With departures every few seconds against a detection of several, redos cascade; before the
// simulator counted such a departure as a plain drop at a boundary, and its 10,000-peer figures
// were optimistic by that much.
func TestSimulateRedosCut(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, delay := range []int{0, 10} {
		opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 20, Int8: true, OwnBatches: true, Delay: delay}
		a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 2, Seed: 42, DetectSeconds: 30, QuickDetectSeconds: 30})
		t.Logf("delay %d: %d replica leaves, %d redos, %d of them cutting a redo; stalled %.0f s", delay, a.ReplicaLeaves, a.ExchangeRedos, a.RedosCut, a.StallSeconds)
		if a.RedosCut == 0 || a.RedosCut >= a.ExchangeRedos {
			t.Errorf("delay %d: %d of %d redos cut another: want some, under 30 s of detection", delay, a.RedosCut, a.ExchangeRedos)
		}
	}
}

// TestSimulateBarrierWaits: a departure during a round that the round's end reaches before it is
// noticed holds every replica there (the coordinator's roundEnd), and noticing it sooner while the
// job waits on it (QuickDetectSeconds, the coordinator's Hub.Hasten) stalls the job less.
func TestSimulateBarrierWaits(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncOuter, Every: 100, Int8: true, OwnBatches: true}
	slow := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 1, Seed: 42, QuickDetectSeconds: 5})
	quick := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 1, Seed: 42})
	t.Logf("noticed in 5 s: %d barrier waits, %.0f s stalled, synchronised %.3f; in 1.625 s: %d, %.0f s, %.3f",
		slow.BarrierWaits, slow.StallSeconds, slow.GoodputSynchronised, quick.BarrierWaits, quick.StallSeconds, quick.GoodputSynchronised)
	if slow.BarrierWaits == 0 {
		t.Fatal("no departure waited for at a round's end")
	}
	if !(quick.StallSeconds < slow.StallSeconds) || !(quick.GoodputSynchronised > slow.GoodputSynchronised) {
		t.Errorf("noticing departures sooner at a round's end did not stall less")
	}
}

// TestSimulateHandsBack: in step mode, a join whose planner's plan puts the joiner in place of a
// holder no twin backs (the default job runs one pipeline on this fleet) is taken up as the
// coordinator takes it: the holder hands its stage over and stands by (Givers with hand-back),
// no checkpoint. On this fleet the build before replanned such joins from a checkpoint.
func TestSimulateHandsBack(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	opt := ReplicaOptions{MicroBatches: 4, Sync: SyncStep}
	a := simulateTwice(t, SimConfig{Profile: prof, Options: opt, Peers: 30, Hours: 1, Seed: 1})
	t.Logf("%d join replans, %d grows, %d handed back; synchronised %.4f", a.JoinReplans, a.Grows, a.HandedBack, a.GoodputSynchronised)
	if a.JoinReplans > 0 || a.HandedBack == 0 || a.Grows < a.HandedBack {
		t.Errorf("%d join replans, %d grows, %d handed back: want the joins taken up by hand-backs", a.JoinReplans, a.Grows, a.HandedBack)
	}
}
