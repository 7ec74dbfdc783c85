package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/internal/leaktest"
	"github.com/shoal-ml/shoal/proto"
)

// The Conn tests talk to scripted fake coordinators over real WebSockets on 127.0.0.1: client
// must not import coordinator, and a fake can misbehave in ways the real hub never does. The
// coordinator's tests (coordinator/hub_test.go) run Conn against the real hub.

const connWait = 5 * time.Second

func checkConnLeaks(t *testing.T) {
	t.Helper()
	leaktest.Check(t, connWait)
}

// fakeCoordinator serves one scripted connection per dial: it reads the hello and hands the socket
// to script, then closes it. It returns the ws:// URL.
func fakeCoordinator(t *testing.T, script func(ctx context.Context, ws *websocket.Conn, hello *proto.Hello)) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), connWait)
	var wg sync.WaitGroup
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		wg.Add(1)
		defer wg.Done()
		ws, err := websocket.Accept(w, r, nil)
		if err != nil {
			t.Errorf("accept: %v", err)
			return
		}
		defer ws.CloseNow()
		ws.SetReadLimit(proto.MaxBinarySize)
		_, b, err := ws.Read(ctx)
		if err != nil {
			t.Errorf("read hello: %v", err)
			return
		}
		m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
		if err != nil {
			t.Errorf("decode hello: %v", err)
			return
		}
		script(ctx, ws, m.(*proto.Hello))
	}))
	t.Cleanup(func() {
		cancel() // ends scripts still reading
		srv.Close()
		wg.Wait()
	})
	return "ws" + strings.TrimPrefix(srv.URL, "http")
}

func fakeSend(ctx context.Context, t *testing.T, ws *websocket.Conn, m proto.Message) {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		t.Error(err)
		return
	}
	if err := ws.Write(ctx, websocket.MessageText, b); err != nil {
		t.Errorf("fake coordinator write: %v", err)
	}
}

func fakeWelcome(ctx context.Context, t *testing.T, ws *websocket.Conn, heartbeatMS int64) {
	fakeSend(ctx, t, ws, &proto.Welcome{WorkerID: "w-test", HeartbeatMS: heartbeatMS, Loopback: true, Session: fakeSession(0)})
}

// fakeSession is the n-th session credential a fake coordinator hands out: 43 characters of
// base64url, as proto checks.
func fakeSession(n int) string {
	return fmt.Sprintf("session-%035d", n)
}

// fakeRead reads the worker's next message: a control message, or a binary one as raw bytes.
func fakeRead(ctx context.Context, ws *websocket.Conn) (proto.Message, []byte, error) {
	typ, b, err := ws.Read(ctx)
	if err != nil {
		return nil, nil, err
	}
	if typ == websocket.MessageBinary {
		return nil, b, nil
	}
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	return m, nil, err
}

func connHello() proto.Hello {
	return proto.Hello{Kind: proto.WorkerBrowser, Backend: proto.BackendWebGPU, GFLOPS: 3, MemoryBytes: 1 << 28, Threads: 1, Name: "tab"}
}

func dialConn(t *testing.T, cfg ConnConfig) (*Conn, *proto.Welcome) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), connWait)
	defer cancel()
	c, w, err := Dial(ctx, cfg)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c, w
}

func waitDone(t *testing.T, c *Conn) error {
	t.Helper()
	select {
	case <-c.Done():
		return c.Err()
	case <-time.After(connWait):
		t.Fatal("connection still up")
	}
	panic("unreachable")
}

func TestConnDialVersionMismatch(t *testing.T) {
	checkConnLeaks(t)
	// A coordinator of a newer protocol answers in it: this worker cannot even read the error,
	// and must say which side to upgrade.
	newer := proto.ProtocolVersion + 1
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		ws.Write(ctx, websocket.MessageText, []byte(fmt.Sprintf(`{"v":%d,"type":"error","body":{"code":"protocol","message":"worker speaks protocol %d, this coordinator speaks %d: upgrade the worker"}}`,
			newer, proto.ProtocolVersion, newer)))
		ws.Read(ctx) // until the worker hangs up
	})
	ctx, cancel := context.WithTimeout(context.Background(), connWait)
	defer cancel()
	_, _, err := Dial(ctx, ConnConfig{URL: url, Hello: connHello()})
	var verr *proto.VersionError
	if !errors.Is(err, proto.ErrProtocolVersion) || !errors.As(err, &verr) {
		t.Fatalf("got %v, want a version error", err)
	}
	if want := fmt.Sprintf("coordinator speaks protocol %d, this worker speaks %d: upgrade the worker", newer, proto.ProtocolVersion); !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not say %q", err, want)
	}
}

