package proto

// StepSpec is what a shard needs to know about the step being opened: the fields of StepOpen that
// name its tensors and shape its schedule. It lives here rather than in client because the
// coordinator names the same tensors when it sends each micro-batch's tokens and targets, and the
// coordinator must not import the worker runtime (docs/design.md, "Packages").
type StepSpec struct {
	Step         uint64
	PlanVersion  uint32
	MicroBatches int // M
	Rows         int // sequences per micro-batch, B/M
	// Reroutes are the step's reroutes (StepReroute.Shares, in order), for a recomputation of a
	// step that had some: a stage applies them where a live one does, after its own micro-batches.
	// A live stage hears of them while it runs and leaves this nil.
	Reroutes [][]ReplicaShare
	// Takeover is the stage takeover of the step's first reroute (StepReroute.Stage, whose
	// Shares are Reroutes[0]), for a recomputation: the lost stage's pool takes it up where a
	// live one does, after its own micro-batches, and the lost stage's neighbours send to its
	// taker from the start (what a live neighbour sent the lost stage before it left, it sent
	// the taker again: audit.Outcome.Moved). Live stages leave it nil.
	Takeover *StageTakeover
}

// EvalStep is the step number under which an evaluation after training step s moves its tensors:
// the top bit keeps them apart from the training step's own. Coordinator and stages must agree on
// it, or the stages would wait for tokens that never come.
func EvalStep(s uint64) uint64 { return s | evalBit }

// TrainingStep is the step a step number names: s itself, or the step after which the evaluation
// EvalStep(s) runs. For messages people read.
func TrainingStep(s uint64) uint64 { return s &^ evalBit }

// evalBit marks an evaluation's step number: no training step comes near it.
const evalBit = 1 << 63

// TokensKey names micro-batch mb's input tokens, which the coordinator sends to the first stage.
func TokensKey(st StepSpec, mb int) TensorKey {
	return TokenKey{Kind: KindTokens, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: mb}.Key()
}

// TargetsKey names micro-batch mb's targets, which the coordinator sends to the last stage.
func TargetsKey(st StepSpec, mb int) TensorKey {
	return TokenKey{Kind: KindTargets, PlanVersion: st.PlanVersion, Step: st.Step, MicroBatch: mb}.Key()
}

// TokenTensors returns the tokens and targets tensors of micro-batch mb (rows × T int32 each),
// as the coordinator sends them to the first and last stage.
func TokenTensors(st StepSpec, mb, T int, tokens, targets []int32) (Tensor, Tensor, error) {
	sh, err := ShapeOf(st.Rows, T)
	if err != nil {
		return Tensor{}, Tensor{}, err
	}
	x := Tensor{Key: TokensKey(st, mb), DType: I32, Shape: sh, Data: AppendInt32s(nil, tokens)}
	y := Tensor{Key: TargetsKey(st, mb), DType: I32, Shape: sh, Data: AppendInt32s(nil, targets)}
	return x, y, nil
}
