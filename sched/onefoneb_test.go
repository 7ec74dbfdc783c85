package sched

import (
	"errors"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// parseSchedule reads the shorthand "RA0 F0 SA0 RG0 B0 SG0" used in the tables below.
func parseSchedule(t *testing.T, s string) []Instruction {
	t.Helper()
	ops := map[string]Op{"RA": OpRecvAct, "F": OpForward, "SA": OpSendAct, "RG": OpRecvGrad, "B": OpBackward, "SG": OpSendGrad}
	var out []Instruction
	for _, f := range strings.Fields(s) {
		i := strings.IndexAny(f, "0123456789")
		mb, err := strconv.Atoi(f[i:])
		op, ok := ops[f[:i]]
		if i < 1 || err != nil || !ok {
			t.Fatalf("bad instruction %q", f)
		}
		out = append(out, Instruction{op, mb})
	}
	return out
}

func TestOneFOneBOrder(t *testing.T) {
	tests := []struct {
		name        string
		stage, S, M int
		want        string
	}{
		{"single-stage", 0, 1, 3, "F0 B0 F1 B1 F2 B2"},
		{"two-stages-first", 0, 2, 3, "F0 SA0  F1 SA1 RG0 B0  F2 SA2 RG1 B1  RG2 B2"},
		{"two-stages-last", 1, 2, 3, "RA0 F0 B0 SG0  RA1 F1 B1 SG1  RA2 F2 B2 SG2"},
		{"three-stages-middle", 1, 3, 4, "RA0 F0 SA0  RA1 F1 SA1 RG0 B0 SG0  RA2 F2 SA2 RG1 B1 SG1  RA3 F3 SA3 RG2 B2 SG2  RG3 B3 SG3"},
		{"four-stages-first-short-step", 0, 4, 2, "F0 SA0 F1 SA1  RG0 B0 RG1 B1"},
		{"four-stages-second-short-step", 1, 4, 2, "RA0 F0 SA0 RA1 F1 SA1  RG0 B0 SG0 RG1 B1 SG1"},
		{"four-stages-third-short-step", 2, 4, 2, "RA0 F0 SA0  RA1 F1 SA1 RG0 B0 SG0  RG1 B1 SG1"},
		{"four-stages-last-short-step", 3, 4, 2, "RA0 F0 B0 SG0  RA1 F1 B1 SG1"},
		{"one-micro-batch", 1, 3, 1, "RA0 F0 SA0 RG0 B0 SG0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := OneFOneB(tt.stage, tt.S, tt.M)
			if want := parseSchedule(t, tt.want); !reflect.DeepEqual(got, want) {
				t.Errorf("OneFOneB(%d, %d, %d)\n got %v\nwant %v", tt.stage, tt.S, tt.M, got, want)
			}
		})
	}
}

