package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/shoal-ml/shoal/proto"
)

// Who owns what in a worker's session (docs/design.md: one goroutine owns a peer session).
//
// A session has two goroutines of its own, beside the connection's:
//
//   - serve, the reader loop, reads the coordinator's messages and alone keeps the session's
//     control state, as its own locals: the work it has handed the executor and not seen end
//     (control), and what it heard for a plan whose data plane is not open yet (early). It hands
//     each message to the executor with the context it is to run under, and cancels that
//     context when a later Assign of a newer plan, or a later attempt of the same outer step,
//     makes the work moot: the executor registers nothing back, so nothing is shared.
//   - execute, the executor, runs those messages one at a time and alone holds the shard (the
//     runner, its trainer, the assignment). At an Assign it builds the new plan's data plane
//     whole (plane) and publishes it (session.plane), then closes the old one as a whole.
//
// The connection's reader goroutine runs onFrame for every binary frame: it loads the plane once
// per frame, and alone touches the plane's reassemblers. The plane's links call back (signals
// out, a failed neighbour) from their own goroutines with what the plane itself carries.
//
// So the session holds no lock: what crosses goroutines is a channel (work, fail, planeUp), a
// context, or the plane pointer (an atomic.Pointer, whose plane does not change once published).

// plane is the data plane of one plan: what it admits, the mailboxes its tensors arrive in, the
// reassemblers of the frames relayed through the coordinator, and its WebRTC links. An Assign
// makes a new one, whole, before it is published; a plan change closes the old one whole.
type plane struct {
	version uint32
	// adm is what the plan admits, from whom (nil: no plan yet, or the session ended: every
	// frame is dropped).
	adm *admission
	// coord holds the plan's tensors from the coordinator (tokens, targets), box those from
	// neighbours, whether they came over WebRTC or relayed through the coordinator.
	coord, box *Mailbox
	// rtc is the plan's WebRTC links; nil when every neighbour is relayed (or before any plan).
	rtc *RTCTransport
	// reasm has one reassembler per sender of relayed frames ("" for the coordinator's own):
	// touched by the frame handler alone, which runs on the connection's reader goroutine.
	reasm map[string]*proto.Reassembler
	// reroutes is where the session's reader leaves the reroutes of the step in flight on the
	// plan's stage (reroute.go); nil where the stage reroutes nothing.
	reroutes *rerouteBox
}

// planeEnded is the plane of a session that has ended: it admits nothing, and an executor that
// finds it in place of the plane it replaces closes the one it built instead of publishing it.
var planeEnded = &plane{}

// newPlane is the data plane of plan version, admitting what ad says.
func newPlane(version uint32, ad *admission) *plane {
	return &plane{version: version, adm: ad, coord: NewMailbox(0), box: NewMailbox(ad.mailboxBytes),
		reasm: map[string]*proto.Reassembler{}}
}

// close closes the plane's links and mailboxes: whatever still waits on them fails with
// ErrClosed.
func (p *plane) close() {
	if p.rtc != nil {
		p.rtc.Close()
	}
	if p.box != nil {
		p.box.Close(nil)
	}
	if p.coord != nil {
		p.coord.Close(nil)
	}
}

// reassemble checks frame's sender and header against the plan, and files it with its sender's
// reassembler, in that order: nothing is decoded for a sender outside the plan, and nothing
// allocated for a tensor the plan does not bring from this sender. Frame handler only.
func (p *plane) reassemble(from string, frame []byte) (proto.Tensor, bool, error) {
	ad := p.adm
	switch {
	case ad == nil:
		return proto.Tensor{}, false, fmt.Errorf("frame from %s before any plan: %w", senderName(from), ErrNotNeighbour)
	case from != "" && !ad.neighbour(from):
		return proto.Tensor{}, false, fmt.Errorf("frame from %s: %w", from, ErrNotNeighbour)
	}
	f, err := proto.DecodeFrame(frame, ad.lim)
	if err != nil {
		return proto.Tensor{}, false, err
	}
	if h := f.Header; h.PlanVersion < ad.plan {
		return proto.Tensor{}, false, fmt.Errorf("%v from %s: %w (current plan %d)", h.TensorKey, senderName(from), proto.ErrStalePlan, ad.plan)
	}
	if err := ad.check(from, f.Header); err != nil {
		return proto.Tensor{}, false, err
	}
	r, ok := p.reasm[from]
	if !ok {
		r = proto.NewReassembler(ad.lim)
		r.SetPlanVersion(ad.plan)
		p.reasm[from] = r
	}
	return r.AddFrame(f)
}

// planSignaler is the Signaler of one plane's links: it stamps what they send with their plan, so
// that a link of a plan being closed never speaks for the next one.
type planSignaler struct {
	s       *session
	version uint32
}

func (g planSignaler) SendSignal(ctx context.Context, to string, m proto.Signal) error {
	if g.s.cfg.BlockWebRTC {
		return nil
	}
	m.From, m.To, m.PlanVersion = g.s.welcome.WorkerID, to, g.version
	return g.s.conn.Send(ctx, &m)
}

// errSuperseded is the cause that ends the context of work a later Assign of a newer plan, or a
// later attempt of the same outer step, made moot (control).
var errSuperseded = errors.New("superseded")

