package proto

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strings"
)

// WorkerKind says how a worker runs.
type WorkerKind string

const (
	WorkerNative  WorkerKind = "native"  // the shoal worker daemon
	WorkerBrowser WorkerKind = "browser" // the wasm worker in a browser tab
)

// Backend is the compute backend a worker benchmarked and will train with.
type Backend string

const (
	BackendCPU    Backend = "cpu"
	BackendWebGPU Backend = "webgpu"
	BackendVulkan Backend = "vulkan" // a native worker's GPU (package vulkan)
)

// Kernel families: the arithmetic a worker's backend computes with. Two workers of one family
// compute the same bits (kernels/doc.go), so an audit of one by the other is exact; across
// families it is compared within tolerances.
const (
	KernelsFMA      = "fma"      // native SIMD kernels (AVX-512, AVX2): fused multiply-adds
	KernelsPortable = "portable" // the pure-Go kernels (wasm, -tags purego): rounded products
	KernelsWebGPU   = "webgpu"   // WGSL shaders on a GPU
	KernelsVulkan   = "vulkan"   // SPIR-V compute shaders through Vulkan (package vulkan)
)

// Hello is a worker's first message: what it is and what it measured about itself. The
// coordinator plans with these numbers (sched.Peer), so they are measured, not configured. The
// protocol version is not a field: it travels in every message's envelope, the hello's included.
type Hello struct {
	Kind    WorkerKind `json:"kind"`
	Backend Backend    `json:"backend"`
	// GFLOPS is the measured throughput of Backend on the training kernels, in GFLOP/s.
	GFLOPS float64 `json:"gflops"`
	// MemoryBytes is what the worker may use for its shard (--memory, or what the browser allows).
	MemoryBytes int64 `json:"memory_bytes"`
	// OuterOnHeap: the worker keeps outer mode's state in MemoryBytes, beside its shard (a browser
	// tab always does; a native worker where it cannot map a file), rather than on disk. The
	// coordinator then offers the planner what that state leaves (sched.HeapOuterOffer). It can
	// only lower the worker's own offer.
	OuterOnHeap bool `json:"outer_on_heap,omitempty"`
	// Threads is the number of compute threads (--threads; 1 for WebGPU's host side is fine).
	Threads int `json:"threads"`
	// LinkBytesPerS is the measured upload bandwidth in bytes/s, or 0 when not measured yet
	// (the coordinator then measures it).
	LinkBytesPerS float64 `json:"link_bytes_per_s"`
	// Kernels is the kernel family the worker computes with (KernelsFMA, KernelsPortable,
	// KernelsWebGPU): whether its audits can be compared bit for bit. "" is unknown, compared
	// within tolerances.
	Kernels string `json:"kernels,omitempty"`
	// Name is a label for dashboards (host name, browser); not an identity.
	Name string `json:"name"`
	// Device names what Backend computes on — the GPU's or adapter's name as its driver gives it
	// ("NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)") — for dashboards; "" for the CPU. Like
	// Name it is a label, shown escaped; GFLOPS, not Device, is what the planner believes (once
	// measured).
	Device string `json:"device,omitempty"`
	// WorkerID is the id the coordinator gave this worker before, when it reconnects; "" on a
	// first join. It is granted only with the Session credential that came with it.
	WorkerID string `json:"worker_id"`
	// Session is the credential of the worker's last Welcome, presented to rejoin as WorkerID. An
	// id asked for without its current credential is not granted: the worker gets a fresh one, so
	// that nobody can take over another worker's id (and its shard, uploads and credit).
	Session string `json:"session,omitempty"`
	// JoinToken is a private job's join token (from its join link); "" for public jobs.
	JoinToken string `json:"join_token,omitempty"`
	// SigningKey is the worker's Ed25519 public key (SigningKeySize bytes): its volunteer's
	// identity (identity.go), which it proves it holds before it is welcomed. It also signs what
	// the worker contributes to an outer step (sync mode "outer", package audit's outer
	// commitments), so that a receiver can prove to the coordinator what it was sent. The
	// coordinator passes it to the peers that receive from the worker (ReducePeer.Key). Empty:
	// the worker has no identity (its credit is kept under its worker id) and can take part in no
	// outer step, as its contributions cannot be verified.
	SigningKey []byte `json:"signing_key,omitempty"`
}

// SigningKeySize is the size of an Ed25519 public key (Hello.SigningKey, ReducePeer.Key).
const SigningKeySize = 32

func (*Hello) Type() MessageType { return TypeHello }

