package proto

import "slices"

// Pipeline replicas (docs/design.md, "Replicas and synchronisation"): a plan may run R pipelines, each
// with its own stage cuts and workers, computing disjoint contiguous runs of every step's
// micro-batches. In step mode each stage then reduces its gradients with the stages of the other
// replicas that hold the same tensors, peer to peer: every holder sends the others the nodes of
// the gradient tree its micro-batches make (model/gradtree.go), as KindGradReduce frames, and each
// sums the same tree.

// ReplicaAssign places a stage shard in one of several pipeline replicas; Assign.Replica is nil
// for a plan of one pipeline.
type ReplicaAssign struct {
	Index int `json:"index"` // the replica, 0-based, in micro-batch order
	Count int `json:"count"` // R; 1 only in sync mode "outer", whose replica trains its own steps
	// First and MicroBatches are the replica's micro-batches of every step:
	// [First, First+MicroBatches) of the spec's micro_batches.
	First        int `json:"first"`
	MicroBatches int `json:"micro_batches"`
	// Peers are the stages of the other replicas holding tensors this stage holds too, in
	// replica order: whom it reduces gradients with.
	Peers []ReducePeer `json:"peers"`
	// PrevPool and NextPool, in step mode, are the workers of the other replicas that hold the
	// stage ending at this stage's first block and the stage beginning at its end: whoever of them
	// a stage takeover (StageTakeover) names sends this stage what its own neighbour would — the
	// taker of a lost neighbour, or, when this stage takes a lost stage over, that stage's
	// neighbours. Admission lets them send only the boundary tensors.
	PrevPool []string `json:"prev_pool,omitempty"`
	NextPool []string `json:"next_pool,omitempty"`
}

// ReducePeer is a stage of another replica: its worker, the replica's micro-batches and the
// stage's blocks — from which the receiver knows which tensors (the blocks', the embedding's on
// the first stage, Begin 0, the head's on the last, End n_layer) and which gradient-tree nodes the
// worker may send, before it allocates anything. A peer that shares no tensor with the receiver is
// refused by the receiver, which knows n_layer.
type ReducePeer struct {
	Worker       string `json:"worker"`
	Replica      int    `json:"replica"`
	First        int    `json:"first"`
	MicroBatches int    `json:"micro_batches"`
	Begin        int    `json:"begin"`
	End          int    `json:"end"`
	// Key is the worker's signing key (Hello.SigningKey), which what it sends at an outer step
	// must be signed with; empty when it has none.
	Key []byte `json:"key,omitempty"`
}

// MaxReplicas bounds ReplicaAssign.Count: a micro-batch per replica at the least, and far more
// replicas than any step has micro-batches would only mean a hostile Assign.
const MaxReplicas = 1 << 12

func (r *ReplicaAssign) validate(stage *StageShard) error {
	switch {
	case stage == nil:
		return invalid("replica", "set for an expert shard")
	case r.Count < 1 || r.Count > MaxReplicas:
		return invalid("replica.count", "%d, want in [1, %d]", r.Count, MaxReplicas)
	case r.Index < 0 || r.Index >= r.Count:
		return invalid("replica.index", "%d of %d replicas", r.Index, r.Count)
	case r.First < 0 || r.MicroBatches < 1:
		return invalid("replica", "micro-batches [%d, %d+%d)", r.First, r.First, r.MicroBatches)
	case len(r.Peers) > r.Count*stage.End:
		return invalid("replica.peers", "%d peers", len(r.Peers))
	}
	for _, p := range r.Peers {
		if err := checkID("replica.peers.worker", p.Worker); err != nil {
			return err
		}
		switch {
		case p.Replica < 0 || p.Replica >= r.Count || p.Replica == r.Index:
			return invalid("replica.peers.replica", "%d (this stage is replica %d of %d)", p.Replica, r.Index, r.Count)
		case p.First < 0 || p.MicroBatches < 1:
			return invalid("replica.peers", "micro-batches [%d, %d+%d)", p.First, p.First, p.MicroBatches)
		case p.Begin < 0 || p.End <= p.Begin:
			return invalid("replica.peers", "blocks [%d, %d)", p.Begin, p.End)
		case len(p.Key) != 0 && len(p.Key) != SigningKeySize:
			return invalid("replica.peers.key", "%d bytes, want %d or none", len(p.Key), SigningKeySize)
		}
	}
	for _, pool := range []struct {
		field string
		ids   []string
	}{{"replica.prev_pool", r.PrevPool}, {"replica.next_pool", r.NextPool}} {
		if len(pool.ids) >= r.Count {
			return invalid(pool.field, "%d workers beside %d replicas", len(pool.ids), r.Count)
		}
		for _, w := range pool.ids {
			if err := checkID(pool.field, w); err != nil {
				return err
			}
		}
	}
	return nil
}

