//go:build js && wasm

package webgpu

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall/js"

	"github.com/shoal-ml/shoal/kernels/wgsl"
)

// AdapterInfo describes the adapter and device a Device runs on, for the contributor page and the
// planner.
type AdapterInfo struct {
	Vendor       string `json:"vendor"`
	Architecture string `json:"architecture"`
	Description  string `json:"description"`
	// Fallback: a software adapter (SwiftShader): correct, but a CPU at 0.1–2 GFLOP/s.
	Fallback bool `json:"is_fallback_adapter"`
	// Compatibility: the device runs in WebGPU compatibility mode (an adapter that offers no
	// core device, e.g. OpenGL ES): workgroups of at most 128 invocations, which every kernel
	// respects.
	Compatibility                     bool  `json:"compatibility"`
	MaxComputeInvocationsPerWorkgroup int   `json:"max_compute_invocations_per_workgroup"`
	MaxStorageBufferBindingSize       int64 `json:"max_storage_buffer_binding_size"`
	MaxBufferSize                     int64 `json:"max_buffer_size"`
}

func (a AdapterInfo) String() string {
	s := a.Vendor
	if a.Architecture != "" {
		s += " " + a.Architecture
	}
	if a.Description != "" {
		s += " (" + a.Description + ")"
	}
	if a.Fallback {
		s += ", software fallback"
	}
	if a.Compatibility {
		s += ", compatibility mode"
	}
	return s
}

// Parameter blocks: one 256-byte slot (minUniformBufferOffsetAlignment, the most any adapter
// asks) per dispatch in a uniform arena that is written once per submit, and bound with a
// dynamic offset so that one bind group serves every dispatch over the same buffers.
const (
	paramSlot  = 256
	arenaSlots = 512
)

// Device is a WebGPU device with Shoal's kernels compiled for it. See the package doc for how
// work is batched and when calls block.
type Device struct {
	adapter, device, queue js.Value
	info                   AdapterInfo

	maxBinding   int // maxStorageBufferBindingSize, bytes
	maxBuffer    int64
	maxGroups    int // maxComputeWorkgroupsPerDimension
	storageAlign int // minStorageBufferOffsetAlignment
	layouts      map[layoutKey]layout
	pipes        map[string]*pipeline
	lazy         map[string]lazyPipeline // pipelines compiled on first use (pipelineFor)
	bindGroups   map[bgKey]js.Value
	nextBufferID uint32
	dispatches   int     // dispatches recorded so far
	scratch      *Tensor // attention's dP/dS
	scratchNorms *Tensor // the partial sums of SquaredNorms
	scratchCols  *Tensor // the chunk sums of BiasGrad and LayerNormBackward
	scratchLinks *Tensor // EncoderBackward's lists of the rows of each token (int32)
	scratchSegs  *Tensor // AdamWSlab's segment table (int32)
	segsHost     []int32 // what scratchSegs holds
	// gpuKernels: the variants for GPUs run — matmul_tiled (workgroup-memory tiles) and the
	// row kernels with a workgroup per row (LANES 128) — rather than those for fallback
	// adapters: matmul (register blocks) and an invocation per row (LANES 1). See Options.
	gpuKernels    bool
	aliasScratch  [wgsl.MaxStorageBuffers]*Tensor
	encoder, pass js.Value
	passOpen      bool

	arena      js.Value // GPUBuffer, arenaSlots·paramSlot bytes
	arenaBytes []byte
	arenaJS    js.Value // Uint8Array staging the arena for writeBuffer
	arenaUsed  int
	dynOffsets js.Value // Uint32Array {0, 256, 512, …}: slot i's dynamic offset is element i
	words      [32]uint32

	upload    js.Value // Uint8Array reused by Write
	uploadLen int
	staging   js.Value // MAP_READ buffer reused by Read
	stageLen  int

	lostFunc, errFunc js.Func
	closed            bool          // Close has run
	lost              chan struct{} // closed when the browser loses the device (not on Close)
	errMu             sync.Mutex
	err               error // first uncaptured GPU error or the loss of the device
}

type layout struct {
	group, pipeline js.Value // GPUBindGroupLayout, GPUPipelineLayout
}

// lazyPipeline is a pipeline compiled on first use: its kernel and its descriptor.
type lazyPipeline struct {
	kernel wgsl.Kernel
	desc   js.Value
}

