package wan

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/pion/transport/v5"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/proto"
)

// The shaping's promises are lower bounds — a packet never arrives before its delay, a host never
// receives faster than its rate — so these tests assert only those: how much later than the bound
// things happen depends on the machine.

// hostIP is h's address on the network (its eth0).
func hostIP(t *testing.T, h transport.Net) net.IP {
	t.Helper()
	ifi, err := h.InterfaceByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := ifi.Addrs()
	if err != nil || len(addrs) == 0 {
		t.Fatalf("eth0 has no address: %v", err)
	}
	return addrs[0].(*net.IPNet).IP
}

// pair makes a network of l with two hosts, a UDP socket on each, and returns them with b's
// address.
func pair(t *testing.T, l Link) (n *Network, a, b net.PacketConn, bAddr net.Addr) {
	t.Helper()
	n, err := New(l)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	ha, err := n.Host()
	if err != nil {
		t.Fatal(err)
	}
	hb, err := n.Host()
	if err != nil {
		t.Fatal(err)
	}
	ca, err := ha.ListenUDP("udp4", &net.UDPAddr{IP: hostIP(t, ha)})
	if err != nil {
		t.Fatal(err)
	}
	cb, err := hb.ListenUDP("udp4", &net.UDPAddr{IP: hostIP(t, hb), Port: 5000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ca.Close(); cb.Close() })
	return n, ca, cb, cb.LocalAddr()
}

// TestPingTakesRTT: a UDP echo between two hosts takes at least the RTT, however small the
// packets and however idle the link.
func TestPingTakesRTT(t *testing.T) {
	const rtt = 60 * time.Millisecond
	_, a, b, bAddr := pair(t, Link{RateBitsPerS: 200e6, RTT: rtt})
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := b.ReadFrom(buf)
			if err != nil {
				return
			}
			b.WriteTo(buf[:n], from)
		}
	}()
	buf := make([]byte, 1500)
	for i := range 3 {
		start := time.Now()
		if _, err := a.WriteTo([]byte("ping"), bAddr); err != nil {
			t.Fatal(err)
		}
		a.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, _, err := a.ReadFrom(buf)
		if err != nil {
			t.Fatalf("ping %d: %v", i, err)
		}
		took := time.Since(start)
		if string(buf[:n]) != "ping" {
			t.Fatalf("echo %q", buf[:n])
		}
		if took < rtt {
			t.Errorf("ping %d took %v, under the RTT %v", i, took, rtt)
		}
		t.Logf("ping %d: %v (RTT %v)", i, took, rtt)
	}
}

// TestIngressRate: N bytes sent at once to a host arrive no sooner than the rate allows, less
// what the token bucket lets through at once; and all of them arrive (the queue holds them).
func TestIngressRate(t *testing.T) {
	const (
		rate  = 16e6 // bits/s
		total = 600 << 10
		size  = 1200 // an SCTP packet's payload, about
	)
	// A queue that holds the whole burst: this is about the bucket, not drop-tail.
	n, a, b, bAddr := pair(t, Link{RateBitsPerS: rate, RTT: 2 * time.Millisecond, QueueBytes: 2 * total})
	burst := n.Link().BurstBytes
	got := make(chan error, 1)
	var end time.Time
	go func() {
		buf := make([]byte, 1500)
		seen := 0
		for seen < total {
			b.SetReadDeadline(time.Now().Add(10 * time.Second))
			k, _, err := b.ReadFrom(buf)
			if err != nil {
				got <- err
				return
			}
			seen += k
		}
		end = time.Now()
		got <- nil
	}()
	start := time.Now()
	msg := bytes.Repeat([]byte{7}, size)
	for sent := 0; sent < total; sent += size {
		if _, err := a.WriteTo(msg[:min(size, total-sent)], bAddr); err != nil {
			t.Fatal(err)
		}
		if sent%(200*size) == 0 {
			// vnet's sockets queue 1024 packets: let the receiver's reader keep up with a
			// burst that the bucket releases at once.
			time.Sleep(time.Millisecond)
		}
	}
	if err := <-got; err != nil {
		t.Fatalf("receiving: %v", err)
	}
	took := end.Sub(start)
	floor := time.Duration(float64(total-burst) * 8 / rate * float64(time.Second))
	t.Logf("%d bytes through a %g Mb/s ingress (bucket %d bytes): %v, floor %v, %.1f Mb/s",
		total, rate/1e6, burst, took, floor, float64(total)*8/took.Seconds()/1e6)
	if took < floor {
		t.Errorf("%d bytes arrived in %v, faster than %g b/s allows (%v)", total, took, rate, floor)
	}
}

// TestLoss: with 20% loss, some but not all of a burst's packets arrive — and the same seed drops
// the same share again.
func TestLoss(t *testing.T) {
	const packets = 200
	count := func() int {
		_, a, b, bAddr := pair(t, Link{RTT: time.Millisecond, Loss: 0.2, Seed: 42})
		for i := range packets {
			if _, err := a.WriteTo([]byte{byte(i)}, bAddr); err != nil {
				t.Fatal(err)
			}
		}
		got := 0
		buf := make([]byte, 16)
		for {
			// The packets that made it are queued on b within a millisecond or so; half a
			// second of silence after the last is plenty on any machine.
			b.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			if _, _, err := b.ReadFrom(buf); err != nil {
				var ne net.Error
				if !errors.As(err, &ne) || !ne.Timeout() {
					t.Fatal(err)
				}
				return got
			}
			got++
		}
	}
	got := count()
	t.Logf("%d of %d packets arrived at 20%% loss", got, packets)
	if got == 0 || got == packets {
		t.Errorf("%d of %d packets arrived at 20%% loss, want some but not all", got, packets)
	}
	if again := count(); again != got {
		t.Errorf("the same seed let %d packets through, then %d", got, again)
	}
}

