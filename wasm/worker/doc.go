//go:build js && wasm

// Command worker is the browser worker: the same client.RunWorker as `shoal worker`, compiled with
// GOOS=js GOARCH=wasm into shoal.wasm, which the contributor page (web/contrib) loads when its
// Start button is pressed. It exposes one global object to the page:
//
//	shoal.start({join, name, memoryBytes, backend, onStatus})  join the page's coordinator
//	shoal.stop(reason) → Promise                               say Bye (reason) and leave; resolves once left
//	shoal.running → bool
//
// onStatus receives client.Status as a plain object (its JSON names) every time it changes, plus
// `compute`, which says what the tab computes on.
//
// The page decides when anything runs: loading shoal.wasm only defines `shoal`; nothing is
// measured or joined before start. The coordinator is the page's own origin.
//
// What the tab computes on is chosen in backend.go, on Start: WebGPU (wasm/webgpu's ModelDevice,
// which keeps the shard's tensors on the GPU) when the browser has an adapter and it runs a
// training step faster than the CPU fallback — package kernels' pure-Go code, one thread — does;
// start's backend ("cpu", "webgpu") forces one.
//
// This package must not import storage, coordinator or anything else that cannot run in a
// browser; client's dependency test (jsdeps_test.go) checks the whole worker's imports.
package main
