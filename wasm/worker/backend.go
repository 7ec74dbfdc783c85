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
}

// chooseBackend measures what this tab can compute on and picks the faster, on Start (never
// before: nothing runs until the contributor asks). want is the page's ?backend= — "cpu" or
// "webgpu" forces one (tests; a contributor whose GPU misbehaves); "" chooses by measurement.
//
// The CPU fallback is the pure-Go kernels on one thread. WebGPU wins only where it is faster on
// a real training step (client.TimeDeviceStep), not on a large multiply: Chromium's SwiftShader
// adapter, which a machine without a GPU offers, multiplies at ~2 GFLOP/s but runs a step of
// small ops slower than the CPU kernels do (measured here: 0.3–0.6 vs 1.2–2.6 GFLOP/s), so a tab there
// computes on the CPU; a real GPU wins by far. Measuring takes a second or two and blocks the page.
func chooseBackend(ctx context.Context, want string) backend {
	cpu := backend{kind: proto.BackendCPU, gflops: client.MeasureGFLOPS(),
		describe: "CPU (pure-Go kernels, one thread)"}
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
	gpu := webgpu.NewModelDevice(d)
	devStep, err := client.TimeDeviceStep(gpu)
	if err == nil {
		err = gpu.Err()
	}
	if err != nil {
		d.Close()
		cpu.describe += fmt.Sprintf(": WebGPU on %s failed its benchmark (%v)", d.Adapter(), err)
		return cpu
	}
	cpuStep, err := client.TimeDeviceStep(model.Host{})
	if err != nil {
		d.Close()
		cpu.describe += fmt.Sprintf(": the CPU benchmark failed (%v)", err)
		return cpu
	}
	use, gflops := client.BrowserGFLOPS(cpu.gflops, cpuStep, devStep)
	if want == "webgpu" {
		use, gflops = true, cpu.gflops*cpuStep.Seconds()/devStep.Seconds()
	}
	dev, host := devStep.Round(time.Millisecond), cpuStep.Round(time.Millisecond)
	if !use {
		d.Close()
		cpu.describe += fmt.Sprintf(", the faster here: a benchmark step takes %v, %v on WebGPU (%s)", host, dev, d.Adapter())
		return cpu
	}
	why := "the faster here"
	if want == "webgpu" {
		why = "chosen by ?backend=webgpu"
	}
	return backend{kind: proto.BackendWebGPU, device: gpu, gflops: gflops, close: d.Close,
		describe: fmt.Sprintf("WebGPU (%s), %s: a benchmark step takes %v, %v on the CPU", d.Adapter(), why, dev, host)}
}
