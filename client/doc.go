// Package client is the worker runtime, the same code for native daemons and browser tabs: it
// holds a shard (a model.Stage with its experts, or expert shards), runs a step's 1F1B schedule
// from package sched, and moves tensors to its neighbours through a Transport — in memory for
// tests, WebRTC between peers: data channels, and QUIC on the path ICE selected between two
// native workers (rtc_quic.go). Across a plan change a worker keeps the shard it holds when the
// coordinator says so (proto.Keep), and hands its state to a pool mate taking up the same blocks,
// or takes it up from one, peer to peer (handover.go).
//
// client must never import storage or coordinator: SQLite and the server stay out of the wasm
// build.
package client
