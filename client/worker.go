package client

import (
	"bytes"
	"context"
	"crypto/ed25519"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/transport/v5"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// errDrained ends a worker asked to leave for good.
var errDrained = errors.New("drained by the admin")

// WorkerConfig configures a worker daemon (`shoal worker`) or a browser tab.
type WorkerConfig struct {
	// Coordinator is the coordinator's base URL, http(s)://host:port.
	Coordinator string
	Kind        proto.WorkerKind
	Backend     proto.Backend
	Threads     int
	MemoryBytes int64
	Name        string
	JoinToken   string // a private job's join token
	Logger      *slog.Logger
	HTTP        *http.Client
	// BackoffBase and BackoffMax bound reconnection delays (defaults 250 ms and 15 s).
	BackoffBase, BackoffMax time.Duration
	// ICETimeout is how long a WebRTC connection to a neighbour may take before the link falls
	// back to the relay through the coordinator (default 20 s).
	ICETimeout time.Duration
	// BlockWebRTC drops this worker's outgoing WebRTC signaling, so that every neighbour link
	// times out into the relay: it stands in for peers that ICE cannot connect (tests, and
	// diagnosing a deployment).
	BlockWebRTC bool
	// Device is what the worker's shards compute on; nil is model.Host, the CPU kernels. A
	// browser tab passes its WebGPU device when that is the faster backend, `shoal worker
	// --device vulkan` its Vulkan device (Backend says which).
	Device model.Device
	// DeviceName names Device for the coordinator's dashboards (proto.Hello.Device).
	DeviceName string
	// GFLOPS, when > 0, is the throughput reported in the Hello instead of MeasureGFLOPS: for a
	// worker whose shard runs on another backend than the CPU kernels MeasureGFLOPS times (a
	// browser tab measures the backend it chose), or a test that plays a slow peer.
	GFLOPS float64
	// Identity is the volunteer's key (proto.Hello.SigningKey, and the proof of holding it): kept
	// across restarts (LoadIdentity, a browser's IndexedDB), so that credit accumulates under
	// one volunteer. Nil: a key made for this run alone.
	Identity ed25519.PrivateKey
	// WorkerID asks the coordinator for this id on the first join: it is granted only if no
	// worker ever had it (an id that was given out takes its session credential); "" lets the
	// coordinator choose. Reconnections ask for the id of the last welcome, with its credential.
	WorkerID string
	// OnStatus, when set, is told of every change of the worker's Status (connection state,
	// assignment, steps computed), one call at a time, from the worker's goroutines: it must
	// return quickly. The browser entry draws the contributor page from it.
	OnStatus func(Status)
	// Fault, when not "", makes this worker misbehave on purpose on every training step, in the
	// one way it names (FaultKinds; `shoal worker` reads it from SHOAL_FAULT): for showing that
	// audits catch it. Never set it on a worker whose work should count.
	Fault string
	// Leave, when closed, asks the worker to leave at the job's next step boundary (`shoal worker`
	// closes it at the first SIGTERM): it tells the coordinator (proto.Leaving), goes on computing
	// until the coordinator lets it go — after a checkpoint of that step when it holds a shard —
	// and then returns nil, as after a drain; a lost connection meanwhile ends it at once, and so
	// does ctx.
	Leave <-chan struct{}
	// LeaveReason, when set, says why the worker leaves once Leave is closed (proto.Leaving's
	// reason, in the coordinator's event log): a resource policy's pause says which condition
	// holds. Nil, or "", is "worker stopping".
	LeaveReason func() string
	// StallTimeout is how long a request to the coordinator's HTTP server may go without a byte
	// moving before it is cut (default DefaultStallTimeout): a download, a checkpoint or evidence
	// upload, or the wait for a response.
	StallTimeout time.Duration
	// MaxUploadBytesPerS, when > 0, caps what this worker sends: its data-plane frames and its
	// checkpoint and evidence uploads share one token bucket of this rate (Uplink). The Hello
	// reports it as the worker's link speed (proto.Hello.LinkBytesPerS), so that the planner
	// weighs the worker by the rate it will get.
	MaxUploadBytesPerS float64
	// Network, when set, is the simulated network (internal/wan) that this worker's WebRTC
	// connections use instead of the host's (RTCConfig.Net): tests and the WAN bench only. The
	// control WebSocket stays on the real network.
	Network transport.Net
}

// RunWorker joins the coordinator and serves it until ctx ends, reconnecting with exponential
// backoff and jitter whenever the connection is lost. It returns nil when ctx ends, or an error
// the worker cannot recover from by reconnecting (an incompatible protocol version).
//
// When ctx ends the worker says Bye before it closes the connection, and the coordinator handles
// that as a departure. The Bye's reason is ctx's cause when one was given
// (context.WithCancelCause), so that the coordinator's log says why ("tab closed"), and "worker
// stopping" otherwise.
func RunWorker(ctx context.Context, cfg WorkerConfig) (err error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.HTTP == nil {
		cfg.HTTP = http.DefaultClient
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = 250 * time.Millisecond
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 15 * time.Second
	}
	if cfg.ICETimeout <= 0 {
		cfg.ICETimeout = 20 * time.Second
	}
	if cfg.Kind == "" {
		cfg.Kind = proto.WorkerNative
	}
	if cfg.HTTP, err = coordinatorHTTP(cfg.Coordinator, cfg.HTTP); err != nil {
		return err
	}
	if cfg.Backend == "" {
		cfg.Backend = proto.BackendCPU
	}
	if err := CheckFault(cfg.Fault); err != nil {
		return err
	}
	if cfg.Fault != "" {
		cfg.Logger.Error("SHOAL_FAULT="+cfg.Fault+": this worker misbehaves ON PURPOSE", "fault", cfg.Fault, "does", faultDoes(cfg.Fault))
	}
	key := cfg.Identity
	if key == nil {
		if _, key, err = ed25519.GenerateKey(crand.Reader); err != nil {
			return err
		}
	}
	if len(key) != ed25519.PrivateKeySize {
		return fmt.Errorf("identity key: %d bytes, want an Ed25519 private key (%d)", len(key), ed25519.PrivateKeySize)
	}
	pub := key.Public().(ed25519.PublicKey)
	board := &statusBoard{on: cfg.OnStatus, st: Status{Coordinator: cfg.Coordinator, Backend: cfg.Backend, Identity: proto.Fingerprint(pub)}}
	defer func() {
		board.update(func(s *Status) {
			s.State = StateStopped
			switch {
			case err != nil:
				s.Err = err.Error()
			case ctx.Err() != nil:
				s.Err = "" // stopped as asked: an earlier reconnection's error is moot
			}
		})
	}()
	wsURL, err := wsURLOf(cfg.Coordinator)
	if err != nil {
		return err
	}
	gflops := cfg.GFLOPS
	if gflops <= 0 {
		board.update(func(s *Status) { s.State = StateMeasuring })
		gflops = MeasureGFLOPS()
	}
	hello := proto.Hello{Kind: cfg.Kind, Backend: cfg.Backend, GFLOPS: gflops, MemoryBytes: cfg.MemoryBytes, OuterOnHeap: outerOnHeap,
		Threads: max(cfg.Threads, 1), Name: cfg.Name, JoinToken: cfg.JoinToken, WorkerID: cfg.WorkerID,
		Kernels: kernelFamily(cfg), Device: cfg.DeviceName, SigningKey: pub, LinkBytesPerS: max(cfg.MaxUploadBytesPerS, 0)}
	uplink := NewUplink(cfg.MaxUploadBytesPerS)
	cfg.Logger.Info("worker starting", "coordinator", cfg.Coordinator, "identity", proto.Fingerprint(pub), "gflops", fmt.Sprintf("%.1f", hello.GFLOPS), "kernels", kernels.ISA())
	board.update(func(s *Status) { s.State, s.GFLOPS = StateConnecting, gflops })
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	spills := &spillSlots{}
	for attempt := 0; ; {
		if leaving(cfg.Leave) {
			return nil // asked to stop while not joined: nothing held, nothing to hand over
		}
		conn, welcome, err := Dial(ctx, ConnConfig{URL: wsURL, Hello: hello, Key: key, Logger: cfg.Logger, HTTP: cfg.HTTP})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// Only another protocol version, a ban and a server that is no coordinator are final. A coordinator at its cap of
			// workers (proto.ErrCodeBusy) or a private job refusing this worker
			// (proto.ErrCodeForbidden) may take it later: those are retried with the same growing
			// backoff as an unreachable coordinator, which keeps a crowd of refused workers from
			// knocking in step.
			if errors.Is(err, proto.ErrProtocolVersion) || errors.Is(err, ErrNotCoordinator) {
				return err
			}
			if isBanned(err) {
				return bannedErr(cfg.Logger, err)
			}
			if pe := (*proto.Error)(nil); errors.As(err, &pe) && pe.Code == proto.ErrCodeIdentity {
				return fmt.Errorf("the coordinator does not accept this worker's identity proof: %w", err)
			}
			d := Backoff(attempt, cfg.BackoffBase, cfg.BackoffMax, r)
			cfg.Logger.Warn("cannot reach the coordinator; retrying", "err", err, "in", d.Round(time.Millisecond))
			board.update(func(s *Status) { s.State, s.Err = StateReconnecting, err.Error() })
			attempt++
			select {
			case <-ctx.Done():
				return nil
			case <-cfg.Leave:
				return nil // nothing held: nothing to hand over
			case <-time.After(d):
			}
			continue
		}
		// Rejoin under the same id after a reconnect, proving the claim with the credential that
		// came with it: the coordinator grants an id only to its session's holder.
		hello.WorkerID, hello.Session = welcome.WorkerID, welcome.Session
		cfg.Logger.Info("joined", "id", welcome.WorkerID)
		// A new connection holds nothing until the coordinator assigns it a shard again.
		board.update(func(s *Status) {
			s.State, s.Err, s.WorkerID = StateJoined, "", welcome.WorkerID
			s.PlanVersion, s.Shard = 0, nil
		})
		s := newSession(cfg, conn, welcome)
		s.board, s.key, s.spills, s.uplink = board, key, spills, uplink
		joined := time.Now()
		err = s.serve(ctx)
		// A session that lasted a while resets the backoff; one that ended at once (refused by a
		// private job, dropped for a protocol error) keeps backing off rather than knocking again
		// and again.
		if time.Since(joined) > 10*time.Second {
			attempt = 0
		}
		if errors.Is(err, errDrained) && leaving(cfg.Leave) {
			conn.Leave(leaveReason(cfg))
			cfg.Logger.Info("let go by the coordinator at a step boundary: leaving")
			return nil
		}
		if errors.Is(err, errDrained) {
			conn.Leave("drained by the admin")
			cfg.Logger.Info("drained by the coordinator's admin: leaving")
			board.update(func(s *Status) { s.Err = "drained by the coordinator's admin" })
			return nil
		}
		if isBanned(err) {
			conn.Close()
			return bannedErr(cfg.Logger, err)
		}
		if errors.Is(err, errLeftOnAudit) || errors.Is(err, errLeftInExchange) || errors.Is(err, errLeftOnGive) || errors.Is(err, errLeftMidStep) {
			conn.Close() // no goodbye: as a process that exits
			cfg.Logger.Error("leaving: " + err.Error())
			return err
		}
		if leaving(cfg.Leave) {
			// Asked to leave, and the session ended before the coordinator let it go (the
			// coordinator went away, or ctx ended): no rejoining.
			conn.Leave(leaveReason(cfg))
			return nil
		}
		if ctx.Err() != nil {
			reason := "worker stopping"
			if c := context.Cause(ctx); c != nil && c != ctx.Err() {
				reason = c.Error()
			}
			conn.Leave(reason)
			return nil
		}
		conn.Close()
		d := Backoff(attempt, cfg.BackoffBase, cfg.BackoffMax, r)
		attempt++
		cfg.Logger.Warn("connection to the coordinator lost; reconnecting", "err", err, "in", d.Round(time.Millisecond))
		board.update(func(s *Status) { s.State, s.Err = StateReconnecting, err.Error() })
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(d):
		}
	}
}