// otherVariant reports whether pipeline name of kernel k belongs to the variants the device
// does not run by default (see Options.Kernels).
func (d *Device) otherVariant(k wgsl.Kernel, name string) bool {
	switch {
	case k.Name == "matmul":
		return d.gpuKernels
	case k.Name == "matmul_tiled":
		return !d.gpuKernels
	case k.Grid == wgsl.Rows:
		return (name == rowPipeline(k.Name, wgsl.MaxInvocations)) != d.gpuKernels
	}
	return false
}

// pipelineFor returns the pipeline called name, compiling it now if Open left it for later. A
// compilation error then surfaces at the next Read, as any validation error does.
func (d *Device) pipelineFor(name string) *pipeline {
	if p := d.pipes[name]; p != nil {
		return p
	}
	l, ok := d.lazy[name]
	if !ok {
		return nil
	}
	delete(d.lazy, name)
	p := &pipeline{kernel: l.kernel, gpu: d.device.Call("createComputePipeline", l.desc), layout: kernelLayout(l.kernel)}
	d.pipes[name] = p
	return p
}

type pipeline struct {
	kernel wgsl.Kernel
	gpu    js.Value
	layout layoutKey
}

// layoutKey identifies a bind-group layout: the number of storage bindings and which of them
// are writable (bit i for binding 1+i).
type layoutKey struct {
	nbind int
	write uint8
}

func kernelLayout(k wgsl.Kernel) layoutKey {
	l := layoutKey{nbind: len(k.Bindings)}
	for i, b := range k.Bindings {
		if b.Write {
			l.write |= 1 << i
		}
	}
	return l
}

// bgKey identifies a bind group: its layout and the buffer range of each binding.
type bgKey struct {
	layout  layoutKey
	entries [wgsl.MaxStorageBuffers]bgEntry
}

type bgEntry struct {
	id         uint32
	off, bytes int
}

// matmul pipelines, one per layout of the operands, for each of the two matmul kernels:
// kernel name + suffix.
var matmulVariants = []struct {
	suffix         string
	transA, transB bool
}{{"_nn", false, false}, {"_nt", false, true}, {"_tn", true, false}}

// Options adjusts Open.
type Options struct {
	// Compatibility asks for a compatibility-mode adapter and device even where a core one
	// exists: to check, on any machine, that the kernels run within compatibility limits.
	Compatibility bool
	// Kernels chooses the kernel variants: "gpu" (matmul_tiled's workgroup-memory tiles, a
	// workgroup per row for the row reductions), "fallback" (matmul's register blocks, an
	// invocation per row: no barriers), or "" for the adapter's: fallback on a fallback
	// (software) adapter such as SwiftShader, where barriers cost more than they save, gpu
	// elsewhere. Both compute the same chains per matmul element; see wgsl for the rows.
	Kernels string
	// CompileAll compiles both variants of every kernel at Open, not only the adapter's: to
	// check that all of them compile (under compatibility limits, say) before running any.
	CompileAll bool
}

// Open requests an adapter (a core one, else a compatibility-mode one), a device with the
// adapter's buffer limits, and compiles every kernel. ctx bounds the wait for the browser's
// promises. It returns ErrNoWebGPU or ErrNoAdapter when WebGPU cannot be used: the caller then
// runs the CPU kernels.
func Open(ctx context.Context) (*Device, error) { return OpenWith(ctx, Options{}) }

