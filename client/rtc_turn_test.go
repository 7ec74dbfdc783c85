//go:build !js

package client

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/pion/logging"
	"github.com/pion/turn/v5"
	"github.com/pion/webrtc/v4"

	"github.com/shoal-ml/shoal/proto"
)

// startLoopbackTURN runs a pion TURN server on 127.0.0.1 whose relays are on 127.0.0.1, with one
// static credential, and returns the ICE server that names it.
func startLoopbackTURN(t *testing.T) proto.ICEServer {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lf := logging.NewDefaultLoggerFactory()
	lf.DefaultLogLevel = logging.LogLevelDisabled
	key := turn.GenerateAuthKey("user", "test", "pass")
	srv, err := turn.NewServer(turn.ServerConfig{Realm: "test", LoggerFactory: lf,
		AuthHandler: func(ra *turn.RequestAttributes) (string, []byte, bool) {
			return ra.Username, key, ra.Username == "user"
		},
		PacketConnConfigs: []turn.PacketConnConfig{{PacketConn: pc,
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{RelayAddress: net.IPv4(127, 0, 0, 1), Address: "127.0.0.1"}}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	port := strconv.Itoa(pc.LocalAddr().(*net.UDPAddr).Port)
	return proto.ICEServer{URLs: []string{"turn:127.0.0.1:" + port + "?transport=udp"}, Username: "user", Credential: "pass"}
}

// selectedPair is the candidate pair ICE selected on a's connection to peer.
func selectedPair(t *testing.T, a *RTCTransport, peer string) *webrtc.ICECandidatePair {
	t.Helper()
	a.mu.Lock()
	p := a.peers[peer]
	a.mu.Unlock()
	pair, err := p.pc.SCTP().Transport().ICETransport().GetSelectedCandidatePair()
	if err != nil || pair == nil {
		t.Fatalf("%s → %s: no selected pair (%v)", a.id, peer, err)
	}
	return pair
}

// TestRTCRelayOnlyThroughLoopbackTURN: in loopback mode with RelayOnly, two transports connect
// through a TURN server on 127.0.0.1 — loopback mode keeps an ICE server on a loopback address —
// and the pair each side selected is of relayed candidates on 127.0.0.1; a tensor crosses it.
func TestRTCRelayOnlyThroughLoopbackTURN(t *testing.T) {
	checkRTCGoroutines(t)
	ice := startLoopbackTURN(t)
	cfg := RTCConfig{Loopback: true, RelayOnly: true, ICEServers: []proto.ICEServer{ice}}
	r := newRTCRelay(t)
	a, b := r.add("a", cfg), r.add("b", cfg)
	connectRTC(t, a, b)
	for _, c := range []struct {
		from *RTCTransport
		to   string
	}{{a, "b"}, {b, "a"}} {
		pair := selectedPair(t, c.from, c.to)
		if pair.Local.Typ != webrtc.ICECandidateTypeRelay || pair.Remote.Typ != webrtc.ICECandidateTypeRelay ||
			pair.Local.Address != "127.0.0.1" || pair.Remote.Address != "127.0.0.1" {
			t.Errorf("%s → %s selected %s", c.from.id, c.to, pair)
		}
	}
	tn := rtcTensor(rtcSeed(t), proto.KindActivation, 0, 64, 1024)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := a.Send(ctx, "b", tn); err != nil {
		t.Fatal(err)
	}
	got, err := b.Recv(ctx, tn.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := sameTensor(got, tn); err != nil {
		t.Error(err)
	}
}

// TestRTCLoopbackIgnoresOtherICEServers: loopback mode does not ask an ICE server that is not on
// a loopback address (its packets would leave the host): with relay-only ICE and only such a
// server, there is no candidate at all, and the connection does not come up.
func TestRTCLoopbackIgnoresOtherICEServers(t *testing.T) {
	checkRTCGoroutines(t)
	cfg := RTCConfig{Loopback: true, RelayOnly: true,
		ICEServers: []proto.ICEServer{{URLs: []string{"turn:192.0.2.1:3478?transport=udp"}, Username: "u", Credential: "p"}}}
	r := newRTCRelay(t)
	a, b := r.add("a", cfg), r.add("b", cfg)
	if len(a.ice) != 0 {
		t.Fatalf("loopback mode kept %v", a.ice)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	errs := make(chan error, 2)
	go func() { errs <- a.Connect(ctx, "b", true) }()
	go func() { errs <- b.Connect(ctx, "a", false) }()
	for range 2 {
		if err := <-errs; err == nil {
			t.Error("a relay-only connection came up without a TURN server")
		}
	}
}
