package coordinator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/internal/leaktest"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// The hub tests run real WebSockets between a Hub on an httptest server (127.0.0.1) and real
// workers: client.Conn, or raw coder/websocket connections where a test must misbehave.

const waitFor = 5 * time.Second

// checkHubLeaks fails the test if goroutines started during it outlive its cleanup. Call it first,
// so that its cleanup runs last.
func checkHubLeaks(t *testing.T) {
	t.Helper()
	leaktest.Check(t, waitFor)
}

// startHub serves a hub at /ws of a loopback test server and returns it with its ws:// URL.
func startHub(t *testing.T, cfg HubConfig) (*Hub, string) {
	t.Helper()
	h := NewHub(cfg)
	mux := http.NewServeMux()
	mux.Handle("/ws", h)
	srv := httptest.NewServer(mux) // listens on 127.0.0.1
	t.Cleanup(func() {
		h.Close()
		srv.Close()
	})
	return h, "ws" + strings.TrimPrefix(srv.URL, "http") + "/ws"
}

func testHello(name string) proto.Hello {
	return proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 12.5, MemoryBytes: 1 << 30, Threads: 2, Name: name}
}

// dialWorker joins a real client.Conn.
func dialWorker(t *testing.T, url string, hello proto.Hello, onFrame func(string, []byte)) (*client.Conn, *proto.Welcome) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	c, w, err := client.Dial(ctx, client.ConnConfig{URL: url, Hello: hello, OnFrame: onFrame})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c, w
}

// rawJoin joins with a bare WebSocket, for tests where the worker misbehaves.
func rawJoin(t *testing.T, url string, hello proto.Hello) (*websocket.Conn, string) {
	t.Helper()
	ws := rawDial(t, url)
	b, err := proto.EncodeMessage(&hello)
	if err != nil {
		t.Fatal(err)
	}
	rawWrite(t, ws, websocket.MessageText, b)
	m := rawRead(t, ws)
	w, ok := m.(*proto.Welcome)
	if !ok {
		t.Fatalf("got %#v, want a welcome", m)
	}
	return ws, w.WorkerID
}

func rawDial(t *testing.T, url string) *websocket.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ws, _, err := websocket.Dial(ctx, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.CloseNow() })
	return ws
}

func rawWrite(t *testing.T, ws *websocket.Conn, typ websocket.MessageType, b []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if err := ws.Write(ctx, typ, b); err != nil {
		t.Fatalf("write: %v", err)
	}
}

// rawRead reads the next control message, failing the test on a binary message or an error.
func rawRead(t *testing.T, ws *websocket.Conn) proto.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	typ, b, err := ws.Read(ctx)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	if typ != websocket.MessageText {
		t.Fatalf("got a binary message, want a control message")
	}
	m, err := proto.DecodeMessage(b, proto.RoleWorker)
	if err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return m
}

// rawExpectClosed reads until the connection closes, which it must within waitFor.
func rawExpectClosed(t *testing.T, ws *websocket.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	for {
		if _, _, err := ws.Read(ctx); err != nil {
			if ctx.Err() != nil {
				t.Fatal("connection still open")
			}
			return
		}
	}
}

func nextEvent(t *testing.T, h *Hub) Event {
	t.Helper()
	select {
	case e := <-h.Events():
		return e
	case <-time.After(waitFor):
		t.Fatal("no event")
	}
	panic("unreachable")
}

func expectEvent(t *testing.T, h *Hub, kind EventKind, worker string) Event {
	t.Helper()
	e := nextEvent(t, h)
	if e.Kind != kind || e.Worker != worker {
		t.Fatalf("got event %v %s (err %v, msg %#v), want %v %s", e.Kind, e.Worker, e.Err, e.Msg, kind, worker)
	}
	return e
}

func nextMessage(t *testing.T, c *client.Conn) proto.Message {
	t.Helper()
	select {
	case m, ok := <-c.Messages():
		if !ok {
			t.Fatalf("messages closed: %v", c.Err())
		}
		return m
	case <-time.After(waitFor):
		t.Fatal("no message")
	}
	panic("unreachable")
}

func expectDone(t *testing.T, c *client.Conn) error {
	t.Helper()
	select {
	case <-c.Done():
		return c.Err()
	case <-time.After(waitFor):
		t.Fatal("connection still up")
	}
	panic("unreachable")
}

// roundTrip checks that worker c is served: a Ready from it reaches the job loop.
func roundTrip(t *testing.T, h *Hub, c *client.Conn, plan uint32) {
	t.Helper()
	if err := c.Send(context.Background(), &proto.Ready{PlanVersion: plan}); err != nil {
		t.Fatal(err)
	}
	e := expectEvent(t, h, EventMessage, c.ID())
	if r, ok := e.Msg.(*proto.Ready); !ok || r.PlanVersion != plan {
		t.Fatalf("got %#v, want ready %d", e.Msg, plan)
	}
}

