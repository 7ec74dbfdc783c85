package proto

import (
	"encoding/binary"
	"fmt"
)

// Typed keys (docs/design.md, "Wire"). Every frame kind names its tensor with the same header
// fields (TensorKey: micro-batch, block, expert), but what they hold depends on the kind: a
// gradient-tree node's range, a model tensor's index, a replica, a part. Each family of kinds has
// a key type of its own whose fields say what they mean; its Key method packs it into the header's
// fields and its parser (ParseStageKey, …) unpacks a TensorKey, refusing one of another kind or
// with a field out of range. A frame's header is accepted only if its kind's parser accepts it
// (DecodeFrame, AppendFrame), so a receiver can parse any key it is given without checking again.
//
// Key never names another tensor than the typed key does: for a typed key with a field out of
// range it returns a key that no parser accepts, which AppendFrame refuses, so a bug surfaces
// where the tensor is sent rather than as a tensor nobody waits for.

// TypedKey is a tensor's key as its kind reads it: StageKey, TokenKey, ExpertKey, GradReduceKey,
// OuterDeltaKey, OuterSigKey or StateKey.
type TypedKey interface {
	Key() TensorKey
	String() string
}

// ParseKey parses k with its kind's parser. The family parsers allocate nothing; ParseKey's
// interface does.
func ParseKey(k TensorKey) (TypedKey, error) {
	switch k.Kind {
	case KindActivation, KindActivationGrad:
		return ParseStageKey(k)
	case KindTokens, KindTargets:
		return ParseTokenKey(k)
	case KindExpertIn, KindExpertOut, KindExpertGradIn, KindExpertGradOut:
		return ParseExpertKey(k)
	case KindGradReduce:
		return ParseGradReduceKey(k)
	case KindOuterDelta:
		return ParseOuterDeltaKey(k)
	case KindOuterSig:
		return ParseOuterSigKey(k)
	case KindState:
		return ParseStateKey(k)
	}
	return nil, fmt.Errorf("%w: unknown kind %d", ErrBadHeader, uint8(k.Kind))
}

// badKey is the error of a parser refusing k.
func badKey(k TensorKey, format string, args ...any) error {
	return fmt.Errorf("%w: %v frame (mb %d, block %d, expert %d): %s", ErrBadHeader, k.Kind, k.MicroBatch, k.Block, k.Expert, fmt.Sprintf(format, args...))
}

// wantKind refuses k when its kind is none of kinds.
func wantKind(k TensorKey, kinds ...Kind) error {
	for _, x := range kinds {
		if k.Kind == x {
			return nil
		}
	}
	want := ""
	for i, x := range kinds { // not kinds itself, which would escape: DecodeFrame allocates nothing
		if i > 0 {
			want += " or "
		}
		want += x.String()
	}
	return fmt.Errorf("%w: a key of kind %v, want %s", ErrBadHeader, k.Kind, want)
}

// invalidKey is what Key returns for a typed key with a field out of range: every kind's parser
// refuses a block of NoBlock with an expert of 0 (tokens want NoExpert, the others a block).
func invalidKey(kind Kind, plan uint32, step uint64) TensorKey {
	return TensorKey{Kind: kind, PlanVersion: plan, Step: step, Block: NoBlock, Expert: 0}
}

// inU32 reports whether x fits a header field below limit (exclusive); limit 0 means any uint32
// but the field's "none" value, ^uint32(0).
func inU32(x int, limit uint64) bool {
	if limit == 0 {
		limit = uint64(^uint32(0))
	}
	return x >= 0 && uint64(x) < limit
}

// StageKey names a tensor that crosses a pipeline boundary: micro-batch MicroBatch's activation
// (KindActivation), sent forward into the stage whose first block is Block, or the gradient with
// respect to it (KindActivationGrad), sent back from that stage.
type StageKey struct {
	Kind        Kind // KindActivation or KindActivationGrad
	PlanVersion uint32
	Step        uint64
	MicroBatch  int
	Block       int
}

