package coordinator

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// tinyJob is the tiny model on this package's sources, with checkpoints and validation inside a
// dozen steps.
func tinyJob(t *testing.T, steps int) job.Spec {
	t.Helper()
	var text []byte
	for _, f := range []string{"hub.go", "job.go", "step.go", "server.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text = append(text, b...)
	}
	p := filepath.Join(t.TempDir(), "corpus.txt")
	if err := os.WriteFile(p, text, 0o644); err != nil {
		t.Fatal(err)
	}
	s := job.Default()
	s.Model = model.TinyConfig()
	s.Data, s.Steps, s.BatchSize, s.MicroBatches = p, steps, 8, 4
	s.Warmup, s.CheckpointEvery, s.ValEvery = 2, 4, 3
	return s
}

// cluster is a coordinator on an httptest server with in-process workers: real WebSockets, real
// pion peers on loopback, a real SQLite file.
type cluster struct {
	srv    *Server
	http   *httptest.Server
	cancel context.CancelFunc
	kill   []context.CancelFunc // one per worker
	// startWorker starts worker i (its name is i): startCluster starts 0..workers-1.
	startWorker func(i int)
	onStep      func(local.Report)
	workers     sync.WaitGroup
	mu          sync.Mutex
	reports     []local.Report
	relayed     int64 // relay bytes seen at any step
}

// newTestHTTP serves a cluster's coordinator; a test may serve it another way (TestSweep: the
// listener caps and timeouts of shoal serve).
var newTestHTTP = httptest.NewServer

// clusterConfig, when set, adjusts the coordinator's Config of the next startCluster.
var clusterConfig func(*Config)

func startCluster(t *testing.T, spec job.Spec, workers int, relay bool, tweak ...func(i int, cfg *client.WorkerConfig)) *cluster {
	t.Helper()
	c := &cluster{}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	cfg := Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, Relay: relay,
		MinWorkers: workers, Settle: 200 * time.Millisecond, OutDir: t.TempDir(), Logger: log,
		OnStep: func(r local.Report) {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.reports = append(c.reports, r)
			for _, w := range c.srv.hub.Workers() {
				c.relayed += w.RelaySent
			}
			if c.onStep != nil {
				c.onStep(r)
			}
		}}
	if clusterConfig != nil {
		clusterConfig(&cfg)
	}
	srv, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.srv = srv
	c.http = newTestHTTP(srv.Handler())
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	c.startWorker = func(i int) {
		wctx, kill := context.WithCancel(ctx)
		c.kill = append(c.kill, kill)
		c.workers.Add(1)
		cfg := client.WorkerConfig{Coordinator: c.http.URL, MemoryBytes: 1 << 30, Logger: log, Name: strconv.Itoa(i),
			BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond}
		for _, f := range tweak {
			f(i, &cfg)
		}
		go func() {
			defer c.workers.Done()
			client.RunWorker(wctx, cfg)
		}()
	}
	for i := 0; i < workers; i++ {
		c.startWorker(i)
	}
	t.Cleanup(c.stop)
	return c
}

// killHolder stops the worker holding stage i of the active plan (called from OnStep, on the job
// loop's goroutine, so the published status is current).
func (c *cluster) killHolder(t *testing.T, i int) {
	st := c.srv.status.Load()
	if st.Plan == nil || len(st.Plan.Stages) <= i {
		t.Errorf("no stage %d to kill", i)
		return
	}
	for _, w := range c.srv.hub.Workers() {
		if w.ID == st.Plan.Stages[i].Peer {
			n, _ := strconv.Atoi(w.Hello.Name)
			c.kill[n]()
			return
		}
	}
	t.Errorf("stage %d's worker is not connected", i)
}

// killHolderAfter makes the cluster stop the worker holding stage i once, after step step's
// report: the worker leaves mid-job.
func (c *cluster) killHolderAfter(t *testing.T, step, i int) {
	var once sync.Once
	c.onStep = func(r local.Report) {
		if r.Step == step {
			once.Do(func() { c.killHolder(t, i) })
		}
	}
}

func (c *cluster) stop() {
	c.cancel()
	c.workers.Wait()
	c.http.Close()
	c.srv.Close()
}

func (c *cluster) run(t *testing.T) {
	t.Helper()
	c.runUntil(t, nil)
}

