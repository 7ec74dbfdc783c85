//go:build js && wasm

package webgpu

import "errors"

// ErrNoWebGPU: the browser has no navigator.gpu (not a WebGPU browser, WebGPU disabled, or not a
// secure context — plain http:// from another host than localhost). The caller falls back to the
// CPU kernels.
var ErrNoWebGPU = errors.New("webgpu: this browser exposes no WebGPU (navigator.gpu is missing; a page served over plain http from another host than localhost never has it)")

// ErrNoAdapter: navigator.gpu offered no adapter, not even in compatibility mode (blocklisted
// GPU, or no GPU and no software fallback enabled). The caller falls back to the CPU kernels.
var ErrNoAdapter = errors.New("webgpu: no WebGPU adapter (requestAdapter returned null in core and compatibility mode)")

// ErrReleased: a tensor was used after Release.
var ErrReleased = errors.New("webgpu: tensor used after Release")

// ErrClosed is Err after Close: work encoded on a destroyed device computes nothing.
var ErrClosed = errors.New("webgpu: device closed")
