// Package coordinator drives a training job across peers: the hub that serves the workers'
// WebSockets (control messages, signaling relay, the tensor relay fallback), the job loop that
// plans (sched), assigns stages and expert shards, runs each step — tokens in, reports back, the
// clip factor out; in outer mode each replica at its own pace between outer steps (round.go) —
// records it in SQLite (storage), takes and assembles checkpoints, evaluates
// through the pipeline, and deals with peers that leave or join as the rule book says
// (sched.Decide): in outer mode a replica lost during a round is dropped and the others carry on
// (round.go); in step mode the other replicas share a lost replica's micro-batches keeping their
// shards (reshare.go), and workers that join take their stages' state from pool mates that hold it
// (grow.go) — in outer mode once what they add repays the stall of their handovers; step-mode
// replicas' shares follow their measured pace (rebalance.go); otherwise the job replans from the
// newest complete checkpoint; and the HTTP API
// (/ws, /api/status, /blobs/, checkpoint uploads).
//
// Peers are untrusted (docs/design.md, "Trust"): the hub admits workers (a private job's token,
// caps per address and in all) and gives each a session credential that its id, uploads and
// blob downloads are bound to; only the active plan's neighbours may signal or relay to each
// other (Hub.SetLinks); a checkpoint shard is accepted only from the worker asked for it, and
// only as the job's shard (upload.go, checkpoint.go); a peer's claimed speed stands only until its
// steps are measured (measure.go); HTTP is served with per-route deadlines and connection caps
// (limits.go); the embedded TURN server relays only for connected workers, each with a credential
// of its own that its Welcome carries (turn.go).
//
// One goroutine, the job loop (Server.Run), owns the job's state; the hub turns connections into
// events for it. The coordinator never computes the model, and it does not import client (the
// worker runtime): what both sides need — the step spec, the tokens and targets tensors and their
// wire keys, the step-total arithmetic — lives in proto (deps_test.go). Its tests do import client,
// to run real workers in-process.
package coordinator
