//go:build !js

package client

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// The QUIC path between native workers (rtc_quic.go), on real pion peers and real quic-go
// connections over loopback.

// waitQUICRefused waits until t's dial of QUIC to peer has failed.
func waitQUICRefused(t *testing.T, tr *RTCTransport, peer string) {
	t.Helper()
	tr.mu.Lock()
	p := tr.peers[peer]
	tr.mu.Unlock()
	deadline := time.Now().Add(60 * time.Second)
	for !p.quicRefused.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("%s's QUIC dial to %s neither failed nor ended in 60 s (link %q)", tr.id, peer, tr.Link(peer))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// frameCounts is how many frames tr sent to peer on QUIC and on the data channel.
func frameCounts(tr *RTCTransport, peer string) (quicN, dcN int64) {
	tr.mu.Lock()
	p := tr.peers[peer]
	tr.mu.Unlock()
	return p.quicFrames.Load(), p.dcFrames.Load()
}

// exchange sends tensors of several sizes both ways between a and b and checks what arrives.
func exchange(t *testing.T, a, b *RTCTransport) {
	t.Helper()
	rng := rtcSeed(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var sent [2][]proto.Tensor
	for i, n := range []int{1, 1000, proto.MaxChunkPayload / 4, 3 << 20 / 4} {
		sent[0] = append(sent[0], rtcTensor(rng, proto.KindActivation, uint32(i), n))
		g := rtcTensor(rng, proto.KindActivation, uint32(i), n)
		g.Key.Kind = proto.KindActivationGrad
		sent[1] = append(sent[1], g)
	}
	var wg sync.WaitGroup
	for side, pair := range [][2]*RTCTransport{{a, b}, {b, a}} {
		from, to := pair[0], pair[1]
		wg.Go(func() {
			for _, tn := range sent[side] {
				if err := from.Send(ctx, to.id, tn); err != nil {
					t.Error(err)
					return
				}
			}
		})
		wg.Go(func() {
			for _, want := range sent[side] {
				got, err := to.Recv(ctx, want.Key)
				if err != nil {
					t.Error(err)
					return
				}
				if err := sameTensor(got, want); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
}

// TestRTCQUICLink: two native transports signal their QUIC certificates, the offerer (ICE's
// controlling side) dials on the selected pair, and every frame then moves on QUIC, both ways,
// with the data channel left idle.
func TestRTCQUICLink(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	cfg := RTCConfig{Loopback: true}
	a, b := r.add("a", cfg), r.add("b", cfg)
	connectRTC(t, a, b)
	waitLink(t, a, "b", "quic")
	waitLink(t, b, "a", "quic")
	for _, id := range []string{"a", "b"} {
		for _, s := range r.signalsFrom(id) {
			if s.SDP != nil && s.QUIC == "" {
				t.Errorf("%s's %s carries no QUIC certificate", id, s.SDP.Type)
			}
		}
	}
	// The pair ICE selected starts at the socket QUIC runs on: one socket per transport.
	for _, tr := range []*RTCTransport{a, b} {
		for _, p := range tr.peerList() {
			if _, ok := p.quicPath(); !ok {
				t.Errorf("%s: the selected ICE pair is not on the shared socket", tr.id)
			}
		}
	}
	exchange(t, a, b)
	for _, c := range [][2]*RTCTransport{{a, b}, {b, a}} {
		q, d := frameCounts(c[0], c[1].id)
		if q == 0 || d != 0 {
			t.Errorf("%s sent %d frames on QUIC and %d on the data channel, want all on QUIC", c[0].id, q, d)
		}
	}
	if a.Err() != nil || b.Err() != nil {
		t.Errorf("failures: %v, %v", a.Err(), b.Err())
	}
}

// TestRTCQUICWrongCertificate: when the certificate a QUIC end presents is not the one the
// signalling announced — either end's — the handshake is refused, the link stays on its data
// channel, and tensors still move. A stranger dialing a worker's QUIC socket from elsewhere is
// refused too.
func TestRTCQUICWrongCertificate(t *testing.T) {
	_, other, err := selfSignedCert()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, liar string }{
		{"listener refuses the dialer's", "a"}, // b is told another certificate for a
		{"dialer refuses the listener's", "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkRTCGoroutines(t)
			r := newRTCRelay(t)
			r.rewrite = func(s *proto.Signal) {
				if s.From == tc.liar && s.SDP != nil {
					s.QUIC = other
				}
			}
			cfg := RTCConfig{Loopback: true, Logger: testLogger(t)}
			a, b := r.add("a", cfg), r.add("b", cfg)
			connectRTC(t, a, b)
			waitQUICRefused(t, a, "b")
			if la, lb := a.Link("b"), b.Link("a"); la != "datachannel" || lb != "datachannel" {
				t.Fatalf("links %q and %q after a refused certificate, want the data channel", la, lb)
			}
			exchange(t, a, b)
			if q, _ := frameCounts(a, "b"); q != 0 {
				t.Errorf("a sent %d frames on QUIC", q)
			}
			if a.Err() != nil || b.Err() != nil {
				t.Errorf("failures: %v, %v", a.Err(), b.Err())
			}
		})
	}

	t.Run("stranger", func(t *testing.T) {
		checkRTCGoroutines(t)
		a, b := rtcPair(t, RTCConfig{})
		waitLink(t, a, "b", "quic")
		udp, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		tr := &quic.Transport{Conn: udp}
		defer udp.Close()
		defer tr.Close()
		cert, _, err := selfSignedCert()
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e := b.quic
		// It even names b's certificate: only its own key is missing, and its address is no
		// neighbour's ICE pair.
		tlsConf := e.clientTLS(e.fp)
		tlsConf.Certificates = []tls.Certificate{cert}
		conn, err := tr.Dial(ctx, e.udp.LocalAddr(), tlsConf, e.conf)
		if err == nil {
			conn.CloseWithError(0, "")
			t.Fatal("a stranger's QUIC dial to b was accepted")
		}
		t.Logf("stranger refused: %v", err)
		if l := a.Link("b"); l != "quic" || b.Err() != nil {
			t.Errorf("the neighbours' link is %q (%v) after the stranger's attempt", l, b.Err())
		}
	})
}

// TestRTCQUICBlocked: a network that passes ICE and DTLS but drops QUIC (here: every QUIC
// packet the dialer sends) leaves the link on its data channel once the handshake times out,
// without failing the neighbour.
func TestRTCQUICBlocked(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	cfg := RTCConfig{Loopback: true, PeerTimeout: 6 * time.Second} // a 2 s QUIC handshake timeout
	a, b := r.add("a", cfg), r.add("b", cfg)
	a.quicDrop = true
	connectRTC(t, a, b)
	waitQUICRefused(t, a, "b")
	exchange(t, a, b)
	if la, lb := a.Link("b"), b.Link("a"); la != "datachannel" || lb != "datachannel" {
		t.Errorf("links %q and %q with QUIC blocked, want the data channel", la, lb)
	}
	if q, d := frameCounts(a, "b"); q != 0 || d == 0 {
		t.Errorf("a sent %d frames on QUIC and %d on the data channel", q, d)
	}
	if a.Err() != nil || b.Err() != nil {
		t.Errorf("failures: %v, %v", a.Err(), b.Err())
	}
}

// splitNet is a stage's network in TestPipelineOverQUIC: its neighbour stage over an
// RTCTransport, the driver's tokens and targets over the in-memory network.
type splitNet struct {
	mem  Transport
	rtc  *RTCTransport
	peer string
}

func (n splitNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	if to == n.peer {
		return n.rtc.Send(ctx, to, t)
	}
	return n.mem.Send(ctx, to, t)
}

func (n splitNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	if key.Kind == proto.KindActivation || key.Kind == proto.KindActivationGrad {
		return n.rtc.Recv(ctx, key)
	}
	return n.mem.Recv(ctx, key)
}

// TestPipelineOverQUIC: the tiny model in two stages whose boundary crosses two native
// transports — on QUIC, and with QUIC blocked on the data channel it falls back to — trains bit
// for bit as one process does (trainAlongside), and the frames went the way the link says.
func TestPipelineOverQUIC(t *testing.T) {
	for _, blocked := range []bool{false, true} {
		name := map[bool]string{false: "quic", true: "quic-blocked"}[blocked]
		t.Run(name, func(t *testing.T) {
			checkRTCGoroutines(t)
			cfg := model.TinyConfig()
			p, err := NewLocalPipeline(cfg, 21, []int{2}, trainWD)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			r := newRTCRelay(t)
			rcfg := RTCConfig{Loopback: true, PeerTimeout: 6 * time.Second}
			s0, s1 := r.add("stage-0", rcfg), r.add("stage-1", rcfg)
			s0.quicDrop = blocked
			connectRTC(t, s0, s1)
			want := "quic"
			if blocked {
				waitQUICRefused(t, s0, "stage-1")
				want = "datachannel"
			}
			waitLink(t, s0, "stage-1", want)
			waitLink(t, s1, "stage-0", want)
			p.Runners[0].Net = splitNet{mem: p.Runners[0].Net, rtc: s0, peer: "stage-1"}
			p.Runners[1].Net = splitNet{mem: p.Runners[1].Net, rtc: s1, peer: "stage-0"}
			trainAlongside(t, cfg, 21, p)
			for _, c := range [][2]*RTCTransport{{s0, s1}, {s1, s0}} {
				q, d := frameCounts(c[0], c[1].id)
				if blocked && (q != 0 || d == 0) || !blocked && (q == 0 || d != 0) {
					t.Errorf("%s sent %d frames on QUIC and %d on the data channel, want all on %s", c[0].id, q, d, want)
				}
			}
			if err := errors.Join(s0.Err(), s1.Err()); err != nil {
				t.Error(err)
			}
		})
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// sendRawQUIC puts b on a's QUIC link to peer as it is, length prefix included.
func sendRawQUIC(t *testing.T, a *RTCTransport, peer string, b []byte) {
	t.Helper()
	a.mu.Lock()
	p := a.peers[peer]
	a.mu.Unlock()
	l := p.link.Load()
	if l == nil {
		t.Fatalf("%s has no QUIC link to %s", a.id, peer)
	}
	l.mu.Lock()
	l.q = append(l.q, b)
	l.queued += len(b)
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// TestRTCQUICProtocolViolation: frames on the QUIC link meet the same checks as on the data
// channel — a length over a frame's, a malformed frame, a tensor Admit refuses — and the
// receiver fails the sender with ErrProtocolViolation.
func TestRTCQUICProtocolViolation(t *testing.T) {
	good := rtcTensor(rtcSeed(t), proto.KindActivation, 3, 64)
	frame, err := proto.AppendChunk([]byte{0, 0, 0, 0}, good, 0, proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	binary.LittleEndian.PutUint32(frame, uint32(len(frame)-4))
	refused := errors.New("not from you")
	for _, tc := range []struct {
		name  string
		raw   []byte
		admit func(string, proto.FrameHeader) error
		want  error
	}{
		{"oversize-length", binary.LittleEndian.AppendUint32(nil, proto.MaxFrameSize+1), nil, nil},
		{"not-a-frame", append(binary.LittleEndian.AppendUint32(nil, proto.HeaderSize+4), make([]byte, proto.HeaderSize+4)...), nil, proto.ErrFrameVersion},
		{"admission", frame, func(string, proto.FrameHeader) error { return refused }, refused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkRTCGoroutines(t)
			r := newRTCRelay(t)
			a := r.add("a", RTCConfig{Loopback: true})
			b := r.add("b", RTCConfig{Loopback: true, Admit: tc.admit})
			connectRTC(t, a, b)
			waitLink(t, a, "b", "quic")
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			never := good.Key
			never.MicroBatch = 99
			recv := make(chan error, 1)
			go func() { _, err := b.Recv(ctx, never); recv <- err }()
			waitPending(t, b, never)
			sendRawQUIC(t, a, "b", tc.raw)
			err := <-recv
			var pe *PeerError
			if !errors.Is(err, ErrProtocolViolation) || !errors.As(err, &pe) || pe.Peer != "a" ||
				tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("b's pending Recv: %v, want ErrProtocolViolation from a wrapping %v", err, tc.want)
			}
			t.Logf("b: %v", err)
		})
	}
}
