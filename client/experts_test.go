package client

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestExpertHostsEqualSingleProcess is the expert-parallel equivalence test: the tiny model as 2
// stages with its 8 experts on 4 expert hosts — and the same with expert 1 of block 1 replicated
// on two hosts — trains, evaluates and ends bitwise equal to one process, for top-1 and top-2;
// the replicas' parameters are bitwise equal to each other.
func TestExpertHostsEqualSingleProcess(t *testing.T) {
	type ref = ExpertRef
	placements := map[string][][]ExpertRef{
		"4 hosts": {{ref{1, 0}, ref{1, 1}}, {ref{1, 2}, ref{1, 3}}, {ref{3, 0}, ref{3, 1}}, {ref{3, 2}, ref{3, 3}}},
		"4 hosts, expert 1/1 replicated": {{ref{1, 0}, ref{1, 1}}, {ref{1, 2}, ref{1, 3}, ref{1, 1}},
			{ref{3, 0}, ref{3, 1}}, {ref{3, 2}, ref{3, 3}}},
		"some experts stay with their stage": {{ref{1, 3}}, {ref{3, 0}, ref{3, 2}}},
	}
	for _, k := range []int{1, 2} {
		for name, hosts := range placements {
			t.Run(fmt.Sprintf("top%d/%s", k, name), func(t *testing.T) {
				cfg := model.TinyConfig()
				cfg.TopK = k
				const B, M, steps, lr, wd, clip = 8, 4, 3, 1e-2, 0.1, 1.0
				ref, err := model.NewModel(cfg)
				if err != nil {
					t.Fatal(err)
				}
				ref.Init(33)
				p, err := NewLocalExpertPipeline(cfg, 33, []int{2}, wd, hosts)
				if err != nil {
					t.Fatal(err)
				}
				defer p.Close()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				for s := 0; s < steps; s++ {
					x, y := testBatch(t, s, B, cfg.BlockSize)
					r, err := ref.TrainStep(x, y, B, model.Hyper{MicroBatches: M, LR: lr, WeightDecay: wd, Clip: clip})
					if err != nil {
						t.Fatal(err)
					}
					ce, aux, norm, err := p.Step(ctx, uint64(s), x, y, B, M, lr, clip)
					if err != nil {
						t.Fatal(err)
					}
					if ce != r.CE || aux != r.Aux || norm != r.GradNorm {
						t.Fatalf("step %d: expert-parallel ce %v aux %v norm %v; single process %v %v %v", s, ce, aux, norm, r.CE, r.Aux, r.GradNorm)
					}
				}
				vx, vy := testBatch(t, 77, 32, cfg.BlockSize)
				want, err := local.ValidationLoss(ref, vx, vy)
				if err != nil {
					t.Fatal(err)
				}
				if val, err := p.Eval(ctx, steps-1, vx, vy); err != nil || val != want {
					t.Fatalf("validation loss %v (%v), single process %v", val, err, want)
				}
				got := p.Params()
				for _, tt := range ref.P.Tensors {
					g := got[tt.Name]
					if len(g) != len(tt.Data) {
						t.Fatalf("%s: %d values, want %d", tt.Name, len(g), len(tt.Data))
					}
					for i := range g {
						if math.Float32bits(g[i]) != math.Float32bits(tt.Data[i]) {
							t.Fatalf("%s[%d]: expert-parallel %v, single process %v", tt.Name, i, g[i], tt.Data[i])
						}
					}
				}
				// Replicas hold the same bits.
				seen := map[string][]float32{}
				for _, h := range p.Hosts {
					for _, tt := range h.Shard.P.Tensors {
						if prev, ok := seen[tt.Name]; ok {
							for i := range prev {
								if math.Float32bits(prev[i]) != math.Float32bits(tt.Data[i]) {
									t.Fatalf("replicas of %s differ at %d", tt.Name, i)
								}
							}
						}
						seen[tt.Name] = tt.Data
					}
				}
			})
		}
	}
}
