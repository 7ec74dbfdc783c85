package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// An exchange that survives a departure (issue 31, lever 1). An outer step's exchange is an
// outerExchange that lives across the step's attempts (proto.OuterSync.Attempt) rather than one
// exchange an attempt. The first attempt fixes the segments (proto.OuterSync.Owners): segment k
// of every tensor is model.OuterSegment(n, len(owners), k), owned by owners[k]. A redo changes
// only who takes part and who owns a lost replica's segments (model.OuterReassign); so
//   - what a replica gives is the same in every attempt (its θ_r, or its int8 codes, encoded once
//     with its error feedback), and nothing that crossed is sent again: a survivor sends a
//     reassigned segment's contribution to its new owner, and nothing else;
//   - an owner averages a segment once, when it holds the contributions of every participant of
//     the attempt then asked (ReduceSegment), and that average stands: its participants are that
//     attempt's, a replica lost since included when its contribution had come (OuterDone.Averaged
//     says which attempt, the coordinator records it, and a replay averages the segment over the
//     same participants: model.Outer.StepSegments);
//   - a holder waits for each segment's average from its current owner; one from an owner lost
//     since is dropped, for the segment's new owner averages it afresh.
// A replica that leaves so costs the resend of its own segments' contributions to their new owners
// and those averages, not the exchange again. Keys name the segment, not the attempt
// (proto.OuterDeltaKey.Segment): a contribution and an average each cross once whatever the
// attempt. A link that fails is not the exchange's failure at once: the coordinator, hearing of
// a departure, asks the next attempt without the replica; only a link to a replica it keeps
// asking for past linkLostGrace fails the attempt (outerFailed reports it), and the exchange is
// still there for the redo that mends it.

// linkLostGrace is how long an exchange waits, once the link to a participant failed, for the
// coordinator's redo that leaves the participant out, before the attempt fails.
const linkLostGrace = 10 * time.Second

// outerExchange is an outer step's exchange across its attempts (see above).
type outerExchange struct {
	r          *StageRunner
	step       uint64
	plan       uint32
	me         int   // this stage's replica
	first      []int // the first attempt's participants: positions index contributions
	segs       int   // segments of every tensor: the first attempt's len(owners)
	compressed bool
	given      *model.Params         // what this replica gives: θ_r, or int8's decoded Δ_r
	payload    map[string][2][]byte  // int8: the tensor's parts, as they cross
	avgParts   map[string][2][]byte  // int8: this stage's averages' parts by avgName (x.mu)
	base       map[string][][32]byte // the global θ's Merkle leaves by tensor
	bound      audit.OuterBound
	headers    batchHeaders    // the batches' signatures received
	index      map[string]int  // the stage's tensors' places in its shard, by name
	ctx        context.Context // the step's: ended by close
	cancel     context.CancelCauseFunc
	sendWake   chan struct{} // cap 1: something was queued (sendq, under mu)
	wg         sync.WaitGroup

	mu        sync.Mutex
	changed   chan struct{} // closed and replaced at every change of what follows
	attempt   int
	parts     []int        // the participants asked last
	owners    []int        // the owners asked last
	lost      map[int]bool // replicas whose link failed: nothing more comes from them
	lostSince map[int]time.Time
	// From a replica (by its position in first) to a segment this stage owns: whether every
	// tensor's contribution is in, and the values by segment, tensor and position.
	in       map[[2]int]bool // (segment, position)
	vals     map[int][][][]float32
	taking   map[[2]int]bool // (segment, replica) receives started: contributions, averages
	avgTaken map[[2]int]bool
	avgFrom  []int       // by segment: the replica whose average this stage holds, -1 none
	avg      [][]float32 // by tensor: the whole average, as segments come in
	averaged []proto.SegmentAveraged
	held     []int       // segments averaged whose averages are not yet queued (advance)
	sendq    []outerSend // what the sender has still to send, in order
	sending  int         // sends queued and not over
	err      error
	closed   bool
}

// outerSend is a segment's contribution, or with average this stage's average of it, to replica
// to's stages.
type outerSend struct {
	seg, to int
	average bool
}