func TestConnDialRefused(t *testing.T) {
	checkConnLeaks(t)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		fakeSend(ctx, t, ws, &proto.Error{Code: proto.ErrCodeProtocol, Message: "no room for browsers today"})
		ws.Read(ctx)
	})
	ctx, cancel := context.WithTimeout(context.Background(), connWait)
	defer cancel()
	_, _, err := Dial(ctx, ConnConfig{URL: url, Hello: connHello()})
	var perr *proto.Error
	if !errors.As(err, &perr) || perr.Message != "no room for browsers today" {
		t.Fatalf("got %v, want the coordinator's error", err)
	}

	// An invalid hello is refused before dialling.
	bad := connHello()
	bad.Threads = 0
	if _, _, err := Dial(ctx, ConnConfig{URL: url, Hello: bad}); !errors.Is(err, proto.ErrBadMessage) {
		t.Fatalf("invalid hello: %v", err)
	}
}

// fakeReport is what a scripted coordinator saw the worker send.
type fakeReport struct {
	hello      *proto.Hello
	heartbeats int
	acked7     bool
	ready      bool
	bye        *proto.Bye
}

func TestConnMessagesAndHeartbeats(t *testing.T) {
	checkConnLeaks(t)
	report := make(chan fakeReport, 1)
	beats := make(chan struct{}, 64) // a heartbeat the coordinator answered
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, hello *proto.Hello) {
		rep := fakeReport{hello: hello}
		defer func() { report <- rep }()
		// 50 ms: the silence timeout (5 intervals) must outlast a scheduling stall of a loaded
		// 2-core machine running other packages' tests (113 ms was seen at 20 ms).
		fakeWelcome(ctx, t, ws, 50)
		fakeSend(ctx, t, ws, &proto.Heartbeat{Seq: 7})
		fakeSend(ctx, t, ws, &proto.Clip{Step: 1, Factor: 1})
		fakeSend(ctx, t, ws, &proto.Signal{From: "w-peer", To: "w-test", Candidate: &proto.ICECandidate{}})
		for {
			m, _, err := fakeRead(ctx, ws)
			if err != nil {
				return
			}
			switch m := m.(type) {
			case *proto.Heartbeat:
				if m.Ack {
					rep.acked7 = rep.acked7 || m.Seq == 7
					continue
				}
				rep.heartbeats++
				fakeSend(ctx, t, ws, &proto.Heartbeat{Seq: m.Seq, Ack: true})
				select {
				case beats <- struct{}{}:
				default:
				}
			case *proto.Ready:
				rep.ready = true
			case *proto.Bye:
				rep.bye = m
				return
			}
		}
	})
	c, w := dialConn(t, ConnConfig{URL: url, Hello: connHello()})
	if w.WorkerID != "w-test" || c.ID() != "w-test" || w.HeartbeatMS != 50 || !w.Loopback {
		t.Fatalf("welcome %+v", w)
	}
	// In order, without the heartbeat.
	if m, ok := (<-c.Messages()).(*proto.Clip); !ok || m.Step != 1 {
		t.Fatalf("first message %#v, want the clip", m)
	}
	if m, ok := (<-c.Messages()).(*proto.Signal); !ok || m.From != "w-peer" {
		t.Fatalf("second message %#v, want the signal", m)
	}
	if err := c.Send(context.Background(), &proto.Ready{PlanVersion: 1}); err != nil {
		t.Fatal(err)
	}
	// A few heartbeats answered, however slowly the machine sends them.
	for range 3 {
		select {
		case <-beats:
		case <-time.After(connWait):
			t.Fatal("the worker stopped heartbeating")
		}
	}
	if err := c.Err(); err != nil {
		t.Fatalf("connection failed while the coordinator answered: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Err(); !errors.Is(err, ErrConnClosed) {
		t.Fatalf("after Close: %v", err)
	}
	if _, ok := <-c.Messages(); ok {
		t.Fatal("messages still open after Close")
	}
	if err := c.Send(context.Background(), &proto.Ready{}); !errors.Is(err, ErrConnClosed) {
		t.Fatalf("send after Close: %v", err)
	}
	rep := <-report
	if rep.hello.Name != "tab" || rep.hello.Kind != proto.WorkerBrowser {
		t.Fatalf("hello %+v", rep.hello)
	}
	if rep.heartbeats < 2 || !rep.acked7 || !rep.ready || rep.bye == nil {
		t.Fatalf("coordinator saw %+v, want heartbeats, the ack of 7, the ready and a bye", rep)
	}
}

