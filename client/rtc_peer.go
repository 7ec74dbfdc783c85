package client

// RTCTransport on pion/webrtc, for every platform: pion's native build runs ICE, DTLS and SCTP
// itself, and its js build wraps the browser's RTCPeerConnection behind the same API. What differs
// between the two (how the pion API is configured, how a candidate is parsed, how a connection is
// closed) is in rtc_native.go and rtc_js.go, which each define:
//
//	newRTCAPI(cfg RTCConfig) (*webrtc.API, error)  the API one peer connection is made with
//	prepareChannel(dc)                            settle how the data channel delivers messages
//	loopbackCandidate(c string) bool              whether an SDP candidate is on a loopback address
//	closeConnection(pc, dc) error                 close a connection and its data channel
//	usesSimulatedNet                              whether RTCConfig.Net is honoured

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/webrtc/v4"

	"github.com/shoal-ml/shoal/proto"
)

var _ Transport = (*RTCTransport)(nil)

// RTCTransport is a worker's data plane: one WebRTC peer connection, with one ordered, reliable
// data channel, per neighbour (docs/design.md, "Wire"). Tensors go out as proto frames of at most 64 KiB;
// frames coming in are reassembled per neighbour and filed in one Mailbox, where Recv finds them
// whichever neighbour sent them.
//
// # Connecting
//
// Both workers of a pair call Connect; the coordinator relays their signals, which the worker
// hands to HandleSignal. Exactly one side offers: by convention the lower worker id, which both
// sides can tell without talking. ICE candidates are trickled (sent as they are found) rather than
// gathered before the offer goes out: proto.Signal carries them, browsers trickle by default, and
// a STUN or TURN server that answers slowly, or not at all, then delays nothing but its own
// candidate. Loopback mode gathers in microseconds, so the choice costs tests nothing.
//
// # Trust
//
// Peers are untrusted (docs/design.md, "Trust"). A worker tells the transport the neighbours of its
// plan (RTCConfig.Neighbours): signals from anyone else are refused unanswered, so no connection
// to a peer outside the plan ever exists. Each frame's header is then put to RTCConfig.Admit —
// does the plan have this neighbour send this tensor, this large? — before the reassembler
// allocates anything for it, and every neighbour's reassembler draws on the worker's one
// proto.Budget (RTCConfig.Limits), so that neighbours together cannot make it hold more.
//
// # Failures
//
// A neighbour fails when its connection closes or fails (ErrPeerGone), or when it breaks the
// protocol (ErrProtocolViolation): a malformed frame, contradicting chunks, a tensor twice, a
// tensor that does not fit the limits, a tensor Admit refuses. Its connection is closed, and Send
// to it, Err and OnPeerFailed report a *PeerError naming it.
//
// A Recv key does not say which neighbour will send it, so a failed neighbour fails every Recv of
// the transport: those waiting when it fails, and later ones (except for tensors that had already
// arrived whole) until the worker Disconnects it or Connects to it again. The step in progress is
// lost anyway (docs/design.md, "Faults"), and failing fast beats each Recv waiting for its deadline.
type RTCTransport struct {
	id  string
	sig Signaler
	cfg RTCConfig
	ice []webrtc.ICEServer
	box *Mailbox
	// allowed is the set of peers this transport talks to (RTCConfig.Neighbours); nil: anyone.
	allowed map[string]bool
	// fg is what foreground tensors are being sent, to any neighbour: a background frame
	// waits for none (see background), since every link shares the worker's uplink.
	fg foreground
	// frameSent, when set (tests only, before the first Send), is told the kind of every frame
	// handed to a link, in order, under the link's sendSem.
	frameSent func(proto.Kind)

	ctx    context.Context // parent of the peers' contexts; cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // goroutines closing peers in the background

	// plan is the current plan version. It is written under mu but read without it, by
	// connections queueing signals under their own locks.
	plan atomic.Uint32

	mu         sync.Mutex
	closed     bool
	peers      map[string]*rtcPeer
	failed     map[string]*PeerError // failed neighbours not yet Disconnected or reconnected
	failOrder  []string              // failed's keys, first failure first
	failCtx    context.Context       // cancelled, with the first failure as cause, while failed is not empty
	failCancel context.CancelCauseFunc
	// left are the neighbours the coordinator said left the job (PeerLeft): a connection to one
	// fails at once instead of waiting out its ICE timeout.
	left map[string]bool

	// quic is the socket shared by QUIC and ICE (rtc_quic.go), opened with the first connection;
	// nil where QUIC is off or the socket could not be opened (pion then opens its own).
	quic      *quicEndpoint
	quicTried bool

	// beforeFrame, when set before connecting, runs before each incoming message is decoded:
	// tests slow the receiver down with it.
	beforeFrame func(peer string)
	// quicDrop, when set before connecting, drops every QUIC packet this transport sends: a
	// firewall that lets ICE and DTLS through but not QUIC.
	quicDrop bool
}

