package client

// The worker's end of the /ws control connection (docs/design.md, "Wire" and "Faults"): join with a
// Hello, then exchange control messages, heartbeats and, when WebRTC fails between two peers,
// relayed frames. The same code runs natively and in the browser: coder/websocket has a js build
// with the same API over the browser's WebSocket, so this file must not use anything that build
// lacks (dial options, pings, the net.Conn adapter).

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/proto"
)

// Why a Conn ended: Conn.Err wraps one of these.
var (
	// ErrConnClosed means this worker closed the connection (Conn.Close).
	ErrConnClosed = errors.New("control connection closed by this worker")
	// ErrCoordinatorSilent means nothing came from the coordinator for SilenceIntervals heartbeat
	// intervals (and at least minSilence): it or the network is gone without closing the
	// connection.
	ErrCoordinatorSilent = errors.New("coordinator silent past the heartbeat timeout")
	// ErrCoordinatorLeft means the coordinator said Bye and closed the connection: it is shutting
	// down, or it dropped this worker without blaming it.
	ErrCoordinatorLeft = errors.New("coordinator closed the connection")
	// ErrDroppedByCoordinator means the coordinator sent an Error and closed the connection; the
	// error also wraps that *proto.Error (errors.As).
	ErrDroppedByCoordinator = errors.New("dropped by the coordinator")
	// ErrConnLost means the connection closed or failed without a word from the coordinator, or
	// the coordinator broke the protocol.
	ErrConnLost = errors.New("control connection lost")
)

// SilenceIntervals is how many heartbeat intervals the coordinator may stay silent before the
// connection fails. The coordinator answers each heartbeat, so a live one is never silent for
// more than about one interval plus a round trip.
const SilenceIntervals = 5

// minSilence is the least silence a connection outlasts whatever the interval: a coordinator's
// intervals are seconds, but one that sets tens of milliseconds (tests do) would otherwise have a
// worker give up on it after a quarter second of a loaded machine's scheduling delay.
const minSilence = 2 * time.Second

// maxHeartbeat bounds the heartbeat interval a coordinator's welcome may set: a worker sends its
// heartbeats at least this often, and the coordinator answers each, so that a coordinator that
// says "once a year" and goes silent is still found out within SilenceIntervals of it.
const maxHeartbeat = 30 * time.Second

const (
	// sendQueue is how many outgoing messages wait for the socket before Send blocks: back-pressure
	// for relayed frames, slack for control messages.
	sendQueue = 64
	// finalWriteTimeout bounds the write of the Bye or Error that precedes a close.
	finalWriteTimeout = time.Second
)

// ConnConfig configures Dial.
type ConnConfig struct {
	// URL is the coordinator's control endpoint: ws:// or wss://host/ws.
	URL string
	// Hello is what this worker says about itself; its WorkerID asks to rejoin under an old id.
	Hello proto.Hello
	// Key is the private half of Hello.SigningKey: it answers the coordinator's identity
	// Challenge. Nil with a SigningKey: the coordinator's challenge cannot be answered.
	Key ed25519.PrivateKey
	// MaxMessageBytes bounds a message from the coordinator. Default proto.MaxMessageSize; never
	// less than proto.MaxBinarySize, so that a relayed frame always fits.
	MaxMessageBytes int64
	// OnFrame, when set, is the frame handler from the start (see Conn.SetFrameHandler): the way
	// to be sure no frame arrives before there is a handler.
	OnFrame func(from string, frame []byte)
	// Logger receives connection events; nil discards them.
	Logger *slog.Logger
	// HTTP makes the handshake (not in a browser, whose WebSocket does); nil is a client that
	// follows redirects only within URL's origin. Joining — the handshake and the welcome — is
	// bounded in time whatever it is.
	HTTP *http.Client
}

// Conn is a worker's control connection to the coordinator, joined and welcomed. A reader
// goroutine takes messages off the socket (answering heartbeats itself) and a writer goroutine
// owns every write (queued by Send and SendRelay, heartbeats, the final Bye); a third hands
// received messages to Messages, so that a busy consumer never holds up heartbeats.
type Conn struct {
	ws       *websocket.Conn
	log      *slog.Logger
	id       string
	interval time.Duration

	// ctx bounds the reader's reads; cancelled once the writer has closed the socket.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	out       chan outgoing
	lastHeard atomic.Int64 // unix ns
	handler   atomic.Pointer[func(from string, frame []byte)]

	msgs  chan proto.Message
	queue msgQueue

	done     chan struct{} // closed when the connection has ended; err is set before
	failOnce sync.Once
	err      error
	final    proto.Message // written before done is closed: sent before the close, if any
	stop     chan struct{} // closed by Close: discard undelivered messages
	stopOnce sync.Once
}

