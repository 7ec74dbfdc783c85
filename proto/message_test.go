package proto

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

// sampleMessages is one valid message of every type, with the role that sends it; the fuzz seed
// corpus is built from these too.
func sampleMessages() []struct {
	name string
	from Role
	msg  Message
} {
	spec := json.RawMessage(`{"model":{"n_layer":4},"seed":1,"micro_batches":4}`)
	return []struct {
		name string
		from Role
		msg  Message
	}{
		{"hello", RoleWorker, &Hello{Kind: WorkerNative, Backend: BackendCPU, GFLOPS: 41.5,
			MemoryBytes: 8 << 30, Threads: 8, LinkBytesPerS: 12.5e6, Name: "box-1", SigningKey: make([]byte, SigningKeySize)}},
		{"hello-vulkan", RoleWorker, &Hello{Kind: WorkerNative, Backend: BackendVulkan, GFLOPS: 9000, Kernels: KernelsVulkan,
			MemoryBytes: 80 << 30, Threads: 16, Name: "gpu-box", Device: "NVIDIA H200"}},
		{"hello-browser-rejoin", RoleWorker, &Hello{Kind: WorkerBrowser, Backend: BackendWebGPU, GFLOPS: 0.7,
			MemoryBytes: 1 << 30, Threads: 1, Name: "Chromium 131", WorkerID: "w-17"}},
		{"welcome", RoleCoordinator, &Welcome{WorkerID: "w-17", HeartbeatMS: 2000, Session: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ",
			ICEServers: []ICEServer{{URLs: []string{"stun:stun.example.org:3478"}},
				{URLs: []string{"turn:turn.example.org"}, Username: "u", Credential: "c"}}}},
		{"welcome-relay-only", RoleCoordinator, &Welcome{WorkerID: "w-2", HeartbeatMS: 500, Loopback: true, ICERelayOnly: true, Session: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO-_",
			ICEServers: []ICEServer{{URLs: []string{"turn:127.0.0.1:3478?transport=udp"}, Username: "1767225600:w-2", Credential: "c"}}}},
		{"welcome-loopback", RoleCoordinator, &Welcome{WorkerID: "w-1", HeartbeatMS: 500, ICEServers: []ICEServer{}, Loopback: true, Session: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO-_"}},
		{"assign-first-stage", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 3,
			Shard: Shard{Stage: &StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}},
			Next:  "w-2", ExpertHosts: []ExpertHost{}}},
		{"assign-last-stage-restore", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 3,
			Shard: Shard{Stage: &StageShard{Index: 1, Count: 2, Begin: 2, End: 4, Last: true}},
			Prev:  "w-1", ExpertHosts: []ExpertHost{{Block: 3, Expert: 1, Workers: []string{"w-9", "w-10"}}},
			Restore: &CheckpointRef{Step: 100, Blobs: []string{strings.Repeat("ab", 32), strings.Repeat("cd", 32)}}}},
		{"assign-experts", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 4,
			Shard:  Shard{Experts: &ExpertShard{Block: 1, Experts: []int{0, 2, 3}, StageIndex: 0, StageCount: 2}},
			Router: "w-1"}},
		{"assign-experts-replicas", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 6,
			Shard: Shard{Experts: &ExpertShard{Block: 1, Experts: []int{0, 1}, StageIndex: 0, StageCount: 2}},
			Routers: []ExpertRouter{{Worker: "w-1", Replica: 0, StageIndex: 0, StageCount: 2, First: 0, MicroBatches: 2, Depth: 1},
				{Worker: "w-3", Replica: 1, StageIndex: 0, StageCount: 1, First: 2, MicroBatches: 2}}}},
		{"assign-depth", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 5,
			Shard: Shard{Stage: &StageShard{Index: 0, Count: 2, Begin: 0, End: 2, First: true}},
			Next:  "w-2", ExpertHosts: []ExpertHost{}, Depth: 3}},
		{"assign-keep-give", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 7,
			Shard:       Shard{Stage: &StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}},
			ExpertHosts: []ExpertHost{}, Keep: &Keep{FromPlan: 6, Step: 40}, Give: []Gift{{Worker: "w-5", Begin: 0, End: 4}, {Worker: "w-6", Begin: 2, End: 4}},
			Replica: &ReplicaAssign{Index: 0, Count: 2, First: 0, MicroBatches: 2, Peers: []ReducePeer{{Worker: "w-5", Replica: 1, First: 2, MicroBatches: 2, Begin: 0, End: 4}}}}},
		{"assign-from", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 7,
			Shard:       Shard{Stage: &StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}},
			ExpertHosts: []ExpertHost{}, From: []Handover{{Worker: "w-1", FromPlan: 6, Step: 40, Begin: 0, End: 4}}}},
		{"assign-from-two", RoleCoordinator, &Assign{Job: "job-1", Spec: spec, PlanVersion: 7,
			Shard:       Shard{Stage: &StageShard{Index: 0, Count: 1, Begin: 0, End: 4, First: true, Last: true}},
			ExpertHosts: []ExpertHost{}, From: []Handover{{Worker: "w-1", FromPlan: 6, Step: 40, Begin: 0, End: 1}, {Worker: "w-2", FromPlan: 5, Step: 40, Begin: 1, End: 4}}}},
		{"signal-offer", RoleWorker, &Signal{From: "w-1", To: "w-2", PlanVersion: 3,
			SDP: &SessionDescription{Type: "offer", SDP: "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\n"}}},
		{"signal-candidate", RoleCoordinator, &Signal{From: "w-2", To: "w-1", PlanVersion: 3,
			Candidate: &ICECandidate{Candidate: "candidate:1 1 udp 2130706431 127.0.0.1 50000 typ host",
				SDPMid: ptr("0"), SDPMLineIndex: ptr(uint16(0))}}},
		{"signal-offer-quic", RoleWorker, &Signal{From: "w-1", To: "w-2", PlanVersion: 3,
			SDP:  &SessionDescription{Type: "answer", SDP: "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\n"},
			QUIC: strings.Repeat("0f", 32)}},
		{"signal-end-of-candidates", RoleWorker, &Signal{From: "w-1", To: "w-2", Candidate: &ICECandidate{}}},
		{"step-open", RoleCoordinator, &StepOpen{Step: 7, PlanVersion: 3, LR: 6e-4, MicroBatches: 4, DeadlineMS: 60000, Rows: 4}},
		{"step-open-eval", RoleCoordinator, &StepOpen{Step: 50, PlanVersion: 3, MicroBatches: 2, DeadlineMS: 60000, Rows: 16, Eval: true}},
		{"ready", RoleWorker, &Ready{PlanVersion: 3}},
		{"ready-gave-sums", RoleWorker, &Ready{PlanVersion: 3, State: EncodeDigest(make([]byte, 32)), Gave: EncodeDigest(make([]byte, 32)),
			Sums: []KeyDigest{{Key: "transformer.wte.weight", Digest: EncodeDigest(make([]byte, 32))}, {Key: "optim.m.transformer.wte.weight", Digest: EncodeDigest(make([]byte, 32))}}}},
		{"checkpoint", RoleCoordinator, &Checkpoint{ID: 4, Step: 100, Shard: "stage-0", UploadPath: "/api/checkpoints/4/shards/stage-0"}},
		{"step-report", RoleWorker, &StepReport{Step: 7, PlanVersion: 3,
			GradSq:  map[string]float64{"transformer.h.2.ln_1.weight": 1.25e-3, "lm_head.weight": 0.1 + 0.2},
			CE:      []float64{5.54, 5.51, 5.49, 5.50},
			Aux:     []BlockAux{{Block: 3, Aux: []float64{1.01, 1.02, 1.0, 1.03}}},
			Timings: Timings{ForwardNS: 1e8, BackwardNS: 2e8, WaitNS: 5e7, TotalNS: 4e8}}},
		{"clip", RoleCoordinator, &Clip{Step: 7, PlanVersion: 3, Factor: 0.5}},
		{"audit-lean", RoleCoordinator, &Audit{Step: 7, PlanVersion: 3, UploadPath: "/api/audits/4", Lean: true}},
		{"audit-thin", RoleCoordinator, &Audit{Step: 7, PlanVersion: 3, UploadPath: "/api/audits/4", Lean: true, Sample: 0x9e3779b97f4a7c15}},
		{"audit-thin-whole", RoleCoordinator, &Audit{Step: 7, PlanVersion: 3, UploadPath: "/api/audits/4", Sample: 3}},
		{"heartbeat", RoleWorker, &Heartbeat{Seq: 12}},
		{"heartbeat-ack", RoleCoordinator, &Heartbeat{Seq: 12, Ack: true}},
		{"error", RoleWorker, &Error{Code: ErrCodeNonFinite, Message: "lm_head.weight: gradient is NaN", Step: ptr(uint64(7))}},
		{"error-plan", RoleWorker, &Error{Code: ErrCodeStep, Message: "neighbour w-2: data channel closed", PlanVersion: 3}},
		{"error-outer-refused", RoleWorker, &Error{Code: ErrCodeOuterRefused, Message: "refused replica 1's contribution", PlanVersion: 3, Accused: ptr(uint32(1))}},
		{"error-outer-evidence", RoleWorker, &Error{Code: ErrCodeOuterRefused, Message: "refused replica 1's contribution", PlanVersion: 3, Accused: ptr(uint32(1)),
			Step: ptr(uint64(19)), Evidence: goodEvidence()}},
		{"bye", RoleWorker, &Bye{Reason: "SIGTERM: draining"}},
		{"leaving", RoleWorker, &Leaving{Reason: "SIGTERM"}},
	}
}

