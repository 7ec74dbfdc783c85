package proto

import (
	"math"
	"sort"
)

// StepOpen starts step Step under plan PlanVersion on every shard. The first stage then receives
// KindTokens frames and the last stage KindTargets frames, one per micro-batch, from the
// coordinator; everything else a stage needs (config, seed, B, M, weight decay) came with Assign.
type StepOpen struct {
	Step        uint64 `json:"step"`
	PlanVersion uint32 `json:"plan_version"`
	// LR is lr_s, the learning rate of this step with warm-up and cosine decay already applied
	// (docs/design.md, "A training step"), so that every shard uses the very same float64.
	LR float64 `json:"lr"`
	// MicroBatches is M, repeated from the job so that a stage can refuse a step it would
	// schedule differently from its neighbours.
	MicroBatches int `json:"micro_batches"`
	// DeadlineMS is how long the step may take before the coordinator abandons it; a stage
	// waiting for a neighbour longer than this gives up on the step.
	DeadlineMS int64 `json:"deadline_ms"`
	// Rows is the number of sequences in each micro-batch (B/M for a training step).
	Rows int `json:"rows"`
	// Eval asks for forward passes only: the validation loss. The last stage reports CE per
	// micro-batch; nothing is accumulated, reported as gradients, or applied.
	Eval bool `json:"eval"`
}

func (*StepOpen) Type() MessageType { return TypeStepOpen }

func (m *StepOpen) Validate() error {
	switch {
	case !(m.LR >= 0) || math.IsInf(m.LR, 0):
		return invalid("lr", "%v, want a finite number >= 0", m.LR)
	case m.MicroBatches < 1:
		return invalid("micro_batches", "%d, want >= 1", m.MicroBatches)
	case m.DeadlineMS <= 0:
		return invalid("deadline_ms", "%d, want > 0", m.DeadlineMS)
	case m.Rows < 1 || m.Rows > 1<<16:
		return invalid("rows", "%d, want in [1, 65536]", m.Rows)
	}
	return nil
}

// BlockAux is the Switch load-balancing loss of one MoE block, one value per micro-batch.
type BlockAux struct {
	Block int       `json:"block"`
	Aux   []float64 `json:"aux"`
}

// Timings is where a shard's time went in one step, in nanoseconds.
type Timings struct {
	ForwardNS  int64 `json:"forward_ns"`
	BackwardNS int64 `json:"backward_ns"`
	// WaitNS is time blocked on neighbours (activations, gradients, expert outputs): the
	// pipeline bubble plus slow links.
	WaitNS int64 `json:"wait_ns"`
	// TransferNS is time spent handing tensors to the network (sends, with back-pressure).
	TransferNS int64 `json:"transfer_ns"`
	// TotalNS is from StepOpen to this report.
	TotalNS int64 `json:"total_ns"`
	// BytesSent is the tensor payload this shard sent to other workers during the step.
	BytesSent int64 `json:"bytes_sent"`
}

// StepReport is a shard's result of a step after its last backward: what the coordinator needs to
// compute the clip factor and to record the step. Every value is finite: a shard that finds a NaN
// or Inf sends an Error with code ErrCodeNonFinite instead (JSON cannot carry NaN, and the step
// must not be applied).
type StepReport struct {
	Step        uint64 `json:"step"`
	PlanVersion uint32 `json:"plan_version"`
	// GradSq is ‖g‖², the sum of squared gradient entries, of every tensor of the shard, by tensor
	// name, accumulated in float64. The coordinator adds them in tensor-name order. float64
	// survives JSON exactly (encoding/json writes the shortest representation that round-trips).
	GradSq map[string]float64 `json:"grad_sq"`
	// CE is the last stage's cross-entropy of each micro-batch, in micro-batch order; empty on
	// other shards.
	CE []float64 `json:"ce"`
	// Aux is the balancing loss of each MoE block of a stage shard, in block order.
	Aux     []BlockAux `json:"aux"`
	Timings Timings    `json:"timings"`
	// Eval marks the report of an evaluation (forward only): it carries CE and no gradients.
	Eval bool `json:"eval"`
	// Routed is, for each MoE block of a stage, the token assignments per expert over the step's
	// micro-batches: the router statistics expert placement follows.
	Routed []BlockRouting `json:"routed,omitempty"`
	// Commit is the shard's commitment to the step (training steps of a job that audits; nil
	// otherwise, and for evaluations).
	Commit *Commit `json:"commit,omitempty"`
	// Reroutes is how many of the step's StepReroutes the report includes: the coordinator takes
	// only a report that includes every one it sent.
	Reroutes int `json:"reroutes,omitempty"`
}

// BlockRouting counts the tokens the router of MoE block Block sent to each expert.
type BlockRouting struct {
	Block  int   `json:"block"`
	Tokens []int `json:"tokens"`
}

