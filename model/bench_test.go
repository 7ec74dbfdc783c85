package model

import (
	"math/rand/v2"
	"os"
	"testing"
)

// BenchmarkTrainStep measures one training step of the default job's model (B 16, M 4) and reports
// tokens/s. It trains on the same batch every step; BenchmarkTrainStepFresh is the job shape
// `make bench` compares with the PyTorch anchor.
func BenchmarkTrainStep(b *testing.B) {
	cfg := DefaultConfig()
	m, err := NewModel(cfg)
	if err != nil {
		b.Fatal(err)
	}
	m.Init(1)
	const B = 16
	T := cfg.BlockSize
	r := rand.New(rand.NewPCG(1, 2))
	x, y := make([]int32, B*T), make([]int32, B*T)
	for i := range x {
		x[i], y[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
	}
	h := Hyper{MicroBatches: 4, LR: 3e-4, WeightDecay: 0.1, Clip: 1}
	if _, err := m.TrainStep(x, y, B, h); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := m.TrainStep(x, y, B, h); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(B*T*b.N)/b.Elapsed().Seconds(), "tokens/s")
}

// BenchmarkTrainStepFresh is the default job's training step as the PyTorch anchor's `bench
// --micro-batches 4 --clip 1` times it: B 16 sequences of T bytes, 4 micro-batches, global-norm
// clipping at 1, one AdamW step, and a fresh random batch every step (drawn inside the timed loop,
// as the anchor draws its own). `make bench` compares its tokens/s with the anchor's.
func BenchmarkTrainStepFresh(b *testing.B) { benchTrainFresh(b, DefaultConfig()) }

// BenchmarkTrainStepFreshLarge is BenchmarkTrainStepFresh on LargeConfig (about 284M parameters,
// 4.5 GB of training state; one step takes tens of seconds on two cores). It runs only with
// SHOAL_BENCH_LARGE=1, so that `go test -bench .` does not spend minutes and gigabytes on it;
// `LARGE=1 make bench` sets it.
func BenchmarkTrainStepFreshLarge(b *testing.B) {
	if os.Getenv("SHOAL_BENCH_LARGE") != "1" {
		b.Skip("set SHOAL_BENCH_LARGE=1 to time the large model's training step")
	}
	benchTrainFresh(b, LargeConfig())
}

// benchTrainFresh times TrainStep on cfg with the default job's hyperparameters (B 16, M 4, clip
// 1) and a new batch each step, after one untimed warm-up step; it reports tokens/s.
func benchTrainFresh(b *testing.B, cfg Config) {
	m, err := NewModel(cfg)
	if err != nil {
		b.Fatal(err)
	}
	m.Init(1)
	const B = 16
	T := cfg.BlockSize
	r := rand.New(rand.NewPCG(1, 2))
	x, y := make([]int32, B*T), make([]int32, B*T)
	// draw fills x with B random sequences and y with each one shifted by a byte: the anchor's
	// d = randint(V, (B, T+1)); x, y = d[:, :T], d[:, 1:].
	draw := func() {
		for s := 0; s < B; s++ {
			prev := int32(r.IntN(cfg.VocabSize))
			for t := 0; t < T; t++ {
				next := int32(r.IntN(cfg.VocabSize))
				x[s*T+t], y[s*T+t] = prev, next
				prev = next
			}
		}
	}
	h := Hyper{MicroBatches: 4, LR: 3e-4, WeightDecay: 0.1, Clip: 1}
	draw()
	if _, err := m.TrainStep(x, y, B, h); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		draw()
		if _, err := m.TrainStep(x, y, B, h); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(B*T*b.N)/b.Elapsed().Seconds(), "tokens/s")
}