// newOuterExchange starts the exchange of outer step m (its first attempt) of what this replica
// gives, mine (with payload its int8 parts).
func (r *StageRunner) newOuterExchange(parent context.Context, m *proto.OuterSync, mine model.OuterGiven, payload map[string][2][]byte) *outerExchange {
	o, sh := r.Outer, r.Shard
	given := mine.Theta
	if o.outer.Int8 {
		given = mine.Delta
	}
	owners := m.SegmentOwners()
	x := &outerExchange{r: r, step: m.Step, plan: m.PlanVersion, me: r.Replica.Index, first: slices.Clone(m.FirstParticipants()), segs: len(owners),
		compressed: o.outer.Int8, given: given, payload: payload, bound: audit.NewOuterBound(o.spec, int(m.Step), o.outer.Int8),
		sendWake: make(chan struct{}, 1), changed: make(chan struct{}),
		lost: map[int]bool{}, lostSince: map[int]time.Time{}, in: map[[2]int]bool{}, vals: map[int][][][]float32{},
		taking: map[[2]int]bool{}, avgTaken: map[[2]int]bool{}, avgParts: map[string][2][]byte{}}
	x.headers.segs = x.segs
	x.ctx, x.cancel = context.WithCancelCause(parent)
	// The global θ's leaves: what this stage signs and verifies is over them, and nothing
	// changes the global θ until the commit.
	x.base = make(map[string][][32]byte, len(o.global.Tensors))
	for _, t := range o.global.Tensors {
		x.base[t.Name] = audit.OuterBaseLeaves(t.Data)
	}
	x.avg = make([][]float32, len(sh.P.Tensors))
	x.index = make(map[string]int, len(sh.P.Tensors))
	for ti, t := range sh.P.Tensors {
		x.avg[ti] = make([]float32, len(t.Data))
		x.index[t.Name] = ti
	}
	x.avgFrom = make([]int, x.segs)
	for k := range x.avgFrom {
		x.avgFrom[k] = -1
	}
	// The first attempt's owners are its participants, one segment each; asked first at a later
	// attempt (a delayed step's replica that was still training), this stage forgets the
	// average's error feedback of the segments lost since, as those asked earlier did.
	o.outer.Participate(m.FirstOwners())
	if len(m.Lost) > 0 {
		o.outer.Forget(func(q int) bool { return slices.Contains(owners, q) })
		o.outer.SetOwners(owners)
	}
	x.wg.Add(1)
	go x.sender()
	x.mu.Lock()
	x.ask(m)
	x.mu.Unlock()
	return x
}

// update takes up a later attempt m of the step: fewer participants, a lost owner's segments
// reassigned.
func (x *outerExchange) update(m *proto.OuterSync) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch {
	case m.Attempt <= x.attempt:
		return fmt.Errorf("outer step after step %d: attempt %d after attempt %d", m.Step, m.Attempt, x.attempt)
	case len(m.SegmentOwners()) != x.segs || !slices.Equal(m.FirstParticipants(), x.first):
		return fmt.Errorf("outer step after step %d: attempt %d has %d segments of %v, the first had %d of %v", m.Step, m.Attempt, len(m.SegmentOwners()), m.FirstParticipants(), x.segs, x.first)
	}
	for _, q := range m.Participants {
		if !slices.Contains(x.first, q) {
			return fmt.Errorf("outer step after step %d: attempt %d asks replica %d, which the first did not", m.Step, m.Attempt, q)
		}
	}
	if _, refused := errors.AsType[*outerRefusal](x.err); x.err != nil && !refused {
		x.err = nil // a link lost: the redo mends it
	}
	// The lost owners' averages are nobody's now, in one process as here: model.Outer.Forget.
	owners := m.SegmentOwners()
	x.r.Outer.outer.Forget(func(q int) bool { return slices.Contains(owners, q) })
	x.r.Outer.outer.SetOwners(owners)
	x.ask(m)
	return nil
}

// ask takes attempt m up (x.mu held): starts what it needs that is not under way.
func (x *outerExchange) ask(m *proto.OuterSync) {
	x.attempt, x.parts, x.owners = m.Attempt, slices.Clone(m.Participants), slices.Clone(m.SegmentOwners())
	x.advance()
}

// pos is replica q's position among the first attempt's participants.
func (x *outerExchange) pos(q int) int { return slices.Index(x.first, q) }

