// Package model is Shoal's GPT with mixture-of-experts blocks: exactly what the PyTorch anchor
// (testdata's copy, testdata/torch_gpt_moe.py) computes, with forward and backward
// written by hand as llm.c-style pairs, AdamW, gradient clipping and safetensors checkpoints. It
// is the reference that every other backend and every split of the model across peers is checked
// against.
//
// The seams are the units of placement: a Stage runs blocks [a, b) (the embeddings on the first,
// the head and loss on the last) and an Expert runs one expert MLP; each does forward, backward and
// the optimizer on its own tensors given only its inputs and output gradients. A Stage reaches its
// experts through the Experts interface, so they can live in the same process or on other peers.
// Model is the whole network in one process: one slab, the stage [0, L) and local experts. With
// two or more threads it runs a step's two halves of micro-batches at once, the second on a lane
// (lanes.go: a copy of the stage over the same parameters with gradients of its own), and sums the
// gradient tree's root from the two halves' nodes — the same bits as one lane (TestLanesEqualSerial,
// TestStepBitsPinned).
//
// A job may carry its boundary tensors compressed (bfloat16, int8); the quantisation is then part
// of the model, applied at every block boundary and expert dispatch whatever the plan (wire.go),
// so that every split still computes the single process's bits.
//
// # Devices
//
// Stages, experts and a Shard's optimizer compute through a Device: buffers plus one method per
// layer of package kernels, with the kernels' semantics. Host is the kernels themselves on host
// slices (AVX-512/AVX2 natively, portable Go in wasm) and the default; a WebGPU device implements
// the same methods with shaders, and so does package vulkan. The seam sits where it does so that a GPU is worth having: a
// shard's parameters, gradients, moments and activations stay on the device for the whole step,
// and only what a peer must send or report is read back — a stage's output activations and input
// gradient, the loss, the rows its MoE blocks route to experts on other peers (Experts moves host
// rows; a block whose experts are all on the stage's device routes there, moe.go's dense path,
// and reads back only its statistics), an expert's outputs and input gradients, and, when asked
// for, gradients (norms, replica exchange) and tensors (checkpoints). Shard documents when its host mirror must be pushed or pulled; on Host that is
// free, because the device buffers are the Params' own memory. Model stays on Host.
//
// Determinism: reductions run in a fixed order (rows, micro-batches, tensor names) and the kernels
// never split a reduction by thread count, so results are bitwise reproducible on one backend.
// A device whose ops give the kernels' bits (Host; the test's farDevice) reproduces them too;
// WebGPU is compared with a tolerance.
//
// model imports no network or database package; it is compiled into the wasm worker.
package model
