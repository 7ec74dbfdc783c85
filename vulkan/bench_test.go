package vulkan

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/shoal-ml/shoal/internal/stagecheck"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

var (
	benchModel = flag.String("vulkan.benchmodel", "tiny", "model config of BenchmarkVulkanStageStep (tiny, default, large)")
	benchRows  = flag.Int("vulkan.benchrows", 4, "sequences per micro-batch of BenchmarkVulkanStageStep")
	benchSize  = flag.Int("vulkan.benchsize", 1024, "m = k = n of BenchmarkVulkanMatMul")
)

// BenchmarkVulkanMatMul times c = a·bᵀ (a Linear layer's product) at -vulkan.benchsize³ and
// reports GFLOP/s; the iterations are queued back to back and waited for once at the end, as a
// training step queues its products.
func BenchmarkVulkanMatMul(b *testing.B) {
	d := device(b)
	n := *benchSize
	r := rand.New(rand.NewPCG(1, 2))
	x, w, c := d.Alloc(n*n), d.Alloc(n*n), d.Alloc(n*n)
	defer func() { d.Free(x); d.Free(w); d.Free(c) }()
	d.Write(x, stagecheck.RandFloats(r, n*n, 1))
	d.Write(w, stagecheck.RandFloats(r, n*n, 1))
	one := make([]float32, 1)
	d.MatMulNT(c, x, w, n, n, n, false) // builds the pipeline
	d.Read(one, d.Slice(c, 0, 1))
	b.ResetTimer()
	for range b.N {
		d.MatMulNT(c, x, w, n, n, n, false)
	}
	d.Read(one, d.Slice(c, 0, 1))
	b.StopTimer()
	if err := d.Err(); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(2*float64(n)*float64(n)*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}

// BenchmarkVulkanStageStep times one training step of a whole-model stage (forward and backward
// of every micro-batch, gradient norms, AdamW) on Host and on the Vulkan device, and reports the
// step's GFLOP/s by the planner's cost model (sched.Profile), the number the planner weighs
// peers by.
func BenchmarkVulkanStageStep(b *testing.B) {
	mk, ok := model.Configs[*benchModel]
	if !ok {
		b.Fatalf("no model config %q", *benchModel)
	}
	cfg := mk()
	rows := *benchRows
	prof, err := sched.NewProfile(cfg, rows)
	if err != nil {
		b.Fatal(err)
	}
	gflop := prof.StageFLOPs(0, cfg.NLayer) * stageMicro / 1e9
	for _, dev := range []string{"host", "vulkan"} {
		b.Run(fmt.Sprintf("%s/%s", *benchModel, dev), func(b *testing.B) {
			var dv model.Device = model.Host{}
			if dev == "vulkan" {
				dv = device(b)
			}
			sh, err := model.NewStageShardOn(dv, cfg, 0, cfg.NLayer, nil)
			if err != nil {
				b.Fatal(err)
			}
			sh.Init(1)
			r := rand.New(rand.NewPCG(3, 4))
			N := rows * cfg.BlockSize
			ins := make([]model.StageInput, stageMicro)
			for mb := range ins {
				ins[mb] = model.StageInput{B: rows, T: cfg.BlockSize, Micro: stageMicro,
					Tokens: stagecheck.RandTokens(r, N, cfg.VocabSize), Targets: stagecheck.RandTokens(r, N, cfg.VocabSize)}
			}
			step := func(s int) {
				for mb := range ins {
					if _, err := sh.Stage.Forward(mb, ins[mb]); err != nil {
						b.Fatal(err)
					}
				}
				for mb := stageMicro - 1; mb >= 0; mb-- {
					if _, err := sh.Stage.Backward(mb, nil, 1/float32(stageMicro)); err != nil {
						b.Fatal(err)
					}
				}
				norm := model.GlobalNorm(sh.GradSquaredNorms()) // and the MoE statistics, in one read
				sh.Stage.TakeStats()
				sh.Apply(s+1, stageLR, stageWD, model.ClipFactor(norm, 1))
				sh.ZeroGrads()
			}
			step(0) // pipelines, scratch buffers
			b.ResetTimer()
			for i := range b.N {
				step(i + 1)
			}
			sh.Pull()
			b.StopTimer()
			if vd, ok := dv.(*Device); ok {
				if err := vd.Err(); err != nil {
					b.Fatal(err)
				}
			}
			sec := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(sec*1e3, "ms/step")
			b.ReportMetric(gflop/sec, "GFLOP/s")
		})
	}
}
