// Package coordinator drives a training job across peers: the hub that serves the workers'
// WebSockets (control messages, signaling relay, the tensor relay fallback), the job loop that
// plans (sched), assigns stages and expert shards, runs each step — tokens in, reports back, the
// clip factor out — records it in SQLite (storage), takes and assembles checkpoints, evaluates
// through the pipeline, and recovers from lost peers by replanning from the newest complete
// checkpoint; and the HTTP API (/ws, /api/status, /blobs/, checkpoint uploads).
//
// One goroutine, the job loop (Server.Run), owns the job's state; the hub turns connections into
// events for it. The coordinator never computes the model: it imports client only for the
// step-total arithmetic and the wire keys that workers share.
package coordinator
