// Package model is Shoal's GPT with mixture-of-experts blocks on the CPU: exactly what the PyTorch
// anchor (../shared/anchors/torch_gpt_moe.py, copied to testdata/) computes, with forward and
// backward written by hand as llm.c-style pairs, AdamW, gradient clipping and safetensors
// checkpoints. It is the reference that every other backend and every split of the model across
// peers is checked against.
//
// The seams are the units of placement: a Stage runs blocks [a, b) (the embeddings on the first,
// the head and loss on the last) and an Expert runs one expert MLP; each does forward, backward and
// the optimizer on its own tensors given only its inputs and output gradients. A Stage reaches its
// experts through the Experts interface, so they can live in the same process or on other peers.
// Model is the whole network in one process: one slab, the stage [0, L) and local experts.
//
// Determinism: reductions run in a fixed order (rows, micro-batches, tensor names) and the kernels
// never split a reduction by thread count, so results are bitwise reproducible on one backend.
//
// model imports no network or database package; it is compiled into the wasm worker.
package model
