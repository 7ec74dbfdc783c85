//go:build js && wasm

// Command worker is the browser worker: the same client.RunWorker as `shoal worker`, compiled with
// GOOS=js GOARCH=wasm into shoal.wasm, which the contributor page (web/contrib) loads when its
// Start button is pressed, in a dedicated worker of its own (web/contrib/worker.js), so that its
// compute, its WebGPU device, its WebSocket and its timers never hold the page's thread. Its
// peer connections, which Chromium offers only on the page, reach it through a bridge
// (web/contrib/rtcbridge.js and rtcpage.js) that pion/webrtc's js build sees as RTCPeerConnection.
// It exposes one global object to the worker's script:
//
//	shoal.start({join, name, memoryBytes, backend, modelConfig, onStatus})  join the page's coordinator
//	shoal.stop(reason) → Promise                               say Bye (reason) and leave; resolves once left
//	shoal.stop(reason, true) → Promise                         leave at the job's next step boundary (reason); resolves once left
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
// start's backend ("cpu", "webgpu") forces one. The benchmark times a step of the job's own layers
// (modelConfig, the job's model as JSON) on each backend in about two seconds in all. A GPU
// device lost while the worker runs makes it leave and join again on the CPU.
//
// This package must not import storage, coordinator or anything else that cannot run in a
// browser; client's dependency test (jsdeps_test.go) checks the whole worker's imports.
package main
