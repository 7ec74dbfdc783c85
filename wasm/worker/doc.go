//go:build js && wasm

// Command worker is the browser worker: the same client.RunWorker as `shoal worker`, compiled with
// GOOS=js GOARCH=wasm into shoal.wasm, which the contributor page (web/contrib) loads when its
// Start button is pressed. It exposes one global object to the page:
//
//	shoal.start({join, name, memoryBytes, onStatus})  join the page's coordinator as a browser worker
//	shoal.stop(reason) → Promise                      say Bye (reason) and leave; resolves once left
//	shoal.running → bool
//
// onStatus receives client.Status as a plain object (its JSON names) every time it changes, plus
// `compute`, which says what the tab computes on.
//
// The page decides when anything runs: loading shoal.wasm only defines `shoal`; nothing is
// measured or joined before start. The coordinator is the page's own origin.
//
// What the tab computes on is chosen in backend.go. Today that is the CPU fallback — package
// kernels' pure-Go code, which is what it selects in a wasm build — and the WebGPU backend
// (wasm/webgpu) will be chosen there when the page has an adapter.
//
// This package must not import storage, coordinator or anything else that cannot run in a
// browser; client's dependency test (jsdeps_test.go) checks the whole worker's imports.
package main
