package client

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/proto"
)

// Stage takeovers (issue 30, stage pools; proto.StageTakeover): in step mode the stages of the
// replicas that hold the same blocks are a pool — the same parameters, the same summed gradient.
// When one member of a pool is lost mid-step, the member of the replica beside it takes its
// micro-batches of the step over at those blocks alone; the lost stage's other replica-mates keep
// their runs and what they computed of them. What changes, by role:
//
//   - The lost stage's neighbours (the stage before and after it in its replica) send the taker
//     what they sent the lost stage, from the step's first micro-batch on — each keeps what it
//     sent for the step (route) — and from then on send to it instead; each tensor reaches the
//     taker exactly once (route.send and route.redirect share one lock). A neighbour waiting on
//     the lost stage's failed link waits for the takeover instead of failing (recvRouted).
//   - The taker widens its gradient tree (as a reroute does), and after its own micro-batches
//     runs the lost run through its blocks as one more 1F1B leg, with the lost stage's neighbours
//     as its own: the same schedule the lost stage followed, at the same stage index.
//   - The other members of the pool reduce with the taker's widened run and without the lost
//     stage; every other stage only counts the reroute.
//
// The boundary tensors between the taker and the lost stage's neighbours travel through the
// coordinator's relay: they are never WebRTC neighbours (admission's prevPool and nextPool, which
// the relay only carries between the pairs a takeover names). What the neighbours receive twice —
// what the lost stage had sent them and the taker sends again — is the same bits, and the second
// copy is dropped (Mailbox.DeliverOnce).

// route is where a stage's run sends its boundary tensors — activations to next, their gradients
// to prev — and, on a stage of a step-mode replica (log), what it sent them this step.
type route struct {
	mu         sync.Mutex
	prev, next string
	log        bool
	acts       []proto.Tensor // sent to next this step (log)
	grads      []proto.Tensor // sent to prev this step (log)
	moved      []string       // the neighbours a takeover replaced
	// ctx, net and forget are the step's, for a redirect heard while the step runs: its
	// resends, and the lost neighbour's link, which must no longer fail this stage's waits.
	ctx     context.Context
	cancel  context.CancelFunc
	net     Transport
	forget  func(peer string)
	box     *rerouteBox // where the takeovers of the step arrive
	resends sync.WaitGroup
	err     error // a resend's failure
}

// awaitRedirect waits until a takeover replaces neighbour peer, reporting whether one did within
// rerouteGrace (and ctx): the coordinator hears a killed worker leave at once (its socket closes)
// and takes its stage over well within it; a link that fails between two workers that stay is
// reported once the grace is over, and weighed as before (the coordinator's linkGrace).
func (rt *route) awaitRedirect(ctx context.Context, peer string) bool {
	if !rt.log || rt.box == nil {
		return false
	}
	grace := time.NewTimer(rerouteGrace)
	defer grace.Stop()
	for {
		wake := rt.box.changed()
		if rt.replaced(peer) {
			return true
		}
		select {
		case <-wake:
		case <-grace.C:
			return rt.replaced(peer)
		case <-ctx.Done():
			return false
		}
	}
}

// send sends t to the next stage (forward) or the previous one, keeping it when the route logs.
func (rt *route) send(ctx context.Context, net Transport, forward bool, t proto.Tensor) error {
	rt.mu.Lock()
	to := rt.prev
	if forward {
		to = rt.next
	}
	if rt.log {
		if forward {
			rt.acts = append(rt.acts, t)
		} else {
			rt.grads = append(rt.grads, t)
		}
	}
	err := rt.err
	rt.mu.Unlock()
	if err != nil {
		return err
	}
	err = net.Send(ctx, to, t)
	// A lost neighbour's link fails the send: t is kept, and a takeover sends it to the taker.
	if err != nil && ctx.Err() == nil && linkFailed(err) && rt.awaitRedirect(ctx, to) {
		return nil
	}
	return err
}

// linkFailed reports whether err is a neighbour's link failing, which a stage takeover answers.
func linkFailed(err error) bool {
	_, peer := errors.AsType[*PeerError](err)
	return peer || errors.Is(err, ErrPeerGone) || errors.Is(err, ErrNotConnected)
}

// redirect takes takeover tk up on a route that logs: when the lost stage is one of its
// neighbours, the taker replaces it, and gets — in the background, under ctx — everything sent
// to the lost stage this step. Taking the same takeover up twice changes nothing.
func (rt *route) redirect(ctx context.Context, tk *proto.StageTakeover) {
	if tk == nil || !rt.log {
		return
	}
	rt.mu.Lock()
	var resend []proto.Tensor
	switch tk.Lost {
	case rt.next:
		rt.next, resend = tk.Taker, slices.Clone(rt.acts)
	case rt.prev:
		rt.prev, resend = tk.Taker, slices.Clone(rt.grads)
	default:
		rt.mu.Unlock()
		return
	}
	rt.moved = append(rt.moved, tk.Lost)
	rt.resends.Add(1)
	rt.mu.Unlock()
	go func() {
		defer rt.resends.Done()
		if rt.forget != nil {
			rt.forget(tk.Lost) // its link's failure no longer fails this stage's waits
		}
		for _, t := range resend {
			if err := rt.net.Send(ctx, tk.Taker, t); err != nil {
				rt.mu.Lock()
				rt.err = cmp.Or(rt.err, fmt.Errorf("send %v again, to %s, which took %s's stage over: %w", t.Key, tk.Taker, tk.Lost, err))
				rt.mu.Unlock()
				return
			}
		}
	}()
}