func (s StageKey) check() error {
	switch {
	case s.Kind != KindActivation && s.Kind != KindActivationGrad:
		return fmt.Errorf("%v is not a stage kind", s.Kind)
	case !inU32(s.MicroBatch, 1<<32):
		return fmt.Errorf("micro-batch %d", s.MicroBatch)
	case !inU32(s.Block, 0):
		return fmt.Errorf("block %d", s.Block)
	}
	return nil
}

// Key is s on the wire.
func (s StageKey) Key() TensorKey {
	if s.check() != nil {
		return invalidKey(s.Kind, s.PlanVersion, s.Step)
	}
	return TensorKey{Kind: s.Kind, PlanVersion: s.PlanVersion, Step: s.Step, MicroBatch: uint32(s.MicroBatch), Block: uint32(s.Block), Expert: NoExpert}
}

func (s StageKey) String() string {
	return fmt.Sprintf("%v plan %d step %d mb %d block %d", s.Kind, s.PlanVersion, s.Step, s.MicroBatch, s.Block)
}

// ParseStageKey parses an activation's or activation gradient's key.
func ParseStageKey(k TensorKey) (StageKey, error) {
	if err := wantKind(k, KindActivation, KindActivationGrad); err != nil {
		return StageKey{}, err
	}
	if k.Block == NoBlock || k.Expert != NoExpert {
		return StageKey{}, badKey(k, "want a block and no expert")
	}
	return StageKey{Kind: k.Kind, PlanVersion: k.PlanVersion, Step: k.Step, MicroBatch: int(k.MicroBatch), Block: int(k.Block)}, nil
}

// TokenKey names micro-batch MicroBatch's input token ids (KindTokens), which the coordinator
// sends the first stage, or its targets (KindTargets), sent to the last.
type TokenKey struct {
	Kind        Kind // KindTokens or KindTargets
	PlanVersion uint32
	Step        uint64
	MicroBatch  int
}

func (t TokenKey) check() error {
	switch {
	case t.Kind != KindTokens && t.Kind != KindTargets:
		return fmt.Errorf("%v is not a token kind", t.Kind)
	case !inU32(t.MicroBatch, 1<<32):
		return fmt.Errorf("micro-batch %d", t.MicroBatch)
	}
	return nil
}

// Key is t on the wire.
func (t TokenKey) Key() TensorKey {
	if t.check() != nil {
		return invalidKey(t.Kind, t.PlanVersion, t.Step)
	}
	return TensorKey{Kind: t.Kind, PlanVersion: t.PlanVersion, Step: t.Step, MicroBatch: uint32(t.MicroBatch), Block: NoBlock, Expert: NoExpert}
}

func (t TokenKey) String() string {
	return fmt.Sprintf("%v plan %d step %d mb %d", t.Kind, t.PlanVersion, t.Step, t.MicroBatch)
}

// ParseTokenKey parses a micro-batch's tokens' or targets' key.
func ParseTokenKey(k TensorKey) (TokenKey, error) {
	if err := wantKind(k, KindTokens, KindTargets); err != nil {
		return TokenKey{}, err
	}
	if k.Block != NoBlock || k.Expert != NoExpert {
		return TokenKey{}, badKey(k, "want no block and no expert")
	}
	return TokenKey{Kind: k.Kind, PlanVersion: k.PlanVersion, Step: k.Step, MicroBatch: int(k.MicroBatch)}, nil
}

// ExpertGroups is the number of token groups an expert's rows of a micro-batch travel in
// (model.ExpertGroups, which package client holds equal to it): group r goes to replica r of a
// replicated expert, both to a whole one.
const ExpertGroups = 2

// ExpertKey names rows exchanged between a stage and the host of expert Expert of MoE block
// Block: token group Group of micro-batch MicroBatch, of any of the four expert kinds.
//
// Partial marks the other form, of KindExpertGradOut only: replica Group's partial gradient of
// the expert's parameters (its node of the gradient tree, model.GroupHalf), which the expert's two
// replicas exchange after the step's last backward. It belongs to no micro-batch: MicroBatch is 0.
//
// On the wire the micro-batch field holds MicroBatch·ExpertGroups + Group, so a micro-batch's
// groups are separate tensors, or for a partial gradient PartialBit | Group.
type ExpertKey struct {
	Kind        Kind
	PlanVersion uint32
	Step        uint64
	MicroBatch  int
	Group       int
	Block       int
	Expert      int
	Partial     bool
}