// ExpertRouter is the stage of an expert host's block in one pipeline replica: its worker, its
// place in its replica's pipeline (whose 1F1B schedule, at Depth, the host follows for it), and
// the replica's micro-batches [First, First+MicroBatches).
type ExpertRouter struct {
	Worker       string `json:"worker"`
	Replica      int    `json:"replica"`
	StageIndex   int    `json:"stage_index"`
	StageCount   int    `json:"stage_count"`
	First        int    `json:"first"`
	MicroBatches int    `json:"micro_batches"`
	Depth        int    `json:"depth"`
}

// validateRouters checks an expert host's routers: one per replica in replica order, distinct
// workers, schedules that exist, and micro-batches that run on from 0 without gaps (the worker
// checks that they end at the spec's micro_batches).
func validateRouters(rs []ExpertRouter) error {
	if len(rs) > MaxReplicas {
		return invalid("routers", "%d, at most %d", len(rs), MaxReplicas)
	}
	seen := make(map[string]bool, len(rs))
	next := 0
	for i, r := range rs {
		if err := checkID("routers.worker", r.Worker); err != nil {
			return err
		}
		switch {
		case seen[r.Worker]:
			return invalid("routers.worker", "%s routes for two replicas", quote(r.Worker))
		case r.Replica != i:
			return invalid("routers.replica", "%d at position %d", r.Replica, i)
		case r.StageCount < 1 || r.StageCount > MaxDepth || r.StageIndex < 0 || r.StageIndex >= r.StageCount:
			return invalid("routers", "stage %d of %d", r.StageIndex, r.StageCount)
		case r.First != next || r.MicroBatches < 1 || r.MicroBatches > MaxReduceMicroBatches:
			return invalid("routers", "replica %d: micro-batches [%d, %d+%d) after %d", i, r.First, r.First, r.MicroBatches, next)
		case r.Depth < 0 || r.Depth >= r.MicroBatches:
			return invalid("routers.depth", "%d for %d micro-batches", r.Depth, r.MicroBatches)
		}
		seen[r.Worker] = true
		next += r.MicroBatches
	}
	return nil
}

// OuterSync asks every stage of a plan of replicas in sync mode "outer" to take the outer step
// after training step Step (model.Outer): each sends the stages of the other participating
// replicas that hold its tensors what crosses — its θ_r, or with int8 compression its
// pseudo-gradient's codes and scales (OuterDeltaKey), signed (OuterSigKey) — and all take the same step.
// Participants are the replicas in the average, ascending: the coordinator records them, so that
// a replay takes the same step. Owners are the owners of the tensors' segments in the
// reduce-scatter (model.OuterSegment over len(Owners) segments, model.OuterOwners at the first
// attempt: several a participant, so that a lost one's spread over several survivors; omitted:
// Participants, one each).
//
// Without a delay (job.Sync.Delay) an outer step is taken in two phases, so that the loss of a
// participant during the exchange costs no restore: each stage exchanges, keeps the average
// without applying it and answers OuterDone; once every stage has, the coordinator sends
// OuterCommit and they apply it. A participant lost before that is left out of the step, which
// the coordinator asks again of the others with the next Attempt — the same Owners, but for the
// lost replica's segments, which go to survivors (model.OuterReassign). The exchange does not
// start over (client/outer.go, "an exchange that survives a departure"): what crossed stands, a
// segment averaged already keeps its average, and a survivor sends its contribution to a
// reassigned segment's new owner only. Each segment's average is over the participants of the
// attempt its owner took it in (OuterDone.Averaged), which the coordinator records for a replay.
// Each attempt has fewer participants, so there are fewer than MaxReplicas. With a delay the
// same two phases run beside training: each stage answers OuterDone once its exchange is over,
// the coordinator commits before any replica's step after the take-up (and before a checkpoint
// or an evaluation), and a redo is asked while the replicas train on.
type OuterSync struct {
	Step         uint64 `json:"step"`
	PlanVersion  uint32 `json:"plan_version"`
	Participants []int  `json:"participants"`
	Owners       []int  `json:"owners,omitempty"`
	// Lost are the replicas of the step's first attempt left out since (a redo's): the first
	// attempt's participants, whose segments Owners are, are Participants and Lost.
	Lost    []int `json:"lost,omitempty"`
	Attempt int   `json:"attempt,omitempty"`
}