// TestOneFOneBShape checks, for every S ≤ 8, M ≤ 16 and depth 0..M (M is past the last depth
// that differs), each stage's list on its own: every micro-batch forwarded and backwarded once,
// both in micro-batch order; the warm-up length min(S−stage−1+depth, M); the activations held,
// min(S−stage+depth, M); and no communication at the pipeline's ends. Depth 0 is OneFOneB.
func TestOneFOneBShape(t *testing.T) {
	for S := 1; S <= 8; S++ {
		for M := 1; M <= 16; M++ {
			for stage, depth := 0, 0; stage < S; stage, depth = stage+(depth+1)/(M+1), (depth+1)%(M+1) {
				prog := OneFOneBDepth(stage, S, M, depth)
				if depth == 0 && !reflect.DeepEqual(prog, OneFOneB(stage, S, M)) {
					t.Fatalf("S %d M %d stage %d: depth 0 is not OneFOneB", S, M, stage)
				}
				var fwd, bwd []int
				held, peak, warmup := 0, 0, -1
				for _, in := range prog {
					switch in.Op {
					case OpForward:
						fwd = append(fwd, in.MicroBatch)
						held++
						peak = max(peak, held)
					case OpBackward:
						if warmup < 0 {
							warmup = len(fwd) - 1 // the forward just before the first backward is steady state
						}
						bwd = append(bwd, in.MicroBatch)
						held--
					case OpRecvAct, OpSendGrad:
						if stage == 0 {
							t.Fatalf("S %d M %d: the first stage has %v", S, M, in)
						}
					case OpSendAct, OpRecvGrad:
						if stage == S-1 {
							t.Fatalf("S %d M %d: the last stage has %v", S, M, in)
						}
					}
				}
				order := make([]int, M)
				for i := range order {
					order[i] = i
				}
				if !reflect.DeepEqual(fwd, order) || !reflect.DeepEqual(bwd, order) {
					t.Fatalf("S %d M %d stage %d: forwards %v backwards %v, want both %v", S, M, stage, fwd, bwd, order)
				}
				if want := min(S-stage-1+depth, M); warmup != want && !(want == M && warmup == M-1) || Warmup(stage, S, M, depth) != want {
					t.Errorf("S %d M %d stage %d depth %d: %d warm-up forwards (Warmup %d), want %d",
						S, M, stage, depth, warmup, Warmup(stage, S, M, depth), want)
				}
				if want := min(S-stage+depth, M); peak != want || InFlight(stage, S, M, depth) != want {
					t.Errorf("S %d M %d stage %d depth %d: holds %d micro-batches (InFlight %d), want %d",
						S, M, stage, depth, peak, InFlight(stage, S, M, depth), want)
				}
			}
		}
	}
}

func pipeline(S, M int, schedule func(stage, S, M int) []Instruction) [][]Instruction {
	stages := make([][]Instruction, S)
	for s := range stages {
		stages[s] = schedule(s, S, M)
	}
	return stages
}

// TestOneFOneBSimulation runs all stages against each other for every S ≤ 8 and M ≤ 16, with one-
// and two-message queues per direction: no deadlock, 2(M+S−1) ticks with unit-time forward and
// backward, at most S−stage micro-batches held, backwards in micro-batch order.
func TestOneFOneBSimulation(t *testing.T) {
	for _, queueCap := range []int{1, 2} {
		for S := 1; S <= 8; S++ {
			for M := 1; M <= 16; M++ {
				run, err := SimulatePipeline(pipeline(S, M, OneFOneB), queueCap)
				if err != nil {
					t.Fatalf("queue %d S %d M %d: %v", queueCap, S, M, err)
				}
				if want := 2 * (M + S - 1); run.Ticks != want {
					t.Errorf("queue %d S %d M %d: %d ticks, want %d", queueCap, S, M, run.Ticks, want)
				}
				for s := 0; s < S; s++ {
					if want := min(S-s, M); run.PeakHeld[s] != want {
						t.Errorf("queue %d S %d M %d stage %d: held %d micro-batches, want %d", queueCap, S, M, s, run.PeakHeld[s], want)
					}
					for i, mb := range run.BackwardOrder[s] {
						if mb != i {
							t.Fatalf("queue %d S %d M %d stage %d: backward order %v", queueCap, S, M, s, run.BackwardOrder[s])
						}
					}
				}
			}
		}
	}
}