// TestAssignHandoverRefused: a handover names an earlier plan and a worker, never with a restore
// or a keep, never for an expert shard; only a kept stage gives, to a bounded list of workers named
// once each.
func TestAssignHandoverRefused(t *testing.T) {
	spec := json.RawMessage(`{"steps":1}`)
	stage := Shard{Stage: &StageShard{Index: 0, Count: 1, Begin: 0, End: 2, First: true, Last: true}}
	from := func(f func(a *Assign)) *Assign {
		a := &Assign{Job: "job-1", Spec: spec, PlanVersion: 5, Shard: stage, ExpertHosts: []ExpertHost{}, From: []Handover{{Worker: "w-1", FromPlan: 4, Step: 9, Begin: 0, End: 2}}}
		f(a)
		return a
	}
	many := make([]Gift, MaxGive+1)
	for i := range many {
		many[i] = Gift{Worker: fmt.Sprintf("w-%d", i), Begin: 0, End: 2}
	}
	two := func(f func(a *Assign)) *Assign {
		return from(func(a *Assign) {
			a.From = []Handover{{Worker: "w-1", FromPlan: 4, Step: 9, Begin: 0, End: 1}, {Worker: "w-2", FromPlan: 4, Step: 9, Begin: 1, End: 2}}
			f(a)
		})
	}
	give := func(gs ...Gift) func(a *Assign) {
		return func(a *Assign) { a.From, a.Keep, a.Give = nil, &Keep{FromPlan: 4, Step: 9}, gs }
	}
	tests := []struct {
		name string
		a    *Assign
		want string
	}{
		{"from a later plan", from(func(a *Assign) { a.From[0].FromPlan = 5 }), "want an earlier plan"},
		{"from plan 0", from(func(a *Assign) { a.From[0].FromPlan = 0 }), "want an earlier plan"},
		{"from nobody", from(func(a *Assign) { a.From[0].Worker = "" }), "from.worker"},
		// Several givers: the stage's blocks in order, each once, all at one step.
		{"from a gap", two(func(a *Assign) { a.From[1].Begin = 2 }), "want its blocks in order"},
		{"from overlapping", two(func(a *Assign) { a.From[0].End = 2 }), "want its blocks in order"},
		{"from out of order", two(func(a *Assign) { a.From[0], a.From[1] = a.From[1], a.From[0] }), "want its blocks in order"},
		{"from short", two(func(a *Assign) { a.From = a.From[:1] }), "want all of them"},
		{"from past the stage", from(func(a *Assign) { a.From[0].End = 3 }), "want its blocks in order"},
		{"from no blocks", two(func(a *Assign) { a.From[0].End = 0 }), "want its blocks in order"},
		{"from one giver twice", two(func(a *Assign) { a.From[1].Worker = "w-1" }), `"w-1" twice`},
		{"from two steps", two(func(a *Assign) { a.From[1].Step = 10 }), "want one step"},
		{"from with a restore", from(func(a *Assign) { a.Restore = &CheckpointRef{Step: 9, Blobs: []string{strings.Repeat("ab", 32)}} }), "a handover with a restore"},
		{"from with a keep", from(func(a *Assign) { a.Keep = &Keep{FromPlan: 4, Step: 9} }), "a handover with a restore"},
		// A restore names the checkpoint's shards the stage reads: some, each once, each a sha256.
		{"restore from no blob", from(func(a *Assign) { a.From, a.Restore = nil, &CheckpointRef{Step: 9} }), "restore.blobs"},
		{"restore from a blob twice", from(func(a *Assign) {
			a.From, a.Restore = nil, &CheckpointRef{Step: 9, Blobs: []string{strings.Repeat("ab", 32), strings.Repeat("ab", 32)}}
		}), "listed twice"},
		{"restore from a name not a sha256", from(func(a *Assign) {
			a.From, a.Restore = nil, &CheckpointRef{Step: 9, Blobs: []string{strings.Repeat("AB", 32)}}
		}), "not a lowercase hex sha256"},
		{"restore from too many blobs", from(func(a *Assign) {
			bs := make([]string, MaxRestoreBlobs+1)
			for i := range bs {
				bs[i] = fmt.Sprintf("%064x", i)
			}
			a.From, a.Restore = nil, &CheckpointRef{Step: 9, Blobs: bs}
		}), "want 1 to 1024"},
		{"from for experts", from(func(a *Assign) {
			a.Shard = Shard{Experts: &ExpertShard{Block: 1, Experts: []int{0}, StageIndex: 0, StageCount: 1}}
			a.Router, a.ExpertHosts = "w-2", nil
		}), "for an expert shard"},
		{"give without a keep", from(func(a *Assign) { a.From, a.Give = nil, []Gift{{Worker: "w-2", Begin: 0, End: 2}} }), "give"},
		{"give twice to one", from(give(Gift{Worker: "w-2", Begin: 0, End: 1}, Gift{Worker: "w-2", Begin: 1, End: 2})), `"w-2" twice`},
		{"give to too many", from(give(many...)), "at most 64"},
		{"give blocks it does not keep", from(give(Gift{Worker: "w-2", Begin: 1, End: 3})), "blocks [1, 3)"},
		{"give no blocks", from(give(Gift{Worker: "w-2", Begin: 1, End: 1})), "blocks [1, 1)"},
		// A standby hands over the stage it keeps and runs none: nothing else may come with it.
		{"standby giving nothing", from(func(a *Assign) { a.From, a.Keep, a.Standby = nil, &Keep{FromPlan: 4, Step: 9}, true }), "standby"},
		{"standby taking", from(func(a *Assign) { a.Standby = true }), "standby"},
		{"standby with a neighbour", from(func(a *Assign) {
			a.From, a.Keep, a.Give, a.Standby, a.Next = nil, &Keep{FromPlan: 4, Step: 9}, []Gift{{Worker: "w-2", Begin: 0, End: 2}}, true, "w-3"
		}), "standby"},
		{"standby in a replica", from(func(a *Assign) {
			a.From, a.Keep, a.Give, a.Standby = nil, &Keep{FromPlan: 4, Step: 9}, []Gift{{Worker: "w-2", Begin: 0, End: 2}}, true
			a.Replica = &ReplicaAssign{Index: 0, Count: 2, MicroBatches: 1}
		}), "standby"},
		{"standby of experts", from(func(a *Assign) {
			a.From, a.Keep, a.Give, a.Standby = nil, &Keep{FromPlan: 4, Step: 9}, []Gift{{Worker: "w-2", Begin: 0, End: 2}}, true
			a.Shard = Shard{Experts: &ExpertShard{Block: 1, Experts: []int{0}, StageIndex: 0, StageCount: 1}}
			a.Router, a.ExpertHosts = "w-2", nil
		}), "standby"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.a.Validate()
			if err == nil || !errors.Is(err, ErrBadMessage) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want ErrBadMessage with %q", err, tt.want)
			}
		})
	}
}

