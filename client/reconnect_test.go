package client

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/proto"
)

// TestRunWorkerRejoinsWithItsSession: a worker refused because the coordinator is at its cap
// (busy) or the job is private (forbidden) tries again later; once welcomed, every reconnection
// asks for its id with the credential of its last Welcome, and only that one.
func TestRunWorkerRejoinsWithItsSession(t *testing.T) {
	checkConnLeaks(t)
	hellos := make(chan *proto.Hello, 8)
	var conns atomic.Int32
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, hello *proto.Hello) {
		n := int(conns.Add(1))
		var answer proto.Message
		switch n {
		case 1:
			answer = &proto.Error{Code: proto.ErrCodeBusy, Message: "at the worker cap: retry later"}
		case 2:
			answer = &proto.Error{Code: proto.ErrCodeForbidden, Message: "this job is private: join with its link"}
		default:
			answer = &proto.Welcome{WorkerID: "w-7", HeartbeatMS: 1000, Loopback: true, Session: fakeSession(n)}
		}
		fakeSend(ctx, t, ws, answer)
		// Handed over once answered, so that the test never ends while an answer is being written.
		hellos <- hello
		if n <= 4 {
			return // refused, or welcomed and then dropped at once
		}
		for {
			if _, _, err := ws.Read(ctx); err != nil {
				return
			}
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- RunWorker(ctx, WorkerConfig{Coordinator: url, GFLOPS: 1, MemoryBytes: 1 << 28, Name: "box",
			BackoffBase: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	}()
	want := []struct{ id, session string }{
		{"", ""},                // the first join
		{"", ""},                // after busy: nothing granted yet
		{"", ""},                // after forbidden
		{"w-7", fakeSession(3)}, // the id of the third connection's Welcome, with its credential
		{"w-7", fakeSession(4)}, // a new credential with every Welcome
	}
	for i, w := range want {
		select {
		case h := <-hellos:
			if h.WorkerID != w.id || h.Session != w.session {
				t.Errorf("hello %d asks for %q with session %q, want %q with %q", i+1, h.WorkerID, h.Session, w.id, w.session)
			}
		case err := <-done:
			t.Fatalf("RunWorker returned after %d hellos: %v", i, err)
		case <-time.After(connWait):
			t.Fatalf("no hello %d: the worker gave up", i+1)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("RunWorker: %v", err)
	}
}
