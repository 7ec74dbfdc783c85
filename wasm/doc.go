// Package wasm is Shoal in the browser (GOOS=js GOARCH=wasm): the worker's browser entry point,
// and the WebGPU backend driven through syscall/js (wasm/webgpu), whose WGSL shaders live in
// kernels/wgsl beside the Go kernels they are checked against. This package's own files are the
// tests that run those in headless Chromium: kernels_browser_test.go (every kernel against its Go
// reference, and whole stages trained on WebGPU against the CPU, through wasm/kernelcheck) and matmul_bench_test.go (WGSL matmul against TensorFlow.js,
// run by scripts/bench_webgpu.sh).
package wasm