func TestMessageRoundTrip(t *testing.T) {
	for _, tt := range sampleMessages() {
		t.Run(tt.name, func(t *testing.T) {
			b, err := EncodeMessage(tt.msg)
			if err != nil {
				t.Fatalf("EncodeMessage: %v", err)
			}
			got, err := DecodeMessage(b, tt.from.peer())
			if err != nil {
				t.Fatalf("DecodeMessage(%s): %v", b, err)
			}
			// Spec is re-encoded compactly; compare encodings, then the values.
			b2, err := EncodeMessage(got)
			if err != nil {
				t.Fatalf("re-encode: %v", err)
			}
			if string(b2) != string(b) {
				t.Errorf("re-encoded\n got %s\nwant %s", b2, b)
			}
			if !reflect.DeepEqual(got, tt.msg) {
				t.Errorf("decoded\n got %#v\nwant %#v", got, tt.msg)
			}
		})
	}
}

// TestGradSqExact checks that float64 partial sums survive JSON bit for bit: the coordinator's
// clip factor, and so the whole run, must not depend on a rounding in transit.
func TestGradSqExact(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	m := &StepReport{GradSq: map[string]float64{}}
	var want []float64
	for i := 0; i < 1000; i++ {
		v := math.Abs(math.Float64frombits(r.Uint64()))
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		name := "t" + strings.Repeat("x", i%7) + "." + string(rune('a'+i%26)) + "." + strconv.Itoa(i)
		m.GradSq[name] = v
		want = append(want, v)
	}
	b, err := EncodeMessage(m)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeMessage(b, RoleCoordinator)
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range m.GradSq {
		if g := got.(*StepReport).GradSq[name]; math.Float64bits(g) != math.Float64bits(v) {
			t.Errorf("%s: got %v (%#x), want %v (%#x)", name, g, math.Float64bits(g), v, math.Float64bits(v))
		}
	}
	if len(want) < 900 {
		t.Fatalf("only %d values tested", len(want))
	}
}