// runUntil is run, ended early when stop is closed (nil: never): it reports whether it was.
func (c *cluster) runUntil(t *testing.T, stop <-chan struct{}) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	stopped := make(chan bool, 1)
	go func() {
		select {
		case <-stop:
			cancel()
			stopped <- true
		case <-ctx.Done():
			stopped <- false
		}
	}()
	err := c.srv.Run(ctx)
	cancel()
	if <-stopped {
		return true
	}
	if err != nil {
		t.Fatal(err)
	}
	return false
}

func localReports(t *testing.T, spec job.Spec) ([]local.Report, *model.Model) {
	t.Helper()
	var out []local.Report
	res, err := local.Run(context.Background(), spec, local.Options{OnStep: func(r local.Report) { out = append(out, r) }})
	if err != nil {
		t.Fatal(err)
	}
	return out, res.Model
}

// sameAsLocal checks the cluster's step reports and final checkpoint against one process's run
// of spec, bit for bit.
func (c *cluster) sameAsLocal(t *testing.T, spec job.Spec) {
	t.Helper()
	want, ref := localReports(t, spec)
	c.mu.Lock()
	sameReports(t, c.reports, want)
	c.mu.Unlock()
	assertFinalCheckpoint(t, c, ref)
}

func sameReports(t *testing.T, got, want []local.Report) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d steps reported, want %d", len(got), len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		vs := func(v float64) bool { return v != v } // NaN: not computed
		if g.Step != w.Step || g.CE != w.CE || g.Aux != w.Aux || g.GradNorm != w.GradNorm || vs(g.ValLoss) != vs(w.ValLoss) || (!vs(w.ValLoss) && g.ValLoss != w.ValLoss) {
			t.Fatalf("step %d: cluster ce %v aux %v norm %v val %v; one process %v %v %v %v",
				w.Step, g.CE, g.Aux, g.GradNorm, g.ValLoss, w.CE, w.Aux, w.GradNorm, w.ValLoss)
		}
	}
}

// TestClusterEqualsLocal: three worker "processes" (in-process workers with their own WebSockets
// and pion peers) train the tiny job over a 3-stage pipeline; every step's loss, aux, gradient
// norm and validation loss, and the final checkpoint, equal the single process's bit for bit, and
// the activations moved over WebRTC, not the relay.
func TestClusterEqualsLocal(t *testing.T) {
	spec := tinyJob(t, 10)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}}
	want, ref := localReports(t, spec)
	c := startCluster(t, spec, 3, false)
	c.run(t)
	sameReports(t, c.reports, want)
	if c.relayed != 0 {
		t.Errorf("%d bytes went through the relay; the data plane should be WebRTC", c.relayed)
	}
	assertFinalCheckpoint(t, c, ref)
	// Status reflects the finished job.
	resp, err := http.Get(c.http.URL + "/api/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	if st.Job == nil || st.Job.Step != spec.Steps || st.Plan == nil || len(st.Plan.Stages) != 3 || len(st.Steps) != spec.Steps {
		t.Errorf("status %+v", st)
	}
	// Router statistics: every token's top-k assignments, per MoE block, in the status and the store.
	for _, blk := range []int{1, 3} {
		sum := 0
		for _, n := range st.Router[blk] {
			sum += n
		}
		if want := spec.BatchSize * spec.Model.BlockSize * spec.Model.TopK; sum != want {
			t.Errorf("router statistics of block %d count %d assignments, want %d", blk, sum, want)
		}
	}
	if len(st.Events) == 0 || st.Events[len(st.Events)-1].Kind != "job.done" {
		t.Errorf("status events end with %+v, want job.done last", st.Events)
	}
	mresp, err := http.Get(c.http.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, want := range []string{fmt.Sprintf("shoal_step %d", spec.Steps), "shoal_checkpoints_total", "shoal_tensor_bytes_sent_total"} {
		if !strings.Contains(string(mb), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	stats, err := c.srv.db.ListRouterStats(context.Background(), c.srv.status.Load().jobID(t), 0, -1)
	if err != nil || len(stats) != spec.Steps*2*spec.Model.NExpert {
		t.Errorf("%d router stats stored (%v), want %d", len(stats), err, spec.Steps*2*spec.Model.NExpert)
	}
}

// TestClusterRelay: the same job with the relay forced: the same numbers, and the bytes did go
// through the coordinator.
func TestClusterRelay(t *testing.T) {
	spec := tinyJob(t, 6)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	want, _ := localReports(t, spec)
	c := startCluster(t, spec, 2, true)
	c.run(t)
	sameReports(t, c.reports, want)
	if c.relayed == 0 {
		t.Error("relay mode moved no bytes through the coordinator")
	}
}

// TestClusterICEFallsBackToRelay: a worker whose WebRTC signaling never gets through (as behind a
// NAT that ICE cannot cross) makes its links time out; both ends fall back to the relay on their
// own, and the job computes exactly what the single process does.
func TestClusterICEFallsBackToRelay(t *testing.T) {
	spec := tinyJob(t, 5)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}}
	want, _ := localReports(t, spec)
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.ICETimeout = 500 * time.Millisecond
		cfg.BlockWebRTC = i == 1
	})
	c.run(t)
	sameReports(t, c.reports, want)
	if c.relayed == 0 {
		t.Error("no bytes went through the relay")
	}
}

