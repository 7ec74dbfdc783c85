package client

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestStepTotalsNormMatchesModel holds proto.StepTotals to model.GlobalNorm bit for bit: proto
// restates the tensor-name-order sum because it may import the standard library only, and a
// pipelined step must report the very norm (and so the very clip factor) of the single process.
func TestStepTotalsNormMatchesModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 20; trial++ {
		parts := map[string]float64{}
		shards := make([]*proto.StepReport, 1+rng.IntN(4))
		for i := range shards {
			shards[i] = &proto.StepReport{GradSq: map[string]float64{}}
		}
		shards[len(shards)-1].CE = []float64{rng.Float64()}
		for k := 0; k < 1+rng.IntN(40); k++ {
			// Magnitudes far apart, so that a different order would round differently.
			name, v := fmt.Sprintf("h.%d.w%d", rng.IntN(12), k), rng.Float64()*float64(int64(1)<<rng.IntN(40))
			parts[name] = v
			shards[rng.IntN(len(shards))].GradSq[name] = v
		}
		_, _, norm, err := proto.StepTotals(shards, 1)
		if err != nil {
			t.Fatal(err)
		}
		if want := model.GlobalNorm(parts); norm != want {
			t.Fatalf("trial %d: proto.StepTotals norm = %v, model.GlobalNorm = %v", trial, norm, want)
		}
	}
}