// NewRTCTransport returns the data plane of worker id, which signals its neighbours through sig.
// It connects to nobody yet: see Connect. An empty id or a nil sig is a programming error, and
// panics.
func NewRTCTransport(id string, cfg RTCConfig, sig Signaler) *RTCTransport {
	if id == "" || sig == nil {
		panic("client.NewRTCTransport: a worker id and a Signaler are required")
	}
	cfg = cfg.withDefaults()
	t := &RTCTransport{
		id:     id,
		sig:    sig,
		cfg:    cfg,
		box:    cfg.Mailbox,
		peers:  map[string]*rtcPeer{},
		failed: map[string]*PeerError{},
	}
	for _, s := range cfg.ICEServers {
		if !cfg.Loopback || loopbackICEServer(s) {
			t.ice = append(t.ice, webrtc.ICEServer{URLs: s.URLs, Username: s.Username, Credential: s.Credential})
		}
	}
	if t.box == nil {
		t.box = NewMailbox(cfg.MailboxBytes)
	}
	if cfg.Neighbours != nil {
		t.allowed = make(map[string]bool, len(cfg.Neighbours))
		for _, p := range cfg.Neighbours {
			t.allowed[p] = true
		}
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	t.failCtx, t.failCancel = context.WithCancelCause(context.Background())
	return t
}

// rtcPeer is the connection to one neighbour.
type rtcPeer struct {
	t       *RTCTransport
	id      string
	offerer bool
	pc      *webrtc.PeerConnection
	dc      *webrtc.DataChannel

	ctx      context.Context // ends when the connection is closed; bounds signaling
	cancel   context.CancelFunc
	open     chan struct{} // closed when the data channel opens
	done     chan struct{} // closed when the connection fails or is closed; err says why
	low      chan struct{} // one token: the buffered amount fell to the low mark
	sendSem  chan struct{} // one token: who may fill buf and hand it to the data channel
	buf      []byte        // the frame being sent, reused
	peakBuf  atomic.Uint64 // the most bytes seen buffered right after a send, for tests
	loopDone chan struct{} // closed when signalLoop returns

	// recvMu guards the reassembler, which pion's read loop feeds and SetPlanVersion and Discard
	// trim; the lock is uncontended on the hot path.
	recvMu sync.Mutex
	reasm  *proto.Reassembler

	// sigMu orders the handling of incoming signals; pendingICE is its, and remoteSet is written
	// under it (and read without it by HandleSignal, under t.mu).
	sigMu      sync.Mutex
	remoteSet  atomic.Bool
	pendingICE []webrtc.ICECandidateInit // candidates that came before the remote description

	mu       sync.Mutex
	err      *PeerError
	descSent bool                 // our description is queued, so candidates may follow it
	heldICE  []proto.ICECandidate // local candidates found before that
	out      []proto.Signal       // signals for signalLoop to send, in order
	outWake  chan struct{}

	// The QUIC path (rtc_quic.go): remoteQUIC is the certificate fingerprint the peer signalled
	// ("" if none: a browser), under mu; link is set, under mu and only while err is nil, once a
	// QUIC connection carries the frames; quicWG counts the dial in progress.
	remoteQUIC  string
	selected    atomic.Pointer[webrtc.ICECandidatePair] // the pair ICE selected, nil before
	link        atomic.Pointer[quicLink]
	quicWG      sync.WaitGroup
	quicRefused atomic.Bool  // the dial failed: the link stays on the data channel
	quicFrames  atomic.Int64 // frames sent on the QUIC link
	dcFrames    atomic.Int64 // frames sent on the data channel

	openOnce  sync.Once
	closeOnce sync.Once
}

// newPeerLocked sets up the connection to neighbour id; t.mu is held. Both sides create the data
// channel up front as a pre-negotiated channel with stream id 0: its handlers are installed
// before a single byte can arrive (docs/design.md, "Browser tests": no OnDataChannel race), and
// it opens with the SCTP association, without the in-band open handshake's round trip.
func (t *RTCTransport) newPeerLocked(id string, offerer bool) (*rtcPeer, error) {
	if !t.quicTried {
		t.quicTried = true
		if e, err := openQUIC(t); err != nil {
			t.cfg.Logger.Warn("no QUIC socket: links stay on data channels", "err", err)
		} else {
			t.quic = e
		}
	}
	api, err := newRTCAPI(t.cfg, t.quic)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", id, err)
	}
	conf := webrtc.Configuration{ICEServers: t.ice}
	if t.cfg.RelayOnly {
		conf.ICETransportPolicy = webrtc.ICETransportPolicyRelay
	}
	pc, err := api.NewPeerConnection(conf)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", id, err)
	}
	negotiated, streamID := true, uint16(0)
	dc, err := pc.CreateDataChannel("shoal", &webrtc.DataChannelInit{Negotiated: &negotiated, ID: &streamID})
	if err != nil {
		_ = pc.Close()
		return nil, fmt.Errorf("connect to %s: %w", id, err)
	}
	p := &rtcPeer{
		t: t, id: id, offerer: offerer, pc: pc, dc: dc,
		open:     make(chan struct{}),
		done:     make(chan struct{}),
		low:      make(chan struct{}, 1),
		sendSem:  make(chan struct{}, 1),
		loopDone: make(chan struct{}),
		outWake:  make(chan struct{}, 1),
		reasm:    proto.NewReassembler(t.cfg.Limits),
	}
	p.ctx, p.cancel = context.WithCancel(t.ctx)
	p.reasm.SetPlanVersion(t.plan.Load())

	prepareChannel(dc)
	dc.SetBufferedAmountLowThreshold(uint64(t.cfg.LowBuffered))
	dc.OnBufferedAmountLow(func() {
		select {
		case p.low <- struct{}{}:
		default: // a token is already waiting
		}
	})
	dc.OnOpen(func() {
		p.openOnce.Do(func() { close(p.open) })
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.err == nil && t.quic != nil && p.remoteQUIC != "" {
			p.quicWG.Add(1)
			go func() {
				defer p.quicWG.Done()
				p.dialQUIC()
			}()
		}
	})
	dc.OnClose(func() { p.fail(fmt.Errorf("%w: data channel closed", ErrPeerGone)) })
	dc.OnError(func(err error) { p.fail(fmt.Errorf("%w: data channel: %w", ErrPeerGone, err)) })
	dc.OnMessage(p.onMessage)
	pc.OnICECandidate(p.localCandidate)
	p.watchSelectedPair()
	pc.OnConnectionStateChange(func(s webrtc.PeerConnectionState) {
		switch s {
		case webrtc.PeerConnectionStateFailed:
			p.fail(fmt.Errorf("%w: ICE/DTLS connection failed (silent for %v, or unreachable)", ErrPeerGone, t.cfg.PeerTimeout))
		case webrtc.PeerConnectionStateClosed:
			p.fail(fmt.Errorf("%w: connection closed", ErrPeerGone))
		case webrtc.PeerConnectionStateDisconnected:
			t.cfg.Logger.Warn("neighbour connection disconnected, waiting for it to recover", "peer", id)
		}
	})
	go p.signalLoop()
	return p, nil
}