func (*StepReport) Type() MessageType { return TypeStepReport }

// maxTensorName bounds a tensor name (nanoGPT's are under 50 bytes).
const maxTensorName = 256

func (m *StepReport) Validate() error {
	if len(m.GradSq) == 0 && !m.Eval {
		return invalid("grad_sq", "empty: every shard holds at least one tensor")
	}
	names := make([]string, 0, len(m.GradSq))
	for name := range m.GradSq {
		names = append(names, name)
	}
	sort.Strings(names) // the first bad name is reported the same way every time
	for _, name := range names {
		if err := checkTensorName(name); err != nil {
			return err
		}
		if v := m.GradSq[name]; !(v >= 0) || math.IsInf(v, 0) {
			return invalid("grad_sq", "%s is %v, want finite and >= 0", quote(name), v)
		}
	}
	for i, v := range m.CE {
		if !(v >= 0) || math.IsInf(v, 0) {
			return invalid("ce", "micro-batch %d is %v, want finite and >= 0", i, v)
		}
	}
	for i, a := range m.Aux {
		if a.Block < 0 || i > 0 && a.Block <= m.Aux[i-1].Block {
			return invalid("aux", "blocks must be distinct, non-negative and in order")
		}
		if len(a.Aux) == 0 {
			return invalid("aux", "block %d has no values", a.Block)
		}
		for j, v := range a.Aux {
			if !(v >= 0) || math.IsInf(v, 0) {
				return invalid("aux", "block %d micro-batch %d is %v, want finite and >= 0", a.Block, j, v)
			}
		}
	}
	if m.Commit != nil {
		if m.Eval {
			return invalid("commit", "an evaluation commits to nothing")
		}
		if err := m.Commit.Validate(); err != nil {
			return err
		}
	}
	if m.Reroutes < 0 || m.Reroutes > MaxReroutes {
		return invalid("reroutes", "%d, want in [0, %d]", m.Reroutes, MaxReroutes)
	}
	t := m.Timings
	if t.ForwardNS < 0 || t.BackwardNS < 0 || t.WaitNS < 0 || t.TotalNS < 0 {
		return invalid("timings", "negative duration")
	}
	return nil
}

// checkTensorName validates a tensor name: 1 to 256 of [A-Za-z0-9._-], as nanoGPT's names
// ("transformer.h.1.mlp.experts.3.c_fc.weight").
func checkTensorName(s string) error {
	if s == "" || len(s) > maxTensorName {
		return invalid("grad_sq", "tensor name %s must be 1 to %d bytes", quote(s), maxTensorName)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return invalid("grad_sq", "tensor name %s may only use letters, digits, '.', '_' and '-'", quote(s))
		}
	}
	return nil
}

// Clip closes step Step: every shard multiplies its gradients by Factor = min(1, clip/(‖g‖+1e-6))
// and applies AdamW.
type Clip struct {
	Step        uint64  `json:"step"`
	PlanVersion uint32  `json:"plan_version"`
	Factor      float64 `json:"factor"`
}

func (*Clip) Type() MessageType { return TypeClip }

func (m *Clip) Validate() error {
	if !(m.Factor >= 0 && m.Factor <= 1) {
		return invalid("factor", "%v, want in [0, 1]", m.Factor)
	}
	return nil
}

// StepReroute says that the pipeline replicas not in Shares were lost during step Step of plan
// PlanVersion, before anyone applied it: every stage of a surviving replica computes the
// micro-batches its replica's share now holds as well as those it had (the lost replicas' runs
// split between their surviving neighbours, so that each share stays one contiguous run, in replica
// order), keeps the gradient nodes it has made, and reduces with the survivors only. The step's
// bits are unchanged: the same micro-batches summed in the same tree (docs/design.md, "Replicas and
// synchronisation"). A stage that reported the step already computes the rest and reports it
// again. Attempt is the step's reroutes so far, this one included (1, 2, …): the reports say how
// many they include (StepReport.Reroutes).
//
// With Stage set, the reroute is a stage takeover (StageTakeover): only one stage was lost, and
// Shares are the runs of the stages holding its blocks, which reduce together.
type StepReroute struct {
	Step        uint64         `json:"step"`
	PlanVersion uint32         `json:"plan_version"`
	Attempt     int            `json:"attempt"`
	Shares      []ReplicaShare `json:"shares"`
	Stage       *StageTakeover `json:"stage,omitempty"`
}