func assertFinalCheckpoint(t *testing.T, c *cluster, ref *model.Model) {
	t.Helper()
	assertModelFile(t, filepath.Join(c.srv.cfg.OutDir, local.CheckpointName(ref.Step)), ref)
}

func assertModelFile(t *testing.T, path string, ref *model.Model) {
	t.Helper()
	m, _, err := model.LoadModel(path)
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range ref.P.Tensors {
		got := m.P.Tensors[i].Data
		for j := range got {
			if got[j] != tt.Data[j] {
				t.Fatalf("final checkpoint %s[%d] = %v, one process %v", tt.Name, j, got[j], tt.Data[j])
			}
		}
	}
	for i, tt := range ref.Opt.V.Tensors {
		got := m.Opt.V.Tensors[i].Data
		for j := range got {
			if got[j] != tt.Data[j] {
				t.Fatalf("final checkpoint optim.v.%s[%d] differs", tt.Name, j)
			}
		}
	}
}

// TestClusterSurvivesWorkerLoss: a worker leaves after step 5 of 12; the coordinator abandons the
// plan, replans over the two workers left, restores every shard from the checkpoint after step 4
// and replays — and the job ends with exactly the single process's parameters.
func TestClusterSurvivesWorkerLoss(t *testing.T) {
	spec := tinyJob(t, 12)
	_, ref := localReports(t, spec)
	c := startCluster(t, spec, 3, false)
	c.killHolderAfter(t, 5, 1)
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	// shoal export assembles the same model from the store.
	out := filepath.Join(t.TempDir(), "export.safetensors")
	ck, err := Export(context.Background(), c.srv.cfg.DataDir, 0, out)
	if err != nil {
		t.Fatal(err)
	}
	if int(ck.Step) != spec.Steps {
		t.Fatalf("exported checkpoint after step %d, want %d", ck.Step, spec.Steps)
	}
	assertModelFile(t, out, ref)
	events, err := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "plan"})
	if err != nil {
		t.Fatal(err)
	}
	if len(events) < 2 {
		t.Fatalf("%d plans recorded, want a replan after the loss", len(events))
	}
}

