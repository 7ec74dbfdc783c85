//go:build js && wasm

// Command kernelcheck runs webgpu.Validate — every WGSL kernel against its Go reference — in a
// browser page, and hands the page a JSON report through window.shoalKernelcheckDone (index.html
// turns it into the promise window.kernelcheck). wasm/kernels_browser_test.go loads it in
// headless Chromium on SwiftShader; opened in any WebGPU browser it checks that adapter.
//
// Query parameters: seed=N (the inputs' seed; default 1), perturb=1 (also run every case with a
// perturbed input, which must fail), only=Kernel,Kernel (run only those kernels), compat=1 (ask
// for a compatibility-mode device even where a core one exists), repeat=N (validate with N seeds
// in a row, seed, seed+1, …: a stress run of the tolerances).
//
// Built only for GOOS=js GOARCH=wasm: go build ./... elsewhere skips the package.
package main
