//go:build js

package client

// The browser half of RTCTransport: pion/webrtc's js build, which wraps the page's
// RTCPeerConnection. The browser owns the network: it gathers candidates, runs ICE, DTLS and SCTP,
// and sizes its own socket buffers, so the SettingEngine knobs rtc_native.go sets do not exist
// here (pion's js SettingEngine only has DetachDataChannels). What each RTCConfig field becomes:
//
//   - Loopback: the browser gathers the candidates it gathers. Chromium offers loopback
//     candidates only when started with --allow-loopback-in-peer-connection, and keeps off other
//     interfaces only when the page runs where lo is the only interface (docs/design.md, "Browser tests": the flags,
//     and a network namespace with only lo). What this side still does in loopback mode is the
//     same as natively, in rtc_peer.go: remote candidates and SDP candidate lines that are not on
//     a loopback address (mDNS .local names included) are dropped, so this peer never sends a
//     connectivity check anywhere else, and only ICE servers on loopback addresses are configured.
//   - PeerTimeout: not applied. A browser has no ICE timeout setting; it fails a connection that
//     stays silent past its consent-freshness limit (RFC 7675: about 30 s), and a peer that closes
//     its connection is noticed at once, as natively.
//   - Net: ignored (usesSimulatedNet is false): a tab's packets go where the browser sends them,
//     and loopback mode keeps its candidate filters.
//   - ICEServers and RelayOnly (the RTCConfiguration's iceServers and iceTransportPolicy),
//     Limits, MaxBuffered, LowBuffered, Mailbox, MailboxBytes, OnPeerFailed, Contained and
//     Logger: as natively. Flow control uses the RTCDataChannel's bufferedAmount and
//     bufferedamountlow event.

import (
	"net"
	"strings"

	"github.com/pion/webrtc/v4"
)

// usesSimulatedNet: the browser owns the network, so RTCConfig.Net cannot replace it.
const usesSimulatedNet = false

// newRTCAPI returns the pion API for one peer connection: a plain one, because every setting
// that matters natively (interface and IP filters, mDNS, ICE timeouts, socket buffers) belongs to
// the browser here. It never fails; the error is there to match rtc_native.go.
func newRTCAPI(RTCConfig, *quicEndpoint) (*webrtc.API, error) {
	return webrtc.NewAPI(), nil
}

// prepareChannel asks the browser to deliver binary messages as ArrayBuffers. The default is
// the browser's (Firefox's is "blob"), and for a Blob pion's js build reads the bytes through a
// FileReader: asynchronously, so message goroutines park and complete in whatever order the reads
// do, and with a js.Func per message that it never releases — a leak of one function per 64 KiB
// received. An ArrayBuffer is copied into Go at once.
func prepareChannel(dc *webrtc.DataChannel) {
	dc.JSValue().Set("binaryType", "arraybuffer")
}

// loopbackCandidate reports whether an SDP candidate attribute value is on a loopback address.
// Natively pion/ice parses it. In the browser pion's ICE agent is not used (though pion/webrtc's
// js build still links the package), so this side reads the one field it needs itself and keeps
// pion/ice out of the client's own code; it agrees with the native parser on the cases of
// TestRTCLoopbackFilter and on Chromium's tcp and srflx candidates. An SDP candidate is
//
//	candidate:<foundation> <component> <transport> <priority> <address> <port> typ <type> ...
//
// (RFC 8839, section 5.1); anything shorter is not a candidate, and an address that is not an IP
// (an mDNS name) is not loopback.
func loopbackCandidate(c string) bool {
	f := strings.Fields(strings.TrimPrefix(c, "candidate:"))
	if len(f) < 8 || f[6] != "typ" {
		return false
	}
	ip := net.ParseIP(f[4])
	return ip != nil && ip.IsLoopback()
}

// closeConnection closes the data channel dc and the connection pc. Closing the channel first
// matters in the browser: pion's js PeerConnection.Close releases only the connection's own
// callbacks, and the channel's (one js.Func each for open, message and bufferedamountlow) would
// otherwise stay allocated for the life of the page. The browser finishes closing on its own
// event loop; there is nothing of pion's left running to wait for.
func closeConnection(pc *webrtc.PeerConnection, dc *webrtc.DataChannel) error {
	_ = dc.Close() // pc.Close closes it in any case; this is for the callbacks
	return pc.Close()
}