// leaveReason is why cfg's worker leaves once its Leave is closed (WorkerConfig.LeaveReason).
func leaveReason(cfg WorkerConfig) string {
	if cfg.LeaveReason != nil {
		if r := cfg.LeaveReason(); r != "" {
			return r
		}
	}
	return "worker stopping"
}

// leaving reports whether leave (WorkerConfig.Leave) is closed.
func leaving(leave <-chan struct{}) bool {
	select {
	case <-leave:
		return true
	default:
		return false
	}
}

// isBanned reports whether err is the coordinator's word that an audit found this worker's
// results false (proto.ErrCodeBanned), on a hello or ending a connection.
func isBanned(err error) bool {
	var pe *proto.Error
	return errors.As(err, &pe) && pe.Code == proto.ErrCodeBanned
}

// bannedErr says loudly why a banned worker stops: rejoining would only be refused again, and a
// worker whose results an audit found false (broken hardware, a bad build) needs its operator.
func bannedErr(log *slog.Logger, err error) error {
	log.Error("banned by the coordinator: an audit found this worker's results false; stopping", "err", err)
	return fmt.Errorf("banned: %w", err)
}

// kernelFamily is the arithmetic cfg's shards compute with (proto.Kernels*): whether the
// coordinator can audit this worker's steps bit for bit on its own kernels. "" is a device this
// worker cannot vouch for, compared within tolerances.
func kernelFamily(cfg WorkerConfig) string {
	if cfg.Backend == proto.BackendWebGPU {
		return proto.KernelsWebGPU
	}
	if cfg.Backend == proto.BackendVulkan {
		return proto.KernelsVulkan
	}
	if _, host := cfg.Device.(model.Host); cfg.Device != nil && !host {
		return ""
	}
	if kernels.ISA() == kernels.PureGo {
		return proto.KernelsPortable
	}
	return proto.KernelsFMA
}

func wsURLOf(base string) (string, error) {
	u, err := url.Parse(base)
	if err != nil {
		return "", fmt.Errorf("coordinator URL %q: %w", base, err)
	}
	switch u.Scheme {
	case "http":
		u.Scheme = "ws"
	case "https":
		u.Scheme = "wss"
	case "ws", "wss":
	default:
		return "", fmt.Errorf("coordinator URL %q: want http://host:port or https://host:port", base)
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + "/ws"
	return u.String(), nil
}

// MeasureGFLOPS times the kernels on a training-sized multiply: what the planner weighs peers by.
func MeasureGFLOPS() float64 {
	const m, k, n = 256, 256, 256
	a, b, c := make([]float32, m*k), make([]float32, k*n), make([]float32, m*n)
	for i := range a {
		a[i], b[i] = float32(i%7)*0.1, float32(i%5)*0.1
	}
	kernels.MatMulNT(c, a, b, m, k, n, false)
	best := time.Duration(1 << 62)
	for rep := 0; rep < 5; rep++ {
		t0 := time.Now()
		kernels.MatMulNT(c, a, b, m, k, n, false)
		best = min(best, time.Since(t0))
	}
	return 2 * m * k * n / best.Seconds() / 1e9
}

// session is one connection's worth of serving: the shard survives only as long as the plan
// that assigned it, and a new connection waits for a new Assign.
type session struct {
	cfg     WorkerConfig
	key     ed25519.PrivateKey // signs outer-step contributions (RunWorker)
	conn    *Conn
	welcome *proto.Welcome
	log     *slog.Logger
	board   *statusBoard // nil: nobody listens
	// peakLogged is the peak resident memory last logged (peakRSS).
	peakLogged int64
	// http is the client of the coordinator's HTTP server (coordinatorHTTP), spills the uploads
	// in flight, shared by the worker's sessions.
	http   *http.Client
	spills *spillSlots
	uplink *Uplink // nil: uploads unpaced

	// plane is the data plane of the plan the executor set up last (plane.go): the frame handler,
	// serve and the plane's links load it; the executor alone publishes a new one, and serve
	// puts planeEnded in its place when the session ends. planeUp wakes serve once one is
	// published, to hand it what it heard for that plan early.
	plane   atomic.Pointer[plane]
	planeUp chan struct{}
	// dropped counts the relayed frames dropped unread because their sender is not a neighbour
	// under the current plan, or their plan is not the current one.
	dropped atomic.Int64
	// framesHandled counts the frames the frame handler is done with, whatever became of them: a
	// test that has sent n waits for n before it reads the plane's reassemblers.
	framesHandled atomic.Int64

	// work carries the coordinator's requests from serve to the executor, each with the context
	// it runs under; fail the data plane's failures from the frame handler and the links to serve.
	work chan work
	fail chan planFailure

	// Owned by the executor goroutine.
	spec   job.Spec
	assign *proto.Assign
	// outerBroken is the plan whose last outer step this stage refused or could not complete
	// (outerFailed), 0 for none:
	// it takes no step of that plan again.
	outerBroken uint32
	runner      shardRunner
	net         *workerNet
	trainer     *trainer // runs runner's training steps: commitments, evidence, SHOAL_FAULT
	lr          map[uint64]float64
	// next is the training step the shard's state is at: it holds the updates of the steps
	// before it (restored, initialised, or applied here) and none after.
	next uint64
}

func newSession(cfg WorkerConfig, conn *Conn, w *proto.Welcome) *session {
	s := &session{cfg: cfg, conn: conn, welcome: w, log: cfg.Logger.With("worker", w.WorkerID), planeUp: make(chan struct{}, 1),
		work: make(chan work, 256), fail: make(chan planFailure, 1), lr: map[uint64]float64{}, spills: &spillSlots{}}
	s.plane.Store(&plane{}) // before any Assign: every frame is dropped
	var err error
	if s.http, err = coordinatorHTTP(cfg.Coordinator, cfg.HTTP); err != nil {
		// RunWorker checked the URL: only a test gets here, and its requests are refused.
		s.http = &http.Client{Transport: failingTransport{err}}
	}
	conn.SetFrameHandler(s.onFrame)
	return s
}

// failingTransport refuses every request with its error.
type failingTransport struct{ err error }

func (f failingTransport) RoundTrip(*http.Request) (*http.Response, error) { return nil, f.err }

// stall is how long a request to the coordinator may make no progress.
func (s *session) stall() time.Duration {
	if s.cfg.StallTimeout > 0 {
		return s.cfg.StallTimeout
	}
	return DefaultStallTimeout
}

// onFrame reassembles binary frames from the coordinator: direct ones (from == "") are the
// coordinator's own tensors, relayed ones come from a neighbour in relay mode. A relayed frame
// from a worker that is not a neighbour under the current plan, or of an older plan, is dropped
// unread: the coordinator relays what anyone sends, and an error caused by a message from outside
// the plan drops that message, never the step. A neighbour that sends what the plan does not
// have it send has broken the protocol, and fails the plan's data plane as a malformed frame does.
// It runs on the connection's reader goroutine, the only one that touches a plane's reassemblers.
func (s *session) onFrame(from string, frame []byte) {
	defer s.framesHandled.Add(1)
	p := s.plane.Load() // once: the frame is judged, filed and delivered by one plan
	if p == planeEnded {
		return
	}
	t, done, err := p.reassemble(from, frame)
	switch {
	case errors.Is(err, ErrNotNeighbour) || errors.Is(err, proto.ErrStalePlan):
		s.dropped.Add(1)
		s.log.Debug("frame from outside the plan dropped", "from", from, "err", err)
		return
	case err == nil && done:
		switch {
		case from == "":
			err = p.coord.Deliver(t)
		case p.adm.pooled(from):
			err = p.box.DeliverOnce(t) // a stage takeover's: see Mailbox.DeliverOnce
		default:
			err = p.box.Deliver(t)
		}
		if errors.Is(err, ErrClosed) {
			return // replaced by a new plan's data plane, or the session is ending
		}
	}
	if err != nil {
		s.failWith(p.version, from, fmt.Errorf("bad tensor frame from %s: %w", senderName(from), err))
	}
}

// planFailure is a data-plane failure under plan version, of the link to peer ("" when it is not
// one peer's).
type planFailure struct {
	version uint32
	peer    string
	err     error
}

func (s *session) failWith(version uint32, peer string, err error) {
	select {
	case s.fail <- planFailure{version, peer, err}:
	default:
	}
}

// work is a request of the coordinator for the executor, with the context serve gives it
// (control.start) when a later message can make it moot — an Assign, a step, an outer step — and
// nil for the rest, which run under the session's. end, if set, is called once it is done.
type work struct {
	m   proto.Message
	ctx context.Context
	end context.CancelCauseFunc
	// outcome, instead of m: a delayed outer step's exchange ended (awaitDelayed).
	outcome *outerOutcome
}

// serve reads the coordinator's messages, and owns what the session knows of the plans and steps
// in flight (plane.go): it answers what concerns the data plane itself (signals, departures,
// failures) and hands the rest to the executor in order.
func (s *session) serve(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// serve's alone, as locals: the plans and steps in flight, and what was heard early for a
	// plan whose data plane is not open yet.
	var ctl control
	var heard early
	done := make(chan error, 1)
	go func() { done <- s.execute(ctx) }()
	defer func() {
		cancel()
		// An executor publishing a plane after this finds planeEnded, and closes it itself.
		s.plane.Swap(planeEnded).close()
	}()
	forward := func(w work) error {
		select {
		case s.work <- w:
			return nil
		case <-ctx.Done():
			if w.end != nil {
				w.end(context.Canceled)
			}
			return ctx.Err()
		}
	}
	leave := s.cfg.Leave
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-leave:
			// Once: the coordinator answers with a drain's Bye at its next step boundary.
			leave = nil
			reason := leaveReason(s.cfg)
			s.log.Info("asked to stop: leaving at the job's next step boundary", "reason", reason)
			if err := s.conn.Send(ctx, &proto.Leaving{Reason: reason}); err != nil {
				return err
			}
		case err := <-done:
			return err
		case <-s.planeUp:
			heard.handOver(s.plane.Load(), s.log)
		case f := <-s.fail:
			// A neighbour failed or sent garbage: the coordinator abandons the step and replans;
			// this worker stays connected and waits for its next assignment.
			s.log.Warn("data plane failure", "plan", f.version, "err", f.err)
			if err := s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: f.err.Error(), PlanVersion: f.version, Peer: f.peer}); err != nil {
				return err
			}
		case <-s.conn.Done():
			return s.conn.Err()
		case m, ok := <-s.conn.Messages():
			if !ok {
				return s.conn.Err()
			}
			var err error
			switch m := m.(type) {
			case *proto.Signal:
				heard.signal(s.plane.Load(), *m, s.log)
			case *proto.PeerLeft:
				// Here, not in execute: what it ends is what execute may be waiting on.
				heard.peerLeft(s.plane.Load(), m, s.log)
			case *proto.OuterSync:
				// An outer step asked again abandons the earlier attempt still running here.
				ctl.retry(m)
				wctx, end := ctl.start(ctx, m.PlanVersion, m)
				err = forward(work{m: m, ctx: wctx, end: end})
			case *proto.Assign:
				// A new plan abandons whatever step of the old one is still running here.
				ctl.assign(m.PlanVersion)
				wctx, end := ctl.start(ctx, m.PlanVersion, nil)
				err = forward(work{m: m, ctx: wctx, end: end})
			case *proto.StepOpen:
				if p := s.plane.Load(); p.version == m.PlanVersion && !m.Eval {
					// Open to reroutes from here, in the order the coordinator sends: one
					// that follows this open waits for the step.
					p.reroutes.begin(m.Step)
				}
				wctx, end := ctl.start(ctx, m.PlanVersion, nil)
				err = forward(work{m: m, ctx: wctx, end: end})
			case *proto.StepReroute:
				// The step in flight takes it up where it stands; one reported already is
				// re-entered by the executor.
				if p := s.plane.Load(); p.version == m.PlanVersion && p.reroutes.offer(m) {
					break
				}
				wctx, end := ctl.start(ctx, m.PlanVersion, nil)
				err = forward(work{m: m, ctx: wctx, end: end})
			case *proto.Bye:
				if m.Reason == proto.ByeDrain {
					return errDrained
				}
				return fmt.Errorf("coordinator said goodbye: %s", m.Reason)
			case *proto.Error:
				s.log.Warn("coordinator reports an error", "err", m)
			default:
				err = forward(work{m: m})
			}
			if err != nil {
				return err
			}
		}
	}
}

