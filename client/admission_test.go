//go:build !js

package client

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestRelayedFramesFromOutsideThePlan: a worker that is no neighbour of a stage under the plan
// sends it, through the coordinator's relay, the activation of a future step's micro-batch (whole
// and well formed), a chunk twice, a frame that is no frame, and during the steps a duplicate chunk
// again and again. None of it reaches the mailbox, nothing is reported to the coordinator, and the
// steps complete with the losses of the single process, bit for bit.
func TestRelayedFramesFromOutsideThePlan(t *testing.T) {
	h := newTestHub(t)
	spec := testJobSpec(21)
	plan := twoStagePlan(t, spec, "w-s0", "w-s1", true)
	h.join("w-s0")
	s1 := h.join("w-s1")
	h.start(plan)
	want := referenceLosses(t, spec, []int{2}, nil, 2)
	T, C := spec.Model.BlockSize, spec.Model.NEmbd
	N := spec.BatchSize / spec.MicroBatches * T

	var sent int64
	outsider := func(frame []byte) {
		h.relay("w-evil", "w-s1", frame)
		sent++
	}
	forged := forge(t, proto.KindActivation, plan.version, 1, 0, 2, N, C) // step 1, micro-batch 0
	for _, f := range forged {
		outsider(f)
	}
	dup := forge(t, proto.KindActivation, plan.version, 0, 1, 2, N, C)
	outsider(dup[0])
	outsider(dup[0])
	outsider(make([]byte, proto.HeaderSize+8)) // not a frame
	waitFor(t, "the outsider's frames to be dropped", func() bool { return s1.dropped.Load() == sent })
	forgedKey := actKey(proto.StepSpec{Step: 1, PlanVersion: plan.version}, 0, 2)
	if s1.holds(forgedKey) {
		t.Fatalf("the forged %v from outside the plan is in the mailbox", forgedKey)
	}

	for step := 0; step < 2; step++ {
		// The replan storm of the review: a duplicate chunk relayed again and again while the step runs.
		stop := make(chan struct{})
		var flood sync.WaitGroup
		flood.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(2 * time.Millisecond):
					h.relay("w-evil", "w-s1", dup[0])
				}
			}
		})
		x, y := testBatch(t, step, spec.BatchSize, T)
		ce, err := h.trainStep(plan, uint64(step), x, y)
		close(stop)
		flood.Wait()
		if err != nil {
			t.Fatalf("step %d failed: %v", step, err)
		}
		if ce != want[step] {
			t.Fatalf("step %d: loss %v, the single process %v: a forged tensor got in", step, ce, want[step])
		}
	}
	if s1.dropped.Load() <= sent {
		t.Errorf("%d frames dropped, want more than the %d sent before the steps", s1.dropped.Load(), sent)
	}
	select {
	case m := <-h.msgs:
		t.Errorf("%s sent %s after the steps: %v", m.from, m.m.Type(), m.m)
	default:
	}
}

// TestRelayedFrameANeighbourMustNotSend: a neighbour that relays what the plan does not have it
// send — the gradient that only the next stage sends, tokens, an activation for another block,
// expert rows from a stage, a tensor far larger than the job's — broke the protocol: the worker
// reports a data-plane failure, and allocates nothing for the tensor.
func TestRelayedFrameANeighbourMustNotSend(t *testing.T) {
	h := newTestHub(t)
	spec := testJobSpec(21)
	plan := twoStagePlan(t, spec, "w-s0", "w-s1", true)
	s1 := h.join("w-s1") // its neighbour w-s0 is played by the test
	h.send("w-s1", plan.assigns["w-s1"])
	if m := h.next(); m.m.Type() != proto.TypeReady {
		t.Fatalf("%s answered the assignment with %v", m.from, m.m)
	}
	T, C := spec.Model.BlockSize, spec.Model.NEmbd
	N := spec.BatchSize / spec.MicroBatches * T
	v := plan.version
	tests := []struct {
		name   string
		frames [][]byte
		want   string // in the error the worker reports
	}{
		{"gradient from the previous stage", forge(t, proto.KindActivationGrad, v, 0, 0, 2, N, C), ErrUnexpectedTensor.Error()},
		{"tokens from a peer", forge(t, proto.KindTokens, v, 0, 0, 0, N/T, T), ErrUnexpectedTensor.Error()},
		{"activation for another block", forge(t, proto.KindActivation, v, 0, 0, 3, N, C), ErrUnexpectedTensor.Error()},
		{"expert rows from a stage", forge(t, proto.KindExpertOut, v, 0, 0, 3, 4, C), ErrUnexpectedTensor.Error()},
		{"activation of 256 MiB", [][]byte{announce(t, actKey(proto.StepSpec{Step: 0, PlanVersion: v}, 0, 2), proto.Shape{16384, 4096, 1, 1})},
			proto.ErrTensorTooLarge.Error()},
		{"activation of a future plan", forge(t, proto.KindActivation, v+1, 0, 0, 2, N, C), ErrUnexpectedTensor.Error()},
	}
	framesSent := 0
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var before runtime.MemStats
			runtime.ReadMemStats(&before)
			for _, f := range tt.frames {
				h.relay("w-s0", "w-s1", f)
			}
			m := h.next()
			e, ok := m.m.(*proto.Error)
			if !ok || m.from != "w-s1" || e.Code != proto.ErrCodeStep || e.PlanVersion != v || !strings.Contains(e.Message, tt.want) {
				t.Fatalf("%s sent %v, want a step error of plan %d saying %q", m.from, m.m, v, tt.want)
			}
			t.Logf("reported: %s", e.Message)
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			if grew := int64(after.TotalAlloc) - int64(before.TotalAlloc); grew > 16<<20 {
				t.Errorf("%d MiB allocated for a tensor that was refused", grew>>20)
			}
			// The plane's reassemblers are the frame handler's: read once it has handled every
			// frame sent (framesHandled).
			framesSent += len(tt.frames)
			waitFor(t, "the frames to be handled", func() bool { return s1.framesHandled.Load() == int64(framesSent) })
			if r := s1.plane.Load().reasm["w-s0"]; r != nil && r.Pending() != 0 {
				t.Errorf("%d tensors of the refused kind held", r.Pending())
			}
		})
	}
	if s1.dropped.Load() != 0 {
		t.Errorf("%d frames of a neighbour dropped silently, want each reported", s1.dropped.Load())
	}
}

