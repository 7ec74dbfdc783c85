package client

import (
	"fmt"
	"math"
	"testing"

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
				p, err := NewLocalExpertPipeline(cfg, 33, []int{2}, trainWD, hosts)
				if err != nil {
					t.Fatal(err)
				}
				defer p.Close()
				trainAlongside(t, cfg, 33, p)
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