// Connect connects this worker to peer peerID and returns once their data channel is open; ctx
// bounds the wait, and a connection not open by then is failed. Exactly one of the two workers
// passes offerer true: the one with the lower id. Connecting to a connected peer returns at once;
// connecting to a failed one replaces its connection.
func (t *RTCTransport) Connect(ctx context.Context, peerID string, offerer bool) error {
	if peerID == t.id || peerID == "" {
		return fmt.Errorf("connect %s to %q: not a neighbour", t.id, peerID)
	}
	if !t.neighbour(peerID) {
		return fmt.Errorf("connect %s to %s: %w", t.id, peerID, ErrNotNeighbour)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return fmt.Errorf("connect to %s: rtc transport %s: %w", peerID, t.id, ErrClosed)
	}
	if t.left[peerID] {
		t.mu.Unlock()
		return &PeerError{Peer: peerID, Err: fmt.Errorf("%w: the coordinator says it left the job", ErrPeerGone)}
	}
	p := t.peers[peerID]
	created := false
	if p != nil && p.failure() != nil {
		t.dropLocked(p, true)
		p = nil
	}
	if p == nil {
		var err error
		if p, err = t.newPeerLocked(peerID, offerer); err != nil {
			t.mu.Unlock()
			return err
		}
		t.peers[peerID] = p
		created = true
	}
	t.mu.Unlock()
	if p.offerer != offerer {
		return fmt.Errorf("connect to %s as %s: the connection is already set up with %s offering: the lower id offers",
			peerID, role(offerer), role(p.offerer))
	}
	if created && offerer {
		if err := p.sendOffer(); err != nil {
			p.fail(err)
			return fmt.Errorf("connect: %w", p.failure())
		}
	}
	select {
	case <-p.open:
		return nil
	case <-p.done:
		return fmt.Errorf("connect: %w", p.failure())
	case <-ctx.Done():
		select {
		case <-p.open:
			return nil // opened just as ctx ended: keep it
		default:
		}
		p.fail(fmt.Errorf("%w: data channel not open: %w", ErrPeerGone, ctx.Err()))
		return fmt.Errorf("connect: %w", p.failure())
	}
}

func role(offerer bool) string {
	if offerer {
		return "offerer"
	}
	return "answerer"
}

func (p *rtcPeer) sendOffer() error {
	p.sigMu.Lock()
	defer p.sigMu.Unlock()
	offer, err := p.pc.CreateOffer(nil)
	if err != nil {
		return fmt.Errorf("%w: create offer: %w", ErrPeerGone, err)
	}
	if err := p.pc.SetLocalDescription(offer); err != nil {
		return fmt.Errorf("%w: set offer: %w", ErrPeerGone, err)
	}
	p.queueDescription(offer)
	return nil
}

// HandleSignal applies a signal the coordinator relayed from worker from. An offer from a peer
// this worker has not called Connect for yet sets the connection up, so the two workers need not
// call Connect in any particular order. Signals of an older plan version than the transport's are
// ignored (docs/design.md, "Wire"). The error says why a signal was refused; an offer or answer that cannot be
// applied also fails the connection it was for. A signal from a peer outside RTCConfig.Neighbours
// is refused with ErrNotNeighbour before anything is set up for it: an offer from outside the plan
// gets no answer, and no candidate of this worker's.
func (t *RTCTransport) HandleSignal(from string, s proto.Signal) error {
	s.From = from // the coordinator's word for who sent it is the one that counts
	if err := s.Validate(); err != nil {
		return fmt.Errorf("signal from %s: %w", from, err)
	}
	if s.To != t.id {
		return fmt.Errorf("signal from %s for %s delivered to %s", from, s.To, t.id)
	}
	if !t.neighbour(from) {
		return fmt.Errorf("signal from %s: %w", from, ErrNotNeighbour)
	}
	if s.PlanVersion < t.plan.Load() {
		return nil
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return fmt.Errorf("signal from %s: rtc transport %s: %w", from, t.id, ErrClosed)
	}
	p := t.peers[from]
	if s.SDP != nil && s.SDP.Type == "offer" {
		var err error
		if p, err = t.peerForOfferLocked(from, p); err != nil {
			t.mu.Unlock()
			return err
		}
	}
	t.mu.Unlock()

	switch {
	case p == nil:
		return fmt.Errorf("signal from %s: %w", from, ErrNotConnected)
	case s.SDP != nil:
		if s.SDP.Type == "answer" && !p.offerer {
			return fmt.Errorf("answer from %s, which this worker did not offer to", from)
		}
		if err := p.applyDescription(*s.SDP, s.QUIC); err != nil {
			p.fail(err)
			return fmt.Errorf("%s from %s: %w", s.SDP.Type, from, err)
		}
		return nil
	default:
		if err := p.addCandidate(*s.Candidate); err != nil {
			return fmt.Errorf("ICE candidate from %s: %w", from, err)
		}
		return nil
	}
}

// neighbour reports whether this transport may talk to peer (RTCConfig.Neighbours).
func (t *RTCTransport) neighbour(peer string) bool { return t.allowed == nil || t.allowed[peer] }