type outgoing struct {
	typ websocket.MessageType
	b   []byte
}

// Signals reach other workers through Send; the WebRTC transport asks for them this way.
var _ Signaler = (*Conn)(nil)

// Dial connects to the coordinator and joins: it sends cfg.Hello and waits for the Welcome. It
// makes one attempt; retry with Backoff. ctx bounds the connection, the handshake and the wait
// for the Welcome; the Conn outlives it.
//
// A coordinator that answers with an Error (the hello was refused) makes Dial return an error
// wrapping that *proto.Error (errors.As). A coordinator of another protocol version makes it
// return an error wrapping a *proto.VersionError (errors.Is(err, proto.ErrProtocolVersion)),
// whose text says which side to upgrade. A server that answers 404 makes it return an error
// wrapping ErrNotCoordinator.
func Dial(ctx context.Context, cfg ConnConfig) (*Conn, *proto.Welcome, error) {
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = proto.MaxMessageSize
	}
	cfg.MaxMessageBytes = max(cfg.MaxMessageBytes, proto.MaxBinarySize)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	hello, err := proto.EncodeMessage(&cfg.Hello)
	if err != nil {
		return nil, nil, fmt.Errorf("join %s: %w", cfg.URL, err)
	}
	// A coordinator that accepts the connection and then says nothing must not hold the worker.
	jctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	ws, err := dialWS(jctx, cfg.URL, cfg.HTTP)
	if err != nil {
		return nil, nil, fmt.Errorf("join %s: %w", cfg.URL, err)
	}
	ws.SetReadLimit(cfg.MaxMessageBytes)
	welcome, err := join(jctx, ws, hello, cfg.Key)
	if err != nil {
		ws.CloseNow()
		return nil, nil, fmt.Errorf("join %s: %w", cfg.URL, err)
	}
	c := &Conn{
		ws:       ws,
		log:      cfg.Logger.With("worker", welcome.WorkerID),
		id:       welcome.WorkerID,
		interval: time.Duration(min(welcome.HeartbeatMS, maxHeartbeat.Milliseconds())) * time.Millisecond,
		out:      make(chan outgoing, sendQueue),
		msgs:     make(chan proto.Message),
		queue:    msgQueue{ready: make(chan struct{}, 1)},
		done:     make(chan struct{}),
		stop:     make(chan struct{}),
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.lastHeard.Store(time.Now().UnixNano())
	if cfg.OnFrame != nil {
		c.handler.Store(&cfg.OnFrame)
	}
	c.wg.Add(3)
	go c.readLoop()
	go c.writeLoop()
	go c.pump()
	return c, welcome, nil
}

// join sends the hello and reads the answer, proving the worker's identity first when the
// coordinator challenges it (proto.Challenge).
func join(ctx context.Context, ws *websocket.Conn, hello []byte, key ed25519.PrivateKey) (*proto.Welcome, error) {
	if err := ws.Write(ctx, websocket.MessageText, hello); err != nil {
		return nil, fmt.Errorf("send hello: %w", err)
	}
	m, err := readJoin(ctx, ws)
	if err != nil {
		return nil, err
	}
	if ch, ok := m.(*proto.Challenge); ok {
		if key == nil {
			return nil, fmt.Errorf("%w: the coordinator asks to prove an identity this worker has no key for", proto.ErrUnexpectedMessage)
		}
		pub := key.Public().(ed25519.PublicKey)
		proof, err := proto.EncodeMessage(&proto.Proof{Signature: ed25519.Sign(key, proto.ProofMessage(ch.Nonce, pub))})
		if err != nil {
			return nil, err
		}
		if err := ws.Write(ctx, websocket.MessageText, proof); err != nil {
			return nil, fmt.Errorf("send identity proof: %w", err)
		}
		if m, err = readJoin(ctx, ws); err != nil {
			return nil, err
		}
	}
	switch m := m.(type) {
	case *proto.Welcome:
		return m, nil
	case *proto.Error:
		return nil, fmt.Errorf("coordinator refused the hello: %w", m)
	}
	return nil, fmt.Errorf("%w: the coordinator answered the hello with %s", proto.ErrUnexpectedMessage, m.Type())
}

