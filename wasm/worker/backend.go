//go:build js && wasm

package main

import (
	"context"
	"fmt"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/wasm/webgpu"
)

// backend is how this tab computes its shard, and how fast: the planner gives a peer work in
// proportion to the GFLOP/s it reports, so the number must be measured on the backend that will
// run the shard, not on another one.
type backend struct {
	kind proto.Backend
	// describe says what the tab computes on, and why, for the contributor page.
	describe string
	// device is the shard's model.Device: nil for the CPU kernels, a webgpu.ModelDevice otherwise.
	device model.Device
	gflops float64
	close  func() // releases the GPU device; nil for the CPU
	// lost is closed when the browser loses the GPU device (webgpu.Device.Lost); nil for the CPU.
	lost <-chan struct{}
	// cpuGFLOPS is the CPU kernels' figure, which a tab that falls back to them reports.
	cpuGFLOPS float64
}

// probeTokens is how many tokens a benchmark step carries: one sequence of the job's model cut to
// this length. The layers are the job's own (widths, heads, experts), so each backend pays per op
// what it will pay in training; the sequence is cut so that a step takes a fraction of a second
// on the CPU kernels, and the whole benchmark, both backends with their warm-ups, stays within
// about two seconds.
const probeTokens = 32

// probeBudget is how long each backend's timed steps may take after its warm-up: enough for a
// dozen CPU steps of the default model and a few of SwiftShader's, whose warm-up (compiling the
// pipelines) is most of what the WebGPU side costs. At 300 ms the whole benchmark took 1.7–2.3 s
// in the browser tests (the longest forcing WebGPU, which is not given up early), over the two
// seconds it should stay within.
const probeBudget = 200 * time.Millisecond

// maxProbeParams bounds the benchmark's model (two blocks with the embeddings): its parameters,
// gradients and Adam moments must fit in the tab's heap beside the runtime, whatever the
// coordinator's status says the job is.
const maxProbeParams = 1 << 23

// probeConfig is the model a benchmark step times: the first two blocks (an MoE one among them,
// where the job has any) of the job's model, given by the page as JSON (its status's
// job.model_config), or of the default job's when it gives none or one too large. It says which.
func probeConfig(raw string) (model.Config, string) {
	cfg, what := model.DefaultConfig(), "the default model"
	if raw != "" {
		c, err := model.ParseConfig([]byte(raw))
		if err != nil {
			what += fmt.Sprintf(" (the job's: %v)", err)
		} else {
			c.NLayer = min(c.NLayer, 2)
			var n int64
			for _, sp := range c.Specs() {
				n += int64(sp.Size())
			}
			if n > maxProbeParams {
				what += fmt.Sprintf(" (the job's: two blocks have %d parameters, more than the benchmark holds)", n)
			} else {
				cfg, what = c, "the job's model"
			}
		}
	}
	cfg.NLayer = min(cfg.NLayer, 2)
	cfg.BlockSize = min(cfg.BlockSize, probeTokens)
	return cfg, what
}

// chooseBackend measures what this tab can compute on and picks the faster, on Start (never
// before: nothing runs until the contributor asks), in the worker's own thread. want is the
// page's ?backend= — "cpu" or "webgpu" forces one (tests; a contributor whose GPU misbehaves);
// "" chooses by measurement. modelConfig is the job's model (probeConfig).
//
// The CPU fallback is the pure-Go kernels on one thread. WebGPU wins only where it is faster on
// a training step of the job's own layers (client.TimeDeviceStepWithin), not on a large
// multiply or a toy model: Chromium's SwiftShader adapter, which a machine without a GPU offers,
// multiplies quickly but runs a stage of real layers several times slower than the CPU kernels
// do, so a tab there computes on the CPU; a real GPU wins by far.
func chooseBackend(ctx context.Context, want, modelConfig string) backend {
	began := time.Now()
	cpu := backend{kind: proto.BackendCPU, gflops: client.MeasureGFLOPS(),
		describe: "CPU (pure-Go kernels, one thread)"}
	cpu.cpuGFLOPS = cpu.gflops
	if want == "cpu" {
		cpu.describe += ": chosen by ?backend=cpu"
		return cpu
	}
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	d, err := webgpu.Open(octx)
	if err != nil {
		cpu.describe += fmt.Sprintf(": no WebGPU device (%v)", err)
		return cpu
	}
	cfg, what := probeConfig(modelConfig)
	cpuStep, err := client.TimeDeviceStepWithin(model.Host{}, cfg, 1, probeBudget, 0)
	if err != nil {
		d.Close()
		cpu.describe += fmt.Sprintf(": the CPU benchmark failed (%v)", err)
		return cpu
	}
	gpu := webgpu.NewModelDevice(d)
	giveUp := 3 * cpuStep // a warm-up compiles pipelines; more than this is a slower device
	if want == "webgpu" {
		giveUp = 0
	}
	devStep, err := client.TimeDeviceStepWithin(gpu, cfg, 1, probeBudget, giveUp)
	if err == nil {
		err = gpu.Err()
	}
	if err != nil {
		d.Close()
		cpu.describe += fmt.Sprintf(": WebGPU on %s failed its benchmark (%v)", d.Adapter(), err)
		return cpu
	}
	use, gflops := client.BrowserGFLOPS(cpu.gflops, cpuStep, devStep)
	if want == "webgpu" {
		use, gflops = true, cpu.gflops*cpuStep.Seconds()/devStep.Seconds()
	}
	dev, host := devStep.Round(time.Millisecond), cpuStep.Round(time.Millisecond)
	took := time.Since(began).Round(10 * time.Millisecond)
	if !use {
		d.Close()
		cpu.describe += fmt.Sprintf(", the faster here: a step of %s takes %v, %v on WebGPU (%s); measured in %v", what, host, dev, d.Adapter(), took)
		return cpu
	}
	why := "the faster here"
	if want == "webgpu" {
		why = "chosen by ?backend=webgpu"
	}
	return backend{kind: proto.BackendWebGPU, device: gpu, gflops: gflops, close: d.Close, lost: d.Lost(), cpuGFLOPS: cpu.gflops,
		describe: fmt.Sprintf("WebGPU (%s), %s: a step of %s takes %v, %v on the CPU; measured in %v", d.Adapter(), why, what, dev, host, took)}
}
