//go:build js && wasm

package main

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/internal/stagecheck"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
	"github.com/shoal-ml/shoal/wasm/webgpu"
)

// StageCase is one stage trained for a few steps on the CPU (model.Host: the pure-Go kernels,
// as a CPU-fallback tab computes) and on WebGPU from the same initial parameters and data: the
// whole-stage check that the kernels, composed by the model exactly as a worker composes them,
// give the same training run.
type StageCase struct {
	Name   string `json:"name"`
	Blocks [2]int `json:"blocks"`
	// CE is each step's mean cross-entropy over its micro-batches (last stage only); DX the
	// relative error of the input gradient the stage sends back (stages after the first).
	HostCE  []float64 `json:"host_ce,omitempty"`
	GPUCE   []float64 `json:"gpu_ce,omitempty"`
	DXRel   []float64 `json:"dx_rel,omitempty"`
	OutRel  []float64 `json:"out_rel,omitempty"` // the activations it sends forward (not the last)
	NormRel []float64 `json:"norm_rel"`          // ‖g‖ per step
	// UpdateRel is max over tensors of ‖Δθ_gpu − Δθ_host‖/‖Δθ_host‖, Δθ = θ_T − θ_0: with a
	// learning rate of 1e-2 the update is large enough that a missing term shows.
	UpdateRel   float64 `json:"update_rel"`
	UpdateWorst string  `json:"update_worst"`
	// UpdateAll is the same over all the stage's parameters as one vector.
	UpdateAll  float64 `json:"update_all"`
	HostStepMS float64 `json:"host_step_ms"` // median training step, host
	GPUStepMS  float64 `json:"gpu_step_ms"`  // median training step, WebGPU
	// StepGFLOP is a training step's work by the planner's cost model (sched.Profile), so that
	// step times convert to the GFLOP/s the planner weighs peers by.
	StepGFLOP float64 `json:"step_gflop"`
	// GPUReads and GPUReadMS are the WebGPU run's waits for the GPU per step (webgpu.Stats).
	GPUReads  float64 `json:"gpu_reads"`
	GPUReadMS float64 `json:"gpu_read_ms"`
	// MicroReads is the waits within one micro-batch's forward and backward (the rest of a
	// step's are its gradient norms and the Pull that reads the update back, once per step).
	MicroReads float64 `json:"micro_reads"`
	// Dispatches is the kernels a step launches; OptDispatches those of its optimizer update
	// and gradient clear (Shard.Apply and ZeroGrads: the AdamW runs, one fill per gradient
	// slab).
	Dispatches    float64 `json:"dispatches"`
	OptDispatches float64 `json:"opt_dispatches"`
	ReadRTTMS     float64 `json:"read_rtt_ms"` // one read with nothing queued
	// DispatchMS is the cost of one dispatch of a one-element kernel: what every op pays
	// however small it is.
	DispatchMS float64 `json:"dispatch_ms"`
	Error      string  `json:"error,omitempty"`
}

// The learning rate and weight decay are large (docs/design.md, "Equivalence, defined": a tiny learning rate cannot tell a
// missing weight decay from noise): over three steps a dropped decay term moves Δθ by about 1e-2.
const (
	stageSteps = 3
	stageMicro = stagecheck.Micro // micro-batches per step
	stageRows  = stagecheck.Rows  // sequences per micro-batch
)

// stageCheck runs the stage cases: the whole model as one stage (embedding, attention, MoE
// routing with its experts local, head and loss), and a middle stage fed activations and output
// gradients as a pipeline neighbour would feed it.
// With broken set, the WebGPU side runs AdamW without weight decay: the check must catch it.
func stageCheck(d *webgpu.Device, broken bool) []StageCase {
	cfg := model.TinyConfig()
	// The round trip alone: a read of one float with nothing queued.
	one := d.Zeros(1)
	d.Read(one)
	t0 := time.Now()
	for range 20 {
		d.Read(one)
	}
	rtt := ms(time.Since(t0)) / 20
	// And a dispatch: 200 one-element fills, then the read that waits for them.
	t0 = time.Now()
	for range 200 {
		d.Fill(one, 1)
	}
	d.Read(one)
	perDispatch := (ms(time.Since(t0)) - rtt) / 200
	d.Release(one)
	var out []StageCase
	for _, c := range []StageCase{{Name: "whole model", Blocks: [2]int{0, cfg.NLayer}}, {Name: "middle stage", Blocks: [2]int{1, 3}}} {
		gpu := webgpu.NewModelDevice(d)
		var dev model.Device = gpu
		if broken {
			dev = noDecay{gpu}
		}
		c.ReadRTTMS, c.DispatchMS = rtt, perDispatch
		if err := runStageCase(cfg, &c, gpu, dev); err != nil {
			c.Error = err.Error()
		}
		out = append(out, c)
	}
	return out
}