// FirstParticipants are the participants of m's step's first attempt: Participants and Lost,
// ascending.
func (m *OuterSync) FirstParticipants() []int {
	if len(m.Lost) == 0 {
		return m.Participants
	}
	return slices.Sorted(slices.Values(append(slices.Clone(m.Participants), m.Lost...)))
}

// FirstOwners are the owners of the segments at m's step's first attempt: its participants
// (FirstParticipants) in turn, segment k the (k mod n)-th's (model.OuterOwners).
func (m *OuterSync) FirstOwners() []int {
	first := m.FirstParticipants()
	out := make([]int, len(m.SegmentOwners()))
	for k := range out {
		out[k] = first[k%len(first)]
	}
	return out
}

// SegmentOwners are m's owners of the segments of the reduce-scatter: Owners, or without them
// the participants, one segment each.
func (m *OuterSync) SegmentOwners() []int {
	if len(m.Owners) == 0 {
		return m.Participants
	}
	return m.Owners
}

func (*OuterSync) Type() MessageType { return TypeOuterSync }

func (m *OuterSync) Validate() error {
	if len(m.Participants) == 0 || len(m.Participants) > MaxReplicas {
		return invalid("participants", "%d replicas, want 1 to %d", len(m.Participants), MaxReplicas)
	}
	if m.Attempt < 0 || m.Attempt >= MaxReplicas {
		return invalid("attempt", "%d, want 0 to %d", m.Attempt, MaxReplicas-1)
	}
	for i, r := range m.Participants {
		if r < 0 || r >= MaxReplicas || (i > 0 && r <= m.Participants[i-1]) {
			return invalid("participants", "%v: want distinct replica indices in ascending order", m.Participants)
		}
	}
	if len(m.Owners) > MaxReplicas {
		return invalid("owners", "%d segments, want at most %d", len(m.Owners), MaxReplicas)
	}
	for i, r := range m.Lost {
		if _, in := slices.BinarySearch(m.Participants, r); in || r < 0 || r >= MaxReplicas || (i > 0 && r <= m.Lost[i-1]) {
			return invalid("lost", "%v: want distinct replica indices in ascending order, none a participant", m.Lost)
		}
	}
	if n := len(m.Participants) + len(m.Lost); len(m.Lost) > 0 && len(m.Owners) < n {
		return invalid("owners", "%d segments for the %d replicas of the first attempt", len(m.Owners), n)
	}
	for _, r := range m.Owners {
		if _, ok := slices.BinarySearch(m.Participants, r); !ok {
			return invalid("owners", "replica %d owns a segment and is no participant", r)
		}
	}
	return nil
}

// OuterEvidence is what proves a refused outer-step contribution (Error.Evidence): one chunk
// (model.OuterChunk values) of what the accused replica's stage sent of a tensor, as it crossed,
// and the same chunk of the global θ the receiver held, each with its Merkle path to the root
// that the sender's signature covers (package audit, "Outer commitments"). The coordinator checks
// the signature against the sender's key and the chunk against the bound that the receiver
// applied: whichever of the two lied is then known, with two replicas as with more.
type OuterEvidence struct {
	Sender string `json:"sender"` // the accused replica's worker that sent the tensor
	Tensor int    `json:"tensor"` // the tensor's index in the model (model.Config.Specs)
	Chunk  int    `json:"chunk"`  // the refused chunk of it
	// Segment is the chunks [first, end) of the tensor the sender signed (the reduce-scatter's
	// segment it sent the accuser, model.OuterSegment): the Merkle trees are over these.
	Segment [2]int `json:"segment"`
	// Average: the refused chunk is of the segment's owner's average in the all-gather, which
	// it signed as such, not of a contribution.
	Average   bool     `json:"average,omitempty"`
	Base      []byte   `json:"base"` // the chunk of the receiver's global θ, float32
	BasePath  [][]byte `json:"base_path"`
	Given     []byte   `json:"given"` // the chunk as sent: float32, or int8's scale and codes
	GivenPath [][]byte `json:"given_path"`
	// Entry is the segment's place among the Entries of the batch its sender signed at once
	// (audit.OuterEntry), EntryPath its Merkle path to the batch's root (the receiver has every
	// entry's leaf: OuterBatchSig).
	Entry     int      `json:"entry"`
	Entries   int      `json:"entries"`
	EntryPath [][]byte `json:"entry_path"`
	Signature []byte   `json:"signature"`
}

// Bounds of OuterEvidence: a chunk is at most OuterEvidenceChunk bytes (model.OuterChunk
// float32s), a Merkle path at most OuterEvidenceDepth hashes (2^48 chunks is beyond any tensor).
const (
	OuterEvidenceChunk = 4 * 256
	OuterEvidenceDepth = 48
)

