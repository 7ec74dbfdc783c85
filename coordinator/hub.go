package coordinator

// The hub: the coordinator's end of the /ws control connections (docs/design.md, "Wire" and
// "Faults"). It admits workers (hello, welcome), relays signaling and relay-fallback frames
// between them without involving the job loop, keeps them alive with heartbeats, drops those that
// break the protocol, go silent or cannot keep up, and reports joins, messages and departures to
// the job loop as Events.

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/proto"
	"golang.org/x/time/rate"
)

// The reasons a worker leaves, carried (wrapped) by the Err of its EventLeft. They live here
// rather than in an errors.go because the hub is their only source.
var (
	// ErrWorkerLeft means the worker said Bye: it left on purpose (drained, Stop pressed).
	ErrWorkerLeft = errors.New("worker left on purpose")
	// ErrHeartbeatTimeout means nothing was heard from the worker for HubConfig.HeartbeatTimeout.
	ErrHeartbeatTimeout = errors.New("worker silent past the heartbeat timeout")
	// ErrProtocol means the worker sent something a correct worker never sends: a malformed,
	// oversized or unknown-version message, a message type only the coordinator sends, a second
	// hello, a garbage binary message. The error also wraps the proto error that says what.
	ErrProtocol = errors.New("worker broke the control protocol")
	// ErrSlowWorker means the worker's send queue was full (it does not read fast enough), or it
	// sent more messages than the job loop has handled by far.
	ErrSlowWorker = errors.New("worker cannot keep up")
	// ErrDisconnected means the connection closed or failed without a Bye.
	ErrDisconnected = errors.New("worker connection lost")
	// ErrDropped means the coordinator dropped the worker with Hub.Drop; it wraps the reason given.
	ErrDropped = errors.New("dropped by the coordinator")
	// ErrHubClosed is returned by Send after Close, and is the reason of the workers Close drops.
	ErrHubClosed = errors.New("hub closed")
	// ErrUnknownWorker is returned by Send and SendTensor for an id that is not connected (never
	// was, or has left or is being dropped).
	ErrUnknownWorker = errors.New("worker not connected")
	// ErrHubFull refuses a join past HubConfig.MaxWorkers or MaxWorkersPerAddr.
	ErrHubFull = errors.New("coordinator full")
	// ErrNotLinked refuses a signal or relayed frame between two workers that are not neighbours
	// under the active plan: only the plan's links carry traffic between workers.
	ErrNotLinked = errors.New("not neighbours under the active plan")
)

// HubConfig configures a Hub. Zero fields take the defaults in their docs.
type HubConfig struct {
	// HeartbeatInterval is how often workers send heartbeats (sent to them in Welcome, in whole
	// milliseconds, at least 1). Default 1s.
	HeartbeatInterval time.Duration
	// HeartbeatTimeout is the silence after which a worker is dropped. Default 5 intervals. It
	// also bounds a write to the worker's socket, and half of it the wait of a relayed frame for
	// room in the receiver's queue.
	HeartbeatTimeout time.Duration
	// QuickTimeout is the silence after which a worker the job is waiting on (Hasten) is dropped:
	// the workers of a plan while every replica waits on every other (an outer exchange, a round's
	// end, a step-mode step), which a vanished one stalls until it is noticed. Default 2 intervals
	// — one heartbeat late by a whole interval — but never less than 2s nor more than
	// HeartbeatTimeout; for each worker at least twice its longest silence lately (noteGap).
	QuickTimeout time.Duration
	// HelloTimeout bounds the wait for a new connection's first message, which must be a Hello.
	// Default 10s.
	HelloTimeout time.Duration
	// MaxMessageBytes bounds a control (text) message. Default proto.MaxMessageSize, which is
	// also the most DecodeMessage accepts. Binary messages are bounded by proto.MaxBinarySize
	// (one 64 KiB frame and its envelope) whatever this says: the frame format fixes it.
	MaxMessageBytes int64
	// SendQueue is how many outgoing messages may wait for a worker's socket; a worker whose
	// queue is full is dropped as too slow (ErrSlowWorker). Default 256: with relayed 64 KiB
	// frames, 16 MiB held per worker at most.
	SendQueue int
	// ICEServers, Loopback and ICERelayOnly are copied into every Welcome.
	ICEServers   []proto.ICEServer
	Loopback     bool
	ICERelayOnly bool
	// Credentials, when set, is the ICE server added to worker id's Welcome alone (the
	// coordinator's TURN server with a credential of its own, turn.go).
	Credentials func(id string) proto.ICEServer
	// Departed, when set, is told of every worker that leaves, unless its id is taken over by a
	// new connection of the same worker: it revokes what Credentials gave. It is called with the
	// hub's lock held, after the worker is no longer Connected, and must not call the hub.
	Departed func(id string)
	// Logger receives joins, departures and protocol violations; nil discards them.
	Logger *slog.Logger
	// Now is the clock of the heartbeat bookkeeping (last heard, the timeout check); tests
	// inject one. The check itself runs every HeartbeatInterval of real time (a quarter of it
	// while some worker is hastened). Default time.Now.
	Now func() time.Time

	// Admit decides, after a valid Hello (and the proof of its key) and before anything is
	// registered or recorded, whether the worker may join at all (a private job's join token, a
	// ban of its identity or address); a non-nil Error is sent to it and the connection closed.
	// addr is its remote address as the hub groups them (an IPv4 address, an IPv6 /64);
	// rejoin says it presented its id's current session credential (a worker reconnecting).
	// Nil admits everyone.
	Admit func(h *proto.Hello, addr string, rejoin bool) *proto.Error
	// Sessions keeps the digests of the workers' session credentials beyond the hub's memory
	// (a coordinator restart), so that a worker rejoins under its id. Nil: memory only.
	Sessions SessionStore
	// MaxWorkers caps the connected workers in all, and MaxWorkersPerAddr those from one remote
	// IP address: joins past either are refused with Error{busy}, before anything is recorded.
	// Defaults DefaultMaxWorkers and DefaultMaxWorkersPerAddr.
	MaxWorkers, MaxWorkersPerAddr int
	// JoinRate is how many joins per second one address (an IPv4 address, an IPv6 /64) may make
	// on average, and JoinBurst how many at once; a join past it is refused with Error{busy}
	// before its hello is read, and the worker retries later. A flood of joins from one address
	// (a sybil wave) then costs the coordinator a refusal each, no row and no replan. Defaults
	// DefaultJoinRate and MaxWorkersPerAddr (at least its default): a NAT's whole allowance of
	// workers may join at once.
	JoinRate  float64
	JoinBurst int
	// SignalRate is how many signals per second one worker may send on average, SignalBurst how
	// many at once; signals past it are dropped (an ICE exchange is a few dozen). Defaults 50, 200.
	SignalRate  float64
	SignalBurst int
	// RelayBytesPerS bounds the frame bytes per second one worker may relay through the hub on
	// average (a burst of 16 MiB allowed); frames past it wait, which slows the sender through
	// TCP like a congested link. Default 256 MiB/s.
	RelayBytesPerS float64
}

// Defaults of HubConfig.MaxWorkers and MaxWorkersPerAddr (shoal serve --max-workers,
// --max-workers-per-ip). One address may be a university's NAT, so its cap is generous; each
// worker costs the coordinator a goroutine pair, a send queue and a row.
const (
	DefaultMaxWorkers        = 1024
	DefaultMaxWorkersPerAddr = 64
)

// DefaultJoinRate is HubConfig.JoinRate's default: two joins a second from one address, beyond
// its burst, which is many reconnections of honest workers and few of a sybil's.
const DefaultJoinRate = 2

// maxJoinAddrs bounds the addresses whose join rate the hub remembers; past it, those whose
// bucket has refilled are forgotten first, then any. An attacker with that many addresses gets a
// fresh burst for some of them, no more.
const maxJoinAddrs = 1 << 14

// SessionStore persists session credential digests (storage.DB implements it).
type SessionStore interface {
	SessionHash(ctx context.Context, id string) ([]byte, error)
	SetSession(ctx context.Context, id string, hash []byte) error
	// KnownWorker reports whether id was ever given to a worker (a session or a worker row):
	// such an id is granted only with its credential.
	KnownWorker(ctx context.Context, id string) (bool, error)
}