// TestOneFOneBDepthSimulation runs all stages against each other for every S ≤ 8, M ≤ 12 and
// depth 0..M−1, with one- and two-message queues per direction: no deadlock, backwards in
// micro-batch order on every stage, stage s holding min(S−s+depth, M) micro-batches at its peak,
// and, without link latency, the same 2(M+S−1) ticks as depth 0 (depth costs no compute).
func TestOneFOneBDepthSimulation(t *testing.T) {
	for _, queueCap := range []int{1, 2} {
		for S := 1; S <= 8; S++ {
			for M := 1; M <= 12; M++ {
				for depth := 0; depth < M; depth++ {
					schedule := func(stage, S, M int) []Instruction { return OneFOneBDepth(stage, S, M, depth) }
					run, err := SimulatePipeline(pipeline(S, M, schedule), queueCap)
					if err != nil {
						t.Fatalf("queue %d S %d M %d depth %d: %v", queueCap, S, M, depth, err)
					}
					if want := 2 * (M + S - 1); run.Ticks != want {
						t.Errorf("queue %d S %d M %d depth %d: %d ticks, want %d", queueCap, S, M, depth, run.Ticks, want)
					}
					for s := 0; s < S; s++ {
						if want := min(S-s+depth, M); run.PeakHeld[s] != want {
							t.Errorf("queue %d S %d M %d depth %d stage %d: held %d micro-batches, want %d",
								queueCap, S, M, depth, s, run.PeakHeld[s], want)
						}
						for i, mb := range run.BackwardOrder[s] {
							if mb != i {
								t.Fatalf("queue %d S %d M %d depth %d stage %d: backward order %v", queueCap, S, M, depth, s, run.BackwardOrder[s])
							}
						}
					}
				}
			}
		}
	}
}

// TestOneFOneBDepthHidesLatency is what depth is for: with links of a few ticks' latency, plain
// 1F1B (depth 0) waits for every round trip, and each extra micro-batch in flight shortens the
// step (never lengthens it), down to the bound of one forward and one backward trip through the
// pipeline, 2(M+S−1) + 2(S−1)·latency ticks, at depth M−1.
func TestOneFOneBDepthHidesLatency(t *testing.T) {
	for _, latency := range []int{1, 3, 10} {
		for S := 2; S <= 6; S++ {
			for M := 2; M <= 10; M++ {
				prev := 0
				for depth := 0; depth < M; depth++ {
					schedule := func(stage, S, M int) []Instruction { return OneFOneBDepth(stage, S, M, depth) }
					run, err := SimulatePipelineLatency(pipeline(S, M, schedule), M, latency)
					if err != nil {
						t.Fatalf("latency %d S %d M %d depth %d: %v", latency, S, M, depth, err)
					}
					if depth > 0 && run.Ticks > prev {
						t.Errorf("latency %d S %d M %d: depth %d takes %d ticks, depth %d %d", latency, S, M, depth, run.Ticks, depth-1, prev)
					}
					prev = run.Ticks
					for s := 0; s < S; s++ {
						for i, mb := range run.BackwardOrder[s] {
							if mb != i {
								t.Fatalf("latency %d S %d M %d depth %d stage %d: backward order %v", latency, S, M, depth, s, run.BackwardOrder[s])
							}
						}
					}
				}
				if want := 2*(M+S-1) + 2*(S-1)*latency; prev != want {
					t.Errorf("latency %d S %d M %d depth %d: %d ticks, want %d", latency, S, M, M-1, prev, want)
				}
				run0, _ := SimulatePipelineLatency(pipeline(S, M, OneFOneB), M, latency)
				if M > 2 && run0.Ticks <= prev {
					t.Errorf("latency %d S %d M %d: depth 0 takes %d ticks, depth %d %d: depth hid nothing", latency, S, M, run0.Ticks, M-1, prev)
				}
			}
		}
	}
	// Rendezvous cannot have latency: a send that completes only with its receive is not on its way.
	if _, err := SimulatePipelineLatency(pipeline(2, 2, OneFOneB), 0, 1); !errors.Is(err, ErrBadInput) {
		t.Errorf("rendezvous with latency: %v, want ErrBadInput", err)
	}
}