// peerForOfferLocked returns the connection an offer from id is for, p being the current one;
// t.mu is held.
func (t *RTCTransport) peerForOfferLocked(id string, p *rtcPeer) (*rtcPeer, error) {
	if p != nil {
		if p.offerer {
			return nil, fmt.Errorf("offer from %s, which this worker offers to: the lower id offers", id)
		}
		if p.failure() == nil && !p.remoteSet.Load() {
			return p, nil // Connect came first and waits for this offer
		}
		// A second offer means the peer started over: its old connection, and whatever was in
		// flight on it, is gone. That is a failure for the step, reported as such.
		if p.finish(fmt.Errorf("%w: the peer opened a new connection", ErrPeerGone)) {
			t.peerFailedLocked(p)
		}
		t.dropLocked(p, true)
	}
	p, err := t.newPeerLocked(id, false)
	if err != nil {
		return nil, err
	}
	t.peers[id] = p
	return p, nil
}

// applyDescription applies the remote offer or answer, and answers an offer; quicFP is the
// peer's QUIC certificate fingerprint that came with it ("" for none).
func (p *rtcPeer) applyDescription(d proto.SessionDescription, quicFP string) error {
	p.sigMu.Lock()
	defer p.sigMu.Unlock()
	if p.remoteSet.Load() {
		return fmt.Errorf("%w: a second %s on one connection", ErrProtocolViolation, d.Type)
	}
	if p.t.quic != nil {
		p.mu.Lock()
		p.remoteQUIC = quicFP
		p.mu.Unlock()
	}
	sdp := d.SDP
	if p.t.loopbackFilter() {
		sdp = loopbackOnlySDP(sdp)
	}
	typ := webrtc.SDPTypeOffer
	if d.Type == "answer" {
		typ = webrtc.SDPTypeAnswer
	}
	if err := p.pc.SetRemoteDescription(webrtc.SessionDescription{Type: typ, SDP: sdp}); err != nil {
		return fmt.Errorf("%w: apply %s: %w", ErrProtocolViolation, d.Type, err)
	}
	p.remoteSet.Store(true)
	for _, c := range p.pendingICE {
		if err := p.pc.AddICECandidate(c); err != nil {
			p.t.cfg.Logger.Warn("dropping ICE candidate", "peer", p.id, "err", err)
		}
	}
	p.pendingICE = nil
	if typ == webrtc.SDPTypeAnswer {
		return nil
	}
	answer, err := p.pc.CreateAnswer(nil)
	if err != nil {
		return fmt.Errorf("%w: create answer: %w", ErrPeerGone, err)
	}
	if err := p.pc.SetLocalDescription(answer); err != nil {
		return fmt.Errorf("%w: set answer: %w", ErrPeerGone, err)
	}
	p.queueDescription(answer)
	return nil
}

// addCandidate applies a remote ICE candidate, or keeps it until the remote description is there:
// the relay keeps each sender's order, but nothing stops a browser peer from trickling its first
// candidates ahead of its answer.
func (p *rtcPeer) addCandidate(c proto.ICECandidate) error {
	if p.t.loopbackFilter() && c.Candidate != "" && !loopbackCandidate(c.Candidate) {
		// Loopback mode promises not to send a packet elsewhere; ICE would check any address.
		p.t.cfg.Logger.Debug("dropping non-loopback ICE candidate in loopback mode", "peer", p.id, "candidate", c.Candidate)
		return nil
	}
	init := webrtc.ICECandidateInit{Candidate: c.Candidate, SDPMid: c.SDPMid, SDPMLineIndex: c.SDPMLineIndex, UsernameFragment: c.UsernameFragment}
	p.sigMu.Lock()
	defer p.sigMu.Unlock()
	if !p.remoteSet.Load() {
		if len(p.pendingICE) >= maxPendingCandidates {
			return fmt.Errorf("more than %d candidates before the session description", maxPendingCandidates)
		}
		p.pendingICE = append(p.pendingICE, init)
		return nil
	}
	return p.pc.AddICECandidate(init)
}

// maxPendingCandidates bounds what a peer can make this worker hold before its description: a
// host has a handful of candidates per interface and server.
const maxPendingCandidates = 256

// loopbackFilter reports whether remote candidates that are not on a loopback address must be
// dropped: in loopback mode on the host's network. On a simulated one (RTCConfig.Net) every
// candidate is a virtual address, 10.x rather than 127.x, that exists only inside this process: a
// connectivity check to it goes through the simulation's router, never onto a real network, so
// loopback mode's promise holds without the filter (and with it no candidate would remain). The
// js build ignores Net (usesSimulatedNet is false there), so a tab keeps the filter whatever it is
// handed.
func (t *RTCTransport) loopbackFilter() bool {
	return t.cfg.Loopback && !(usesSimulatedNet && t.cfg.Net != nil)
}

// loopbackOnlySDP drops the candidates that are not on a loopback address from an SDP.
func loopbackOnlySDP(sdp string) string {
	var b strings.Builder
	for line := range strings.Lines(sdp) {
		if c, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), "a="); ok &&
			strings.HasPrefix(c, "candidate:") && !loopbackCandidate(c) {
			continue
		}
		b.WriteString(line)
	}
	return b.String()
}

// localCandidate is pion's OnICECandidate: it trickles c to the peer, or the end of candidates
// when c is nil.
func (p *rtcPeer) localCandidate(c *webrtc.ICECandidate) {
	var pc proto.ICECandidate // Candidate "" is the end of candidates
	if c != nil {
		init := c.ToJSON()
		pc = proto.ICECandidate{Candidate: init.Candidate, SDPMid: init.SDPMid, SDPMLineIndex: init.SDPMLineIndex, UsernameFragment: init.UsernameFragment}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.descSent {
		// pion finds candidates as soon as the local description is set, which can be before
		// applyDescription has queued that description; the peer cannot use them before it.
		p.heldICE = append(p.heldICE, pc)
		return
	}
	p.queueLocked(proto.Signal{Candidate: &pc})
}

// queueDescription queues the local offer or answer, then the candidates found before it.
func (p *rtcPeer) queueDescription(d webrtc.SessionDescription) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := proto.Signal{SDP: &proto.SessionDescription{Type: d.Type.String(), SDP: d.SDP}}
	if e := p.t.quic; e != nil {
		s.QUIC = e.fp
	}
	p.queueLocked(s)
	p.descSent = true
	for i := range p.heldICE {
		p.queueLocked(proto.Signal{Candidate: &p.heldICE[i]})
	}
	p.heldICE = nil
}

