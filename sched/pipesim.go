package sched

import (
	"fmt"
	"strings"
)

// PipelineRun is what SimulatePipeline observed.
type PipelineRun struct {
	// Ticks is the number of ticks until the last Forward or Backward finished.
	Ticks int
	// PeakHeld is, per stage, the most micro-batches whose activations were held at once
	// (forward done, backward not yet).
	PeakHeld []int
	// BackwardOrder is, per stage, the micro-batches in the order their backwards ran.
	BackwardOrder [][]int
}

// SimulatePipeline runs the instruction lists of all stages (stages[s] for stage s) against each
// other and reports how long they took, or why they cannot finish. The model:
//
//   - Between stages s and s+1 there are two FIFO queues, activations s→s+1 and gradients
//     s+1→s, each holding at most queueCap messages. A send blocks while its queue is full; a
//     receive blocks while its queue is empty. With queueCap 0 a send is a rendezvous, as on an
//     unbuffered Go channel: it completes only together with the matching receive.
//   - Time advances in ticks. Forward and Backward take one tick each; sends and receives take
//     none (transfer time is the planner's cost model's business, not the schedule's).
//   - In each tick, first every send and receive that can complete does, repeatedly, until none
//     can; then every stage whose next instruction is a Forward or Backward runs it. So a result
//     computed in tick t reaches the next stage in tick t+1.
//   - A tick in which nothing happens while instructions remain is a deadlock (ErrDeadlock,
//     with every stage's blocked instruction).
//
// It also checks the lists for consistency (ErrSchedule): a receive must get the micro-batch it
// names, a forward must follow the receive of its activation, a backward its forward and its
// gradient's receive, a send the computation of what it sends; no micro-batch is forwarded or
// backwarded twice; at the end nothing is left in a queue or held.
func SimulatePipeline(stages [][]Instruction, queueCap int) (PipelineRun, error) {
	return SimulatePipelineLatency(stages, queueCap, 0)
}