// TestRelayMemoryBoundedPerWorker: a stage with four neighbours (the stages before and after it,
// two expert hosts) and four workers outside its plan, all sending first chunks of tensors whose
// other chunks never come, from several steps. The outsiders' frames — announcing 256 MiB each —
// are dropped before anything is allocated; each neighbour gets at most its share; and together
// they hold no more than the worker's one budget, sized by the job's largest tensor, not by
// proto's default limits per sender. A neighbour announcing a tensor larger than the job's is
// refused before its buffer exists.
func TestRelayMemoryBoundedPerWorker(t *testing.T) {
	h := newTestHub(t)
	spec := testJobSpec(21)
	// Micro-batches of 16 sequences: tensors of several chunks each, which the test leaves
	// incomplete.
	spec.BatchSize = 16 * spec.MicroBatches
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	s := h.join("w-s1")
	const v = 1
	h.send("w-s1", &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: v, Prev: "w-s0", Next: "w-s2", Relay: true,
		Shard:       proto.Shard{Stage: &proto.StageShard{Index: 1, Count: 3, Begin: 1, End: 3}},
		ExpertHosts: []proto.ExpertHost{{Block: 1, Expert: 0, Workers: []string{"w-e0"}}, {Block: 1, Expert: 1, Workers: []string{"w-e1"}}}})
	if m := h.next(); m.m.Type() != proto.TypeReady {
		t.Fatalf("%s answered the assignment with %v", m.from, m.m)
	}
	T, C := spec.Model.BlockSize, spec.Model.NEmbd
	rows := max(spec.BatchSize/spec.MicroBatches, spec.ValPassRows()) * T // the largest legitimate tensor's rows
	shape := proto.Shape{uint32(rows), uint32(C), 1, 1}
	tensorBytes := 4 * rows * C
	if tensorBytes <= proto.MaxChunkPayload {
		t.Fatalf("a %d-byte tensor fits one chunk: the test needs tensors left incomplete", tensorBytes)
	}
	huge := proto.Shape{16384, 4096, 1, 1} // 256 MiB, proto's default limit
	key := func(kind proto.Kind, step uint64, mb, block, expert uint32) proto.TensorKey {
		return proto.TensorKey{Kind: kind, PlanVersion: v, Step: step, MicroBatch: mb, Block: block, Expert: expert}
	}
	neighbours := []struct {
		id  string
		key func(step uint64) proto.TensorKey
	}{
		{"w-s0", func(s uint64) proto.TensorKey { return key(proto.KindActivation, s, 0, 1, proto.NoExpert) }},
		{"w-s2", func(s uint64) proto.TensorKey { return key(proto.KindActivationGrad, s, 0, 3, proto.NoExpert) }},
		{"w-e0", func(s uint64) proto.TensorKey { return key(proto.KindExpertOut, s, 0, 1, 0) }},
		{"w-e1", func(s uint64) proto.TensorKey { return key(proto.KindExpertGradOut, s, 1, 1, 1) }},
	}
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var outsiders int64
	for step := uint64(0); step < 8; step++ {
		for i, n := range neighbours {
			h.relay(n.id, "w-s1", announce(t, n.key(step), shape))
			h.relay("w-x"+string(rune('0'+i)), "w-s1", announce(t, n.key(step), huge))
			outsiders++
		}
	}
	h.relay("w-s0", "w-s1", announce(t, neighbours[0].key(100), huge))
	h.relay("w-x9", "w-s1", announce(t, neighbours[0].key(101), huge)) // the last frame: all were read
	outsiders++
	waitFor(t, "the outsiders' frames to be dropped", func() bool { return s.dropped.Load() == outsiders })
	var after runtime.MemStats
	runtime.ReadMemStats(&after)

	// Every frame was handled (the last one counted), so the frame handler's reassemblers can be
	// read.
	pl := s.plane.Load()
	budget := pl.adm.lim.Budget
	perSender := pl.adm.lim.MaxInFlightBytes
	held := 0
	for from, r := range pl.reasm {
		held += r.InFlight()
		if r.InFlight() > perSender {
			t.Errorf("%s holds %d bytes, more than a sender's %d", from, r.InFlight(), perSender)
		}
		if strings.HasPrefix(from, "w-x") {
			t.Errorf("a reassembler for %s, which is outside the plan", from)
		}
	}
	pendingPrev := pl.reasm["w-s0"].Pending()
	t.Logf("budget %d KiB, in use %d KiB, per sender %d KiB; heap grew %d MiB",
		budget.Max()>>10, budget.InUse()>>10, perSender>>10, (int64(after.HeapAlloc)-int64(before.HeapAlloc))>>20)
	if held != budget.InUse() {
		t.Errorf("the reassemblers hold %d bytes, the budget counts %d", held, budget.InUse())
	}
	if budget.InUse() > budget.Max() {
		t.Errorf("%d bytes held, over the worker's budget of %d", budget.InUse(), budget.Max())
	}
	// Each neighbour had 8 tensors started, and room for perSenderTensors of them.
	if want := len(neighbours) * perSenderTensors * tensorBytes; budget.InUse() != want {
		t.Errorf("%d bytes in use, want %d: %d tensors of %d bytes from each of %d neighbours", budget.InUse(), want, perSenderTensors, tensorBytes, len(neighbours))
	}
	if limit := (len(neighbours) + 1) * perSenderTensors * tensorBytes; budget.Max() > limit {
		t.Errorf("budget %d bytes, want at most %d: sized by this job's tensors", budget.Max(), limit)
	}
	if pendingPrev != perSenderTensors {
		t.Errorf("w-s0 has %d tensors pending, want %d: the 256 MiB one must be refused", pendingPrev, perSenderTensors)
	}
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 64<<20 {
		t.Errorf("the heap grew by %d MiB", grew>>20)
	}
	// The neighbours' excess was reported (as one failure or several: the worker reports the
	// first failure it has not sent yet), and nothing about the outsiders. The report goes out
	// from the session's loop, after the frames were read: wait for it.
	var reported []string
	waitFor(t, "the neighbours' excess to be reported", func() bool {
		for len(h.msgs) > 0 {
			m := <-h.msgs
			if e, ok := m.m.(*proto.Error); ok {
				reported = append(reported, e.Message)
			}
		}
		return len(reported) > 0
	})
	for _, msg := range reported {
		if strings.Contains(msg, "w-x") {
			t.Errorf("a frame from outside the plan was reported: %s", msg)
		}
	}
}