func TestDecodeMessageErrors(t *testing.T) {
	big := `{"v":18,"type":"bye","body":{"reason":"` + strings.Repeat("x", MaxMessageSize) + `"}}`
	tests := []struct {
		name  string
		local Role
		in    string
		want  error
		text  string // a substring of the error's text
	}{
		{"too-large", RoleWorker, big, ErrMessageTooLarge, "limit"},
		{"not-json", RoleWorker, `hello`, ErrBadMessage, ""},
		{"array", RoleWorker, `[1,2]`, ErrBadMessage, ""},
		{"no-version", RoleWorker, `{"type":"heartbeat","body":{"seq":1,"ack":false}}`, ErrProtocolVersion, `no "v"`},
		{"newer-coordinator", RoleWorker, `{"v":19,"type":"welcome","body":{}}`, ErrProtocolVersion,
			"coordinator speaks protocol 19, this worker speaks 18: upgrade the worker"},
		{"older-coordinator", RoleWorker, `{"v":0,"type":"welcome","body":{}}`, ErrProtocolVersion,
			"coordinator speaks protocol 0, this worker speaks 18: upgrade the coordinator"},
		{"older-worker", RoleCoordinator, `{"v":0,"type":"hello"}`, ErrProtocolVersion,
			"worker speaks protocol 0, this coordinator speaks 18: upgrade the worker"},
		{"newer-worker-new-fields", RoleCoordinator, `{"v":19,"type":"hello2","extra":[1]}`, ErrProtocolVersion,
			"worker speaks protocol 19, this coordinator speaks 18: upgrade the coordinator"},
		{"version-string", RoleWorker, `{"v":"1","type":"bye","body":{"reason":""}}`, ErrBadMessage, ""},
		{"unknown-type", RoleWorker, `{"v":18,"type":"gossip","body":{}}`, ErrUnknownType, `"gossip"`},
		{"no-type", RoleWorker, `{"v":18,"body":{}}`, ErrUnknownType, ""},
		{"worker-sends-peer-left", RoleCoordinator, `{"v":18,"type":"peer_left","body":{"plan_version":3,"worker":"w1"}}`, ErrUnexpectedMessage, "a worker does not send peer_left"},
		{"peer-left-no-worker", RoleWorker, `{"v":18,"type":"peer_left","body":{"plan_version":3,"worker":""}}`, ErrBadMessage, "worker"},
		// A reroute (coordinator → worker): the survivors' shares, contiguous and in replica order.
		{"worker-sends-step-reroute", RoleCoordinator, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}]}}`, ErrUnexpectedMessage, "a worker does not send step_reroute"},
		{"step-reroute-attempt-0", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":0,"shares":[{"replica":0,"first":0,"micro_batches":4}]}}`, ErrBadMessage, "attempt"},
		{"step-reroute-no-shares", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[]}}`, ErrBadMessage, "shares"},
		{"step-reroute-gap", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":2},{"replica":2,"first":3,"micro_batches":1}]}}`, ErrBadMessage, "do not follow on"},
		{"step-reroute-replicas-out-of-order", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":2,"first":0,"micro_batches":2},{"replica":0,"first":2,"micro_batches":2}]}}`, ErrBadMessage, "in order"},
		{"step-reroute-empty-share", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":0}]}}`, ErrBadMessage, "follow on"},
		{"stage-takeover-same-workers", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":4,"replica":1,"lost":"a","taker":"a","prev":"b","first":2,"micro_batches":2}}}`, ErrBadMessage, "four workers"},
		{"stage-takeover-prev-is-taker", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":4,"replica":1,"lost":"a","taker":"b","prev":"b","first":2,"micro_batches":2}}}`, ErrBadMessage, "four workers"},
		{"stage-takeover-no-blocks", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":2,"replica":1,"lost":"a","taker":"b","first":2,"micro_batches":2}}}`, ErrBadMessage, "blocks"},
		{"stage-takeover-run-outside", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":4,"replica":1,"lost":"a","taker":"b","first":3,"micro_batches":2}}}`, ErrBadMessage, "lost run"},
		{"stage-takeover-lost-has-share", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":4,"replica":0,"lost":"a","taker":"b","first":2,"micro_batches":2}}}`, ErrBadMessage, "has a share"},
		{"stage-takeover-bad-id", RoleWorker, `{"v":18,"type":"step_reroute","body":{"step":1,"plan_version":1,"attempt":1,"shares":[{"replica":0,"first":0,"micro_batches":4}],"stage":{"begin":2,"end":4,"replica":1,"lost":"a b","taker":"b","first":2,"micro_batches":2}}}`, ErrBadMessage, "stage.lost"},
		{"report-too-many-reroutes", RoleCoordinator, `{"v":18,"type":"step_report","body":{"step":1,"plan_version":1,"grad_sq":{"w":1},"ce":[],"aux":[],"timings":{"forward_ns":0,"backward_ns":0,"wait_ns":0,"transfer_ns":0,"total_ns":0},"eval":false,"reroutes":65}}`, ErrBadMessage, "reroutes"},
		{"coordinator-sends-leaving", RoleWorker, `{"v":18,"type":"leaving","body":{"reason":""}}`, ErrUnexpectedMessage, "a coordinator does not send leaving"},
		{"leaving-long", RoleCoordinator, `{"v":18,"type":"leaving","body":{"reason":"` + strings.Repeat("x", 2000) + `"}}`, ErrBadMessage, ""},
		{"worker-sends-welcome", RoleCoordinator, `{"v":18,"type":"welcome","body":{"worker_id":"w","heartbeat_ms":1,"ice_servers":[],"loopback":false}}`,
			ErrUnexpectedMessage, "a worker does not send welcome"},
		{"coordinator-sends-hello", RoleWorker, `{"v":18,"type":"hello","body":{}}`, ErrUnexpectedMessage, ""},
		{"unknown-envelope-field", RoleWorker, `{"v":18,"type":"bye","body":{"reason":""},"x":1}`, ErrBadMessage, "unknown field"},
		{"unknown-body-field", RoleWorker, `{"v":18,"type":"bye","body":{"reason":"","why":1}}`, ErrBadMessage, "unknown field"},
		{"trailing-data", RoleWorker, `{"v":18,"type":"bye","body":{"reason":""}} {}`, ErrBadMessage, "after"},
		{"no-body", RoleWorker, `{"v":18,"type":"bye"}`, ErrBadMessage, "JSON object"},
		{"null-body", RoleWorker, `{"v":18,"type":"bye","body":null}`, ErrBadMessage, "JSON object"},
		{"hello-bad-kind", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"phone","backend":"cpu","gflops":1,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, "kind"},
		{"hello-zero-gflops", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"native","backend":"cpu","gflops":0,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, "gflops"},
		// The device name reaches dashboards and terminals: no escape sequences, bounded.
		{"hello-device-escape", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"native","backend":"vulkan","device":"GPU\u001b[2J","gflops":1,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, "device"},
		{"hello-device-long", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"native","backend":"vulkan","device":"` + strings.Repeat("G", 300) + `","gflops":1,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, "device"},
		{"hello-bad-backend", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"native","backend":"cuda","gflops":1,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, "backend"},
		{"hello-huge-number", RoleCoordinator, `{"v":18,"type":"hello","body":{"kind":"native","backend":"cpu","gflops":1e999,"memory_bytes":1,"threads":1,"link_bytes_per_s":0,"name":"","worker_id":""}}`,
			ErrBadMessage, ""},
		{"welcome-bad-id", RoleWorker, `{"v":18,"type":"welcome","body":{"worker_id":"w 1","heartbeat_ms":1,"ice_servers":[],"loopback":false}}`,
			ErrBadMessage, "worker_id"},
		{"welcome-bad-ice", RoleWorker, `{"v":18,"type":"welcome","body":{"worker_id":"w","heartbeat_ms":1,"ice_servers":[{"urls":["http://x"]}],"loopback":false}}`,
			ErrBadMessage, "ice_servers"},
		{"welcome-relay-only-without-turn", RoleWorker, `{"v":18,"type":"welcome","body":{"worker_id":"w","heartbeat_ms":1,"ice_servers":[{"urls":["stun:x"]}],"loopback":false,"ice_relay_only":true,"session":"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO-_"}}`,
			ErrBadMessage, "ice_relay_only"},
		{"assign-two-shards", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"stage":{"index":0,"count":1,"begin":0,"end":1,"first":true,"last":true},"experts":{"block":0,"experts":[0]}},"prev":"","next":"","expert_hosts":[],"router":"","restore":null}}`,
			ErrBadMessage, "exactly one"},
		{"assign-routers-and-router", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"b","routers":[{"worker":"a","replica":0,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-gap", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":0,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":0},{"worker":"b","replica":1,"stage_index":0,"stage_count":1,"first":3,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-not-from-zero", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":0,"stage_index":0,"stage_count":1,"first":1,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-replica-order", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":1,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-same-worker", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":0,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":0},{"worker":"a","replica":1,"stage_index":0,"stage_count":1,"first":2,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-stage-index", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":0,"stage_index":2,"stage_count":2,"first":0,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-depth", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"a","replica":0,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":2}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-routers-empty-worker", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[0],"stage_index":0,"stage_count":1}},"prev":"","next":"","expert_hosts":[],"router":"","routers":[{"worker":"","replica":0,"stage_index":0,"stage_count":1,"first":0,"micro_batches":2,"depth":0}],"restore":null}}`,
			ErrBadMessage, "router"},
		{"assign-flags", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"stage":{"index":0,"count":2,"begin":0,"end":1,"first":true,"last":true}},"prev":"","next":"w","expert_hosts":[],"router":"","restore":null}}`,
			ErrBadMessage, "first=true last=true"},
		{"assign-spec-not-object", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":[1],"plan_version":1,"shard":{"stage":{"index":0,"count":1,"begin":0,"end":1,"first":true,"last":true}},"prev":"","next":"","expert_hosts":[],"router":"","restore":null}}`,
			ErrBadMessage, "spec"},
		{"assign-unsorted-experts", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"experts":{"block":1,"experts":[2,1]}},"prev":"","next":"","expert_hosts":[],"router":"w","restore":null}}`,
			ErrBadMessage, "sorted"},
		// The pipeline depth is bounded before any worker reads it (the worker then checks it
		// against its spec's micro_batches): a hostile coordinator cannot make a schedule of it.
		{"assign-absurd-depth", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"stage":{"index":0,"count":1,"begin":0,"end":1,"first":true,"last":true}},"prev":"","next":"","expert_hosts":[],"router":"","restore":null,"depth":4000000000}}`,
			ErrBadMessage, "depth"},
		{"assign-depth-past-int", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"stage":{"index":0,"count":1,"begin":0,"end":1,"first":true,"last":true}},"prev":"","next":"","expert_hosts":[],"router":"","restore":null,"depth":1e30}}`,
			ErrBadMessage, ""},
		{"assign-negative-depth", RoleWorker, `{"v":18,"type":"assign","body":{"job":"j","spec":{},"plan_version":1,"shard":{"stage":{"index":0,"count":1,"begin":0,"end":1,"first":true,"last":true}},"prev":"","next":"","expert_hosts":[],"router":"","restore":null,"depth":-1}}`,
			ErrBadMessage, "depth"},
		{"signal-self", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"a","plan_version":0,"candidate":{"candidate":""}}}`,
			ErrBadMessage, "itself"},
		{"signal-both", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"b","plan_version":0,"candidate":{"candidate":""},"sdp":{"type":"offer","sdp":"x"}}}`,
			ErrBadMessage, "exactly one"},
		{"signal-quic-candidate", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"b","plan_version":0,"candidate":{"candidate":""},"quic":"` + strings.Repeat("ab", 32) + `"}}`,
			ErrBadMessage, "quic"},
		{"signal-quic-upper", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"b","plan_version":0,"sdp":{"type":"offer","sdp":"x"},"quic":"` + strings.Repeat("AB", 32) + `"}}`,
			ErrBadMessage, "quic"},
		{"signal-quic-short", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"b","plan_version":0,"sdp":{"type":"offer","sdp":"x"},"quic":"abc"}}`,
			ErrBadMessage, "quic"},
		{"signal-pranswer", RoleWorker, `{"v":18,"type":"signal","body":{"from":"a","to":"b","plan_version":0,"sdp":{"type":"pranswer","sdp":"x"}}}`,
			ErrBadMessage, "sdp.type"},
		{"step-open-negative-lr", RoleWorker, `{"v":18,"type":"step_open","body":{"step":0,"plan_version":1,"lr":-1,"micro_batches":1,"deadline_ms":1}}`,
			ErrBadMessage, "lr"},
		{"step-open-negative-step", RoleWorker, `{"v":18,"type":"step_open","body":{"step":-1,"plan_version":1,"lr":1,"micro_batches":1,"deadline_ms":1}}`,
			ErrBadMessage, ""},
		{"step-report-empty", RoleCoordinator, `{"v":18,"type":"step_report","body":{"step":0,"plan_version":1,"grad_sq":{},"ce":null,"aux":null,"timings":{"forward_ns":0,"backward_ns":0,"wait_ns":0,"total_ns":0}}}`,
			ErrBadMessage, "grad_sq"},
		{"step-report-negative", RoleCoordinator, `{"v":18,"type":"step_report","body":{"step":0,"plan_version":1,"grad_sq":{"w":-1},"ce":null,"aux":null,"timings":{"forward_ns":0,"backward_ns":0,"wait_ns":0,"total_ns":0}}}`,
			ErrBadMessage, "grad_sq"},
		{"step-report-bad-name", RoleCoordinator, `{"v":18,"type":"step_report","body":{"step":0,"plan_version":1,"grad_sq":{"a b":1},"ce":null,"aux":null,"timings":{"forward_ns":0,"backward_ns":0,"wait_ns":0,"total_ns":0}}}`,
			ErrBadMessage, "tensor name"},
		{"clip-over-one", RoleWorker, `{"v":18,"type":"clip","body":{"step":0,"plan_version":1,"factor":1.5}}`, ErrBadMessage, "factor"},
		{"error-bad-code", RoleWorker, `{"v":18,"type":"error","body":{"code":"Oops!","message":""}}`, ErrBadMessage, "code"},
		{"heartbeat-not-number", RoleWorker, `{"v":18,"type":"heartbeat","body":{"seq":"1","ack":false}}`, ErrBadMessage, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := DecodeMessage([]byte(tt.in), tt.local)
			if !errors.Is(err, tt.want) {
				t.Fatalf("DecodeMessage = %v, %v; want error %v", m, err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.text) {
				t.Errorf("error %q does not contain %q", err, tt.text)
			}
		})
	}
}