func TestHubJoinWelcome(t *testing.T) {
	checkHubLeaks(t)
	ice := []proto.ICEServer{{URLs: []string{"stun:127.0.0.1:3478"}}}
	h, url := startHub(t, HubConfig{HeartbeatInterval: 40 * time.Millisecond, ICEServers: ice, Loopback: true})

	a, w := dialWorker(t, url, testHello("alpha"), nil)
	if w.WorkerID == "" || w.WorkerID != a.ID() || w.HeartbeatMS != 40 || !w.Loopback || len(w.ICEServers) != 1 {
		t.Fatalf("welcome %+v", w)
	}
	e := expectEvent(t, h, EventJoined, w.WorkerID)
	if e.Hello == nil || e.Hello.Name != "alpha" {
		t.Fatalf("joined with hello %+v", e.Hello)
	}
	ws := h.Workers()
	if len(ws) != 1 || ws[0].ID != a.ID() || ws[0].Hello.Name != "alpha" || ws[0].BytesOut == 0 || ws[0].BytesIn == 0 {
		t.Fatalf("workers %+v", ws)
	}

	// Both ways: a worker's message is an event, the coordinator's reaches Messages.
	roundTrip(t, h, a, 7)
	if err := h.Send(a.ID(), &proto.Clip{Step: 3, PlanVersion: 7, Factor: 0.5}); err != nil {
		t.Fatal(err)
	}
	if m, ok := nextMessage(t, a).(*proto.Clip); !ok || m.Step != 3 || m.Factor != 0.5 {
		t.Fatalf("got %#v", m)
	}

	// Refused before queueing: a message only workers send, an invalid one, an unknown worker.
	if err := h.Send(a.ID(), &proto.Ready{}); !errors.Is(err, proto.ErrUnexpectedMessage) {
		t.Fatalf("sending a ready to a worker: %v", err)
	}
	if err := h.Send(a.ID(), &proto.Clip{Factor: 2}); !errors.Is(err, proto.ErrBadMessage) {
		t.Fatalf("sending an invalid clip: %v", err)
	}
	if err := h.Send("w-nobody", &proto.Clip{}); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("sending to an unknown worker: %v", err)
	}

	// The id takeover: asking for a connected worker's id without its credential gets a fresh id.
	again := testHello("beta")
	again.WorkerID = a.ID()
	b, wb := dialWorker(t, url, again, nil)
	if wb.WorkerID == a.ID() {
		t.Fatalf("second worker got the connected id %s", a.ID())
	}
	expectEvent(t, h, EventJoined, b.ID())
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if e := expectEvent(t, h, EventLeft, a.ID()); !errors.Is(e.Err, ErrWorkerLeft) {
		t.Fatalf("left with %v, want ErrWorkerLeft", e.Err)
	}
	if err := a.Err(); !errors.Is(err, client.ErrConnClosed) {
		t.Fatalf("closed worker: %v", err)
	}
	// Nor once it has gone silent or left (the id, and its credit, were free for anyone after
	// the heartbeat timeout): a forged credential gets a fresh id too.
	forged := again
	forged.Session = strings.Repeat("A", 43)
	c, wc := dialWorker(t, url, forged, nil)
	if wc.WorkerID == a.ID() {
		t.Fatalf("a forged credential took over %s", a.ID())
	}
	expectEvent(t, h, EventJoined, c.ID())
	if _, ok := h.SessionWorker(w.Session); ok {
		t.Fatal("the credential of a worker that left still authenticates")
	}

	// With its credential the worker gets its id back, and a new credential.
	own := again
	own.Session = w.Session
	d, wd := dialWorker(t, url, own, nil)
	if wd.WorkerID != a.ID() || wd.Session == w.Session {
		t.Fatalf("rejoin got %s (credential rotated: %v), want the old id %s and a new credential", wd.WorkerID, wd.Session != w.Session, a.ID())
	}
	expectEvent(t, h, EventJoined, d.ID())
	if id, ok := h.SessionWorker(wd.Session); !ok || id != d.ID() {
		t.Fatalf("SessionWorker(new credential) = %q, %v", id, ok)
	}
	// The old credential was used up: replaying it gets a fresh id, and does not disturb d.
	e2, we := dialWorker(t, url, own, nil)
	if we.WorkerID == d.ID() {
		t.Fatal("a replayed credential was accepted twice")
	}
	expectEvent(t, h, EventJoined, e2.ID())
	roundTrip(t, h, d, 8)

	// The holder of the current credential may reconnect while its old socket still looks alive
	// (a network change): the new connection supersedes the old one.
	own.Session = wd.Session
	f, wf := dialWorker(t, url, own, nil)
	if wf.WorkerID != d.ID() {
		t.Fatalf("reconnect got %s, want %s", wf.WorkerID, d.ID())
	}
	if ev := expectEvent(t, h, EventLeft, d.ID()); !errors.Is(ev.Err, ErrDropped) {
		t.Fatalf("superseded connection left with %v", ev.Err)
	}
	expectEvent(t, h, EventJoined, f.ID())
	roundTrip(t, h, f, 9)
}

func TestHubRefusesOtherVersions(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	body := `{"kind":"native","backend":"cpu","gflops":1,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}`
	tests := []struct {
		name  string
		first string
		want  string
	}{
		{"older worker", `{"v":0,"type":"hello","body":` + body + `}`,
			"worker speaks protocol 0, this coordinator speaks 18: upgrade the worker"},
		{"newer worker", `{"v":19,"type":"hello","body":` + body + `}`,
			"worker speaks protocol 19, this coordinator speaks 18: upgrade the coordinator"},
		{"not a hello", `{"v":18,"type":"ready","body":{"plan_version":1}}`, "the first message must be a hello, not ready"},
		{"not shoal", `{"hello":"world"}`, `no "v" field`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws := rawDial(t, url)
			rawWrite(t, ws, websocket.MessageText, []byte(tt.first))
			m, ok := rawRead(t, ws).(*proto.Error)
			if !ok || m.Code != proto.ErrCodeProtocol || !strings.Contains(m.Message, tt.want) {
				t.Fatalf("got %#v, want a protocol error saying %q", m, tt.want)
			}
			rawExpectClosed(t, ws)
		})
	}
	if ws := h.Workers(); len(ws) != 0 {
		t.Fatalf("refused connections joined: %+v", ws)
	}
	select {
	case e := <-h.Events():
		t.Fatalf("event for a refused connection: %+v", e)
	default:
	}
}

func TestHubSignalRelay(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	expectEvent(t, h, EventJoined, a.ID())
	b, _ := dialWorker(t, url, testHello("b"), nil)
	expectEvent(t, h, EventJoined, b.ID())
	ctx := context.Background()
	h.SetLinks(2, [][2]string{{a.ID(), b.ID()}})

	// A lies about From: B sees A's id.
	offer := &proto.Signal{From: "someone-else", To: b.ID(), PlanVersion: 2, SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0 fake"}}
	if err := a.Send(ctx, offer); err != nil {
		t.Fatal(err)
	}
	got, ok := nextMessage(t, b).(*proto.Signal)
	if !ok || got.From != a.ID() || got.To != b.ID() || got.SDP == nil || got.SDP.SDP != "v=0 fake" || got.PlanVersion != 2 {
		t.Fatalf("B got %#v, want the offer from %s", got, a.ID())
	}
	// And back, through the Signaler the WebRTC transport uses.
	mid := "0"
	if err := b.SendSignal(ctx, a.ID(), proto.Signal{PlanVersion: 2, Candidate: &proto.ICECandidate{Candidate: "candidate:1 1 udp 1 127.0.0.1 5000 typ host", SDPMid: &mid}}); err != nil {
		t.Fatal(err)
	}
	if got, ok := nextMessage(t, a).(*proto.Signal); !ok || got.From != b.ID() || got.Candidate == nil {
		t.Fatalf("A got %#v", got)
	}

	// To an unknown worker: refused back to the sender, which stays connected.
	h.SetLinks(2, [][2]string{{a.ID(), b.ID()}, {a.ID(), "w-gone"}})
	if err := a.Send(ctx, &proto.Signal{From: a.ID(), To: "w-gone", PlanVersion: 2, SDP: &proto.SessionDescription{Type: "offer", SDP: "x"}}); err != nil {
		t.Fatal(err)
	}
	perr, ok := nextMessage(t, a).(*proto.Error)
	if !ok || perr.Code != proto.ErrCodeProtocol || !strings.Contains(perr.Message, "w-gone") {
		t.Fatalf("got %#v, want a refusal naming w-gone", perr)
	}
	// Signals never reach the job loop: the next event is this Ready.
	roundTrip(t, h, a, 1)
}

// testTensor is an F32 activation of n elements with distinct values.
func testTensor(t *testing.T, n int) proto.Tensor {
	t.Helper()
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%1000) - 0.5
	}
	shape, err := proto.ShapeOf(n)
	if err != nil {
		t.Fatal(err)
	}
	return proto.Tensor{
		Key:   proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 4, MicroBatch: 1, Block: 2, Expert: proto.NoExpert},
		DType: proto.F32, Shape: shape, Data: proto.AppendFloat32s(nil, x),
	}
}

