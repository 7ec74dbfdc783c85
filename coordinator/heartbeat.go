package coordinator

import (
	"bytes"
	"fmt"
	"strconv"

	"github.com/shoal-ml/shoal/proto"
)

// The hub's heartbeat fast path. Every worker sends a heartbeat per interval (make scale: 10,000
// a second), and proto.DecodeMessage reads each three times over with encoding/json (the
// version, the strict envelope, the strict body) and EncodeMessage marshals its ack twice. A
// heartbeat encoded as proto.EncodeMessage encodes it — which is how every worker, native or
// browser, sends it — is recognised here byte for byte instead, and its ack written from the
// same template; anything else, however equivalent as JSON, takes DecodeMessage's path. What
// the fast path accepts, DecodeMessage decodes to the same Heartbeat (TestHeartbeatFastPath).

// heartbeatTemplate is a heartbeat's encoding around its sequence number.
type heartbeatTemplate struct{ prefix, suffix []byte }

var (
	heartbeatIn  = templateOf(false) // {"v":6,"type":"heartbeat","body":{"seq":N,"ack":false}}
	heartbeatAck = templateOf(true)  // {"v":6,"type":"heartbeat","body":{"seq":N,"ack":true}}
)

// templateOf splits proto's encoding of a heartbeat (Ack: ack) at its sequence number.
func templateOf(ack bool) heartbeatTemplate {
	const seq = 1234567890123456789
	b, err := proto.EncodeMessage(&proto.Heartbeat{Seq: seq, Ack: ack})
	if err != nil {
		panic(fmt.Sprintf("encode a heartbeat: %v", err))
	}
	digits := strconv.FormatUint(seq, 10)
	i := bytes.Index(b, []byte(digits))
	if i < 0 || bytes.Count(b, []byte(digits)) != 1 {
		panic(fmt.Sprintf("heartbeat template: %q holds its sequence number %s other than once", b, digits))
	}
	return heartbeatTemplate{prefix: b[:i:i], suffix: b[i+len(digits):]}
}

// parseHeartbeat returns the sequence number of b when b is a heartbeat (not an ack) exactly as
// proto.EncodeMessage writes one: the template around a JSON number that fits a uint64 (no sign,
// no leading zero, no fraction or exponent).
func parseHeartbeat(b []byte) (uint64, bool) {
	t := heartbeatIn
	if len(b) <= len(t.prefix)+len(t.suffix) || !bytes.HasPrefix(b, t.prefix) || !bytes.HasSuffix(b, t.suffix) {
		return 0, false
	}
	d := b[len(t.prefix) : len(b)-len(t.suffix)]
	if len(d) > 20 || len(d) > 1 && d[0] == '0' {
		return 0, false
	}
	var n uint64
	for _, c := range d {
		if c < '0' || c > '9' {
			return 0, false
		}
		x := uint64(c - '0')
		if n > (1<<64-1-x)/10 {
			return 0, false // past a uint64: DecodeMessage refuses it
		}
		n = n*10 + x
	}
	return n, true
}

// appendHeartbeatAck appends proto.EncodeMessage(&proto.Heartbeat{Seq: seq, Ack: true}) to b.
func appendHeartbeatAck(b []byte, seq uint64) []byte {
	b = append(b, heartbeatAck.prefix...)
	b = strconv.AppendUint(b, seq, 10)
	return append(b, heartbeatAck.suffix...)
}