// PartialBit marks the micro-batch field of a partial gradient's key (ExpertKey.Partial), apart
// from the rows of any micro-batch, whose field stays below it.
const PartialBit = 1 << 31

// MaxExpertMicroBatch bounds an expert key's micro-batch: its field, ·ExpertGroups + group, stays
// below PartialBit.
const MaxExpertMicroBatch = PartialBit/ExpertGroups - 1

func (e ExpertKey) check() error {
	switch {
	case !e.Kind.isExpert():
		return fmt.Errorf("%v is not an expert kind", e.Kind)
	case e.Partial && e.Kind != KindExpertGradOut:
		return fmt.Errorf("a partial gradient of kind %v", e.Kind)
	case e.Partial && e.MicroBatch != 0:
		return fmt.Errorf("a partial gradient of micro-batch %d", e.MicroBatch)
	case e.MicroBatch < 0 || e.MicroBatch > MaxExpertMicroBatch:
		return fmt.Errorf("micro-batch %d", e.MicroBatch)
	case e.Group < 0 || e.Group >= ExpertGroups:
		return fmt.Errorf("group %d", e.Group)
	case !inU32(e.Block, 0):
		return fmt.Errorf("block %d", e.Block)
	case !inU32(e.Expert, 0):
		return fmt.Errorf("expert %d", e.Expert)
	}
	return nil
}

// Key is e on the wire.
func (e ExpertKey) Key() TensorKey {
	if e.check() != nil {
		return invalidKey(e.Kind, e.PlanVersion, e.Step)
	}
	mb := uint32(e.MicroBatch*ExpertGroups + e.Group)
	if e.Partial {
		mb = PartialBit | uint32(e.Group)
	}
	return TensorKey{Kind: e.Kind, PlanVersion: e.PlanVersion, Step: e.Step, MicroBatch: mb, Block: uint32(e.Block), Expert: uint32(e.Expert)}
}

func (e ExpertKey) String() string {
	if e.Partial {
		return fmt.Sprintf("%v plan %d step %d partial gradient of group %d block %d expert %d", e.Kind, e.PlanVersion, e.Step, e.Group, e.Block, e.Expert)
	}
	return fmt.Sprintf("%v plan %d step %d mb %d group %d block %d expert %d", e.Kind, e.PlanVersion, e.Step, e.MicroBatch, e.Group, e.Block, e.Expert)
}

// ParseExpertKey parses the key of an expert's rows or of a replica's partial gradient.
func ParseExpertKey(k TensorKey) (ExpertKey, error) {
	if err := wantKind(k, KindExpertIn, KindExpertOut, KindExpertGradIn, KindExpertGradOut); err != nil {
		return ExpertKey{}, err
	}
	if k.Block == NoBlock || k.Expert == NoExpert {
		return ExpertKey{}, badKey(k, "want a block and an expert")
	}
	e := ExpertKey{Kind: k.Kind, PlanVersion: k.PlanVersion, Step: k.Step, Block: int(k.Block), Expert: int(k.Expert)}
	if k.MicroBatch&PartialBit == 0 {
		e.MicroBatch, e.Group = int(k.MicroBatch/ExpertGroups), int(k.MicroBatch%ExpertGroups)
		return e, nil
	}
	e.Partial, e.Group = true, int(k.MicroBatch&^PartialBit)
	switch {
	case k.Kind != KindExpertGradOut:
		return ExpertKey{}, badKey(k, "a partial gradient is an %v frame", KindExpertGradOut)
	case e.Group >= ExpertGroups:
		return ExpertKey{}, badKey(k, "a partial gradient of group %d, want below %d", e.Group, ExpertGroups)
	}
	return e, nil
}

