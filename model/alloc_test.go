package model

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
)

// TestTrainStepAllocation checks that a training step of the default model reuses its memory:
// after four warm-up steps, each step — on a fresh batch, so that the routing, and with it every
// expert's share of the rows, changes — allocates under 1 MB (issue 16). The activations, the
// experts' rows and the kernels' packing buffers are sized once and kept; what is left is small
// bookkeeping (the norm report's map, views, parallel loops), so a buffer of activations
// allocated per micro-batch or per step (256 KB and up at these shapes) shows at once, in every
// step. What it checks is the median step: with two lanes the kernels' shared buffer pools are
// taken in an order that depends on timing, and now and then a step still grows one of them.
func TestTrainStepAllocation(t *testing.T) {
	if testing.Short() {
		t.Skip("several steps of the default model; BenchmarkTrainStep -benchmem measures the same")
	}
	cfg := DefaultConfig()
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(1)
	const B, M = 8, 2 // micro-batches of the default job's shape (4 rows of 128), two per step
	T := cfg.BlockSize
	x, y := make([]int32, B*T), make([]int32, B*T)
	h := Hyper{MicroBatches: M, LR: 1e-3, WeightDecay: 0.1, Clip: 1}
	const warmup, steps, limit = 4, 9, 1 << 20
	var allocs []uint64
	for s := range warmup + steps {
		r := rand.New(rand.NewPCG(uint64(s), 16))
		for i := range x {
			x[i], y[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		if _, err := m.TrainStep(x, y, B, h); err != nil {
			t.Fatal(err)
		}
		runtime.ReadMemStats(&after)
		if s >= warmup {
			allocs = append(allocs, after.TotalAlloc-before.TotalAlloc)
		}
	}
	sorted := slices.Clone(allocs)
	slices.Sort(sorted)
	if med := sorted[len(sorted)/2]; med > limit {
		t.Errorf("the median step allocated %d bytes, want at most %d (steps: %v)", med, limit, allocs)
	}
}