func TestVersionErrorAs(t *testing.T) {
	newer := ProtocolVersion + 1
	_, err := DecodeMessage([]byte(`{"v":`+strconv.Itoa(newer)+`,"type":"clip","body":{}}`), RoleWorker)
	var ve *VersionError
	if !errors.As(err, &ve) {
		t.Fatalf("err = %v, want a *VersionError", err)
	}
	if ve.Peer != RoleCoordinator || ve.PeerVersion != newer || ve.LocalVersion != ProtocolVersion {
		t.Errorf("got %+v", *ve)
	}
}

func TestEncodeMessageErrors(t *testing.T) {
	tests := []struct {
		name string
		msg  Message
		want error
	}{
		{"nil", nil, ErrBadMessage},
		{"typed-nil", (*Hello)(nil), ErrBadMessage},
		{"invalid", &Clip{Factor: math.NaN()}, ErrBadMessage},
		{"bad-utf8", &Bye{Reason: "\xff"}, ErrBadMessage},
		{"html-escaped-text", &Error{Code: "x", Message: strings.Repeat("<", 4096)}, nil},
		// An accusation names a replica, and only an accusation does.
		{"refusal-accusing-nobody", &Error{Code: ErrCodeOuterRefused, Message: "refused"}, ErrBadMessage},
		{"accused-without-refusal", &Error{Code: ErrCodeStep, Message: "x", Accused: ptr(uint32(0))}, ErrBadMessage},
		// Evidence comes with a refusal and its step, and is bounded before anything reads it.
		{"evidence-without-step", &Error{Code: ErrCodeOuterRefused, Message: "x", Accused: ptr(uint32(0)), Evidence: goodEvidence()}, ErrBadMessage},
		{"evidence-without-refusal", &Error{Code: ErrCodeStep, Message: "x", Step: ptr(uint64(1)), Evidence: goodEvidence()}, ErrBadMessage},
		{"evidence-chunk-too-large", evidenceError(func(e *OuterEvidence) { e.Given = make([]byte, OuterEvidenceChunk+1) }), ErrBadMessage},
		{"evidence-base-not-float32", evidenceError(func(e *OuterEvidence) { e.Base = make([]byte, 7) }), ErrBadMessage},
		{"evidence-path-too-deep", evidenceError(func(e *OuterEvidence) { e.BasePath = make([][]byte, OuterEvidenceDepth+1) }), ErrBadMessage},
		{"evidence-short-hash", evidenceError(func(e *OuterEvidence) { e.GivenPath = [][]byte{make([]byte, 31)} }), ErrBadMessage},
		{"evidence-short-signature", evidenceError(func(e *OuterEvidence) { e.Signature = e.Signature[:63] }), ErrBadMessage},
		{"evidence-bad-sender", evidenceError(func(e *OuterEvidence) { e.Sender = "" }), ErrBadMessage},
		{"evidence-negative-chunk", evidenceError(func(e *OuterEvidence) { e.Chunk = -1 }), ErrBadMessage},
		{"evidence-no-entries", evidenceError(func(e *OuterEvidence) { e.Entry, e.Entries = 0, 0 }), ErrBadMessage},
		{"evidence-entry-beyond", evidenceError(func(e *OuterEvidence) { e.Entry = 3 }), ErrBadMessage},
		{"evidence-entry-path-too-deep", evidenceError(func(e *OuterEvidence) { e.EntryPath = make([][]byte, OuterEvidenceDepth+1) }), ErrBadMessage},
		{"evidence-entry-short-hash", evidenceError(func(e *OuterEvidence) { e.EntryPath = [][]byte{make([]byte, 33)} }), ErrBadMessage},
		{"signing-key-short", &Hello{Kind: WorkerNative, Backend: BackendCPU, GFLOPS: 1, MemoryBytes: 1, Threads: 1, SigningKey: make([]byte, 31)}, ErrBadMessage},
		{"report-too-large", func() Message {
			m := &StepReport{GradSq: map[string]float64{}}
			for i := 0; len(m.GradSq) < MaxMessageSize/200; i++ {
				m.GradSq[strings.Repeat("w", 200)+"."+strconv.Itoa(i%1000)+"."+strconv.Itoa(i/1000)] = 1
			}
			return m
		}(), ErrMessageTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := EncodeMessage(tt.msg)
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Fatalf("EncodeMessage = %v, want %v", err, tt.want)
			}
		})
	}
}

