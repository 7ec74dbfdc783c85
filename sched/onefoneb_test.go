package sched

import (
	"errors"
	"reflect"
	"strconv"
	"strings"
	"testing"
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

// TestOneFOneBShape checks, for every S ≤ 8 and M ≤ 16, each stage's list on its own: every
// micro-batch forwarded and backwarded once, both in micro-batch order; the warm-up length; the
// activations held; and no communication at the pipeline's ends.
func TestOneFOneBShape(t *testing.T) {
	for S := 1; S <= 8; S++ {
		for M := 1; M <= 16; M++ {
			for stage := 0; stage < S; stage++ {
				prog := OneFOneB(stage, S, M)
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
				if want := min(S-stage-1, M); warmup != want && !(want == M && warmup == M-1) {
					t.Errorf("S %d M %d stage %d: %d warm-up forwards, want %d", S, M, stage, warmup, want)
				}
				if want := min(S-stage, M); peak != want {
					t.Errorf("S %d M %d stage %d: holds %d micro-batches, want %d", S, M, stage, peak, want)
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
}