// advance starts the sends and receives the attempt asked needs, averages the segments this
// stage owns once their contributions are in, and wakes whoever waits (x.mu held).
func (x *outerExchange) advance() {
	defer func() {
		close(x.changed)
		x.changed = make(chan struct{})
	}()
	if x.closed || x.err != nil {
		return
	}
	sh := x.r.Shard
	var gives []outerSend
	for k, q := range x.owners {
		if q == x.me {
			continue
		}
		// This replica's contribution to segment k goes to its owner, once.
		if !x.taking[[2]int{k, -1 - q}] {
			x.taking[[2]int{k, -1 - q}] = true
			gives = append(gives, outerSend{seg: k, to: q})
		}
		// The segment's average comes from its owner.
		if x.avgFrom[k] != q && !x.avgTaken[[2]int{k, q}] {
			x.avgTaken[[2]int{k, q}] = true
			x.wg.Add(1)
			go x.takeAverages(k, q)
		}
	}
	// Owner by owner, each replica starting from the one after it (a ring's order): an owner
	// then takes one sender's contributions at a time rather than every sender's at once, and
	// holds all of its segments' at about the same moment, so that their averages go out signed
	// together (outerExchange.sign).
	n, me := len(x.first), x.pos(x.me)
	slices.SortStableFunc(gives, func(a, b outerSend) int {
		return (x.pos(a.to)-me+n)%n - (x.pos(b.to)-me+n)%n
	})
	for _, g := range gives {
		x.queue(g)
	}
	for k, q := range x.owners {
		if q != x.me || x.avgFrom[k] == x.me {
			continue
		}
		ready := true
		for _, p := range x.parts {
			if p == x.me || x.in[[2]int{k, x.pos(p)}] {
				continue
			}
			ready = false
			if !x.taking[[2]int{k, p}] {
				x.taking[[2]int{k, p}] = true
				x.wg.Add(1)
				go x.takeContributions(k, p)
			}
		}
		if !ready {
			continue
		}
		// Every participant's contribution to segment k is in: its average, once, over this
		// attempt's participants.
		var in []int
		for _, p := range x.parts {
			in = append(in, x.pos(p))
		}
		for ti, t := range sh.P.Tensors {
			lo, hi := model.OuterSegment(len(t.Data), x.segs, k)
			if lo == hi {
				continue
			}
			xs := make([][]float32, 0, len(in))
			for _, i := range in {
				if x.first[i] == x.me {
					xs = append(xs, x.given.Tensors[ti].Data[lo:hi])
				} else {
					xs = append(xs, x.vals[k][ti][i])
				}
			}
			parts, err := x.r.Outer.outer.ReduceSegment(x.r.Outer.global, ti, lo, xs, x.avg[ti][lo:hi])
			if err != nil {
				x.err = err
				return
			}
			if x.compressed {
				x.avgParts[avgName(k, t.Name)] = parts
			}
		}
		x.avgFrom[k] = x.me
		x.averaged = append(x.averaged, proto.SegmentAveraged{Segment: k, Attempt: x.attempt})
		delete(x.vals, k)
		x.held = append(x.held, k)
	}
	// The averages go out together, signed in one batch a tensor, once this stage holds every
	// segment's it owns — which, with the ring's order above, come in about together — or at once
	// when a participant is lost: nothing is gained then by waiting for the rest.
	release := true
	for k, q := range x.owners {
		release = release && (q != x.me || x.avgFrom[k] == x.me)
	}
	for _, p := range x.parts {
		release = release || x.lost[p]
	}
	if release {
		for _, k := range x.held {
			for _, p := range x.parts {
				if p != x.me {
					x.queue(outerSend{seg: k, to: p, average: true})
				}
			}
		}
		x.held = nil
	}
	// A participant whose link failed and whom the coordinator still asks for: after a grace,
	// the attempt fails (the redo that leaves it out mends it).
	for _, p := range x.parts {
		if t, ok := x.lostSince[p]; ok && time.Since(t) > linkLostGrace {
			x.err = x.lostErr(p)
			return
		}
	}
}

// avgName keys this stage's average's int8 parts of segment k of a tensor in payload.
func avgName(k int, name string) string { return fmt.Sprintf("avg.%d.%s", k, name) }

// lostErr is the failure of the link to replica q's stage.
func (x *outerExchange) lostErr(q int) error {
	for _, l := range x.r.links {
		if l.peer.Replica == q {
			return &PeerError{Peer: l.peer.Worker, Err: fmt.Errorf("outer step: replica %d's stage: %w", q, ErrPeerGone)}
		}
	}
	return fmt.Errorf("outer step: replica %d: %w", q, ErrPeerGone)
}

