//go:build js && wasm

package main

import (
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/proto"
)

// backend is how this tab computes its shard, and how fast: the planner gives a peer work in
// proportion to the GFLOP/s it reports, so the number must be measured on the backend that will
// run the shard, not on another one.
type backend struct {
	kind proto.Backend
	// describe says what the tab computes on, for the contributor page.
	describe string
	// measure benchmarks the backend in GFLOP/s. It runs on Start (never before: nothing runs
	// until the contributor asks) and blocks the page while it runs, about half a second.
	measure func() float64
}

// chooseBackend picks what this tab computes on. There is one choice today, the CPU fallback;
// the WebGPU backend (wasm/webgpu, in progress) plugs in here, taken first when the page found an
// adapter, so that the rest of the entry and the page stay as they are.
func chooseBackend() backend {
	return backend{
		kind:     proto.BackendCPU,
		describe: "CPU fallback (pure-Go " + kernels.ISA() + " kernels, one thread)",
		// client.MeasureGFLOPS times package kernels, which in a wasm build is the pure-Go code
		// the shard runs on: the same kernels measured as used.
		measure: client.MeasureGFLOPS,
	}
}