// TestOuterSyncValidate: an outer step's participants are distinct replica indices, ascending.
func TestOuterSyncValidate(t *testing.T) {
	for _, ps := range [][]int{nil, {}, {1, 0}, {0, 0}, {-1}, {MaxReplicas}} {
		if err := (&OuterSync{Participants: ps}).Validate(); err == nil {
			t.Errorf("participants %v accepted", ps)
		}
	}
	if err := (&OuterSync{Participants: []int{0, 2, 3}}).Validate(); err != nil {
		t.Error(err)
	}
	// Owners are participants: a redo's keep the first attempt's segments, a lost replica's
	// given to survivors.
	if err := (&OuterSync{Participants: []int{0, 3}, Owners: []int{0, 3, 3}, Lost: []int{1}, Attempt: 1}).Validate(); err != nil {
		t.Error(err)
	}
	for _, lost := range [][]int{{0}, {2, 1}, {1, 1}, {-1}, {1, 2}} {
		if err := (&OuterSync{Participants: []int{0, 3}, Owners: []int{0, 3, 3}, Lost: lost, Attempt: 1}).Validate(); err == nil {
			t.Errorf("lost %v of participants [0 3], owners of 3 segments, accepted", lost)
		}
	}
	for _, os := range [][]int{{0, 2}, {-1}, make([]int, MaxReplicas+1)} {
		if err := (&OuterSync{Participants: []int{0, 3}, Owners: os}).Validate(); err == nil {
			t.Errorf("owners %v of participants [0 3] accepted", len(os))
		}
	}
}

