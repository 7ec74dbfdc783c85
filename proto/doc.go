// Package proto defines what Shoal's coordinator and workers say to each other: the JSON control
// messages of the /ws WebSocket (join, signaling, the step protocol, heartbeats) and the binary
// frames that carry tensors between peers over WebRTC data channels, or through the coordinator
// when ICE fails (docs/design.md, "Wire").
//
// It is defined once, here, so that the native worker, the wasm worker in a browser tab and the
// coordinator cannot drift apart; ProtocolVersion and FrameVersion are bumped whenever a change
// would let an old peer misread a new one. For the same reason the little that both sides compute
// about a step lives here too (stepspec.go, steptotals.go): how its tokens and targets are named
// and framed, and how the shards' reports add up — the coordinator does not import client.
//
// A frame's header has the same fields whatever its kind, but each kind means something of its
// own by them: keys.go gives every family of kinds a typed key (StageKey, ExpertKey,
// GradReduceKey, …) that names them, and a frame is encoded or decoded only if its kind's parser
// accepts its key.
//
// Everything that decodes input from the network checks lengths, shapes, dtypes and finiteness
// before it allocates, returns errors that wrap the sentinels of errors.go, and is fuzzed
// (FuzzDecodeMessage, FuzzDecodeFrame, FuzzReassemble, FuzzParseKey, FuzzTypedKey).
//
// proto imports the standard library only: it is compiled into the wasm worker, and the
// coordinator, client and sched packages all depend on it.
package proto