// SimulatePipelineLatency is SimulatePipeline over links of latency ticks: a message sent in
// tick t can be received from tick t+latency on (SimulatePipeline's is latency 0: sent and
// received in the same tick's exchange). A message on its way counts against its queue's
// capacity, as bytes not yet acknowledged count against a data channel's buffer, so with latency
// the queues need room for what is in flight; rendezvous (queueCap 0) needs latency 0. A tick in
// which nothing happens while a message is on its way is waiting, not a deadlock. This is what
// OneFOneBDepth's depth is for: on slow links it lets a stage compute while its messages travel.
func SimulatePipelineLatency(stages [][]Instruction, queueCap, latency int) (PipelineRun, error) {
	S := len(stages)
	if S == 0 || queueCap < 0 || latency < 0 || queueCap == 0 && latency > 0 {
		return PipelineRun{}, fmt.Errorf("%w: %d stages, queue capacity %d, latency %d", ErrBadInput, S, queueCap, latency)
	}
	type msg struct{ mb, at int } // at: the first tick it can be received in
	tick := 0
	type state struct {
		pc                int
		recvAct, recvGrad map[int]bool
		fwd, bwd          map[int]bool
		held, peak        int
		backwardOrder     []int
	}
	st := make([]*state, S)
	for s := range st {
		st[s] = &state{recvAct: map[int]bool{}, recvGrad: map[int]bool{}, fwd: map[int]bool{}, bwd: map[int]bool{}}
	}
	act := make([][]msg, S)  // act[s]: queue s → s+1
	grad := make([][]msg, S) // grad[s]: queue s+1 → s
	next := func(s int) (Instruction, bool) {
		if st[s].pc < len(stages[s]) {
			return stages[s][st[s].pc], true
		}
		return Instruction{}, false
	}
	bad := func(s int, in Instruction, format string, args ...any) error {
		return fmt.Errorf("%w: stage %d instruction %d %v: %s", ErrSchedule, s, st[s].pc, in, fmt.Sprintf(format, args...))
	}
	// deliver completes a receive of mb on stage s; it is called for a queued message or a
	// rendezvous.
	deliver := func(s int, in Instruction, mb int) error {
		if mb != in.MicroBatch {
			return bad(s, in, "received micro-batch %d", mb)
		}
		if in.Op == OpRecvAct {
			st[s].recvAct[mb] = true
		} else {
			st[s].recvGrad[mb] = true
		}
		st[s].pc++
		return nil
	}
	// communicate tries to complete stage s's next instruction if it is a send or receive.
	communicate := func(s int) (bool, error) {
		in, ok := next(s)
		if !ok {
			return false, nil
		}
		switch in.Op {
		case OpSendAct, OpSendGrad:
			to, q := s+1, &act[s]
			if in.Op == OpSendGrad {
				to = s - 1
				if s > 0 {
					q = &grad[s-1]
				}
			}
			if to < 0 || to >= S {
				return false, bad(s, in, "no stage %d to send to", to)
			}
			if in.Op == OpSendAct && !st[s].fwd[in.MicroBatch] || in.Op == OpSendGrad && !st[s].bwd[in.MicroBatch] {
				return false, bad(s, in, "sends what it has not computed")
			}
			if queueCap > 0 {
				if len(*q) == queueCap {
					return false, nil
				}
				*q = append(*q, msg{in.MicroBatch, tick + latency})
				st[s].pc++
				return true, nil
			}
			want := OpRecvAct
			if in.Op == OpSendGrad {
				want = OpRecvGrad
			}
			recv, ok := next(to)
			if !ok || recv.Op != want {
				return false, nil
			}
			st[s].pc++
			return true, deliver(to, recv, in.MicroBatch)
		case OpRecvAct, OpRecvGrad:
			var q *[]msg
			if in.Op == OpRecvAct && s > 0 {
				q = &act[s-1]
			} else if in.Op == OpRecvGrad && s < S-1 {
				q = &grad[s]
			}
			if q == nil {
				return false, bad(s, in, "no stage to receive from")
			}
			if len(*q) == 0 || (*q)[0].at > tick {
				return false, nil // or a rendezvous the sender completes, or on its way
			}
			m := (*q)[0]
			*q = (*q)[1:]
			return true, deliver(s, in, m.mb)
		}
		return false, nil
	}
	compute := func(s int, in Instruction) error {
		x, mb := st[s], in.MicroBatch
		switch in.Op {
		case OpForward:
			if s > 0 && !x.recvAct[mb] {
				return bad(s, in, "forward before its activation arrived")
			}
			if x.fwd[mb] {
				return bad(s, in, "second forward")
			}
			x.fwd[mb] = true
			x.held++
			x.peak = max(x.peak, x.held)
		case OpBackward:
			if !x.fwd[mb] || x.bwd[mb] {
				return bad(s, in, "backward without a forward, or twice")
			}
			if s < S-1 && !x.recvGrad[mb] {
				return bad(s, in, "backward before its gradient arrived")
			}
			x.bwd[mb] = true
			x.held--
			x.backwardOrder = append(x.backwardOrder, mb)
		}
		x.pc++
		return nil
	}

	run := PipelineRun{}
	for ; ; tick++ {
		progress := false
		for changed := true; changed; {
			changed = false
			for s := 0; s < S; s++ {
				ok, err := communicate(s)
				if err != nil {
					return run, err
				}
				changed = changed || ok
				progress = progress || ok
			}
		}
		for s := 0; s < S; s++ {
			if in, ok := next(s); ok && (in.Op == OpForward || in.Op == OpBackward) {
				if err := compute(s, in); err != nil {
					return run, err
				}
				run.Ticks = tick + 1
				progress = true
			} else if ok && in.Op != OpRecvAct && in.Op != OpRecvGrad && in.Op != OpSendAct && in.Op != OpSendGrad {
				return run, bad(s, in, "unknown op")
			}
		}
		done := true
		for s := range st {
			done = done && st[s].pc == len(stages[s])
		}
		if done {
			break
		}
		for s := 0; s < S && !progress; s++ {
			for _, q := range [][]msg{act[s], grad[s]} {
				progress = progress || len(q) > 0 && q[0].at > tick // waiting for a message on its way
			}
		}
		if !progress {
			var blocked []string
			for s := range st {
				if in, ok := next(s); ok {
					blocked = append(blocked, fmt.Sprintf("stage %d at %v", s, in))
				}
			}
			return run, fmt.Errorf("%w at tick %d: %s", ErrDeadlock, tick, strings.Join(blocked, ", "))
		}
	}
	for s, x := range st {
		if x.held != 0 || len(act[s]) > 0 || len(grad[s]) > 0 {
			return run, fmt.Errorf("%w: stage %d ends holding %d micro-batches with %d activations and %d gradients unreceived",
				ErrSchedule, s, x.held, len(act[s]), len(grad[s]))
		}
		run.PeakHeld = append(run.PeakHeld, x.peak)
		run.BackwardOrder = append(run.BackwardOrder, x.backwardOrder)
	}
	return run, nil
}
