// Package webgpu is Shoal's WebGPU backend for the browser: it runs the WGSL kernels of
// kernels/wgsl through syscall/js on whatever adapter the browser offers (a real GPU, or
// Chromium's SwiftShader on a CPU), with the semantics of the Go kernels in package kernels.
//
// A Device owns the GPU device, one compute pipeline per kernel (compiled when it opens), and a
// pending command encoder. Tensors are storage buffers of float32 or int32 elements; Slice makes
// views that share a buffer, and every op honours them (element offsets travel in each
// dispatch's parameter block, so a view may start at any element). Ops — MatMulNN …, the layers,
// AdamW and a few helpers — only record dispatches: tensors stay on the GPU between the ops of a
// step and nothing is submitted until a Read, a Write, a Flush, or a full parameter arena asks
// for it. Read is the one place a step waits for the GPU.
//
// # Tensors that share a buffer
//
// Views of one buffer may be given to one op, as slices of one backing array may be given to a
// Go kernel. WebGPU, though, refuses a buffer bound both read-only and writable in one dispatch,
// and two writable bindings whose ranges overlap (ranges start at 256-byte boundaries). The
// device routes such operands through a copy (an input read from a copy; an output computed in
// a copy, then copied back), so the op still computes what the Go function computes, at the
// price of the copies. Tensors in buffers of their own, or outputs at least 256 bytes apart,
// never pay it. As in package kernels, an output must not overlap an input except where the Go
// function allows it (GELUBackward's dinp may be its dout; the in-place ops take one tensor).
//
// # Kernel variants
//
// The matmul and the row reductions (LayerNorm, softmax, cross-entropy) come in two variants,
// chosen when the device opens by the adapter's isFallbackAdapter (Options.Kernels overrides):
// on a GPU, matmul_tiled (64×64 tiles staged in workgroup memory) and a workgroup per row with a
// tree reduction in workgroup memory; on a fallback adapter (SwiftShader, a CPU), matmul
// (register blocks, no workgroup memory) and an invocation per row, with no barriers, which
// cost far more there than they save. Both variants give every matmul element the Go kernels'
// chain, and reduce rows in fixed orders (see kernels/wgsl). Open compiles the adapter's variant;
// the other is compiled when first used (SetGPUKernels), or at Open with Options.CompileAll.
//
// Validate runs the device validation suite of internal/devcheck — every op against its Go
// reference on random inputs (odd shapes included), with the tolerance table Vulkan is held to
// too — on both variants where there are two; wasm/kernelcheck runs it in a browser and
// wasm/kernels_browser_test.go in headless Chromium, as part of go test ./....
//
// # Blocking
//
// Open, OpenWith, Read, ReadInto, ReadInt32, Finish, SquaredNorms, CrossEntropyMean, TimeMatMul
// and MatMulGFLOPS wait for JavaScript promises. They block the calling goroutine only; the JS
// event loop keeps running. They must not be called from inside a js.Func callback (an event
// handler, a promise continuation): Go's wasm port runs callbacks on the event loop, so waiting
// there for another event deadlocks.
//
// A Device is not safe for concurrent use: one goroutine (the stage's) drives it.
//
// All code but this file is built only for GOOS=js GOARCH=wasm; go build ./... on other systems
// sees an empty package. It imports kernels/wgsl and internal/devcheck (with package kernels, the
// references Validate compares with), and nothing native-only: it is compiled into the browser
// worker.
package webgpu