// GradReduceKey names node [Lo, Hi) of the gradient tree (model/gradtree.go) of the model's tensor
// number Tensor (its index in the model's tensor order, model.Config.Specs) that replica Replica's
// stage sends the other replicas' stages holding the tensor (KindGradReduce, step mode).
//
// On the wire the micro-batch field holds Lo<<16 | Hi, the block field Tensor and the expert
// field Replica.
type GradReduceKey struct {
	PlanVersion uint32
	Step        uint64
	Tensor      int
	Replica     int
	Lo, Hi      int
}

// MaxModelTensors bounds a model tensor's index in the keys that carry one (GradReduceKey,
// OuterDeltaKey, OuterSigKey): far more than any model has.
const MaxModelTensors = 1 << 20

// MaxReduceMicroBatches bounds the micro-batches of a step whose gradients travel as
// KindGradReduce frames: a node's range is two 16-bit halves of the key.
const MaxReduceMicroBatches = 1<<16 - 1

func (g GradReduceKey) check() error {
	switch {
	case !inU32(g.Tensor, MaxModelTensors):
		return fmt.Errorf("tensor %d, want below %d", g.Tensor, MaxModelTensors)
	case !inU32(g.Replica, MaxReplicas):
		return fmt.Errorf("replica %d, want below %d", g.Replica, MaxReplicas)
	case g.Lo < 0 || g.Hi <= g.Lo || g.Hi > MaxReduceMicroBatches:
		return fmt.Errorf("node [%d,%d), want 0 ≤ lo < hi ≤ %d", g.Lo, g.Hi, MaxReduceMicroBatches)
	}
	return nil
}

// Key is g on the wire.
func (g GradReduceKey) Key() TensorKey {
	if g.check() != nil {
		return invalidKey(KindGradReduce, g.PlanVersion, g.Step)
	}
	return TensorKey{Kind: KindGradReduce, PlanVersion: g.PlanVersion, Step: g.Step,
		MicroBatch: uint32(g.Lo)<<16 | uint32(g.Hi), Block: uint32(g.Tensor), Expert: uint32(g.Replica)}
}

func (g GradReduceKey) String() string {
	return fmt.Sprintf("%v plan %d step %d tensor %d node [%d,%d) from replica %d", KindGradReduce, g.PlanVersion, g.Step, g.Tensor, g.Lo, g.Hi, g.Replica)
}

// ParseGradReduceKey parses the key of a node of a tensor's gradient tree.
func ParseGradReduceKey(k TensorKey) (GradReduceKey, error) {
	if err := wantKind(k, KindGradReduce); err != nil {
		return GradReduceKey{}, err
	}
	g := GradReduceKey{PlanVersion: k.PlanVersion, Step: k.Step, Tensor: int(k.Block), Replica: int(k.Expert),
		Lo: int(k.MicroBatch >> 16), Hi: int(k.MicroBatch & 0xffff)}
	if err := g.check(); err != nil {
		return GradReduceKey{}, badKey(k, "%v", err)
	}
	return g, nil
}

// OuterDeltaKey names part Part of what replica Replica's stage sends of the model's tensor number
// Tensor at the outer step after step Step (KindOuterDelta), as model.OuterLayout lays it out: θ_r
// as float32 (part 0), or with int8 compression the tensor's full chunks of model.OuterChunk
// values as one I8 matrix (part 0) and its last, shorter chunk as a one-row matrix (part 1), each
// only when the tensor has it. The sender's signature of the parts travels beside them (OuterSigKey).
//
// On the wire the micro-batch field holds Part, the block field Tensor and the expert field
// Replica.
type OuterDeltaKey struct {
	PlanVersion uint32
	Step        uint64
	Tensor      int
	Replica     int
	Part        int
	// Segment is the segment of the tensor the part is of (OuterSync.Owners; model.OuterSegment):
	// a contribution to its owner, or that owner's average of it. A segment's contribution is the
	// same in every attempt of the outer step, and its average is taken once, by its last owner,
	// so no attempt is named. On the wire the micro-batch field holds Part + OuterParts·Segment.
	Segment int
}