func (m *Hello) Validate() error {
	switch {
	case m.Kind != WorkerNative && m.Kind != WorkerBrowser:
		return invalid("kind", "%s, want %q or %q", quote(string(m.Kind)), WorkerNative, WorkerBrowser)
	case m.Backend != BackendCPU && m.Backend != BackendWebGPU && m.Backend != BackendVulkan:
		return invalid("backend", "%s, want %q, %q or %q", quote(string(m.Backend)), BackendCPU, BackendWebGPU, BackendVulkan)
	case !(m.GFLOPS > 0) || math.IsInf(m.GFLOPS, 0):
		return invalid("gflops", "%v, want a positive measured throughput", m.GFLOPS)
	case m.MemoryBytes <= 0:
		return invalid("memory_bytes", "%d, want > 0", m.MemoryBytes)
	case m.Threads < 1:
		return invalid("threads", "%d, want >= 1", m.Threads)
	case !(m.LinkBytesPerS >= 0) || math.IsInf(m.LinkBytesPerS, 0):
		return invalid("link_bytes_per_s", "%v, want >= 0 (0: not measured)", m.LinkBytesPerS)
	}
	switch m.Kernels {
	case "", KernelsFMA, KernelsPortable, KernelsWebGPU, KernelsVulkan:
	default:
		return invalid("kernels", "%s, want %q, %q, %q or %q", quote(m.Kernels), KernelsFMA, KernelsPortable, KernelsWebGPU, KernelsVulkan)
	}
	if err := checkLabel("name", m.Name, 256); err != nil {
		return err
	}
	if err := checkLabel("device", m.Device, 256); err != nil {
		return err
	}
	if m.Session != "" && m.WorkerID == "" {
		return invalid("session", "set without the worker_id it belongs to")
	}
	if err := checkOptionalSession(m.Session); err != nil {
		return err
	}
	if err := checkText("join_token", m.JoinToken, 256); err != nil {
		return err
	}
	if len(m.SigningKey) != 0 && len(m.SigningKey) != SigningKeySize {
		return invalid("signing_key", "%d bytes, want %d (an Ed25519 public key) or none", len(m.SigningKey), SigningKeySize)
	}
	return checkOptionalID("worker_id", m.WorkerID)
}

// ICEServer is a STUN or TURN server for WebRTC, as the W3C RTCIceServer dictionary (and pion's
// webrtc.ICEServer) spells it, so that it passes through to either unchanged.
type ICEServer struct {
	URLs       []string `json:"urls"`
	Username   string   `json:"username,omitempty"`
	Credential string   `json:"credential,omitempty"`
}

func (s ICEServer) validate() error {
	if len(s.URLs) == 0 {
		return invalid("ice_servers", "a server without urls")
	}
	for _, u := range s.URLs {
		if !strings.HasPrefix(u, "stun:") && !strings.HasPrefix(u, "stuns:") &&
			!strings.HasPrefix(u, "turn:") && !strings.HasPrefix(u, "turns:") {
			return invalid("ice_servers", "url %s is not stun:, stuns:, turn: or turns:", quote(u))
		}
		if err := checkText("ice_servers", u, 1024); err != nil {
			return err
		}
	}
	if err := checkText("ice_servers.username", s.Username, 1024); err != nil {
		return err
	}
	return checkText("ice_servers.credential", s.Credential, 1024)
}

// Welcome accepts a worker: its id, and how to reach other workers.
type Welcome struct {
	WorkerID string `json:"worker_id"`
	// HeartbeatMS is how often each side sends a heartbeat; a peer silent for a few intervals is
	// considered lost.
	HeartbeatMS int64 `json:"heartbeat_ms"`
	// ICEServers are the admin's --ice-server list, and the coordinator's own TURN server with a
	// credential for this worker alone (shoal serve --turn).
	ICEServers []ICEServer `json:"ice_servers"`
	// Loopback restricts ICE to loopback candidates with mDNS off (tests and the local demo).
	// ICE servers on a loopback address are still used then (shoal serve --turn 127.0.0.1:3478).
	Loopback bool `json:"loopback"`
	// ICERelayOnly has the worker offer and use only relayed candidates (iceTransportPolicy
	// "relay"): every link goes through a TURN server, and no peer learns another's address
	// (shoal serve --ice-relay-only).
	ICERelayOnly bool `json:"ice_relay_only,omitempty"`
	// Session is this worker's credential for this connection: it authenticates its checkpoint
	// uploads (as "Authorization: Bearer <session>") and, in the next Hello, its claim to
	// WorkerID. A new one comes with every Welcome; the previous one is void from then on.
	Session string `json:"session"`
}

