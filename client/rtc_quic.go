//go:build !js

package client

// QUIC between native workers, on the path ICE opened (issue 34). pion's data channel costs
// about 20 CPU-seconds per GB of frames for both ends (SCTP over DTLS, 1191-byte packets, one
// DTLS record each); quic-go on a real UDP socket, with segmentation offload and batched reads,
// costs a fraction of that. So a native worker's transport owns one UDP socket and hands it to a
// quic.Transport, whose packets that are not QUIC (STUN, DTLS: RFC 7983's first-byte ranges)
// reach pion's ICE agent through a UDP mux (quicEndpoint.mux): every connection of the transport
// gathers its host candidate on that one socket. Once a link's data channel is open, and the
// pair ICE selected is that socket's host candidate and a peer's host or reflexive address (not
// a relay: TURN stays on data channels), the ICE-controlling side dials QUIC over the same
// 5-tuple. Frames then go on one unidirectional stream per direction, after a hello
// (quicHello), each prefixed with its length. The data channel stays open: it carries the frames
// sent before the link came up, tests' raw messages, and every frame when QUIC cannot connect (a
// firewall that passes only STUN and DTLS, a refused certificate). Nothing a frame may say
// changes: both paths feed the same decoder, Admit, reassembler and mailbox
// (rtcPeer.handleFrame), and nothing depends on the order of frames across them.
//
// Trust is DTLS's: each end makes a self-signed certificate and sends its SHA-256 beside its SDP
// (proto.Signal.QUIC), which the coordinator relays only between neighbours of the plan. A
// connection presenting another certificate is refused in the handshake, and one that reaches
// the listener from an address that is not a neighbour's selected ICE pair is never accepted.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/ice/v4"
	"github.com/pion/webrtc/v4"
	"github.com/quic-go/quic-go"

	"github.com/shoal-ml/shoal/proto"
)

// quicALPN names the one protocol a Shoal QUIC link speaks: length-prefixed proto frames.
const quicALPN = "shoal-frames/1"

// quicOff turns the QUIC path off (SHOAL_QUIC=0): every link stays on its data channel, as in a
// browser, to compare or where a network mangles it.
var quicOff = os.Getenv("SHOAL_QUIC") == "0"

// errWrongCertificate is the refusal of a QUIC peer whose certificate is not the one its
// signalling announced.
var errWrongCertificate = errors.New("QUIC certificate is not the one the neighbour signalled")

// quicEndpoint is a transport's UDP socket, shared by QUIC and by pion's ICE (and so DTLS).
type quicEndpoint struct {
	t    *RTCTransport
	udp  *net.UDPConn
	tr   *quic.Transport
	pc   *nonQUICConn
	mux  *ice.UDPMuxDefault
	ln   *quic.Listener
	cert tls.Certificate
	fp   string // hex SHA-256 of cert's DER
	port int
	conf *quic.Config
	wg   sync.WaitGroup // the accept loop
}

