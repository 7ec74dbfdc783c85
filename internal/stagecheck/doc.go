// Package stagecheck is the whole-stage check of a compute device: a pipeline stage trained for a
// few steps on the device and on model.Host from the same parameters and data, the kernels
// composed by the model exactly as a worker composes them — MoE routing and local experts
// included. The browser's check (wasm/kernelcheck) and the Vulkan backend's (package vulkan's
// tests) train with it, so that both judge their devices on the same run; each compares the two
// runs with its own report.
package stagecheck
