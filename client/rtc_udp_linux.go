//go:build linux && !js

package client

// UDP segmentation offload on the sockets ICE opens (Linux only; rtc_udp_other.go elsewhere),
// and on the sends of ICE's datagrams on the socket it shares with QUIC (udpSender, rtc_quic.go).
//
// pion's SCTP cuts every message into packets of at most 1191 bytes (a constant of pion/webrtc,
// not a setting), and each becomes one DTLS record in one UDP datagram: a 64 KiB frame is 56
// datagrams one way and about 16 SACKs the other, and each datagram was one sendto and one
// recvmsg. On loopback those syscalls were a quarter of the data plane's CPU (a sendto on lo
// also runs the receiving half of the kernel's stack). gsoConn hands the kernel runs of
// same-sized datagrams for one destination as one sendmsg with UDP_SEGMENT (GSO), and sets
// UDP_GRO on the socket, so that such a run crosses loopback as one buffer, is read with one
// recvmsg, and is split back into its datagrams before ICE sees them.
//
// What goes on the wire is unchanged: the same datagrams, in the order they were written, each
// one DTLS record. The kernel (or the NIC) cuts a GSO run into ordinary datagrams wherever it
// leaves the host, and a peer without GRO (a browser, another OS) receives those as before.
// Nothing is trusted more either: every datagram still goes through DTLS, which authenticates
// it, before SCTP or this package looks at a byte of it.

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/pion/transport/v5"
)

const (
	solUDP     = syscall.IPPROTO_UDP
	udpSegment = 103 // UDP_SEGMENT, <linux/udp.h>: the segment size of a GSO send (uint16)
	udpGRO     = 104 // UDP_GRO: deliver coalesced runs, with their segment size (int)

	// gsoMaxSegments is the kernel's UDP_MAX_SEGMENTS; gsoMaxBytes keeps a run's payload inside
	// one IP datagram's 64 KiB, headers included.
	gsoMaxSegments = 64
	gsoMaxBytes    = 60 << 10
	// gsoMinSegment: a datagram shorter than this that would start a run (an SCTP SACK, a STUN
	// check, the tail of a small message) goes out at once instead of waiting for company:
	// such datagrams usually come alone, and holding a SACK back slows the peer's sending.
	gsoMinSegment = 512
	// gsoLinger is how long a run that nothing has closed waits for more datagrams. pion writes
	// a burst of SCTP packets a few µs apart and gives no sign of its end, so a run is sent when
	// a datagram cannot join it (another destination, a longer datagram), when a shorter one
	// closes it (the last packet of a message), when it is full, or after gsoLinger. A timer,
	// not a goroutine woken at once: measured, a woken flusher ran within a µs of every write
	// and sent 1.0–1.3 datagrams per sendmsg, even at GOMAXPROCS=1. With a 50 µs linger a
	// sendmsg carries about 3 datagrams counting the SACKs (which go alone), 12–15 data
	// packets not counting them, and the tail of a burst waits 50–600 µs (Go fires short timers
	// late on an idle process); 20 µs and 100 µs were within the noise of it in CPU per frame.
	gsoLinger = 50 * time.Microsecond
	// groBufferSize holds the largest run the kernel may coalesce.
	groBufferSize = 64 << 10
)

// udpOffload turns gsoConn on for the sockets ICE opens; SHOAL_RTC_OFFLOAD=0 turns it off (to
// compare, or where a kernel misbehaves with it).
var udpOffload = os.Getenv("SHOAL_RTC_OFFLOAD") != "0"

// gsoStats counts the datagrams written through gsoConns, the sendmsg calls that carried them
// and the recvmsg calls that read them, for the benchmarks.
var gsoStats struct{ datagrams, sends, reads atomic.Int64 }

// wrapUDP gives a socket ICE opens GSO and GRO.
func wrapUDP(c transport.UDPConn) transport.UDPConn {
	if u, ok := c.(*net.UDPConn); ok && udpOffload {
		return newGSOConn(u)
	}
	return c
}

// gsoConn is a UDP socket whose writes are gathered into GSO runs and whose reads split GRO
// buffers into datagrams. It implements pion/ice's AddrPortReaderWriter (the path ICE takes for
// every packet) and transport.UDPConn; every read and every write method goes through the same
// run and the same buffer, so none sees a coalesced buffer or overtakes a queued datagram.
type gsoConn struct {
	c *net.UDPConn

	// The send side: a run of n datagrams for dst in buf, each seg bytes but the last.
	mu     sync.Mutex
	dst    netip.AddrPort
	seg    int
	n      int
	buf    []byte
	oob    []byte
	gsoOff bool // the kernel refused GSO on this socket: one sendmsg per datagram
	closed bool
	timer  *time.Timer // sends a run gsoLinger after it started

	// The receive side: a GRO buffer being handed out one datagram at a time.
	rmu   sync.Mutex
	gro   bool // the kernel accepted UDP_GRO
	rfull []byte
	rbuf  []byte // what is left of the last buffer read
	rseg  int
	rfrom netip.AddrPort
	roob  []byte
}

