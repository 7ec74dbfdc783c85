package sched

import (
	"reflect"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

func TestSimulateFleetDeterministic(t *testing.T) {
	prof, err := NewProfile(model.DefaultConfig(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, opt := range []ReplicaOptions{{MicroBatches: 4}, {MicroBatches: 4, Sync: SyncOuter, Every: 20}} {
		t.Run(opt.Sync.String(), func(t *testing.T) {
			cfg := SimConfig{Profile: prof, Options: opt, Peers: 300, Hours: 0.5, Seed: 42}
			a, err := Simulate(cfg)
			if err != nil {
				t.Fatal(err)
			}
			b, err := Simulate(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(a, b) {
				t.Errorf("two runs of seed 42 differ")
			}
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