const (
	defaultHeartbeatInterval = time.Second
	defaultHelloTimeout      = 10 * time.Second
	defaultSendQueue         = 256
	// maxPendingEvents bounds the Message events of one worker that the job loop has not received
	// yet. The event queue is unbounded so that a busy job loop never stalls a reader (which would
	// stall its heartbeats and get the worker dropped); this bound keeps a flooding worker from
	// turning that into unbounded memory. A correct worker sends a few messages per step.
	maxPendingEvents = 1024
	// finalWriteTimeout bounds the write of the Error or Bye that precedes a close: it is small,
	// and a peer that cannot take it in a second is not reading.
	finalWriteTimeout = time.Second
	// minQuickTimeout bounds the default QuickTimeout from below: a loaded machine (or a browser
	// that runs timers at most once a second in a background tab) may send a beat late by a
	// second, and a worker dropped so during an exchange costs a redo as a real departure does.
	minQuickTimeout = 2 * time.Second
	// quickTicks is how many times per heartbeat interval the sweep checks while some worker is
	// hastened: the timeout is noticed within a quarter interval of passing, not a whole one.
	quickTicks = 4
)

func (c HubConfig) withDefaults() HubConfig {
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = defaultHeartbeatInterval
	}
	// Welcome carries whole milliseconds; the hub checks on the same interval the workers use.
	c.HeartbeatInterval = max(c.HeartbeatInterval.Round(time.Millisecond), time.Millisecond)
	if c.HeartbeatTimeout <= 0 {
		c.HeartbeatTimeout = 5 * c.HeartbeatInterval
	}
	if c.QuickTimeout <= 0 {
		c.QuickTimeout = max(2*c.HeartbeatInterval, minQuickTimeout)
	}
	c.QuickTimeout = min(c.QuickTimeout, c.HeartbeatTimeout)
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = defaultHelloTimeout
	}
	if c.MaxMessageBytes <= 0 {
		c.MaxMessageBytes = proto.MaxMessageSize
	}
	if c.SendQueue <= 0 {
		c.SendQueue = defaultSendQueue
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.MaxWorkers <= 0 {
		c.MaxWorkers = DefaultMaxWorkers
	}
	if c.MaxWorkersPerAddr <= 0 {
		c.MaxWorkersPerAddr = DefaultMaxWorkersPerAddr
	}
	if c.JoinRate <= 0 {
		c.JoinRate = DefaultJoinRate
	}
	if c.JoinBurst <= 0 {
		c.JoinBurst = max(c.MaxWorkersPerAddr, DefaultMaxWorkersPerAddr)
	}
	if c.SignalRate <= 0 {
		c.SignalRate = 50
	}
	if c.SignalBurst <= 0 {
		c.SignalBurst = 200
	}
	if c.RelayBytesPerS <= 0 {
		c.RelayBytesPerS = 256 << 20
	}
	return c
}

// EventKind says what an Event reports.
type EventKind uint8

const (
	// EventJoined: a worker was welcomed. Hello is what it said about itself.
	EventJoined EventKind = 1 + iota
	// EventMessage: a worker sent a control message for the job loop (Ready, StepReport, Error;
	// never Hello, Heartbeat, Signal or Bye, which the hub handles itself).
	EventMessage
	// EventLeft: a worker is gone, and Err says why (wrapping ErrWorkerLeft, ErrHeartbeatTimeout,
	// ErrProtocol, ErrSlowWorker, ErrDisconnected, ErrDropped or ErrHubClosed).
	EventLeft
)

func (k EventKind) String() string {
	switch k {
	case EventJoined:
		return "joined"
	case EventMessage:
		return "message"
	case EventLeft:
		return "left"
	}
	return fmt.Sprintf("event(%d)", uint8(k))
}

// Event is something the job loop must know about a worker. For each worker id, events arrive in
// order: one EventJoined, its EventMessages, one EventLeft; a worker that rejoins with its old id
// starts a new such sequence after its EventLeft.
type Event struct {
	Kind   EventKind
	Worker string
	Hello  *proto.Hello // EventJoined; shared with Workers(), do not modify
	// Addr is the worker's remote address as the hub groups them (an IPv4 address, an IPv6
	// /64); EventJoined only.
	Addr string
	Msg  proto.Message // EventMessage
	Err  error         // EventLeft
}

// WorkerInfo is a snapshot of a connected worker, for status pages and metrics.
type WorkerInfo struct {
	ID        string
	Hello     *proto.Hello // do not modify
	Joined    time.Time
	LastHeard time.Time // by HubConfig.Now
	// BytesIn and BytesOut count the WebSocket message payloads read from and written to it.
	BytesIn, BytesOut int64
	// RelaySent and RelayReceived count the frame bytes it sent to and received from other
	// workers through the hub: non-zero means some neighbour link fell back to the relay.
	RelaySent, RelayReceived int64
}

// Hub accepts and serves the workers' control connections. Mount it at /ws.
//
// Each connection has two goroutines: the ServeHTTP call itself reads, and a writer owns every
// write to the socket; everyone else (Send, relays, heartbeat answers, Drop) hands the writer
// messages through the connection's bounded queue. The registry of connected workers is a map
// under a mutex rather than the state of one goroutine: it only maps ids to connections, every
// lock is a lookup or an insert/delete without I/O, and routing a relayed frame through another
// goroutine would add a hop to every frame of the relay fallback. One goroutine of the hub's
// (sweep) drops the workers gone silent, for all of them.
//
// A heartbeat costs the hub no lock, no store write and no fan-out: the reader notes when it
// heard the worker (an atomic), recognises the heartbeat as workers encode it (heartbeat.go)
// and queues its ack, which the writer writes (make scale: 10,000 workers, a beat a second).
type Hub struct {
	cfg HubConfig
	log *slog.Logger

	// ctx ends at Close; it bounds connections still in their hello and the event pump.
	ctx    context.Context
	cancel context.CancelFunc
	// wg counts ServeHTTP calls, writers and the event pump, so that Close returns only when
	// every goroutine of the hub has exited.
	wg sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	workers map[string]*hubConn
	perAddr map[string]int // connected workers by remote IP
	// joins are the join rate limiters of the addresses that joined lately (JoinRate).
	joins map[string]*rate.Limiter
	// bySession maps the digest of each connected worker's credential to it (SessionWorker).
	bySession map[[32]byte]*hubConn
	// sess maps worker ids to the digest of their current session credential: connected
	// workers, and those that left (bounded by maxRememberedSessions; Sessions keeps the rest).
	sess map[string][32]byte

	// hastened are the workers whose silence is noticed after QuickTimeout (Hasten); nil: none.
	hastened map[string]bool

	// links are the pairs of workers that may signal and relay to each other: the neighbours of
	// the active plan (SetLinks). Nil: nobody.
	links atomic.Pointer[planLinks]

	events chan Event
	queue  eventQueue

	// observeAck, when set (tests, before the first connection), is told of every heartbeat
	// answered: the time from the heartbeat read to its ack written, and the part of it the ack
	// waited in the send queue for the writer.
	observeAck func(handled, queued time.Duration)
}

// NewHub returns a hub serving no workers yet.
func NewHub(cfg HubConfig) *Hub {
	cfg = cfg.withDefaults()
	h := &Hub{
		cfg:       cfg,
		log:       cfg.Logger,
		workers:   make(map[string]*hubConn),
		perAddr:   make(map[string]int),
		joins:     make(map[string]*rate.Limiter),
		bySession: make(map[[32]byte]*hubConn),
		sess:      make(map[string][32]byte),
		events:    make(chan Event),
		queue:     eventQueue{ready: make(chan struct{}, 1)},
	}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	h.wg.Add(2)
	go h.pump()
	go h.sweep()
	return h
}

// sweep drops the workers silent past the heartbeat timeout, and those hastened (Hasten) past the
// quick timeout, checking every heartbeat interval — every quarter of one while any worker is
// hastened. One goroutine checks them all: a ticker per connection woke as many goroutines a
// second as there are workers, as many wake-ups again as their heartbeats (make scale).
func (h *Hub) sweep() {
	defer h.wg.Done()
	every := h.cfg.HeartbeatInterval / quickTicks
	tick := time.NewTicker(every)
	defer tick.Stop()
	var silent []*hubConn
	var limits []time.Duration
	last, skipped := time.Now(), false
	for n := 0; ; n++ {
		select {
		case <-h.ctx.Done():
			return
		case <-tick.C:
		}
		// A tick this late means the coordinator itself was held off the CPU (a loaded machine,
		// a long pause): its readers have not read what the workers sent meanwhile either, so
		// their silence is the coordinator's. Judge nobody until they have had a tick to catch
		// up — one tick only: on a coordinator late at every tick, silent workers must still go.
		// (Real time: a test's clock jumps.)
		t := time.Now()
		late := t.Sub(last) > 2*every
		last = t
		if late && !skipped {
			skipped = true
			continue
		}
		skipped = false
		now := h.cfg.Now().UnixNano()
		h.mu.Lock()
		if len(h.hastened) == 0 && n%quickTicks != 0 {
			h.mu.Unlock()
			continue
		}
		for _, c := range h.workers {
			limit := h.cfg.HeartbeatTimeout
			if h.hastened[c.id] {
				limit = min(max(h.cfg.QuickTimeout, 2*time.Duration(c.gap.Load())), limit)
			}
			if now-c.lastHeard.Load() > int64(limit) {
				silent, limits = append(silent, c), append(limits, limit)
			}
		}
		h.mu.Unlock()
		for i, c := range silent {
			silent[i] = nil
			d, limit := time.Duration(now-c.lastHeard.Load()), limits[i]
			if d <= limit {
				continue // heard from meanwhile
			}
			err := fmt.Errorf("%w: nothing heard for %v (timeout %v)", ErrHeartbeatTimeout, d.Round(time.Millisecond), limit)
			// No handshake: a silent peer would not answer it either.
			c.dropWith(err, &proto.Error{Code: proto.ErrCodeProtocol, Message: errorText(err)}, 0, false)
		}
		silent, limits = silent[:0], limits[:0]
	}
}