func TestConnFrames(t *testing.T) {
	checkConnLeaks(t)
	frame, err := proto.AppendFrame(nil, proto.FrameHeader{
		TensorKey: proto.TensorKey{Kind: proto.KindTokens, Block: proto.NoBlock, Expert: proto.NoExpert},
		DType:     proto.I32, Shape: proto.Shape{3, 1, 1, 1}, ChunkIndex: 0, ChunkCount: 1,
	}, proto.AppendInt32s(nil, []int32{1, 2, 3}), proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	relayed := make(chan []byte, 1)
	complaint := make(chan *proto.Error, 1)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		fakeWelcome(ctx, t, ws, 1000)
		direct, _ := proto.AppendDirect(nil, frame)
		relay, _ := proto.AppendRelay(nil, "w-peer", frame)
		ws.Write(ctx, websocket.MessageBinary, direct)
		ws.Write(ctx, websocket.MessageBinary, relay)
		for { // the worker's relayed frame, then garbage and the worker's complaint about it
			m, b, err := fakeRead(ctx, ws)
			if err != nil {
				return
			}
			if b != nil {
				relayed <- b
				ws.Write(ctx, websocket.MessageBinary, []byte{9, 9, 9})
			}
			if perr, ok := m.(*proto.Error); ok {
				complaint <- perr
			}
		}
	})
	type got struct {
		from  string
		frame []byte
	}
	frames := make(chan got, 4)
	c, _ := dialConn(t, ConnConfig{URL: url, Hello: connHello(), OnFrame: func(from string, f []byte) { frames <- got{from, f} }})
	for _, want := range []string{"", "w-peer"} {
		select {
		case g := <-frames:
			if g.from != want || !bytes.Equal(g.frame, frame) {
				t.Fatalf("frame from %q (%d bytes), want from %q", g.from, len(g.frame), want)
			}
		case <-time.After(connWait):
			t.Fatal("no frame")
		}
	}

	if err := c.SendRelay(context.Background(), "w-peer", frame); err != nil {
		t.Fatal(err)
	}
	select {
	case b := <-relayed:
		kind, to, f, err := proto.DecodeBinary(b)
		if err != nil || kind != proto.BinRelay || to != "w-peer" || !bytes.Equal(f, frame) {
			t.Fatalf("coordinator got %v %q (%v)", kind, to, err)
		}
	case <-time.After(connWait):
		t.Fatal("relayed frame not received")
	}

	// The garbage that follows fails the connection, and the coordinator is told why.
	err = waitDone(t, c)
	if !errors.Is(err, ErrConnLost) || !errors.Is(err, proto.ErrFrameVersion) {
		t.Fatalf("after garbage: %v", err)
	}
	select {
	case perr := <-complaint:
		if perr.Code != proto.ErrCodeProtocol || !strings.Contains(perr.Message, "envelope kind 9") {
			t.Fatalf("complaint %v", perr)
		}
	case <-time.After(connWait):
		t.Fatal("coordinator not told")
	}
}

func TestConnCoordinatorSilent(t *testing.T) {
	checkConnLeaks(t)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		fakeWelcome(ctx, t, ws, 20)
		for { // reads, never answers
			if _, _, err := ws.Read(ctx); err != nil {
				return
			}
		}
	})
	c, _ := dialConn(t, ConnConfig{URL: url, Hello: connHello()})
	start := time.Now()
	err := waitDone(t, c)
	if !errors.Is(err, ErrCoordinatorSilent) {
		t.Fatalf("got %v, want ErrCoordinatorSilent", err)
	}
	if d := time.Since(start); d < minSilence-100*time.Millisecond {
		t.Fatalf("failed after %v, before the least silence a connection outlasts (%v)", d, minSilence)
	}
}