// publish makes p the session's data plane and closes the one it replaces, whole; serve is woken
// to hand p what it heard for p's plan early. It fails, closing p, once the session has ended.
func (s *session) publish(p *plane) error {
	old := s.plane.Load()
	// Only serve's end changes the plane beside the executor: a failed swap is the session's end.
	if old == planeEnded || !s.plane.CompareAndSwap(old, p) {
		p.close()
		return fmt.Errorf("plan %d: %w", p.version, ErrClosed)
	}
	old.close()
	select {
	case s.planeUp <- struct{}{}:
	default: // serve is woken already, and loads the newest plane
	}
	return nil
}

// execute runs the coordinator's requests one at a time, in order: it owns the shard.
func (s *session) execute(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case w := <-s.work:
			err := s.do(ctx, w)
			if w.end != nil {
				w.end(context.Canceled)
			}
			if err != nil {
				return err
			}
		}
	}
}

// do runs w; ctx is the session's, under which it answers the coordinator.
func (s *session) do(ctx context.Context, w work) error {
	// The digest of the last update runs beside a training step, which only reads the state;
	// anything else may read the digest or change the state, and waits for it (trainer.settle).
	switch m := w.m.(type) {
	case *proto.StepOpen:
		if m.Eval {
			s.trainer.settle()
		}
	case *proto.StepReroute:
	default:
		s.trainer.settle()
	}
	if err := s.momentumGate(ctx, w); err != nil {
		return err
	}
	if w.outcome != nil {
		return s.delayedOutcome(ctx, w.outcome)
	}
	switch m := w.m.(type) {
	case *proto.Assign:
		// A newer plan cancels this assignment, as it does a step in flight (control): a
		// worker waiting on a neighbour of a plan already abandoned (one that left while the
		// plan loaded) would otherwise wait out its ICE timeout before it heard of the next.
		actx, cancel := context.WithCancel(w.ctx)
		defer cancel()
		if errors.Is(context.Cause(actx), errSuperseded) {
			s.log.Info("assignment superseded by a newer plan", "plan", m.PlanVersion)
			return nil
		}
		if err := s.assignShard(actx, m); err != nil {
			if actx.Err() != nil && ctx.Err() == nil {
				s.log.Info("assignment superseded by a newer plan", "plan", m.PlanVersion)
				return nil
			}
			if ctx.Err() != nil {
				// The session is ending: what cut the assignment short is not the job's to
				// answer (an invalid job restores), its departure is.
				return ctx.Err()
			}
			if errors.Is(err, errLeftOnGive) {
				return err
			}
			s.log.Error("assignment failed", "err", err)
			code := proto.ErrCodeJobInvalid
			if _, ok := errors.AsType[*memoryError](err); ok || errors.Is(err, errOuterDisk) {
				// No room for the shard, in memory or for the outer state on disk: it would
				// refuse again, and the coordinator plans without it.
				code = proto.ErrCodeMemory
			}
			peer := ""
			if pe, ok := errors.AsType[*PeerError](err); ok && slices.Contains(proto.Givers(m.From), pe.Peer) {
				// The state's giver went silent: a data-plane failure on its link, which the
				// coordinator takes for its departure's when it leaves (it reshares or drops
				// rather than restoring).
				code, peer = proto.ErrCodeStep, pe.Peer
			}
			return s.conn.Send(ctx, &proto.Error{Code: code, Message: err.Error(), PlanVersion: m.PlanVersion, Peer: peer})
		}
		s.board.update(func(st *Status) {
			st.Job, st.JobSteps, st.Model = m.Job, s.spec.Steps, modelText(s.spec)
			st.PlanVersion, st.Shard = m.PlanVersion, shardStatus(m)
		})
		r := &proto.Ready{PlanVersion: m.PlanVersion}
		if (m.Keep != nil || len(m.From) > 0) && s.trainer.audits {
			r.State = s.trainer.conduct.readyState(s.trainer.state) // FaultFalseKept
			if len(m.Give) > 0 {
				// What it gave, tensor by tensor: a taker of several givers' blocks names the
				// state the coordinator composes from each giver's (grow.go).
				if sr, ok := s.runner.(*StageRunner); ok && sr.Outer != nil {
					r.Gave, r.Sums = sr.Outer.gaveDigest()
				} else {
					r.Sums = slices.Clone(s.trainer.sums)
				}
			}
		}
		return s.conn.Send(ctx, r)
	case *proto.StepOpen:
		return s.runStep(ctx, w.ctx, m)
	case *proto.StepReroute:
		return s.rerouteStep(ctx, w.ctx, m)
	case *proto.Clip:
		if s.runner == nil || m.PlanVersion != s.assign.PlanVersion {
			return nil
		}
		lr, ok := s.lr[m.Step]
		if !ok {
			return nil // the step was abandoned here
		}
		delete(s.lr, m.Step)
		// The step's tokens and targets that a reroute could still have needed (runStep), and
		// the gradient nodes of it nobody took: a reroute's superseded ones, or what a reduce
		// peer sent beyond what this stage waited for (admission lets a peer send any node
		// outside this stage's own run, since a reroute may widen the peer's mid-step) — held
		// no longer than the step, so that they cannot pile up in the mailbox step after step.
		s.net.coord.Discard(func(k proto.TensorKey) bool { return k.Step == m.Step })
		s.net.box.Discard(func(k proto.TensorKey) bool { return k.Kind == proto.KindGradReduce && k.Step == m.Step })
		s.trainer.apply(m.Step, m.PlanVersion, lr, float32(m.Factor))
		s.next = m.Step + 1
		if err := s.takeUp(ctx); err != nil {
			return err
		}
		// The peak after a whole step (the update included) is the shard's, to set beside what
		// the worker offered: logged as it grows, by a tenth at least.
		if rss := peakRSS(); rss > s.peakLogged+s.peakLogged/10 {
			s.peakLogged = rss
			s.log.Info("memory", "step", m.Step, "peak_rss", rss, "offered", s.cfg.MemoryBytes)
		}
	case *proto.OuterSync:
		return s.outerStep(ctx, w.ctx, m)
	case *proto.OuterCommit:
		return s.outerCommit(ctx, m)
	case *proto.Checkpoint:
		return s.checkpoint(ctx, m)
	case *proto.Audit:
		return s.audit(ctx, m)
	}
	return nil
}

