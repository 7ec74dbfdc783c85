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

// newRTCAPI builds the pion API for one peer connection. A fresh one per connection, because
// the network it carries lists the host's interfaces when it is made, and a worker outlives
// its network (a laptop changing Wi-Fi).
func newRTCAPI(cfg RTCConfig) (*webrtc.API, error) {
	var se webrtc.SettingEngine
	n, err := stdnet.NewNet()
	if err != nil {
		return nil, fmt.Errorf("list network interfaces: %w", err)
	}
	se.SetNet(bigBufferNet{n})
	// pion fails a connection after disconnected+failed timeouts of silence, sending a keepalive
	// whenever the link is idle. A third of the budget to "disconnected" leaves room for a peer that
	// recovers (a GC pause, a congested uplink) before it is given up.
	keepalive := min(2*time.Second, cfg.PeerTimeout/6)
	se.SetICETimeouts(cfg.PeerTimeout/3, cfg.PeerTimeout-cfg.PeerTimeout/3, keepalive)
	if cfg.Loopback {
		// BROWSER.md: host candidates on lo only, no mDNS (it multicasts on every interface), UDP4.
		// The filters, not the absence of ICE servers, are what keep gathering off other interfaces.
		se.SetIncludeLoopbackCandidate(true)
		se.SetICEMulticastDNSMode(ice.MulticastDNSModeDisabled)
		se.SetInterfaceFilter(isLoopbackInterface)
		se.SetIPFilter(func(ip net.IP) bool { return ip.IsLoopback() })
		se.SetNetworkTypes([]webrtc.NetworkType{webrtc.NetworkTypeUDP4})
	}
	return webrtc.NewAPI(webrtc.WithSettingEngine(se)), nil
}

// udpSocketBuffer is the kernel buffer asked for on each ICE socket, both ways. With the
// default (about 200 KiB on Linux) a burst of SCTP packets overflows the receiving socket as
// soon as both directions of a link are busy, as in 1F1B, and every lost tail costs SCTP's
// one-second minimum retransmission timeout: measured on loopback, 3 MiB each way took 1.2 s
// instead of 40 ms. The kernel caps the request at net.core.rmem_max / wmem_max.
const udpSocketBuffer = 4 << 20

// bigBufferNet is the standard network with larger socket buffers on the UDP sockets ICE opens.
type bigBufferNet struct{ *stdnet.Net }

func (n bigBufferNet) ListenUDP(network string, laddr *net.UDPAddr) (transport.UDPConn, error) {
	c, err := n.Net.ListenUDP(network, laddr)
	if err != nil {
		return nil, err
	}
	// Best effort: a smaller buffer than asked is slower, not wrong.
	_ = c.SetReadBuffer(udpSocketBuffer)
	_ = c.SetWriteBuffer(udpSocketBuffer)
	return c, nil
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