// Hasten makes ids the workers whose silence is noticed after HubConfig.QuickTimeout rather than
// the heartbeat timeout, in place of those before; none after Hasten(nil). The job hastens its
// plan's workers while every one of them waits for every other (jobRun.hastenWaited), where a
// machine that vanished without closing its links (a laptop's lid, a network gone) held the whole
// fleet for the heartbeat timeout, and at fleet scale a departure every few seconds made those
// waits cascade (docs/benchmarks.md). A worker that closes its links is noticed at once either way.
func (h *Hub) Hasten(ids []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(ids) == 0 {
		h.hastened = nil
		return
	}
	h.hastened = make(map[string]bool, len(ids))
	for _, id := range ids {
		h.hastened[id] = true
	}
}

// Events returns the hub's events, for one consumer (the job loop). The queue behind it is
// unbounded, so a slow consumer never stalls a connection (see maxPendingEvents for the bound on
// a flooding worker). The channel is never closed; after Close nothing more is delivered and the
// events not yet received are discarded.
func (h *Hub) Events() <-chan Event { return h.events }

// ServeHTTP upgrades a request to a worker's control connection and serves it until it closes.
// Browsers may connect only from the coordinator's own origin (coder/websocket's default), so
// that no other site can enrol its visitors' browsers as workers.
func (h *Hub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.track() {
		http.Error(w, "coordinator shutting down", http.StatusServiceUnavailable)
		return
	}
	defer h.wg.Done()
	ws, err := websocket.Accept(w, r, nil)
	if err != nil {
		h.log.Info("websocket upgrade refused", "remote", r.RemoteAddr, "err", err)
		return // Accept has written the response
	}
	// The hub enforces its own limits, per message type, after learning the type: an oversized
	// message then gets an Error that says so, which the library's limit (a bare close) would not.
	ws.SetReadLimit(-1)
	if wait, ok := h.allowJoin(remoteKey(r.RemoteAddr)); !ok {
		h.log.Info("join refused: too many from this address", "remote", r.RemoteAddr, "retry_in", wait)
		h.answer(ws, &proto.Error{Code: proto.ErrCodeBusy, Message: fmt.Sprintf(
			"too many joins from this address (at most %g a second, %d at once); retry in %v", h.cfg.JoinRate, h.cfg.JoinBurst, wait.Round(time.Millisecond))},
			websocket.StatusTryAgainLater)
		return
	}
	c := h.admit(ws, r.RemoteAddr)
	if c == nil {
		return
	}
	h.wg.Add(1)
	go c.writeLoop()
	c.drop(c.readLoop())
}

// allowJoin takes a join from addr out of its bucket, or says how long until one is there.
func (h *Hub) allowJoin(addr string) (time.Duration, bool) {
	now := h.cfg.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	l := h.joins[addr]
	if l == nil {
		if len(h.joins) >= maxJoinAddrs {
			for k, o := range h.joins {
				if o.TokensAt(now) >= float64(h.cfg.JoinBurst) {
					delete(h.joins, k)
				}
			}
			for k := range h.joins {
				if len(h.joins) < maxJoinAddrs {
					break
				}
				delete(h.joins, k)
			}
		}
		l = rate.NewLimiter(rate.Limit(h.cfg.JoinRate), h.cfg.JoinBurst)
		h.joins[addr] = l
	}
	r := l.ReserveN(now, 1)
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return d, false
	}
	return 0, true
}

// track counts a ServeHTTP call in wg, unless the hub is closed.
func (h *Hub) track() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false
	}
	h.wg.Add(1)
	return true
}

// admit runs a new connection's handshake: it reads the hello, registers the worker and queues
// its Welcome. On failure it has answered and closed the socket, and returns nil.
func (h *Hub) admit(ws *websocket.Conn, remote string) *hubConn {
	log := h.log.With("remote", remote)
	ctx, cancel := context.WithTimeout(h.ctx, h.cfg.HelloTimeout)
	defer cancel()
	typ, b, err := readLimited(ctx, ws, h.cfg.MaxMessageBytes)
	if err != nil {
		var v *violation
		if errors.As(err, &v) {
			h.refuse(ws, log, v.cause)
			return nil
		}
		// A timeout or a closed socket: the library has closed it, nobody to answer.
		log.Info("no hello", "err", err)
		ws.CloseNow()
		return nil
	}
	if typ != websocket.MessageText {
		h.refuse(ws, log, fmt.Errorf("%w: the first message must be a hello, not a binary message", proto.ErrUnexpectedMessage))
		return nil
	}
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	if err != nil {
		// A *proto.VersionError's text names the side to upgrade; it goes to the worker as is.
		h.refuse(ws, log, err)
		return nil
	}
	hello, ok := m.(*proto.Hello)
	if !ok {
		h.refuse(ws, log, fmt.Errorf("%w: the first message must be a hello, not %s", proto.ErrUnexpectedMessage, m.Type()))
		return nil
	}
	// A claimed key is believed only once its holder has signed a fresh challenge with it:
	// nobody earns, or loses, credit under a key it does not hold.
	if len(hello.SigningKey) != 0 {
		if err := h.prove(ctx, ws, hello.SigningKey); err != nil {
			log.Warn("worker refused: identity not proved", "err", err)
			h.answer(ws, &proto.Error{Code: proto.ErrCodeIdentity, Message: errorText(err)}, websocket.StatusPolicyViolation)
			return nil
		}
	}
	claimed, kind := h.claim(ctx, hello.WorkerID, hello.Session)
	// Admission comes before anything is registered or recorded: a refused worker leaves no
	// row, no event and no replan behind, and can never have a frame relayed.
	if h.cfg.Admit != nil {
		if perr := h.cfg.Admit(hello, remoteKey(remote), kind == claimSession); perr != nil {
			log.Info("worker refused", "code", perr.Code, "err", perr.Message)
			h.answer(ws, perr, websocket.StatusPolicyViolation)
			return nil
		}
	}
	now := h.cfg.Now()
	token, digest := newSession()
	c := &hubConn{
		h:       h,
		ws:      ws,
		hello:   hello,
		joined:  now,
		addr:    remoteKey(remote),
		session: digest,
		out:     make(chan outgoing, h.cfg.SendQueue),
		closing: make(chan struct{}),
		signals: rate.NewLimiter(rate.Limit(h.cfg.SignalRate), h.cfg.SignalBurst),
		relayed: rate.NewLimiter(rate.Limit(h.cfg.RelayBytesPerS), relayBurst),
	}
	c.lastHeard.Store(now.UnixNano())
	c.bytesIn.Store(int64(len(b)))
	old, err := h.register(c, hello.WorkerID, kind, claimed, token)
	if err != nil {
		switch {
		case errors.Is(err, ErrHubClosed):
			ws.Close(websocket.StatusGoingAway, "coordinator shutting down")
		case errors.Is(err, ErrHubFull):
			log.Warn("worker refused", "err", err)
			h.answer(ws, &proto.Error{Code: proto.ErrCodeBusy, Message: errorText(err)}, websocket.StatusTryAgainLater)
		default:
			log.Error("cannot welcome a worker", "err", err)
			h.answer(ws, &proto.Error{Code: proto.ErrCodeInternal, Message: errorText(err)}, websocket.StatusInternalError)
		}
		return nil
	}
	if old != nil {
		// The same worker (it holds the credential) on a new connection: the old one is a
		// half-dead socket it gave up on. It has been unregistered already; close it.
		old.dropWith(fmt.Errorf("%w: superseded by a new session of the same worker", ErrDropped),
			&proto.Bye{Reason: "superseded by a new connection of this worker"}, websocket.StatusNormalClosure, false)
	}
	if h.cfg.Sessions != nil {
		// Before the Welcome goes out (the writer starts after admit), so that the credential a
		// worker holds is always the one a restarted coordinator checks.
		if err := h.cfg.Sessions.SetSession(ctx, c.id, digest[:]); err != nil {
			log.Warn("persist session", "worker", c.id, "err", err)
		}
	}
	if hello.WorkerID != "" && hello.WorkerID != c.id {
		c.log.Info("asked for an id without its session credential; assigned a fresh one", "asked", hello.WorkerID)
	}
	c.log.Info("worker joined", "kind", hello.Kind, "backend", hello.Backend, "gflops", hello.GFLOPS, "name", hello.Name)
	return c
}

