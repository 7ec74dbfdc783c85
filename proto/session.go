package proto

// Heartbeat shows that its sender is alive. The receiver answers a heartbeat that is not an Ack
// with an Ack of the same Seq, so that each side can measure the round trip with its own clock.
type Heartbeat struct {
	Seq uint64 `json:"seq"`
	Ack bool   `json:"ack"`
}

func (*Heartbeat) Type() MessageType { return TypeHeartbeat }

func (*Heartbeat) Validate() error { return nil }

// ErrorCode classifies an Error for the program that receives it; the Message is for people.
type ErrorCode string

const (
	ErrCodeProtocol   ErrorCode = "protocol"    // version mismatch or malformed message; the connection closes
	ErrCodeNonFinite  ErrorCode = "non_finite"  // a shard's loss or gradients are NaN/Inf; the step is abandoned
	ErrCodeMemory     ErrorCode = "memory"      // the assigned shard does not fit
	ErrCodeStep       ErrorCode = "step"        // a step failed (neighbour lost, deadline)
	ErrCodeInternal   ErrorCode = "internal"    // a bug
	ErrCodeJobInvalid ErrorCode = "job_invalid" // the job spec cannot run on this worker
	ErrCodeForbidden  ErrorCode = "forbidden"   // a private job refused a worker without its join token
	ErrCodeBusy       ErrorCode = "busy"        // the coordinator is at its cap of workers (in all, or from this address): retry later
	ErrCodeBanned     ErrorCode = "banned"      // an audit found this worker's results false: it may not take part in the job again
	ErrCodeIdentity   ErrorCode = "identity"    // the worker did not prove it holds the key it claimed (proto.Proof)
	// ErrCodeOuterRefused: a replica's stage refused another replica's contribution to an outer
	// step (Error.Accused), which no honest replica could have sent; the step is abandoned.
	ErrCodeOuterRefused ErrorCode = "outer_refused"
)

// Error reports a failure to the other side. It is also a Go error, so a worker can return the
// coordinator's Error as is.
type Error struct {
	Code    ErrorCode `json:"code"`
	Message string    `json:"message"`
	// Step is the step the error belongs to, if any.
	Step *uint64 `json:"step,omitempty"`
	// PlanVersion is the plan whose data plane failed, or whose assignment the worker refused
	// (ErrCodeMemory), for a failure outside a step (0: not known). A worker can report a link of its previous plan failing after the coordinator has
	// sent the next one; the coordinator ignores reports of plans it has moved on from.
	PlanVersion uint32 `json:"plan_version,omitempty"`
	// Peer is, for a data-plane failure, the neighbour whose link failed: the coordinator tells
	// a link to a worker that has left (its departure answers it) from one between two that are
	// still there.
	Peer string `json:"peer,omitempty"`
	// Accused is the replica whose contribution was refused (ErrCodeOuterRefused only).
	Accused *uint32 `json:"accused,omitempty"`
	// Evidence proves the refusal (ErrCodeOuterRefused only): absent when the receiver has no
	// signed contribution to show (the sender's signature was missing or false).
	Evidence *OuterEvidence `json:"evidence,omitempty"`
}

func (*Error) Type() MessageType { return TypeError }

func (m *Error) Validate() error {
	if m.Code == "" || len(m.Code) > 64 {
		return invalid("code", "%s must be 1 to 64 bytes", quote(string(m.Code)))
	}
	for i := 0; i < len(m.Code); i++ {
		if c := m.Code[i]; !(c >= 'a' && c <= 'z' || c == '_') {
			return invalid("code", "%s may only use a-z and '_'", quote(string(m.Code)))
		}
	}
	if err := checkOptionalID("peer", m.Peer); err != nil {
		return err
	}
	if (m.Accused != nil) != (m.Code == ErrCodeOuterRefused) {
		return invalid("accused", "names a replica with code %s, and only then", ErrCodeOuterRefused)
	}
	if m.Evidence != nil {
		if m.Code != ErrCodeOuterRefused || m.Step == nil {
			return invalid("evidence", "comes with code %s and the step, and only then", ErrCodeOuterRefused)
		}
		if err := m.Evidence.validate(); err != nil {
			return err
		}
	}
	return checkText("message", m.Message, 4096)
}

func (m *Error) Error() string { return string(m.Code) + ": " + m.Message }

// Bye says that its sender is leaving on purpose (a drained worker, Stop pressed in a browser, a
// coordinator shutting down), so the other side can replan at once instead of waiting for
// heartbeats to run out.
type Bye struct {
	Reason string `json:"reason"`
}

// ByeDrain is the reason of a coordinator's Bye that asks a worker to leave for good (an admin's
// drain): it abandons its step cleanly and exits instead of reconnecting.
const ByeDrain = "drain"

func (*Bye) Type() MessageType { return TypeBye }