// TestUnshapedThroughput reports what the simulation itself sustains with no rate and no delay:
// the ceiling of any shaped link on this machine (a figure, not an assertion).
func TestUnshapedThroughput(t *testing.T) {
	const total, size = 8 << 20, 1200
	_, a, b, bAddr := pair(t, Link{})
	type result struct {
		bytes int
		last  time.Time
	}
	done := make(chan result, 1)
	go func() {
		buf := make([]byte, 1500)
		var r result
		for r.bytes < total {
			b.SetReadDeadline(time.Now().Add(time.Second))
			k, _, err := b.ReadFrom(buf)
			if err != nil {
				break
			}
			r.bytes += k
			r.last = time.Now()
		}
		done <- r
	}()
	start := time.Now()
	msg := make([]byte, size)
	for sent := 0; sent < total; sent += size {
		a.WriteTo(msg, bAddr)
		if sent%(256*size) == 0 {
			// Paced a little, so that the receiving socket's 1024-packet queue is what limits
			// rather than what overflows.
			time.Sleep(100 * time.Microsecond)
		}
	}
	r := <-done
	took := r.last.Sub(start)
	t.Logf("unshaped vnet, 1200-byte datagrams: %d of %d bytes arrived in %v: %.0f Mb/s",
		r.bytes, total, took, float64(r.bytes)*8/took.Seconds()/1e6)
}

// TestBadLinks: settings that cannot be a link are refused.
func TestBadLinks(t *testing.T) {
	for _, l := range []Link{{RateBitsPerS: -1}, {RTT: -time.Millisecond}, {Loss: 1}, {Loss: -0.1}} {
		if n, err := New(l); err == nil {
			n.Close()
			t.Errorf("New(%+v) accepted", l)
		}
	}
}

// signals hands the transports' signals to each other directly, as the coordinator would.
type signals struct {
	mu    sync.Mutex
	peers map[string]*client.RTCTransport
}

type signalEnd struct {
	s    *signals
	from string
}

func (e signalEnd) SendSignal(ctx context.Context, to string, sig proto.Signal) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sig.From = e.from
	e.s.mu.Lock()
	dst := e.s.peers[to]
	e.s.mu.Unlock()
	if dst == nil {
		return fmt.Errorf("no peer %s", to)
	}
	dst.HandleSignal(e.from, sig)
	return nil
}

// TestDataChannelOverWAN: two workers' data planes (client.RTCTransport, in loopback mode as in
// the tests' clusters) connect over a network's hosts — ICE, DTLS and SCTP all on the simulation —
// and move tensors through it no faster than its rate; the same without shaping shows what the
// simulation and pion together sustain on this machine.
func TestDataChannelOverWAN(t *testing.T) {
	const frames = 160 // of 64 KiB: 10 MiB
	for _, l := range []Link{{}, {RateBitsPerS: 200e6, RTT: 50 * time.Millisecond}} {
		n, err := New(l)
		if err != nil {
			t.Fatal(err)
		}
		sig := &signals{peers: map[string]*client.RTCTransport{}}
		var tr [2]*client.RTCTransport
		for i, id := range []string{"a", "b"} {
			h, err := n.Host()
			if err != nil {
				t.Fatal(err)
			}
			tr[i] = client.NewRTCTransport(id, client.RTCConfig{Loopback: true, Net: h}, signalEnd{sig, id})
			sig.mu.Lock()
			sig.peers[id] = tr[i]
			sig.mu.Unlock()
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		errs := make(chan error, 2)
		go func() { errs <- tr[0].Connect(ctx, "b", true) }()
		go func() { errs <- tr[1].Connect(ctx, "a", false) }()
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatalf("connect over %+v: %v", l, err)
			}
		}
		x := make([]byte, proto.MaxChunkPayload)
		tn := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, Expert: proto.NoExpert},
			DType: proto.F32, Shape: proto.Shape{uint32(len(x) / 4), 1, 1, 1}, Data: x}
		start := time.Now()
		key := tn.Key // before the sends below change tn's
		go func() {
			for i := range frames {
				key.MicroBatch = uint32(i)
				if _, err := tr[1].Recv(ctx, key); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
		for i := range frames {
			tn.Key.MicroBatch = uint32(i)
			if err := tr[0].Send(ctx, "b", tn); err != nil {
				t.Fatal(err)
			}
		}
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		total := frames * len(x)
		t.Logf("rate %g Mb/s, RTT %v: %d MiB through a data channel in %v: %.0f Mb/s",
			float64(l.RateBitsPerS)/1e6, l.RTT, total>>20, took.Round(time.Millisecond), float64(total)*8/took.Seconds()/1e6)
		if l.RateBitsPerS > 0 {
			floor := time.Duration(float64(total-n.Link().BurstBytes) * 8 / float64(l.RateBitsPerS) * float64(time.Second))
			if took < floor {
				t.Errorf("%d bytes in %v: faster than the link's %v", total, took, floor)
			}
		}
		cancel()
		tr[0].Close()
		tr[1].Close()
		n.Close()
	}
}