// OuterParts is how many parts an outer step's tensor crosses in (OuterDeltaKey.Part): a
// replica's contribution to the owner of a segment in the reduce-scatter in parts 0 and 1, the
// owner's average of its segment in the all-gather in parts OuterAveragePart and
// OuterAveragePart+1 (each laid out by model.OuterLayout over the segment), and at a checkpoint
// the owner's error feedback of the average of its segment, float32, in part OuterErrPart.
const OuterParts = 5

// Parts of OuterDeltaKey beyond a contribution's (OuterParts).
const (
	OuterAveragePart = 2
	OuterErrPart     = 4
)

func checkOuter(tensor, replica int) error {
	switch {
	case !inU32(tensor, MaxModelTensors):
		return fmt.Errorf("tensor %d, want below %d", tensor, MaxModelTensors)
	case !inU32(replica, MaxReplicas):
		return fmt.Errorf("replica %d, want below %d", replica, MaxReplicas)
	}
	return nil
}

func (o OuterDeltaKey) check() error {
	if o.Part < 0 || o.Part >= OuterParts {
		return fmt.Errorf("part %d, want below %d", o.Part, OuterParts)
	}
	if o.Segment < 0 || o.Segment >= MaxReplicas {
		return fmt.Errorf("segment %d, want below %d", o.Segment, MaxReplicas)
	}
	return checkOuter(o.Tensor, o.Replica)
}

// Key is o on the wire.
func (o OuterDeltaKey) Key() TensorKey {
	if o.check() != nil {
		return invalidKey(KindOuterDelta, o.PlanVersion, o.Step)
	}
	return TensorKey{Kind: KindOuterDelta, PlanVersion: o.PlanVersion, Step: o.Step, MicroBatch: uint32(o.Part + OuterParts*o.Segment), Block: uint32(o.Tensor), Expert: uint32(o.Replica)}
}

func (o OuterDeltaKey) String() string {
	return fmt.Sprintf("%v plan %d step %d tensor %d segment %d part %d from replica %d", KindOuterDelta, o.PlanVersion, o.Step, o.Tensor, o.Segment, o.Part, o.Replica)
}

// ParseOuterDeltaKey parses the key of a part of an outer step's tensor.
func ParseOuterDeltaKey(k TensorKey) (OuterDeltaKey, error) {
	if err := wantKind(k, KindOuterDelta); err != nil {
		return OuterDeltaKey{}, err
	}
	if k.MicroBatch >= OuterParts*MaxReplicas {
		return OuterDeltaKey{}, badKey(k, "part %d of segment %d, want segments below %d", k.MicroBatch%OuterParts, k.MicroBatch/OuterParts, MaxReplicas)
	}
	o := OuterDeltaKey{PlanVersion: k.PlanVersion, Step: k.Step, Tensor: int(k.Block), Replica: int(k.Expert), Part: int(k.MicroBatch % OuterParts), Segment: int(k.MicroBatch / OuterParts)}
	if err := checkOuter(o.Tensor, o.Replica); err != nil {
		return OuterDeltaKey{}, badKey(k, "%v", err)
	}
	return o, nil
}

// OuterSigKey names replica Replica's stage's Ed25519 signature of what it sends of the model's
// tensor number Tensor at the outer step after step Step (KindOuterSig; package audit, "Outer
// commitments"): an OuterSigEntry's or an OuterBatchSig's bytes as I32 values, little-endian —
// I32 because any bit pattern is a valid one.
//
// On the wire the micro-batch field is 2·Segment + Average (+ 2·MaxReplicas with Batch), the
// block field Tensor and the expert field Replica.
type OuterSigKey struct {
	PlanVersion uint32
	Step        uint64
	Tensor      int
	Replica     int
	// Average: the signature of the owner's average of its segment in the all-gather (micro-batch
	// field 1, plus 2·Segment), not of a contribution.
	Average bool
	// Segment is the segment signed (OuterDeltaKey.Segment).
	Segment int
	// Batch: the signature of the batch whose first segment is Segment, and the leaves of its
	// entries (OuterBatchSig); without it, Segment's place in its batch (OuterSigEntry).
	Batch bool
}

