package coordinator

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pion/logging"
	"github.com/pion/turn/v5"

	"github.com/shoal-ml/shoal/proto"
)

// turnMembers is the set of connected workers a test TURN server asks.
type turnMembers struct {
	mu  sync.Mutex
	ids map[string]bool
}

func (m *turnMembers) has(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.ids[id]
}

func (m *turnMembers) set(id string, in bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ids[id] = in
}

func startTestTURN(t *testing.T, cfg TURNConfig) (*turnServer, *turnMembers) {
	t.Helper()
	m := &turnMembers{ids: map[string]bool{}}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	ts, err := startTURN(cfg, m.has, func(netip.Addr) bool { return false }, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ts.Close() })
	return ts, m
}

// turnAllocate asks ts for a relay with credential c from a fresh local socket.
func turnAllocate(t *testing.T, c proto.ICEServer) (net.PacketConn, *turn.Client, error) {
	t.Helper()
	addr := strings.TrimSuffix(strings.TrimPrefix(c.URLs[0], "turn:"), "?transport=udp")
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lf := logging.NewDefaultLoggerFactory()
	lf.DefaultLogLevel = logging.LogLevelDisabled
	cl, err := turn.NewClient(&turn.ClientConfig{STUNServerAddr: addr, TURNServerAddr: addr, Conn: pc,
		Username: c.Username, Password: c.Credential, LoggerFactory: lf, RTO: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Listen(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close(); pc.Close() })
	relay, err := cl.Allocate()
	return relay, cl, err
}

// TestTURNCredentials: a connected worker's credential allocates a relay on loopback; a forged,
// an expired and an unknown worker's credential do not, and a worker holds at most
// MaxAllocations relays.
func TestTURNCredentials(t *testing.T) {
	ts, members := startTestTURN(t, TURNConfig{MaxAllocations: 2})
	members.set("w-a", true)
	good := ts.credentials("w-a")
	if !strings.HasPrefix(good.URLs[0], "turn:127.0.0.1:") || !strings.HasSuffix(good.Username, ":w-a") {
		t.Fatalf("credential %+v", good)
	}
	relay, _, err := turnAllocate(t, good)
	if err != nil {
		t.Fatalf("a connected worker's credential: %v", err)
	}
	if ip := relay.LocalAddr().(*net.UDPAddr).IP; !ip.IsLoopback() {
		t.Fatalf("relayed address %v, want loopback", relay.LocalAddr())
	}

	forged := good
	forged.Credential = ts.password(good.Username + "x")
	other := good
	other.Username = strings.Replace(good.Username, "w-a", "w-b", 1) // w-a's password for w-b
	unknown := ts.credentials("w-c")                                 // signed, but w-c is not connected
	expired := ts.credentialsAt("w-a", time.Now().Add(-2*ts.ttl))
	for name, c := range map[string]proto.ICEServer{"forged": forged, "another worker's": other, "unknown worker's": unknown, "expired": expired} {
		if _, _, err := turnAllocate(t, c); err == nil {
			t.Errorf("a relay for a %s credential", name)
		}
	}
	if ts.refused.Load() == 0 {
		t.Error("no refusal counted")
	}

	if _, _, err := turnAllocate(t, good); err != nil {
		t.Fatalf("second relay: %v", err)
	}
	if _, _, err := turnAllocate(t, good); err == nil {
		t.Error("a third relay past MaxAllocations 2")
	}
	if n := ts.allocations(); n != 2 {
		t.Errorf("%d relays open, want 2", n)
	}
}

// TestTURNRevoke: when a worker leaves, its relays are closed at once and pion deletes their
// allocations; its credential then allocates nothing.
func TestTURNRevoke(t *testing.T) {
	ts, members := startTestTURN(t, TURNConfig{})
	members.set("w-a", true)
	c := ts.credentials("w-a")
	if _, _, err := turnAllocate(t, c); err != nil {
		t.Fatal(err)
	}
	if n := ts.srv.AllocationCount(); n != 1 {
		t.Fatalf("%d allocations, want 1", n)
	}
	members.set("w-a", false) // the hub forgets the worker, then revokes (Hub.removeLocked)
	ts.revoke("w-a")
	if n := ts.allocations(); n != 0 {
		t.Errorf("%d relays open after revoke", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for ts.srv.AllocationCount() != 0 {
		select {
		case <-ctx.Done():
			t.Fatalf("pion still holds %d allocations", ts.srv.AllocationCount())
		case <-time.After(10 * time.Millisecond):
		}
	}
	if _, _, err := turnAllocate(t, c); err == nil {
		t.Error("a departed worker's credential allocated a relay")
	}
}

// TestTURNPermissions: a loopback server relays to loopback peers only; a public one to its own
// relays and the public addresses workers are connected from (an IPv6 /64), never to other
// hosts or the coordinator host's private networks, even where a worker connected from one.
func TestTURNPermissions(t *testing.T) {
	workers := map[string]bool{"198.51.100.20": true, "2001:db8::/64": true, "10.1.2.3": true, "127.0.0.1": true}
	fromPeer := func(ip netip.Addr) bool { return workers[ipKey(ip)] }
	lo := &turnServer{loopback: true, public: net.ParseIP("127.0.0.1"), fromPeer: fromPeer}
	pub := &turnServer{public: net.ParseIP("203.0.113.7"), fromPeer: fromPeer}
	for _, c := range []struct {
		s    *turnServer
		peer string
		want bool
	}{
		{lo, "127.0.0.1", true}, {lo, "::1", true}, {lo, "192.0.2.1", false}, {lo, "10.0.0.1", false},
		{pub, "203.0.113.7", true}, {pub, "198.51.100.20", true}, {pub, "::ffff:198.51.100.20", true},
		{pub, "2001:db8::1", true}, {pub, "2001:db8::abcd", true},
		{pub, "198.51.100.21", false}, {pub, "2001:db8:0:1::1", false}, {pub, "8.8.8.8", false},
		{pub, "10.1.2.3", false}, {pub, "192.168.1.1", false}, {pub, "127.0.0.1", false}, {pub, "169.254.169.254", false},
		{pub, "fd00::1", false}, {pub, "0.0.0.0", false}, {pub, "224.0.0.1", false},
	} {
		if got := c.s.permit(nil, net.ParseIP(c.peer)); got != c.want {
			t.Errorf("server %v, peer %s: permit %v, want %v", c.s.public, c.peer, got, c.want)
		}
	}
}

// TestTURNConfigErrors: an unspecified listen address needs the public one; a name, and a
// port range upside down or open at the bottom, are refused.
func TestTURNConfigErrors(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, cfg := range []TURNConfig{{Listen: "0.0.0.0:0"}, {Listen: "localhost:0"}, {Listen: "127.0.0.1"},
		{Listen: "127.0.0.1:0", MinPort: 41300, MaxPort: 41200}, {Listen: "127.0.0.1:0", MaxPort: 41200}} {
		if ts, err := startTURN(cfg, func(string) bool { return true }, func(netip.Addr) bool { return true }, log); err == nil {
			ts.Close()
			t.Errorf("%+v accepted", cfg)
		}
	}
}

// TestTURNRelayPortsAndRate: relays are made in the configured port range, and what one worker's
// relays send on is held to its allowance: the rest is dropped.
func TestTURNRelayPortsAndRate(t *testing.T) {
	const minPort, maxPort = 41200, 41299
	ts, members := startTestTURN(t, TURNConfig{MinPort: minPort, MaxPort: maxPort, BytesPerS: 1000})
	members.set("w-a", true)
	members.set("w-b", true)
	a, _, err := turnAllocate(t, ts.credentials("w-a"))
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := turnAllocate(t, ts.credentials("w-b"))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []net.PacketConn{a, b} {
		if p := r.LocalAddr().(*net.UDPAddr).Port; p < minPort || p > maxPort {
			t.Errorf("relay on port %d, outside %d-%d", p, minPort, maxPort)
		}
	}
	// What a's relays send on is held to w-a's allowance (64 KiB of burst, then 1000 B/s):
	// written straight to its relay socket, as pion does with each packet a sends.
	var rc *relayConn
	ts.mu.Lock()
	for c := range ts.relays["w-a"] {
		rc = c
	}
	ts.mu.Unlock()
	const packets, size = 200, 1000
	msg := make([]byte, size)
	began := time.Now()
	for range packets {
		if _, err := rc.WriteTo(msg, b.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	sent := ts.relayed.Load() / size
	if limit := (1<<16 + 1000*int64(time.Since(began).Seconds()+1)) / size; sent > limit || sent == 0 {
		t.Errorf("%d packets of %d B sent on, want 1 to the allowance's %d", sent, size, limit)
	}
	if d := ts.dropped.Load(); d != packets-sent {
		t.Errorf("%d packets dropped, want %d", d, packets-sent)
	}
}