// frameSink collects frames from a client's frame handler.
type frameSink struct {
	mu     sync.Mutex
	from   []string
	frames [][]byte
	got    chan struct{}
}

func newFrameSink() *frameSink { return &frameSink{got: make(chan struct{}, 1024)} }

func (s *frameSink) handle(from string, frame []byte) {
	s.mu.Lock()
	s.from = append(s.from, from)
	s.frames = append(s.frames, frame)
	s.mu.Unlock()
	s.got <- struct{}{}
}

func (s *frameSink) wait(t *testing.T, n int) ([]string, [][]byte) {
	t.Helper()
	for range n {
		select {
		case <-s.got:
		case <-time.After(waitFor):
			t.Fatalf("frames: want %d", n)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.from, s.frames
}

func TestHubRelayFrames(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	expectEvent(t, h, EventJoined, a.ID())
	sink := newFrameSink()
	b, _ := dialWorker(t, url, testHello("b"), sink.handle)
	expectEvent(t, h, EventJoined, b.ID())
	h.SetLinks(1, [][2]string{{a.ID(), b.ID()}})

	frames, err := proto.SplitTensor(testTensor(t, proto.MaxChunkPayload/4+3), proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, f := range frames {
		if err := a.SendRelay(ctx, b.ID(), f); err != nil {
			t.Fatal(err)
		}
	}
	from, got := sink.wait(t, len(frames))
	for i := range frames {
		if from[i] != a.ID() || !bytes.Equal(got[i], frames[i]) {
			t.Fatalf("frame %d from %q, %d bytes; want from %s, %d bytes", i, from[i], len(got[i]), a.ID(), len(frames[i]))
		}
	}
	var relayed int64
	for _, f := range frames {
		relayed += int64(len(f))
	}
	for _, w := range h.Workers() {
		want := [2]int64{relayed, 0}
		if w.ID == b.ID() {
			want = [2]int64{0, relayed}
		}
		if w.RelaySent != want[0] || w.RelayReceived != want[1] {
			t.Fatalf("%s relayed sent/received %d/%d, want %v", w.ID, w.RelaySent, w.RelayReceived, want)
		}
	}

	// To an unknown worker: refused back, the frame dropped, the sender kept.
	if err := a.SendRelay(ctx, "w-gone", frames[0]); err != nil {
		t.Fatal(err)
	}
	perr, ok := nextMessage(t, a).(*proto.Error)
	if !ok || !strings.Contains(perr.Message, "w-gone") {
		t.Fatalf("got %#v, want a refusal naming w-gone", perr)
	}
	roundTrip(t, h, a, 1)
}

func TestHubSendTensor(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	r := proto.NewReassembler(proto.Limits{})
	type result struct {
		from string
		t    proto.Tensor
		err  error
	}
	results := make(chan result, 8)
	// The handler runs on the client's reader goroutine, which alone owns the Reassembler.
	onFrame := func(from string, frame []byte) {
		tn, done, err := r.Add(frame)
		if err != nil || done {
			results <- result{from, tn, err}
		}
	}
	a, _ := dialWorker(t, url, testHello("a"), onFrame)
	expectEvent(t, h, EventJoined, a.ID())

	want := testTensor(t, 2*proto.MaxChunkPayload/4+100) // three chunks
	if n := want.NumChunks(); n != 3 {
		t.Fatalf("%d chunks", n)
	}
	if err := h.SendTensor(a.ID(), want); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-results:
		if res.err != nil {
			t.Fatal(res.err)
		}
		if res.from != "" || res.t.Key != want.Key || res.t.Shape != want.Shape || !bytes.Equal(res.t.Data, want.Data) {
			t.Fatalf("reassembled %v %v from %q, want %v %v from the coordinator", res.t.Key, res.t.Shape, res.from, want.Key, want.Shape)
		}
	case <-time.After(waitFor):
		t.Fatal("tensor not reassembled")
	}

	bad := want
	bad.Data = bad.Data[:8]
	if err := h.SendTensor(a.ID(), bad); !errors.Is(err, proto.ErrPayloadLength) {
		t.Fatalf("sending a tensor shorter than its shape: %v", err)
	}
	if err := h.SendTensor("w-nobody", want); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("sending to an unknown worker: %v", err)
	}
}

func TestHubDropsMisbehavingWorkers(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{MaxMessageBytes: 4096})
	bystander, _ := dialWorker(t, url, testHello("bystander"), nil)
	expectEvent(t, h, EventJoined, bystander.ID())

	frame, err := proto.SplitTensor(testTensor(t, 8), proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	welcome, _ := proto.EncodeMessage(&proto.Welcome{WorkerID: "w-x", HeartbeatMS: 1, Session: strings.Repeat("s", 43)})
	hello, _ := proto.EncodeMessage(&proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1, MemoryBytes: 1, Threads: 1})
	direct, _ := proto.AppendDirect(nil, frame[0])
	garbageFrame, _ := proto.AppendRelay(nil, bystander.ID(), make([]byte, proto.HeaderSize+4))
	text, binary := websocket.MessageText, websocket.MessageBinary
	tests := []struct {
		name string
		typ  websocket.MessageType
		msg  []byte
		want error
		says string
	}{
		{"malformed json", text, []byte(`{"v":18,"type":"ready","body":{`), proto.ErrBadMessage, "malformed control message"},
		{"unknown field", text, []byte(`{"v":18,"type":"ready","body":{"plan_version":1,"x":2}}`), proto.ErrBadMessage, `unknown field "x"`},
		{"oversized", text, bytes.Repeat([]byte("x"), 5000), proto.ErrMessageTooLarge, "more than 4096 bytes"},
		{"other version", text, []byte(`{"v":19,"type":"ready","body":{}}`), proto.ErrProtocolVersion, "upgrade the coordinator"},
		{"unknown type", text, []byte(`{"v":18,"type":"gossip","body":{}}`), proto.ErrUnknownType, `"gossip"`},
		{"coordinator-only type", text, welcome, proto.ErrUnexpectedMessage, "a worker does not send welcome"},
		{"second hello", text, hello, proto.ErrUnexpectedMessage, "second hello"},
		{"garbage binary", binary, []byte{0xff, 1, 2, 3}, proto.ErrFrameVersion, "envelope kind 255"},
		{"empty binary", binary, nil, proto.ErrShortFrame, "empty"},
		{"direct frame from a worker", binary, direct, proto.ErrUnexpectedMessage, "only relay frames"},
		{"relayed garbage frame", binary, garbageFrame, proto.ErrFrameVersion, "relay to " + bystander.ID()},
		{"oversized binary", binary, make([]byte, proto.MaxBinarySize+1), proto.ErrFrameTooLarge, "binary message of more than"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws, id := rawJoin(t, url, testHello(tt.name))
			expectEvent(t, h, EventJoined, id)
			rawWrite(t, ws, tt.typ, tt.msg)

			m, ok := rawRead(t, ws).(*proto.Error)
			if !ok || m.Code != proto.ErrCodeProtocol || !strings.Contains(m.Message, tt.says) {
				t.Fatalf("worker got %#v, want a protocol error saying %q", m, tt.says)
			}
			rawExpectClosed(t, ws)
			e := expectEvent(t, h, EventLeft, id)
			if !errors.Is(e.Err, ErrProtocol) || !errors.Is(e.Err, tt.want) || !strings.Contains(e.Err.Error(), tt.says) {
				t.Fatalf("left with %v, want ErrProtocol and %v saying %q", e.Err, tt.want, tt.says)
			}
			// The hub keeps serving the others.
			roundTrip(t, h, bystander, uint32(i))
		})
	}
	if ws := h.Workers(); len(ws) != 1 || ws[0].ID != bystander.ID() {
		t.Fatalf("workers %+v, want the bystander alone", ws)
	}
}