// prove challenges the worker to sign a fresh nonce with the private half of key
// (proto.Challenge, proto.Proof), within the hello's deadline (ctx).
func (h *Hub) prove(ctx context.Context, ws *websocket.Conn, key []byte) error {
	nonce := make([]byte, proto.ChallengeBytes)
	rand.Read(nonce)
	b, err := proto.EncodeMessage(&proto.Challenge{Nonce: nonce})
	if err != nil {
		return err
	}
	if err := ws.Write(ctx, websocket.MessageText, b); err != nil {
		return fmt.Errorf("send challenge: %w", err)
	}
	typ, b, err := readLimited(ctx, ws, h.cfg.MaxMessageBytes)
	if err != nil {
		return fmt.Errorf("wait for the identity proof: %w", err)
	}
	if typ != websocket.MessageText {
		return fmt.Errorf("%w: a binary message instead of the identity proof", proto.ErrUnexpectedMessage)
	}
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	if err != nil {
		return err
	}
	p, ok := m.(*proto.Proof)
	if !ok {
		return fmt.Errorf("%w: %s instead of the identity proof", proto.ErrUnexpectedMessage, m.Type())
	}
	if !ed25519.Verify(key, proto.ProofMessage(nonce, key), p.Signature) {
		return errors.New("the signature does not match the key the hello claims")
	}
	return nil
}

// refuse answers a connection that failed its handshake with an Error{protocol} and closes it.
func (h *Hub) refuse(ws *websocket.Conn, log *slog.Logger, cause error) {
	log.Warn("connection refused", "err", cause)
	h.answer(ws, &proto.Error{Code: proto.ErrCodeProtocol, Message: errorText(cause)}, websocket.StatusPolicyViolation)
}

// answer writes m to a connection that has no writer goroutine yet, and closes it.
func (h *Hub) answer(ws *websocket.Conn, m proto.Message, status websocket.StatusCode) {
	ctx, cancel := context.WithTimeout(h.ctx, finalWriteTimeout)
	defer cancel()
	if b, err := proto.EncodeMessage(m); err == nil {
		ws.Write(ctx, websocket.MessageText, b)
	}
	ws.Close(status, "")
}

// register gives c its id and publishes it: the id asked for when claimed (the worker presented
// that id's current credential, or nobody ever had it), a fresh one otherwise. Its Welcome, carrying token, is queued
// first, so that nothing relayed to it can overtake the Welcome, and its EventJoined is queued
// under the registry lock, so that for one id the events of a departing connection and a
// rejoining one cannot interleave. A claimed id that is still connected supersedes that
// connection, which is unregistered here and returned for the caller to close.
func (h *Hub) register(c *hubConn, want string, kind claimKind, claimed [32]byte, token string) (old *hubConn, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, ErrHubClosed
	}
	id := ""
	switch kind {
	case claimSession:
		// The credential is single-use: a second join with it (a replay, or a race with the
		// worker's own reconnect) finds it rotated and gets a fresh id.
		if d, ok := h.sess[want]; !ok || d == claimed {
			id = want
			old = h.workers[want]
		}
	case claimUnused:
		if _, taken := h.sess[want]; !taken && h.workers[want] == nil {
			id = want
		}
	}
	n, fromAddr := len(h.workers), h.perAddr[c.addr]
	if old != nil {
		n--
		if old.addr == c.addr {
			fromAddr--
		}
	}
	switch {
	case n >= h.cfg.MaxWorkers:
		return nil, fmt.Errorf("%w: %d workers connected, the most this coordinator takes", ErrHubFull, n)
	case fromAddr >= h.cfg.MaxWorkersPerAddr:
		return nil, fmt.Errorf("%w: %d workers connected from %s, the most it takes from one address", ErrHubFull, fromAddr, c.addr)
	}
	for id == "" || id != want && h.workers[id] != nil {
		id = newWorkerID()
	}
	c.id = id
	c.log = h.log.With("worker", id)
	ice := h.cfg.ICEServers
	if h.cfg.Credentials != nil {
		ice = append(slices.Clip(ice), h.cfg.Credentials(id))
	}
	welcome, err := proto.EncodeMessage(&proto.Welcome{
		WorkerID:     id,
		HeartbeatMS:  h.cfg.HeartbeatInterval.Milliseconds(),
		ICEServers:   ice,
		Loopback:     h.cfg.Loopback,
		ICERelayOnly: h.cfg.ICERelayOnly,
		Session:      token,
	})
	if err != nil {
		// Only a bad --ice-server gets here; the admin must fix it, the worker cannot.
		return nil, fmt.Errorf("encode welcome: %w", err)
	}
	if old != nil {
		old.superseded = true
		h.removeLocked(old, fmt.Errorf("%w: superseded by a new session of the same worker", ErrDropped))
	}
	c.out <- outgoing{msgs: [][]byte{welcome}} // empty queue: never blocks
	h.workers[id] = c
	h.bySession[c.session] = c
	h.perAddr[c.addr]++
	h.rememberLocked(id, c.session)
	h.queue.push(Event{Kind: EventJoined, Worker: id, Hello: c.hello, Addr: c.addr}, c)
	return old, nil
}

// maxRememberedSessions bounds the credentials the hub keeps in memory for workers that are not
// connected; past it they are forgotten here (Sessions still has them).
const maxRememberedSessions = 4096

func (h *Hub) rememberLocked(id string, d [32]byte) {
	// Every connected worker has an entry; only the others count against the bound, and they
	// are trimmed to half of it at once, so that a join costs O(1) amortised however many
	// workers are connected (the scale test found a scan per join past 4,096 connected).
	if len(h.sess)-len(h.workers) >= maxRememberedSessions {
		left := len(h.sess) - len(h.workers)
		for k := range h.sess {
			if left < maxRememberedSessions/2 {
				break
			}
			if h.workers[k] == nil {
				delete(h.sess, k)
				left--
			}
		}
	}
	h.sess[id] = d
}

// claimKind is what a Hello's claim to an id amounts to.
type claimKind uint8

const (
	claimNone    claimKind = iota // a fresh id is given
	claimSession                  // the worker presented the id's current credential
	claimUnused                   // the id was never given to anyone: it may have it
)

// claim checks a Hello's claim to id. An id that was ever given out (the hub's memory, or
// Sessions after a restart) is granted only with its current credential, compared in constant
// time: that is what stops the takeover of a silent worker's id, its shard and its credit. An id
// nobody ever had may be taken as asked (WorkerConfig.WorkerID: tests and operators name their
// workers); it carries nothing to steal. sum is the credential's digest for claimSession.
func (h *Hub) claim(ctx context.Context, id, token string) (sum [32]byte, kind claimKind) {
	if id == "" {
		return sum, claimNone
	}
	h.mu.Lock()
	d, known := h.sess[id]
	h.mu.Unlock()
	if !known && h.cfg.Sessions != nil {
		if b, err := h.cfg.Sessions.SessionHash(ctx, id); err == nil && len(b) == len(d) {
			copy(d[:], b)
			known = true
		} else if k, err := h.cfg.Sessions.KnownWorker(ctx, id); err != nil || k {
			return sum, claimNone // an id of the store's without a credential, or unknown: not granted
		}
	}
	if !known {
		return sum, claimUnused
	}
	if token == "" {
		return sum, claimNone
	}
	sum = sha256.Sum256([]byte(token))
	if subtle.ConstantTimeCompare(d[:], sum[:]) != 1 {
		return [32]byte{}, claimNone
	}
	return sum, claimSession
}

// newSession returns a fresh credential and its digest (all the hub keeps of it).
func newSession() (string, [32]byte) {
	var b [proto.SessionBytes]byte
	rand.Read(b[:])
	token := base64.RawURLEncoding.EncodeToString(b[:])
	return token, sha256.Sum256([]byte(token))
}

// newWorkerID returns a fresh random id, short enough to read in logs and dashboards; 48 random
// bits make a collision with a worker that could still rejoin negligible.
func newWorkerID() string {
	var b [6]byte
	rand.Read(b[:])
	return "w-" + hex.EncodeToString(b[:])
}