func (*Welcome) Type() MessageType { return TypeWelcome }

func (m *Welcome) Validate() error {
	if err := checkID("worker_id", m.WorkerID); err != nil {
		return err
	}
	if m.HeartbeatMS <= 0 {
		return invalid("heartbeat_ms", "%d, want > 0", m.HeartbeatMS)
	}
	turn := false
	for _, s := range m.ICEServers {
		if err := s.validate(); err != nil {
			return err
		}
		for _, u := range s.URLs {
			turn = turn || strings.HasPrefix(u, "turn:") || strings.HasPrefix(u, "turns:")
		}
	}
	if m.ICERelayOnly && !turn {
		return invalid("ice_relay_only", "set without a TURN server: no link could connect")
	}
	if m.Session == "" {
		return invalid("session", "empty: every Welcome carries a credential")
	}
	return checkOptionalSession(m.Session)
}

// StageShard is pipeline stage Index of Count: blocks [Begin, End). The first stage also holds
// the embeddings (wte, wpe), the last ln_f, lm_head and the loss (docs/design.md, "The model").
type StageShard struct {
	Index int  `json:"index"`
	Count int  `json:"count"` // S, the number of stages: 1F1B's warm-up depends on it
	Begin int  `json:"begin"`
	End   int  `json:"end"`
	First bool `json:"first"` // Index == 0
	Last  bool `json:"last"`  // Index == Count-1
}

// ExpertShard is the expert MLPs Experts (sorted) of MoE block Block; the router stays with the
// block's stage.
type ExpertShard struct {
	Block   int   `json:"block"`
	Experts []int `json:"experts"`
	// StageIndex and StageCount place the block's stage in the pipeline: the host serves the
	// stage's requests in the order of that stage's 1F1B schedule.
	StageIndex int `json:"stage_index"`
	StageCount int `json:"stage_count"`
}

// Shard is the unit of placement: exactly one of Stage and Experts is set.
type Shard struct {
	Stage   *StageShard  `json:"stage,omitempty"`
	Experts *ExpertShard `json:"experts,omitempty"`
}

func (s Shard) validate() error {
	switch {
	case (s.Stage == nil) == (s.Experts == nil):
		return invalid("shard", "exactly one of stage and experts must be set")
	case s.Stage != nil:
		st := s.Stage
		switch {
		case st.Count < 1 || st.Index < 0 || st.Index >= st.Count:
			return invalid("shard.stage", "index %d of %d stages", st.Index, st.Count)
		case st.Begin < 0 || st.End <= st.Begin:
			return invalid("shard.stage", "blocks [%d, %d) must be non-empty", st.Begin, st.End)
		case st.First != (st.Index == 0) || st.Last != (st.Index == st.Count-1):
			return invalid("shard.stage", "first=%v last=%v do not match index %d of %d", st.First, st.Last, st.Index, st.Count)
		case st.First && st.Begin != 0:
			return invalid("shard.stage", "the first stage must start at block 0, not %d", st.Begin)
		}
	default:
		ex := s.Experts
		if ex.Block < 0 || len(ex.Experts) == 0 {
			return invalid("shard.experts", "block %d with %d experts", ex.Block, len(ex.Experts))
		}
		for i, e := range ex.Experts {
			if e < 0 || i > 0 && e <= ex.Experts[i-1] {
				return invalid("shard.experts", "experts %v must be distinct, non-negative and sorted", ex.Experts)
			}
		}
		if ex.StageCount < 1 || ex.StageIndex < 0 || ex.StageIndex >= ex.StageCount {
			return invalid("shard.experts", "stage %d of %d", ex.StageIndex, ex.StageCount)
		}
	}
	return nil
}

// ExpertHost says which workers hold expert Expert of block Block, in replica order (the order in
// which the stage reduces their gradients' contributions).
type ExpertHost struct {
	Block   int      `json:"block"`
	Expert  int      `json:"expert"`
	Workers []string `json:"workers"`
}

// CheckpointRef is where an Assign's shard restores from: the checkpoint after Step steps, as the
// safetensors files at /blobs/<sha> for each sha of Blobs (their sha256s, hex) — the shards of the
// checkpoint that hold the tensors this shard reads, not the whole model: a worker downloads what
// it holds (and, where the checkpoint was cut otherwise, the rest of the shards its blocks are in).
// Each blob adds at least one tensor the restore reads that the blobs before it did not, so a
// worker reads no more blobs than it has tensors to read (client: restore).
type CheckpointRef struct {
	Step  uint64   `json:"step"`
	Blobs []string `json:"blobs"`
}