// fakeClock is HubConfig.Now under the test's control.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// fakeClockHub is a hub whose clock is a fakeClock (heartbeats every 10 ms, a minute's timeout),
// checked for leaks when the test ends.
func fakeClockHub(t *testing.T) (*Hub, string, *fakeClock) {
	t.Helper()
	checkHubLeaks(t)
	clock := &fakeClock{now: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	h, url := startHub(t, HubConfig{HeartbeatInterval: 10 * time.Millisecond, HeartbeatTimeout: time.Minute, Now: clock.Now})
	return h, url, clock
}

func TestHubHeartbeatTimeoutFakeClock(t *testing.T) {
	h, url, clock := fakeClockHub(t)
	ws, id := rawJoin(t, url, testHello("silent"))
	expectEvent(t, h, EventJoined, id)

	// Well within the timeout by the injected clock, however long the test really takes.
	clock.Advance(59 * time.Second)
	select {
	case e := <-h.Events():
		t.Fatalf("event before the timeout: %+v", e)
	case <-time.After(100 * time.Millisecond):
	}
	// A heartbeat is answered, and resets the clock.
	hb, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: 41})
	rawWrite(t, ws, websocket.MessageText, hb)
	if m, ok := rawRead(t, ws).(*proto.Heartbeat); !ok || m.Seq != 41 || !m.Ack {
		t.Fatalf("got %#v, want the ack of heartbeat 41", m)
	}
	if got := h.Workers()[0].LastHeard; !got.Equal(clock.Now()) {
		t.Fatalf("last heard %v, want %v", got, clock.Now())
	}
	clock.Advance(61 * time.Second)
	e := expectEvent(t, h, EventLeft, id)
	if !errors.Is(e.Err, ErrHeartbeatTimeout) {
		t.Fatalf("left with %v, want ErrHeartbeatTimeout", e.Err)
	}
	if m, ok := rawRead(t, ws).(*proto.Error); !ok || !strings.Contains(m.Message, "heartbeat timeout") {
		t.Fatalf("got %#v, want an error about the heartbeat timeout", m)
	}
	rawExpectClosed(t, ws)
}

func TestHubHeartbeatTimeoutRealClock(t *testing.T) {
	checkHubLeaks(t)
	// A timeout of 40 intervals: a loaded machine (load average ~19) has held a worker's heartbeat
	// goroutine off the CPU for over 200 ms, and an honest worker must not be dropped for that.
	const interval, timeout = 50 * time.Millisecond, 2 * time.Second
	h, url := startHub(t, HubConfig{HeartbeatInterval: interval, HeartbeatTimeout: timeout})
	live, w := dialWorker(t, url, testHello("live"), nil)
	if w.HeartbeatMS != interval.Milliseconds() {
		t.Fatalf("heartbeat %d ms", w.HeartbeatMS)
	}
	expectEvent(t, h, EventJoined, live.ID())
	_, id := rawJoin(t, url, testHello("silent"))
	expectEvent(t, h, EventJoined, id)
	start := time.Now()
	e := expectEvent(t, h, EventLeft, id) // within waitFor, 2.5 timeouts
	if !errors.Is(e.Err, ErrHeartbeatTimeout) {
		t.Fatalf("left with %v", e.Err)
	}
	if d := time.Since(start); d < timeout-interval {
		t.Fatalf("dropped after %v, before the timeout", d)
	}
	// The client's heartbeats kept it joined past the timeout that dropped the silent one, and
	// keep it joined for a timeout more.
	time.Sleep(timeout)
	if live.Err() != nil {
		t.Fatalf("live worker: %v", live.Err())
	}
	roundTrip(t, h, live, 1)
}