// KindOuterSig tensors come in two forms (package audit, "Outer commitments"). A sender signs
// a batch of segments at once, and sends the batch's signature once, with the leaves of its
// entries (OuterBatchSig, under the key of the batch's first segment with Batch set); beside
// each segment of the batch travels its place in the batch (OuterSigEntry).
const (
	// OuterSigEntryWords is the size of an OuterSigEntry: 3 int32s.
	OuterSigEntryWords = 3
	// MaxOuterBatch is the most entries one signature covers: a batch is of one tensor, a segment
	// an entry.
	MaxOuterBatch = MaxReplicas
	// OuterBatchSigMaxWords bounds an OuterBatchSig: a signature's 16 int32s and 8 a leaf.
	OuterBatchSigMaxWords = 16 + 8*MaxOuterBatch
)

// OuterSigEntry is a segment's place in the batch it was signed in: entry Entry of Entries, the
// batch's signature under the key of its First segment.
type OuterSigEntry struct{ Entry, Entries, First int }

// Tensor is e as the tensor k names.
func (e OuterSigEntry) Tensor(k TensorKey) Tensor {
	b := make([]byte, 0, 4*OuterSigEntryWords)
	for _, v := range []int{e.Entry, e.Entries, e.First} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	return Tensor{Key: k, DType: I32, Shape: Shape{OuterSigEntryWords, 1, 1, 1}, Data: b}
}

// ParseOuterSigEntry parses an OuterSigEntry's payload.
func ParseOuterSigEntry(data []byte) (OuterSigEntry, error) {
	if len(data) != 4*OuterSigEntryWords {
		return OuterSigEntry{}, fmt.Errorf("a signature's entry of %d bytes, want %d", len(data), 4*OuterSigEntryWords)
	}
	e := OuterSigEntry{Entry: int(binary.LittleEndian.Uint32(data)), Entries: int(binary.LittleEndian.Uint32(data[4:])), First: int(binary.LittleEndian.Uint32(data[8:]))}
	if e.Entries < 1 || e.Entries > MaxOuterBatch || e.Entry >= e.Entries || e.First >= MaxReplicas {
		return OuterSigEntry{}, fmt.Errorf("entry %d of %d of the batch from segment %d", e.Entry, e.Entries, e.First)
	}
	return e, nil
}

// OuterBatchSig is a batch's Ed25519 Signature and the Merkle leaves of its entries, in order.
type OuterBatchSig struct {
	Signature []byte
	Leaves    [][32]byte
}

// Tensor is s as the tensor k names.
func (s OuterBatchSig) Tensor(k TensorKey) Tensor {
	b := make([]byte, 0, len(s.Signature)+32*len(s.Leaves))
	b = append(b, s.Signature...)
	for _, l := range s.Leaves {
		b = append(b, l[:]...)
	}
	return Tensor{Key: k, DType: I32, Shape: Shape{uint32(len(b) / 4), 1, 1, 1}, Data: b}
}

// ParseOuterBatchSig parses an OuterBatchSig's payload: a 64-byte signature and 1 to
// MaxOuterBatch leaves. Its signature aliases data.
func ParseOuterBatchSig(data []byte) (OuterBatchSig, error) {
	if len(data) < 64+32 || len(data) > 4*OuterBatchSigMaxWords || (len(data)-64)%32 != 0 {
		return OuterBatchSig{}, fmt.Errorf("a batch's signature of %d bytes, want 64 and 32 a leaf, at most %d", len(data), 4*OuterBatchSigMaxWords)
	}
	s := OuterBatchSig{Signature: data[:64], Leaves: make([][32]byte, (len(data)-64)/32)}
	for i := range s.Leaves {
		copy(s.Leaves[i][:], data[64+32*i:])
	}
	return s, nil
}