func (p *rtcPeer) queueLocked(s proto.Signal) {
	s.From, s.To, s.PlanVersion = p.t.id, p.id, p.t.plan.Load()
	p.out = append(p.out, s)
	select {
	case p.outWake <- struct{}{}:
	default:
	}
}

// signalLoop sends the peer's queued signals in order. It runs on its own goroutine so that a
// slow coordinator link never blocks pion's callbacks, which queue candidates.
func (p *rtcPeer) signalLoop() {
	defer close(p.loopDone)
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-p.outWake:
		}
		for {
			p.mu.Lock()
			if len(p.out) == 0 {
				p.mu.Unlock()
				break
			}
			s := p.out[0]
			p.out = p.out[1:]
			p.mu.Unlock()
			if err := p.t.sig.SendSignal(p.ctx, p.id, s); err != nil {
				if p.ctx.Err() != nil {
					return
				}
				select {
				case <-p.open:
					// A late candidate of a working connection: nothing depends on it.
					p.t.cfg.Logger.Warn("signal to neighbour lost", "peer", p.id, "err", err)
					continue
				default:
				}
				p.fail(fmt.Errorf("%w: signaling: %w", ErrPeerGone, err))
				return
			}
		}
	}
}

// failure is why the connection is done, or nil while it works.
func (p *rtcPeer) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil {
		return nil
	}
	return p.err
}

// finish marks the connection done for cause, and reports whether this call did so.
func (p *rtcPeer) finish(cause error) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return false
	}
	p.err = &PeerError{Peer: p.id, Err: cause}
	close(p.done)
	return true
}

// fail marks the connection failed and reports it. It is called from pion's callbacks, so it
// closes the connection on another goroutine.
func (p *rtcPeer) fail(cause error) {
	if !p.finish(cause) {
		return
	}
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	p.t.peerFailedLocked(p)
}

// peerFailedLocked records the failure of p, whose err is set, and starts closing it; t.mu is
// held.
func (t *RTCTransport) peerFailedLocked(p *rtcPeer) {
	if t.closed || t.peers[p.id] != p {
		return // Close or a replacement has taken it over
	}
	err := p.err
	if c := t.cfg.Contained; c == nil || !c(p.id) {
		t.failed[p.id] = err
		t.failOrder = append(t.failOrder, p.id)
		t.failCancel(err)
	}
	t.cfg.Logger.Warn("neighbour failed", "peer", p.id, "err", err.Err)
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		p.shutdown()
	}()
	if cb := t.cfg.OnPeerFailed; cb != nil {
		// Not tracked by wg: the callback may take its time, and Close must not wait for it.
		go cb(p.id, err)
	}
}

// dropLocked forgets p and its failure, closing it in the background when async, else leaving
// that to the caller; t.mu is held.
func (t *RTCTransport) dropLocked(p *rtcPeer, async bool) {
	if t.peers[p.id] == p {
		delete(t.peers, p.id)
	}
	if _, ok := t.failed[p.id]; ok {
		delete(t.failed, p.id)
		t.failOrder = removeString(t.failOrder, p.id)
		// A fresh context for the Recvs to come, cancelled again if another failure is still
		// outstanding.
		t.failCtx, t.failCancel = context.WithCancelCause(context.Background())
		if len(t.failOrder) > 0 {
			t.failCancel(t.failed[t.failOrder[0]])
		}
	}
	if async {
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			p.shutdown()
		}()
	}
}

func removeString(s []string, x string) []string {
	out := s[:0]
	for _, v := range s {
		if v != x {
			out = append(out, v)
		}
	}
	return out
}

// shutdown closes the connection and waits for its goroutines (and pion's) to end.
func (p *rtcPeer) shutdown() {
	p.closeOnce.Do(func() {
		p.finish(fmt.Errorf("%w: closed by this worker", ErrPeerGone))
		p.cancel()
		p.quicWG.Wait()
		if l := p.link.Load(); l != nil {
			l.close()
		}
		if err := closeConnection(p.pc, p.dc); err != nil {
			p.t.cfg.Logger.Debug("close neighbour connection", "peer", p.id, "err", err)
		}
		<-p.loopDone
		// Give the partial tensors' bytes back to the budget the worker's reassemblers share;
		// onMessage files nothing more once done is closed (finish, above).
		p.recvMu.Lock()
		p.reasm.Discard(func(proto.TensorKey) bool { return true })
		p.recvMu.Unlock()
	})
}

// PeerDone is closed once the connection to peer has failed or closed (RTCConfig.Contained); nil
// when this transport has no connection to it.
func (t *RTCTransport) PeerDone(peer string) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p := t.peers[peer]; p != nil {
		return p.done
	}
	return nil
}

// PeerLeft fails the link to peerID, if it is a neighbour's, as if the link had broken: the
// coordinator says the peer left the job (proto.PeerLeft), which a killed process's link shows
// only when it times out. A contained link's failure ends only what waits on that peer
// (RTCConfig.Contained); any other fails the plan's data plane, as a broken link does.
func (t *RTCTransport) PeerLeft(peerID string) {
	t.mu.Lock()
	if t.left == nil {
		t.left = map[string]bool{}
	}
	t.left[peerID] = true // a Connect that has not begun yet fails at once too
	p := t.peers[peerID]
	t.mu.Unlock()
	if p != nil {
		p.fail(fmt.Errorf("%w: the coordinator says it left the job", ErrPeerGone))
	}
}