// stepMicroBatches is how many micro-batches a training step opened on the stage a assigns has:
// the job's M, or with own batches (outer mode) its replica's n_r, the micro-batches of the
// replica's own batch (job.Spec.OwnBatches), which the coordinator opens each replica's step with.
func stepMicroBatches(spec job.Spec, a *proto.Assign) int {
	if r := a.Replica; spec.OwnBatches() && r != nil && a.Shard.Stage != nil {
		return r.MicroBatches
	}
	return spec.MicroBatches
}

// stepShape refuses a step, or an evaluation, of another shape than the job's: training steps of
// stepMicroBatches micro-batches of B/M rows, evaluations in data.ValWindows/p passes of
// p = job.Spec.ValPassRows rows. The coordinator says both; a worker takes only what its Assign's
// memory check counted.
func stepShape(spec job.Spec, a *proto.Assign, m *proto.StepOpen) error {
	rows, micro, what := spec.BatchSize/spec.MicroBatches, stepMicroBatches(spec, a), "step"
	if m.Eval {
		rows = spec.ValPassRows()
		micro, what = data.ValWindows/rows, "evaluation"
	}
	if m.Rows != rows || m.MicroBatches != micro {
		return fmt.Errorf("%s %d of %d micro-batches of %d rows: the job has %d of %d for this shard", what, m.Step, m.MicroBatches, m.Rows, micro, rows)
	}
	return nil
}

// runStep runs the step m opens under wctx, which a newer plan's Assign ends (control); ctx is
// the session's.
func (s *session) runStep(ctx, wctx context.Context, m *proto.StepOpen) error {
	if s.runner == nil || m.PlanVersion != s.assign.PlanVersion {
		return nil // a step of a plan this worker no longer holds
	}
	if r, ok := s.runner.(*StageRunner); ok && m.Eval && r.Outer != nil && r.Outer.pending != nil {
		// An evaluation is of the latest outer step's θ: a delayed one's exchange must be over,
		// and its failure is answered as the take-up's would be.
		if err := r.settleOuter(); err != nil {
			if err := s.outerFailed(ctx, r.Outer.pending.step, err); err != nil {
				return err
			}
		}
	}
	if s.outerBroken != 0 && s.outerBroken == m.PlanVersion {
		step := m.Step
		return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: "this stage refused or could not complete the plan's last outer step: it waits for a new plan", Step: &step, PlanVersion: m.PlanVersion})
	}
	if r, ok := s.runner.(*StageRunner); ok {
		if r.Outer != nil && r.Outer.pending != nil && !m.Eval && m.Step > uint64(r.Outer.pending.takeUp) {
			// The step after the take-up needs the delayed outer step committed and taken up.
			step := m.Step
			return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: fmt.Sprintf("step %d before the delayed outer step after step %d is committed", m.Step, r.Outer.pending.step), Step: &step, PlanVersion: m.PlanVersion})
		}
		if why := r.outerUncommitted(); why != "" {
			// θ_r is not the outer step's θ yet: no step may start from it.
			step := m.Step
			return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: why, Step: &step, PlanVersion: m.PlanVersion})
		}
	}
	st := proto.StepSpec{Step: m.Step, PlanVersion: m.PlanVersion, MicroBatches: m.MicroBatches, Rows: m.Rows}
	// Give up a little before the coordinator does, so that it hears this worker's failure
	// before its own deadline and can tell a peer that failed from one that went silent.
	sctx, cancel := context.WithTimeout(wctx, time.Duration(m.DeadlineMS)*time.Millisecond*9/10)
	defer cancel()
	var rep *proto.StepReport
	var err error
	if err = stepShape(s.spec, s.assign, m); err != nil {
		// A shape the job does not have: what the shard would allocate for it was never
		// checked against its memory.
	} else if m.Eval {
		rep, err = s.runner.RunEval(sctx, st)
	} else {
		rep, err = s.trainer.step(sctx, st)
	}
	if err != nil || m.Eval {
		// A training step's tokens and targets stay until its Clip: a reroute heard after the
		// report may add micro-batches whose inputs came already.
		s.net.coord.Discard(func(k proto.TensorKey) bool { return k.Step == m.Step })
	}
	if errors.Is(err, errLeftMidStep) {
		return err // as a process that exits: no word of the step
	}
	if err != nil {
		return s.stepFailed(ctx, m.Step, m.PlanVersion, err)
	}
	if !m.Eval {
		s.lr[m.Step] = m.LR
	}
	return s.reported(ctx, m.Step, m.Rows, m.Eval, 0, rep)
}

// stepFailed tells the coordinator that step of plan failed here with err.
func (s *session) stepFailed(ctx context.Context, step uint64, plan uint32, err error) error {
	if ctx.Err() != nil {
		return ctx.Err() // the session is ending: its departure is what the coordinator answers
	}
	s.log.Warn("step failed", "step", proto.TrainingStep(step), "err", err)
	// The plan names the failure: one of a step abandoned for a new plan must not be taken for
	// the failure of the same step under it. A step lost on a link names the neighbour: if it is
	// leaving, the coordinator answers its departure (a reroute, a reshare) rather than a failure
	// between two that stay (a restore).
	var pe *PeerError
	peer := ""
	if errors.As(err, &pe) {
		peer = pe.Peer
	}
	return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: err.Error(), Step: &step, PlanVersion: plan, Peer: peer})
}

// reported sends the coordinator rep, the report of step (an evaluation's when eval), which a
// reroute made of added more micro-batches than an earlier report of it had.
func (s *session) reported(ctx context.Context, step uint64, rows int, eval bool, added int, rep *proto.StepReport) error {
	rep.Timings.BytesSent = s.net.sent.Swap(0)
	if !eval {
		// A replica's stage computes its replica's micro-batches of the step, not all of them
		// (more when a reroute added some).
		n := s.spec.MicroBatches
		if a := s.assign; a != nil && a.Replica != nil && a.Shard.Stage != nil {
			n = a.Replica.MicroBatches
			if r, ok := s.runner.(*StageRunner); ok && r.cur != nil {
				n = r.cur.hi - r.cur.lo
			}
		}
		s.board.stepDone(step, rows, rep, s.spec, n, added, s.net.links())
	} else {
		s.board.update(func(st *Status) { st.Evaluations++ })
	}
	return s.conn.Send(ctx, rep)
}

// rerouteStep takes up reroute m of a step this stage reported and has not applied yet
// (StageRunner.Reroute), and reports the step again.
func (s *session) rerouteStep(ctx, wctx context.Context, m *proto.StepReroute) error {
	r, ok := s.runner.(*StageRunner)
	if _, reported := s.lr[m.Step]; !ok || !reported || m.PlanVersion != s.assign.PlanVersion {
		return nil // a step abandoned here, or of a plan this worker no longer holds
	}
	if r.cur == nil {
		return nil
	}
	sctx, cancel := context.WithDeadline(wctx, r.cur.until)
	defer cancel()
	before := r.cur.hi - r.cur.lo
	rows := r.cur.st.Rows
	rep, err := s.trainer.reroute(sctx, m)
	if err != nil {
		delete(s.lr, m.Step)
		s.net.coord.Discard(func(k proto.TensorKey) bool { return k.Step == m.Step })
		return s.stepFailed(ctx, m.Step, m.PlanVersion, err)
	}
	return s.reported(ctx, m.Step, rows, false, max(r.cur.hi-r.cur.lo-before, 1), rep)
}

