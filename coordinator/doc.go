// Package coordinator will drive jobs across peers: the worker registry, the signaling relay, the
// step driver over the plan from sched, checkpoints in storage, and the HTTP and WebSocket API
// (DESIGN.md, "Wire"). It is built in the pipeline issue; until then `shoal train` runs a job in
// one process through package local.
package coordinator
