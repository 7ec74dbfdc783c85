// Package devcheck is the validation suite of a compute device: every op of model.Device (and the
// matrix products its layers are built from) run on random inputs against its Go reference in
// package kernels, forward and backward, with one tolerance per op (tolerance.go; docs/design.md,
// "Equivalence, defined"). The browser's check (webgpu.Validate, run by wasm/kernelcheck) and the
// Vulkan backend's tests (package vulkan) run the same cases through the same comparisons, so that
// both backends are held to one table.
//
// A backend supplies a Device: a model.NormDevice with MatMulNN, MatMulNT and MatMulTN. What only
// some backends have is optional and checked where present: Primitives (the kernels WebGPU builds
// its ops from), Variants (more than one implementation of a kernel, each checked) and
// GridLimiter (a lowered workgroup-grid limit, so that small tensors need a 2-D grid).
//
// Every tensor is a view at an odd offset inside a larger buffer, whose other elements must come
// back untouched; outputs that an op accumulates into start non-zero, outputs it overwrites start
// with garbage. With Options.Perturb, one input of each case moves by 1% on the device's side only,
// and every case must then fail: that shows each comparison can fail and that its tolerance is far
// below a 1% error. With Options.Twice, each case runs again from the same inputs and must give the
// same bits (docs/design.md, "Determinism").
//
// The package is plain Go: it compiles into the js/wasm kernel check as into native tests.
package devcheck
