package client

import (
	"math/rand/v2"
	"time"

	"github.com/shoal-ml/shoal/model"
)

// TimeDeviceStep times a training step — forward and backward of one micro-batch of two
// sequences through two blocks of the tiny model (an MoE block among them) and the loss — on
// dev, best of three after a warm-up. Unlike MeasureGFLOPS, which times one large multiply, it
// sees what a backend pays per op: a WebGPU adapter that multiplies quickly but dispatches slowly
// (SwiftShader, measured here: ~1.9 GFLOP/s in a 256³ multiply, 0.3–0.6 in a step of the tiny model) is timed at
// what it will deliver. A browser tab times each backend it has and computes on the faster
// (BrowserGFLOPS).
func TimeDeviceStep(dev model.Device) (time.Duration, error) {
	cfg := model.TinyConfig()
	cfg.NLayer = 2
	return TimeDeviceStepOf(dev, cfg, 2)
}

// TimeDeviceStepOf is TimeDeviceStep for one micro-batch of rows sequences through cfg's first
// cfg.NLayer blocks: a native worker times the size of model it expects to hold (`shoal worker
// --device auto`), where the tiny model would time a GPU's dispatch latency alone.
func TimeDeviceStepOf(dev model.Device, cfg model.Config, rows int) (time.Duration, error) {
	return timeSteps(dev, cfg, rows, 3, 0, 0)
}

// TimeDeviceStepWithin is TimeDeviceStepOf on a time budget, for a browser tab, whose
// contributor waits for it: after the warm-up it times steps while one more fits in budget (one at least)
// and returns the best. When giveUp > 0 and the warm-up alone took longer, it returns the
// warm-up's time without timing more: the device is already slower than a rival it is being
// compared with, by more than a warm-up's extra cost (pipelines compiled, buffers made) explains.
func TimeDeviceStepWithin(dev model.Device, cfg model.Config, rows int, budget, giveUp time.Duration) (time.Duration, error) {
	return timeSteps(dev, cfg, rows, 0, budget, giveUp)
}

// timeSteps times reps steps after a warm-up, or as many as fit in budget when reps is 0.
func timeSteps(dev model.Device, cfg model.Config, rows, reps int, budget, giveUp time.Duration) (time.Duration, error) {
	sh, err := model.NewStageShardOn(dev, cfg, 0, cfg.NLayer, nil)
	if err != nil {
		return 0, err
	}
	sh.Init(1)
	sh.Stage.Defer = true // as a worker's stage: one read a step
	T := cfg.BlockSize
	r := rand.New(rand.NewPCG(1, 2))
	in := model.StageInput{B: rows, T: T, Micro: 1, Tokens: make([]int32, rows*T), Targets: make([]int32, rows*T)}
	for i := range in.Tokens {
		in.Tokens[i], in.Targets[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
	}
	step := func() error {
		if _, err := sh.Stage.Forward(0, in); err != nil {
			return err
		}
		if _, err := sh.Stage.Backward(0, nil, 1); err != nil {
			return err
		}
		sh.GradSquaredNorms() // waits for the device, as a step's report does (MoE statistics too)
		sh.Stage.TakeStats()
		sh.ZeroGrads()
		return nil
	}
	t0 := time.Now()
	if err := step(); err != nil { // warm-up: pipelines, buffers, caches
		return 0, err
	}
	warm := time.Since(t0)
	if giveUp > 0 && warm > giveUp {
		return warm, nil
	}
	best := time.Duration(1<<63 - 1)
	began := time.Now()
	for i := 0; reps > 0 && i < reps || reps == 0 && (i == 0 || time.Since(began)+best <= budget); i++ {
		t0 := time.Now()
		if err := step(); err != nil {
			return 0, err
		}
		best = min(best, time.Since(t0))
	}
	return best, nil
}

// BrowserGFLOPS puts a tab's backends on the planner's scale. Native workers report
// MeasureGFLOPS, a large multiply on the CPU kernels; the tab measures the same multiply on its
// pure-Go CPU kernels (cpuGFLOPS) and, when it has a second backend, times a training step on
// both (cpuStep, devStep). The second backend is worth cpuGFLOPS·cpuStep/devStep on that scale:
// the multiply anchors the scale, the steps give the backends' ratio on real work. It returns
// whether the device is the faster, and the figure to report.
func BrowserGFLOPS(cpuGFLOPS float64, cpuStep, devStep time.Duration) (useDevice bool, gflops float64) {
	if devStep <= 0 || cpuStep <= 0 || devStep >= cpuStep {
		return false, cpuGFLOPS
	}
	return true, cpuGFLOPS * cpuStep.Seconds() / devStep.Seconds()
}