// TestSessionStepsOverWebRTCWithExpertHosts runs real sessions over real WebRTC data channels: two
// stages and two expert hosts, one expert replicated on both, so that every kind of tensor a plan
// has travels between the neighbours the plan names, checked by each receiver. A peer outside the
// plan offers a connection to a stage: nothing is answered to it. The losses are the single
// process's, bit for bit.
func TestSessionStepsOverWebRTCWithExpertHosts(t *testing.T) {
	checkRTCGoroutines(t)
	h := newTestHub(t)
	spec := testJobSpec(33)
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	plan := twoStagePlan(t, spec, "w-s0", "w-s1", false)
	plan.hosts = []string{"w-e0", "w-e1"}
	// Block 1's experts 0 and 1 on w-e0, 1 and 2 on w-e1 (expert 1 replicated, w-e0 first); expert
	// 3 and block 3 stay with their stages.
	plan.assigns["w-s0"].ExpertHosts = []proto.ExpertHost{{Block: 1, Expert: 0, Workers: []string{"w-e0"}},
		{Block: 1, Expert: 1, Workers: []string{"w-e0", "w-e1"}}, {Block: 1, Expert: 2, Workers: []string{"w-e1"}}}
	replicated := []proto.ExpertHost{{Block: 1, Expert: 1, Workers: []string{"w-e0", "w-e1"}}}
	for i, es := range [][]int{{0, 1}, {1, 2}} {
		plan.assigns[plan.hosts[i]] = &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: plan.version, Router: "w-s0",
			ExpertHosts: replicated, Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 1, Experts: es, StageIndex: 0, StageCount: 2}}}
	}
	type ref = ExpertRef
	want := referenceLosses(t, spec, []int{2}, [][]ExpertRef{{ref{1, 0}, ref{1, 1}}, {ref{1, 1}, ref{1, 2}}}, 2)

	for _, id := range plan.participants() {
		h.join(id)
	}
	h.start(plan)

	// An outsider's real offer (made by a transport of its own), relayed to w-s1.
	offers := make(chan proto.Signal, 16)
	evil := NewRTCTransport("w-a-evil", RTCConfig{Loopback: true}, signalFunc(func(_ context.Context, _ string, s proto.Signal) error {
		select {
		case offers <- s:
		default: // the offer and its first candidates are enough
		}
		return nil
	}))
	defer evil.Close()
	cctx, ccancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	evil.Connect(cctx, "w-s1", true)
	ccancel()
	for len(offers) > 0 {
		s := <-offers
		s.PlanVersion = plan.version
		h.send("w-s1", &s)
	}

	for step := 0; step < 2; step++ {
		x, y := testBatch(t, step, spec.BatchSize, spec.Model.BlockSize)
		ce, err := h.trainStep(plan, uint64(step), x, y)
		if err != nil {
			t.Fatalf("step %d failed: %v", step, err)
		}
		if ce != want[step] {
			t.Fatalf("step %d: loss %v, the single process %v", step, ce, want[step])
		}
	}
	h.mu.Lock()
	stray := h.stray
	h.mu.Unlock()
	if len(stray) > 0 {
		t.Errorf("signals to peers outside the plan: %v", stray)
	}
}

// signalFunc is a Signaler made of a function.
type signalFunc func(ctx context.Context, to string, s proto.Signal) error

func (f signalFunc) SendSignal(ctx context.Context, to string, s proto.Signal) error {
	return f(ctx, to, s)
}

// TestSessionCheckpointPresentsItsSession: a checkpoint upload carries the session credential of
// the worker's Welcome, which is what the coordinator takes a shard's upload on.
func TestSessionCheckpointPresentsItsSession(t *testing.T) {
	checkRTCGoroutines(t)
	h := newTestHub(t)
	uploads := make(chan string, 1)
	h.mu.Lock()
	h.onHTTP = func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/upload/1" {
			uploads <- r.Header.Get("Authorization")
		}
		w.WriteHeader(http.StatusNoContent)
	}
	h.mu.Unlock()
	spec := testJobSpec(21)
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	s := h.join("w-s0")
	h.send("w-s0", &proto.Assign{Job: "job-1", Spec: raw, PlanVersion: 1, ExpertHosts: []proto.ExpertHost{},
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}}})
	if m := h.next(); m.m.Type() != proto.TypeReady {
		t.Fatalf("%s answered the assignment with %v", m.from, m.m)
	}
	h.send("w-s0", &proto.Checkpoint{ID: 1, Step: 0, Shard: "stage-0", UploadPath: "/upload/1"})
	select {
	case got := <-uploads:
		if want := "Bearer " + s.welcome.Session; got != want || s.welcome.Session == "" {
			t.Errorf("upload with Authorization %q, want %q", got, want)
		}
	case <-time.After(connWait):
		t.Fatal("no upload")
	}
}

// TestSessionPendingSignalsBounded: signals for a plan the worker has not set up yet are held,
// but not without bound.
func TestSessionPendingSignalsBounded(t *testing.T) {
	var e early // serve's, before any plan
	cand := &proto.ICECandidate{Candidate: "candidate:1 1 udp 2130706431 127.0.0.1 5000 typ host"}
	for i := range 1000 {
		e.signal(&plane{}, proto.Signal{From: "w-x" + strings.Repeat("x", i%50), To: "w-s1", PlanVersion: 7, Candidate: cand}, slog.New(slog.DiscardHandler))
	}
	n := len(e.signals)
	if n > maxPendingSignals {
		t.Errorf("%d signals held, want at most %d", n, maxPendingSignals)
	}
}