// StageTakeover narrows a StepReroute to one stage (issue 30, stage pools): the stage of blocks
// [Begin, End) of replica Replica, held by worker Lost, was lost during the step, and Taker — the
// stage of the same blocks in the replica beside it in micro-batch order — computes Replica's
// micro-batches [First, First+MicroBatches) at those blocks, after its own, with the lost stage's
// neighbours Prev and Next ("" at a pipeline's end, where the coordinator sends the tokens or the
// targets) in its pipeline. Those two send the taker what they sent the lost stage, from the
// step's first micro-batch on — each tensor once — and take what it sends them, a tensor they
// hold already counting for nothing. Every other stage of the lost replica keeps its run and its
// work; the reduction of blocks [Begin, End) leaves the lost stage out and takes the taker's
// widened run (Shares); the stages of other blocks compute nothing more. The bits are the single
// process's: the same micro-batches, through stages holding the same parameters, summed in the
// same tree.
type StageTakeover struct {
	Begin        int    `json:"begin"`
	End          int    `json:"end"`
	Replica      int    `json:"replica"`
	Lost         string `json:"lost"`
	Taker        string `json:"taker"`
	Prev         string `json:"prev,omitempty"`
	Next         string `json:"next,omitempty"`
	First        int    `json:"first"`
	MicroBatches int    `json:"micro_batches"`
}

// ReplicaShare is replica Replica's micro-batches of a step: [First, First+MicroBatches).
type ReplicaShare struct {
	Replica      int `json:"replica"`
	First        int `json:"first"`
	MicroBatches int `json:"micro_batches"`
}

// MaxReroutes bounds a step's reroutes: each loses a replica; beyond this many in one step the
// coordinator reshares instead (the survivors compute the step again under a new plan).
const MaxReroutes = 64

func (*StepReroute) Type() MessageType { return TypeStepReroute }

func (m *StepReroute) Validate() error {
	switch {
	case m.Attempt < 1 || m.Attempt > MaxReroutes:
		return invalid("attempt", "%d, want in [1, %d]", m.Attempt, MaxReroutes)
	case len(m.Shares) == 0 || len(m.Shares) > maxReplicaShares:
		return invalid("shares", "%d replicas, want 1 to %d", len(m.Shares), maxReplicaShares)
	}
	if err := CheckShares(m.Shares, -1); err != nil {
		return err
	}
	if t := m.Stage; t != nil {
		return t.validate(m.Shares)
	}
	return nil
}

func (t *StageTakeover) validate(shares []ReplicaShare) error {
	for _, id := range []struct{ field, id string }{{"stage.lost", t.Lost}, {"stage.taker", t.Taker}} {
		if err := checkID(id.field, id.id); err != nil {
			return err
		}
	}
	for _, id := range []struct{ field, id string }{{"stage.prev", t.Prev}, {"stage.next", t.Next}} {
		if err := checkOptionalID(id.field, id.id); err != nil {
			return err
		}
	}
	last := shares[len(shares)-1]
	switch {
	case t.Begin < 0 || t.End <= t.Begin:
		return invalid("stage", "blocks [%d,%d)", t.Begin, t.End)
	case t.Lost == t.Taker || t.Prev != "" && (t.Prev == t.Lost || t.Prev == t.Taker) || t.Next != "" && (t.Next == t.Lost || t.Next == t.Taker):
		return invalid("stage", "the lost stage, its taker and its neighbours must be four workers")
	case t.Prev != "" && t.Prev == t.Next:
		return invalid("stage", "the lost stage's neighbours must differ")
	case t.MicroBatches < 1 || t.First < 0 || t.First+t.MicroBatches > last.First+last.MicroBatches:
		return invalid("stage", "the lost run [%d,%d)", t.First, t.First+t.MicroBatches)
	}
	for _, s := range shares {
		if s.Replica == t.Replica {
			return invalid("stage", "replica %d lost its stage, and has a share", t.Replica)
		}
		// The taker's widened run holds the lost one whole.
		if s.First <= t.First && t.First+t.MicroBatches <= s.First+s.MicroBatches {
			return nil
		}
	}
	return invalid("stage", "no share holds the lost run [%d,%d)", t.First, t.First+t.MicroBatches)
}

// maxReplicaShares bounds the replicas a reroute lists.
const maxReplicaShares = 4096

// CheckShares checks that shares are replicas in increasing index order whose micro-batches are
// contiguous runs tiling [0, M) in that order (M < 0: whatever the last one ends at).
func CheckShares(shares []ReplicaShare, M int) error {
	next := 0
	for i, s := range shares {
		switch {
		case s.Replica < 0 || i > 0 && s.Replica <= shares[i-1].Replica:
			return invalid("shares", "replicas must be distinct, non-negative and in order")
		case s.First != next || s.MicroBatches < 1:
			return invalid("shares", "replica %d's micro-batches [%d,%d) do not follow on from %d", s.Replica, s.First, s.First+s.MicroBatches, next)
		}
		next = s.First + s.MicroBatches
	}
	if M >= 0 && next != M {
		return invalid("shares", "the replicas' micro-batches end at %d, want %d", next, M)
	}
	return nil
}
