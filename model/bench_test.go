package model

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkTrainStep measures one training step of the default job's model (B 16, M 4) and reports
// tokens/s; `make bench` compares it with the PyTorch anchor.
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
