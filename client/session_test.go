//go:build !js

package client

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// The session tests run real worker sessions (the code RunWorker serves a connection with) against
// testHub, a scripted coordinator over real WebSockets on 127.0.0.1. The hub relays signals and
// frames between workers as the real one does, and drives steps as coordinator/step.go does; it
// also lets a test put anything on a worker's connection, such as frames that claim any sender, as
// a hostile peer's relayed frames would arrive. Data channels are real pion peers in loopback mode.

// testHub is the fake coordinator. Each worker joins under the id its Hello asks for.
type testHub struct {
	t    *testing.T
	srv  *httptest.Server
	ctx  context.Context
	msgs chan hubMsg // control messages from workers, other than signals and heartbeats

	mu       sync.Mutex
	conns    map[string]*websocket.Conn
	sessions int
	stray    []string // signals for workers that are not connected: "from->to type"
	// onHTTP serves every request that is not /ws (checkpoint uploads).
	onHTTP func(w http.ResponseWriter, r *http.Request)
}

type hubMsg struct {
	from string
	m    proto.Message
}

func newTestHub(t *testing.T) *testHub {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h := &testHub{t: t, ctx: ctx, msgs: make(chan hubMsg, 1024), conns: map[string]*websocket.Conn{}}
	var wg sync.WaitGroup
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ws" {
			h.mu.Lock()
			f := h.onHTTP
			h.mu.Unlock()
			if f == nil {
				http.NotFound(w, r)
				return
			}
			f(w, r)
			return
		}
		wg.Add(1)
		defer wg.Done()
		h.serveWorker(w, r)
	}))
	t.Cleanup(func() {
		cancel()
		h.srv.Close()
		wg.Wait()
	})
	return h
}

func (h *testHub) serveWorker(w http.ResponseWriter, r *http.Request) {
	ws, err := websocket.Accept(w, r, nil)
	if err != nil {
		h.t.Errorf("accept: %v", err)
		return
	}
	defer ws.CloseNow()
	ws.SetReadLimit(proto.MaxBinarySize)
	_, b, err := ws.Read(h.ctx)
	if err != nil {
		return
	}
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	if err != nil {
		h.t.Errorf("hello: %v", err)
		return
	}
	id := m.(*proto.Hello).WorkerID
	h.mu.Lock()
	h.sessions++
	session := fakeSession(h.sessions)
	h.conns[id] = ws
	h.mu.Unlock()
	h.write(ws, &proto.Welcome{WorkerID: id, HeartbeatMS: 1000, Loopback: true, ICEServers: []proto.ICEServer{}, Session: session})
	for {
		typ, b, err := ws.Read(h.ctx)
		if err != nil {
			return
		}
		if typ == websocket.MessageBinary {
			kind, to, frame, err := proto.DecodeBinary(b)
			if err != nil || kind != proto.BinRelay {
				h.t.Errorf("%s sent a bad binary message: %v", id, err)
				return
			}
			h.relay(id, to, frame)
			continue
		}
		m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
		if err != nil {
			h.t.Errorf("%s: %v", id, err)
			return
		}
		switch m := m.(type) {
		case *proto.Heartbeat:
			if !m.Ack {
				h.write(ws, &proto.Heartbeat{Seq: m.Seq, Ack: true})
			}
		case *proto.Signal:
			m.From = id // the coordinator's word for who sent it
			if dst := h.conn(m.To); dst != nil {
				h.write(dst, m)
			} else {
				h.mu.Lock()
				h.stray = append(h.stray, fmt.Sprintf("%s->%s %v", m.From, m.To, m.SDP != nil))
				h.mu.Unlock()
			}
		default:
			select {
			case h.msgs <- hubMsg{id, m}:
			case <-h.ctx.Done():
				return
			}
		}
	}
}

func (h *testHub) conn(id string) *websocket.Conn {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.conns[id]
}

func (h *testHub) write(ws *websocket.Conn, m proto.Message) {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		h.t.Errorf("encode %s: %v", m.Type(), err)
		return
	}
	ws.Write(h.ctx, websocket.MessageText, b) // fails only once the test is over
}

// send sends control message m to worker to.
func (h *testHub) send(to string, m proto.Message) {
	h.t.Helper()
	ws := h.conn(to)
	if ws == nil {
		h.t.Fatalf("no worker %s", to)
	}
	h.write(ws, m)
}

