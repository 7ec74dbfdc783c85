//go:build !linux && !js

package client

import (
	"net"
	"sync/atomic"

	"github.com/pion/transport/v5"
)

// Segmentation offload (rtc_udp_linux.go) is Linux's; elsewhere ICE's sockets are used as they
// are, one syscall per datagram.

var udpOffload = false

var gsoStats struct{ datagrams, sends, reads atomic.Int64 }

func wrapUDP(c transport.UDPConn) transport.UDPConn { return c }

// udpSender writes ICE's datagrams on a socket quic-go reads (rtc_quic.go) one at a time.
func udpSender(c *net.UDPConn) udpWriter { return plainSender{c} }