// TestAdmissionRules is the admission of a stage and of an expert host of a plan like the one
// above, without a network: for each kind of tensor, who may send it and who may not.
func TestAdmissionRules(t *testing.T) {
	spec := testJobSpec(33)
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	stage0 := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Next: "s1",
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}}
	hosted := map[ExpertRef][]string{{1, 0}: {"e0"}, {1, 1}: {"e0", "e1"}}
	stage := newAdmission("s0", stage0, spec, nil, []string{"s1", "e0", "e1"}, hosted, nil, nil)

	host1 := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Router: "s0",
		Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 1, Experts: []int{1, 2}, StageIndex: 0, StageCount: 2}}}
	sh, err := model.NewExpertShard(spec.Model, 1, []int{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	sh.Experts.Get(1, 1).SetReplica(1)
	host := newAdmission("e1", host1, spec, sh, []string{"s0", "e0"}, nil, map[ExpertRef]string{{1, 1}: "e0"}, nil)
	params := sh.Experts.Get(1, 1).G.NumElements()

	T, C := spec.Model.BlockSize, spec.Model.NEmbd
	N := max(spec.BatchSize/spec.MicroBatches, spec.ValPassRows()) * T // the most rows a tensor may have
	st := proto.StepSpec{Step: 5, PlanVersion: 3}
	rows := func(k proto.TensorKey, n, cols int) proto.FrameHeader {
		d := proto.F32
		if k.Kind == proto.KindTokens || k.Kind == proto.KindTargets {
			d = proto.I32
		}
		return proto.FrameHeader{TensorKey: k, DType: d, Shape: proto.Shape{uint32(n), uint32(cols), 1, 1}}
	}
	ex := func(kind proto.Kind, e, mb, group int) proto.TensorKey {
		return expertKey(kind, st, ExpertRef{1, e}, mb, group)
	}
	otherPlan := gradKey(st, 0, 2)
	otherPlan.PlanVersion = 4
	tests := []struct {
		name string
		ad   *admission
		from string
		h    proto.FrameHeader
		want error // nil: admitted
	}{
		{"tokens from the coordinator", stage, "", rows(proto.TokensKey(st, 0), N/T, T), nil},
		{"targets to the first stage", stage, "", rows(proto.TargetsKey(st, 0), N/T, T), ErrUnexpectedTensor},
		{"activation from the coordinator", stage, "", rows(actKey(st, 0, 0), N, C), ErrUnexpectedTensor},
		{"tokens from a neighbour", stage, "s1", rows(proto.TokensKey(st, 0), N/T, T), ErrUnexpectedTensor},
		{"gradient from the next stage", stage, "s1", rows(gradKey(st, 0, 2), N, C), nil},
		{"gradient of the largest size", stage, "s1", rows(gradKey(st, 0, 2), N, C), nil},
		{"gradient too large", stage, "s1", rows(gradKey(st, 0, 2), N+1, C), proto.ErrTensorTooLarge},
		{"gradient for another boundary", stage, "s1", rows(gradKey(st, 0, 1), N, C), ErrUnexpectedTensor},
		{"gradient of another plan", stage, "s1", rows(otherPlan, N, C), ErrUnexpectedTensor},
		{"activation to the first stage", stage, "s1", rows(actKey(st, 0, 0), N, C), ErrUnexpectedTensor},
		{"gradient from an expert host", stage, "e0", rows(gradKey(st, 0, 2), N, C), ErrUnexpectedTensor},
		{"expert rows from their host", stage, "e0", rows(ex(proto.KindExpertOut, 0, 2, 1), 7, C), nil},
		{"replica 0's rows", stage, "e0", rows(ex(proto.KindExpertOut, 1, 2, 0), 7, C), nil},
		{"replica 1's rows from replica 0", stage, "e0", rows(ex(proto.KindExpertGradOut, 1, 2, 1), 7, C), ErrUnexpectedTensor},
		{"replica 1's rows", stage, "e1", rows(ex(proto.KindExpertGradOut, 1, 2, 1), 7, C), nil},
		{"rows of an expert the stage holds", stage, "e1", rows(ex(proto.KindExpertOut, 2, 0, 0), 7, C), ErrUnexpectedTensor},
		{"expert input to a stage", stage, "e0", rows(ex(proto.KindExpertIn, 0, 0, 0), 7, C), ErrUnexpectedTensor},
		{"partial gradient to a stage", stage, "e0", rows(partialKey(st, ExpertRef{1, 1}, 0), params, 1), ErrUnexpectedTensor},
		{"anything from outside the plan", stage, "x", rows(gradKey(st, 0, 2), N, C), ErrNotNeighbour},

		{"rows from the router", host, "s0", rows(ex(proto.KindExpertIn, 2, 0, 1), N, C), nil},
		{"gradient rows from the router", host, "s0", rows(ex(proto.KindExpertGradIn, 2, 3, 0), N, C), nil},
		{"rows of the replica's group", host, "s0", rows(ex(proto.KindExpertIn, 1, 0, 1), N, C), nil},
		{"rows of the other replica's group", host, "s0", rows(ex(proto.KindExpertIn, 1, 0, 0), N, C), ErrUnexpectedTensor},
		{"rows of an expert held elsewhere", host, "s0", rows(ex(proto.KindExpertIn, 0, 0, 0), N, C), ErrUnexpectedTensor},
		{"rows too large", host, "s0", rows(ex(proto.KindExpertIn, 2, 0, 0), N+1, C), proto.ErrTensorTooLarge},
		{"rows from the sibling", host, "e0", rows(ex(proto.KindExpertIn, 2, 0, 0), N, C), ErrUnexpectedTensor},
		{"the sibling's partial gradient", host, "e0", rows(partialKey(st, ExpertRef{1, 1}, 0), params, 1), nil},
		{"a partial gradient too large", host, "e0", rows(partialKey(st, ExpertRef{1, 1}, 0), params+1, 1), proto.ErrTensorTooLarge},
		{"this replica's own partial", host, "e0", rows(partialKey(st, ExpertRef{1, 1}, 1), params, 1), ErrUnexpectedTensor},
		{"a partial from the router", host, "s0", rows(partialKey(st, ExpertRef{1, 1}, 0), params, 1), ErrUnexpectedTensor},
		{"a partial of a whole expert", host, "e0", rows(partialKey(st, ExpertRef{1, 2}, 0), params, 1), ErrUnexpectedTensor},
		{"expert output to a host", host, "s0", rows(ex(proto.KindExpertOut, 2, 0, 0), N, C), ErrUnexpectedTensor},
		{"an activation to a host", host, "s0", rows(actKey(st, 0, 1), N, C), ErrUnexpectedTensor},
		{"tokens to a host", host, "", rows(proto.TokensKey(st, 0), N/T, T), ErrUnexpectedTensor},
		{"the stage of another block", host, "s9", rows(ex(proto.KindExpertIn, 2, 0, 0), N, C), ErrNotNeighbour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.ad.check(tt.from, tt.h)
			if tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Errorf("check(%q, %v %v) = %v, want %v", tt.from, tt.h.TensorKey, tt.h.Shape, err, tt.want)
			}
		})
	}
	// The bounds are the job's, far below proto's defaults, and the budget is one for the worker.
	if stage.lim.MaxTensorBytes != 4*N*C || host.lim.MaxTensorBytes != max(4*N*C, 4*params) {
		t.Errorf("largest tensors %d and %d, want %d and %d", stage.lim.MaxTensorBytes, host.lim.MaxTensorBytes, 4*N*C, max(4*N*C, 4*params))
	}
	if b := stage.lim.Budget; b == nil || b.Max() != 4*perSenderTensors*4*N*C || stage.lim.MaxInFlightBytes != perSenderTensors*4*N*C {
		t.Errorf("stage budget %v, per sender %d", b, stage.lim.MaxInFlightBytes)
	}
}