// relay hands frame to worker to as the real hub does, claiming that worker from sent it: frames
// between workers, and the frames a test forges.
func (h *testHub) relay(from, to string, frame []byte) {
	ws := h.conn(to)
	if ws == nil {
		return
	}
	b, err := proto.AppendRelay(nil, from, frame)
	if err != nil {
		h.t.Errorf("relay from %s: %v", from, err)
		return
	}
	ws.Write(h.ctx, websocket.MessageBinary, b)
}

// direct sends the frames of tensor tn to worker to from the coordinator itself.
func (h *testHub) direct(to string, tn proto.Tensor) {
	h.t.Helper()
	frames, err := proto.SplitTensor(tn, proto.Limits{})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, f := range frames {
		b, err := proto.AppendDirect(nil, f)
		if err != nil {
			h.t.Fatal(err)
		}
		h.conn(to).Write(h.ctx, websocket.MessageBinary, b)
	}
}

// next returns the next control message a worker sent, failing the test after a while.
func (h *testHub) next() hubMsg {
	h.t.Helper()
	select {
	case m := <-h.msgs:
		return m
	case <-time.After(30 * time.Second):
		h.t.Fatal("no message from the workers")
	}
	panic("unreachable")
}

// join starts a worker session as RunWorker does for one connection, asking for id, and returns
// it once welcomed. It ends with the test.
func (h *testHub) join(id string) *session {
	h.t.Helper()
	return h.joinOffering(id, 0)
}

// joinOffering is join for a worker offering memory bytes for its shard (--memory; 0: no cap).
func (h *testHub) joinOffering(id string, memory int64) *session {
	h.t.Helper()
	return h.joinWith(id, func(cfg *WorkerConfig, hello *proto.Hello) {
		if memory > 0 {
			cfg.MemoryBytes, hello.MemoryBytes = memory, memory
		}
	})
}

// joinWith is join with the worker's config and hello adjusted by adjust.
func (h *testHub) joinWith(id string, adjust func(*WorkerConfig, *proto.Hello)) *session {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	hello := proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1, MemoryBytes: 1 << 30, Threads: 1, WorkerID: id}
	cfg := WorkerConfig{Coordinator: h.srv.URL, Logger: slog.New(slog.DiscardHandler), HTTP: http.DefaultClient, ICETimeout: 10 * time.Second}
	if adjust != nil {
		adjust(&cfg, &hello)
	}
	dctx, dcancel := context.WithTimeout(ctx, connWait)
	defer dcancel()
	conn, w, err := Dial(dctx, ConnConfig{URL: "ws" + strings.TrimPrefix(h.srv.URL, "http") + "/ws", Hello: hello})
	if err != nil {
		cancel()
		h.t.Fatal(err)
	}
	s := newSession(cfg, conn, w)
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.serve(ctx)
	}()
	h.t.Cleanup(func() {
		cancel()
		<-done
		conn.Close()
	})
	return s
}

// testPlan is a job placed on workers: the stages in order, then the expert hosts, each with its
// Assign.
type testPlan struct {
	spec    job.Spec
	version uint32
	stages  []string
	hosts   []string
	assigns map[string]*proto.Assign
}

func (p *testPlan) participants() []string {
	return append(append([]string{}, p.stages...), p.hosts...)
}

// testJobSpec is the equivalence tests' job (stage_test.go) as a spec.
func testJobSpec(seed uint64) job.Spec {
	return job.Spec{Model: model.TinyConfig(), Data: "testdata", DataExtensions: []string{}, Seed: seed, Steps: 10,
		BatchSize: trainB, MicroBatches: trainM, LR: trainLR, MinLRRatio: 1, WeightDecay: trainWD, Clip: trainClip,
		StepDeadlineMinS: 1, StepDeadlineMaxS: 60}
}

// twoStagePlan cuts the tiny model at block 2 onto workers s0 and s1, each stage with its own
// experts, with every tensor relayed through the coordinator when relay is set.
func twoStagePlan(t *testing.T, spec job.Spec, s0, s1 string, relay bool) *testPlan {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &testPlan{spec: spec, version: 1, stages: []string{s0, s1}, assigns: map[string]*proto.Assign{}}
	p.assigns[s0] = &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: p.version, Next: s1, ExpertHosts: []proto.ExpertHost{}, Relay: relay,
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}}
	p.assigns[s1] = &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: p.version, Prev: s0, ExpertHosts: []proto.ExpertHost{}, Relay: relay,
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 1, Count: 2, Begin: 2, End: 4, Last: true}}}
	return p
}