// assignShard builds the shard of a plan, restores or initialises it, and opens the data plane to
// its neighbours.
func (s *session) assignShard(ctx context.Context, a *proto.Assign) error {
	spec, err := job.Parse(a.Spec)
	if err != nil {
		return err
	}
	if err := checkHandover(spec, a); err != nil {
		return err
	}
	// A shard kept from the last plan keeps the evidence of that plan's last step too: the
	// coordinator may audit it against the state this worker kept (proto.Ready.State). Otherwise
	// the evidence is moot: the coordinator audits only steps of the plan a worker holds.
	var kept *model.Shard
	if k := a.Keep; k != nil {
		if kept, err = s.keepable(spec, a); err != nil {
			err = fmt.Errorf("keep the shard of plan %d at step %d: %w", k.FromPlan, k.Step, err)
		}
	}
	if kept == nil && s.trainer != nil {
		s.trainer.dropEvidence()
	}
	if err != nil {
		return err
	}
	// Refuse a shard larger than this worker offered before allocating any of it.
	if err := checkMemory(spec, a, s.cfg.MemoryBytes); err != nil {
		return err
	}
	me := s.welcome.WorkerID
	var keptRunner shardRunner
	if kept != nil {
		keptRunner = s.runner
	}
	b, err := buildShardKeeping(s.device(), spec, a, me, keptRunner)
	if err != nil {
		return err
	}
	sh, hosted, siblings, neighbours := b.sh, b.hosted, b.siblings, b.neighbours
	if sr, ok := b.runner.(*StageRunner); ok && a.Replica != nil && s.cfg.MemoryBytes > 0 {
		sr.fits = widenedFits(spec, a, s.cfg.MemoryBytes) // what a reroute or a takeover widens
	}
	outer, _ := b.runner.(*StageRunner)
	if outer != nil && outer.Outer == nil {
		outer = nil
	}
	if outer != nil {
		outer.Outer.key, outer.Outer.job = s.key, a.Job
	}
	// next is taken up with the runner at the end: an assignment that fails or is superseded
	// halfway leaves the shard held, and the step it is at, as they were.
	next := s.next
	switch {
	case kept != nil:
		// A step abandoned when the plan changed left its gradients: the step is computed again.
		sh.ZeroGrads()
		if old, ok := keptRunner.(*StageRunner); outer != nil && ok && old.Outer == nil {
			// The synchronous warm-up's end (warmingOut): outer mode starts from the state.
			sh.Pull()
			if err := outer.Outer.warmStart(sh.P); err != nil {
				return err
			}
		} else if outer != nil {
			outer.Outer.outer.Grown() // a replica joins without a restore (handover.go)
		}
	case len(a.From) > 0:
		next = a.From[0].Step // filled once the data plane is open (takeState)
	case a.Restore != nil:
		if err := s.restore(ctx, spec, sh, a.Restore, outer); err != nil {
			return err
		}
		next = a.Restore.Step
	default:
		sh.Init(spec.Seed)
		if outer != nil {
			outer.Outer.global.CopyFrom(sh.P) // every replica starts from θ_0, the first global θ
		}
		next = 0
	}
	// The plan's data plane, built whole before anything can reach it: from when it is published
	// frames are admitted as this plan says — only from the neighbours it names, only the tensors
	// each of them sends, no larger than this job's, within one budget — and the previous plan's
	// is closed, whole.
	ad := newAdmission(me, a, spec, sh, neighbours, hosted, siblings, b.links)
	pl := newPlane(a.PlanVersion, ad)
	if sr, ok := b.runner.(*StageRunner); ok && sr.Replica != nil && sr.Outer == nil && sr.Dispatch == nil && len(sr.links) > 0 {
		// A step-mode replica's stage without expert hosts: the coordinator may reroute its steps.
		sr.reroutes = newRerouteBox(a.PlanVersion)
		pl.reroutes = sr.reroutes
	}
	var waits stateWaits
	if len(a.From) > 0 {
		if waits, err = expectState(pl.box, spec, sh, a.PlanVersion, a.From[0].Step); err != nil {
			return err
		}
	}
	wn := &workerNet{coord: pl.coord, box: pl.box, relay: &relayNet{conn: s.conn, uplink: s.uplink}, viaRelay: map[string]bool{}, pool: map[string]bool{}}
	for _, pool := range []map[string]bool{ad.prevPool, ad.nextPool} {
		for p := range pool {
			wn.pool[p] = true
		}
	}
	// A link that fails while connecting falls back to the relay (below); only a failure of an
	// established link breaks the step, and is reported to the coordinator.
	var established atomic.Bool
	if a.Relay {
		for _, p := range neighbours {
			wn.viaRelay[p] = true
		}
	} else {
		// A link to another replica's stage only (outer steps, gradient nodes) stops only what
		// waits on it: that replica may be dropped (outer mode) or rerouted around (step mode),
		// and the others go on. So does a link that only carries a handover of state.
		contained := func(p string) bool { return outerPartnerOnly(a, p) || handoverOnly(a, p) }
		pl.rtc = NewRTCTransport(me, RTCConfig{Loopback: s.welcome.Loopback, ICEServers: s.welcome.ICEServers, RelayOnly: s.welcome.ICERelayOnly,
			Net: s.cfg.Network, Mailbox: pl.box, Uplink: s.uplink, Limits: ad.lim, Admit: ad.check,
			// Never nil, which would let any peer in: a worker without neighbours talks to nobody.
			Neighbours: append([]string{}, neighbours...),
			Contained:  contained,
			Logger:     s.log, OnPeerFailed: func(p string, err error) {
				// Failures of a plan this worker has moved on from (its transport closing) are
				// nobody's business.
				current := s.plane.Load() == pl
				if current && established.Load() && !wn.viaRelay[p] && !contained(p) {
					s.failWith(a.PlanVersion, p, fmt.Errorf("neighbour %s: %w", p, err))
				}
			}}, planSignaler{s, a.PlanVersion})
		pl.rtc.SetPlanVersion(a.PlanVersion)
	}
	if err := s.publish(pl); err != nil {
		return err
	}
	// A failure reported by the previous plan's data plane is moot now.
	select {
	case <-s.fail:
	default:
	}
	if rtc := pl.rtc; rtc != nil {
		// Signals and departures heard for this plan before now are handed to rtc by serve,
		// which publish woke; a departure heard during Connect ends it as well.
		// Connect to both neighbours at once: each waits for the other side's answer.
		errs := make([]error, len(neighbours))
		var wg sync.WaitGroup
		for i, p := range neighbours {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, cancel := context.WithTimeout(ctx, s.cfg.ICETimeout)
				defer cancel()
				errs[i] = rtc.Connect(cctx, p, s.welcome.WorkerID < p)
			}()
		}
		wg.Wait()
		for i, p := range neighbours {
			if errs[i] != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				// ICE could not connect the two peers: their tensors go through the coordinator.
				s.log.Warn("WebRTC to neighbour failed; using the relay through the coordinator", "peer", p, "err", errs[i])
				rtc.Disconnect(p)
				wn.viaRelay[p] = true
			}
		}
		wn.rtc = rtc
		established.Store(true)
	}
	c, err := newConduct(s.cfg.Fault)
	if err != nil {
		return err
	}
	if kept != nil {
		c.kept(kept) // FaultPoisonKept
		var o *outerState
		if outer != nil {
			o = outer.Outer
		}
		if err := c.give(proto.Takers(a.Give)); err != nil {
			return err
		}
		missed, err := giveState(ctx, wn, spec, kept, o, a.PlanVersion, a.Keep.Step, a.Give)
		if err != nil {
			return err
		}
		if len(missed) > 0 {
			s.log.Warn("could not hand the state over; keeping the shard", "takers", missed)
		}
	}
	if len(a.From) > 0 {
		var o *outerState
		if outer != nil {
			o = outer.Outer
		}
		if err := takeState(ctx, waits, spec, sh, o, a.From, wn.peerDone); err != nil {
			return err
		}
		for _, f := range a.From {
			// A standby giver: nothing more crosses that link. In outer mode the momentum is
			// still on its way over it (takeState), and the link stays.
			if o == nil && handoverOnly(a, f.Worker) && wn.rtc != nil {
				wn.rtc.Disconnect(f.Worker)
			}
		}
	}
	t := newTrainer(b.runner, wn, spec.Audits(), c)
	if kept != nil && s.trainer != nil {
		// The evidence held goes on with the shard, and so do the uploads reading it from
		// memory: an audit of the previous plan's last step comes before this Assign, and its
		// upload may outlast the next Clip, which must not overwrite what it reads.
		t.held, t.snapshots = s.trainer.held, s.trainer.snapshots
	}
	// An outer state's pages stay resident between outer steps where the memory this worker
	// offered holds them beside the shard (outerArena.resident); a worker that offers no cap
	// keeps them too. What they take is not room for the spare below.
	offer := s.cfg.MemoryBytes
	if r, ok := b.runner.(*StageRunner); ok && r.Outer != nil {
		ar := r.Outer.arena
		if ar.resident = outerResident(spec, a, offer, ar.bytes()); ar.resident && offer > 0 {
			offer -= ar.bytes()
		}
	}
	// A second snapshot for uploads that outlast their step (snapshots.lent), where the memory
	// this worker offered holds the shard with one more copy of its state.
	if t.audits {
		room := offer - stateBytes(model.CheckpointTensors(sh.P, sh.Opt))
		t.spareOK = s.cfg.MemoryBytes <= 0 || room > 0 && checkMemory(spec, a, room) == nil
	}
	if why := c.idle(b.runner); why != "" {
		s.log.Warn("SHOAL_FAULT="+s.cfg.Fault+" cannot misbehave on this shard", "why", why)
	}
	s.spec, s.assign = spec, a
	s.lr = map[uint64]float64{}
	if old, ok := s.runner.(*StageRunner); ok && old.Outer != nil && (outer == nil || outer.Outer != old.Outer) {
		// The last plan's outer state, not kept: its file goes now, not at a collection that a
		// worker with a large heap may be several plans away from.
		old.Outer.close()
	}
	s.runner, s.net, s.trainer, s.next = b.runner, wn, t, next
	if st := a.Shard.Stage; st != nil {
		s.log.Info("assigned", "plan", a.PlanVersion, "stage", st.Index, "blocks", fmt.Sprintf("[%d,%d)", st.Begin, st.End),
			"hosted_experts", len(hosted), "restore", a.Restore != nil, "kept", kept != nil, "from", len(a.From), "gave", len(a.Give), "relay", a.Relay, "wire", spec.Wire.String())
	} else {
		s.log.Info("assigned", "plan", a.PlanVersion, "experts", fmt.Sprintf("block %d %v", a.Shard.Experts.Block, a.Shard.Experts.Experts),
			"replicated", len(siblings), "restore", a.Restore != nil, "relay", a.Relay, "wire", spec.Wire.String())
	}
	return nil
}