// queue hands s to the sender (x.mu held). The queue grows with what the exchange really sends
// — one contribution a segment, one average a partner for each segment this stage owns — not with
// a capacity fixed from the plan's size ahead of it.
func (x *outerExchange) queue(s outerSend) {
	x.sending++
	x.sendq = append(x.sendq, s)
	select {
	case x.sendWake <- struct{}{}:
	default:
	}
}

// sender sends what is queued, in order, over this stage's links: one segment at a time, so
// that each goes out whole and the uplink is shared by nothing of the exchange's own.
func (x *outerExchange) sender() {
	defer x.wg.Done()
	for {
		x.mu.Lock()
		if len(x.sendq) == 0 {
			x.mu.Unlock()
			select {
			case <-x.ctx.Done():
				return
			case <-x.sendWake:
			}
			continue
		}
		// Everything queued so far goes out under one signature a partner and tensor (and
		// phase: its contributions, or the averages it is sent), in the order queued.
		sends := x.sendq
		x.sendq = nil
		x.mu.Unlock()
		batches := x.sign(sends)
		for _, s := range sends {
			err := x.send(s, batches)
			x.mu.Lock()
			x.sending--
			if err != nil && x.err == nil && x.ctx.Err() == nil {
				if _, link := errors.AsType[*linkErr](err); link {
					// The link to it failed, whatever the transport calls it ("no connection to
					// peer" once it is forgotten): a partner lost, whom the coordinator's redo
					// leaves out.
					x.linkLost(s.to)
				} else {
					x.err = err
				}
			}
			x.advance()
			x.mu.Unlock()
		}
	}
}

// batchKey names a batch signed at once: what this stage sends a partner (replica to) of one
// tensor as its contributions to the segments the partner owns; or, with average, the averages of
// the segments it owns of one tensor that it sends every partner at once (to is -1: an average is
// the same for every holder, so one signature serves them all).
type batchKey struct {
	to, tensor int
	average    bool
}

// batchOf is the batch in which s's segment of tensor t is signed.
func batchOf(s outerSend, t reduceTensor) batchKey {
	if s.average {
		return batchKey{to: -1, tensor: t.global, average: true}
	}
	return batchKey{to: s.to, tensor: t.global}
}

// signedBatch is a batch signed, or why it could not be.
type signedBatch struct {
	*outerBatch
	err error
}

// sign signs sends, a batch each partner and tensor, and for averages a batch a tensor
// (batchKey): an entry for each segment of the tensor. It hashes what it signs; sends hash
// nothing. A batch is as large as the sender's backlog: a sender with nothing queued sends what
// is ready at once rather than wait to sign more with it.
//
// Why a batch a tensor, and not one for everything a partner is sent: one stage of a partner
// holds a tensor, so it receives every entry of the tensor's batch and the batch's leaves can go
// to it once, with the signature, where each segment carries only its place (12 bytes). A batch
// across tensors may span several of the partner's stages, each of which would need the whole
// list of leaves or a Merkle path for every segment; and a batch a tensor already makes the
// signatures c times fewer than one a segment.
func (x *outerExchange) sign(sends []outerSend) map[batchKey]signedBatch {
	out := map[batchKey]signedBatch{}
	for _, s := range sends {
		// An average's entry serves every partner: its frames are made and hashed once.
		signed := func(t reduceTensor) bool {
			b, ok := out[batchOf(s, t)]
			if !ok {
				return false
			}
			_, in := b.at[s.seg]
			return in
		}
		// The callback keeps each batch's error with it (send fails with it) and fails nothing.
		_ = x.frames(s, signed, func(_ *reduceLink, k int, t reduceTensor, seg outerSeg, pts []proto.Tensor) error {
			key := batchOf(s, t)
			b, ok := out[key]
			if !ok {
				b = signedBatch{outerBatch: &outerBatch{}}
			}
			if b.err == nil {
				var e audit.OuterEntry
				if e, b.err = x.r.outerEntry(t, seg, pts, x.base[t.name]); b.err == nil {
					b.add(k, e)
				}
			}
			out[key] = b
			return nil
		})
	}
	for key, b := range out {
		if b.err == nil {
			b.err = x.r.signBatch(b.outerBatch, x.plan, x.step, x.me, key.average)
			out[key] = b
		}
	}
	return out
}