// start assigns every worker its shard and waits until all are ready.
func (h *testHub) start(p *testPlan) {
	h.t.Helper()
	for id, a := range p.assigns {
		h.send(id, a)
	}
	ready := map[string]bool{}
	for len(ready) < len(p.assigns) {
		m := h.next()
		switch msg := m.m.(type) {
		case *proto.Ready:
			ready[m.from] = true
		default:
			h.t.Fatalf("%s answered its assignment with %s: %v", m.from, msg.Type(), msg)
		}
	}
}

// trainStep runs training step step of plan p on batch (x, y) as the coordinator does: open it
// everywhere, feed tokens and targets, collect every report, send the clip factor. It returns the
// step's cross-entropy, or the first error a worker reported.
func (h *testHub) trainStep(p *testPlan, step uint64, x, y []int32) (float64, error) {
	h.t.Helper()
	M, B, T := p.spec.MicroBatches, p.spec.BatchSize, p.spec.Model.BlockSize
	st := proto.StepSpec{Step: step, PlanVersion: p.version, MicroBatches: M, Rows: B / M}
	parts := p.participants()
	for _, id := range parts {
		h.send(id, &proto.StepOpen{Step: step, PlanVersion: p.version, LR: p.spec.LR, MicroBatches: M, DeadlineMS: 30_000, Rows: st.Rows})
	}
	n := st.Rows * T
	for j := 0; j < M; j++ {
		xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
		if err != nil {
			h.t.Fatal(err)
		}
		h.direct(p.stages[0], xt)
		h.direct(p.stages[len(p.stages)-1], yt)
	}
	reports := make([]*proto.StepReport, len(parts))
	for got := 0; got < len(parts); {
		m := h.next()
		switch msg := m.m.(type) {
		case *proto.StepReport:
			for i, id := range parts {
				if id == m.from {
					reports[i] = msg
				}
			}
			got++
		case *proto.Error:
			return 0, fmt.Errorf("%s: %w", m.from, msg)
		default:
			h.t.Fatalf("%s sent %s during step %d", m.from, msg.Type(), step)
		}
	}
	ce, _, norm, err := proto.StepTotals(reports, M)
	if err != nil {
		return 0, err
	}
	clip := model.ClipFactor(norm, p.spec.Clip)
	for _, id := range parts {
		h.send(id, &proto.Clip{Step: step, PlanVersion: p.version, Factor: float64(clip)})
	}
	return ce, nil
}

// referenceLosses trains the plan's job in one process (LocalPipeline, bitwise the single process)
// and returns each step's cross-entropy.
func referenceLosses(t *testing.T, spec job.Spec, cuts []int, hosts [][]ExpertRef, steps int) []float64 {
	t.Helper()
	p, err := NewLocalExpertPipeline(spec.Model, spec.Seed, cuts, spec.WeightDecay, hosts)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var ces []float64
	for s := 0; s < steps; s++ {
		x, y := testBatch(t, s, spec.BatchSize, spec.Model.BlockSize)
		ce, _, _, err := p.Step(ctx, uint64(s), x, y, spec.BatchSize, spec.MicroBatches, spec.LR, spec.Clip)
		if err != nil {
			t.Fatal(err)
		}
		ces = append(ces, ce)
	}
	return ces
}