// newQUICEndpoint opens the socket where ICE gathers: 127.0.0.1 in loopback mode, else every
// IPv4 interface (the host candidates pion would have gathered).
func newQUICEndpoint(t *RTCTransport) (*quicEndpoint, error) {
	laddr := &net.UDPAddr{IP: net.IPv4zero}
	if t.cfg.Loopback {
		laddr.IP = net.IPv4(127, 0, 0, 1)
	}
	udp, err := net.ListenUDP("udp4", laddr)
	if err != nil {
		return nil, fmt.Errorf("open the QUIC/ICE socket: %w", err)
	}
	_ = udp.SetReadBuffer(udpSocketBuffer)
	_ = udp.SetWriteBuffer(udpSocketBuffer)
	e := &quicEndpoint{t: t, udp: udp, port: udp.LocalAddr().(*net.UDPAddr).Port}
	var conn net.PacketConn = udp
	if t.quicDrop {
		conn = dropQUICConn{udp}
	}
	e.tr = &quic.Transport{Conn: conn}
	if e.cert, e.fp, err = selfSignedCert(); err != nil {
		_ = udp.Close()
		return nil, err
	}
	pt := t.cfg.PeerTimeout
	e.conf = &quic.Config{
		HandshakeIdleTimeout: min(5*time.Second, pt/3),
		MaxIdleTimeout:       pt,
		KeepAlivePeriod:      min(2*time.Second, pt/6),
		// One unidirectional stream each way, nothing else: a peer cannot open more.
		MaxIncomingStreams:    -1,
		MaxIncomingUniStreams: 1,
		// The receive windows bound what a neighbour can make this side buffer below the
		// reassembler, as sctpReceiveBuffer does for a data channel.
		MaxStreamReceiveWindow:     sctpReceiveBuffer,
		MaxConnectionReceiveWindow: sctpReceiveBuffer + sctpReceiveBuffer/4,
	}
	ln, err := e.tr.Listen(e.serverTLS(), e.conf)
	if err != nil {
		_ = e.tr.Close()
		_ = udp.Close()
		return nil, fmt.Errorf("listen for QUIC: %w", err)
	}
	e.ln = ln
	ctx, cancel := context.WithCancel(context.Background())
	var w udpWriter = plainSender{udp}
	if !t.quicDrop {
		w = udpSender(udp)
	}
	e.pc = &nonQUICConn{tr: e.tr, w: w, local: udp.LocalAddr(), ctx: ctx, cancel: cancel}
	e.mux = ice.NewUDPMuxDefault(ice.UDPMuxParams{UDPConn: e.pc})
	e.wg.Go(e.acceptLoop)
	return e, nil
}

// close ends the listener, the mux and the socket; the transport's connections are closed.
func (e *quicEndpoint) close() {
	_ = e.ln.Close()
	_ = e.mux.Close()
	e.pc.cancel()
	_ = e.tr.Close()
	_ = e.udp.Close()
	e.wg.Wait()
}

func selfSignedCert() (tls.Certificate, string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("QUIC key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return tls.Certificate{}, "", err
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: serial, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(30 * 24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("QUIC certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, certFingerprint(der), nil
}

func certFingerprint(der []byte) string {
	h := sha256.Sum256(der)
	return hex.EncodeToString(h[:])
}

// pinned verifies that the peer presented exactly the certificate whose fingerprint is want.
func pinned(want string) func([][]byte, [][]*x509.Certificate) error {
	return func(raw [][]byte, _ [][]*x509.Certificate) error {
		if want == "" || len(raw) == 0 || certFingerprint(raw[0]) != want {
			return errWrongCertificate
		}
		return nil
	}
}

// serverTLS identifies the dialing peer by the address it dials from — the remote end of a
// neighbour's selected ICE pair — and then holds it to that neighbour's certificate.
func (e *quicEndpoint) serverTLS() *tls.Config {
	base := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{e.cert},
		ClientAuth: tls.RequireAnyClientCert, NextProtos: []string{quicALPN}}
	cfg := base.Clone()
	cfg.GetConfigForClient = func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
		p := e.t.peerAtAddr(chi.Conn.RemoteAddr())
		if p == nil {
			return nil, fmt.Errorf("QUIC from %v: no neighbour's ICE pair there", chi.Conn.RemoteAddr())
		}
		c := base.Clone()
		c.VerifyPeerCertificate = pinned(p.remoteQUICFingerprint())
		return c, nil
	}
	return cfg
}

func (e *quicEndpoint) clientTLS(want string) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{e.cert},
		// No name or CA to check: the certificate itself is pinned, as DTLS pins the SDP's.
		InsecureSkipVerify: true, VerifyPeerCertificate: pinned(want),
		ServerName: "shoal", NextProtos: []string{quicALPN}}
}