var (
	_ transport.UDPConn = (*gsoConn)(nil)
	// pion/ice's AddrPortReaderWriter:
	_ interface {
		ReadFromAddrPort(b []byte) (int, netip.AddrPort, error)
		WriteToAddrPort(b []byte, addr netip.AddrPort) (int, error)
	} = (*gsoConn)(nil)
)

func newGSOConn(c *net.UDPConn) *gsoConn {
	g := newGSOSender(c)
	g.roob = make([]byte, syscall.CmsgSpace(4))
	if raw, err := c.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) {
			g.gro = syscall.SetsockoptInt(int(fd), solUDP, udpGRO, 1) == nil
		})
	}
	if g.gro {
		g.rfull = make([]byte, groBufferSize)
	}
	return g
}

// newGSOSender is a gsoConn for writing only: the socket's reads belong to another reader
// (quic-go's, which does not split GRO buffers), so UDP_GRO is left off.
func newGSOSender(c *net.UDPConn) *gsoConn {
	g := &gsoConn{
		c:   c,
		buf: make([]byte, 0, gsoMaxBytes),
		oob: make([]byte, syscall.CmsgSpace(2)),
	}
	putCmsgHeader(g.oob, solUDP, udpSegment, 2)
	g.timer = time.AfterFunc(time.Hour, g.flushLate)
	g.timer.Stop()
	return g
}

// udpSender is how ICE's datagrams go out on a socket quic-go reads (rtc_quic.go): gathered into
// GSO runs as on ICE's own sockets, or one at a time with SHOAL_RTC_OFFLOAD=0.
func udpSender(c *net.UDPConn) udpWriter {
	if udpOffload {
		return newGSOSender(c)
	}
	return plainSender{c}
}

// flushLate sends the run that nothing closed within gsoLinger.
func (g *gsoConn) flushLate() {
	g.mu.Lock()
	defer g.mu.Unlock()
	_ = g.flushLocked() // a datagram lost here is one lost on the network: SCTP resends it
}

// WriteToAddrPort queues b for addr (see gsoLinger for when it is sent). An error may be that of
// an earlier datagram: UDP promises nothing about delivery, and neither does this.
func (g *gsoConn) WriteToAddrPort(b []byte, addr netip.AddrPort) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return 0, net.ErrClosed
	}
	if len(b) == 0 || len(b) > gsoMaxBytes/2 {
		if err := g.flushLocked(); err != nil {
			return 0, err
		}
		return g.c.WriteToUDPAddrPort(b, addr)
	}
	if g.n > 0 && (addr != g.dst || len(b) > g.seg || len(g.buf)+len(b) > gsoMaxBytes) {
		if err := g.flushLocked(); err != nil {
			return 0, err
		}
	}
	if g.n == 0 {
		g.dst, g.seg = addr, len(b)
	}
	g.buf = append(g.buf, b...)
	g.n++
	if len(b) < g.seg || g.n == gsoMaxSegments || g.n == 1 && len(b) < gsoMinSegment {
		if err := g.flushLocked(); err != nil {
			return 0, err
		}
	} else if g.n == 1 {
		g.timer.Reset(gsoLinger)
	}
	return len(b), nil
}

// flushLocked sends the queued run; g.mu is held.
func (g *gsoConn) flushLocked() error {
	if g.n == 0 {
		return nil
	}
	defer func() { g.buf, g.n = g.buf[:0], 0 }()
	gsoStats.datagrams.Add(int64(g.n))
	if g.n == 1 {
		gsoStats.sends.Add(1)
		_, err := g.c.WriteToUDPAddrPort(g.buf, g.dst)
		return err
	}
	if !g.gsoOff {
		binary.NativeEndian.PutUint16(g.oob[syscall.CmsgLen(0):], uint16(g.seg))
		gsoStats.sends.Add(1)
		_, _, err := g.c.WriteMsgUDPAddrPort(g.buf, g.oob, g.dst)
		if err == nil || !gsoRefused(err) {
			return err
		}
		g.gsoOff = true // and send this run one datagram at a time
	}
	for b := g.buf; len(b) > 0; {
		d := b[:min(g.seg, len(b))]
		b = b[len(d):]
		gsoStats.sends.Add(1)
		if _, err := g.c.WriteToUDPAddrPort(d, g.dst); err != nil {
			return err
		}
	}
	return nil
}

// gsoRefused reports whether a sendmsg with UDP_SEGMENT failed because this socket or route
// cannot segment (a kernel before 4.18, a device without checksum offload, a path MTU below the
// segment), rather than for a reason any send could fail for.
func gsoRefused(err error) bool {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	return errno == syscall.EIO || errno == syscall.EINVAL || errno == syscall.ENOPROTOOPT ||
		errno == syscall.EOPNOTSUPP
}