// gpipe is GPipe's schedule (all forwards, then all backwards): the same makespan, but every
// stage holds all M micro-batches. A contrast that shows the simulator measures what it claims.
func gpipe(stage, S, M int) []Instruction {
	var out []Instruction
	for mb := 0; mb < M; mb++ {
		if stage > 0 {
			out = append(out, RecvAct(mb))
		}
		out = append(out, Forward(mb))
		if stage < S-1 {
			out = append(out, SendAct(mb))
		}
	}
	for mb := 0; mb < M; mb++ {
		if stage < S-1 {
			out = append(out, RecvGrad(mb))
		}
		out = append(out, Backward(mb))
		if stage > 0 {
			out = append(out, SendGrad(mb))
		}
	}
	return out
}

func TestSimulatePipeline(t *testing.T) {
	tests := []struct {
		name     string
		stages   [][]Instruction
		queueCap int
		ticks    int   // when err is nil
		peak     []int // when err is nil
		err      error
	}{
		{"gpipe", pipeline(3, 4, gpipe), 4, 12, []int{4, 4, 4}, nil},
		{"one-f-one-b", pipeline(3, 4, OneFOneB), 1, 12, []int{3, 2, 1}, nil},
		// Rendezvous sends deadlock 1F1B: stage 0 sends activation 1 while stage 1 sends
		// gradient 0, each waiting for the other to receive. This is why OneFOneB needs a
		// one-message buffer per direction.
		{"one-f-one-b-rendezvous", pipeline(2, 2, OneFOneB), 0, 0, nil, ErrDeadlock},
		{"one-f-one-b-rendezvous-one-micro-batch", pipeline(2, 1, OneFOneB), 0, 4, []int{1, 1}, nil},
		{"missing-send", [][]Instruction{parseSchedule(t, "F0"), parseSchedule(t, "RA0 F0 B0")}, 1, 0, nil, ErrDeadlock},
		{"receive-out-of-order", [][]Instruction{parseSchedule(t, "F0 SA0 F1 SA1"), parseSchedule(t, "RA1 RA0 F0 F1")}, 2, 0, nil, ErrSchedule},
		{"backward-before-forward", [][]Instruction{parseSchedule(t, "B0 F0")}, 1, 0, nil, ErrSchedule},
		{"forward-before-receive", [][]Instruction{parseSchedule(t, "F0 SA0 RG0 B0"), parseSchedule(t, "F0 RA0 B0 SG0")}, 1, 0, nil, ErrSchedule},
		{"send-before-compute", [][]Instruction{parseSchedule(t, "SA0 F0")}, 1, 0, nil, ErrSchedule},
		{"send-past-the-end", [][]Instruction{parseSchedule(t, "F0 SA0 B0")}, 1, 0, nil, ErrSchedule},
		{"forgotten-backward", [][]Instruction{parseSchedule(t, "F0")}, 1, 0, nil, ErrSchedule},
		// The most depth is GPipe, memory and all.
		{"depth-m-1-is-gpipe", pipeline(3, 4, func(stage, S, M int) []Instruction { return OneFOneBDepth(stage, S, M, M-1) }),
			4, 12, []int{4, 4, 4}, nil},
		{"depth-1", pipeline(3, 4, func(stage, S, M int) []Instruction { return OneFOneBDepth(stage, S, M, 1) }), 1, 12, []int{4, 3, 2}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			run, err := SimulatePipeline(tt.stages, tt.queueCap)
			if !errors.Is(err, tt.err) {
				t.Fatalf("SimulatePipeline = %v, want %v", err, tt.err)
			}
			if err != nil {
				return
			}
			if run.Ticks != tt.ticks || !reflect.DeepEqual(run.PeakHeld, tt.peak) {
				t.Errorf("got %d ticks, peak %v; want %d, %v", run.Ticks, run.PeakHeld, tt.ticks, tt.peak)
			}
		})
	}
}

