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