// Key is o on the wire.
func (o OuterSigKey) Key() TensorKey {
	if checkOuter(o.Tensor, o.Replica) != nil || o.Segment < 0 || o.Segment >= MaxReplicas {
		return invalidKey(KindOuterSig, o.PlanVersion, o.Step)
	}
	k := TensorKey{Kind: KindOuterSig, PlanVersion: o.PlanVersion, Step: o.Step, MicroBatch: uint32(2 * o.Segment), Block: uint32(o.Tensor), Expert: uint32(o.Replica)}
	if o.Average {
		k.MicroBatch++
	}
	if o.Batch {
		k.MicroBatch += 2 * MaxReplicas
	}
	return k
}

func (o OuterSigKey) String() string {
	what := ""
	if o.Average {
		what = " average"
	}
	if o.Batch {
		what += " batch"
	}
	return fmt.Sprintf("%v plan %d step %d tensor %d segment %d%s from replica %d", KindOuterSig, o.PlanVersion, o.Step, o.Tensor, o.Segment, what, o.Replica)
}

// ParseOuterSigKey parses the key of an outer step's tensor's signature.
func ParseOuterSigKey(k TensorKey) (OuterSigKey, error) {
	if err := wantKind(k, KindOuterSig); err != nil {
		return OuterSigKey{}, err
	}
	if k.MicroBatch >= 4*MaxReplicas {
		return OuterSigKey{}, badKey(k, "micro-batch field %d, want below %d (a segment below %d, twice, with and without Batch)", k.MicroBatch, 4*MaxReplicas, MaxReplicas)
	}
	o := OuterSigKey{PlanVersion: k.PlanVersion, Step: k.Step, Tensor: int(k.Block), Replica: int(k.Expert), Average: k.MicroBatch%2 == 1,
		Segment: int(k.MicroBatch % (2 * MaxReplicas) / 2), Batch: k.MicroBatch >= 2*MaxReplicas}
	if err := checkOuter(o.Tensor, o.Replica); err != nil {
		return OuterSigKey{}, badKey(k, "%v", err)
	}
	return o, nil
}

// StateKey names tensor number Tensor of a stage shard's state handed over at plan PlanVersion by
// a worker that keeps it to one that takes it up (KindState; Assign.Give, Assign.From). Tensor
// numbers the state's tensors of the whole model, so that a giver and a taker of different blocks
// name each alike: part p (the parameters, then AdamW's first and second moments; in outer mode
// the global θ, then the outer momentum) of the model's tensor i (model.Config.Specs' order) is
// p × the model's tensor count + i. Its step field is the handover's: the updates the state holds
// (Handover.Step).
//
// On the wire the micro-batch field is 0, the block field Tensor and the expert field 0.
type StateKey struct {
	PlanVersion uint32
	Step        uint64
	Tensor      int
}

// Key is s on the wire.
func (s StateKey) Key() TensorKey {
	if !inU32(s.Tensor, 3*MaxModelTensors) {
		return invalidKey(KindState, s.PlanVersion, s.Step)
	}
	return TensorKey{Kind: KindState, PlanVersion: s.PlanVersion, Step: s.Step, Block: uint32(s.Tensor)}
}

func (s StateKey) String() string {
	return fmt.Sprintf("%v plan %d step %d tensor %d", KindState, s.PlanVersion, s.Step, s.Tensor)
}

// ParseStateKey parses the key of a tensor of a shard's state handed over.
func ParseStateKey(k TensorKey) (StateKey, error) {
	if err := wantKind(k, KindState); err != nil {
		return StateKey{}, err
	}
	switch {
	case k.MicroBatch != 0 || k.Expert != 0:
		return StateKey{}, badKey(k, "want micro-batch 0 and expert 0")
	case !inU32(int(k.Block), 3*MaxModelTensors):
		return StateKey{}, badKey(k, "tensor %d, want below %d", k.Block, 3*MaxModelTensors)
	}
	return StateKey{PlanVersion: k.PlanVersion, Step: k.Step, Tensor: int(k.Block)}, nil
}
