package sched

import "fmt"

// Op is what one instruction of a pipeline stage does.
type Op uint8

const (
	// OpRecvAct receives the micro-batch's activation from the previous stage.
	OpRecvAct Op = 1 + iota
	// OpForward runs the stage's blocks forward and keeps what backward needs.
	OpForward
	// OpSendAct sends the stage's output to the next stage.
	OpSendAct
	// OpRecvGrad receives the gradient with respect to the stage's output from the next stage.
	OpRecvGrad
	// OpBackward runs the stage's blocks backward, accumulates parameter gradients and frees the
	// micro-batch's activations. On the last stage it starts from the loss.
	OpBackward
	// OpSendGrad sends the gradient with respect to the stage's input to the previous stage.
	OpSendGrad
)

var opNames = [...]string{"", "RecvAct", "Forward", "SendAct", "RecvGrad", "Backward", "SendGrad"}

func (o Op) String() string {
	if o >= OpRecvAct && o <= OpSendGrad {
		return opNames[o]
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Instruction is one step of a stage's schedule: an Op on a micro-batch.
type Instruction struct {
	Op         Op
	MicroBatch int
}

func (in Instruction) String() string { return fmt.Sprintf("%v(%d)", in.Op, in.MicroBatch) }

// RecvAct returns the instruction that receives micro-batch mb's activation.
func RecvAct(mb int) Instruction { return Instruction{OpRecvAct, mb} }

// Forward returns the instruction that runs micro-batch mb forward.
func Forward(mb int) Instruction { return Instruction{OpForward, mb} }

// SendAct returns the instruction that sends micro-batch mb's activation on.
func SendAct(mb int) Instruction { return Instruction{OpSendAct, mb} }

// RecvGrad returns the instruction that receives micro-batch mb's output gradient.
func RecvGrad(mb int) Instruction { return Instruction{OpRecvGrad, mb} }

// Backward returns the instruction that runs micro-batch mb backward.
func Backward(mb int) Instruction { return Instruction{OpBackward, mb} }

// SendGrad returns the instruction that sends micro-batch mb's input gradient back.
func SendGrad(mb int) Instruction { return Instruction{OpSendGrad, mb} }

// OneFOneB returns the instructions stage (0-based) of an S-stage pipeline runs for a step of M
// micro-batches: the one-forward-one-backward schedule of PipeDream-Flush (Narayanan et al.,
// "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021) as Megatron-LM runs it
// (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM", SC 2021, §2.2.1, the non-interleaved schedule; DeepSpeed's TrainSchedule is the
// same schedule):
//
//   - warm-up: W = min(S−stage−1, M) forwards, so that the last stage can start its first
//     backward as early as possible;
//   - steady state: M−W times, one forward (micro-batch W+i) then one backward (micro-batch i);
//   - cool-down: the W backwards left.
//
// Backwards run in micro-batch order 0..M−1 on every stage, so parameter gradients accumulate in
// the order a single process would accumulate them: this is what makes a pipelined step
// bitwise-equal to the unsplit one (docs/design.md, "Equivalence, defined"). A stage holds at most
// min(S−stage, M) micro-batches of activations at once, which the planner's memory model uses;
// GPipe's all-forwards-then-all-backwards would hold M.
//
// The first stage has no RecvAct (it embeds the micro-batch's tokens) and no SendGrad; the last
// stage has no SendAct and no RecvGrad (its backward starts from its own loss). Sends must not
// wait for the matching receive: with rendezvous sends, stage s's SendAct of its next
// micro-batch and stage s+1's SendGrad of the previous one would wait for each other forever.
// A one-message buffer per direction, which a WebRTC data channel gives, is enough;
// SimulatePipeline checks both claims.
//
// OneFOneB is OneFOneBDepth with depth 0. It panics unless S ≥ 1, 0 ≤ stage < S and M ≥ 1.
func OneFOneB(stage, S, M int) []Instruction {
	if S < 1 || stage < 0 || stage >= S || M < 1 {
		panic(fmt.Sprintf("sched.OneFOneB(stage %d, S %d, M %d): need S >= 1, 0 <= stage < S, M >= 1", stage, S, M))
	}
	return OneFOneBDepth(stage, S, M, 0)
}

// OneFOneBDepth is OneFOneB with depth extra micro-batches in flight, to hide link latency
// (issue 17, item 5). In plain 1F1B a stage idles, after its warm-up, for the round trip to the
// last stage and back: with 50 ms between stages that is most of a step on small models. Here
// every stage runs depth more warm-up forwards,
//
//	W = min(S−stage−1+depth, M),
//
// then M−W times one forward (micro-batch W+i) and one backward (micro-batch i), then the W
// backwards left. Forwards and backwards both still run in micro-batch order 0..M−1 on every
// stage, so the parameter gradients accumulate in the same order as with depth 0 and as in one
// process: a step's results are bitwise the same whatever the depth (docs/design.md, "Equivalence, defined");
// only the time a stage waits, and its memory, change. A stage holds at most
// min(S−stage+depth, M) micro-batches of activations (the planner's memory model counts the
// depth: Profile.StageMemoryDepth); depth ≥ M−1 is GPipe on every stage (all forwards first),
// holding M.
//
// Deadlock freedom. W is non-increasing along the pipeline: W_s ≥ W_{s+1} (S−s−1+depth falls by
// one per stage, and min with M keeps the order). Stage s waits for gradient i (RecvGrad(i)) only
// after it has sent activation min(W_s+i, M−1), and W_s+i ≥ W_{s+1}+i: so every activation stage
// s+1 forwards before its backward i — micro-batches up to min(W_{s+1}+i, M−1) — has been sent
// by then. By induction from the last stage (whose backward i needs nothing but its own forwards)
// towards the first, and over i, each stage's i-th gradient therefore arrives whatever its
// neighbours are waiting for, provided sends do not wait for the matching receive. As for
// OneFOneB, a one-message buffer per direction is enough: SimulatePipeline checks this, the
// order of the backwards and the peak memory for every depth 0..M−1, and
// SimulatePipelineLatency that each extra depth shortens a step on links with latency, down to
// one round trip through the pipeline at depth M−1. Without latency depth changes nothing in
// time (2(M+S−1) forward/backward slots either way).
//
// OneFOneBDepth panics unless S ≥ 1, 0 ≤ stage < S, M ≥ 1 and depth ≥ 0. A depth of M−1 or
// more is the same schedule as M−1 (W is capped at M).
func OneFOneBDepth(stage, S, M, depth int) []Instruction {
	if S < 1 || stage < 0 || stage >= S || M < 1 || depth < 0 {
		panic(fmt.Sprintf("sched.OneFOneBDepth(stage %d, S %d, M %d, depth %d): need S >= 1, 0 <= stage < S, M >= 1, depth >= 0",
			stage, S, M, depth))
	}
	first, last := stage == 0, stage == S-1
	out := make([]Instruction, 0, 6*M)
	forward := func(mb int) {
		if !first {
			out = append(out, RecvAct(mb))
		}
		out = append(out, Forward(mb))
		if !last {
			out = append(out, SendAct(mb))
		}
	}
	backward := func(mb int) {
		if !last {
			out = append(out, RecvGrad(mb))
		}
		out = append(out, Backward(mb))
		if !first {
			out = append(out, SendGrad(mb))
		}
	}
	warmup := Warmup(stage, S, M, depth)
	for mb := 0; mb < warmup; mb++ {
		forward(mb)
	}
	for i := 0; i < M-warmup; i++ {
		forward(warmup + i)
		backward(i)
	}
	for mb := M - warmup; mb < M; mb++ {
		backward(mb)
	}
	return out
}

// Warmup is the number of warm-up forwards of stage of S in OneFOneBDepth: min(S−stage−1+depth,
// M), computed without overflow for any depth ≥ 0.
func Warmup(stage, S, M, depth int) int {
	return min(S-stage-1, M) + min(depth, M-min(S-stage-1, M))
}

// InFlight is the most micro-batches whose activations stage of S holds at once under
// OneFOneBDepth: min(S−stage+depth, M). The memory model multiplies a stage's activation bytes
// per micro-batch by it.
func InFlight(stage, S, M, depth int) int {
	return min(Warmup(stage, S, M, depth)+1, M)
}