// TestClusterSurvivesBadInput: while a job trains, rogue clients send garbage, oversized and
// out-of-place messages, signals and frames for unknown workers, and reports for steps they do not
// hold. Each is refused or dropped with an error; the job finishes with the single process's
// parameters and the store stays sound.
func TestClusterSurvivesBadInput(t *testing.T) {
	spec := tinyJob(t, 8)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	_, ref := localReports(t, spec)
	c := startCluster(t, spec, 2, false)
	wsURL := "ws" + strings.TrimPrefix(c.http.URL, "http") + "/ws"
	hello := func(ctx context.Context) *websocket.Conn {
		ws, _, err := websocket.Dial(ctx, wsURL, nil)
		if err != nil {
			t.Error(err)
			return nil
		}
		b, _ := proto.EncodeMessage(&proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1, MemoryBytes: 1, Threads: 1, Name: "rogue"})
		ws.Write(ctx, websocket.MessageText, b)
		ws.Read(ctx) // the welcome
		return ws
	}
	attacks := []struct {
		name string
		send func(ctx context.Context, ws *websocket.Conn)
	}{
		{"garbage json", func(ctx context.Context, ws *websocket.Conn) {
			ws.Write(ctx, websocket.MessageText, []byte(`{"v":18,"type":"step_report","body":{`))
		}},
		{"oversized", func(ctx context.Context, ws *websocket.Conn) {
			ws.Write(ctx, websocket.MessageText, make([]byte, proto.MaxMessageSize+10))
		}},
		{"coordinator-only message", func(ctx context.Context, ws *websocket.Conn) {
			b, _ := json.Marshal(map[string]any{"v": proto.ProtocolVersion, "type": "clip", "body": map[string]any{"step": 1, "plan_version": 1, "factor": 1}})
			ws.Write(ctx, websocket.MessageText, b)
		}},
		{"report for a step it does not hold", func(ctx context.Context, ws *websocket.Conn) {
			b, _ := proto.EncodeMessage(&proto.StepReport{Step: 2, PlanVersion: 1, GradSq: map[string]float64{"lm_head.weight": 1}, CE: []float64{1, 1, 1, 1}})
			ws.Write(ctx, websocket.MessageText, b)
		}},
		{"signal to an unknown worker", func(ctx context.Context, ws *websocket.Conn) {
			b, _ := proto.EncodeMessage(&proto.Signal{From: "x", To: "nobody", SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0"}})
			ws.Write(ctx, websocket.MessageText, b)
		}},
		{"garbage binary", func(ctx context.Context, ws *websocket.Conn) {
			ws.Write(ctx, websocket.MessageBinary, []byte{9, 9, 9, 9})
		}},
		{"relay frame with NaN", func(ctx context.Context, ws *websocket.Conn) {
			for _, w := range c.srv.hub.Workers() {
				if w.Hello.Name != "rogue" {
					h := proto.FrameHeader{TensorKey: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 3, Block: 2, Expert: proto.NoExpert},
						DType: proto.F32, Shape: proto.Shape{1, 1, 1, 1}, ChunkCount: 1}
					frame, err := proto.AppendFrame(nil, h, proto.AppendFloat32s(nil, []float32{1}), proto.DefaultLimits())
					if err != nil {
						t.Error(err)
						return
					}
					// AppendFrame refuses NaN: write one into the payload by hand.
					binary.LittleEndian.PutUint32(frame[len(frame)-4:], math.Float32bits(float32(math.NaN())))
					b, _ := proto.AppendRelay(nil, w.ID, frame)
					ws.Write(ctx, websocket.MessageBinary, b)
					return
				}
			}
		}},
	}
	done := make(chan struct{})
	var once sync.Once
	attack := func() {
		defer close(done)
		for _, a := range attacks {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if ws := hello(ctx); ws != nil {
				a.send(ctx, ws)
				time.Sleep(20 * time.Millisecond)
				ws.CloseNow()
			}
			cancel()
		}
	}
	// Attack while the job trains (not from the job loop's goroutine: it must keep running).
	c.onStep = func(r local.Report) {
		if r.Step == 1 {
			once.Do(func() { go attack() })
		}
	}
	c.run(t)
	<-done
	assertFinalCheckpoint(t, c, ref)
	if err := c.srv.db.Check(context.Background()); err != nil {
		t.Fatalf("store after the attacks: %v", err)
	}
}

// TestClusterExpertHosts: 2 stages and 4 expert hosts (one expert replicated on two of them) as
// seven worker processes' worth of real peers: the same losses and final parameters as one process.
func TestClusterExpertHosts(t *testing.T) {
	spec := tinyJob(t, 6)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}, Experts: []job.ExpertShard{
		{Block: 1, Experts: []int{0, 1}, Host: 0}, {Block: 1, Experts: []int{1, 2, 3}, Host: 1},
		{Block: 3, Experts: []int{0, 1}, Host: 2}, {Block: 3, Experts: []int{2, 3}, Host: 3}}}
	want, ref := localReports(t, spec)
	c := startCluster(t, spec, 6, false)
	c.run(t)
	sameReports(t, c.reports, want)
	assertFinalCheckpoint(t, c, ref)
	if c.relayed != 0 {
		t.Errorf("%d bytes relayed", c.relayed)
	}
}

