package coordinator

import (
	"bytes"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/proto"
)

// TestHeartbeatFastPath: what the hub's fast path takes for a heartbeat, DecodeMessage decodes to
// that heartbeat; what it refuses goes to DecodeMessage, whatever that makes of it; and its acks
// are EncodeMessage's, byte for byte.
func TestHeartbeatFastPath(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	seqs := []uint64{0, 1, 9, 10, 41, 1 << 32, math.MaxUint64 - 1, math.MaxUint64}
	for range 200 {
		seqs = append(seqs, rng.Uint64()>>rng.IntN(64))
	}
	for _, seq := range seqs {
		b, err := proto.EncodeMessage(&proto.Heartbeat{Seq: seq})
		if err != nil {
			t.Fatal(err)
		}
		got, ok := parseHeartbeat(b)
		if !ok || got != seq {
			t.Fatalf("fast path on %s: %d, %v; want %d", b, got, ok, seq)
		}
		want, err := proto.EncodeMessage(&proto.Heartbeat{Seq: seq, Ack: true})
		if err != nil {
			t.Fatal(err)
		}
		var a ackMsg
		if ack := appendHeartbeatAck(a.buf[:0], seq); !bytes.Equal(ack, want) {
			t.Fatalf("ack of %d: %s, want %s", seq, ack, want)
		} else if &ack[0] != &a.buf[0] {
			t.Fatalf("the ack of %d (%d bytes) does not fit ackMsg's buffer", seq, len(ack))
		}
	}

	canonical, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: 7})
	around := func(digits string) []byte {
		return []byte(strings.Replace(string(canonical), `"seq":7`, `"seq":`+digits, 1))
	}
	refused := [][]byte{
		around(""), around("07"), around("00"), around("-1"), around("+1"), around("1.0"), around("1e3"),
		around(" 7"), around("7 "), around("18446744073709551616"), around("99999999999999999999"),
		around("184467440737095516150"), around("0x10"), around(`"7"`), around("null"),
		[]byte(strings.Replace(string(canonical), `"ack":false`, `"ack":true`, 1)),
		[]byte(strings.Replace(string(canonical), `"v":18`, `"v":2`, 1)),
		[]byte(strings.Replace(string(canonical), `"seq":7,`, `"seq":7,"x":1,`, 1)),
		[]byte(strings.Replace(string(canonical), `"seq":7,"ack":false`, `"ack":false,"seq":7`, 1)),
		append(bytes.Clone(canonical), ' '), append([]byte{' '}, canonical...),
		canonical[:len(canonical)-1], canonical[1:], nil, {},
	}
	for _, b := range refused {
		if seq, ok := parseHeartbeat(b); ok {
			t.Errorf("fast path took %q as heartbeat %d", b, seq)
		}
	}
	// Every input: the fast path agrees with DecodeMessage where it answers. Mutations of the
	// canonical encoding, byte by byte.
	check := func(b []byte) {
		seq, ok := parseHeartbeat(b)
		if !ok {
			return
		}
		m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
		hb, isHB := m.(*proto.Heartbeat)
		if err != nil || !isHB || hb.Ack || hb.Seq != seq {
			t.Errorf("fast path took %q as heartbeat %d; DecodeMessage: %#v, %v", b, seq, m, err)
		}
	}
	for _, s := range []string{"0", "7", "123", strconv.FormatUint(math.MaxUint64, 10)} {
		base := around(s)
		for i := range base {
			for _, c := range []byte("0123456789 -+.eE\"{}:,aftrue\x00\xff") {
				b := bytes.Clone(base)
				b[i] = c
				check(b)
				check(append(bytes.Clone(b[:i]), b[i+1:]...))
				check(append(append(bytes.Clone(b[:i]), c), base[i:]...))
			}
		}
	}

	if n := testing.AllocsPerRun(100, func() { parseHeartbeat(canonical) }); n != 0 {
		t.Errorf("parseHeartbeat allocates %v times", n)
	}
}