// readJoin reads one message of the handshake.
func readJoin(ctx context.Context, ws *websocket.Conn) (proto.Message, error) {
	typ, b, err := ws.Read(ctx)
	if err != nil {
		return nil, fmt.Errorf("wait for welcome: %w", err)
	}
	if typ != websocket.MessageText {
		return nil, fmt.Errorf("%w: the coordinator answered the hello with a binary message", proto.ErrUnexpectedMessage)
	}
	return proto.DecodeMessage(b, proto.RoleWorker)
}

// ID is the worker id the coordinator gave this worker.
func (c *Conn) ID() string { return c.id }

// Send queues a control message for the coordinator. It refuses (before queueing) an invalid
// message, one a worker does not send, and a Hello (Dial sent it). ctx bounds the wait for room
// in the queue, not the write; a nil error means queued.
func (c *Conn) Send(ctx context.Context, m proto.Message) error {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		return fmt.Errorf("send: %w", err)
	}
	// As the coordinator will decode it: a message a worker may not send would get it dropped.
	if _, err := proto.DecodeMessage(b, proto.RoleCoordinator); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	if m.Type() == proto.TypeHello {
		return fmt.Errorf("send: %w: a joined worker does not send another hello", proto.ErrUnexpectedMessage)
	}
	return c.enqueue(ctx, outgoing{typ: websocket.MessageText, b: b}, m.Type())
}

// SendSignal sends WebRTC signaling to worker to through the coordinator (the Signaler of
// RTCTransport). From is set to this worker's id; the coordinator would overwrite it anyway.
func (c *Conn) SendSignal(ctx context.Context, to string, s proto.Signal) error {
	s.From, s.To = c.id, to
	return c.Send(ctx, &s)
}

// SendRelay queues frame for worker to through the coordinator: the relay fallback for a
// neighbour that WebRTC cannot reach. frame is copied, so the caller may reuse it at once. ctx
// bounds the wait for room in the queue; that wait is the relay's back-pressure.
func (c *Conn) SendRelay(ctx context.Context, to string, frame []byte) error {
	b, err := proto.AppendRelay(make([]byte, 0, 2+len(to)+len(frame)), to, frame)
	if err != nil {
		return fmt.Errorf("relay to %s: %w", to, err)
	}
	return c.enqueue(ctx, outgoing{typ: websocket.MessageBinary, b: b}, "relay frame")
}

func (c *Conn) enqueue(ctx context.Context, o outgoing, what any) error {
	select {
	case <-c.done:
		return fmt.Errorf("send %v: %w", what, c.err)
	default:
	}
	select {
	case c.out <- o:
		return nil
	case <-c.done:
		return fmt.Errorf("send %v: %w", what, c.err)
	case <-ctx.Done():
		return fmt.Errorf("send %v: %w", what, ctx.Err())
	}
}

// Messages returns the control messages from the coordinator, in order: everything but the
// Welcome (Dial returned it) and heartbeats (answered here). Signals are included. It is closed
// once the connection has ended and every message received before has been delivered, or at
// Close, which discards what was not received yet.
func (c *Conn) Messages() <-chan proto.Message { return c.msgs }

// SetFrameHandler sets the function that receives tensor frames from the coordinator: from is ""
// for a frame the coordinator sends this worker itself (tokens, targets), and the sending worker's
// id for a relayed one. frame is the handler's to keep. The handler runs on the reader goroutine,
// so it must be quick (a Reassembler.Add and a hand-off, say): while it runs, no control message
// or heartbeat answer is read. Frames that arrive while no handler is set are dropped and logged;
// set it before anything can send frames (ConnConfig.OnFrame sets one from the start). A nil f
// removes the handler.
func (c *Conn) SetFrameHandler(f func(from string, frame []byte)) {
	if f == nil {
		c.handler.Store(nil)
		return
	}
	c.handler.Store(&f)
}

// Done is closed when the connection has ended; Err then says why.
func (c *Conn) Done() <-chan struct{} { return c.done }