// acceptLoop hands each QUIC connection to the neighbour it came from.
func (e *quicEndpoint) acceptLoop() {
	for {
		conn, err := e.ln.Accept(context.Background())
		if err != nil {
			return // the listener closed
		}
		p := e.t.peerAtAddr(conn.RemoteAddr())
		var got string
		if cs := conn.ConnectionState().TLS; len(cs.PeerCertificates) > 0 {
			got = certFingerprint(cs.PeerCertificates[0].Raw)
		}
		if p == nil || got != p.remoteQUICFingerprint() {
			_ = conn.CloseWithError(quicCodeRefused, "not a neighbour")
			continue
		}
		p.mu.Lock()
		if p.err != nil {
			p.mu.Unlock()
			_ = conn.CloseWithError(quicCodeRefused, "neighbour gone")
			continue
		}
		p.quicWG.Add(1)
		p.mu.Unlock()
		go func() {
			defer p.quicWG.Done()
			p.startLink(conn, false)
		}()
	}
}

// The application error codes a link is closed with.
const (
	quicCodeClosed  quic.ApplicationErrorCode = 0 // by its owner: the neighbour is gone
	quicCodeRefused quic.ApplicationErrorCode = 1 // never carried frames
)

// peerAtAddr is the neighbour whose selected ICE pair ends at addr, if it may use QUIC.
func (t *RTCTransport) peerAtAddr(addr net.Addr) *rtcPeer {
	t.mu.Lock()
	peers := t.peerList()
	t.mu.Unlock()
	for _, p := range peers {
		if p.failure() != nil || p.remoteQUICFingerprint() == "" {
			continue
		}
		if a, ok := p.quicPath(); ok && a.String() == addr.String() {
			return p
		}
	}
	return nil
}

// watchSelectedPair keeps the pair ICE selects in p.selected, rather than asking pion, whose
// GetSelectedCandidatePair races with ICE's start.
func (p *rtcPeer) watchSelectedPair() {
	p.pc.SCTP().Transport().ICETransport().OnSelectedCandidatePairChange(func(pair *webrtc.ICECandidatePair) {
		p.selected.Store(pair)
	})
}

// quicPath is the remote address to run QUIC to, when the pair ICE selected for p starts at the
// endpoint's socket (its host candidate) and does not end at a relay.
func (p *rtcPeer) quicPath() (*net.UDPAddr, bool) {
	e := p.t.quic
	pair := p.selected.Load()
	if e == nil || pair == nil || pair.Local == nil || pair.Remote == nil {
		return nil, false
	}
	l, r := pair.Local, pair.Remote
	if l.Protocol != webrtc.ICEProtocolUDP || l.Typ != webrtc.ICECandidateTypeHost || int(l.Port) != e.port ||
		r.Protocol != webrtc.ICEProtocolUDP || r.Typ == webrtc.ICECandidateTypeRelay {
		return nil, false
	}
	ip := net.ParseIP(r.Address)
	if ip == nil {
		return nil, false
	}
	return &net.UDPAddr{IP: ip, Port: int(r.Port)}, true
}

func (p *rtcPeer) remoteQUICFingerprint() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.remoteQUIC
}

// openQUIC opens the transport's shared socket, unless QUIC is off (SHOAL_QUIC=0) or the
// transport runs on a simulated network, whose sockets quic-go cannot use. Beyond loopback it is
// opt-in (SHOAL_QUIC=1) until it has run on real networks: the shared socket gathers IPv4 host
// candidates only there, and server-reflexive pairs stay on data channels anyway.
func openQUIC(t *RTCTransport) (*quicEndpoint, error) {
	if quicOff || t.cfg.Net != nil || !t.cfg.Loopback && os.Getenv("SHOAL_QUIC") != "1" {
		return nil, nil
	}
	return newQUICEndpoint(t)
}