// noDecay is a deliberately wrong device: AdamW without weight decay.
type noDecay struct{ *webgpu.ModelDevice }

func (n noDecay) AdamW(w, g, m, v model.Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	n.ModelDevice.AdamW(w, g, m, v, 1, stepSize, sqrtBC2, gradScale)
}

// stageRun is the shared check's run (internal/stagecheck) with what the browser measures of it.
type stageRun struct {
	*stagecheck.Run
	stepMS []float64
	// microReads counts the device's waits inside forwards and backwards, all steps;
	// optDispatches the dispatches of Apply and ZeroGrads.
	microReads, optDispatches int
}

func runStageCase(cfg model.Config, c *StageCase, gpu *webgpu.ModelDevice, dev model.Device) error {
	lo, hi := c.Blocks[0], c.Blocks[1]
	host, err := trainStage(cfg, model.Host{}, lo, hi, nil)
	if err != nil {
		return fmt.Errorf("host: %w", err)
	}
	before := gpu.Stats()
	on, err := trainStage(cfg, dev, lo, hi, gpu.Stats)
	after := gpu.Stats()
	c.GPUReads = float64(after.Reads-before.Reads) / stageSteps
	c.GPUReadMS = ms(after.ReadTime-before.ReadTime) / stageSteps
	c.MicroReads = float64(on.microReads) / (stageSteps * stageMicro)
	c.Dispatches = float64(after.Dispatches-before.Dispatches) / stageSteps
	c.OptDispatches = float64(on.optDispatches) / stageSteps
	if err != nil {
		return fmt.Errorf("webgpu: %w", err)
	}
	if err := gpu.Err(); err != nil {
		return err
	}
	c.HostCE, c.GPUCE = host.CE, on.CE
	for i := range host.Norms {
		c.NormRel = append(c.NormRel, math.Abs(on.Norms[i]-host.Norms[i])/host.Norms[i])
	}
	for i := range host.DX {
		c.DXRel = append(c.DXRel, relErr(on.DX[i], host.DX[i]))
	}
	for i := range host.Out {
		c.OutRel = append(c.OutRel, relErr(on.Out[i], host.Out[i]))
	}
	var allH, allG []float32
	for i, ht := range host.Shard.P.Tensors {
		gt, h0 := on.Shard.P.Tensors[i], host.Initial.Tensors[i]
		dh, dg := make([]float32, len(ht.Data)), make([]float32, len(ht.Data))
		for j := range ht.Data {
			dh[j], dg[j] = ht.Data[j]-h0.Data[j], gt.Data[j]-h0.Data[j]
		}
		if r := relErr(dg, dh); r > c.UpdateRel || math.IsNaN(r) {
			c.UpdateRel, c.UpdateWorst = r, ht.Name
		}
		allH, allG = append(allH, dh...), append(allG, dg...)
	}
	c.UpdateAll = relErr(allG, allH)
	c.HostStepMS, c.GPUStepMS = median(host.stepMS), median(on.stepMS)
	prof, err := sched.NewProfile(cfg, stageRows)
	if err != nil {
		return err
	}
	c.StepGFLOP = prof.StageFLOPs(lo, hi) * stageMicro / 1e9
	return nil
}

// trainStage trains blocks [lo, hi) with their experts local for stageSteps steps on dev: the
// whole-stage check's run (internal/stagecheck), which the Vulkan backend's tests train too.
// stats, when not nil, counts the device's waits and dispatches so far.
func trainStage(cfg model.Config, dev model.Device, lo, hi int, stats func() webgpu.Stats) (*stageRun, error) {
	if stats == nil {
		stats = func() webgpu.Stats { return webgpu.Stats{} }
	}
	run := &stageRun{}
	var t0 time.Time
	var r0, d0 int
	h := stagecheck.Hooks{
		StepStart:  func() { t0, r0 = time.Now(), stats().Reads },
		MicroDone:  func() { run.microReads += stats().Reads - r0 },
		ApplyStart: func() { d0 = stats().Dispatches },
		ApplyDone:  func() { run.optDispatches += stats().Dispatches - d0 },
		StepDone:   func() { run.stepMS = append(run.stepMS, ms(time.Since(t0))) },
	}
	r, err := stagecheck.Train(cfg, dev, lo, hi, stageSteps, h)
	if err != nil {
		return nil, err
	}
	run.Run = r
	return run, nil
}

// relErr is ‖got − want‖/‖want‖ in float64 (‖got‖ when want is zero).
func relErr(got, want []float32) float64 {
	var d, w float64
	for i := range want {
		e := float64(got[i]) - float64(want[i])
		d += e * e
		w += float64(want[i]) * float64(want[i])
	}
	if w == 0 {
		return math.Sqrt(d)
	}
	return math.Sqrt(d / w)
}

func median(x []float64) float64 {
	if len(x) == 0 {
		return 0
	}
	s := slices.Clone(x)
	slices.Sort(s)
	return s[len(s)/2]
}