func TestHubDropAndCloseReachClients(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	expectEvent(t, h, EventJoined, a.ID())
	b, _ := dialWorker(t, url, testHello("b"), nil)
	expectEvent(t, h, EventJoined, b.ID())
	c, _ := dialWorker(t, url, testHello("c"), nil)
	expectEvent(t, h, EventJoined, c.ID())

	// With a *proto.Error: the worker gets that error.
	h.Drop(a.ID(), &proto.Error{Code: proto.ErrCodeStep, Message: "step 3 deadline passed"})
	err := expectDone(t, a)
	var perr *proto.Error
	if !errors.Is(err, client.ErrDroppedByCoordinator) || !errors.As(err, &perr) || perr.Code != proto.ErrCodeStep {
		t.Fatalf("dropped worker: %v", err)
	}
	e := expectEvent(t, h, EventLeft, a.ID())
	if !errors.Is(e.Err, ErrDropped) || !strings.Contains(e.Err.Error(), "deadline") {
		t.Fatalf("left with %v", e.Err)
	}

	// With a plain error: its text, as a protocol error.
	h.Drop(b.ID(), fmt.Errorf("unexpected report for step %d", 9))
	err = expectDone(t, b)
	if !errors.As(err, &perr) || perr.Code != proto.ErrCodeProtocol || !strings.Contains(perr.Message, "unexpected report for step 9") {
		t.Fatalf("dropped worker: %v", err)
	}
	expectEvent(t, h, EventLeft, b.ID())
	h.Drop(b.ID(), nil) // gone already: nothing happens

	h.Close()
	err = expectDone(t, c)
	if !errors.Is(err, client.ErrCoordinatorLeft) || !strings.Contains(err.Error(), "shutting down") {
		t.Fatalf("worker of a closed hub: %v", err)
	}
	if err := h.Send(c.ID(), &proto.Clip{}); !errors.Is(err, ErrHubClosed) {
		t.Fatalf("send after close: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, _, err := client.Dial(ctx, client.ConnConfig{URL: url, Hello: testHello("late")}); err == nil || !strings.Contains(err.Error(), "503") {
		t.Fatalf("dial after close: %v", err)
	}
	h.Close() // twice is fine
}

func TestHubEventsDoNotBlockReaders(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	// Nobody reads Events while the worker sends; its heartbeats must still be answered, and
	// everything must arrive in order afterwards.
	const n = 200
	for i := range n {
		if err := a.Send(context.Background(), &proto.Ready{PlanVersion: uint32(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Send(a.ID(), &proto.Clip{Factor: 1}); err != nil {
		t.Fatal(err)
	}
	nextMessage(t, a) // the hub's writer was not held up by the pending events
	expectEvent(t, h, EventJoined, a.ID())
	for i := range n {
		e := expectEvent(t, h, EventMessage, a.ID())
		if r := e.Msg.(*proto.Ready); r.PlanVersion != uint32(i) {
			t.Fatalf("message %d is ready %d", i, r.PlanVersion)
		}
	}
}

func TestHubDropsSlowWorkers(t *testing.T) {
	checkHubLeaks(t)
	// A worker that stops reading fills the loopback socket's buffers, then its send queue.
	h, url := startHub(t, HubConfig{SendQueue: 2, HeartbeatInterval: 50 * time.Millisecond, HeartbeatTimeout: time.Second})
	sender, _ := dialWorker(t, url, testHello("sender"), nil)
	expectEvent(t, h, EventJoined, sender.ID())

	// heartbeats keeps a raw worker that does not read from being timed out instead.
	heartbeats := func(ws *websocket.Conn) (stop func()) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			hb, _ := proto.EncodeMessage(&proto.Heartbeat{})
			for ctx.Err() == nil {
				if ws.Write(ctx, websocket.MessageText, hb) != nil {
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		}()
		return func() { cancel(); <-done }
	}
	big := testTensor(t, 1<<18) // 1 MiB, 17 frames

	t.Run("direct", func(t *testing.T) {
		ws, id := rawJoin(t, url, testHello("stuck"))
		stop := heartbeats(ws)
		defer stop()
		expectEvent(t, h, EventJoined, id)
		var err error
		for i := 0; i < 500 && err == nil; i++ {
			err = h.SendTensor(id, big)
		}
		// The full queue is noticed by SendTensor, or first by the answer to a heartbeat.
		if !errors.Is(err, ErrSlowWorker) && !errors.Is(err, ErrUnknownWorker) {
			t.Fatalf("sending to a worker that does not read: %v", err)
		}
		if e := expectEvent(t, h, EventLeft, id); !errors.Is(e.Err, ErrSlowWorker) {
			t.Fatalf("left with %v", e.Err)
		}
	})

	t.Run("relay", func(t *testing.T) {
		ws, id := rawJoin(t, url, testHello("stuck"))
		stop := heartbeats(ws)
		defer stop()
		expectEvent(t, h, EventJoined, id)
		frames, err := proto.SplitTensor(big, proto.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		h.SetLinks(1, [][2]string{{sender.ID(), id}})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		sent := make(chan struct{})
		go func() { // relays until the receiver is dropped; its queue then refuses the rest
			defer close(sent)
			for i := 0; ctx.Err() == nil; i++ {
				if sender.SendRelay(ctx, id, frames[i%len(frames)]) != nil {
					return
				}
			}
		}()
		e := nextEvent(t, h)
		cancel()
		<-sent
		if e.Kind != EventLeft || e.Worker != id || !errors.Is(e.Err, ErrSlowWorker) {
			t.Fatalf("got %v %s %v, want %s left as too slow", e.Kind, e.Worker, e.Err, id)
		}
		// The sender, held up meanwhile, is still served (its messages hold the refusals of the
		// frames that arrived once the receiver was gone; they make no events).
		roundTrip(t, h, sender, 1)
	})
}

// A worker that heartbeats but stops reading leaves its writer stuck in a write once the
// socket's buffers are full, with room still in its queue: the write is bounded by the heartbeat
// timeout (hubConn.writeTimer), and the worker is dropped.
func TestHubWriteTimeout(t *testing.T) {
	checkHubLeaks(t)
	const timeout = 400 * time.Millisecond
	h, url := startHub(t, HubConfig{SendQueue: 1024, HeartbeatInterval: 50 * time.Millisecond, HeartbeatTimeout: timeout})
	ws, id := rawJoin(t, url, testHello("stuck"))
	expectEvent(t, h, EventJoined, id)
	ctx, cancel := context.WithCancel(context.Background())
	beating := make(chan struct{})
	go func() {
		defer close(beating)
		hb, _ := proto.EncodeMessage(&proto.Heartbeat{})
		for ctx.Err() == nil && ws.Write(ctx, websocket.MessageText, hb) == nil {
			time.Sleep(20 * time.Millisecond)
		}
	}()
	defer func() { cancel(); <-beating }()
	// 48 MiB: more than loopback's buffers hold, less than the queue. The write may time out
	// while they are queued (slowly, under the race detector).
	big := testTensor(t, 1<<18)
	for range 48 {
		if err := h.SendTensor(id, big); errors.Is(err, ErrUnknownWorker) {
			break
		} else if err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	e := expectEvent(t, h, EventLeft, id)
	if !errors.Is(e.Err, ErrDisconnected) || !errors.Is(e.Err, context.DeadlineExceeded) {
		t.Fatalf("left with %v, want a write timeout", e.Err)
	}
}

// The forged-activation attack: a worker that is not the receiver's neighbour under the active
// plan (a standby, a refused or a former participant) relays a well-formed activation for a
// future step, and signals an offer. Neither reaches the receiver; the sender is told, and stays
// connected (its frames may just be late ones of an abandoned plan).
func TestHubOnlyPlanLinksCarryTraffic(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	sink := newFrameSink()
	stage, _ := dialWorker(t, url, testHello("stage"), sink.handle)
	expectEvent(t, h, EventJoined, stage.ID())
	prev, _ := dialWorker(t, url, testHello("prev"), nil)
	expectEvent(t, h, EventJoined, prev.ID())
	standby, _ := dialWorker(t, url, testHello("standby"), nil)
	expectEvent(t, h, EventJoined, standby.ID())
	h.SetLinks(1, [][2]string{{prev.ID(), stage.ID()}})
	ctx := context.Background()

	forged := testTensor(t, 64)
	forged.Key.Step = 1000 // a future step: the mailbox would have held it
	frames, err := proto.SplitTensor(forged, proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if err := standby.SendRelay(ctx, stage.ID(), frames[0]); err != nil {
		t.Fatal(err)
	}
	if perr, ok := nextMessage(t, standby).(*proto.Error); !ok || !strings.Contains(perr.Message, "not neighbours") {
		t.Fatalf("standby got %#v, want a refusal", perr)
	}
	offer := &proto.Signal{From: standby.ID(), To: stage.ID(), PlanVersion: 1, SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0 forged"}}
	if err := standby.Send(ctx, offer); err != nil {
		t.Fatal(err)
	}
	// A neighbour's frame of an older plan is refused too.
	old := testTensor(t, 64)
	old.Key.PlanVersion = 0
	oldFrames, _ := proto.SplitTensor(old, proto.Limits{})
	if err := prev.SendRelay(ctx, stage.ID(), oldFrames[0]); err != nil {
		t.Fatal(err)
	}
	// The neighbour's frame of this plan arrives, and is the only thing that does.
	if err := prev.SendRelay(ctx, stage.ID(), frames[0]); err != nil {
		t.Fatal(err)
	}
	from, got := sink.wait(t, 1)
	if len(got) != 1 || from[0] != prev.ID() {
		t.Fatalf("stage got frames from %v, want one from %s", from, prev.ID())
	}
	select {
	case m := <-stage.Messages():
		t.Fatalf("stage got %#v from outside the plan", m)
	case <-time.After(100 * time.Millisecond):
	}
	roundTrip(t, h, standby, 1) // still connected, and nothing it sent made an event
	if ws := h.Workers(); len(ws) != 3 {
		t.Fatalf("workers %d, want all 3 still connected", len(ws))
	}
}

// Joins past the caps are refused at the hello with Error{busy}: no registration, no event (500
// joins used to store 500 worker rows and events and force a replan per wave).
func TestHubCapsWorkers(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{MaxWorkers: 3, MaxWorkersPerAddr: 2})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	expectEvent(t, h, EventJoined, a.ID())
	b, _ := dialWorker(t, url, testHello("b"), nil)
	expectEvent(t, h, EventJoined, b.ID())
	ws := rawDial(t, url)
	hello, _ := proto.EncodeMessage(ptr(testHello("c")))
	rawWrite(t, ws, websocket.MessageText, hello)
	if m, ok := rawRead(t, ws).(*proto.Error); !ok || m.Code != proto.ErrCodeBusy || !strings.Contains(m.Message, "from one address") {
		t.Fatalf("third worker from one address got %#v, want busy", m)
	}
	rawExpectClosed(t, ws)
	select {
	case e := <-h.Events():
		t.Fatalf("event for a refused join: %+v", e)
	case <-time.After(50 * time.Millisecond):
	}
	// A slot frees when a worker leaves.
	a.Close()
	expectEvent(t, h, EventLeft, a.ID())
	c, _ := dialWorker(t, url, testHello("c"), nil)
	expectEvent(t, h, EventJoined, c.ID())
}

// A worker may not flood others with signals: past its rate they are dropped (and it is told).
func TestHubSignalRate(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{SignalRate: 1, SignalBurst: 5})
	a, _ := dialWorker(t, url, testHello("a"), nil)
	expectEvent(t, h, EventJoined, a.ID())
	b, _ := dialWorker(t, url, testHello("b"), nil)
	expectEvent(t, h, EventJoined, b.ID())
	h.SetLinks(1, [][2]string{{a.ID(), b.ID()}})
	ctx := context.Background()
	mid := "0"
	for i := range 20 {
		c := proto.ICECandidate{Candidate: fmt.Sprintf("candidate:%d 1 udp 1 127.0.0.1 5000 typ host", i), SDPMid: &mid}
		if err := a.SendSignal(ctx, b.ID(), proto.Signal{PlanVersion: 1, Candidate: &c}); err != nil {
			t.Fatal(err)
		}
	}
	roundTrip(t, h, a, 1) // every signal was handled before this Ready
	n := 0
	for {
		select {
		case m := <-b.Messages():
			if _, ok := m.(*proto.Signal); ok {
				n++
			}
			continue
		case <-time.After(100 * time.Millisecond):
		}
		break
	}
	if n < 5 || n > 6 {
		t.Fatalf("b got %d signals of 20, want the burst of 5 (and maybe one refilled)", n)
	}
}

func ptr[T any](v T) *T { return &v }

// Session credentials outlive the coordinator: after a restart (a new hub over the same SQLite
// file) a worker gets its id back with its credential, nobody gets it without, and an id that was
// never given out may still be asked for.
func TestHubSessionsSurviveRestart(t *testing.T) {
	checkHubLeaks(t)
	db, err := storage.Open(context.Background(), filepath.Join(t.TempDir(), "shoal.db"), storage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	h1, url1 := startHub(t, HubConfig{Sessions: db})
	named := testHello("a")
	named.WorkerID = "w-chosen"
	a, wa := dialWorker(t, url1, named, nil)
	if wa.WorkerID != "w-chosen" {
		t.Fatalf("an id nobody had was not granted: got %s", wa.WorkerID)
	}
	expectEvent(t, h1, EventJoined, a.ID())
	a.Close()
	expectEvent(t, h1, EventLeft, a.ID())

	h2, url2 := startHub(t, HubConfig{Sessions: db})
	for _, tok := range []string{"", strings.Repeat("B", 43)} {
		thief := named
		thief.Session = tok
		c, wc := dialWorker(t, url2, thief, nil)
		if wc.WorkerID == "w-chosen" {
			t.Fatalf("after a restart, %q took over w-chosen", tok)
		}
		expectEvent(t, h2, EventJoined, c.ID())
	}
	back := named
	back.Session = wa.Session
	d, wd := dialWorker(t, url2, back, nil)
	if wd.WorkerID != "w-chosen" {
		t.Fatalf("after a restart the worker got %s, want its id back", wd.WorkerID)
	}
	expectEvent(t, h2, EventJoined, d.ID())
}

// TestHubTabGoingAway: a browser closes its WebSockets with 1001 (going away) when its page goes
// away, which ends the tab's dedicated worker before its Bye may be sent — or, when the browser
// ends the worker first, the socket just ends, without a close frame: for a browser worker either
// is the tab's departure; for a native worker it is still a lost connection.
func TestHubTabGoingAway(t *testing.T) {
	checkHubLeaks(t)
	h, url := startHub(t, HubConfig{})
	for _, c := range []struct {
		kind  proto.WorkerKind
		frame bool // a 1001 close frame, or none
	}{{proto.WorkerBrowser, true}, {proto.WorkerNative, true}, {proto.WorkerBrowser, false}, {proto.WorkerNative, false}} {
		kind := c.kind
		hello := testHello(string(kind))
		hello.Kind = kind
		ws, id := rawJoin(t, url, hello)
		if !c.frame {
			ws.CloseNow()
		} else if err := ws.Close(websocket.StatusGoingAway, ""); err != nil {
			t.Logf("close: %v", err) // the hub may close first; the event says what it heard
		}
		deadline := time.After(waitFor)
	wait:
		for {
			select {
			case ev := <-h.Events():
				if ev.Kind != EventLeft || ev.Worker != id {
					continue
				}
				left := errors.Is(ev.Err, ErrWorkerLeft) && strings.Contains(ev.Err.Error(), "tab closed")
				if want := kind == proto.WorkerBrowser; left != want || !want && !errors.Is(ev.Err, ErrDisconnected) {
					t.Errorf("a %s worker's close (a 1001 frame: %v): %v; want a departure %v", kind, c.frame, ev.Err, want)
				}
				break wait
			case <-deadline:
				t.Fatalf("no EventLeft for the %s worker", kind)
			}
		}
	}
}

// TestHubTURNCredentials: each Welcome carries the configured ICE servers and one credential
// made for that worker alone; Departed hears of a worker that leaves, but not of one whose id
// is taken over by its own new connection (a reconnect keeps its relays' owner).
func TestHubTURNCredentials(t *testing.T) {
	checkHubLeaks(t)
	var mu sync.Mutex
	var departed []string
	ice := []proto.ICEServer{{URLs: []string{"stun:127.0.0.1:3478"}}}
	h, url := startHub(t, HubConfig{ICEServers: ice, Loopback: true, ICERelayOnly: true,
		Credentials: func(id string) proto.ICEServer {
			return proto.ICEServer{URLs: []string{"turn:127.0.0.1:3478?transport=udp"}, Username: "1:" + id, Credential: "c-" + id}
		},
		Departed: func(id string) {
			mu.Lock()
			defer mu.Unlock()
			departed = append(departed, id)
		}})
	named := testHello("a")
	named.WorkerID = "w-a"
	a, wa := dialWorker(t, url, named, nil)
	_, wb := dialWorker(t, url, testHello("b"), nil)
	for _, w := range []*proto.Welcome{wa, wb} {
		if len(w.ICEServers) != 2 || w.ICEServers[0].URLs[0] != "stun:127.0.0.1:3478" || w.ICEServers[1].Username != "1:"+w.WorkerID || !w.ICERelayOnly {
			t.Fatalf("welcome of %s: %+v", w.WorkerID, w)
		}
	}
	expectEvent(t, h, EventJoined, "w-a")
	expectEvent(t, h, EventJoined, wb.WorkerID)
	if lo := netip.MustParseAddr("127.0.0.1"); !h.ConnectedFrom(lo) || h.ConnectedFrom(netip.MustParseAddr("198.51.100.20")) {
		t.Errorf("ConnectedFrom: 127.0.0.1 %v, 198.51.100.20 %v; want true, false", h.ConnectedFrom(lo), h.ConnectedFrom(netip.MustParseAddr("198.51.100.20")))
	}

	back := named
	back.Session = wa.Session
	a2, _ := dialWorker(t, url, back, nil)
	expectEvent(t, h, EventLeft, "w-a")
	expectEvent(t, h, EventJoined, "w-a")
	a.Close()
	a2.Close()
	expectEvent(t, h, EventLeft, "w-a")
	mu.Lock()
	defer mu.Unlock()
	if len(departed) != 1 || departed[0] != "w-a" {
		t.Errorf("departed %q, want w-a once (not for the superseded connection)", departed)
	}
}

// TestHubAddLinks: the pairs a stage takeover names (Hub.AddLinks) may relay only under the
// active plan, and only once they are added: not before, not under another plan's version, and
// not after the next plan's links replace them.
func TestHubAddLinks(t *testing.T) {
	h := NewHub(HubConfig{})
	h.SetLinks(3, [][2]string{{"a", "b"}})
	if _, ok := h.linked("b", "taker"); ok {
		t.Fatal("a pair no takeover named is linked")
	}
	h.AddLinks(2, [][2]string{{"b", "taker"}}) // an older plan's: ignored
	if _, ok := h.linked("b", "taker"); ok {
		t.Fatal("a pair added under another plan is linked")
	}
	h.AddLinks(3, [][2]string{{"b", "taker"}})
	for _, p := range [][2]string{{"b", "taker"}, {"taker", "b"}, {"a", "b"}} {
		if v, ok := h.linked(p[0], p[1]); !ok || v != 3 {
			t.Errorf("%s → %s: linked %v under plan %d, want plan 3", p[0], p[1], ok, v)
		}
	}
	if _, ok := h.linked("a", "taker"); ok {
		t.Error("a pair nobody named is linked")
	}
	h.SetLinks(4, [][2]string{{"a", "b"}})
	if _, ok := h.linked("b", "taker"); ok {
		t.Error("a takeover's pair outlived its plan")
	}
}

// TestHubQUICLinks: what the planner's link bound believes of a worker (Hub.QUICLinks) follows
// what its SDPs said, not its kind alone: a native worker on loopback is believed to offer QUIC
// until an SDP of its says otherwise; beyond loopback only once an SDP offers it; a browser never.
// A signal the hub refuses (to a worker that is no neighbour) changes nothing.
func TestHubQUICLinks(t *testing.T) {
	checkHubLeaks(t)
	fp := strings.Repeat("ab", 32)
	sdp := func(t *testing.T, c *client.Conn, to, quic string) {
		t.Helper()
		if err := c.Send(context.Background(), &proto.Signal{From: c.ID(), To: to, PlanVersion: 2, SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0 fake"}, QUIC: quic}); err != nil {
			t.Fatal(err)
		}
	}
	for _, loopback := range []bool{true, false} {
		t.Run(fmt.Sprintf("loopback=%v", loopback), func(t *testing.T) {
			h, url := startHub(t, HubConfig{Loopback: loopback})
			a, _ := dialWorker(t, url, testHello("a"), nil)
			expectEvent(t, h, EventJoined, a.ID())
			b, _ := dialWorker(t, url, testHello("b"), nil)
			expectEvent(t, h, EventJoined, b.ID())
			tab := testHello("tab")
			tab.Kind, tab.Backend = proto.WorkerBrowser, proto.BackendWebGPU
			c, _ := dialWorker(t, url, tab, nil)
			expectEvent(t, h, EventJoined, c.ID())
			h.SetLinks(2, [][2]string{{a.ID(), b.ID()}, {b.ID(), c.ID()}})

			if got := h.QUICLinks(a.ID()); got != loopback {
				t.Fatalf("a native worker before any SDP: QUICLinks %v, want %v (loopback)", got, loopback)
			}
			// A lie to a worker that is no neighbour is refused, and believed in nothing.
			sdp(t, a, c.ID(), "")
			if m, ok := nextMessage(t, a).(*proto.Error); !ok || !strings.Contains(m.Message, c.ID()) {
				t.Fatalf("got %#v, want the refusal of a signal to a non-neighbour", m)
			}
			if got := h.QUICLinks(a.ID()); got != loopback {
				t.Fatalf("after a refused signal: QUICLinks %v, want %v", got, loopback)
			}
			sdp(t, a, b.ID(), fp)
			nextMessage(t, b)
			if !h.QUICLinks(a.ID()) {
				t.Fatal("a worker whose SDP offered QUIC is not believed to")
			}
			sdp(t, b, a.ID(), "")
			nextMessage(t, a)
			if h.QUICLinks(b.ID()) {
				t.Fatal("a worker whose SDP offered no QUIC (SHOAL_QUIC=0) is believed to")
			}
			sdp(t, a, b.ID(), "")
			nextMessage(t, b)
			if h.QUICLinks(a.ID()) {
				t.Fatal("the last SDP counts: a worker that stopped offering QUIC is still believed to")
			}
			// A browser's fingerprint (it has no QUIC) is believed in nothing either.
			sdp(t, c, b.ID(), fp)
			nextMessage(t, b)
			if h.QUICLinks(c.ID()) || h.QUICLinks("w-nobody") {
				t.Fatal("a browser, or an unknown worker, is believed to move frames over QUIC")
			}
		})
	}
}

// TestHubHasten: a worker the job waits on (Hasten) is dropped once silent past the quick
// timeout; one not hastened, as silent, is not, nor is anyone once the job stops waiting.
func TestHubHasten(t *testing.T) {
	h, url, clock := fakeClockHub(t)
	if h.cfg.QuickTimeout != minQuickTimeout {
		t.Fatalf("quick timeout %v, want %v", h.cfg.QuickTimeout, minQuickTimeout)
	}
	wsA, a := rawJoin(t, url, testHello("waited-on"))
	expectEvent(t, h, EventJoined, a)
	_, b := rawJoin(t, url, testHello("not-waited-on"))
	expectEvent(t, h, EventJoined, b)
	h.Hasten([]string{a})

	clock.Advance(minQuickTimeout + time.Second)
	e := expectEvent(t, h, EventLeft, a)
	if !errors.Is(e.Err, ErrHeartbeatTimeout) || !strings.Contains(e.Err.Error(), "timeout 2s") {
		t.Fatalf("left with %v, want the quick heartbeat timeout", e.Err)
	}
	rawExpectClosed(t, wsA)

	// b is as silent, and stays: only the heartbeat timeout drops it.
	h.Hasten([]string{a, b})
	h.Hasten(nil)
	clock.Advance(minQuickTimeout + time.Second)
	select {
	case e := <-h.Events():
		t.Fatalf("event for a worker no longer hastened: %+v", e)
	case <-time.After(200 * time.Millisecond):
	}
	if ws := h.Workers(); len(ws) != 1 || ws[0].ID != b {
		t.Fatalf("workers %+v, want %s alone", ws, b)
	}
}

// TestHubQuickTimeoutDefaults: the quick timeout is two intervals, at least 2s, at most the
// heartbeat timeout.
func TestHubQuickTimeoutDefaults(t *testing.T) {
	for _, c := range []struct {
		in   HubConfig
		want time.Duration
	}{
		{HubConfig{}, 2 * time.Second},
		{HubConfig{HeartbeatInterval: 3 * time.Second}, 6 * time.Second},
		{HubConfig{HeartbeatInterval: 100 * time.Millisecond}, 500 * time.Millisecond},
		{HubConfig{HeartbeatInterval: 100 * time.Millisecond, HeartbeatTimeout: 10 * time.Second}, 2 * time.Second},
		{HubConfig{QuickTimeout: time.Hour}, 5 * time.Second},
		{HubConfig{QuickTimeout: time.Second}, time.Second},
	} {
		if got := c.in.withDefaults().QuickTimeout; got != c.want {
			t.Errorf("%+v: quick timeout %v, want %v", c.in, got, c.want)
		}
	}
}

// TestHubHastenMeasuredGap: a worker that has kept silences of 1.5 s (a tab computing on its CPU,
// which cannot beat until its kernel returns) is hastened to twice that, 3 s, not to 2 s: the
// quick timeout follows the silences measured lately.
func TestHubHastenMeasuredGap(t *testing.T) {
	h, url, clock := fakeClockHub(t)
	ws, id := rawJoin(t, url, testHello("slow-beat"))
	expectEvent(t, h, EventJoined, id)
	beat := func(seq uint64) {
		hb, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: seq})
		rawWrite(t, ws, websocket.MessageText, hb)
		if m, ok := rawRead(t, ws).(*proto.Heartbeat); !ok || m.Seq != seq {
			t.Fatalf("got %#v, want the ack of heartbeat %d", m, seq)
		}
	}
	beat(1)
	clock.Advance(1500 * time.Millisecond)
	beat(2) // heard after 1.5 s of silence
	h.Hasten([]string{id})
	clock.Advance(2500 * time.Millisecond) // past 2 s, within 3 s
	select {
	case e := <-h.Events():
		t.Fatalf("dropped within twice its measured silence: %+v", e)
	case <-time.After(200 * time.Millisecond):
	}
	clock.Advance(time.Second)
	e := expectEvent(t, h, EventLeft, id)
	if !errors.Is(e.Err, ErrHeartbeatTimeout) || !strings.Contains(e.Err.Error(), "timeout 3s") {
		t.Fatalf("left with %v, want the quick timeout at twice its 1.5 s silence", e.Err)
	}
}