// keepable returns the shard this worker holds when assignment a may keep it (proto.Keep): the
// very shard — the same blocks of the same job, no experts on hosts, step mode — under the plan a
// names, holding every update before a's step and none after. Anything else is refused, and the
// coordinator restores instead: a kept state is the worker's word (it commits to it, Ready.State),
// never a guess.
func (s *session) keepable(spec job.Spec, a *proto.Assign) (*model.Shard, error) {
	k, old := a.Keep, s.assign
	switch {
	case old == nil || s.runner == nil:
		return nil, errors.New("this worker holds no shard")
	case old.PlanVersion > k.FromPlan:
		// An earlier plan is fine: the one named may have superseded it before this worker took
		// it up (a departure while the survivors got ready), its shard and step being the same.
		return nil, fmt.Errorf("this worker holds its shard under plan %d", old.PlanVersion)
	case old.Job != a.Job:
		return nil, errors.New("the shard held is another job's")
	case !bytes.Equal(old.Spec, a.Spec) && !warmingOut(old.Spec, spec, k):
		return nil, errors.New("the shard held is another job's, or of another spec")
	case (old.Shard.Stage == nil) != (a.Shard.Stage == nil):
		return nil, errors.New("the shard held is another kind of shard")
	case a.Shard.Stage != nil && (old.Shard.Stage.Begin != a.Shard.Stage.Begin || old.Shard.Stage.End != a.Shard.Stage.End):
		return nil, fmt.Errorf("the shard held is blocks [%d,%d), not [%d,%d)", old.Shard.Stage.Begin, old.Shard.Stage.End, a.Shard.Stage.Begin, a.Shard.Stage.End)
	case a.Shard.Experts != nil && !sameExperts(old.Shard.Experts, a.Shard.Experts):
		return nil, errors.New("the shard held is other experts")
	case !slices.EqualFunc(old.ExpertHosts, a.ExpertHosts, func(x, y proto.ExpertHost) bool {
		return x.Block == y.Block && x.Expert == y.Expert && slices.Equal(x.Workers, y.Workers)
	}):
		// A stage's state leaves out the experts on hosts, and a replicated expert's half of
		// the gradient tree is its place among its hosts: both are the shard's, kept only as
		// they were.
		return nil, errors.New("the experts on hosts are not the ones the shard held was built with")
	case s.next != k.Step:
		return nil, fmt.Errorf("the shard held has %d updates, not %d", s.next, k.Step)
	}
	if spec.Outer() && warmingOut(old.Spec, spec, k) {
		// The synchronous warm-up's end: a step-mode replica's stage becomes an outer-mode
		// one, its state the warm-up's (assignShard: warmStart).
		if r, ok := s.runner.(*StageRunner); !ok || r.Replica == nil || a.Replica == nil {
			return nil, errors.New("sync mode \"outer\" keeps only a replica's stage")
		}
		return s.runner.shard(), nil
	}
	if spec.Outer() {
		// An outer-mode stage keeps its replica's state and its share of the outer optimizer; a
		// delayed outer step still to be taken up would be this plan's to finish, which it cannot
		// know of.
		r, ok := s.runner.(*StageRunner)
		switch {
		case !ok || r.Outer == nil || a.Replica == nil || r.Replica == nil:
			return nil, errors.New("sync mode \"outer\" keeps only a replica's stage")
		case r.Replica.Index != a.Replica.Index:
			return nil, fmt.Errorf("the stage held is replica %d's, not %d's", r.Replica.Index, a.Replica.Index)
		case r.Outer.pending != nil && !r.Outer.pending.committed:
			return nil, errors.New("a delayed outer step is still pending")
		case s.outerBroken != 0 && s.outerBroken == old.PlanVersion:
			// Its last outer exchange failed or was refused part-way (outerFailed): some
			// segments may hold the new global θ and others the old one.
			return nil, errors.New("the stage's last outer step did not complete: its state is between two outer steps")
		case r.outerUncommitted() != "":
			return nil, errors.New("the stage's last outer step was not committed: " + r.outerUncommitted())
		}
	}
	return s.runner.shard(), nil
}