// unregister removes c from the registry (if it is still there: its id may have been taken over
// already) and queues its EventLeft.
func (h *Hub) unregister(c *hubConn, reason error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.removeLocked(c, reason)
}

// removeLocked unregisters c once and queues its EventLeft; h.mu is held.
func (h *Hub) removeLocked(c *hubConn, reason error) {
	if c.removed {
		return
	}
	c.removed = true
	if h.workers[c.id] == c {
		delete(h.workers, c.id)
	}
	if h.bySession[c.session] == c {
		delete(h.bySession, c.session)
	}
	if h.perAddr[c.addr]--; h.perAddr[c.addr] <= 0 {
		delete(h.perAddr, c.addr)
	}
	if h.cfg.Departed != nil && !c.superseded && h.workers[c.id] == nil {
		h.cfg.Departed(c.id)
	}
	h.queue.push(Event{Kind: EventLeft, Worker: c.id, Err: reason}, c)
}

// What a worker's SDPs said of QUIC (hubConn.quic).
const (
	quicUnseen int32 = iota
	quicOffered
	quicRefused
)

// QUICLinks reports whether worker id's links to other native workers move frames over QUIC
// (issue 34), as far as the hub can tell: a browser's never do; a native worker's do when its last
// SDP offered a QUIC certificate; before its first SDP, when native workers open QUIC here by
// default — on loopback, unless every pair is relayed. A worker that turned QUIC off
// (SHOAL_QUIC=0), or opted in beyond loopback (SHOAL_QUIC=1), shows it at its first signal. What
// this believes only sets a bound on the link the planner assumes (dataPlaneBytesPerS): a worker
// that offers QUIC and then refuses it gets slower plans, nothing else.
func (h *Hub) QUICLinks(id string) bool {
	c, err := h.lookup(id)
	if err != nil || c.hello == nil || c.hello.Kind != proto.WorkerNative {
		return false
	}
	switch c.quic.Load() {
	case quicOffered:
		return true
	case quicRefused:
		return false
	}
	return h.cfg.Loopback && !h.cfg.ICERelayOnly
}

func (h *Hub) lookup(id string) (*hubConn, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if c := h.workers[id]; c != nil {
		return c, nil
	}
	if h.closed {
		return nil, ErrHubClosed
	}
	return nil, ErrUnknownWorker
}

// ConnectedFrom reports whether some connected worker's remote address is ip's (an IPv4
// address, an IPv6 /64, as the hub groups them).
func (h *Hub) ConnectedFrom(ip netip.Addr) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.perAddr[ipKey(ip)] > 0
}

// Connected reports whether worker id has a session: false as soon as the hub has dropped it,
// before the job loop reads its EventLeft.
func (h *Hub) Connected(id string) bool {
	_, err := h.lookup(id)
	return err == nil
}

// Send queues a control message for worker id. It fails for an invalid message or one the
// coordinator does not send (before anything is queued), for an unknown worker, and when the
// worker's queue is full, in which case the worker is dropped as too slow. A nil error means
// queued, not delivered.
func (h *Hub) Send(id string, m proto.Message) error {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		return fmt.Errorf("send to %s: %w", id, err)
	}
	// Decoding our own message as the worker will catches a job-loop bug (a StepReport sent to a
	// worker, say) here, instead of as a dropped worker.
	if _, err := proto.DecodeMessage(b, proto.RoleWorker); err != nil {
		return fmt.Errorf("send to %s: %w", id, err)
	}
	c, err := h.lookup(id)
	if err != nil {
		return fmt.Errorf("send %s to %s: %w", m.Type(), id, err)
	}
	if err := c.send(outgoing{msgs: [][]byte{b}}); err != nil {
		return fmt.Errorf("send %s to %s: %w", m.Type(), id, err)
	}
	return nil
}

// SendTensor queues tensor t for worker id as BinDirect frames (the coordinator feeding a
// micro-batch's tokens or targets to an end stage). The frames take one slot of the queue
// together, so a tensor is queued whole or not at all; it is meant for such small tensors, since
// all of its frames are built before the call returns. Errors as Send.
func (h *Hub) SendTensor(id string, t proto.Tensor) error {
	n := t.NumChunks()
	msgs := make([][]byte, n)
	for i := range msgs {
		size := 1 + proto.HeaderSize + min(proto.MaxChunkPayload, len(t.Data)-i*proto.MaxChunkPayload)
		b, err := proto.AppendChunk(append(make([]byte, 0, size), byte(proto.BinDirect)), t, i, proto.Limits{})
		if err != nil {
			return fmt.Errorf("send tensor to %s: %w", id, err)
		}
		msgs[i] = b
	}
	c, err := h.lookup(id)
	if err != nil {
		return fmt.Errorf("send tensor %v to %s: %w", t.Key, id, err)
	}
	if err := c.send(outgoing{msgs: msgs, binary: true}); err != nil {
		return fmt.Errorf("send tensor %v to %s: %w", t.Key, id, err)
	}
	return nil
}

// Drop disconnects worker id: it sends reason as an Error when reason is (or wraps) a
// *proto.Error, an Error{protocol} with reason's text for any other error, and a Bye for nil,
// then closes the connection. The worker's EventLeft follows, its Err wrapping ErrDropped and
// reason. Dropping an unknown worker does nothing.
func (h *Hub) Drop(id string, reason error) {
	c, err := h.lookup(id)
	if err != nil {
		return
	}
	var final proto.Message = &proto.Bye{Reason: "dropped by the coordinator"}
	left := ErrDropped
	if reason != nil {
		var perr *proto.Error
		if errors.As(reason, &perr) {
			final = perr
		} else {
			final = &proto.Error{Code: proto.ErrCodeProtocol, Message: errorText(reason)}
		}
		left = fmt.Errorf("%w: %w", ErrDropped, reason)
	}
	c.dropWith(left, final, websocket.StatusNormalClosure, true)
}

// planLinks is the set of worker pairs that may exchange signals and relayed frames under plan
// version.
type planLinks struct {
	version uint32
	pairs   map[[2]string]bool
}

// SetLinks makes pairs (each allowed both ways) the only workers that may signal each other and
// relay frames to each other, for signals and frames of plan version only. The job loop calls it
// before it sends a plan's assignments, and with no pairs when it abandons a plan.
func (h *Hub) SetLinks(version uint32, pairs [][2]string) {
	l := &planLinks{version: version, pairs: make(map[[2]string]bool, 2*len(pairs))}
	for _, p := range pairs {
		l.pairs[p] = true
		l.pairs[[2]string{p[1], p[0]}] = true
	}
	h.links.Store(l)
}

// AddLinks adds pairs to the links of plan version, if it is the active one: the pairs a stage
// takeover names (takeover.go).
func (h *Hub) AddLinks(version uint32, pairs [][2]string) {
	old := h.links.Load()
	if old == nil || old.version != version || len(pairs) == 0 {
		return
	}
	l := &planLinks{version: version, pairs: maps.Clone(old.pairs)}
	for _, p := range pairs {
		l.pairs[p] = true
		l.pairs[[2]string{p[1], p[0]}] = true
	}
	h.links.Store(l)
}

// linked reports whether a may send to b under the active plan, and that plan's version.
func (h *Hub) linked(a, b string) (uint32, bool) {
	l := h.links.Load()
	if l == nil {
		return 0, false
	}
	return l.version, l.pairs[[2]string{a, b}]
}

// SessionWorker returns the id of the connected worker whose session credential is token (the
// Welcome's Session, as an upload presents it in "Authorization: Bearer"). Credentials of
// workers that have left, or been superseded by a newer Welcome, are not accepted.
func (h *Hub) SessionWorker(token string) (string, bool) {
	if token == "" {
		return "", false
	}
	// A map lookup by the credential's digest: the digest of a 256-bit random secret reveals
	// nothing through timing, and the lookup costs O(1) where a scan of every worker cost 0.4 ms
	// at 10,000 of them, under the hub's lock, for every upload and download.
	sum := sha256.Sum256([]byte(token))
	h.mu.Lock()
	defer h.mu.Unlock()
	if c := h.bySession[sum]; c != nil {
		return c.id, true
	}
	return "", false
}

// Workers returns a snapshot of the connected workers, in the order they joined.
func (h *Hub) Workers() []WorkerInfo {
	h.mu.Lock()
	conns := make([]*hubConn, 0, len(h.workers))
	for _, c := range h.workers {
		conns = append(conns, c)
	}
	h.mu.Unlock()
	out := make([]WorkerInfo, len(conns))
	for i, c := range conns {
		out[i] = WorkerInfo{
			ID: c.id, Hello: c.hello, Joined: c.joined,
			LastHeard: time.Unix(0, c.lastHeard.Load()),
			BytesIn:   c.bytesIn.Load(), BytesOut: c.bytesOut.Load(),
			RelaySent: c.relaySent.Load(), RelayReceived: c.relayReceived.Load(),
		}
	}
	slices.SortFunc(out, func(a, b WorkerInfo) int {
		if c := a.Joined.Compare(b.Joined); c != 0 {
			return c
		}
		return strings.Compare(a.ID, b.ID)
	})
	return out
}