// dialQUIC runs once the data channel is open: the ICE-controlling side dials QUIC on the
// selected pair, and a link that cannot come up leaves the frames on the data channel.
func (p *rtcPeer) dialQUIC() {
	e := p.t.quic
	if ice := p.pc.SCTP().Transport().ICETransport(); ice.Role() != webrtc.ICERoleControlling {
		return // the other side dials; acceptLoop takes its connection
	}
	addr, ok := p.quicPath()
	if !ok {
		p.quicRefused.Store(true)
		p.t.cfg.Logger.Debug("ICE selected a pair QUIC does not run on: frames stay on the data channel", "peer", p.id)
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, 2*e.conf.HandshakeIdleTimeout)
	defer cancel()
	conn, err := e.tr.Dial(ctx, addr, e.clientTLS(p.remoteQUICFingerprint()), e.conf)
	if err != nil {
		if p.ctx.Err() == nil {
			p.t.cfg.Logger.Warn("no QUIC link to the neighbour: frames stay on the data channel", "peer", p.id, "err", err)
		}
		p.quicRefused.Store(true)
		return
	}
	p.startLink(conn, true)
}

// quicLink is a working QUIC connection to a neighbour: frames out on one stream, in on another.
type quicLink struct {
	p    *rtcPeer
	conn *quic.Conn
	in   *quic.ReceiveStream
	out  *quic.SendStream

	mu     sync.Mutex
	q      [][]byte // frames queued for the writer, each with its length prefix
	queued int      // their bytes
	wake   chan struct{}
	low    chan struct{} // one token: queued fell to the low mark
	closed atomic.Bool   // this side closed the link: its errors are not the peer's
	wg     sync.WaitGroup
}

// framePool holds length-prefixed frame buffers: a frame is copied into one by AppendChunk and
// out of it by quic-go, and the buffer then comes back.
var framePool = sync.Pool{New: func() any { b := make([]byte, 0, 4+proto.MaxFrameSize); return &b }}

// quicHello opens each direction's stream. Neither side moves frames onto a link before the
// other's hello has arrived: in TLS 1.3 the dialer finishes its handshake before the listener has
// checked the dialer's certificate, so only the listener's hello says it accepted the link.
var quicHello = [4]byte{'S', 'H', 'Q', 1}

// startLink opens p's stream on conn and, once the peer's hello has come, moves p's outgoing
// frames onto it and reads the peer's from it. A link that does not get that far is closed,
// and the frames stay on the data channel.
func (p *rtcPeer) startLink(conn *quic.Conn, dialer bool) {
	in, out, err := p.helloLink(conn)
	if err != nil {
		_ = conn.CloseWithError(quicCodeRefused, "no hello")
		if dialer {
			p.quicRefused.Store(true)
		}
		if p.ctx.Err() == nil {
			p.t.cfg.Logger.Warn("QUIC link not confirmed: frames stay on the data channel", "peer", p.id, "err", err)
		}
		return
	}
	l := &quicLink{p: p, conn: conn, in: in, out: out, wake: make(chan struct{}, 1), low: make(chan struct{}, 1)}
	p.mu.Lock()
	if p.err != nil || p.link.Load() != nil {
		p.mu.Unlock()
		_ = conn.CloseWithError(quicCodeRefused, "link exists or peer gone")
		return
	}
	p.link.Store(l)
	p.mu.Unlock()
	l.wg.Go(l.readLoop)
	l.wg.Go(l.writeLoop)
	p.t.cfg.Logger.Debug("neighbour link on QUIC", "peer", p.id, "remote", conn.RemoteAddr())
}

// helloLink sends this side's hello and waits for the peer's, within the handshake's timeout.
func (p *rtcPeer) helloLink(conn *quic.Conn) (*quic.ReceiveStream, *quic.SendStream, error) {
	wait := 2 * p.t.quic.conf.HandshakeIdleTimeout
	ctx, cancel := context.WithTimeout(p.ctx, wait)
	defer cancel()
	out, err := conn.OpenUniStream()
	if err != nil {
		return nil, nil, err
	}
	if _, err := out.Write(quicHello[:]); err != nil {
		return nil, nil, err
	}
	in, err := conn.AcceptUniStream(ctx)
	if err != nil {
		return nil, nil, err
	}
	_ = in.SetReadDeadline(time.Now().Add(wait))
	stop := context.AfterFunc(ctx, func() { _ = in.SetReadDeadline(time.Now()) })
	var h [len(quicHello)]byte
	_, err = io.ReadFull(in, h[:])
	if !stop() && err == nil {
		err = ctx.Err() // the deadline may have been set after the read
	}
	switch {
	case err != nil:
		return nil, nil, err
	case h != quicHello:
		return nil, nil, fmt.Errorf("%w: QUIC stream opens with %q", ErrProtocolViolation, h[:])
	}
	_ = in.SetReadDeadline(time.Time{})
	return in, out, nil
}