// Err is nil while the connection is up, and then why it ended: wrapping ErrConnClosed,
// ErrCoordinatorSilent, ErrCoordinatorLeft, ErrDroppedByCoordinator or ErrConnLost.
func (c *Conn) Err() error {
	select {
	case <-c.done:
		return c.err
	default:
		return nil
	}
}

// Close says Bye to the coordinator (unless the connection has already ended), closes the
// connection and waits for its goroutines, at most about 10 s when the coordinator does not answer
// the close (coder/websocket's bound). It always returns nil; Err says how the connection ended.
func (c *Conn) Close() error { return c.Leave("worker closing") }

// Leave is Close with the reason the Bye gives: the coordinator records it with the departure
// (a worker stopping, a tab closed by its contributor).
func (c *Conn) Leave(reason string) error {
	c.fail(ErrConnClosed, &proto.Bye{Reason: reason})
	c.stopOnce.Do(func() { close(c.stop) })
	c.wg.Wait()
	return nil
}

// fail ends the connection, once: err becomes Err, done closes, and the writer sends final (if
// any) and closes the socket.
func (c *Conn) fail(err error, final proto.Message) {
	c.failOnce.Do(func() {
		c.err, c.final = err, final
		close(c.done)
		if !errors.Is(err, ErrConnClosed) {
			c.log.Warn("control connection ended", "err", err)
		}
	})
}

func (c *Conn) readLoop() {
	defer c.wg.Done()
	defer c.queue.finish()
	// last is the coordinator's last Error or Bye, if that was its last message: the reason for
	// the close that follows it.
	var last proto.Message
	for {
		typ, b, err := c.ws.Read(c.ctx)
		if err != nil {
			c.fail(closeReason(last, err), nil)
			return
		}
		c.lastHeard.Store(time.Now().UnixNano())
		last = nil
		if typ == websocket.MessageBinary {
			kind, from, frame, err := proto.DecodeBinary(b)
			if err != nil {
				c.violation(err)
				return
			}
			if kind == proto.BinDirect {
				from = ""
			}
			if f := c.handler.Load(); f != nil {
				(*f)(from, frame)
			} else {
				c.log.Warn("frame dropped: no frame handler", "from", from, "bytes", len(frame))
			}
			continue
		}
		m, err := proto.DecodeMessage(b, proto.RoleWorker)
		if err != nil {
			c.violation(err)
			return
		}
		switch m := m.(type) {
		case *proto.Heartbeat:
			if !m.Ack {
				c.reply(&proto.Heartbeat{Seq: m.Seq, Ack: true})
			}
			continue
		case *proto.Error, *proto.Bye:
			last = m
		}
		c.queue.push(m)
	}
}

// closeReason is Err for a connection whose socket closed with err after the coordinator's last
// message last.
func closeReason(last proto.Message, err error) error {
	switch m := last.(type) {
	case *proto.Error:
		return fmt.Errorf("%w: %w", ErrDroppedByCoordinator, m)
	case *proto.Bye:
		return fmt.Errorf("%w: %s", ErrCoordinatorLeft, m.Reason)
	}
	return fmt.Errorf("%w: %w", ErrConnLost, err)
}

// violation ends the connection after the coordinator sent something this worker cannot accept,
// telling it why.
func (c *Conn) violation(err error) {
	c.fail(fmt.Errorf("%w: the coordinator broke the protocol: %w", ErrConnLost, err),
		&proto.Error{Code: proto.ErrCodeProtocol, Message: err.Error()})
}

// reply queues a heartbeat answer from the reader, waiting while the queue is full (the writer is
// then stuck, and the connection will fail on its own).
func (c *Conn) reply(m proto.Message) {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		return
	}
	select {
	case c.out <- outgoing{typ: websocket.MessageText, b: b}:
	case <-c.done:
	}
}