// Close says Bye to every worker, closes every connection (connections still in their hello are
// cut), and returns when every goroutine of the hub has exited. A close handshake waits for the
// peer at most about 10 s (coder/websocket's bound); the workers' EventLeft are not delivered.
func (h *Hub) Close() {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		h.wg.Wait()
		return
	}
	h.closed = true
	conns := make([]*hubConn, 0, len(h.workers))
	for _, c := range h.workers {
		conns = append(conns, c)
	}
	h.mu.Unlock()
	h.cancel()
	for _, c := range conns {
		c.dropWith(ErrHubClosed, &proto.Bye{Reason: "coordinator shutting down"}, websocket.StatusGoingAway, true)
	}
	h.wg.Wait()
}

// pump moves events from the unbounded queue to the Events channel.
func (h *Hub) pump() {
	defer h.wg.Done()
	for {
		it, ok := h.queue.pop(h.ctx.Done())
		if !ok {
			return
		}
		select {
		case h.events <- it.Event:
			if it.Kind == EventMessage {
				it.c.pending.Add(-1)
			}
		case <-h.ctx.Done():
			return
		}
	}
}

// hubConn is one worker's connection.
type hubConn struct {
	h      *Hub
	ws     *websocket.Conn
	id     string
	hello  *proto.Hello
	joined time.Time
	log    *slog.Logger
	// The reader's reads and the writer's writes take no context: a context that can end costs
	// the library a registration per read and per write (context.AfterFunc), and a timeout a
	// timer per write, for every heartbeat (make scale). What a context did is done here
	// instead, by closing the socket, which is what the library does when one ends: the writer
	// closes it when it exits, which ends the reader's read; writeTimer drops the worker (and so
	// closes it) when a write takes longer than a heartbeat timeout; and cancelWrites closes it
	// when a drop without a handshake finds a write in progress (the peer is too slow, silent or
	// gone), so that a write stuck on a peer that does not read ends at once.
	//
	// writeStart is when the write in progress started (ns since monoEpoch; 0: none), and
	// writesCancelled is set by cancelWrites: no queued write starts after it.
	writeStart      atomic.Int64
	writesCancelled atomic.Bool
	writeTimer      *time.Timer // writer only; created at its first write

	out chan outgoing
	// closing is closed by dropWith: from then on nothing is queued, and the writer sends final
	// (if any) and closes the socket.
	closing   chan struct{}
	dropOnce  sync.Once
	final     proto.Message        // written before closing is closed
	status    websocket.StatusCode // likewise
	handshake bool                 // likewise: close with a handshake (the peer is alive) or at once

	lastHeard atomic.Int64 // unix ns by HubConfig.Now
	// gap is the longest silence heard from the worker lately (ns; noteGap): its quick timeout is
	// at least twice that (sweep).
	gap                                         atomic.Int64
	bytesIn, bytesOut, relaySent, relayReceived atomic.Int64
	pending                                     atomic.Int64 // EventMessages queued, not yet received
	// quic is what the worker's last relayed SDP said of QUIC (quicUnseen, quicOffered,
	// quicRefused): whether its links to other native workers move frames over QUIC (QUICLinks).
	quic atomic.Int32

	left bool // EventLeft queued; guarded by the hub's queue.mu

	// session is the sha256 of the credential sent in this connection's Welcome (set before the
	// connection is registered, then read-only); addr its remote IP.
	session [32]byte
	addr    string
	removed bool // unregistered; guarded by the hub's mu
	// superseded: its id was taken over by a new connection of the same worker (register);
	// guarded by the hub's mu.
	superseded bool

	// Rate limits of what the worker asks the hub to forward; reader only.
	signals, relayed *rate.Limiter // on the hub's clock (Config.Now), so tests drive them

	// readAt is when the message being handled was read (nowMicros; 0 unless Hub.observeAck
	// is set); reader only.
	readAt uint32

	refusedRelays map[string]time.Time // when a relay to each unknown target was last refused; reader only
}

// outgoing is one slot of a connection's queue: WebSocket messages of one type, written in order
// (a tensor's frames stay together). A queue holds SendQueue of them per connection, allocated
// when it connects, so the slot is kept to 32 bytes.
type outgoing struct {
	msgs   [][]byte
	binary bool // else text
	// ackRead is, for a heartbeat's ack, when the heartbeat was read (nowMicros; 0 otherwise),
	// for Hub.observeAck.
	ackRead uint32
}

// nowMicros is the clock of outgoing.ackRead: microseconds, modulo 2³² (71 minutes), which
// measures anything shorter exactly by modular subtraction and keeps outgoing small.
func nowMicros() uint32 {
	return uint32(time.Now().UnixNano() / 1e3)
}

// violation marks a reader error as the worker's fault: it is answered with an Error{protocol}.
type violation struct{ cause error }

func (v *violation) Error() string { return v.cause.Error() }
func (v *violation) Unwrap() error { return v.cause }

func violationf(format string, args ...any) error {
	return &violation{cause: fmt.Errorf(format, args...)}
}

// readLimited reads one message of at most limit bytes (text) or proto.MaxBinarySize (binary).
// An oversized message is a *violation; it is not read to its end, since the connection is
// dropped anyway.
func readLimited(ctx context.Context, ws *websocket.Conn, limit int64) (websocket.MessageType, []byte, error) {
	typ, r, err := ws.Reader(ctx)
	if err != nil {
		return 0, nil, err
	}
	b, err := readBody(typ, r, limit, nil)
	return typ, b, err
}

// readBody reads a message of type typ from r into buf (grown as needed) as readLimited does.
func readBody(typ websocket.MessageType, r io.Reader, limit int64, buf []byte) ([]byte, error) {
	sentinel, kind := proto.ErrMessageTooLarge, "text"
	if typ == websocket.MessageBinary {
		limit, sentinel, kind = proto.MaxBinarySize, proto.ErrFrameTooLarge, "binary"
	}
	// io.ReadAll(io.LimitReader(r, limit+1)), into buf.
	b := buf[:0]
	for int64(len(b)) <= limit {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		room := b[len(b):cap(b)]
		if left := limit + 1 - int64(len(b)); int64(len(room)) > left {
			room = room[:left]
		}
		n, err := r.Read(room)
		b = b[:len(b)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return b, err
		}
	}
	if int64(len(b)) > limit {
		return b, violationf("%w: a %s message of more than %d bytes", sentinel, kind, limit)
	}
	return b, nil
}

// readBufs are the reader goroutines' buffers, taken for one message once it has begun to
// arrive: an idle connection holds none, and a heartbeat allocates none.
var readBufs = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// maxPooledRead is the largest buffer kept in readBufs: a relayed frame's (grown by append),
// not a huge control message's.
const maxPooledRead = 128 << 10

// readLoop reads and handles messages until the connection fails or must be dropped, and
// returns why.
func (c *hubConn) readLoop() error {
	for {
		// No context (hubConn.writeStart): the writer closes the socket when it exits.
		typ, r, err := c.ws.Reader(context.Background())
		if err != nil {
			return err
		}
		bp := readBufs.Get().(*[]byte)
		b, err := readBody(typ, r, c.h.cfg.MaxMessageBytes, *bp)
		if err == nil {
			if c.h.observeAck != nil {
				c.readAt = nowMicros()
			}
			now := c.h.cfg.Now().UnixNano()
			c.noteGap(now - c.lastHeard.Swap(now))
			c.bytesIn.Add(int64(len(b)))
			// Nothing the handlers keep refers to b: decoding copies, and relaying re-frames.
			if typ == websocket.MessageBinary {
				err = c.handleBinary(b)
			} else {
				err = c.handleText(b)
			}
		}
		if cap(b) <= maxPooledRead {
			*bp = b[:0]
			readBufs.Put(bp)
		}
		if err != nil {
			return err
		}
	}
}

// errBye ends readLoop after the worker's Bye; drop has already run.
var errBye = errors.New("bye")

