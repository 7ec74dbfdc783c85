// Package wasm will hold the browser entry point (GOOS=js GOARCH=wasm) and the WebGPU backend
// driven through syscall/js; the WGSL sources live beside the Go kernels in package kernels.
package wasm