func TestConnCoordinatorClosesSocket(t *testing.T) {
	checkConnLeaks(t)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		fakeWelcome(ctx, t, ws, 1000)
		ws.Close(websocket.StatusInternalError, "crashed")
	})
	c, _ := dialConn(t, ConnConfig{URL: url, Hello: connHello()})
	err := waitDone(t, c)
	if !errors.Is(err, ErrConnLost) || !strings.Contains(err.Error(), "crashed") {
		t.Fatalf("got %v, want ErrConnLost with the close reason", err)
	}
	if _, ok := <-c.Messages(); ok {
		t.Fatal("messages still open after the connection ended")
	}
	if err := c.Send(context.Background(), &proto.Ready{}); !errors.Is(err, ErrConnLost) {
		t.Fatalf("send after the end: %v", err)
	}
}

func TestConnSendRefusesWhatAWorkerDoesNotSend(t *testing.T) {
	checkConnLeaks(t)
	url := fakeCoordinator(t, func(ctx context.Context, ws *websocket.Conn, _ *proto.Hello) {
		fakeWelcome(ctx, t, ws, 1000)
		ws.Read(ctx)
	})
	c, _ := dialConn(t, ConnConfig{URL: url, Hello: connHello()})
	ctx := context.Background()
	hello := connHello()
	tests := []struct {
		name string
		err  error
		want error
	}{
		{"welcome", c.Send(ctx, &proto.Welcome{WorkerID: "w-x", HeartbeatMS: 1, Session: fakeSession(1)}), proto.ErrUnexpectedMessage},
		{"second hello", c.Send(ctx, &hello), proto.ErrUnexpectedMessage},
		{"invalid", c.Send(ctx, &proto.Bye{Reason: "\xff"}), proto.ErrBadMessage},
		{"relay to a bad id", c.SendRelay(ctx, "a b", make([]byte, proto.HeaderSize)), proto.ErrBadHeader},
		{"relay a short frame", c.SendRelay(ctx, "w-peer", []byte{1}), proto.ErrShortFrame},
	}
	for _, tt := range tests {
		if !errors.Is(tt.err, tt.want) {
			t.Errorf("%s: got %v, want %v", tt.name, tt.err, tt.want)
		}
	}
	if err := c.Err(); err != nil {
		t.Fatalf("refused sends broke the connection: %v", err)
	}
}

func TestBackoff(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))
	const base, maxDelay = 100 * time.Millisecond, 10 * time.Second
	tests := []struct {
		name    string
		attempt int
		ceil    time.Duration
	}{
		{"first", 0, base},
		{"negative attempt", -3, base},
		{"doubles", 1, 2 * base},
		{"doubles again", 3, 8 * base},
		{"capped", 7, maxDelay},
		{"far past the cap", 1000, maxDelay},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var sum, hi time.Duration
			const n = 2000
			for range n {
				d := Backoff(tt.attempt, base, maxDelay, r)
				if d < 0 || d > tt.ceil {
					t.Fatalf("Backoff(%d) = %v, outside [0, %v]", tt.attempt, d, tt.ceil)
				}
				sum += d
				hi = max(hi, d)
			}
			// Full jitter: uniform over [0, ceil], so the mean is ceil/2 and the top is reached.
			if mean := sum / n; mean < tt.ceil*4/10 || mean > tt.ceil*6/10 {
				t.Errorf("mean %v, want about %v", mean, tt.ceil/2)
			}
			if hi < tt.ceil*9/10 {
				t.Errorf("largest %v, want near %v", hi, tt.ceil)
			}
		})
	}
	if d := Backoff(50, time.Hour, time.Duration(1<<62), nil); d < 0 || d > 1<<62 {
		t.Errorf("huge cap: %v", d)
	}
	if d := Backoff(2, time.Minute, time.Second, r); d > time.Second {
		t.Errorf("base above the cap: %v", d)
	}
	if d := Backoff(2, 0, time.Second, r); d != 0 {
		t.Errorf("zero base: %v", d)
	}
}