// close ends the link and waits for its goroutines.
func (l *quicLink) close() {
	l.closed.Store(true)
	_ = l.conn.CloseWithError(quicCodeClosed, "closed")
	l.wg.Wait()
}

// lost fails the peer for a link that broke under it: frames on it are gone.
func (l *quicLink) lost(err error) {
	if l.closed.Load() {
		return
	}
	l.p.fail(fmt.Errorf("%w: QUIC link: %w", ErrPeerGone, err))
}

func (l *quicLink) readLoop() {
	in := l.in
	buf := make([]byte, proto.MaxFrameSize)
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(in, hdr[:]); err != nil {
			l.lost(err)
			return
		}
		n := binary.LittleEndian.Uint32(hdr[:])
		if n == 0 || n > proto.MaxFrameSize {
			l.p.fail(fmt.Errorf("%w: a QUIC frame of %d bytes (at most %d)", ErrProtocolViolation, n, proto.MaxFrameSize))
			return
		}
		if _, err := io.ReadFull(in, buf[:n]); err != nil {
			l.lost(err)
			return
		}
		if !l.p.handleFrame(buf[:n]) {
			return
		}
	}
}

func (l *quicLink) writeLoop() {
	ctx := l.conn.Context()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.wake:
		}
		for {
			l.mu.Lock()
			if len(l.q) == 0 {
				l.mu.Unlock()
				break
			}
			b := l.q[0]
			l.q[0] = nil
			l.q = l.q[1:]
			l.mu.Unlock()
			_, err := l.out.Write(b)
			n := len(b)
			b = b[:0]
			framePool.Put(&b)
			l.mu.Lock()
			l.queued -= n
			low := l.queued <= l.p.t.cfg.LowBuffered
			l.mu.Unlock()
			if low {
				select {
				case l.low <- struct{}{}:
				default:
				}
			}
			if err != nil {
				l.lost(err)
				return
			}
		}
	}
}

func (l *quicLink) buffered() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.queued
}