// OpenWith is Open with options.
func OpenWith(ctx context.Context, o Options) (*Device, error) {
	gpu := js.Global().Get("navigator").Get("gpu")
	if gpu.IsUndefined() || gpu.IsNull() {
		return nil, ErrNoWebGPU
	}
	adapter := js.Null()
	if !o.Compatibility {
		var err error
		adapter, err = await(ctx, gpu.Call("requestAdapter"))
		if err != nil {
			return nil, fmt.Errorf("webgpu: request adapter: %w", err)
		}
	}
	compatRequested := false
	if adapter.IsNull() || adapter.IsUndefined() {
		var err error
		compatRequested = true
		adapter, err = await(ctx, gpu.Call("requestAdapter", object(map[string]any{"featureLevel": "compatibility"})))
		if err != nil {
			return nil, fmt.Errorf("webgpu: request compatibility adapter: %w", err)
		}
		if adapter.IsNull() || adapter.IsUndefined() {
			return nil, ErrNoAdapter
		}
	}
	al := adapter.Get("limits")
	// Ask for the adapter's buffer limits (the defaults, 128 and 256 MiB, are below what most
	// adapters allow); workgroup and binding counts stay at the defaults, which the kernels are
	// written for.
	devPromise := adapter.Call("requestDevice", object(map[string]any{
		"requiredLimits": map[string]any{
			"maxStorageBufferBindingSize": al.Get("maxStorageBufferBindingSize"),
			"maxBufferSize":               al.Get("maxBufferSize"),
		},
	}))
	device, err := await(ctx, devPromise)
	if err != nil {
		return nil, fmt.Errorf("webgpu: request device: %w", err)
	}
	d := &Device{adapter: adapter, device: device, queue: device.Get("queue")}
	lim := device.Get("limits")
	d.info = AdapterInfo{
		Compatibility:                     compatRequested && !device.Get("features").Call("has", "core-features-and-limits").Bool(),
		MaxComputeInvocationsPerWorkgroup: lim.Get("maxComputeInvocationsPerWorkgroup").Int(),
		MaxStorageBufferBindingSize:       int64(lim.Get("maxStorageBufferBindingSize").Float()),
		MaxBufferSize:                     int64(lim.Get("maxBufferSize").Float()),
	}
	if info := adapter.Get("info"); info.Type() == js.TypeObject {
		d.info.Vendor = info.Get("vendor").String()
		d.info.Architecture = info.Get("architecture").String()
		d.info.Description = info.Get("description").String()
		if fb := info.Get("isFallbackAdapter"); fb.Type() == js.TypeBoolean {
			d.info.Fallback = fb.Bool()
		}
	}
	if fb := adapter.Get("isFallbackAdapter"); fb.Type() == js.TypeBoolean { // before Chrome 136
		d.info.Fallback = d.info.Fallback || fb.Bool()
	}
	if err := d.checkLimits(lim); err != nil {
		device.Call("destroy")
		return nil, err
	}
	switch o.Kernels {
	case "":
		d.gpuKernels = !d.info.Fallback
	case "gpu", "fallback":
		d.gpuKernels = o.Kernels == "gpu"
	default:
		device.Call("destroy")
		return nil, fmt.Errorf("webgpu: kernel variants %q: want gpu, fallback or empty", o.Kernels)
	}
	d.maxBinding = int(min(d.info.MaxStorageBufferBindingSize, 1<<31-4) &^ 3)
	d.maxBuffer = d.info.MaxBufferSize
	d.maxGroups = lim.Get("maxComputeWorkgroupsPerDimension").Int()
	d.storageAlign = lim.Get("minStorageBufferOffsetAlignment").Int()

	d.errFunc = js.FuncOf(func(_ js.Value, args []js.Value) any {
		if len(args) > 0 {
			d.setErr(fmt.Errorf("webgpu: %w", jsError([]js.Value{args[0].Get("error")})))
		}
		return nil
	})
	device.Call("addEventListener", "uncapturederror", d.errFunc)
	d.lostFunc = js.FuncOf(func(_ js.Value, args []js.Value) any {
		msg := "device lost"
		if len(args) > 0 {
			if args[0].Get("reason").String() == "destroyed" {
				d.lostFunc.Release() // Close: nothing went wrong
				return nil
			}
			if m := args[0].Get("message"); m.Type() == js.TypeString {
				msg += ": " + m.String()
			}
		}
		d.setErr(errors.New("webgpu: " + msg))
		close(d.lost)
		d.lostFunc.Release() // a device is lost once
		return nil
	})
	d.lost = make(chan struct{})
	device.Get("lost").Call("then", d.lostFunc)

	d.arena = d.newBuffer(arenaSlots*paramSlot, gpuBufferUsage("UNIFORM", "COPY_DST"))
	d.arenaBytes = make([]byte, arenaSlots*paramSlot)
	d.arenaJS = js.Global().Get("Uint8Array").New(arenaSlots * paramSlot)
	d.dynOffsets = js.Global().Get("Uint32Array").New(arenaSlots)
	for i := 0; i < arenaSlots; i++ {
		d.dynOffsets.SetIndex(i, i*paramSlot)
	}
	d.layouts = map[layoutKey]layout{}
	d.bindGroups = map[bgKey]js.Value{}
	if err := d.compile(ctx, o.CompileAll); err != nil {
		d.Close()
		return nil, err
	}
	// Errors from here on are caught per Read (see Read) as well as by the event listener.
	d.pushErrorScopes()
	return d, nil
}