// writeLoop owns the socket's writes: queued messages, heartbeats and the silence check, and at
// the end the final message and the close.
func (c *Conn) writeLoop() {
	defer c.wg.Done()
	defer c.cancel()
	tick := time.NewTicker(c.interval)
	defer tick.Stop()
	var seq uint64
	silence := max(SilenceIntervals*c.interval, minSilence)
	for {
		select {
		case <-c.done:
			c.finish()
			return
		default:
		}
		var err error
		select {
		case <-c.done:
			continue
		case o := <-c.out:
			err = c.write(o)
		case <-tick.C:
			if quiet := time.Since(time.Unix(0, c.lastHeard.Load())); quiet > silence {
				c.fail(fmt.Errorf("%w: nothing heard for %v (%d heartbeats of %v)", ErrCoordinatorSilent,
					quiet.Round(time.Millisecond), SilenceIntervals, c.interval), nil)
				continue
			}
			seq++
			b, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: seq})
			err = c.write(outgoing{typ: websocket.MessageText, b: b})
		}
		if err != nil {
			c.fail(fmt.Errorf("%w: %w", ErrConnLost, err), nil)
		}
	}
}

func (c *Conn) write(o outgoing) error {
	// A write that cannot finish while the coordinator would still count as alive will not.
	ctx, cancel := context.WithTimeout(c.ctx, SilenceIntervals*c.interval)
	defer cancel()
	return c.ws.Write(ctx, o.typ, o.b)
}

// finish sends the final message, if any, and closes the socket: with a close handshake when there
// was something to say (the coordinator is alive to answer), at once otherwise.
func (c *Conn) finish() {
	if c.final == nil {
		c.ws.CloseNow()
		return
	}
	if b, err := proto.EncodeMessage(c.final); err == nil {
		ctx, cancel := context.WithTimeout(c.ctx, finalWriteTimeout)
		c.ws.Write(ctx, websocket.MessageText, b)
		cancel()
	}
	status := websocket.StatusNormalClosure
	if _, ok := c.final.(*proto.Error); ok {
		status = websocket.StatusPolicyViolation
	}
	c.ws.Close(status, "")
}

// pump hands received messages to Messages, and closes it.
func (c *Conn) pump() {
	defer c.wg.Done()
	defer close(c.msgs)
	for {
		m, ok := c.queue.pop(c.stop)
		if !ok {
			return
		}
		select {
		case c.msgs <- m:
		case <-c.stop:
			return
		}
	}
}

// msgQueue is the unbounded FIFO between the reader and Messages: the coordinator is trusted and
// sends a few messages per step, so holding them all costs little, and the reader never waits for
// the consumer.
type msgQueue struct {
	mu       sync.Mutex
	items    []proto.Message
	finished bool          // the reader is done: nothing more will be pushed
	ready    chan struct{} // capacity 1: items may be waiting, or finished
}

func (q *msgQueue) push(m proto.Message) {
	q.mu.Lock()
	q.items = append(q.items, m)
	q.mu.Unlock()
	q.signal()
}

func (q *msgQueue) finish() {
	q.mu.Lock()
	q.finished = true
	q.mu.Unlock()
	q.signal()
}

func (q *msgQueue) signal() {
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// pop removes the oldest message, waiting for one; it reports false once the queue is finished
// and empty, or at stop.
func (q *msgQueue) pop(stop <-chan struct{}) (proto.Message, bool) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			m := q.items[0]
			q.items[0] = nil
			q.items = q.items[1:]
			q.mu.Unlock()
			return m, true
		}
		finished := q.finished
		q.mu.Unlock()
		if finished {
			return nil, false
		}
		select {
		case <-q.ready:
		case <-stop:
			return nil, false
		}
	}
}

// Backoff returns how long to wait before reconnection attempt attempt (0 for the first retry):
// exponential with full jitter, uniform in [0, min(maxDelay, base·2^attempt)], so that workers cut off
// together do not come back together (AWS Architecture Blog, "Exponential Backoff and Jitter").
// r supplies the randomness (seed it per worker, or pass nil for the global source).
func Backoff(attempt int, base, maxDelay time.Duration, r *rand.Rand) time.Duration {
	if base <= 0 || maxDelay <= 0 {
		return 0
	}
	// base·2^attempt, capped, without overflow: stop doubling once past half the cap.
	ceil := min(base, maxDelay)
	for i := 0; i < attempt && ceil < maxDelay; i++ {
		if ceil > maxDelay/2 {
			ceil = maxDelay
			break
		}
		ceil *= 2
	}
	if r == nil {
		return time.Duration(rand.Int64N(int64(ceil) + 1))
	}
	return time.Duration(r.Int64N(int64(ceil) + 1))
}
