// Package wgsl holds Shoal's WebGPU compute kernels: the WGSL sources, embedded with go:embed,
// and what a host needs to run them — entry point, storage bindings in order, the fields of the
// uniform parameter block, workgroup size and how the launch grid is sized.
//
// Each kernel computes what a Go reference in package kernels computes, with the same
// semantics: where the Go function accumulates (every backward into parameter gradients, matmul
// with acc) the kernel accumulates, where it overwrites the kernel overwrites. The browser
// backend (wasm/webgpu) runs them through syscall/js and validates each one against its Go
// reference with a stated tolerance.
//
// # Conventions every kernel follows
//
//   - @group(0) @binding(0) is the uniform Params block; storage buffers follow at @binding(1)…
//     in the argument order of the Go reference (outputs first, as in the kernels package).
//   - Params starts with one element offset per storage binding (off_<name>), then the kernel's
//     own fields, every field 4 bytes (u32 or f32). Offsets travel in Params, not as binding
//     offsets, so a tensor view may start at any element: binding offsets must be multiples of
//     256 bytes (minStorageBufferOffsetAlignment).
//   - Inputs are read-only storage (var<storage, read>) and outputs read_write. WebGPU lets
//     read-only bindings of one buffer overlap freely (attention reads q and k out of one qkv
//     tensor) but refuses a buffer bound both read-only and writable in one dispatch, and two
//     writable bindings whose ranges overlap; the host works around those (see wasm/webgpu).
//   - At most 128 invocations per workgroup, 8 storage buffers and 16 KiB of workgroup memory:
//     the defaults of a compatibility-mode device, so one set of shaders runs on every adapter.
//   - No atomics and no reduction split that depends on the launch, so results are
//     deterministic run to run. A row's sum (LayerNorm, softmax, cross-entropy) is one
//     workgroup's: strided partial sums, then a fixed pairwise tree in workgroup memory
//     (reduce.wgsl). A column's sum over rows (bias and LayerNorm parameter gradients) is
//     chunks of ColumnChunk rows summed in row order, then a fixed pairwise tree over the chunks
//     (colsum_tree): the shapes depend on the sizes alone. Both differ from the Go reference's
//     order, within the tolerances wasm/webgpu states. A matmul element and the embedding
//     gradients keep the Go reference's own chain, as do the MoE routing kernels' dots over a
//     row (gate_grad, softmax_backward_rows). moe_stats, whose Go reference sums in float64,
//     sums each of its few columns in one workgroup: strided partial sums in row order, then a
//     fixed pairwise tree.
//
// Module returns a kernel's complete source: common.wgsl (shared helpers, since WGSL has no
// include), reduce.wgsl for the kernels that reduce in a workgroup, then the kernel's file.
//
// This package imports only the standard library and never syscall/js: a native WebGPU backend
// (Dawn or wgpu) is meant to run the same shaders.
package wgsl