// MaxRestoreBlobs bounds CheckpointRef.Blobs: a stage of the largest model reads a few thousand
// tensors at most, and an honest coordinator lists few shards holding them, greedily.
const MaxRestoreBlobs = 1024

// Keep is the state an Assign continues from: the worker's own shard of its previous plan, every
// step before Step applied and none after.
type Keep struct {
	FromPlan uint32 `json:"from_plan"` // the plan the worker holds the shard under
	Step     uint64 `json:"step"`      // the next training step: the shard holds Step updates
}

// Handover is where an Assign's shard takes blocks [Begin, End) of its state from instead of a
// checkpoint: a worker of the previous plan that keeps a stage holding those blocks (its Assign has
// Keep and a Gift of them to this worker) and sends their state over the data plane (KindState,
// StateKey), every step before Step applied and none after. It is how a worker joins a running job
// without a checkpoint: a new replica's stage takes up the state of stages other replicas hold,
// peer to peer. A stage's blocks may come from several givers, each holding some of them (a cut
// no holder has whole): Assign.From lists them in block order.
type Handover struct {
	Worker   string `json:"worker"`    // the worker that keeps the shard and sends it
	FromPlan uint32 `json:"from_plan"` // the plan that worker holds it under (its Keep.FromPlan)
	Step     uint64 `json:"step"`      // the next training step: the state holds Step updates
	Begin    int    `json:"begin"`     // the first block of the taker's stage this worker sends
	End      int    `json:"end"`       // one past its last
}

// Gift is what a worker keeping a stage (Assign.Keep) sends one taker: the state of blocks
// [Begin, End) of its stage, which the taker's Assign.From names it the giver of.
type Gift struct {
	Worker string `json:"worker"`
	Begin  int    `json:"begin"`
	End    int    `json:"end"`
}

// Givers are the workers of from (Assign.From), in block order.
func Givers(from []Handover) []string {
	out := make([]string, len(from))
	for i, f := range from {
		out[i] = f.Worker
	}
	return out
}

// Takers are the workers of give (Assign.Give), in order.
func Takers(give []Gift) []string {
	out := make([]string, len(give))
	for i, g := range give {
		out[i] = g.Worker
	}
	return out
}

// MaxGive bounds Assign.Give: the workers one holder hands its state to at a plan change.
const MaxGive = 64

// Assign gives a worker its shard under a plan, its neighbours, and where to start from. It is
// sent after Welcome and again at every replan; a worker holds one shard at a time.
type Assign struct {
	Job string `json:"job"`
	// Spec is the job spec JSON as submitted (every field written out): the worker takes the model
	// config, seed, batch size, micro-batches and weight decay from it. It stays raw here because
	// proto must not import the packages that define it.
	Spec        json.RawMessage `json:"spec"`
	PlanVersion uint32          `json:"plan_version"`
	Shard       Shard           `json:"shard"`
	// Prev and Next are the workers holding the neighbouring stages of a stage shard ("" at the
	// ends of the pipeline and for expert shards).
	Prev string `json:"prev"`
	Next string `json:"next"`
	// ExpertHosts lists, for a stage shard, the experts of its MoE blocks that live on other
	// workers. Empty while experts stay with their stage.
	ExpertHosts []ExpertHost `json:"expert_hosts"`
	// Router is, for an expert shard, the worker holding the stage of its block — in a plan of
	// one pipeline; with several replicas it is empty and Routers says.
	Router string `json:"router"`
	// Routers are, for an expert shard of a plan of several pipeline replicas (sync mode "step"),
	// the stage of its block in each replica, in replica order: the host serves every replica's
	// micro-batches, each in its stage's schedule, and its gradient covers the whole step.
	Routers []ExpertRouter `json:"routers,omitempty"`
	// Restore is the checkpoint to load before the next step; nil to initialise from the job seed
	// (unless Keep says otherwise).
	Restore *CheckpointRef `json:"restore"`
	// Keep continues from the state the worker holds under its previous plan, instead of a restore:
	// the plan changed around the shard (a replica of step mode was lost, and the survivors share
	// its micro-batches) but not the shard itself. A worker that does not hold that very shard at
	// that very step refuses the assignment, and the coordinator restores instead. Set only with
	// Restore nil.
	Keep *Keep `json:"keep,omitempty"`
	// From takes the shard's state from other workers, which keep stages holding its blocks
	// (Handover), instead of a restore: in block order, together its stage's blocks exactly, all
	// at one step. Set only with Restore and Keep nil, for a stage shard.
	From []Handover `json:"from,omitempty"`
	// Give lists the workers this worker sends the state of blocks of the stage it keeps (Keep)
	// to, before it is Ready: each takes them up (From). Set only with Keep.
	Give []Gift `json:"give,omitempty"`
	// Standby: the worker holds no stage of this plan. It sends the state of the stage it keeps
	// (Keep, the shard it held) to the workers in Give, is Ready, and then stands by: no step of
	// the plan opens for it. A holder the plan leaves out in place of a joiner hands its stage
	// over so, instead of a checkpoint. Set only with Keep and Give.
	Standby bool `json:"standby,omitempty"`
	// Relay sends this worker's tensors through the coordinator's WebSockets instead of WebRTC
	// data channels: the fallback when ICE cannot connect two peers, or an admin's choice.
	Relay bool `json:"relay"`
	// Depth is the plan's pipeline depth: how many micro-batches beyond plain 1F1B every stage
	// keeps in flight (sched.OneFOneBDepth), to hide link latency. It is fixed per plan version
	// and the same in every Assign of a plan, so that an expert host follows its stage's order
	// and a worker can check its memory against it (0 ≤ Depth < the spec's micro_batches) before
	// allocating anything. 0, and absent, is plain 1F1B.
	Depth int `json:"depth,omitempty"`
	// Replica places a stage in one of several pipeline replicas (proto/replica.go); nil for a
	// plan of one pipeline.
	Replica *ReplicaAssign `json:"replica,omitempty"`
}