// Disconnect closes the connection to peerID and forgets it, and its failure if it failed: a
// worker applying a new plan disconnects the neighbours it no longer has, which lets Recv wait
// again. It returns once the connection is closed.
func (t *RTCTransport) Disconnect(peerID string) {
	t.mu.Lock()
	p := t.peers[peerID]
	if p != nil {
		t.dropLocked(p, false)
	}
	t.mu.Unlock()
	if p != nil {
		p.shutdown()
	}
}

// onMessage is pion's OnMessage for the data channel. Native pion calls it from the channel's one
// read loop, so frames reach the reassembler in the order they were sent, and a slow receiver
// holds up the SCTP window rather than piling messages up. pion's js build instead starts a
// goroutine per browser message event (a js callback must not block), so there neither holds:
// the order is the order the wasm scheduler runs those goroutines in, and the browser keeps
// reading whatever this side does. Nothing here depends on the order: the reassembler files a
// chunk by its index, whole tensors go to the mailbox by key, and both are guarded by locks
// (TestRTCMessagesOutOfOrder). What bounds the memory a neighbour can make this side hold is
// not back-pressure but the limits: RTCConfig.Admit's verdict on each header (whether this
// neighbour sends such a tensor, this large), proto.Limits per neighbour and its Budget over all
// of them for partial tensors, and the mailbox's bound for whole ones, which a peer following the
// schedule never reaches. All of it is decided at the header, before a tensor's buffer exists.
func (p *rtcPeer) onMessage(msg webrtc.DataChannelMessage) {
	if msg.IsString {
		select {
		case <-p.done:
		default:
			p.fail(fmt.Errorf("%w: a text message (%d bytes) on the tensor channel", ErrProtocolViolation, len(msg.Data)))
		}
		return
	}
	p.handleFrame(msg.Data)
}

// handleFrame decodes, admits and files one frame from the peer, whichever path it came on; b
// is not kept. It reports whether the peer is still worth reading.
func (p *rtcPeer) handleFrame(b []byte) bool {
	select {
	case <-p.done:
		return false // a failed peer's remaining frames are not looked at
	default:
	}
	if h := p.t.beforeFrame; h != nil {
		h(p.id)
	}
	f, err := proto.DecodeFrame(b, p.t.cfg.Limits)
	if err != nil {
		p.fail(fmt.Errorf("%w: %w", ErrProtocolViolation, err))
		return false
	}
	if f.Header.PlanVersion < p.t.plan.Load() {
		return true // docs/design.md, "Wire": frames from an old plan version are dropped
	}
	if admit := p.t.cfg.Admit; admit != nil {
		if err := admit(p.id, f.Header); err != nil {
			p.fail(fmt.Errorf("%w: %w", ErrProtocolViolation, err))
			return false
		}
	}
	p.recvMu.Lock()
	select {
	case <-p.done:
		// shutdown has given the reassembler's bytes back: nothing more may be filed.
		p.recvMu.Unlock()
		return false
	default:
	}
	tn, whole, err := p.reasm.AddFrame(f)
	p.recvMu.Unlock()
	switch {
	case errors.Is(err, proto.ErrStalePlan):
		return true // the plan moved on while the frame was decoded
	case err != nil:
		p.fail(fmt.Errorf("%w: %w", ErrProtocolViolation, err))
		return false
	case !whole:
		return true
	}
	if err := p.t.box.Deliver(tn); err != nil {
		if errors.Is(err, ErrClosed) {
			return false // this transport is closing
		}
		p.fail(fmt.Errorf("%w: %w", ErrProtocolViolation, err))
		return false
	}
	return true
}

// Send queues t for peer to, frame by frame, and returns once the last frame is handed to the
// data channel; it does not wait for the receiver. ctx bounds the wait for the connection to
// open and for buffer space: Send waits while more than RTCConfig.MaxBuffered bytes are queued
// on the channel. A Send that ends early leaves the receiver a partial tensor, which the step's
// Discard removes.
func (t *RTCTransport) Send(ctx context.Context, to string, tn proto.Tensor) error {
	t.mu.Lock()
	p, closed := t.peers[to], t.closed
	t.mu.Unlock()
	switch {
	case closed:
		return fmt.Errorf("send %v to %s: rtc transport %s: %w", tn.Key, to, t.id, ErrClosed)
	case p == nil:
		return fmt.Errorf("send %v to %s: %w", tn.Key, to, ErrNotConnected)
	}
	select {
	case <-p.open:
	case <-p.done:
		return fmt.Errorf("send %v: %w", tn.Key, p.failure())
	case <-ctx.Done():
		return fmt.Errorf("send %v to %s: waiting for the connection: %w", tn.Key, to, ctx.Err())
	}
	bg := background(tn.Key.Kind)
	if !bg {
		p.t.fg.enter()
		defer p.t.fg.leave()
	}
	for i := range tn.NumChunks() {
		if err := p.sendChunk(ctx, tn, i, bg); err != nil {
			return fmt.Errorf("send %v chunk %d/%d: %w", tn.Key, i, tn.NumChunks(), err)
		}
	}
	return nil
}