// control is what the reader loop (serve) alone keeps of the work it has handed the executor:
// each Assign, step and outer step runs under a context of its own (run), which serve cancels
// when the coordinator, later, makes the work moot — an Assign of a newer plan ends the work of
// older ones, an outer step asked again its earlier attempts — whether the work runs already or
// still waits its turn. Work the coordinator asks after an Assign is its to ask, even of an older
// plan (an Assign the worker refused leaves the plan it holds in force).
type control struct {
	runs []run // handed to the executor, and not over yet
}

// run is one piece of work handed to the executor: of plan, an attempt of an outer step when
// outer is set.
type run struct {
	plan   uint32
	outer  *proto.OuterSync
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// start makes the context of work of plan (an outer step's attempt when outer is set), a child of
// the session's ctx, and the end the executor calls once the work is over.
func (c *control) start(ctx context.Context, plan uint32, outer *proto.OuterSync) (context.Context, context.CancelCauseFunc) {
	// What is over has ended its context: forgotten here, so that runs holds at most what the
	// work queue does, and the one in flight.
	c.runs = slices.DeleteFunc(c.runs, func(r run) bool { return r.ctx.Err() != nil })
	rctx, cancel := context.WithCancelCause(ctx)
	c.runs = append(c.runs, run{plan: plan, outer: outer, ctx: rctx, cancel: cancel})
	return rctx, cancel
}

// assign ends the work of plans older than version: a new plan abandons whatever step (or
// assignment, or outer step) of the old one is still running here, or waits to.
func (c *control) assign(version uint32) {
	for _, r := range c.runs {
		if r.plan < version {
			r.cancel(errSuperseded)
		}
	}
}

// retry ends the earlier attempts of the outer step m asks again (proto.OuterSync.Attempt): they
// may wait on a partner that has given them up for m.
func (c *control) retry(m *proto.OuterSync) {
	for _, r := range c.runs {
		if o := r.outer; o != nil && o.PlanVersion == m.PlanVersion && o.Step == m.Step && o.Attempt < m.Attempt {
			r.cancel(errSuperseded)
		}
	}
}

// early is what serve heard for a plan whose data plane is not open yet: a neighbour may offer,
// or leave, before this worker has set the plan up. It is handed to the plan's links once they
// exist (handOver), so that no offer is lost and nobody waits out a connection to a peer gone.
type early struct {
	signals []proto.Signal // at most maxPendingSignals
	// left are the workers the coordinator said left plan leftPlan (proto.PeerLeft).
	left     map[string]bool
	leftPlan uint32
	// handed is the plane what was held was last handed to.
	handed *plane
}

// handOver gives p, the plane now published, what is held for its plan, once, and forgets what
// is held for it or an older plan: an older plan's links are closed already, and a relayed
// plan's have nothing to take.
func (e *early) handOver(p *plane, log *slog.Logger) {
	if p == e.handed {
		return
	}
	e.handed = p
	if p.rtc != nil && e.leftPlan == p.version {
		for w := range e.left {
			p.rtc.PeerLeft(w)
		}
	}
	if e.leftPlan <= p.version {
		e.left = nil
	}
	kept := e.signals[:0]
	for _, m := range e.signals {
		switch {
		case m.PlanVersion > p.version:
			kept = append(kept, m)
		case m.PlanVersion == p.version && p.rtc != nil:
			deliverSignal(p.rtc, m, log)
		}
	}
	clear(e.signals[len(kept):])
	e.signals = kept
}

// signal hands a Signal to the data plane of its plan, p being the plane now published, holding
// it until that plan's links exist. Signals of older plans are dropped, and at most
// maxPendingSignals are held.
func (e *early) signal(p *plane, m proto.Signal, log *slog.Logger) {
	e.handOver(p, log)
	switch {
	case m.PlanVersion == p.version && p.rtc != nil:
		deliverSignal(p.rtc, m, log)
	case m.PlanVersion <= p.version:
		// An older plan's, or one whose neighbours are all relayed: no link takes it.
	case len(e.signals) >= maxPendingSignals:
		log.Debug("signal dropped: too many waiting for their plan", "from", m.From, "plan", m.PlanVersion)
	default:
		e.signals = append(e.signals, m)
	}
}

// peerLeft tells the links of plan m.PlanVersion that m.Worker left, p being the plane now
// published; a departure from a plan whose links do not exist yet is kept for them.
func (e *early) peerLeft(p *plane, m *proto.PeerLeft, log *slog.Logger) {
	e.handOver(p, log)
	switch {
	case m.PlanVersion == p.version && p.rtc != nil:
		p.rtc.PeerLeft(m.Worker)
	case m.PlanVersion > p.version:
		if e.left == nil || e.leftPlan != m.PlanVersion {
			e.left, e.leftPlan = map[string]bool{}, m.PlanVersion
		}
		if len(e.left) < maxLeftEarly {
			e.left[m.Worker] = true
		}
	}
}

func deliverSignal(rtc *RTCTransport, m proto.Signal, log *slog.Logger) {
	if err := rtc.HandleSignal(m.From, m); errors.Is(err, ErrNotNeighbour) {
		log.Debug("signal from outside the plan dropped", "from", m.From)
	} else if err != nil {
		log.Warn("signal", "from", m.From, "err", err)
	}
}

// maxPendingSignals bounds the signals held for a plan this worker has not set up yet. A plan's
// neighbours send an offer or answer and a few candidates each before their data channel opens;
// without a bound anyone could make a worker hold any number of them.
const maxPendingSignals = 64

// maxLeftEarly bounds the departures a worker remembers for a plan whose links it has not opened
// yet: a coordinator's PeerLeft names one of the plan's workers, far fewer than this.
const maxLeftEarly = 1024