// TestAdmissionReplicaReduce: a stage of a replicated plan takes gradient-tree nodes only from
// the stages of other replicas its Assign names, only of tensors both hold, only the nodes of
// the sender's own micro-batches, under the sender's replica, and no larger than the tensor.
func TestAdmissionReplicaReduce(t *testing.T) {
	spec, raw := replicaJobSpec(t)
	cfg := spec.Model
	// Replica 0's first stage, blocks [0,2), micro-batches [0,3); replica 1 runs [0,1) on "r0"
	// and [1,4) on "r1", micro-batch 3.
	rep := &proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 3, Peers: []proto.ReducePeer{
		{Worker: "r0", Replica: 1, First: 3, MicroBatches: 1, Begin: 0, End: 1},
		{Worker: "r1", Replica: 1, First: 3, MicroBatches: 1, Begin: 1, End: 4},
	}}
	a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Next: "s1", Replica: rep,
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	b, err := buildShard(model.Host{}, spec, a, "s0")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.neighbours, []string{"r0", "r1", "s1"}) {
		t.Fatalf("neighbours %v", b.neighbours)
	}
	ad := newAdmission("s0", a, spec, b.sh, b.neighbours, b.hosted, b.siblings, b.links)
	index := map[string]int{}
	sizes := map[string]int{}
	for i, s := range cfg.Specs() {
		index[s.Name], sizes[s.Name] = i, s.Size()
	}
	st := proto.StepSpec{Step: 5, PlanVersion: 3}
	node := func(name string, replica, lo, hi, n int) proto.FrameHeader {
		return proto.FrameHeader{TensorKey: gradReduceKey(st, index[name], replica, lo, hi), DType: proto.F32, Shape: proto.Shape{uint32(n), 1, 1, 1}}
	}
	outer := func(name string, replica, part int, d proto.DType, rows, cols int) proto.FrameHeader {
		k := proto.OuterDeltaKey{PlanVersion: st.PlanVersion, Step: st.Step, Tensor: index[name], Replica: replica, Part: part}
		return proto.FrameHeader{TensorKey: k.Key(), DType: d, Shape: proto.Shape{uint32(rows), uint32(cols), 1, 1}}
	}
	// What DecodeFrame accepts of a signature (proto.OuterSigKey): a segment's entry, and a
	// batch's signature and leaves.
	sig := func(name string, replica int) proto.FrameHeader {
		k := proto.OuterSigKey{PlanVersion: st.PlanVersion, Step: st.Step, Tensor: index[name], Replica: replica}
		return proto.FrameHeader{TensorKey: k.Key(), DType: proto.I32, Shape: proto.Shape{proto.OuterSigEntryWords, 1, 1, 1}}
	}
	chunks := func(name string) int { return model.OuterLayout{N: sizes[name]}.Chunks() }
	batch := func(name string, replica, leaves int) proto.FrameHeader {
		k := proto.OuterSigKey{PlanVersion: st.PlanVersion, Step: st.Step, Tensor: index[name], Replica: replica, Batch: true}
		return proto.FrameHeader{TensorKey: k.Key(), DType: proto.I32, Shape: proto.Shape{uint32(16 + 8*leaves), 1, 1, 1}}
	}
	wte, h0, h1 := "transformer.wte.weight", "transformer.h.0.ln_1.weight", "transformer.h.1.ln_1.weight"
	tests := []struct {
		name string
		from string
		h    proto.FrameHeader
		want error
	}{
		{"the embedding from the other first stage", "r0", node(wte, 1, 3, 4, sizes[wte]), nil},
		{"block 0 from the other first stage", "r0", node(h0, 1, 3, 4, sizes[h0]), nil},
		{"block 1 from the stage holding it", "r1", node(h1, 1, 3, 4, sizes[h1]), nil},
		{"block 1 from a stage without it", "r0", node(h1, 1, 3, 4, sizes[h1]), ErrUnexpectedTensor},
		{"the embedding from a stage without it", "r1", node(wte, 1, 3, 4, sizes[wte]), ErrUnexpectedTensor},
		{"a tensor this stage does not hold", "r1", node("lm_head.weight", 1, 3, 4, 10), ErrUnexpectedTensor},
		{"a node of this replica's micro-batches", "r0", node(h0, 1, 0, 2, sizes[h0]), ErrUnexpectedTensor},
		{"the whole step's node", "r0", node(h0, 1, 0, 4, sizes[h0]), ErrUnexpectedTensor},
		{"under another replica's name", "r0", node(h0, 0, 3, 4, sizes[h0]), ErrUnexpectedTensor},
		// A reroute may widen a survivor's run mid-step into a lost replica's (reroute.go), never
		// into this stage's own (the two above): here, with two replicas, nothing else is left.
		{"larger than the tensor", "r0", node(h0, 1, 3, 4, sizes[h0]+1), proto.ErrTensorTooLarge},
		{"from the next stage of its own replica", "s1", node(h1, 1, 3, 4, sizes[h1]), ErrUnexpectedTensor},
		{"from the coordinator", "", node(h0, 1, 3, 4, sizes[h0]), ErrUnexpectedTensor},
		{"from outside the plan", "x", node(h0, 1, 3, 4, sizes[h0]), ErrNotNeighbour},
		// At an outer step (sync mode "outer"): a tensor both hold, from the sender's replica,
		// part 0 or 1, never more than the float32 tensor, and its signature.
		{"θ_r of the embedding at an outer step", "r0", outer(wte, 1, 0, proto.F32, sizes[wte], 1), nil},
		{"int8 chunks at an outer step", "r0", outer(wte, 1, 0, proto.I8, sizes[wte]/256, 256), nil},
		{"the last int8 chunk", "r1", outer(h1, 1, 1, proto.I8, 1, sizes[h1]), nil},
		{"an owner's average", "r0", outer(h0, 1, proto.OuterAveragePart, proto.F32, sizes[h0]/2, 1), nil},
		// Segments are a few of each of the first attempt's participants' (model.OuterOwners),
		// the plan's replicas at most: 2·OuterSegmentsPerReplica here.
		{"segment 1 of two replicas'", "r0", proto.FrameHeader{TensorKey: proto.TensorKey{Kind: proto.KindOuterDelta, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: proto.OuterParts, Block: uint32(index[h0]), Expert: 1}, DType: proto.F32, Shape: proto.Shape{uint32(sizes[h0]), 1, 1, 1}}, nil},
		{"a segment beyond two replicas'", "r0", proto.FrameHeader{TensorKey: proto.TensorKey{Kind: proto.KindOuterDelta, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: 2 * model.OuterSegmentsPerReplica * proto.OuterParts, Block: uint32(index[h0]), Expert: 1}, DType: proto.F32, Shape: proto.Shape{uint32(sizes[h0]), 1, 1, 1}}, ErrUnexpectedTensor},
		{"a signature of a segment beyond two replicas'", "r0", proto.FrameHeader{TensorKey: proto.TensorKey{Kind: proto.KindOuterSig, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: 2 * 2 * model.OuterSegmentsPerReplica, Block: uint32(index[h0]), Expert: 1}, DType: proto.I32, Shape: proto.Shape{proto.OuterSigEntryWords, 1, 1, 1}}, ErrUnexpectedTensor},
		// Its signature, from the sender of the tensor only (its dtype and size are the wire's:
		// proto's TestOuterSigFrames).
		{"the signature", "r0", sig(h0, 1), nil},
		{"the signature of the last block", "r1", sig(h1, 1), nil},
		{"a signature from a stage without the tensor", "r0", sig(h1, 1), ErrUnexpectedTensor},
		{"a signature under another replica's name", "r0", sig(h0, 0), ErrUnexpectedTensor},
		{"a signature from its own replica's next stage", "s1", sig(h1, 1), ErrUnexpectedTensor},
		{"a signature from the coordinator", "", sig(h0, 1), ErrUnexpectedTensor},
		// A leaf a segment of the tensor at most: no more than the plan's segments, nor than the
		// tensor's chunks.
		{"a batch's signature", "r0", batch(wte, 1, 2), nil},
		{"a batch of a leaf for every segment", "r0", batch(wte, 1, min(ad.segments, chunks(wte))), nil},
		{"a batch of more leaves than segments", "r0", batch(wte, 1, min(ad.segments, chunks(wte))+1), proto.ErrTensorTooLarge},
		{"a batch of a leaf for every chunk of a small tensor", "r0", batch(h0, 1, chunks(h0)), nil},
		{"a batch of more leaves than a small tensor has chunks", "r0", batch(h0, 1, chunks(h0)+1), proto.ErrTensorTooLarge},
		{"a batch's signature from a stage without the tensor", "r0", batch(h1, 1, 1), ErrUnexpectedTensor},
		{"under another replica's name at an outer step", "r0", outer(h0, 0, 0, proto.F32, sizes[h0], 1), ErrUnexpectedTensor},
		{"a tensor the sender does not hold, at an outer step", "r0", outer(h1, 1, 0, proto.F32, sizes[h1], 1), ErrUnexpectedTensor},
		{"more than the tensor at an outer step", "r0", outer(h0, 1, 0, proto.F32, sizes[h0]+1, 1), proto.ErrTensorTooLarge},
		{"an outer step's part from its own replica's next stage", "s1", outer(h1, 1, 0, proto.F32, sizes[h1], 1), ErrUnexpectedTensor},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ad.check(tt.from, tt.h)
			if tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Errorf("check(%q, %v %v) = %v, want %v", tt.from, tt.h.TensorKey, tt.h.Shape, err, tt.want)
			}
		})
	}
	// A replica's Assign must not name peers that share nothing (the shard is refused before
	// it is built), or its own replica.
	bad := *a
	bad.Replica = &proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 3,
		Peers: []proto.ReducePeer{{Worker: "r9", Replica: 1, First: 3, MicroBatches: 1, Begin: 2, End: 3}}}
	if err := bad.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := buildShard(model.Host{}, spec, &bad, "s0"); err == nil {
		t.Error("a reduce peer sharing no tensor was accepted")
	}
	bad.Replica = &proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 3,
		Peers: []proto.ReducePeer{{Worker: "r0", Replica: 0, First: 3, MicroBatches: 1, Begin: 0, End: 1}}}
	if err := bad.Validate(); err == nil {
		t.Error("a reduce peer of the stage's own replica was accepted")
	}
	// Micro-batches outside the job are refused when the shard is built, before anything is
	// allocated for them.
	far := *a
	far.Replica = &proto.ReplicaAssign{Index: 0, Count: 2, First: 2, MicroBatches: 3, Peers: rep.Peers}
	if _, err := buildShard(model.Host{}, spec, &far, "s0"); err == nil {
		t.Error("a replica past the job's micro-batches was built")
	}
}

