package client

// The WebRTC data plane's platform-independent half: the configuration, the signaling interface
// and the errors that RTCTransport returns on every platform. RTCTransport itself is rtc_peer.go,
// on pion/webrtc, whose js build wraps the browser's RTCPeerConnection with the same API; what
// differs between a native worker and a browser tab is in rtc_native.go and rtc_js.go. Nothing
// here imports pion's implementation: only pion/transport's interfaces, for RTCConfig.Net, which
// compile to nothing in the js build.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/pion/transport/v5"

	"github.com/shoal-ml/shoal/proto"
)

// Signaler sends WebRTC signaling (SDP offers and answers, trickled ICE candidates) to another
// worker through the coordinator. The worker's control connection implements it; signals coming
// back the other way are handed to RTCTransport.HandleSignal.
//
// The transport calls SendSignal from one goroutine per neighbour, in the order the signals must
// arrive (a description before its candidates), so an implementation that keeps the order of its
// calls on the wire (one WebSocket) keeps the order the receiver relies on. ctx bounds the write
// and ends when the neighbour's connection is closed.
type Signaler interface {
	SendSignal(ctx context.Context, to string, s proto.Signal) error
}

// RTCConfig configures an RTCTransport. The zero value is usable apart from the ICE servers a
// real deployment needs: see the field docs for the defaults.
type RTCConfig struct {
	// Loopback restricts ICE to the loopback interface: host candidates on 127.0.0.1 only, STUN
	// and TURN servers only on loopback addresses (and relayed candidates then on loopback), no mDNS, and remote candidates that are not loopback addresses dropped. Tests and the
	// local demo run so, and must not put a packet on any other network (docs/design.md, "Wire").
	Loopback bool
	// ICEServers are the STUN and TURN servers the coordinator hands out (shoal serve --ice-server,
	// --turn). In loopback mode only those whose every URL names a loopback address are used (the
	// coordinator's own TURN server in tests), so that no packet leaves the host.
	ICEServers []proto.ICEServer
	// RelayOnly gathers and uses relayed candidates only (iceTransportPolicy "relay"): every link
	// goes through a TURN server in ICEServers, and no neighbour learns this worker's address.
	RelayOnly bool
	// Net, when set, is a simulated network (pion vnet; internal/wan shapes one into a WAN) that
	// the connections use instead of the host's: nothing it carries leaves the process. In
	// loopback mode its virtual interfaces and addresses count as loopback — they exist only in
	// memory. Tests and the WAN bench only; the js build ignores it (the browser owns the network).
	Net transport.Net
	// Limits bound what a neighbour may make this worker hold: one tensor, and the bytes of
	// tensors still missing chunks per neighbour and, through Limits.Budget, over all of them.
	// Zero fields take proto.DefaultLimits.
	Limits proto.Limits
	// Mailbox, when set, receives the tensors that arrive whole, instead of one the transport makes
	// itself: a worker shares it with the relay path, so that a neighbour reached through the
	// coordinator and one reached over WebRTC are received the same way.
	Mailbox *Mailbox
	// MailboxBytes bounds the payload of tensors that arrived whole and wait for Recv, over all
	// neighbours; a tensor that would pass it is a protocol violation by its sender (a correct
	// peer never runs that far ahead of the schedule). 0 means Limits.MaxInFlightBytes.
	MailboxBytes int
	// MaxBuffered is the send high-water mark: Send waits while more than this many bytes are
	// queued on a neighbour's data channel and not yet acknowledged. 0 means DefaultMaxBuffered.
	MaxBuffered int
	// LowBuffered is where a waiting Send resumes (the channel's bufferedAmountLowThreshold).
	// 0 means MaxBuffered/4.
	LowBuffered int
	// PeerTimeout is how long a neighbour may stay silent (no ICE consent or keepalive answered)
	// before its connection is failed. It catches peers that vanish without closing, such as a
	// killed process or a laptop that left the network; a peer that closes its connection is
	// noticed at once. 0 means DefaultPeerTimeout.
	PeerTimeout time.Duration
	// Neighbours, when not nil, are the only peers this transport talks to: a signal from anyone
	// else (an offer above all) is refused with ErrNotNeighbour and answered with nothing, and
	// Connect to anyone else fails. A worker sets it to the neighbours of its plan; nil lets any
	// peer in (a transport tested on its own).
	Neighbours []string
	// Admit, when set, is asked about every frame's header before anything is allocated for it:
	// may neighbour peer send this tensor, this large, under the current plan? An error fails the
	// peer as a protocol violation (wrapping the error). Frames of older plans are dropped before.
	Admit func(peer string, h proto.FrameHeader) error
	// OnPeerFailed, when set, is called once for each failure of a neighbour (its connection
	// failed or closed, or it broke the protocol), on a goroutine of its own, so that the worker
	// can tell the coordinator, which abandons the step. Close does not wait for it.
	OnPeerFailed func(peer string, err error)
	// Contained, when set, names the neighbours whose failure stops only what waits on them
	// (PeerDone) instead of every Recv: a stage's partners in outer steps, which it hears from
	// only during an exchange, so that one of them leaving does not stop its pipeline's
	// activations or an exchange among the others (client/outer.go).
	Contained func(peer string) bool
	// Logger receives connection events; nil discards them.
	Logger *slog.Logger
	// Uplink, when set, paces every frame sent (WorkerConfig.MaxUploadBytesPerS).
	Uplink *Uplink
}