// frames calls f with the frames of s for each tensor of the stages of replica s.to that hold
// one, as outerFrames makes them: segment s.seg of what this replica gives, or of its average.
func (x *outerExchange) frames(s outerSend, skip func(t reduceTensor) bool, f func(l *reduceLink, k int, t reduceTensor, seg outerSeg, pts []proto.Tensor) error) error {
	r, sh := x.r, x.r.Shard
	var avgParts map[string][2][]byte
	if s.average && x.compressed {
		x.mu.Lock()
		avgParts = make(map[string][2][]byte, len(sh.P.Tensors))
		for _, t := range sh.P.Tensors {
			avgParts[t.Name] = x.avgParts[avgName(s.seg, t.Name)]
		}
		x.mu.Unlock()
	}
	for li := range r.links {
		l := &r.links[li]
		if l.peer.Replica != s.to {
			continue
		}
		for _, t := range l.tensors {
			lo, hi := model.OuterSegment(t.size, x.segs, s.seg)
			if lo == hi || skip != nil && skip(t) {
				continue
			}
			ti := x.index[t.name]
			var pts []proto.Tensor
			if s.average {
				pts = r.outerFrames(x.plan, x.step, s.seg, t, x.me, x.avg[ti][lo:hi], avgParts[t.name], true)
			} else {
				var parts [2][]byte
				if x.compressed {
					parts = model.OuterLayout{N: t.size, Int8: true}.Segment(x.payload[t.name], lo, hi)
				}
				pts = r.outerFrames(x.plan, x.step, s.seg, t, x.me, x.given.Tensors[ti].Data[lo:hi], parts, false)
			}
			if err := f(l, s.seg, t, outerSeg{lo, hi}, pts); err != nil {
				return err
			}
		}
	}
	return nil
}

// linkErr is a send that the link to a partner refused.
type linkErr struct{ err error }

func (e *linkErr) Error() string { return e.err.Error() }
func (e *linkErr) Unwrap() error { return e.err }

// send sends segment s.seg of what this replica gives (or its average) to replica s.to's stages
// holding the tensors: each tensor's frames with their place in their batch (batches, sign), and
// before a batch's first segment to a partner the batch's signature and leaves.
func (x *outerExchange) send(s outerSend, batches map[batchKey]signedBatch) error {
	r := x.r
	f, ok := r.Net.(interface{ leavesInExchange() bool })
	leaves := s.average && ok && f.leavesInExchange()
	var first *reduceLink
	err := x.frames(s, nil, func(l *reduceLink, k int, t reduceTensor, seg outerSeg, pts []proto.Tensor) error {
		if first == nil {
			first = l
		} else if leaves && l != first {
			return errLeftInExchange
		}
		b := batches[batchOf(s, t)]
		if b.err != nil {
			return b.err
		}
		pts = append(pts, r.entryFrame(b.outerBatch, x.plan, x.step, k, t, x.me, s.average))
		if !b.sent[s.to] {
			// The batch's signature goes first, once a partner: its segments' receives wait for
			// it.
			pts = append([]proto.Tensor{r.batchFrame(b.outerBatch, x.plan, x.step, t, x.me, s.average)}, pts...)
			if b.sent == nil {
				b.sent = map[int]bool{}
			}
			b.sent[s.to] = true
		}
		if err := r.sendAll(x.ctx, *l, pts); err != nil {
			what := t.name
			if s.average {
				what = "the average of " + t.name
			}
			return fmt.Errorf("outer step: %s to replica %d: %w", what, s.to, &linkErr{err})
		}
		return nil
	})
	if leaves && (err == nil || errors.Is(err, errLeftInExchange)) {
		// Its average went to the first link only: a moment for it to cross, and it is gone.
		select {
		case <-time.After(leaveInExchangeAfter):
		case <-x.ctx.Done():
		}
		return errLeftInExchange
	}
	return err
}

// receive receives replica q's segment k of every tensor this stage holds — its contribution,
// or with average its average — verified and checked (takeOuter, takeAverage); nil when that
// failed (failed).
func (x *outerExchange) receive(k, q int, average bool) [][]float32 {
	r, sh := x.r, x.r.Shard
	qctx, stop := r.fromPartner(x.ctx, q)
	defer stop()
	take := r.takeOuter
	if average {
		take = r.takeAverage
	}
	vals := make([][]float32, len(sh.P.Tensors))
	for ti, t := range sh.P.Tensors {
		lo, hi := model.OuterSegment(len(t.Data), x.segs, k)
		vals[ti] = make([]float32, hi-lo)
		if lo == hi {
			continue
		}
		if err := take(qctx, &x.headers, x.plan, x.step, k, q, x.bound, r.Outer.global.Tensors[ti].Data, t.Name, outerSeg{lo, hi}, vals[ti], x.base[t.Name]); err != nil {
			x.failed(q, qctx, err)
			return nil
		}
	}
	return vals
}