// forge returns the frames of a tensor of kind with a key of plan version and the given step,
// micro-batch and block (and expert 0 for an expert kind), holding rows rows of C float32 (int32 for
// tokens and targets): what a hostile peer would send.
func forge(t *testing.T, kind proto.Kind, version uint32, step uint64, mb, block uint32, rows, C int) [][]byte {
	t.Helper()
	sh, err := proto.ShapeOf(rows, C)
	if err != nil {
		t.Fatal(err)
	}
	x := make([]float32, rows*C)
	for i := range x {
		x[i] = 1e3 // loud enough to change any loss it gets into
	}
	tn := proto.Tensor{Key: proto.TensorKey{Kind: kind, PlanVersion: version, Step: step, MicroBatch: mb, Block: block, Expert: proto.NoExpert},
		DType: proto.F32, Shape: sh, Data: proto.AppendFloat32s(nil, x)}
	switch kind {
	case proto.KindExpertIn, proto.KindExpertOut, proto.KindExpertGradIn, proto.KindExpertGradOut:
		tn.Key.Expert = 0
	case proto.KindTokens, proto.KindTargets:
		tn.Key.Block, tn.DType = proto.NoBlock, proto.I32
		tn.Data = proto.AppendInt32s(nil, make([]int32, rows*C))
	}
	frames, err := proto.SplitTensor(tn, proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	return frames
}

// waitFor polls cond until it holds, failing the test after connWait.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(connWait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// holds reports whether the session's neighbour mailbox holds a tensor of key k.
func (s *session) holds(k proto.TensorKey) bool {
	box := s.plane.Load().box
	box.mu.Lock()
	defer box.mu.Unlock()
	_, ok := box.arrived[k]
	return ok
}

// announce returns the first frame of a tensor of key and shape (float32), whatever its size: a
// frame announcing a tensor, the rest of which never comes.
func announce(t *testing.T, key proto.TensorKey, shape proto.Shape) []byte {
	t.Helper()
	h := proto.FrameHeader{TensorKey: key, DType: proto.F32, Shape: shape}
	total := h.TensorBytes()
	h.ChunkCount = uint32((total + proto.MaxChunkPayload - 1) / proto.MaxChunkPayload)
	b, err := proto.AppendFrame(nil, h, make([]byte, min(total, proto.MaxChunkPayload)), proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSessionRefusesShardOverMemory: a worker offering less memory than its stage needs answers
// the Assign with proto.ErrCodeMemory for that plan, not Ready, and stays connected.
func TestSessionRefusesShardOverMemory(t *testing.T) {
	h := newTestHub(t)
	h.joinOffering("w-0", 1<<20)
	p := twoStagePlan(t, testJobSpec(1), "w-0", "w-1", true)
	h.send("w-0", p.assigns["w-0"])
	m := h.next()
	e, ok := m.m.(*proto.Error)
	if !ok || m.from != "w-0" {
		t.Fatalf("%s answered with %s, want an error", m.from, m.m.Type())
	}
	if e.Code != proto.ErrCodeMemory || e.PlanVersion != p.version || !strings.Contains(e.Message, "this worker offers 1048576 (--memory)") {
		t.Fatalf("got %+v, want a memory error for plan %d", e, p.version)
	}
	if h.conn("w-0") == nil {
		t.Fatal("the worker left after refusing its shard")
	}
}

// TestSessionRefusesStepOfAnotherShape: a step or an evaluation of other rows or micro-batches
// than the job's is refused with an error, before the stage allocates for it — a coordinator
// asking for 4,096 rows gets no 4,096-row activations (proto bounds rows at 65,536) — and the worker stays to train
// the job's own steps.
func TestSessionRefusesStepOfAnotherShape(t *testing.T) {
	h := newTestHub(t)
	h.join("w-0")
	h.join("w-1")
	p := twoStagePlan(t, testJobSpec(1), "w-0", "w-1", true)
	h.start(p)
	M, rows := p.spec.MicroBatches, p.spec.BatchSize/p.spec.MicroBatches
	pass := p.spec.ValPassRows()
	for _, open := range []*proto.StepOpen{
		{Step: 0, PlanVersion: p.version, MicroBatches: M, Rows: 4096, DeadlineMS: 30_000},
		{Step: 0, PlanVersion: p.version, MicroBatches: M + 1, Rows: rows, DeadlineMS: 30_000},
		{Step: proto.EvalStep(0), PlanVersion: p.version, MicroBatches: 1, Rows: 32, DeadlineMS: 30_000, Eval: true},
		{Step: proto.EvalStep(0), PlanVersion: p.version, MicroBatches: data.ValWindows/pass + 1, Rows: pass, DeadlineMS: 30_000, Eval: true},
	} {
		h.send("w-0", open)
		m := h.next()
		e, ok := m.m.(*proto.Error)
		if !ok || m.from != "w-0" || !strings.Contains(e.Message, "the job has") {
			t.Fatalf("%+v: %s answered %v, want a refusal of the shape", open, m.from, m.m)
		}
	}
	if h.conn("w-0") == nil {
		t.Fatal("the worker left after refusing a step")
	}
	x, y := testBatch(t, 0, p.spec.BatchSize, p.spec.Model.BlockSize)
	if _, err := h.trainStep(p, 0, x, y); err != nil {
		t.Fatalf("the job's own step after the refusals: %v", err)
	}
}