// sendChunk queues frame i of tn for the link once at most high bytes wait (MaxBuffered, or a
// background frame's LowBuffered), as a data channel's buffered amount bounds it; sendSem is held.
func (l *quicLink) sendChunk(ctx context.Context, tn proto.Tensor, i, high int) error {
	p := l.p
	if l.buffered() > high {
		defer p.t.fg.held(tn.Key.Kind)()
	}
	for l.buffered() > high {
		select {
		case <-l.low:
		case <-p.done:
			return p.failure()
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	select {
	case <-p.done:
		return p.failure()
	default:
	}
	bp := framePool.Get().(*[]byte)
	b, err := proto.AppendChunk(append((*bp)[:0], 0, 0, 0, 0), tn, i, p.t.cfg.Limits)
	if err != nil {
		framePool.Put(bp)
		return err
	}
	binary.LittleEndian.PutUint32(b, uint32(len(b)-4))
	// The volunteer's upload cap (--max-upload) holds on every path its frames take.
	if err := p.t.cfg.Uplink.wait(ctx, len(b)); err != nil {
		framePool.Put(bp)
		return err
	}
	l.mu.Lock()
	l.q = append(l.q, b)
	l.queued += len(b)
	n := l.queued
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
	if uint64(n) > p.peakBuf.Load() {
		p.peakBuf.Store(uint64(n))
	}
	p.quicFrames.Add(1)
	p.handed(tn.Key.Kind)
	return nil
}

// nonQUICConn is the packet connection pion's UDP mux reads and writes (also as pion/ice's
// AddrPortReaderWriter): the packets the quic.Transport did not take, and datagrams written
// straight onto the shared socket, gathered into GSO runs as on ICE's own sockets
// (rtc_udp_linux.go). quic-go writes to the socket too: the kernel keeps each sendmsg whole.
type nonQUICConn struct {
	tr     *quic.Transport
	w      udpWriter
	local  net.Addr
	ctx    context.Context
	cancel context.CancelFunc
}

// udpWriter sends datagrams on a socket without reading it.
type udpWriter interface {
	WriteToAddrPort(b []byte, addr netip.AddrPort) (int, error)
	stop() // send what is queued; later writes fail
}

// plainSender is a udpWriter without segmentation offload.
type plainSender struct{ c *net.UDPConn }

func (s plainSender) WriteToAddrPort(b []byte, addr netip.AddrPort) (int, error) {
	return s.c.WriteToUDPAddrPort(b, addr)
}

func (plainSender) stop() {}

func (c *nonQUICConn) ReadFromAddrPort(b []byte) (int, netip.AddrPort, error) {
	n, a, err := c.tr.ReadNonQUICPacket(c.ctx, b)
	if err != nil {
		return 0, netip.AddrPort{}, net.ErrClosed
	}
	ua, ok := a.(*net.UDPAddr)
	if !ok {
		return 0, netip.AddrPort{}, fmt.Errorf("packet from a %T", a)
	}
	ap := ua.AddrPort()
	return n, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

func (c *nonQUICConn) WriteToAddrPort(b []byte, addr netip.AddrPort) (int, error) {
	return c.w.WriteToAddrPort(b, netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port()))
}

func (c *nonQUICConn) ReadFrom(b []byte) (int, net.Addr, error) {
	n, a, err := c.ReadFromAddrPort(b)
	if err != nil {
		return 0, nil, err
	}
	return n, net.UDPAddrFromAddrPort(a), nil
}

func (c *nonQUICConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	ua, ok := addr.(*net.UDPAddr)
	if !ok {
		return 0, fmt.Errorf("write to a %T", addr)
	}
	return c.WriteToAddrPort(b, ua.AddrPort())
}

func (c *nonQUICConn) Close() error                     { c.cancel(); c.w.stop(); return nil }
func (c *nonQUICConn) LocalAddr() net.Addr              { return c.local }
func (c *nonQUICConn) SetDeadline(time.Time) error      { return nil }
func (c *nonQUICConn) SetReadDeadline(time.Time) error  { return nil }
func (c *nonQUICConn) SetWriteDeadline(time.Time) error { return nil }

// dropQUICConn is the socket with every QUIC packet it would send dropped (a test's firewall
// that passes STUN and DTLS only). It hides the socket's OOB methods, so that quic-go writes
// every packet through WriteTo.
type dropQUICConn struct{ c *net.UDPConn }

func (d dropQUICConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	if len(b) > 0 && b[0]&0xc0 != 0 {
		return len(b), nil
	}
	return d.c.WriteTo(b, addr)
}

func (d dropQUICConn) ReadFrom(b []byte) (int, net.Addr, error) { return d.c.ReadFrom(b) }
func (d dropQUICConn) Close() error                             { return d.c.Close() }
func (d dropQUICConn) LocalAddr() net.Addr                      { return d.c.LocalAddr() }
func (d dropQUICConn) SetDeadline(t time.Time) error            { return d.c.SetDeadline(t) }
func (d dropQUICConn) SetReadDeadline(t time.Time) error        { return d.c.SetReadDeadline(t) }
func (d dropQUICConn) SetWriteDeadline(t time.Time) error       { return d.c.SetWriteDeadline(t) }
func (d dropQUICConn) SetReadBuffer(n int) error                { return d.c.SetReadBuffer(n) }
func (d dropQUICConn) SetWriteBuffer(n int) error               { return d.c.SetWriteBuffer(n) }