// warmingOut reports whether a shard held under a plan of spec old may be kept (k) into a plan of
// spec, an outer-mode job, at the end of its synchronous warm-up (job.Sync.Warmup): old is the
// warm-up's step-mode phase of spec (job.Spec.Phase) and k keeps the state after its last step.
func warmingOut(old json.RawMessage, spec job.Spec, k *proto.Keep) bool {
	w := spec.SyncWarmup()
	if w == 0 || k == nil || k.Step != uint64(w) {
		return false
	}
	o, err := job.Parse(old)
	if err != nil {
		return false
	}
	a, errA := json.Marshal(o)
	b, errB := json.Marshal(spec.Phase(0))
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// builtShard is an assignment's shard, as buildShard makes it.
type builtShard struct {
	sh     *model.Shard // all zero: the caller initialises or restores it
	runner shardRunner  // without a Transport: the caller sets one (setNet)
	// What the data plane admits: the remote experts a stage routes to, by their hosts in replica
	// order; a replicated expert's other replica; every peer the shard exchanges tensors with,
	// sorted.
	hosted     map[ExpertRef][]string
	siblings   map[ExpertRef]string
	neighbours []string
	links      []reduceLink // a replica's stage: what the other replicas' stages send it
}

// buildShard builds the shard that assignment a gives worker me, computing on dev, and the runner
// of its steps. A worker builds its own with it (assignShard), and an auditor the audited
// worker's (Recompute): one construction, so that the recomputation runs the very code the worker
// ran.
func buildShard(dev model.Device, spec job.Spec, a *proto.Assign, me string) (*builtShard, error) {
	return buildShardKeeping(dev, spec, a, me, nil)
}

// sameExperts reports whether x and y are the same expert shard: its block, experts, and its
// block's stage's place in the pipeline.
func sameExperts(x, y *proto.ExpertShard) bool {
	return x != nil && y != nil && x.Block == y.Block && slices.Equal(x.Experts, y.Experts) && x.StageIndex == y.StageIndex && x.StageCount == y.StageCount
}

// buildShardKeeping is buildShard around the shard of kept, the runner of a shard the worker
// holds already with its state (Assign.Keep; keepable said it is this assignment's), instead of a
// new one. A kept stage has the same experts on the same hosts (keepable), so the dispatch its
// experts were built with is this plan's too; a kept expert shard the same hosts for each
// replicated expert, so each keeps its half of the gradient tree.
func buildShardKeeping(dev model.Device, spec job.Spec, a *proto.Assign, me string, kept shardRunner) (*builtShard, error) {
	// The plan's depth must leave a micro-batch for steady state (proto bounds it already).
	if a.Depth < 0 || a.Depth >= max(spec.MicroBatches, 1) {
		return nil, fmt.Errorf("assignment at pipeline depth %d for a job of %d micro-batches (want 0 <= depth < micro_batches)", a.Depth, spec.MicroBatches)
	}
	b := &builtShard{hosted: map[ExpertRef][]string{}, siblings: map[ExpertRef]string{}}
	addNeighbour := func(p string) {
		if p != "" && p != me && !slices.Contains(b.neighbours, p) {
			b.neighbours = append(b.neighbours, p)
		}
	}
	var err error
	switch {
	case a.Shard.Stage != nil:
		st := a.Shard.Stage
		for _, h := range a.ExpertHosts {
			b.hosted[ExpertRef{h.Block, h.Expert}] = h.Workers
		}
		var disp *ExpertDispatch
		if kept != nil {
			old, ok := kept.(*StageRunner)
			if !ok {
				return nil, errors.New("the shard kept is no stage")
			}
			b.sh, disp = old.Shard, old.Dispatch
			if (disp != nil) != (len(b.hosted) > 0) {
				return nil, errors.New("the stage kept was built with other experts on hosts")
			}
		} else if b.sh, err = model.NewStageShardWithOn(dev, spec.Model, st.Begin, st.End,
			func(blk, e int) bool { return len(b.hosted[ExpertRef{blk, e}]) == 0 },
			func(local *model.LocalExperts) model.Experts {
				disp = &ExpertDispatch{Local: local, Hosts: b.hosted, C: spec.Model.NEmbd}
				return disp
			}); err != nil {
			return nil, err
		}
		// On a GPU a training step's losses and MoE statistics wait on the device for the step's
		// one read, with the norms (runStep takes them); on the CPU this changes nothing.
		b.sh.Stage.Defer = true
		addNeighbour(a.Prev)
		addNeighbour(a.Next)
		for _, f := range a.From {
			addNeighbour(f.Worker)
		}
		for _, g := range a.Give {
			addNeighbour(g.Worker)
		}
		for _, ws := range b.hosted {
			for _, w := range ws {
				addNeighbour(w)
			}
		}
		r := &StageRunner{Shard: b.sh, Index: st.Index, NumStages: st.Count, Prev: a.Prev, Next: a.Next,
			WeightDecay: spec.WeightDecay, Depth: a.Depth}
		if rep := a.Replica; rep != nil {
			switch {
			case len(b.hosted) > 0 && spec.Outer():
				return nil, errors.New("a pipeline replica with expert hosts in sync mode \"outer\": not supported (each replica keeps its experts, its own θ, with its stages)")
			case spec.OwnBatches() && (rep.First != 0 || rep.MicroBatches > spec.MaxOwnMicroBatches() || a.Depth >= rep.MicroBatches):
				return nil, fmt.Errorf("replica micro-batches [%d,%d) at depth %d of its own batch: want [0, n) with n at most %d", rep.First, rep.First+rep.MicroBatches, a.Depth, spec.MaxOwnMicroBatches())
			case !spec.OwnBatches() && (rep.First+rep.MicroBatches > spec.MicroBatches || a.Depth >= rep.MicroBatches):
				return nil, fmt.Errorf("replica micro-batches [%d,%d) at depth %d in a job of %d", rep.First, rep.First+rep.MicroBatches, a.Depth, spec.MicroBatches)
			case max(spec.MicroBatches, rep.MicroBatches) > proto.MaxReduceMicroBatches:
				return nil, fmt.Errorf("%d micro-batches: replicas reduce at most %d", spec.MicroBatches, proto.MaxReduceMicroBatches)
			}
			// The experts on hosts are reduced nowhere: their one host computes the whole step.
			held := func(blk, e int) bool { return len(b.hosted[ExpertRef{blk, e}]) == 0 }
			if r.links, err = reduceLinks(spec, b.sh, rep, held); err != nil {
				return nil, err
			}
			r.Replica = rep
			for _, p := range rep.Peers {
				addNeighbour(p.Worker)
			}
			b.links = r.links
			if spec.Outer() {
				if old, ok := kept.(*StageRunner); ok && old.Outer != nil {
					r.Outer = old.Outer // a kept stage keeps its share of the outer optimizer
				} else if r.Outer, err = newOuterState(b.sh.P.Specs(), spec); err != nil {
					return nil, err
				}
			}
		} else if spec.Outer() {
			return nil, errors.New("sync mode \"outer\" needs a plan of replicas: this stage has none")
		}
		if len(b.hosted) > 0 {
			r.Dispatch = disp
		}
		b.runner = r
	case a.Shard.Experts != nil:
		ex := a.Shard.Experts
		if kept != nil {
			old, ok := kept.(*ExpertRunner)
			if !ok {
				return nil, errors.New("the shard kept is no expert shard")
			}
			b.sh = old.Shard
		} else if b.sh, err = model.NewExpertShardOn(dev, spec.Model, ex.Block, ex.Experts); err != nil {
			return nil, err
		}
		for _, h := range a.ExpertHosts {
			x := b.sh.Experts.Get(h.Block, h.Expert)
			if x == nil || len(h.Workers) != 2 {
				return nil, fmt.Errorf("replica list for block %d expert %d, which this shard does not hold", h.Block, h.Expert)
			}
			ref := ExpertRef{h.Block, h.Expert}
			switch me {
			case h.Workers[0]:
				x.SetReplica(0)
				b.siblings[ref] = h.Workers[1]
			case h.Workers[1]:
				x.SetReplica(1)
				b.siblings[ref] = h.Workers[0]
			default:
				return nil, fmt.Errorf("block %d expert %d: this worker is not among its replicas", h.Block, h.Expert)
			}
			addNeighbour(b.siblings[ref])
		}
		addNeighbour(a.Router)
		if len(a.Routers) > 0 {
			// A host of a plan of pipeline replicas serves each replica's stage of its block; their
			// micro-batches must be the step's (proto checked that they run on from 0).
			last := a.Routers[len(a.Routers)-1]
			switch {
			case spec.Outer():
				return nil, errors.New("an expert host of pipeline replicas in sync mode \"outer\": not supported (each replica keeps its experts with its stages)")
			case last.First+last.MicroBatches != spec.MicroBatches:
				return nil, fmt.Errorf("expert host routers cover micro-batches [0,%d) of a job of %d", last.First+last.MicroBatches, spec.MicroBatches)
			}
			for _, rt := range a.Routers {
				addNeighbour(rt.Worker)
			}
		}
		b.runner = &ExpertRunner{Shard: b.sh, Stage: a.Router, StageIndex: ex.StageIndex, NumStages: ex.StageCount,
			Routers: a.Routers, Siblings: b.siblings, WeightDecay: spec.WeightDecay, Depth: a.Depth}
	default:
		return nil, errors.New("assignment without a shard")
	}
	// The job's boundary formats: the shard quantises between its blocks and around its
	// experts, and its runner sends and receives in them (model/wire.go, client/wire.go).
	b.sh.SetWire(spec.Wire)
	sort.Strings(b.neighbours)
	return b, nil
}

// device is what this worker's shards compute on.
func (s *session) device() model.Device {
	if s.cfg.Device != nil {
		return s.cfg.Device
	}
	return model.Host{}
}

// outerStep takes the outer step the coordinator asks for after a step (sync mode "outer"); a
// failure is answered by outerFailed. xctx is this attempt's (control): a newer attempt of the
// step, or a newer plan, ends it, for its exchange may wait on a partner that has moved on; ctx
// is the session's.
func (s *session) outerStep(ctx, xctx context.Context, m *proto.OuterSync) error {
	r, ok := s.runner.(*StageRunner)
	if !ok || m.PlanVersion != s.assign.PlanVersion {
		return nil
	}
	// Without a delay the step changes the shard's parameters now; with one, at its take-up,
	// its exchange running on beside the training steps, under the session's context.
	now := r.Outer != nil && r.Outer.spec.OuterTakeUpAfter(int(m.Step)) == int(m.Step)
	octx := ctx
	if now {
		s.trainer.beforeOuter(m.Step)
		octx = xctx
	}
	err := r.OuterStep(ctx, octx, m)
	if r.Outer != nil {
		s.board.outerSignatures(r.Outer.signs.Swap(0), r.Outer.verifies.Swap(0))
	}
	if err != nil {
		if now && errors.Is(context.Cause(xctx), errSuperseded) && ctx.Err() == nil {
			// A newer attempt or plan is queued behind this one: it is what answers.
			s.log.Info("outer step attempt given up for a newer one", "step", m.Step, "attempt", m.Attempt)
			return nil
		}
		return s.outerFailed(ctx, m.Step, err)
	}
	if now {
		// Held until every stage of the participants holds it (proto.OuterCommit).
		var av []proto.SegmentAveraged
		if h := r.Outer.held; h != nil {
			av = h.averaged
		}
		return s.conn.Send(ctx, &proto.OuterDone{Step: m.Step, PlanVersion: m.PlanVersion, Attempt: m.Attempt, Averaged: s.behaviour().averaged(av)})
	}
	// Delayed: answered once its exchange, running on, is over.
	s.awaitDelayed(ctx, m.PlanVersion, r.Outer.pending)
	return nil
}

// outerCommit applies the outer step the stage holds (proto.OuterCommit); a delayed one is taken
// up now if its take-up step is behind the stage already (takeUp).
func (s *session) outerCommit(ctx context.Context, m *proto.OuterCommit) error {
	r, ok := s.runner.(*StageRunner)
	if !ok || m.PlanVersion != s.assign.PlanVersion {
		return nil
	}
	delayed := r.Outer.pendingOf(m.Step) != nil
	if err := r.CommitOuter(m); err != nil {
		return s.outerFailed(ctx, m.Step, err)
	}
	if delayed {
		return s.takeUp(ctx)
	}
	s.trainer.afterOuter(m.Step, r.Outer.global)
	return nil
}

// takeUp takes up the delayed outer step pending once it is committed and the stage has applied
// the step after which it is due (StageRunner.takeUpOuter): at that step's clip factor, or at the
// commit when that comes later.
func (s *session) takeUp(ctx context.Context) error {
	r, ok := s.runner.(*StageRunner)
	if !ok || r.Outer == nil || r.Outer.pending == nil || s.next == 0 {
		return nil
	}
	p := r.Outer.pending
	if !p.committed || uint64(p.takeUp) >= s.next {
		return nil
	}
	after := uint64(p.takeUp)
	s.trainer.beforeOuter(after)
	if _, err := r.takeUpOuter(int(s.next) - 1); err != nil {
		return s.outerFailed(ctx, p.step, err)
	}
	s.trainer.afterOuter(after, r.Outer.global)
	return nil
}

// outerOutcome is how a delayed outer step's exchange ended on this stage, handed to the executor
// (delayedOutcome) by the goroutine that waits for it.
type outerOutcome struct {
	step    uint64
	plan    uint32
	attempt int
	err     error
}

// awaitDelayed waits, beside the executor, for the exchange of the delayed outer step p asked
// under plan. It answers OuterDone itself, at once, so that the commit the other replicas may be
// waiting for does not wait for this stage's step in flight (an attempt superseded meanwhile is
// answered all the same: the coordinator counts only its latest attempt's answers); a failure it
// hands to the executor, which owns what the session does about it (delayedOutcome).
func (s *session) awaitDelayed(ctx context.Context, plan uint32, p *pendingOuter) {
	c := s.behaviour() // the executor's, read here
	go func() {
		select {
		case <-p.done:
		case <-ctx.Done():
			return
		}
		if p.err == nil {
			if err := s.conn.Send(ctx, &proto.OuterDone{Step: p.step, PlanVersion: plan, Attempt: p.attempt, Averaged: c.averaged(p.averaged)}); err != nil {
				s.log.Debug("outer_done not sent", "step", p.step, "err", err)
			}
			return
		}
		select {
		case s.work <- work{outcome: &outerOutcome{step: p.step, plan: plan, attempt: p.attempt, err: p.err}}:
		case <-ctx.Done():
		}
	}()
}

// delayedOutcome answers the failure of a delayed outer step's exchange. A refusal (what another
// replica sent no honest one could) is outerFailed's; any other failure — a participant
// vanished, a link broke — leaves the stage's θ_r as it was, so it trains on, and says which step
// and which link failed, so that the coordinator can tell a departure's (it asks the step again
// without it) from one between two that stay (it replans). An attempt a redo or a new plan
// superseded is not answered: the coordinator asked for another.
func (s *session) delayedOutcome(ctx context.Context, o *outerOutcome) error {
	r, ok := s.runner.(*StageRunner)
	if !ok || o.plan != s.assign.PlanVersion {
		return nil
	}
	p := r.Outer.pendingOf(o.step)
	if p == nil || p.attempt != o.attempt || p.committed || o.err == nil {
		return nil
	}
	if _, refused := errors.AsType[*outerRefusal](o.err); refused || errors.Is(o.err, errLeftInExchange) || ctx.Err() != nil {
		return s.outerFailed(ctx, o.step, o.err)
	}
	s.log.Warn("delayed outer step failed", "step", o.step, "attempt", o.attempt, "err", o.err)
	peer := ""
	if pe, ok := errors.AsType[*PeerError](o.err); ok {
		peer = pe.Peer
	}
	step := o.step
	return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: fmt.Sprintf("delayed outer step after step %d, attempt %d: %v", o.step, o.attempt, o.err), Step: &step, PlanVersion: o.plan, Peer: peer})
}