// TestAdmissionHandover: a stage taking up its state from a twin (Assign.From) accepts each state
// tensor only from that twin, at the handover's step, no larger than the shard's own tensor;
// nobody else may send one, and a stage not taking up state accepts none; a giver outside the plan
// (a standby's handover) likewise. With several givers each tensor comes only from the giver of
// its block. A handover with a giver or a taker that holds other blocks is refused before
// anything is built.
func TestAdmissionHandover(t *testing.T) {
	spec, raw := replicaJobSpec(t)
	L := spec.Model.NLayer
	rep := &proto.ReplicaAssign{Index: 1, Count: 3, First: 2, MicroBatches: 1, Peers: []proto.ReducePeer{
		{Worker: "a", Replica: 0, First: 0, MicroBatches: 2, Begin: 0, End: L},
		{Worker: "c", Replica: 2, First: 3, MicroBatches: 1, Begin: 0, End: L},
	}}
	a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 7, Replica: rep, ExpertHosts: []proto.ExpertHost{},
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: L, First: true, Last: true}},
		From:  []proto.Handover{{Worker: "a", FromPlan: 6, Step: 40, Begin: 0, End: L}}}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := checkHandover(spec, a); err != nil {
		t.Fatal(err)
	}
	b, err := buildShard(model.Host{}, spec, a, "b")
	if err != nil {
		t.Fatal(err)
	}
	ad := newAdmission("b", a, spec, b.sh, b.neighbours, b.hosted, b.siblings, b.links)
	state := handoverTensors(b.sh, nil)
	nums, blocks, err := handoverNumbers(spec, b.sh)
	if err != nil {
		t.Fatal(err)
	}
	// h is the header of state tensor i (handoverTensors' order; past them, a number no tensor
	// of the model has).
	h := func(step uint64, i, n int, d proto.DType) proto.FrameHeader {
		k := 3 * len(spec.Model.Specs())
		if i < len(nums) {
			k = nums[i]
		}
		return proto.FrameHeader{TensorKey: stateKey(7, step, k), DType: d, Shape: proto.Shape{uint32(n), 1, 1, 1}}
	}
	last := len(state) - 1
	tests := []struct {
		name string
		from string
		h    proto.FrameHeader
		want error
	}{
		{"the first tensor from the giver", "a", h(40, 0, len(state[0].Data), proto.F32), nil},
		{"the last moment from the giver", "a", h(40, last, len(state[last].Data), proto.F32), nil},
		{"from the other twin", "c", h(40, 0, len(state[0].Data), proto.F32), ErrUnexpectedTensor},
		{"from the coordinator", "", h(40, 0, len(state[0].Data), proto.F32), ErrUnexpectedTensor},
		{"from outside the plan", "x", h(40, 0, len(state[0].Data), proto.F32), ErrNotNeighbour},
		{"of another step", "a", h(41, 0, len(state[0].Data), proto.F32), ErrUnexpectedTensor},
		{"past the state's tensors", "a", h(40, last+1, 1, proto.F32), ErrUnexpectedTensor},
		{"larger than the tensor", "a", h(40, 0, len(state[0].Data)+1, proto.F32), proto.ErrTensorTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ad.check(tt.from, tt.h)
			if tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Errorf("check(%q, %v %v) = %v, want %v", tt.from, tt.h.TensorKey, tt.h.Shape, err, tt.want)
			}
		})
	}
	// The giver's own admission takes no state: it gives.
	give := *a
	give.From, give.Keep, give.Give = nil, &proto.Keep{FromPlan: 6, Step: 40}, []proto.Gift{{Worker: "c", Begin: 0, End: L}}
	if err := checkHandover(spec, &give); err != nil {
		t.Fatal(err)
	}
	gb, err := buildShard(model.Host{}, spec, &give, "b")
	if err != nil {
		t.Fatal(err)
	}
	gad := newAdmission("b", &give, spec, gb.sh, gb.neighbours, gb.hosted, gb.siblings, gb.links)
	if err := gad.check("a", h(40, 0, len(state[0].Data), proto.F32)); !errors.Is(err, ErrUnexpectedTensor) {
		t.Errorf("a giver admitted a state tensor: %v", err)
	}
	// A giver outside the plan is a holder the plan left out, handing its stage over before it
	// stands by (proto.Assign.Standby): the state comes from it alone, not from the twin.
	stranger := *a
	stranger.From = []proto.Handover{{Worker: "x", FromPlan: 6, Step: 40, Begin: 0, End: L}}
	if err := checkHandover(spec, &stranger); err != nil {
		t.Fatalf("a handover from a standby giver: %v", err)
	}
	sb, err := buildShard(model.Host{}, spec, &stranger, "b")
	if err != nil {
		t.Fatal(err)
	}
	sad := newAdmission("b", &stranger, spec, sb.sh, sb.neighbours, sb.hosted, sb.siblings, sb.links)
	if err := sad.check("x", h(40, 0, len(state[0].Data), proto.F32)); err != nil {
		t.Errorf("the standby giver's state refused: %v", err)
	}
	if err := sad.check("a", h(40, 0, len(state[0].Data), proto.F32)); !errors.Is(err, ErrUnexpectedTensor) {
		t.Errorf("state from the twin that is not the giver: %v, want ErrUnexpectedTensor", err)
	}
	// Two givers, the first block from the standby x and the rest from the twin a: each tensor
	// from the giver of its block only.
	split := *a
	split.From = []proto.Handover{{Worker: "x", FromPlan: 6, Step: 40, Begin: 0, End: 1}, {Worker: "a", FromPlan: 6, Step: 40, Begin: 1, End: L}}
	if err := split.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := checkHandover(spec, &split); err != nil {
		t.Fatalf("a handover from two givers: %v", err)
	}
	xb, err := buildShard(model.Host{}, spec, &split, "b")
	if err != nil {
		t.Fatal(err)
	}
	xad := newAdmission("b", &split, spec, xb.sh, xb.neighbours, xb.hosted, xb.siblings, xb.links)
	firsts, rests := 0, 0
	for i := range state {
		giver, other := "a", "x"
		if blocks[i] == 0 {
			giver, other = "x", "a"
			firsts++
		} else {
			rests++
		}
		if err := xad.check(giver, h(40, i, len(state[i].Data), proto.F32)); err != nil {
			t.Fatalf("tensor %d (%s, block %d) from its giver %s: %v", i, state[i].Name, blocks[i], giver, err)
		}
		if err := xad.check(other, h(40, i, len(state[i].Data), proto.F32)); !errors.Is(err, ErrUnexpectedTensor) {
			t.Fatalf("tensor %d (%s, block %d) from %s, which does not give it: %v, want ErrUnexpectedTensor", i, state[i].Name, blocks[i], other, err)
		}
	}
	if firsts == 0 || rests == 0 {
		t.Fatalf("%d tensors of block 0 and %d of the others: the test shows nothing", firsts, rests)
	}
	// Twins only otherwise: a giver or taker of the plan holding other blocks is refused.
	other := *a
	other.Replica = &proto.ReplicaAssign{Index: 1, Count: 2, First: 2, MicroBatches: 2, Peers: []proto.ReducePeer{
		{Worker: "a", Replica: 0, First: 0, MicroBatches: 2, Begin: 0, End: 1}}}
	if err := checkHandover(spec, &other); err == nil {
		t.Error("a handover from a stage of other blocks was accepted")
	}
	// In outer mode a handover carries the global θ and the outer momentum: two of the stage's
	// parameter tensors each, no more (handoverSizes), from the giver alone.
	outer := spec
	outer.Sync = &job.Sync{Mode: "outer", Every: 2}
	if err := checkHandover(outer, a); err != nil {
		t.Fatalf("a handover of the global θ in outer mode: %v", err)
	}
	oad := newAdmission("b", a, outer, b.sh, b.neighbours, b.hosted, b.siblings, b.links)
	np := len(b.sh.P.Tensors)
	if n := len(handoverSizes(outer, b.sh)); n != 2*np {
		t.Fatalf("an outer handover of %d tensors, want %d", n, 2*np)
	}
	oh := func(i, n int) proto.FrameHeader { return h(40, i, n, proto.F32) }
	lastP := b.sh.P.Tensors[np-1]
	for _, tt := range []struct {
		name string
		from string
		h    proto.FrameHeader
		want error
	}{
		{"the last momentum tensor", "a", oh(2*np-1, len(lastP.Data)), nil},
		{"past the momentum", "a", oh(2*np, 1), ErrUnexpectedTensor},
		{"from the other twin", "c", oh(0, len(b.sh.P.Tensors[0].Data)), ErrUnexpectedTensor},
		{"larger than the tensor", "a", oh(0, len(b.sh.P.Tensors[0].Data)+1), proto.ErrTensorTooLarge},
	} {
		if err := oad.check(tt.from, tt.h); tt.want == nil && err != nil || !errors.Is(err, tt.want) {
			t.Errorf("outer: %s: check = %v, want %v", tt.name, err, tt.want)
		}
	}
}