// TestOuterDoneValidate: the segments a stage averaged are distinct, ascending, each at an
// attempt up to the one answered.
func TestOuterDoneValidate(t *testing.T) {
	ok := &OuterDone{Attempt: 2, Averaged: []SegmentAveraged{{Segment: 0, Attempt: 0}, {Segment: 3, Attempt: 2}}}
	if err := ok.Validate(); err != nil {
		t.Error(err)
	}
	for _, av := range [][]SegmentAveraged{{{Segment: 1}, {Segment: 1}}, {{Segment: 2}, {Segment: 1}}, {{Segment: -1}}, {{Segment: MaxReplicas}}, {{Segment: 0, Attempt: 3}}, {{Segment: 0, Attempt: -1}}} {
		if err := (&OuterDone{Attempt: 2, Averaged: av}).Validate(); err == nil {
			t.Errorf("averaged %v accepted", av)
		}
	}
}

// goodEvidence is valid proof of a refused outer-step chunk, as far as its shape goes.
func goodEvidence() *OuterEvidence {
	return &OuterEvidence{Sender: "w-2", Tensor: 3, Chunk: 1, Segment: [2]int{0, 2}, Base: make([]byte, 4*256), BasePath: [][]byte{make([]byte, 32)},
		Given: make([]byte, 4+256), GivenPath: [][]byte{make([]byte, 32), make([]byte, 32)}, Entry: 1, Entries: 3, EntryPath: [][]byte{make([]byte, 32), make([]byte, 32)},
		Signature: make([]byte, 64)}
}