func (e *OuterEvidence) validate() error {
	if err := checkID("evidence.sender", e.Sender); err != nil {
		return err
	}
	switch {
	case e.Tensor < 0 || e.Tensor > 1<<20 || e.Chunk < 0 || e.Chunk > 1<<40:
		return invalid("evidence", "tensor %d, chunk %d", e.Tensor, e.Chunk)
	case e.Segment[0] < 0 || e.Segment[0] > e.Chunk || e.Chunk >= e.Segment[1] || e.Segment[1] > 1<<40:
		return invalid("evidence.segment", "chunks [%d,%d), want the chunk %d among them", e.Segment[0], e.Segment[1], e.Chunk)
	case len(e.Base) == 0 || len(e.Base) > OuterEvidenceChunk || len(e.Base)%4 != 0:
		return invalid("evidence.base", "%d bytes, want float32s, at most %d bytes", len(e.Base), OuterEvidenceChunk)
	case len(e.Given) == 0 || len(e.Given) > OuterEvidenceChunk:
		return invalid("evidence.given", "%d bytes, want 1 to %d", len(e.Given), OuterEvidenceChunk)
	case len(e.Signature) != 64:
		return invalid("evidence.signature", "%d bytes, want 64 (Ed25519)", len(e.Signature))
	case e.Entries < 1 || e.Entries > MaxOuterBatch || e.Entry < 0 || e.Entry >= e.Entries:
		return invalid("evidence.entry", "entry %d of %d, want one of 1 to %d", e.Entry, e.Entries, MaxOuterBatch)
	}
	for _, p := range [][][]byte{e.BasePath, e.GivenPath, e.EntryPath} {
		if len(p) > OuterEvidenceDepth {
			return invalid("evidence", "a Merkle path of %d hashes, at most %d", len(p), OuterEvidenceDepth)
		}
		for _, h := range p {
			if len(h) != 32 {
				return invalid("evidence", "a Merkle path's hash of %d bytes, want 32", len(h))
			}
		}
	}
	return nil
}

// OuterDone is a stage's answer to OuterSync (with a delay, once its exchange is over): it holds the average of attempt
// Attempt of the outer step after step Step, checked and not yet applied (OuterSync).
type OuterDone struct {
	Step        uint64 `json:"step"`
	PlanVersion uint32 `json:"plan_version"`
	Attempt     int    `json:"attempt,omitempty"`
	// Averaged are the segments this stage owns and averaged (OuterSync.Owners), each with the
	// attempt whose participants the average is over: one of an earlier attempt than the last
	// keeps a replica lost since, whose contribution had crossed.
	Averaged []SegmentAveraged `json:"averaged,omitempty"`
}

// SegmentAveraged is a segment of the reduce-scatter (OuterDeltaKey.Segment) and the attempt of
// the outer step whose participants its owner averaged it over.
type SegmentAveraged struct {
	Segment int `json:"segment"`
	Attempt int `json:"attempt"`
}

func (*OuterDone) Type() MessageType { return TypeOuterDone }

func (m *OuterDone) Validate() error {
	if m.Attempt < 0 || m.Attempt >= MaxReplicas {
		return invalid("attempt", "%d, want 0 to %d", m.Attempt, MaxReplicas-1)
	}
	if len(m.Averaged) > MaxReplicas {
		return invalid("averaged", "%d segments, want at most %d", len(m.Averaged), MaxReplicas)
	}
	for i, a := range m.Averaged {
		switch {
		case a.Segment < 0 || a.Segment >= MaxReplicas || (i > 0 && a.Segment <= m.Averaged[i-1].Segment):
			return invalid("averaged", "segments %v: want distinct segments below %d, ascending", m.Averaged, MaxReplicas)
		case a.Attempt < 0 || a.Attempt > m.Attempt:
			return invalid("averaged", "segment %d averaged at attempt %d, after this one (%d)", a.Segment, a.Attempt, m.Attempt)
		}
	}
	return nil
}

// OuterCommit tells a stage that every stage of the outer step's participants holds attempt
// Attempt's average of the outer step after step Step: it applies it (OuterSync).
type OuterCommit struct {
	Step        uint64 `json:"step"`
	PlanVersion uint32 `json:"plan_version"`
	Attempt     int    `json:"attempt,omitempty"`
}

func (*OuterCommit) Type() MessageType { return TypeOuterCommit }

func (m *OuterCommit) Validate() error {
	if m.Attempt < 0 || m.Attempt >= MaxReplicas {
		return invalid("attempt", "%d, want 0 to %d", m.Attempt, MaxReplicas-1)
	}
	return nil
}