func (st *Status) jobID(t *testing.T) uuid.UUID {
	id, err := uuid.Parse(st.Job.ID)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestClusterTakesInNewWorkers: workers that join mid-job get work at the next step boundary,
// replaying nothing — the one worker, which holds every block, hands the planner's new stages their
// blocks peer to peer (sched.Cover, with hand-back), or else the coordinator checkpoints there and
// replans from it — and the job still ends with the single process's parameters.
func TestClusterTakesInNewWorkers(t *testing.T) {
	spec := tinyJob(t, 10)
	spec.CheckpointEvery = 5
	_, ref := localReports(t, spec)
	c := startCluster(t, spec, 1, false)
	var once sync.Once
	c.onStep = func(r local.Report) {
		if r.Step == 2 {
			once.Do(func() { c.startWorker(1); c.startWorker(2) })
		}
	}
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	var taken []storage.Event
	for _, kind := range []string{"pool.joined", "replan.join"} {
		events, err := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: kind})
		if err != nil {
			t.Fatal(err)
		}
		taken = append(taken, events...)
	}
	if len(taken) == 0 {
		t.Fatal("the new workers were never taken in")
	}
	t.Logf("taken in by %s: %s", taken[0].Kind, taken[0].Message)
	abandoned, _ := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "step.abandoned"})
	if len(abandoned) != 0 {
		t.Errorf("%d steps abandoned: taking workers in should replay nothing", len(abandoned))
	}
}

// TestClusterDropsSilentPeer: a peer that takes a stage and then never answers (a hung laptop,
// not a closed connection) misses the step's deadline — derived from the job's floor and ceiling
// — is dropped, and the job replans over the others and ends with the single process's
// parameters.
func TestClusterDropsSilentPeer(t *testing.T) {
	spec := tinyJob(t, 6)
	spec.StepDeadlineMinS, spec.StepDeadlineMaxS = 1, 2
	_, ref := localReports(t, spec)
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) { cfg.ICETimeout = 300 * time.Millisecond })
	// The silent peer claims to be fast, so the planner gives it a stage; it says Ready and then
	// nothing, but keeps its connection open (and answers heartbeats' absence with silence too).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wsURL := "ws" + strings.TrimPrefix(c.http.URL, "http") + "/ws"
	ws, _, err := websocket.Dial(ctx, wsURL, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.CloseNow()
	hello, _ := proto.EncodeMessage(&proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1e4, MemoryBytes: 1 << 40, Threads: 64, Name: "silent"})
	ws.Write(ctx, websocket.MessageText, hello)
	go func() {
		for {
			typ, b, err := ws.Read(ctx)
			if err != nil {
				return
			}
			if typ != websocket.MessageText {
				continue
			}
			if m, err := proto.DecodeMessage(b, proto.RoleWorker); err == nil {
				if a, ok := m.(*proto.Assign); ok {
					r, _ := proto.EncodeMessage(&proto.Ready{PlanVersion: a.PlanVersion})
					ws.Write(ctx, websocket.MessageText, r)
				}
			}
		}
	}()
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	dropped, _ := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "worker.deadline"})
	if len(dropped) == 0 {
		t.Fatal("the silent peer was never dropped for missing a deadline")
	}
}

// TestClusterTURNRelayOnly: with the coordinator's own TURN server on loopback and relay-only
// ICE, no link can connect directly, so every link goes through TURN: the job computes exactly
// what the single process does, the relays carried its tensors, and nothing went through the
// WebSocket relay. Without the TURN server the links would time out into that relay.
func TestClusterTURNRelayOnly(t *testing.T) {
	spec := tinyJob(t, 5)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}}
	want, ref := localReports(t, spec)
	clusterConfig = func(cfg *Config) {
		cfg.TURN = &TURNConfig{Listen: "127.0.0.1:0"}
		cfg.ICERelayOnly = true
	}
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		// Long enough for a loaded machine; a link that fails it still shows as relayed bytes.
		cfg.ICETimeout = 60 * time.Second
	})
	c.run(t)
	sameReports(t, c.reports, want)
	if c.relayed != 0 {
		t.Errorf("%d bytes went through the WebSocket relay; the links should go through TURN", c.relayed)
	}
	// Two links of 4 steps' activations and gradients at least.
	if got := c.srv.TURNRelayedBytes(); got < 1<<16 {
		t.Errorf("the TURN relays sent %d bytes", got)
	} else {
		t.Logf("the TURN relays sent %d bytes on", got)
	}
	assertFinalCheckpoint(t, c, ref)
}