func (c *hubConn) handleText(b []byte) error {
	// Heartbeats are most of what the hub reads: one per worker and interval. As a worker
	// encodes them, they are answered without proto's decoder (three JSON passes) and encoder.
	if seq, ok := parseHeartbeat(b); ok {
		return c.ackHeartbeat(seq)
	}
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	if err != nil {
		return &violation{cause: err}
	}
	switch m := m.(type) {
	case *proto.Hello:
		return violationf("%w: a second hello on a joined connection", proto.ErrUnexpectedMessage)
	case *proto.Heartbeat:
		if !m.Ack {
			return c.ackHeartbeat(m.Seq)
		}
		return nil
	case *proto.Signal:
		c.relaySignal(m)
		return nil
	case *proto.Bye:
		c.dropWith(fmt.Errorf("%w: %s", ErrWorkerLeft, m.Reason), nil, websocket.StatusNormalClosure, true)
		return errBye
	}
	if c.pending.Add(1) > maxPendingEvents {
		return fmt.Errorf("%w: %d messages the job loop has not handled yet", ErrSlowWorker, maxPendingEvents)
	}
	c.h.queue.push(Event{Kind: EventMessage, Worker: c.id, Msg: m}, c)
	return nil
}

// relaySignal forwards a Signal to its To worker as coming from this connection's worker,
// whatever its From said (proto.Signal). An unknown target is refused back to the sender, not
// held against it: the target may just have left.
func (c *hubConn) relaySignal(m *proto.Signal) {
	m.From = c.id
	if !c.signals.AllowN(c.h.cfg.Now(), 1) {
		c.refuseRelay(m.To, fmt.Errorf("more than %v signals per second", c.h.cfg.SignalRate))
		return
	}
	// Only neighbours of the active plan signal each other: anyone else would get a peer's SDP
	// and candidates (its addresses, once STUN is on) and a data channel into its mailbox.
	if v, ok := c.h.linked(c.id, m.To); !ok || m.PlanVersion != v {
		c.refuseRelay(m.To, fmt.Errorf("signal for plan %d: %w", m.PlanVersion, ErrNotLinked))
		return
	}
	dst, err := c.h.lookup(m.To)
	if err == nil && dst == c {
		err = errors.New("a worker does not signal itself")
	}
	if err != nil {
		c.log.Warn("signal refused", "to", m.To, "err", err)
		c.refuseBack(fmt.Sprintf("signal to %s refused: %v", m.To, err))
		return
	}
	if m.SDP != nil {
		v := quicRefused
		if m.QUIC != "" {
			v = quicOffered
		}
		c.quic.Store(v)
	}
	b, err := proto.EncodeMessage(m)
	if err != nil { // cannot happen: it decoded, and From != To
		c.refuseBack(fmt.Sprintf("signal to %s refused: %v", m.To, err))
		return
	}
	if err := dst.send(outgoing{msgs: [][]byte{b}}); err != nil {
		c.log.Info("signal not delivered", "to", m.To, "err", err)
	}
}

// refuseBack tells the worker that a message of its was not delivered, without dropping it. The
// refusal is advisory: it is skipped rather than queued on a full queue, so that a burst of frames
// for a worker that has just left cannot get their sender dropped as slow too.
func (c *hubConn) refuseBack(text string) {
	b, err := proto.EncodeMessage(&proto.Error{Code: proto.ErrCodeProtocol, Message: text})
	if err != nil {
		return
	}
	select {
	case <-c.closing:
	case c.out <- outgoing{msgs: [][]byte{b}}:
	default:
	}
}

// refuseRelay refuses a relayed frame back to its sender, once per target and heartbeat interval:
// a tensor is many frames, and one refusal says it all.
func (c *hubConn) refuseRelay(to string, err error) {
	now := c.h.cfg.Now()
	if last, ok := c.refusedRelays[to]; ok && now.Sub(last) < c.h.cfg.HeartbeatInterval {
		return
	}
	if c.refusedRelays == nil || len(c.refusedRelays) >= 64 { // bounded, whatever ids it tries
		c.refusedRelays = make(map[string]time.Time)
	}
	c.refusedRelays[to] = now
	c.log.Debug("relay refused", "to", to, "err", err)
	c.refuseBack(fmt.Sprintf("relay to %s refused: %v", to, err))
}

func (c *hubConn) handleBinary(b []byte) error {
	kind, to, frame, err := proto.DecodeBinary(b)
	if err != nil {
		return &violation{cause: err}
	}
	if kind != proto.BinRelay {
		return violationf("%w: a worker sends only relay frames, not %v frames", proto.ErrUnexpectedMessage, kind)
	}
	// Decoding the frame here costs a pass over 64 KiB, and it blames garbage on its sender
	// instead of on the worker it would have reached.
	f, err := proto.DecodeFrame(frame, proto.Limits{})
	if err != nil {
		return &violation{cause: fmt.Errorf("relay to %s: %w", to, err)}
	}
	// Only the plan's links carry frames, and only the plan's: a standby, a refused or a former
	// participant cannot put a tensor into a stage's mailbox. The frame is dropped, not held
	// against the sender: a participant's last frames of an abandoned plan land here too.
	if v, ok := c.h.linked(c.id, to); !ok || f.Header.PlanVersion != v {
		c.refuseRelay(to, fmt.Errorf("frame of plan %d: %w", f.Header.PlanVersion, ErrNotLinked))
		return nil
	}
	// Past its rate the sender waits, as on a congested link; its reader, and so its socket,
	// stalls meanwhile, which is the back-pressure TCP gives it.
	// A frame (at most proto.MaxFrameSize) is far below relayBurst, so the reservation is always
	// granted; only its delay matters.
	now := c.h.cfg.Now()
	if wait := c.relayed.ReserveN(now, len(frame)).DelayFrom(now); wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-c.closing:
			t.Stop()
			return nil
		}
	}
	dst, err := c.h.lookup(to)
	if err == nil && dst == c {
		err = errors.New("a worker does not relay to itself")
	}
	if err != nil {
		c.refuseRelay(to, err)
		return nil
	}
	msg, err := proto.AppendRelay(make([]byte, 0, 2+len(c.id)+len(frame)), c.id, frame)
	if err != nil {
		return &violation{cause: err} // cannot happen: both parts were checked
	}
	// Counted before the frame is handed over, so that a worker that has it never reads counts
	// without it (TestHubRelayFrames read them short under load); taken back if it was dropped.
	n := int64(len(frame))
	c.relaySent.Add(n)
	dst.relayReceived.Add(n)
	if !dst.relay(outgoing{msgs: [][]byte{msg}, binary: true}, c.closing) {
		c.relaySent.Add(-n)
		dst.relayReceived.Add(-n)
	}
	return nil
}

// ackMsg is a heartbeat's ack and its queue slot's message list, in one allocation.
type ackMsg struct {
	msgs [1][]byte
	buf  [96]byte
}

// ackHeartbeat queues the ack of heartbeat seq.
func (c *hubConn) ackHeartbeat(seq uint64) error {
	a := new(ackMsg)
	a.msgs[0] = appendHeartbeatAck(a.buf[:0], seq)
	return c.send(outgoing{msgs: a.msgs[:], ackRead: c.readAt})
}

// send queues o without waiting; a full queue drops the worker as too slow.
func (c *hubConn) send(o outgoing) error {
	select {
	case <-c.closing:
		return ErrUnknownWorker
	default:
	}
	select {
	case c.out <- o:
		return nil
	default:
		err := fmt.Errorf("%w: %d messages queued", ErrSlowWorker, cap(c.out))
		c.dropWith(err, &proto.Error{Code: proto.ErrCodeProtocol, Message: "too slow: " + err.Error()}, websocket.StatusPolicyViolation, false)
		return err
	}
}

// relay queues a relayed frame, waiting for room while the queue is full: that wait stalls the
// sender's reader and so, through TCP, the sender, which is the flow control the relay needs. A
// receiver that takes no frame for half a heartbeat timeout is dropped as too slow; half, so that
// the stalled sender is not itself timed out. It reports whether o was queued.
func (c *hubConn) relay(o outgoing, senderClosing <-chan struct{}) bool {
	select {
	case c.out <- o:
		return true
	case <-c.closing:
		return false
	default:
	}
	t := time.NewTimer(c.h.cfg.HeartbeatTimeout / 2)
	defer t.Stop()
	select {
	case c.out <- o:
		return true
	case <-c.closing:
	case <-senderClosing:
	case <-t.C:
		err := fmt.Errorf("%w: relayed frames not taken for %v", ErrSlowWorker, c.h.cfg.HeartbeatTimeout/2)
		c.dropWith(err, &proto.Error{Code: proto.ErrCodeProtocol, Message: "too slow: " + err.Error()}, websocket.StatusPolicyViolation, false)
	}
	return false
}