// putCmsgHeader writes the header of a control message with n bytes of data at the start of b.
func putCmsgHeader(b []byte, level, typ int32, n int) {
	h := (*syscall.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = level, typ
	h.SetLen(syscall.CmsgLen(n))
}

// ReadFromAddrPort returns the next datagram: the next of the GRO buffer being split, or one read
// from the socket.
func (g *gsoConn) ReadFromAddrPort(b []byte) (int, netip.AddrPort, error) {
	if !g.gro {
		return g.c.ReadFromUDPAddrPort(b)
	}
	g.rmu.Lock()
	defer g.rmu.Unlock()
	if len(g.rbuf) == 0 {
		n, oobn, _, from, err := g.c.ReadMsgUDPAddrPort(g.rfull, g.roob)
		if err != nil {
			return 0, from, err
		}
		gsoStats.reads.Add(1)
		g.rbuf, g.rfrom, g.rseg = g.rfull[:n], from, groSegment(g.roob[:oobn])
		if g.rseg <= 0 || g.rseg > n {
			g.rseg = n // one datagram
		}
		if n == 0 {
			return 0, from, nil
		}
	}
	d := g.rbuf[:min(g.rseg, len(g.rbuf))]
	g.rbuf = g.rbuf[len(d):]
	return copy(b, d), g.rfrom, nil
}

// groSegment is the segment size a UDP_GRO control message gives, or 0 if there is none.
func groSegment(oob []byte) int {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return 0
	}
	for _, m := range msgs {
		if m.Header.Level == solUDP && m.Header.Type == udpGRO {
			switch {
			case len(m.Data) >= 4:
				return int(binary.NativeEndian.Uint32(m.Data))
			case len(m.Data) >= 2:
				return int(binary.NativeEndian.Uint16(m.Data))
			}
		}
	}
	return 0
}

func (g *gsoConn) ReadFrom(b []byte) (int, net.Addr, error) {
	n, a, err := g.ReadFromAddrPort(b)
	if err != nil {
		return n, nil, err
	}
	return n, net.UDPAddrFromAddrPort(a), nil
}

func (g *gsoConn) ReadFromUDP(b []byte) (int, *net.UDPAddr, error) {
	n, a, err := g.ReadFromAddrPort(b)
	if err != nil {
		return n, nil, err
	}
	return n, net.UDPAddrFromAddrPort(a), nil
}

func (g *gsoConn) Read(b []byte) (int, error) {
	n, _, err := g.ReadFromAddrPort(b)
	return n, err
}

// ReadMsgUDP reads datagrams as ReadFromUDP does, and no control messages.
func (g *gsoConn) ReadMsgUDP(b, _ []byte) (n, oobn, flags int, addr *net.UDPAddr, err error) {
	n, addr, err = g.ReadFromUDP(b)
	return n, 0, 0, addr, err
}

func (g *gsoConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	ua, ok := addr.(*net.UDPAddr)
	if !ok {
		return 0, &net.OpError{Op: "write", Net: "udp", Addr: addr, Err: syscall.EAFNOSUPPORT}
	}
	return g.WriteToUDP(b, ua)
}

func (g *gsoConn) WriteToUDP(b []byte, addr *net.UDPAddr) (int, error) {
	return g.WriteToAddrPort(b, addr.AddrPort())
}

// Write and WriteMsgUDP send the queued run first, then b as it is.
func (g *gsoConn) Write(b []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.flushLocked(); err != nil {
		return 0, err
	}
	return g.c.Write(b)
}

func (g *gsoConn) WriteMsgUDP(b, oob []byte, addr *net.UDPAddr) (n, oobn int, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.flushLocked(); err != nil {
		return 0, 0, err
	}
	return g.c.WriteMsgUDP(b, oob, addr)
}

// Close sends the queued run and closes the socket.
func (g *gsoConn) Close() error {
	g.stop()
	return g.c.Close()
}

// stop sends the queued run and refuses later writes, leaving the socket open.
func (g *gsoConn) stop() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.timer.Stop()
	if !g.closed {
		_ = g.flushLocked()
		g.closed = true
	}
}

func (g *gsoConn) LocalAddr() net.Addr                { return g.c.LocalAddr() }
func (g *gsoConn) RemoteAddr() net.Addr               { return g.c.RemoteAddr() }
func (g *gsoConn) SetDeadline(t time.Time) error      { return g.c.SetDeadline(t) }
func (g *gsoConn) SetReadDeadline(t time.Time) error  { return g.c.SetReadDeadline(t) }
func (g *gsoConn) SetWriteDeadline(t time.Time) error { return g.c.SetWriteDeadline(t) }
func (g *gsoConn) SetReadBuffer(n int) error          { return g.c.SetReadBuffer(n) }
func (g *gsoConn) SetWriteBuffer(n int) error         { return g.c.SetWriteBuffer(n) }
