//go:build !js

package client

// The native half of RTCTransport: pion/webrtc's own ICE agent, configured through its
// SettingEngine (loopback filters, ICE timeouts, larger UDP socket buffers). None of it exists
// in pion's js build, where the browser owns the network: see rtc_js.go.

import (
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/pion/ice/v4"
	"github.com/pion/transport/v5"
	"github.com/pion/transport/v5/stdnet"
	"github.com/pion/webrtc/v4"
)

// newRTCAPI builds the pion API for one peer connection, gathering on q's socket when there is
// one. A fresh one per connection, because the network it carries lists the host's interfaces
// when it is made, and a worker outlives its network (a laptop changing Wi-Fi).
func newRTCAPI(cfg RTCConfig, q *quicEndpoint) (*webrtc.API, error) {
	var se webrtc.SettingEngine
	if q != nil {
		// Host candidates on the socket QUIC shares (rtc_quic.go) instead of one socket each.
		se.SetICEUDPMux(q.mux)
	}
	if cfg.Net != nil {
		// A simulated network: its sockets are channels in this process, so the kernel buffers
		// below do not exist.
		se.SetNet(cfg.Net)
	} else {
		n, err := stdnet.NewNet()
		if err != nil {
			return nil, fmt.Errorf("list network interfaces: %w", err)
		}
		se.SetNet(bigBufferNet{n})
	}
	// pion fails a connection after disconnected+failed timeouts of silence, sending a keepalive
	// whenever the link is idle. A third of the budget to "disconnected" leaves room for a peer that
	// recovers (a GC pause, a congested uplink) before it is given up.
	keepalive := min(2*time.Second, cfg.PeerTimeout/6)
	se.SetICETimeouts(cfg.PeerTimeout/3, cfg.PeerTimeout-cfg.PeerTimeout/3, keepalive)
	se.SetSCTPMaxReceiveBufferSize(sctpReceiveBuffer)
	// RFC 9653: SCTP over DTLS may leave its CRC32c checksum at zero, DTLS's AEAD tag already
	// authenticating every byte. Offered in the INIT and used only toward a peer that offered it
	// too (a browser or an older pion that does not gets checksums as before); a non-zero
	// checksum is still verified. It saves the CRC32c of every packet both ways: 1.3-1.6% of the
	// data plane's CPU on loopback in the profiles (issue: CPU per byte of the data plane).
	se.EnableSCTPZeroChecksum(true)
	if cfg.Loopback {
		// docs/design.md, "Browser tests": host candidates on lo only, no mDNS (it multicasts on every interface), UDP4.
		// The filters, not the absence of ICE servers, are what keep gathering off other interfaces.
		se.SetICEMulticastDNSMode(ice.MulticastDNSModeDisabled)
		se.SetNetworkTypes([]webrtc.NetworkType{webrtc.NetworkTypeUDP4})
		if cfg.Net != nil {
			// On a simulated network the virtual eth0 and its 10.x address are as private as lo
			// (they exist only in this process), and they are what its router carries, shaped;
			// its lo stays out: a 127.0.0.1 candidate would pair with the neighbour's 127.0.0.1,
			// which on a vnet is this host's own loopback, never the neighbour.
			vn := cfg.Net
			se.SetInterfaceFilter(func(name string) bool {
				ifi, err := vn.InterfaceByName(name)
				return err == nil && ifi.Flags&net.FlagLoopback == 0
			})
			se.SetIPFilter(func(ip net.IP) bool { return !ip.IsLoopback() })
		} else {
			se.SetIncludeLoopbackCandidate(true)
			se.SetInterfaceFilter(isLoopbackInterface)
			se.SetIPFilter(func(ip net.IP) bool { return ip.IsLoopback() })
		}
	}
	return webrtc.NewAPI(webrtc.WithSettingEngine(se)), nil
}

// usesSimulatedNet: natively, pion's ICE agent runs on RTCConfig.Net when one is set.
const usesSimulatedNet = true

// sctpReceiveBuffer is the SCTP receive window each native connection advertises. pion's
// default, 1 MiB, caps one data channel at window/RTT: about 168 Mb/s at 50 ms, below a 200 Mb/s
// link's bandwidth-delay product (1.25 MB). 4 MiB covers 200 Mb/s up to about 160 ms of RTT, or
// 670 Mb/s at 50 ms. It is a bound, not an allocation: pion holds in it only the chunks that wait
// for a gap to be retransmitted or for the reader, which drains it as fast as frames arrive (the
// reassembler's own limits, RTCConfig.Limits, apply after). So it can cost up to 4 MiB per
// neighbour when a link loses packets; a stage has two neighbours, an expert host a few more.
const sctpReceiveBuffer = 4 << 20

// udpSocketBuffer is the kernel buffer asked for on each ICE socket, both ways. With the
// default (about 200 KiB on Linux) a burst of SCTP packets overflows the receiving socket as
// soon as both directions of a link are busy, as in 1F1B, and every lost tail costs SCTP's
// one-second minimum retransmission timeout: measured on loopback, 3 MiB each way took 1.2 s
// instead of 40 ms. The kernel caps the request at net.core.rmem_max / wmem_max.
const udpSocketBuffer = 4 << 20

// bigBufferNet is the standard network with larger socket buffers on the UDP sockets ICE opens,
// and on Linux segmentation offload (rtc_udp_linux.go).
type bigBufferNet struct{ *stdnet.Net }

func (n bigBufferNet) ListenUDP(network string, laddr *net.UDPAddr) (transport.UDPConn, error) {
	c, err := n.Net.ListenUDP(network, laddr)
	if err != nil {
		return nil, err
	}
	// Best effort: a smaller buffer than asked is slower, not wrong.
	_ = c.SetReadBuffer(udpSocketBuffer)
	_ = c.SetWriteBuffer(udpSocketBuffer)
	return wrapUDP(c), nil
}

func (n bigBufferNet) ListenPacket(network, address string) (net.PacketConn, error) {
	c, err := n.Net.ListenPacket(network, address)
	if err != nil {
		return nil, err
	}
	if u, ok := c.(*net.UDPConn); ok {
		_ = u.SetReadBuffer(udpSocketBuffer)
		_ = u.SetWriteBuffer(udpSocketBuffer)
	}
	return c, nil
}

// isLoopbackInterface asks the interface's flags rather than matching "lo", which is lo0 on BSDs.
func isLoopbackInterface(name string) bool {
	ifi, err := net.InterfaceByName(name)
	return err == nil && ifi.Flags&net.FlagLoopback != 0
}

// prepareChannel has nothing to do natively: pion hands every message over as bytes from the
// channel's read loop.
func prepareChannel(*webrtc.DataChannel) {}

// loopbackCandidate reports whether an SDP candidate attribute value is on a loopback address.
func loopbackCandidate(c string) bool {
	cand, err := ice.UnmarshalCandidate(strings.TrimPrefix(c, "candidate:"))
	if err != nil {
		return false
	}
	ip := net.ParseIP(cand.Address())
	return ip != nil && ip.IsLoopback()
}

// closeConnection closes pc, and with it its data channel dc, and waits for pion's goroutines on
// it (its read loops, the data channel's callbacks) to end.
func closeConnection(pc *webrtc.PeerConnection, _ *webrtc.DataChannel) error {
	return pc.GracefulClose()
}