// MaxDepth bounds Assign.Depth whatever the spec says: a worker checks depth < M against the
// job spec, and this keeps a hostile value from ever reaching a schedule or an allocation.
const MaxDepth = 1 << 16

func (*Assign) Type() MessageType { return TypeAssign }

func (m *Assign) Validate() error {
	if err := checkID("job", m.Job); err != nil {
		return err
	}
	if t := bytes.TrimSpace(m.Spec); len(t) == 0 || t[0] != '{' || !json.Valid(t) {
		return invalid("spec", "must be the job spec as a JSON object")
	}
	if err := m.Shard.validate(); err != nil {
		return err
	}
	if m.Depth < 0 || m.Depth >= MaxDepth {
		return invalid("depth", "%d, want in [0, %d)", m.Depth, MaxDepth)
	}
	if k := m.Keep; k != nil && (m.Restore != nil || k.FromPlan == 0 || k.FromPlan >= m.PlanVersion) {
		return invalid("keep", "from plan %d into plan %d with a restore %v: want an earlier plan and no restore", k.FromPlan, m.PlanVersion, m.Restore != nil)
	}
	if len(m.From) > 0 {
		st := m.Shard.Stage
		if m.Restore != nil || m.Keep != nil || st == nil {
			return invalid("from", "a handover with a restore (%v), a keep (%v) or for an expert shard", m.Restore != nil, m.Keep != nil)
		}
		next := st.Begin
		for i, f := range m.From {
			switch {
			case f.FromPlan == 0 || f.FromPlan >= m.PlanVersion:
				return invalid("from.from_plan", "%d into plan %d: want an earlier plan", f.FromPlan, m.PlanVersion)
			case f.Step != m.From[0].Step:
				return invalid("from.step", "givers at steps %d and %d: want one step", m.From[0].Step, f.Step)
			case f.Begin != next || f.End <= f.Begin || f.End > st.End:
				return invalid("from", "blocks [%d, %d) from %s after block %d of a stage of [%d, %d): want its blocks in order, each once",
					f.Begin, f.End, quote(f.Worker), next, st.Begin, st.End)
			}
			if err := checkID("from.worker", f.Worker); err != nil {
				return err
			}
			if slices.ContainsFunc(m.From[:i], func(g Handover) bool { return g.Worker == f.Worker }) {
				return invalid("from", "%s twice", quote(f.Worker))
			}
			next = f.End
		}
		if next != st.End {
			return invalid("from", "blocks up to %d of a stage of [%d, %d): want all of them", next, st.Begin, st.End)
		}
	}
	if m.Standby && (len(m.Give) == 0 || m.Shard.Stage == nil || m.Replica != nil || m.Prev != "" || m.Next != "" || len(m.ExpertHosts) > 0) {
		return invalid("standby", "a standby's assignment gives %d workers a stage (%v) and names a replica (%v) or neighbours: want a stage it hands over, nothing else",
			len(m.Give), m.Shard.Stage != nil, m.Replica != nil)
	}
	if len(m.Give) > 0 && (m.Keep == nil || m.Shard.Stage == nil || len(m.Give) > MaxGive) {
		return invalid("give", "%d workers with a keep %v: want a kept stage and at most %d", len(m.Give), m.Keep != nil, MaxGive)
	}
	for i, g := range m.Give {
		if err := checkID("give", g.Worker); err != nil {
			return err
		}
		if slices.ContainsFunc(m.Give[:i], func(h Gift) bool { return h.Worker == g.Worker }) {
			return invalid("give", "%s twice", quote(g.Worker))
		}
		if st := m.Shard.Stage; g.Begin < st.Begin || g.End <= g.Begin || g.End > st.End {
			return invalid("give", "blocks [%d, %d) to %s of a stage of [%d, %d)", g.Begin, g.End, quote(g.Worker), st.Begin, st.End)
		}
	}
	for _, f := range []struct{ name, id string }{{"prev", m.Prev}, {"next", m.Next}, {"router", m.Router}} {
		if err := checkOptionalID(f.name, f.id); err != nil {
			return err
		}
	}
	if st := m.Shard.Stage; st != nil {
		switch {
		case (m.Prev == "") != st.First && !m.Standby: // a standby runs no stage: it has no neighbours
			return invalid("prev", "%s for stage %d of %d", quote(m.Prev), st.Index, st.Count)
		case (m.Next == "") != st.Last && !m.Standby:
			return invalid("next", "%s for stage %d of %d", quote(m.Next), st.Index, st.Count)
		case m.Router != "" || len(m.Routers) > 0:
			return invalid("router", "set for a stage shard")
		}
		seen := make(map[[2]int]bool, len(m.ExpertHosts))
		for _, h := range m.ExpertHosts {
			k := [2]int{h.Block, h.Expert}
			switch {
			case h.Block < st.Begin || h.Block >= st.End || h.Expert < 0:
				return invalid("expert_hosts", "block %d expert %d is not in this stage's blocks [%d, %d)", h.Block, h.Expert, st.Begin, st.End)
			case seen[k]:
				return invalid("expert_hosts", "block %d expert %d listed twice", h.Block, h.Expert)
			case len(h.Workers) == 0:
				return invalid("expert_hosts", "block %d expert %d has no workers", h.Block, h.Expert)
			}
			seen[k] = true
			for _, w := range h.Workers {
				if err := checkID("expert_hosts.workers", w); err != nil {
					return err
				}
			}
		}
	} else {
		switch {
		case m.Prev != "" || m.Next != "":
			return invalid("prev", "set for an expert shard")
		case (m.Router == "") == (len(m.Routers) == 0):
			return invalid("router", "an expert shard needs the worker of its block's stage, or one per replica in routers")
		case len(m.Routers) > 0 && len(m.ExpertHosts) > 0:
			return invalid("routers", "replicated experts in a plan of pipeline replicas")
		}
		if err := validateRouters(m.Routers); err != nil {
			return err
		}
		// An expert shard's ExpertHosts lists the replicas of its own replicated experts, so that
		// each replica knows the other.
		for _, h := range m.ExpertHosts {
			if h.Block != m.Shard.Experts.Block || len(h.Workers) != 2 {
				return invalid("expert_hosts", "an expert shard lists only its own replicated experts (block %d expert %d)", h.Block, h.Expert)
			}
			for _, w := range h.Workers {
				if err := checkID("expert_hosts.workers", w); err != nil {
					return err
				}
			}
		}
	}
	if r := m.Replica; r != nil {
		if err := r.validate(m.Shard.Stage); err != nil {
			return err
		}
	}
	if r := m.Restore; r != nil {
		if len(r.Blobs) == 0 || len(r.Blobs) > MaxRestoreBlobs {
			return invalid("restore.blobs", "%d blobs, want 1 to %d", len(r.Blobs), MaxRestoreBlobs)
		}
		for i, b := range r.Blobs {
			if len(b) != 64 || strings.Trim(b, "0123456789abcdef") != "" {
				return invalid("restore.blobs", "%s is not a lowercase hex sha256", quote(b))
			}
			if slices.Contains(r.Blobs[:i], b) {
				return invalid("restore.blobs", "%s is listed twice", quote(b))
			}
		}
	}
	return nil
}
