// Package vulkan is Shoal's native GPU backend: a model.Device (and model.NormDevice) that runs
// the training step's kernels as Vulkan compute shaders, so that a native worker with a GPU —
// NVIDIA, AMD, Intel, Apple through MoltenVK, or a CPU through Mesa's lavapipe — trains on it.
//
// # Why Vulkan, loaded at run time
//
// One binary must build for every OS from one tree without cgo (docs/design.md, "The device contract").
// Vulkan is the one compute API every GPU vendor ships a driver for on Linux and Windows (and
// MoltenVK on macOS), and its loader is a plain C library: the device opens it with purego
// (syscall.LoadLibrary on Windows) and calls the few functions it needs through
// vkGetInstanceProcAddr and vkGetDeviceProcAddr, with the C structs written out in vk.go. A
// machine without a driver gets an error from Open, never a crash, and the worker falls back to
// the CPU.
//
// # Kernels
//
// The GLSL sources are in shaders/, compiled to the SPIR-V in spv/ by `go generate ./vulkan/`
// (scripts/gen_spirv.sh, glslangValidator) and embedded; TestSPIRVCurrent fails when the two
// disagree. They compute what package kernels computes, with its accumulate-or-overwrite rules
// and, where the device can, its exact per-element chains: every product element is one
// sequential fma chain over k, as the AVX2/AVX-512 micro-kernels compute it, so that tiling
// changes no result; elementwise kernels mark their arithmetic precise so the compiler does not
// fuse what Go does not. Where Go sums in float64 (LayerNorm statistics, softmax denominators,
// log-sum-exp) the device sums in float32, since float64 is optional in Vulkan and slow on most
// GPUs; the validation suite that the tests run (internal/devcheck, shared with WebGPU) states
// the resulting tolerance per op.
//
// Every reduction has a fixed order that depends on the shape alone — a binary tree over a
// workgroup's invocations for a row, fixed chunks of 32 rows summed in order and then combined in
// chunk order for a column — and nothing uses atomics, so a step gives the same bits on every run
// on one GPU, as docs/design.md's "Determinism" asks; across backends the results are compared with a
// tolerance ("Equivalence, defined").
//
// # Memory and batching
//
// Tensors are ranges of a few large blocks (one VkBuffer and VkDeviceMemory each), because
// drivers cap the number of allocations; kernels bind whole blocks and take element offsets in
// push constants, so a view (Slice) may start anywhere and the descriptor sets are few and
// cached. Host data passes through one mapped staging buffer; its copies are commands in the
// same stream as the kernels, so Write is ordered with the ops before it without a wait.
// SetMemoryLimit caps the tensors' blocks (a volunteer's `shoal worker --gpu-memory`): an
// allocation past it panics as one the device has no memory for does.
//
// Ops are recorded into one command buffer and submitted only when the host needs a value (Read,
// CrossEntropyForward, SquaredNorms): each of those costs one wait, and nothing else waits
// (Waits counts them; TestStepWaits holds the device to it). Between commands the device inserts
// a memory barrier only when a command touches bytes that an earlier one since the last barrier
// wrote, so that independent dispatches (AdamW over a shard's many tensors) overlap on a GPU.
//
// This package imports package model (the interface it implements) and purego; nothing in the
// model, the client or the coordinator depends on it except the worker's device choice.
package vulkan
