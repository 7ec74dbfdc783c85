// Package client will be the worker runtime, identical for native daemons and browser tabs: join a
// coordinator, hold a shard (a model.Stage or model.Experts), run the 1F1B schedule and exchange
// activations with neighbours over WebRTC. It must never import storage or coordinator: SQLite has
// to stay out of the wasm build.
package client