// TestAdmissionExpertHostRouters: an expert host of a plan of pipeline replicas takes each
// micro-batch's rows only from the stage of the replica computing it (an evaluation's from the
// first replica's), and a replica's stage takes no gradient-tree node of an expert that lives on
// the host: nobody but the host holds it.
func TestAdmissionExpertHostRouters(t *testing.T) {
	spec := testJobSpec(35)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	routers := []proto.ExpertRouter{
		{Worker: "a1", Replica: 0, StageIndex: 1, StageCount: 2, First: 0, MicroBatches: 3, Depth: 1},
		{Worker: "b1", Replica: 1, StageIndex: 0, StageCount: 1, First: 3, MicroBatches: 1},
	}
	a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Routers: routers,
		Shard: proto.Shard{Experts: &proto.ExpertShard{Block: 3, Experts: []int{0, 2}, StageIndex: 1, StageCount: 2}}}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	b, err := buildShard(model.Host{}, spec, a, "h")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.neighbours, []string{"a1", "b1"}) {
		t.Fatalf("neighbours %v", b.neighbours)
	}
	host := newAdmission("h", a, spec, b.sh, b.neighbours, b.hosted, b.siblings, b.links)
	// Routers that leave micro-batches out, or in outer mode, are refused before anything is built.
	short := *a
	short.Routers = routers[:1]
	if _, err := buildShard(model.Host{}, spec, &short, "h"); err == nil {
		t.Error("routers covering micro-batches [0,3) of 4 accepted")
	}
	outer := spec
	outer.Sync = &job.Sync{Mode: job.SyncOuter, Every: 2, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	if _, err := buildShard(model.Host{}, outer, a, "h"); err == nil {
		t.Error("an expert host of replicas in outer mode accepted")
	}

	// Replica 1's one stage, whose block 3 experts 0 and 2 are on the host.
	stageA := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3,
		Shard:       proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}},
		ExpertHosts: []proto.ExpertHost{{Block: 3, Expert: 0, Workers: []string{"h"}}, {Block: 3, Expert: 2, Workers: []string{"h"}}},
		Replica: &proto.ReplicaAssign{Index: 1, Count: 2, First: 3, MicroBatches: 1, Peers: []proto.ReducePeer{
			{Worker: "a1", Replica: 0, First: 0, MicroBatches: 3, Begin: 2, End: 4}}}}
	if err := stageA.Validate(); err != nil {
		t.Fatal(err)
	}
	bs, err := buildShard(model.Host{}, spec, stageA, "b1")
	if err != nil {
		t.Fatal(err)
	}
	stage := newAdmission("b1", stageA, spec, bs.sh, bs.neighbours, bs.hosted, bs.siblings, bs.links)
	index := map[string]int{}
	sizes := map[string]int{}
	for i, s := range spec.Model.Specs() {
		index[s.Name], sizes[s.Name] = i, s.Size()
	}

	C := spec.Model.NEmbd
	st := proto.StepSpec{Step: 5, PlanVersion: 3}
	ev := proto.StepSpec{Step: proto.EvalStep(5), PlanVersion: 3}
	rows := func(k proto.TensorKey) proto.FrameHeader {
		return proto.FrameHeader{TensorKey: k, DType: proto.F32, Shape: proto.Shape{7, uint32(C), 1, 1}}
	}
	in := func(s proto.StepSpec, kind proto.Kind, mb int) proto.FrameHeader {
		return rows(expertKey(kind, s, ExpertRef{3, 2}, mb, 1))
	}
	node := func(name string, lo, hi int) proto.FrameHeader {
		if _, ok := index[name]; !ok {
			t.Fatalf("no tensor %s in the model", name)
		}
		return proto.FrameHeader{TensorKey: gradReduceKey(st, index[name], 0, lo, hi), DType: proto.F32, Shape: proto.Shape{uint32(sizes[name]), 1, 1, 1}}
	}
	tests := []admitCase{
		{"replica 0's micro-batch from its stage", host, "a1", in(st, proto.KindExpertIn, 0), nil},
		{"replica 0's last micro-batch", host, "a1", in(st, proto.KindExpertGradIn, 2), nil},
		{"replica 1's micro-batch from its stage", host, "b1", in(st, proto.KindExpertIn, 3), nil},
		{"replica 1's micro-batch from replica 0", host, "a1", in(st, proto.KindExpertIn, 3), ErrUnexpectedTensor},
		{"replica 0's micro-batch from replica 1", host, "b1", in(st, proto.KindExpertGradIn, 0), ErrUnexpectedTensor},
		{"a micro-batch past the step's", host, "b1", in(st, proto.KindExpertIn, 4), ErrUnexpectedTensor},
		{"an evaluation from the first replica", host, "a1", in(ev, proto.KindExpertIn, 5), nil},
		{"an evaluation from the second", host, "b1", in(ev, proto.KindExpertIn, 0), ErrUnexpectedTensor},
		{"from outside the plan", host, "x", in(st, proto.KindExpertIn, 0), ErrNotNeighbour},
		{"a node of a block the stages share", stage, "a1", node("transformer.h.3.ln_1.weight", 0, 2), nil},
		{"a node of the router, held by both", stage, "a1", node("transformer.h.3.mlp.router.weight", 0, 2), nil},
		{"a node of an expert on the host", stage, "a1", node("transformer.h.3.mlp.experts.2.c_fc.weight", 0, 2), ErrUnexpectedTensor},
		{"a node of an expert both hold", stage, "a1", node("transformer.h.3.mlp.experts.1.c_fc.weight", 0, 2), nil},
	}
	checkAdmits(t, tests)
}