// evidenceError is a refusal whose evidence edit spoils.
func evidenceError(edit func(*OuterEvidence)) *Error {
	e := goodEvidence()
	edit(e)
	return &Error{Code: ErrCodeOuterRefused, Message: "x", Accused: ptr(uint32(0)), Step: ptr(uint64(3)), Evidence: e}
}

// TestReadySumsRefused: what a giver lists of the state it gave is bounded and well formed — at
// most MaxReadySums tensors, each named once, with a name and a digest — before the coordinator
// builds anything of it.
func TestReadySumsRefused(t *testing.T) {
	d := EncodeDigest(make([]byte, 32))
	many := make([]KeyDigest, MaxReadySums+1)
	for i := range many {
		many[i] = KeyDigest{Key: fmt.Sprintf("t%d", i), Digest: d}
	}
	for _, tc := range []struct {
		name string
		sums []KeyDigest
		want string
	}{
		{"too many", many, "at most"},
		{"a tensor twice", []KeyDigest{{Key: "a", Digest: d}, {Key: "a", Digest: d}}, `"a" twice`},
		{"no name", []KeyDigest{{Key: "", Digest: d}}, "name of 0 bytes"},
		{"a long name", []KeyDigest{{Key: strings.Repeat("x", 257), Digest: d}}, "name of 257 bytes"},
		{"a bad digest", []KeyDigest{{Key: "a", Digest: "not a digest"}}, "sums"},
	} {
		err := (&Ready{PlanVersion: 3, Sums: tc.sums}).Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}