// outerFailed answers the failure of the outer step after step step — when it is asked, or with
// a delay (job.Sync.Delay) when the stage waits for its exchange.
func (s *session) outerFailed(ctx context.Context, step uint64, err error) error {
	if ref, ok := errors.AsType[*outerRefusal](err); ok {
		// Another replica sent what no honest one could: this stage applied nothing, but it is
		// not at the new global θ either, so it takes no step of this plan again; it says why and
		// waits for the coordinator's next plan, which restores it.
		s.log.Warn("outer step refused", "step", step, "err", err)
		s.outerBroken = s.assign.PlanVersion
		accused := uint32(ref.replica)
		return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeOuterRefused, Message: fmt.Sprintf("outer step after step %d: %v", step, err), PlanVersion: s.assign.PlanVersion, Accused: &accused,
			Step: &step, Evidence: ref.evidence})
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, errLeftInExchange) {
		return err
	}
	r, _ := s.runner.(*StageRunner)
	if r != nil && r.Outer != nil && r.Outer.failed == int64(step) {
		// The exchange of an outer step without a delay failed — a participant vanished, a link
		// broke — and nothing of it was applied: the stage waits for the coordinator, which asks
		// the step again without a participant that left (a redo), or else replans. Step and
		// Peer say which step and which link, so that the coordinator can tell a departure's
		// failure from one between two that stay.
		s.log.Warn("outer step failed", "step", step, "err", err)
		var pe *PeerError
		peer := ""
		if errors.As(err, &pe) {
			peer = pe.Peer
		}
		return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: fmt.Sprintf("outer step after step %d: %v", step, err), Step: &step, PlanVersion: s.assign.PlanVersion, Peer: peer})
	}
	// The exchange failed where no redo can mend it — with a delay (the stage trained on), or at
	// its commit: the stage's state is between two outer steps, where no step may continue from.
	// Like a refusal, it takes no step of this plan again, says why (a data-plane failure of the
	// plan, which the coordinator replans on) and stays connected for the next plan, which
	// restores it from the newest checkpoint.
	s.log.Warn("outer step failed", "step", step, "err", err)
	s.outerBroken = s.assign.PlanVersion
	return s.conn.Send(ctx, &proto.Error{Code: proto.ErrCodeStep, Message: fmt.Sprintf("outer step after step %d: %v", step, err), PlanVersion: s.assign.PlanVersion})
}

// checkpoint snapshots the shard now — before the next step can change it — and uploads it in
// the background so that training does not wait for the network.
func (s *session) checkpoint(ctx context.Context, m *proto.Checkpoint) error {
	if s.runner == nil {
		return nil
	}
	// Refused before anything is copied: a flood of requests costs a log line each.
	uctx, cancelUpload := context.WithCancel(ctx)
	if err := s.spills.takeCheckpoint(m.ID, m.Step, cancelUpload); err != nil {
		cancelUpload()
		s.log.Warn("checkpoint refused", "checkpoint", m.ID, "step", m.Step, "why", err.Error())
		return nil
	}
	sh := s.runner.shard()
	sh.Pull() // the device → the host mirror the checkpoint is written from
	ts := model.CheckpointTensors(sh.P, sh.Opt)
	if r, ok := s.runner.(*StageRunner); ok && r.Outer != nil {
		var err error
		step := m.Step
		if p := r.Outer.pending; p != nil {
			step = p.step
		}
		if ts, err = r.outerCheckpoint(ctx, s.assign.PlanVersion, m); err != nil {
			cancelUpload()
			s.spills.doneCheckpoint()
			if errors.Is(err, errGatherFailed) && ctx.Err() == nil {
				s.log.Warn("checkpoint abandoned", "checkpoint", m.ID, "step", m.Step, "err", err)
				return nil
			}
			return s.outerFailed(ctx, step, err)
		}
	}
	if s.trainer != nil {
		ts = s.trainer.conduct.checkpoint(ts) // FaultFalseCheckpoint
	}
	// Written out before this returns, so the next step may change the shard (client/spill.go).
	body, err := newSpill(fileBytes(ts), fileBytes(ts), func(w io.Writer) error {
		return safetensors.Write(w, ts, model.CheckpointMeta(sh.Cfg, int(m.Step)))
	})
	if r, ok := s.runner.(*StageRunner); ok {
		r.Outer.release() // what the checkpoint read of the outer state stays on disk
	}
	if err != nil {
		cancelUpload()
		s.spills.doneCheckpoint()
		return err
	}
	go func() {
		defer s.spills.doneCheckpoint()
		defer body.Close()
		defer cancelUpload()
		if err := s.post(uctx, m.UploadPath, body); err != nil {
			s.log.Warn("checkpoint upload failed", "checkpoint", m.ID, "err", err)
		}
	}()
	return nil
}

// post uploads body to path on the coordinator, as this worker: the coordinator takes a shard's
// upload (a checkpoint, an audit's evidence) only from the worker that holds it. It is cut when
// no byte moves for the stall timeout, the wait for the answer included.
func (s *session) post(ctx context.Context, path string, body *spill) error {
	ctx, touch, stop := watch(ctx, s.stall())
	defer stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(s.cfg.Coordinator, "/")+path, &progressReader{r: s.uplink.reader(ctx, body), touch: touch})
	if err != nil {
		return err
	}
	req.ContentLength = body.size // not chunked: the coordinator refuses an oversize upload up front
	s.authorize(req)
	resp, err := s.http.Do(req)
	if err != nil {
		return stallErr(ctx, err)
	}
	msg, err := io.ReadAll(io.LimitReader(&progressReader{r: resp.Body, touch: touch}, 1024))
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("POST %s: %s: %s", path, resp.Status, bytes.TrimSpace(msg))
	}
	return stallErr(ctx, err)
}

// authorize presents this connection's session credential (the Welcome's) with a request to the
// coordinator's HTTP server.
func (s *session) authorize(req *http.Request) {
	req.Header.Set("Authorization", "Bearer "+s.welcome.Session)
}

// shardRunner is what a worker runs for the shard it holds: a stage or an expert host.
type shardRunner interface {
	RunStep(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error)
	RunEval(ctx context.Context, st proto.StepSpec) (*proto.StepReport, error)
	Apply(step uint64, lr float64, clip float32)
	shard() *model.Shard
	// setNet sets the Transport the runner's steps exchange tensors over.
	setNet(net Transport)
}

func (r *StageRunner) shard() *model.Shard  { return r.Shard }
func (r *ExpertRunner) shard() *model.Shard { return r.Shard }

func (r *StageRunner) setNet(net Transport) {
	r.Net = net
	if r.Dispatch != nil {
		r.Dispatch.Net = net
	}
}

func (r *ExpertRunner) setNet(net Transport) { r.Net = net }

// workerNet is a worker's Transport: tokens and targets come from the coordinator; everything
// else travels between neighbours, over WebRTC or, for neighbours it could not reach, relayed
// through the coordinator. Both paths deliver into one mailbox.
type workerNet struct {
	sent     atomic.Int64 // tensor payload bytes sent to neighbours
	coord    *Mailbox
	box      *Mailbox
	rtc      *RTCTransport // nil when every neighbour is relayed
	relay    *relayNet
	viaRelay map[string]bool
	// pool are the stages beside this one's blocks in other replicas (admission.prevPool,
	// nextPool), never WebRTC neighbours: a stage takeover names some of them, and the
	// coordinator relays between the two from then on (reroute.go).
	pool map[string]bool
}

func (w *workerNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	w.sent.Add(int64(len(t.Data)))
	if w.rtc == nil || w.viaRelay[to] || w.pool[to] {
		return w.relay.Send(ctx, to, t)
	}
	return w.rtc.Send(ctx, to, t)
}

// links is how frames travel to each neighbour now (StepStatus.Links).
func (w *workerNet) links() map[string]string {
	m := map[string]string{}
	if w.rtc != nil {
		m = w.rtc.Links()
	}
	for p, relayed := range w.viaRelay {
		if relayed {
			m[p] = "relay"
		}
	}
	return m
}

func (w *workerNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	if key.Kind == proto.KindTokens || key.Kind == proto.KindTargets {
		return w.coord.Recv(ctx, key)
	}
	if w.rtc != nil {
		return w.rtc.Recv(ctx, key) // fails fast when a WebRTC neighbour fails
	}
	return w.box.Recv(ctx, key)
}

// relayNet sends tensors to neighbours through the coordinator's WebSockets.
type relayNet struct {
	conn   *Conn
	uplink *Uplink
	mu     sync.Mutex
	buf    []byte
}

func (r *relayNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := 0; i < t.NumChunks(); i++ {
		var err error
		if r.buf, err = proto.AppendChunk(r.buf[:0], t, i, proto.DefaultLimits()); err != nil {
			return err
		}
		if err := r.uplink.wait(ctx, len(r.buf)); err != nil {
			return err
		}
		if err := r.conn.SendRelay(ctx, to, r.buf); err != nil {
			return err
		}
	}
	return nil
}

// momentumGate holds w until the outer momentum this stage's giver sends behind the global θ is
// in (takeState), unless w is a training step's, which does not read it: an outer step, a
// checkpoint, an audit and a handover of its own all wait. A new plan that comes first ends the
// session: the shard the plan would keep is not whole, and its departure is what the coordinator
// answers (its replica is dropped), as it does a worker lost right after it joined.
func (s *session) momentumGate(ctx context.Context, w work) error {
	sr, ok := s.runner.(*StageRunner)
	if !ok || sr.Outer == nil || sr.Outer.arriving == nil {
		return nil
	}
	a := sr.Outer.arriving
	if w.outcome == nil {
		switch w.m.(type) {
		case *proto.StepOpen, *proto.StepReroute, *proto.Clip:
			return nil
		case *proto.Assign:
			select {
			case <-a.done:
			default:
				return errors.New("a new plan came before the outer momentum handed over had arrived")
			}
		}
	}
	if err := a.wait(ctx); err != nil {
		return fmt.Errorf("the outer momentum handed over: %w", err)
	}
	sr.Outer.arriving = nil
	return nil
}