// checkLimits refuses a device that cannot run the kernels as written: fewer than 128
// invocations per workgroup or 8 storage buffers per stage, which no conformant device has.
func (d *Device) checkLimits(lim js.Value) error {
	need := []struct {
		name string
		min  int
	}{
		{"maxComputeInvocationsPerWorkgroup", wgsl.MaxInvocations},
		{"maxComputeWorkgroupSizeX", 128},
		{"maxStorageBuffersPerShaderStage", wgsl.MaxStorageBuffers},
		{"maxComputeWorkgroupStorageSize", wgsl.MaxWorkgroupMemory},
		{"maxDynamicUniformBuffersPerPipelineLayout", 1},
		{"maxUniformBufferBindingSize", paramSlot},
	}
	for _, n := range need {
		if v := lim.Get(n.name).Int(); v < n.min {
			return fmt.Errorf("webgpu: adapter %s has %s %d, the kernels need %d", d.info, n.name, v, n.min)
		}
	}
	if a := lim.Get("minUniformBufferOffsetAlignment").Int(); a > paramSlot {
		return fmt.Errorf("webgpu: adapter %s aligns uniform offsets to %d bytes, the parameter arena to %d", d.info, a, paramSlot)
	}
	return nil
}

// Adapter describes the adapter and device.
func (d *Device) Adapter() AdapterInfo { return d.info }

// Dispatches is the number of kernel dispatches recorded so far (copies routed through kernels
// included): with Stats' reads, what a step costs in round trips and launches.
func (d *Device) Dispatches() int { return d.dispatches }

// GPUKernels reports whether the device runs the kernel variants for GPUs (see Options.Kernels).
func (d *Device) GPUKernels() bool { return d.gpuKernels }

// SetGPUKernels chooses the kernel variants for the ops recorded from now on: Validate checks
// both on any adapter, and the benchmark times both.
func (d *Device) SetGPUKernels(on bool) { d.gpuKernels = on }

func (d *Device) setErr(err error) {
	d.errMu.Lock()
	defer d.errMu.Unlock()
	if d.err == nil {
		d.err = err
	}
}

// Err returns the first GPU error seen so far (an uncaptured validation or out-of-memory error,
// or the loss of the device), or nil. Once set it stays set: results computed after it are not
// to be trusted.
func (d *Device) Err() error {
	d.errMu.Lock()
	defer d.errMu.Unlock()
	return d.err
}

// Lost is closed when the browser loses the device (a driver reset, the GPU process gone); Err
// then says why. Close does not close it.
func (d *Device) Lost() <-chan struct{} { return d.lost }

// Close destroys the device and everything allocated on it. It keeps the GPUDevice handle: a
// goroutine still encoding work when Close runs (a stage unwinding after its worker was stopped)
// then calls a destroyed device, which WebGPU answers with errors (Err, a failed Read), rather
// than a method call on undefined, which panics the whole wasm program.
func (d *Device) Close() {
	if d.closed || d.device.IsUndefined() {
		return
	}
	d.closed = true
	d.setErr(ErrClosed)
	d.device.Call("removeEventListener", "uncapturederror", d.errFunc)
	d.device.Call("destroy")
	// lostFunc releases itself when the lost promise resolves, which destroy causes.
	d.errFunc.Release()
}

func gpuBufferUsage(flags ...string) int {
	u := js.Global().Get("GPUBufferUsage")
	v := 0
	for _, f := range flags {
		v |= u.Get(f).Int()
	}
	return v
}

func (d *Device) newBuffer(bytes int, usage int) js.Value {
	return d.device.Call("createBuffer", object(map[string]any{"size": bytes, "usage": usage}))
}