// Two classes share a worker's uplink (issue 31, lever 3: a giver's uplink carries state beside
// the pipeline). Background tensors — a stage's state handed to a newcomer, an outer step's
// contributions and signatures — are what the job can wait for: without a delay nothing else
// crosses while they do, and with one (or the momentum a grow's takers get while they train) they
// should fill the gaps the pipeline leaves, not stand in front of its activations. Every link of a
// transport shares the uplink, so the classes are the transport's:
//   - A background frame goes while no foreground tensor is being sent on any link, or once
//     bgShare foreground frames went since the last background one (it then competes for the
//     link, and may lose it again), so that a pipeline that never pauses does not leave it
//     nothing (a delayed outer step waits on it at its take-up).
//   - One that waited bgMaxWait goes all the same (a foreground tensor waiting on the upload cap,
//     --max-upload, sends no frame to count).
//   - While the pipeline runs (a foreground tensor within bgMaxWait), a background frame goes only
//     into a channel drained to its low mark (RTCConfig.LowBuffered, not MaxBuffered), so that a
//     foreground frame that comes next finds at most that ahead of it; when it does not, as fast
//     as a foreground one (a channel kept at the low mark moved 205–235 MB/s on loopback against
//     232–273 at MaxBuffered in one run, within another run's noise; but a WAN link's
//     bandwidth-delay product can pass LowBuffered).
func background(k proto.Kind) bool {
	return k == proto.KindState || k == proto.KindOuterDelta || k == proto.KindOuterSig
}

// bgShare is how many foreground frames a background frame lets pass before it goes.
const bgShare = 4

// bgMaxWait is the longest a background frame waits for its turn.
const bgMaxWait = 250 * time.Millisecond

// foreground is the foreground traffic of a transport's links (see background).
type foreground struct {
	mu sync.Mutex
	n  int // foreground tensors being sent
	// blocked are those of them waiting for their link's back-pressure (held).
	blocked int
	frames  uint64    // foreground frames sent
	bgAt    uint64    // frames when the last background frame was sent
	last    time.Time // when the last foreground tensor was sent
	// wake is closed, and dropped, when n falls to zero or a foreground frame is sent; nil
	// until a background frame waits.
	wake chan struct{}
}

// notify wakes the background frames that wait (mu held).
func (f *foreground) notify() {
	if f.wake != nil {
		close(f.wake)
		f.wake = nil
	}
}

func (f *foreground) enter() {
	f.mu.Lock()
	f.n++
	f.mu.Unlock()
}

func (f *foreground) leave() {
	f.mu.Lock()
	if f.n--; f.n == 0 {
		f.last = time.Now()
		f.notify()
	}
	f.mu.Unlock()
}

// sent counts a frame handed to a link, foreground or background.
func (f *foreground) sent(bg bool) {
	f.mu.Lock()
	if bg {
		f.bgAt = f.frames
	} else {
		f.frames++
		f.notify()
	}
	f.mu.Unlock()
}

// held marks a tensor of kind k as held by its link's back-pressure until the function it
// returns is called: a foreground one then does not hold background frames back on the other
// links — its neighbour's path is full, not necessarily the uplink — which would otherwise trickle
// (a delayed outer step's exchange beside a pipeline with one slow neighbour).
func (f *foreground) held(k proto.Kind) func() {
	if background(k) {
		return func() {}
	}
	f.mu.Lock()
	f.blocked++
	f.notify()
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		f.blocked--
		f.mu.Unlock()
	}
}

// mayGo reports whether a background frame may go now: no foreground tensor is being sent (but
// those held by back-pressure), or bgShare foreground frames went since the last background one.
// Otherwise it returns a channel closed when that may have changed.
func (f *foreground) mayGo() (bool, <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n == f.blocked || f.frames-f.bgAt >= bgShare {
		return true, nil
	}
	if f.wake == nil {
		f.wake = make(chan struct{})
	}
	return false, f.wake
}

// quiet reports whether no foreground tensor has been sent for bgMaxWait: the pipeline is not
// running (an outer exchange without a delay, a grow's handover that holds everyone), and a
// background frame may fill the channel to MaxBuffered, as fast as a foreground one.
func (f *foreground) quiet() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n == 0 && time.Since(f.last) >= bgMaxWait
}