// Leaving says that a worker was asked to stop (a first SIGTERM) and would leave at the job's next
// step boundary, once what it holds is safe: the coordinator answers Bye{Reason: ByeDrain} when it
// may go — after a checkpoint of that step when it holds a shard — so that the job resumes where
// it left rather than replaying from the last periodic checkpoint.
type Leaving struct {
	Reason string `json:"reason"`
}

func (*Leaving) Type() MessageType { return TypeLeaving }

func (m *Leaving) Validate() error { return checkText("reason", m.Reason, 1024) }

func (m *Bye) Validate() error { return checkText("reason", m.Reason, 1024) }

// PeerLeft tells a worker that Worker, a peer of its plan PlanVersion, has left the job (its
// connection to the coordinator closed), so that what the worker waits for from it fails at once
// instead of when the link to it times out — a killed process and a slow one look alike on the
// data plane for many seconds. The coordinator sends it where a wait on the departed peer outlives
// the plan (outer mode: a replica dropped while the others may be exchanging with it). A worker
// acts on it only for a current neighbour of that very plan.
type PeerLeft struct {
	PlanVersion uint32 `json:"plan_version"`
	Worker      string `json:"worker"`
}

func (*PeerLeft) Type() MessageType { return TypePeerLeft }

func (m *PeerLeft) Validate() error { return checkID("worker", m.Worker) }

// Ready says that a worker holds the shard of plan PlanVersion — initialised or restored — and has
// opened its links to its neighbours: the coordinator may open steps.
type Ready struct {
	PlanVersion uint32 `json:"plan_version"`
	// State is, for a shard kept from the previous plan (Assign.Keep) in a job that audits, the
	// digest of the state kept (audit.StateDigest, base64url): the worker's commitment to how the previous
	// plan's last step ended, which the coordinator may audit that step against, and which its
	// first report under the new plan must commit to again.
	State string `json:"state,omitempty"`
	// Gave is, in outer mode for a worker that handed its stage's global θ and outer momentum to
	// takers (Assign.Give) in a job that audits, the digest of the state each taker starts from
	// (audit.StateDigest of the global θ with zero AdamW moments): the giver's word, which every
	// taker's Ready.State must equal.
	Gave string `json:"gave,omitempty"`
	// Sums are, for a worker that handed blocks of its stage over (Assign.Give) in a job that
	// audits, the value hash (audit.TensorSums) of each tensor of the state it gave from: in step
	// mode its kept state (the parameters and both moments, named as model.CheckpointTensors
	// names them), which compose to State; in outer mode its global θ, which with zero moments
	// compose to Gave. From them the coordinator composes the state each taker of several givers
	// must name (audit.ComposeState).
	Sums []KeyDigest `json:"sums,omitempty"`
}

// MaxReadySums bounds Ready.Sums: a stage's state tensors, three of each parameter tensor
// (a shard has at most MaxCommitEntries of those, as OuterBoundary bounds them).
const MaxReadySums = 3 * MaxCommitEntries

func (*Ready) Type() MessageType { return TypeReady }

func (m *Ready) Validate() error {
	if m.State != "" {
		if err := checkDigest("state", m.State); err != nil {
			return err
		}
	}
	if m.Gave != "" {
		if err := checkDigest("gave", m.Gave); err != nil {
			return err
		}
	}
	return checkTensorSums("sums", m.Sums, MaxReadySums)
}

// Checkpoint asks a worker to upload its shard as it stands after Step steps: a safetensors file
// (model tensors and Adam's moments) POSTed to UploadPath on the coordinator's HTTP server.
type Checkpoint struct {
	ID         int64  `json:"id"`
	Step       uint64 `json:"step"`
	Shard      string `json:"shard"`
	UploadPath string `json:"upload_path"`
	// Global: in outer mode, the stage uploads the global part of its tensors (the global θ, the
	// outer momentum and error feedback) beside its replica's own. The coordinator asks it of one
	// replica's stages — every replica holds the same global part — and accepts the upload only
	// with exactly the parts it asked for.
	Global bool `json:"global,omitempty"`
	// GlobalReplica is, in outer mode, the replica whose stages upload the global part (Global):
	// with int8 the others' stages send it their segments of the average's error feedback first,
	// which only their owner holds (model.Outer.Participate).
	GlobalReplica int `json:"global_replica,omitempty"`
	// Live are, in outer mode, the replicas whose stages take part in the checkpoint (those not
	// dropped): an owner not among them has no segments to send, and they are lost.
	Live []int `json:"live,omitempty"`
}

func (*Checkpoint) Type() MessageType { return TypeCheckpoint }

func (m *Checkpoint) Validate() error {
	if m.ID <= 0 {
		return invalid("id", "%d, want > 0", m.ID)
	}
	if err := checkText("shard", m.Shard, 256); err != nil {
		return err
	}
	if len(m.UploadPath) == 0 || m.UploadPath[0] != '/' {
		return invalid("upload_path", "%s must be an absolute path on the coordinator", quote(m.UploadPath))
	}
	return checkText("upload_path", m.UploadPath, 1024)
}