// compile creates the bind-group layouts and every kernel's pipeline, asynchronously and all at
// once, so that the browser compiles them in parallel and a shader error names its kernel —
// except, unless all, the variants the adapter does not run by default, which pipelineFor
// compiles when they are first used.
func (d *Device) compile(ctx context.Context, all bool) error {
	d.lazy = map[string]lazyPipeline{}
	type pending struct {
		name    string
		kernel  wgsl.Kernel
		module  js.Value
		promise js.Value
	}
	var ps []pending
	for _, k := range wgsl.All() {
		src, err := k.Module()
		if err != nil {
			return err
		}
		module := d.device.Call("createShaderModule", object(map[string]any{"label": k.Name, "code": src}))
		variants := []struct {
			name      string
			constants map[string]any
		}{{k.Name, nil}}
		// Both variants are compiled whatever the adapter, so that either can be validated and
		// timed on any (SetGPUKernels).
		if k.Name == "matmul" || k.Name == "matmul_tiled" {
			variants = variants[:0]
			for _, v := range matmulVariants {
				variants = append(variants, struct {
					name      string
					constants map[string]any
				}{k.Name + v.suffix, map[string]any{"TRANS_A": b2f(v.transA), "TRANS_B": b2f(v.transB)}})
			}
		}
		if k.Grid == wgsl.Rows {
			variants = variants[:0]
			for _, lanes := range []int{wgsl.MaxInvocations, 1} {
				variants = append(variants, struct {
					name      string
					constants map[string]any
				}{rowPipeline(k.Name, lanes), map[string]any{"LANES": lanes}})
			}
		}
		for _, v := range variants {
			compute := map[string]any{"module": module, "entryPoint": k.Name}
			if v.constants != nil {
				compute["constants"] = v.constants
			}
			desc := object(map[string]any{
				"label":   v.name,
				"layout":  d.layout(kernelLayout(k)).pipeline,
				"compute": compute,
			})
			if !all && d.otherVariant(k, v.name) {
				// Compiled on first use (pipelineFor): SwiftShader takes seconds to compile
				// the barrier-heavy GPU variants, which a fallback adapter runs only when
				// asked to (validation, benchmarks).
				d.lazy[v.name] = lazyPipeline{k, desc}
				continue
			}
			ps = append(ps, pending{v.name, k, module, d.device.Call("createComputePipelineAsync", desc)})
		}
	}
	d.pipes = map[string]*pipeline{}
	for _, p := range ps {
		gp, err := await(ctx, p.promise)
		if err != nil {
			return fmt.Errorf("webgpu: compile kernel %s: %w%s", p.name, err, compilationMessages(ctx, p.module))
		}
		d.pipes[p.name] = &pipeline{kernel: p.kernel, gpu: gp, layout: kernelLayout(p.kernel)}
	}
	return nil
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// compilationMessages returns the shader compiler's messages for module, for an error.
func compilationMessages(ctx context.Context, module js.Value) string {
	info, err := await(ctx, module.Call("getCompilationInfo"))
	if err != nil {
		return ""
	}
	msgs := info.Get("messages")
	s := ""
	for i := 0; i < msgs.Length(); i++ {
		m := msgs.Index(i)
		s += fmt.Sprintf("\n  %s at %d:%d: %s", m.Get("type").String(), m.Get("lineNum").Int(), m.Get("linePos").Int(), m.Get("message").String())
	}
	return s
}

// layout returns the bind-group and pipeline layouts for kernels with the storage bindings of
// key: binding 0 the parameter block (dynamic offset), then the storage buffers, writable or
// read-only as the kernel declares them.
func (d *Device) layout(key layoutKey) layout {
	if l, ok := d.layouts[key]; ok {
		return l
	}
	compute := js.Global().Get("GPUShaderStage").Get("COMPUTE").Int()
	entries := []any{map[string]any{
		"binding": 0, "visibility": compute,
		"buffer": map[string]any{"type": "uniform", "hasDynamicOffset": true},
	}}
	for i := 0; i < key.nbind; i++ {
		typ := "read-only-storage"
		if key.write&(1<<i) != 0 {
			typ = "storage"
		}
		entries = append(entries, map[string]any{
			"binding": 1 + i, "visibility": compute, "buffer": map[string]any{"type": typ},
		})
	}
	g := d.device.Call("createBindGroupLayout", object(map[string]any{"entries": entries}))
	p := d.device.Call("createPipelineLayout", object(map[string]any{"bindGroupLayouts": []any{g}}))
	l := layout{g, p}
	d.layouts[key] = l
	return l
}

// pushErrorScopes opens the scopes that Read pops: validation and out-of-memory errors of the
// work between two reads land there instead of only in the console.
func (d *Device) pushErrorScopes() {
	d.device.Call("pushErrorScope", "out-of-memory")
	d.device.Call("pushErrorScope", "validation")
}

// popErrorScopes closes the scopes opened by pushErrorScopes, waits for the errors of the work
// submitted meanwhile, and opens new ones.
func (d *Device) popErrorScopes(ctx context.Context) error {
	pv := d.device.Call("popErrorScope")
	po := d.device.Call("popErrorScope")
	d.pushErrorScopes()
	// Both promises are awaited whatever the first gives: one left without a handler rejects
	// "Uncaught (in promise)" when the device is gone (the page logged it after a lost GPU,
	// TestBrowserWorkerThread/gpu-lost under load).
	var first error
	for _, p := range []js.Value{pv, po} {
		e, err := await(ctx, p)
		switch {
		case first != nil:
		case err != nil:
			first = fmt.Errorf("webgpu: pop error scope: %w", err)
		case !e.IsNull() && !e.IsUndefined():
			first = fmt.Errorf("webgpu: %s", e.Get("message").String())
			d.setErr(first)
		}
	}
	return first
}