func TestOneFOneBDepthOrder(t *testing.T) {
	tests := []struct {
		name               string
		stage, S, M, depth int
		want               string
	}{
		{"single-stage-depth-1", 0, 1, 3, 1, "F0 F1 B0 F2 B1 B2"},
		{"two-stages-first-depth-1", 0, 2, 4, 1, "F0 SA0 F1 SA1  F2 SA2 RG0 B0  F3 SA3 RG1 B1  RG2 B2 RG3 B3"},
		{"two-stages-last-depth-1", 1, 2, 4, 1, "RA0 F0  RA1 F1 B0 SG0  RA2 F2 B1 SG1  RA3 F3 B2 SG2  B3 SG3"},
		{"three-stages-middle-depth-2", 1, 3, 4, 2, "RA0 F0 SA0 RA1 F1 SA1 RA2 F2 SA2  RA3 F3 SA3 RG0 B0 SG0  RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3"},
		{"depth-past-m", 0, 2, 2, 5, "F0 SA0 F1 SA1 RG0 B0 RG1 B1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := OneFOneBDepth(tt.stage, tt.S, tt.M, tt.depth)
			if want := parseSchedule(t, tt.want); !reflect.DeepEqual(got, want) {
				t.Errorf("OneFOneBDepth(%d, %d, %d, %d)\n got %v\nwant %v", tt.stage, tt.S, tt.M, tt.depth, got, want)
			}
		})
	}
	if got := Warmup(0, 4, 8, math.MaxInt); got != 8 {
		t.Errorf("Warmup with the largest depth = %d, want M", got)
	}
}

func TestOneFOneBPanics(t *testing.T) {
	for _, args := range [][3]int{{0, 0, 1}, {-1, 2, 1}, {2, 2, 1}, {0, 2, 0}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("OneFOneB%v did not panic", args)
				}
			}()
			OneFOneB(args[0], args[1], args[2])
		}()
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Errorf("OneFOneBDepth with depth -1 did not panic")
			}
		}()
		OneFOneBDepth(0, 2, 2, -1)
	}()
}

// TestStageMemoryCountsDepth: the memory model counts OneFOneBDepth's extra micro-batches —
// min(S−index+depth, M) of them on stage index — and depth 0 is the plain 1F1B budget.
func TestStageMemoryCountsDepth(t *testing.T) {
	cfg := model.TinyConfig()
	prof, err := NewProfile(cfg, 2)
	if err != nil {
		t.Fatal(err)
	}
	const S, M = 3, 6
	for i := 0; i < S; i++ {
		c := prof.stageCost(i, i+1)
		for depth := 0; depth < M; depth++ {
			want := c.StateBytes + TreeBytesPerParam(M, 0, M)*float64(c.Params) + float64(min(S-i+depth, M))*c.ActBytes
			if got := prof.StageMemoryDepth(i, i+1, i, S, M, depth); got != want {
				t.Errorf("stage %d depth %d: StageMemoryDepth %v, want %v", i, depth, got, want)
			}
			if got, err := StageShardMemory(cfg, 2, M, i, i+1, i, S, 0, depth, ShardJob{}); err != nil || got != want {
				t.Errorf("stage %d depth %d: StageShardMemory %v (%v), want %v", i, depth, got, err, want)
			}
		}
		if d0, old := prof.StageMemoryDepth(i, i+1, i, S, M, 0), prof.StageMemory(i, i+1, i, S, M); d0 != old {
			t.Errorf("stage %d: depth 0 %v, StageMemory %v", i, d0, old)
		}
		if got, _ := StageShardMemory(cfg, 2, M, i, i+1, i, S, 0, 0, ShardJob{}); got != prof.StageMemory(i, i+1, i, S, M) {
			t.Errorf("stage %d: StageShardMemory %v is not depth 0", i, got)
		}
	}
	for _, depth := range []int{-1, M, math.MaxInt} {
		if _, err := StageShardMemory(cfg, 2, M, 0, 1, 0, S, 0, depth, ShardJob{}); !errors.Is(err, ErrBadInput) {
			t.Errorf("depth %d: %v, want ErrBadInput", depth, err)
		}
	}
}