// drop ends the connection after readLoop returned err.
func (c *hubConn) drop(err error) {
	var v *violation
	switch {
	case errors.Is(err, errBye):
		return // dropped already
	case errors.As(err, &v):
		c.log.Warn("protocol violation", "err", v.cause)
		status := websocket.StatusPolicyViolation
		if errors.Is(v.cause, proto.ErrMessageTooLarge) || errors.Is(v.cause, proto.ErrFrameTooLarge) {
			status = websocket.StatusMessageTooBig
		}
		c.dropWith(fmt.Errorf("%w: %w", ErrProtocol, v.cause),
			&proto.Error{Code: proto.ErrCodeProtocol, Message: errorText(v.cause)}, status, true)
	case errors.Is(err, ErrSlowWorker):
		c.dropWith(err, &proto.Error{Code: proto.ErrCodeProtocol, Message: errorText(err)}, websocket.StatusPolicyViolation, true)
	case c.hello != nil && c.hello.Kind == proto.WorkerBrowser && (websocket.CloseStatus(err) == websocket.StatusGoingAway || errors.Is(err, io.EOF)):
		// A browser closes its WebSockets with 1001 when the page goes away (RFC 6455, 7.4.1):
		// the tab was closed or left. The browser worker runs in a dedicated worker that the
		// browser ends with the page, often before the Bye the page asked it for is sent, so
		// this is the tab's departure, as its Bye would have said. When the browser ends the
		// worker before even the close frame goes out (a busy machine, a step mid-way), the
		// socket just ends (EOF): the same departure. A tab whose network fails does not end
		// its socket so; its heartbeats stop (ErrHeartbeatTimeout).
		c.dropWith(fmt.Errorf("%w: tab closed", ErrWorkerLeft), nil, 0, false)
	default:
		c.dropWith(fmt.Errorf("%w: %w", ErrDisconnected, err), nil, 0, false)
	}
}

// dropWith drops the worker, once: it is unregistered and its EventLeft queued at once, and the
// writer sends final (if not nil) and closes the socket, with a close handshake when the peer is
// alive to answer it. Only the first reason counts.
func (c *hubConn) dropWith(reason error, final proto.Message, status websocket.StatusCode, handshake bool) {
	c.dropOnce.Do(func() {
		c.final, c.status, c.handshake = final, status, handshake
		close(c.closing)
		if !handshake {
			c.cancelWrites()
		}
		c.h.unregister(c, reason)
		c.log.Info("worker left", "reason", reason)
	})
}

// writeLoop owns the socket's writes: queued messages and, at the end, the final message and the
// close. (The heartbeat timeout is Hub.sweep's.)
func (c *hubConn) writeLoop() {
	defer c.h.wg.Done()
	defer func() {
		if c.writeTimer != nil {
			c.writeTimer.Stop()
		}
		// The reader's read takes no context: the socket's close ends it, whatever finish did.
		c.ws.CloseNow()
	}()
	for {
		// closing first: once dropped, nothing else of the queue is written.
		select {
		case <-c.closing:
			c.finish()
			return
		default:
		}
		select {
		case <-c.closing:
		case o := <-c.out:
			if err := c.write(o); err != nil {
				c.dropWith(fmt.Errorf("%w: write: %w", ErrDisconnected, err), nil, 0, false)
			}
		}
	}
}

// errWritesCancelled fails the writes queued after a drop without a handshake.
var errWritesCancelled = errors.New("writes cancelled: the worker was dropped")

// monoEpoch is the origin of hubConn.writeStart: a monotonic clock, which a change of the wall
// clock cannot make expire a write early or never.
var monoEpoch = time.Now()

func (c *hubConn) write(o outgoing) error {
	// A write that cannot finish within a heartbeat timeout means the worker stopped reading:
	// writeTimer drops it, closing the socket, which fails the write.
	var taken uint32 // when an ack was taken from the queue, for observeAck
	if o.ackRead != 0 && c.h.observeAck != nil {
		taken = nowMicros()
	}
	timeout := c.h.cfg.HeartbeatTimeout
	c.writeStart.Store(int64(time.Since(monoEpoch)) | 1) // never 0
	if c.writeTimer == nil {
		c.writeTimer = time.AfterFunc(timeout, c.writeExpired)
	} else {
		c.writeTimer.Reset(timeout)
	}
	defer func() {
		c.writeTimer.Stop()
		c.writeStart.Store(0)
	}()
	typ := websocket.MessageText
	if o.binary {
		typ = websocket.MessageBinary
	}
	for _, b := range o.msgs {
		if c.writesCancelled.Load() {
			return errWritesCancelled
		}
		// Counted before the write: once it is on the wire the worker may act on it (and a test
		// or the dashboard look at the count) before this goroutine runs again.
		c.bytesOut.Add(int64(len(b)))
		if err := c.ws.Write(context.Background(), typ, b); err != nil {
			c.bytesOut.Add(-int64(len(b)))
			return err
		}
	}
	if taken != 0 {
		now := nowMicros()
		c.h.observeAck(time.Duration(now-o.ackRead)*time.Microsecond, time.Duration(taken-o.ackRead)*time.Microsecond)
	}
	return nil
}

// writeExpired is writeTimer's: it drops the worker, without a handshake (which closes the
// socket under the write), if the write in progress has taken a heartbeat timeout. A late run
// for an earlier write finds a later start, or none, and does nothing.
func (c *hubConn) writeExpired() {
	timeout := c.h.cfg.HeartbeatTimeout
	start := c.writeStart.Load()
	if start != 0 && time.Since(monoEpoch)-time.Duration(start) >= timeout {
		c.dropWith(fmt.Errorf("%w: write: %w: not written within %v", ErrDisconnected, context.DeadlineExceeded, timeout), nil, 0, false)
	}
}

// cancelWrites fails the writes queued from now on, and the one in progress, if any, by closing
// the socket (as the library does when a write's context ends).
func (c *hubConn) cancelWrites() {
	c.writesCancelled.Store(true)
	if c.writeStart.Load() != 0 {
		c.ws.CloseNow()
	}
}

// finish sends the final message and closes the socket.
func (c *hubConn) finish() {
	// Not through write: a drop without a handshake has cancelled the writes, and the final
	// message is worth a try still (a silent worker may just be stuck, and read it later).
	if c.final != nil {
		if b, err := proto.EncodeMessage(c.final); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), finalWriteTimeout)
			if c.ws.Write(ctx, websocket.MessageText, b) == nil {
				c.bytesOut.Add(int64(len(b)))
			}
			cancel()
		}
	}
	if c.handshake {
		// The close reason is limited to 123 bytes; the Error said it all.
		c.ws.Close(c.status, "")
	} else {
		c.ws.CloseNow()
	}
}

// errorText makes err's text fit a proto.Error's message: valid UTF-8, at most 4096 bytes.
func errorText(err error) string {
	s := strings.ToValidUTF8(err.Error(), "\uFFFD")
	const limit = 4096
	if len(s) > limit {
		s = s[:limit-len("…")]
		for len(s) > 0 && !utf8.ValidString(s) {
			s = s[:len(s)-1]
		}
		s += "…"
	}
	return s
}

// eventQueue is the unbounded FIFO behind Events: pushing never blocks.
type eventQueue struct {
	mu    sync.Mutex
	items []queuedEvent
	ready chan struct{} // capacity 1: items may be waiting
}

type queuedEvent struct {
	Event
	c *hubConn
}

// push appends e. A connection's EventMessage after its EventLeft is discarded, so that Left is
// always a worker's last event (its reader may still be finishing a message when it is dropped).
func (q *eventQueue) push(e Event, c *hubConn) {
	q.mu.Lock()
	if e.Kind == EventMessage && c.left {
		q.mu.Unlock()
		c.pending.Add(-1)
		return
	}
	if e.Kind == EventLeft {
		c.left = true
	}
	q.items = append(q.items, queuedEvent{e, c})
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// pop removes the oldest event, waiting for one until done.
func (q *eventQueue) pop(done <-chan struct{}) (queuedEvent, bool) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			it := q.items[0]
			q.items[0] = queuedEvent{}
			q.items = q.items[1:]
			q.mu.Unlock()
			return it, true
		}
		q.mu.Unlock()
		select {
		case <-q.ready:
		case <-done:
			return queuedEvent{}, false
		}
	}
}

// relayBurst is the relay bytes a worker may send at once before its rate applies: a few
// activations of the default job.
const relayBurst = 16 << 20

// gapDecay is how fast a worker's longest silence (hubConn.gap) is forgotten: by 1/gapDecay of it
// at every message heard, so about a minute of beats halves it.
const gapDecay = 64

// noteGap takes the silence d before the message just heard (the reader's alone). A worker is
// hastened only after twice the longest silence it keeps lately: a browser tab computing on its
// CPU cannot beat until a kernel returns, and a machine that is simply slow to beat would
// otherwise be dropped as vanished whenever the fleet waits on it — measured, not taken on its
// word.
func (c *hubConn) noteGap(d int64) {
	g := c.gap.Load()
	c.gap.Store(max(g-g/gapDecay, d))
}