// sendChunk sends frame i of tn once the channel has room; a background frame (bg) once the
// link's foreground pauses too (see background).
func (p *rtcPeer) sendChunk(ctx context.Context, tn proto.Tensor, i int, bg bool) error {
	var waited <-chan time.Time
	for {
		for bg {
			ok, wake := p.t.fg.mayGo()
			if ok {
				break
			}
			if waited == nil {
				t := time.NewTimer(bgMaxWait)
				defer t.Stop()
				waited = t.C
			}
			select {
			case <-wake:
			case <-waited:
				bg = false // waited long enough: this frame goes as a foreground one would
			case <-p.done:
				return p.failure()
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		select {
		case p.sendSem <- struct{}{}:
		case <-p.done:
			return p.failure()
		case <-ctx.Done():
			return ctx.Err()
		}
		if bg {
			if ok, _ := p.t.fg.mayGo(); !ok {
				<-p.sendSem // a foreground tensor came meanwhile: it goes first
				continue
			}
		}
		break
	}
	defer func() { <-p.sendSem }()
	high := p.t.cfg.MaxBuffered
	if bg && !p.t.fg.quiet() {
		high = p.t.cfg.LowBuffered
	}
	if l := p.link.Load(); l != nil {
		return l.sendChunk(ctx, tn, i, high)
	}
	// The low event fires when the amount falls from above the low mark to it, so a token
	// from before this wait only costs one more look at the amount.
	if p.dc.BufferedAmount() > uint64(high) {
		defer p.t.fg.held(tn.Key.Kind)()
	}
	for p.dc.BufferedAmount() > uint64(high) {
		select {
		case <-p.low:
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
	var err error
	if p.buf, err = proto.AppendChunk(p.buf[:0], tn, i, p.t.cfg.Limits); err != nil {
		return err // the tensor is bad, not the link
	}
	if err := p.t.cfg.Uplink.wait(ctx, len(p.buf)); err != nil {
		return err
	}
	if err := p.write(p.buf, false); err != nil {
		return err
	}
	p.dcFrames.Add(1)
	p.handed(tn.Key.Kind)
	return nil
}

// handed counts a frame of kind k handed to the link (data channel or QUIC), sendSem held: in
// the transport's classes by its kind — a background frame that waited out its turn too — and
// for a test watching (frameSent).
func (p *rtcPeer) handed(k proto.Kind) {
	p.t.fg.sent(background(k))
	if f := p.t.frameSent; f != nil {
		f(k)
	}
}

// write hands one message to the data channel, which copies it.
func (p *rtcPeer) write(b []byte, text bool) error {
	var err error
	if text {
		err = p.dc.SendText(string(b))
	} else {
		err = p.dc.Send(b)
	}
	if err != nil {
		if f := p.failure(); f != nil {
			return f
		}
		p.fail(fmt.Errorf("%w: data channel send: %w", ErrPeerGone, err))
		return p.failure()
	}
	if n := p.dc.BufferedAmount(); n > p.peakBuf.Load() {
		p.peakBuf.Store(n) // only sendSem's holder stores
	}
	return nil
}

// Recv returns the tensor named key once it has arrived from any neighbour; ctx bounds the wait.
// While a neighbour is failed (see RTCTransport), Recv returns a tensor that has already arrived,
// and otherwise fails at once with the *PeerError, instead of waiting for a tensor that may never
// come; a failure while Recv waits ends the wait the same way.
func (t *RTCTransport) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	t.mu.Lock()
	failCtx := t.failCtx
	t.mu.Unlock()
	if failCtx.Err() != nil {
		ended, cancel := context.WithCancel(ctx)
		cancel() // the Mailbox then hands over what it holds and waits for nothing
		if tn, err := t.box.Recv(ended, key); err == nil {
			return tn, nil
		} else if errors.Is(err, ErrClosed) {
			return proto.Tensor{}, err
		}
		return proto.Tensor{}, fmt.Errorf("receive %v: %w", key, context.Cause(failCtx))
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(failCtx, cancel)
	defer stop()
	tn, err := t.box.Recv(rctx, key)
	if err != nil && ctx.Err() == nil && failCtx.Err() != nil {
		return proto.Tensor{}, fmt.Errorf("receive %v: %w", key, context.Cause(failCtx))
	}
	return tn, err
}

// Err returns the first neighbour failure not yet cleared by Disconnect or Connect, or nil.
func (t *RTCTransport) Err() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.failOrder) == 0 {
		return nil
	}
	return t.failed[t.failOrder[0]]
}

// SetPlanVersion moves the transport to plan v: frames and signals of older plans are dropped
// from now on, and tensors of older plans still held are discarded. Versions only move forward.
func (t *RTCTransport) SetPlanVersion(v uint32) {
	t.mu.Lock()
	if v <= t.plan.Load() {
		t.mu.Unlock()
		return
	}
	t.plan.Store(v)
	peers := t.peerList()
	t.mu.Unlock()
	for _, p := range peers {
		p.recvMu.Lock()
		p.reasm.SetPlanVersion(v)
		p.recvMu.Unlock()
	}
	t.box.Discard(func(k proto.TensorKey) bool { return k.PlanVersion < v })
}

// Discard drops the tensors whose keys match, whole or still missing chunks, from every
// neighbour: the leftovers of an abandoned step. It returns how many it dropped.
func (t *RTCTransport) Discard(match func(proto.TensorKey) bool) int {
	t.mu.Lock()
	peers := t.peerList()
	t.mu.Unlock()
	n := t.box.Discard(match)
	for _, p := range peers {
		p.recvMu.Lock()
		n += p.reasm.Discard(match)
		p.recvMu.Unlock()
	}
	return n
}

func (t *RTCTransport) peerList() []*rtcPeer {
	ps := make([]*rtcPeer, 0, len(t.peers))
	for _, p := range t.peers {
		ps = append(ps, p)
	}
	return ps
}

// Close closes every connection, fails pending and later calls with ErrClosed, and returns once
// the goroutines of the transport and of its connections have ended.
func (t *RTCTransport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	peers := t.peerList()
	t.peers = map[string]*rtcPeer{}
	t.mu.Unlock()
	t.box.Close(fmt.Errorf("rtc transport %s: %w", t.id, ErrClosed))
	var wg sync.WaitGroup
	for _, p := range peers {
		wg.Go(p.shutdown)
	}
	wg.Wait()
	t.cancel()
	t.wg.Wait()
	if t.quic != nil {
		t.quic.close()
	}
	return nil
}

// Links is Link of every neighbour this transport has a working connection to.
func (t *RTCTransport) Links() map[string]string {
	t.mu.Lock()
	ids := make([]string, 0, len(t.peers))
	for id := range t.peers {
		ids = append(ids, id)
	}
	t.mu.Unlock()
	m := make(map[string]string, len(ids))
	for _, id := range ids {
		if l := t.Link(id); l != "" {
			m[id] = l
		}
	}
	return m
}

// Link is how frames travel to a neighbour: "quic" once a QUIC link carries them,
// "datachannel" while the data channel does, "" without a working connection.
func (t *RTCTransport) Link(peer string) string {
	t.mu.Lock()
	p := t.peers[peer]
	t.mu.Unlock()
	switch {
	case p == nil || p.failure() != nil:
		return ""
	case p.link.Load() != nil:
		return "quic"
	}
	select {
	case <-p.open:
		return "datachannel"
	default:
		return ""
	}
}

// sendRaw puts b on the channel to peer as it is, for tests that play a broken peer.
func (t *RTCTransport) sendRaw(to string, b []byte, text bool) error {
	t.mu.Lock()
	p := t.peers[to]
	t.mu.Unlock()
	if p == nil {
		return ErrNotConnected
	}
	p.sendSem <- struct{}{}
	defer func() { <-p.sendSem }()
	return p.write(b, text)
}