// flush waits for the resends of the redirects taken up, and returns the first failure.
func (rt *route) flush() error {
	rt.resends.Wait()
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.err
}

// replaced reports whether a takeover replaced neighbour peer.
func (rt *route) replaced(peer string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return slices.Contains(rt.moved, peer)
}

// neighbour reports whether peer is one of the route's neighbours now or was replaced.
func (rt *route) neighbour(peer string) bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return peer == rt.prev || peer == rt.next || slices.Contains(rt.moved, peer)
}

// recvRouted receives the boundary tensor of key for a run sending through rt. On a route that
// logs (a stage of a step-mode replica), a failed link to one of its neighbours does not fail the
// wait at once: a stage takeover may name that neighbour, whose taker then sends the tensor; the
// wait goes on until the takeover comes (and the lost link is forgotten) or the step's context
// ends. Elsewhere a failed link fails the wait, as it always did.
func (r *StageRunner) recvRouted(ctx context.Context, rt *route, key proto.TensorKey) (proto.Tensor, error) {
	for {
		t, err := r.Net.Recv(ctx, key)
		var pe *PeerError
		if err == nil || ctx.Err() != nil || !errors.As(err, &pe) || !rt.neighbour(pe.Peer) || !rt.awaitRedirect(ctx, pe.Peer) {
			return t, err
		}
		r.forgetPeer(pe.Peer) // the redirect forgot its link; forget it again if it failed since
	}
}

// forgetPeer closes the link to peer and forgets its failure (workerNet.forget), where there is
// a link.
func (r *StageRunner) forgetPeer(peer string) {
	if w := baseNet(r.Net); w != nil {
		w.forget(peer)
	}
}

// takeOver takes up on run the stage takeover m (m.Stage): on the pool of the lost stage's blocks
// the reduction leaves the lost stage out and takes its taker's widened run, and the taker runs the
// lost run as one more leg; every other stage counts it (its neighbours redirected when it was
// offered: route.redirect).
func (r *StageRunner) takeOver(ctx context.Context, run *stepRun, m *proto.StepReroute) error {
	st, tk, s := run.st, m.Stage, r.Shard.Stage
	M := st.MicroBatches
	if err := proto.CheckShares(m.Shares, M); err != nil {
		return fmt.Errorf("step %d: takeover %d: %w", st.Step, m.Attempt, err)
	}
	if s.Lo != tk.Begin || s.Hi != tk.End {
		run.reroutes++
		return nil
	}
	share := map[int][2]int{}
	for _, sh := range m.Shares {
		share[sh.Replica] = [2]int{sh.First, sh.First + sh.MicroBatches}
	}
	mine, ok := share[r.Replica.Index]
	lost := [2]int{tk.First, tk.First + tk.MicroBatches}
	switch {
	case !ok:
		return fmt.Errorf("step %d: takeover %d leaves this stage's replica %d out", st.Step, m.Attempt, r.Replica.Index)
	case run.red == nil:
		return fmt.Errorf("step %d: a takeover of a stage that reduces with nobody", st.Step)
	case mine != [2]int{run.lo, run.hi} && !(mine == [2]int{run.lo, lost[1]} && lost[0] == run.hi || mine == [2]int{lost[0], run.hi} && lost[1] == run.lo):
		return fmt.Errorf("step %d: takeover %d gives replica %d micro-batches [%d,%d): its own are [%d,%d), the lost ones [%d,%d)",
			st.Step, m.Attempt, r.Replica.Index, mine[0], mine[1], run.lo, run.hi, lost[0], lost[1])
	}
	if r.fits != nil && mine != [2]int{run.lo, run.hi} {
		if err := r.fits(mine[0], mine[1]-mine[0]); err != nil {
			return fmt.Errorf("step %d: takeover %d widens this stage's run to micro-batches [%d,%d): %w", st.Step, m.Attempt, mine[0], mine[1], err)
		}
	}
	if err := r.reduceWith(run, share, M); err != nil {
		return fmt.Errorf("step %d: takeover %d: %w", st.Step, m.Attempt, err)
	}
	run.reroutes++
	if mine == [2]int{run.lo, run.hi} {
		return nil // a pool mate: it reduces with the taker's widened run
	}
	if err := r.Shard.ExtendGradients(mine[0], mine[1]); err != nil {
		return fmt.Errorf("step %d: takeover %d: %w", st.Step, m.Attempt, err)
	}
	run.lo, run.hi = mine[0], mine[1]
	return r.leg(ctx, run, lost[0], lost[1]-lost[0], &route{prev: tk.Prev, next: tk.Next})
}

// takerFor is whom a stage that sent peer its boundary tensors sends them to in a recomputation
// of a step taken over by tk: tk's taker where peer is the lost stage, else peer.
func takerFor(tk *proto.StageTakeover, peer string) string {
	if peer != "" && peer == tk.Lost {
		return tk.Taker
	}
	return peer
}