const (
	// DefaultMaxBuffered is the send high-water mark: on loopback, 4 MiB in flight with a 1 MiB
	// low mark kept a pion data channel at its full throughput (docs/design.md, "Browser
	// tests"), and it bounds what a slow neighbour makes this worker hold per connection.
	DefaultMaxBuffered = 4 << 20
	// DefaultPeerTimeout is RTCConfig.PeerTimeout's default: longer than a GC pause or a busy
	// browser tab's stall, well inside a step deadline.
	DefaultPeerTimeout = 15 * time.Second
)

// withDefaults fills the zero fields of c.
func (c RTCConfig) withDefaults() RTCConfig {
	d := proto.DefaultLimits()
	if c.Limits.MaxTensorBytes <= 0 {
		c.Limits.MaxTensorBytes = d.MaxTensorBytes
	}
	if c.Limits.MaxInFlightBytes <= 0 {
		c.Limits.MaxInFlightBytes = d.MaxInFlightBytes
	}
	if c.MailboxBytes <= 0 {
		c.MailboxBytes = c.Limits.MaxInFlightBytes
	}
	if c.MaxBuffered <= 0 {
		c.MaxBuffered = DefaultMaxBuffered
	}
	if c.LowBuffered <= 0 || c.LowBuffered >= c.MaxBuffered {
		c.LowBuffered = c.MaxBuffered / 4
	}
	if c.PeerTimeout <= 0 {
		c.PeerTimeout = DefaultPeerTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

var (
	// ErrPeerGone means a neighbour's connection closed or failed: the peer closed it, ICE or DTLS
	// failed, or it stayed silent past RTCConfig.PeerTimeout. The step that needed it is lost.
	ErrPeerGone = errors.New("neighbour connection lost")
	// ErrProtocolViolation means a neighbour sent something a correct peer never sends: a
	// malformed frame, chunks that contradict each other, a tensor twice, or more than the
	// configured limits allow. Its connection is closed; the error also wraps the cause
	// (a proto frame error, ErrDuplicate, ...).
	ErrProtocolViolation = errors.New("neighbour broke the data-plane protocol")
	// ErrNotNeighbour means a peer that is not a neighbour under the current plan sent a signal
	// or a tensor frame. Nothing is answered to it, and the frame is dropped: an error caused by a
	// message from outside the plan drops that message, never the step.
	ErrNotNeighbour = errors.New("peer is not a neighbour under the current plan")
	// ErrUnexpectedTensor means a neighbour sent a tensor that the plan does not have it send (an
	// activation from the next stage, expert rows from a stage, tokens from a peer): it broke the
	// protocol.
	ErrUnexpectedTensor = errors.New("tensor from a peer the plan does not have send it")
	// ErrNotConnected is returned by Send to a peer that Connect was never called for (and that
	// never offered a connection), or that was Disconnected.
	ErrNotConnected = errors.New("no connection to peer")
)

// PeerError is how RTCTransport reports a neighbour's failure: which peer, and why (wrapping
// ErrPeerGone or ErrProtocolViolation).
type PeerError struct {
	Peer string
	Err  error
}

func (e *PeerError) Error() string { return fmt.Sprintf("peer %s: %v", e.Peer, e.Err) }

func (e *PeerError) Unwrap() error { return e.Err }

// loopbackICEServer reports whether every URL of s names a loopback address by its IP
// (stun:127.0.0.1:3478, turn:[::1]:3478?transport=udp): a name is not resolved, so "localhost"
// is not one, as loopback mode resolves nothing.
func loopbackICEServer(s proto.ICEServer) bool {
	if len(s.URLs) == 0 {
		return false
	}
	for _, u := range s.URLs {
		_, rest, ok := strings.Cut(u, ":")
		if !ok {
			return false
		}
		rest, _, _ = strings.Cut(rest, "?")
		host := rest
		if h, _, err := net.SplitHostPort(rest); err == nil {
			host = h
		}
		ip := net.ParseIP(strings.Trim(host, "[]"))
		if ip == nil || !ip.IsLoopback() {
			return false
		}
	}
	return true
}