// takeContributions receives replica q's contribution to segment k, which this stage owns.
func (x *outerExchange) takeContributions(k, q int) {
	defer x.wg.Done()
	vals := x.receive(k, q, false)
	if vals == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.vals[k] == nil {
		x.vals[k] = make([][][]float32, len(vals))
		for ti := range x.vals[k] {
			x.vals[k][ti] = make([][]float32, len(x.first))
		}
	}
	i := x.pos(q)
	for ti := range vals {
		x.vals[k][ti][i] = vals[ti]
	}
	x.in[[2]int{k, i}] = true
	x.advance()
}

// takeAverages receives owner q's average of segment k, and keeps it while q still owns the
// segment.
func (x *outerExchange) takeAverages(k, q int) {
	defer x.wg.Done()
	vals := x.receive(k, q, true)
	if vals == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.closed || x.owners[k] != q {
		return // the segment went to another owner, who averages it afresh
	}
	for ti, t := range x.r.Shard.P.Tensors {
		lo, hi := model.OuterSegment(len(t.Data), x.segs, k)
		copy(x.avg[ti][lo:hi], vals[ti])
	}
	x.avgFrom[k] = q
	x.advance()
}

// failed answers a receive from replica q that failed: its link's failure marks q lost (the
// coordinator's redo leaves it out); what q sent that no honest replica could fails the
// exchange, as anything else does.
func (x *outerExchange) failed(q int, qctx context.Context, err error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch {
	case x.closed || x.ctx.Err() != nil:
	case !slices.Contains(x.parts, q):
		// Left out since: nothing more is wanted of it.
	case qctx.Err() != nil:
		x.linkLost(q)
	case x.err == nil:
		if !errors.As(err, new(*outerRefusal)) {
			err = fmt.Errorf("outer step: %w", err)
		}
		x.err = err
	}
	x.advance()
}

// linkLost marks replica q's link failed (x.mu held): nothing more comes from it, and unless
// the coordinator leaves it out within linkLostGrace the attempt fails.
func (x *outerExchange) linkLost(q int) {
	if x.lost[q] {
		return
	}
	x.lost[q] = true
	x.lostSince[q] = time.Now()
	x.wg.Add(1)
	go func() {
		defer x.wg.Done()
		select {
		case <-time.After(linkLostGrace + 10*time.Millisecond):
			x.mu.Lock()
			x.advance()
			x.mu.Unlock()
		case <-x.ctx.Done():
		}
	}()
}

// wait waits until this stage holds the whole average under attempt's owners and its sends are
// out, and returns it with the segments it averaged; or until the exchange fails, ctx ends, or
// a later attempt is asked.
func (x *outerExchange) wait(ctx context.Context, attempt int) ([][]float32, []proto.SegmentAveraged, error) {
	for {
		x.mu.Lock()
		ch := x.changed
		switch {
		case x.attempt != attempt:
			x.mu.Unlock()
			return nil, nil, fmt.Errorf("outer step after step %d: attempt %d superseded by %d: %w", x.step, attempt, x.attempt, errSuperseded)
		case x.err != nil:
			err := x.err
			x.mu.Unlock()
			return nil, nil, err
		case x.complete():
			avg, av := x.avg, slices.Clone(x.averaged)
			x.mu.Unlock()
			slices.SortFunc(av, func(a, b proto.SegmentAveraged) int { return a.Segment - b.Segment })
			return avg, av, nil
		}
		x.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, nil, context.Cause(ctx)
		case <-x.ctx.Done():
			return nil, nil, context.Cause(x.ctx)
		}
	}
}

// complete reports whether every segment's average is its current owner's and every send is
// out (x.mu held).
func (x *outerExchange) complete() bool {
	if x.sending > 0 || len(x.held) > 0 {
		return false
	}
	for k, q := range x.owners {
		if x.avgFrom[k] != q {
			return false
		}
	}
	return true
}

// close ends the exchange: its sends and receives stop, and nothing it still has in flight
// changes the average it gave.
func (x *outerExchange) close() {
	x.mu.Lock()
	x.closed = true
	x.mu.Unlock()
	x.cancel(errSuperseded)
	x.wg.Wait()
}