// TestAdmissionStagePools: in step mode a stage admits, besides its own neighbours, the stages
// beside its blocks in the other replicas (proto.ReplicaAssign.PrevPool, NextPool) — a stage
// takeover's taker, or the lost stage's neighbours when this stage is the taker — and from them
// only the boundary tensors its own neighbour would send: no gradient nodes, no tokens, no
// activation of another block. Their copies of what it holds already are dropped, not refused
// (admission.pooled: Mailbox.DeliverOnce). An Assign naming as many pool workers as replicas is
// refused.
func TestAdmissionStagePools(t *testing.T) {
	spec, raw := replicaJobSpec(t)
	cfg := spec.Model
	T, C := cfg.BlockSize, cfg.NEmbd
	N := spec.BatchSize / spec.MicroBatches * T
	st := proto.StepSpec{Step: 5, PlanVersion: 3}
	act := func(block int) proto.FrameHeader {
		return proto.FrameHeader{TensorKey: actKey(st, 1, block), DType: proto.F32, Shape: proto.Shape{uint32(N), uint32(C), 1, 1}}
	}
	grad := func(block int) proto.FrameHeader {
		return proto.FrameHeader{TensorKey: gradKey(st, 1, block), DType: proto.F32, Shape: proto.Shape{uint32(N), uint32(C), 1, 1}}
	}
	build := func(me string, stage *proto.StageShard, prev, next string, rep *proto.ReplicaAssign) *admission {
		a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Prev: prev, Next: next, Replica: rep, Shard: proto.Shard{Stage: stage}}
		if err := a.Validate(); err != nil {
			t.Fatal(err)
		}
		b, err := buildShard(model.Host{}, spec, a, me)
		if err != nil {
			t.Fatal(err)
		}
		return newAdmission(me, a, spec, b.sh, b.neighbours, b.hosted, b.siblings, b.links)
	}
	// Two replicas of two stages, [0,2) and [2,4): replica 0 is s0, s1; replica 1 is p0, p1.
	first := build("s0", &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}, "", "s1",
		&proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, NextPool: []string{"p1"},
			Peers: []proto.ReducePeer{{Worker: "p0", Replica: 1, First: 2, MicroBatches: 2, Begin: 0, End: 2}}})
	last := build("s1", &proto.StageShard{Index: 1, Count: 2, Begin: 2, End: 4, Last: true}, "s0", "",
		&proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, PrevPool: []string{"p0"},
			Peers: []proto.ReducePeer{{Worker: "p1", Replica: 1, First: 2, MicroBatches: 2, Begin: 2, End: 4}}})
	index := map[string]int{}
	for i, s := range cfg.Specs() {
		index[s.Name] = i
	}
	node := proto.FrameHeader{TensorKey: gradReduceKey(st, index["transformer.h.0.ln_1.weight"], 1, 2, 4), DType: proto.F32, Shape: proto.Shape{uint32(C), 1, 1, 1}}
	tests := []admitCase{
		{"the gradient from the next stage's pool", first, "p1", grad(2), nil},
		{"the gradient from the next stage", first, "s1", grad(2), nil},
		{"an activation from the next stage's pool", first, "p1", act(0), ErrUnexpectedTensor},
		{"a gradient of another block from the pool", first, "p1", grad(3), ErrUnexpectedTensor},
		{"a gradient node from the next stage's pool", first, "p1", node, ErrUnexpectedTensor},
		{"tokens from the next stage's pool", first, "p1", proto.FrameHeader{TensorKey: proto.TokensKey(st, 1), DType: proto.I32, Shape: proto.Shape{uint32(N / T), uint32(T), 1, 1}}, ErrUnexpectedTensor},
		{"the gradient from outside the pools", first, "x", grad(2), ErrNotNeighbour},
		{"the activation from the previous stage's pool", last, "p0", act(2), nil},
		{"the activation from the previous stage", last, "s0", act(2), nil},
		{"a gradient from the previous stage's pool", last, "p0", grad(4), ErrUnexpectedTensor},
		{"the activation from the own pool's mate", last, "p1", act(2), ErrUnexpectedTensor},
	}
	checkAdmits(t, tests)
	if !first.pooled("p1") || first.pooled("s1") || first.pooled("p0") || first.pooled("") {
		t.Error("pooled: only a pool's worker sends copies to drop")
	}
	bad := proto.ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, NextPool: []string{"p1", "p2"}}
	a := &proto.Assign{Job: "j", Spec: raw, PlanVersion: 3, Next: "s1", Replica: &bad,
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}}}
	if err := a.Validate(); err == nil {
		t.Error("a pool of as many workers as replicas was accepted")
	}
}

// replicaJobSpec is the job of the admission tests of replicated plans — 8 sequences a step in 4
// micro-batches — and its JSON, as an Assign carries it.
func replicaJobSpec(t *testing.T) (job.Spec, []byte) {
	t.Helper()
	spec := testJobSpec(34)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	return spec, raw
}

// admitCase is a tensor header some sender sends a stage (ad), and whether it is admitted: nil,
// or the error it is refused with.
type admitCase struct {
	name string
	ad   *admission
	from string
	h    proto.FrameHeader
	want error
}

// checkAdmits runs the admission cases tests.
func checkAdmits(t *testing.T, tests []admitCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.ad.check(tt.from, tt.h)
			if tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Errorf("check(%q, %v %v) = %v, want %v", tt.from, tt.h.TensorKey, tt.h.Shape, err, tt.want)
			}
		})
	}
}
