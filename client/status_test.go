package client

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/proto"
)

// TestRunWorkerStatus: a worker configured as a browser tab reports the throughput it was given,
// asks for its id and presents its join link's token; OnStatus follows it from connecting to joined to stopped; and cancelling
// its context with a cause says Bye with that cause, which is how a closed tab tells the
// coordinator why it left.
func TestRunWorkerStatus(t *testing.T) {
	checkConnLeaks(t)
	hellos := make(chan *proto.Hello, 1)
	byes := make(chan string, 1)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, hello *proto.Hello) {
		hellos <- hello
		fakeWelcome(ctx, t, ws, 50)
		for {
			m, _, err := fakeRead(ctx, ws)
			if err != nil {
				return
			}
			if b, ok := m.(*proto.Bye); ok {
				byes <- b.Reason
				return
			}
		}
	})
	var mu sync.Mutex
	var states []State
	joined := make(chan Status, 1)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	done := make(chan error, 1)
	go func() {
		done <- RunWorker(ctx, WorkerConfig{Coordinator: url, Kind: proto.WorkerBrowser, GFLOPS: 7.5, WorkerID: "w-asked", JoinToken: "tok",
			MemoryBytes: 1 << 28, Name: "tab", Logger: slog.New(slog.DiscardHandler), OnStatus: func(s Status) {
				mu.Lock()
				defer mu.Unlock()
				if len(states) == 0 || states[len(states)-1] != s.State {
					states = append(states, s.State)
				}
				if s.State == StateJoined {
					select {
					case joined <- s:
					default:
					}
				}
			}})
	}()
	select {
	case h := <-hellos:
		if h.GFLOPS != 7.5 || h.WorkerID != "w-asked" || h.Kind != proto.WorkerBrowser || h.JoinToken != "tok" {
			t.Errorf("hello %+v: want 7.5 GFLOPS, id w-asked, kind browser, join token tok", h)
		}
	case <-time.After(connWait):
		t.Fatal("no hello")
	}
	select {
	case s := <-joined:
		if s.WorkerID != "w-test" || s.GFLOPS != 7.5 || s.Shard != nil {
			t.Errorf("joined status %+v: want id w-test, 7.5 GFLOPS, no shard", s)
		}
	case <-time.After(connWait):
		t.Fatal("no joined status")
	}
	cancel(errors.New("tab closed"))
	select {
	case reason := <-byes:
		if reason != "tab closed" {
			t.Errorf("Bye %q, want the context's cause, %q", reason, "tab closed")
		}
	case <-time.After(connWait):
		t.Fatal("no Bye")
	}
	if err := <-done; err != nil {
		t.Errorf("RunWorker: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []State{StateConnecting, StateJoined, StateStopped}; !slices.Equal(states, want) {
		t.Errorf("states %v, want %v", states, want)
	}
}

// TestShardStatus: a worker's page says what its assignment holds, and in a plan of several
// pipeline replicas which replica and which of its micro-batches.
func TestShardStatus(t *testing.T) {
	tests := []struct {
		name        string
		assign      proto.Assign
		want        string
		wantReplica *ReplicaStatus
	}{
		{
			name:   "a stage of one pipeline",
			assign: proto.Assign{Shard: proto.Shard{Stage: &proto.StageShard{Index: 1, Count: 3, Begin: 1, End: 3}}},
			want:   "stage 2 of 3: blocks [1,3)",
		},
		{
			name:   "experts",
			assign: proto.Assign{Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 1, Experts: []int{1, 2}}}},
			want:   "experts [1 2] of block 1",
		},
		{
			name: "experts for replicas",
			assign: proto.Assign{Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 3, Experts: []int{0, 2}}},
				Routers: []proto.ExpertRouter{{Worker: "w-a", MicroBatches: 3}, {Worker: "w-b", Replica: 1, First: 3, MicroBatches: 1}}},
			want: "experts [0 2] of block 3, for the stages of 2 pipeline replicas",
		},
		{
			name: "a stage of a replica",
			assign: proto.Assign{Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}},
				Replica: &proto.ReplicaAssign{Index: 1, Count: 2, First: 3, MicroBatches: 1,
					Peers: []proto.ReducePeer{{Worker: "w-a", Replica: 0, First: 0, MicroBatches: 3, Begin: 0, End: 4}}}},
			want:        "replica 2 of 2, stage 1 of 2: blocks [0,2), micro-batches [3,4) of every step",
			wantReplica: &ReplicaStatus{Index: 1, Count: 2, First: 3, MicroBatches: 1, Peers: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := shardStatus(&tt.assign)
			if got == nil {
				t.Fatal("shardStatus = nil")
			}
			if got.Text != tt.want {
				t.Errorf("text %q, want %q", got.Text, tt.want)
			}
			if (got.Replica == nil) != (tt.wantReplica == nil) || (got.Replica != nil && *got.Replica != *tt.wantReplica) {
				t.Errorf("replica %+v, want %+v", got.Replica, tt.wantReplica)
			}
			// The page keeps what OnStatus hands it: a clone shares nothing it could change.
			st := Status{Shard: got}.clone()
			if st.Shard == got || (got.Replica != nil && st.Shard.Replica == got.Replica) {
				t.Error("clone shares the shard with the board")
			}
		})
	}
}
