package proto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
)

// typedKeys are valid keys of every family, at the edges of their fields' ranges.
func typedKeys() []TypedKey {
	return []TypedKey{
		StageKey{Kind: KindActivation, PlanVersion: 3, Step: 1 << 40, MicroBatch: 2, Block: 4},
		StageKey{Kind: KindActivationGrad, PlanVersion: math.MaxUint32, Step: math.MaxUint64, MicroBatch: math.MaxUint32, Block: 0},
		TokenKey{Kind: KindTokens, PlanVersion: 1, Step: EvalStep(5), MicroBatch: 0},
		TokenKey{Kind: KindTargets, PlanVersion: 1, Step: 5, MicroBatch: math.MaxUint32},
		ExpertKey{Kind: KindExpertIn, PlanVersion: 2, Step: 7, MicroBatch: 3, Group: 1, Block: 1, Expert: 2},
		ExpertKey{Kind: KindExpertOut, PlanVersion: 2, Step: 7, MicroBatch: MaxExpertMicroBatch, Group: 1, Block: 0, Expert: 0},
		ExpertKey{Kind: KindExpertGradIn, PlanVersion: 2, Step: 7, MicroBatch: 0, Group: 0, Block: 5, Expert: 63},
		ExpertKey{Kind: KindExpertGradOut, PlanVersion: 2, Step: 7, MicroBatch: 9, Group: 0, Block: 5, Expert: 63},
		ExpertKey{Kind: KindExpertGradOut, PlanVersion: 2, Step: 7, Group: 1, Block: 5, Expert: 63, Partial: true},
		GradReduceKey{PlanVersion: 4, Step: 9, Tensor: 12, Replica: 1, Lo: 3, Hi: 4},
		GradReduceKey{PlanVersion: 4, Step: 9, Tensor: MaxModelTensors - 1, Replica: MaxReplicas - 1, Lo: 0, Hi: MaxReduceMicroBatches},
		OuterDeltaKey{PlanVersion: 5, Step: 99, Tensor: 0, Replica: 0, Part: 0},
		OuterDeltaKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Part: 1},
		OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3},
		OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Average: true},
		OuterDeltaKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Part: 2, Segment: MaxReplicas - 1},
		OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Average: true, Segment: 9},
		OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Average: true, Segment: MaxReplicas - 1, Batch: true},
		OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Segment: 4, Batch: true},
		StateKey{PlanVersion: 6, Step: 40, Tensor: 0},
		StateKey{PlanVersion: 6, Step: 40, Tensor: 3*MaxModelTensors - 1},
	}
}

// TestTypedKeysRoundTrip: every typed key parses back from its wire key, by its family's parser
// and by ParseKey, and a frame of it crosses the wire; the wire key's String is the typed key's.
func TestTypedKeysRoundTrip(t *testing.T) {
	for _, k := range typedKeys() {
		w := k.Key()
		got, err := ParseKey(w)
		if err != nil {
			t.Fatalf("%v: ParseKey(%+v): %v", k, w, err)
		}
		if got != k {
			t.Errorf("ParseKey(%v.Key()) = %#v, want %#v", k, got, k)
		}
		if w.String() != k.String() {
			t.Errorf("wire key's String %q, typed key's %q", w.String(), k.String())
		}
		var again TypedKey
		switch k.(type) {
		case StageKey:
			again, err = ParseStageKey(w)
		case TokenKey:
			again, err = ParseTokenKey(w)
		case ExpertKey:
			again, err = ParseExpertKey(w)
		case GradReduceKey:
			again, err = ParseGradReduceKey(w)
		case OuterDeltaKey:
			again, err = ParseOuterDeltaKey(w)
		case OuterSigKey:
			again, err = ParseOuterSigKey(w)
		case StateKey:
			again, err = ParseStateKey(w)
		}
		if err != nil || again != k {
			t.Errorf("family parser: %#v, %v; want %#v", again, err, k)
		}
		dt, shape := F32, Shape{2, 1, 1, 1}
		switch w.Kind {
		case KindTokens, KindTargets:
			dt = I32
		case KindOuterSig:
			dt, shape = I32, Shape{OuterSigEntryWords, 1, 1, 1}
		}
		tn := Tensor{Key: w, DType: dt, Shape: shape, Data: make([]byte, 4*shape[0])}
		frames, err := SplitTensor(tn, Limits{})
		if err != nil {
			t.Fatalf("%v: %v", k, err)
		}
		f, err := DecodeFrame(frames[0], Limits{})
		if err != nil || f.Header.TensorKey != w {
			t.Errorf("%v: decoded %v, %v", k, f.Header.TensorKey, err)
		}
	}
}

// TestKeyStrings: a key says what its fields mean for its kind.
func TestKeyStrings(t *testing.T) {
	tests := []struct {
		k    TypedKey
		want string
	}{
		{StageKey{Kind: KindActivation, PlanVersion: 3, Step: 8, MicroBatch: 2, Block: 4}, "activation plan 3 step 8 mb 2 block 4"},
		{TokenKey{Kind: KindTargets, PlanVersion: 1, Step: 5, MicroBatch: 6}, "targets plan 1 step 5 mb 6"},
		{ExpertKey{Kind: KindExpertIn, PlanVersion: 2, Step: 7, MicroBatch: 3, Group: 1, Block: 1, Expert: 2}, "expert-in plan 2 step 7 mb 3 group 1 block 1 expert 2"},
		{ExpertKey{Kind: KindExpertGradOut, PlanVersion: 2, Step: 7, Group: 1, Block: 1, Expert: 2, Partial: true}, "expert-grad-out plan 2 step 7 partial gradient of group 1 block 1 expert 2"},
		{GradReduceKey{PlanVersion: 4, Step: 9, Tensor: 12, Replica: 1, Lo: 3, Hi: 4}, "grad-reduce plan 4 step 9 tensor 12 node [3,4) from replica 1"},
		{OuterDeltaKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Part: 1}, "outer-delta plan 5 step 99 tensor 7 segment 0 part 1 from replica 3"},
		{OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3}, "outer-sig plan 5 step 99 tensor 7 segment 0 from replica 3"},
		{OuterDeltaKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Part: 1, Segment: 2}, "outer-delta plan 5 step 99 tensor 7 segment 2 part 1 from replica 3"},
		{OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Average: true, Segment: 1}, "outer-sig plan 5 step 99 tensor 7 segment 1 average from replica 3"},
		{OuterSigKey{PlanVersion: 5, Step: 99, Tensor: 7, Replica: 3, Segment: 1, Batch: true}, "outer-sig plan 5 step 99 tensor 7 segment 1 batch from replica 3"},
		{StateKey{PlanVersion: 6, Step: 40, Tensor: 2}, "state plan 6 step 40 tensor 2"},
	}
	for _, tt := range tests {
		if got := tt.k.Key().String(); got != tt.want {
			t.Errorf("%#v: %q, want %q", tt.k, got, tt.want)
		}
	}
	bad := TensorKey{Kind: KindOuterSig, PlanVersion: 1, Step: 2, MicroBatch: 4 * MaxReplicas, Block: 4, Expert: 5}
	if got := bad.String(); got != "outer-sig plan 1 step 2 mb 16384 block 4 expert 5 (invalid)" {
		t.Errorf("an invalid key: %q", got)
	}
}

// TestParseKeyRefusals: each parser refuses a key of another kind and fields out of its range,
// with an error that says which.
func TestParseKeyRefusals(t *testing.T) {
	stage := func(k TensorKey) error { _, err := ParseStageKey(k); return err }
	token := func(k TensorKey) error { _, err := ParseTokenKey(k); return err }
	expert := func(k TensorKey) error { _, err := ParseExpertKey(k); return err }
	reduce := func(k TensorKey) error { _, err := ParseGradReduceKey(k); return err }
	delta := func(k TensorKey) error { _, err := ParseOuterDeltaKey(k); return err }
	sig := func(k TensorKey) error { _, err := ParseOuterSigKey(k); return err }
	state := func(k TensorKey) error { _, err := ParseStateKey(k); return err }
	parseAny := func(k TensorKey) error { _, err := ParseKey(k); return err }
	act := TensorKey{Kind: KindActivation, Step: 1, MicroBatch: 2, Block: 3, Expert: NoExpert}
	tok := TensorKey{Kind: KindTokens, Step: 1, Block: NoBlock, Expert: NoExpert}
	ex := TensorKey{Kind: KindExpertGradOut, Step: 1, MicroBatch: 5, Block: 1, Expert: 2}
	gr := GradReduceKey{Step: 1, Tensor: 3, Replica: 1, Lo: 2, Hi: 4}.Key()
	od := OuterDeltaKey{Step: 1, Tensor: 3, Replica: 1, Part: 1}.Key()
	os := OuterSigKey{Step: 1, Tensor: 3, Replica: 1}.Key()
	sk := StateKey{Step: 1, Tensor: 3}.Key()
	with := func(k TensorKey, f func(*TensorKey)) TensorKey { f(&k); return k }
	tests := []struct {
		name  string
		parse func(TensorKey) error
		k     TensorKey
		want  string
	}{
		{"unknown kind", parseAny, with(act, func(k *TensorKey) { k.Kind = 0 }), "unknown kind 0"},
		{"a kind past the last", parseAny, with(act, func(k *TensorKey) { k.Kind = kindEnd }), "unknown kind"},
		{"tokens as a stage key", stage, tok, "want activation or activation-grad"},
		{"an expert key as a stage key", stage, ex, "want activation or activation-grad"},
		{"activation without a block", stage, with(act, func(k *TensorKey) { k.Block = NoBlock }), "want a block and no expert"},
		{"activation with an expert", stage, with(act, func(k *TensorKey) { k.Expert = 0 }), "want a block and no expert"},
		{"activation as tokens", token, act, "want tokens or targets"},
		{"tokens with a block", token, with(tok, func(k *TensorKey) { k.Block = 0 }), "want no block and no expert"},
		{"tokens with an expert", token, with(tok, func(k *TensorKey) { k.Expert = 1 }), "want no block and no expert"},
		{"grad-reduce as an expert key", expert, gr, "want expert-in or expert-out or expert-grad-in or expert-grad-out"},
		{"expert rows without a block", expert, with(ex, func(k *TensorKey) { k.Block = NoBlock }), "want a block and an expert"},
		{"expert rows without an expert", expert, with(ex, func(k *TensorKey) { k.Expert = NoExpert }), "want a block and an expert"},
		{"a partial gradient of expert-in", expert, with(ex, func(k *TensorKey) { k.Kind, k.MicroBatch = KindExpertIn, PartialBit }), "a partial gradient is an expert-grad-out frame"},
		{"a partial gradient of expert-out", expert, with(ex, func(k *TensorKey) { k.Kind, k.MicroBatch = KindExpertOut, PartialBit|1 }), "a partial gradient is an expert-grad-out frame"},
		{"a partial gradient of group 2", expert, with(ex, func(k *TensorKey) { k.MicroBatch = PartialBit | 2 }), "partial gradient of group 2"},
		{"a partial gradient with micro-batch bits", expert, with(ex, func(k *TensorKey) { k.MicroBatch = PartialBit | 2<<1 }), "partial gradient of group 4"},
		{"outer-delta as grad-reduce", reduce, od, "want grad-reduce"},
		{"an empty node", reduce, with(gr, func(k *TensorKey) { k.MicroBatch = 3<<16 | 3 }), "node [3,3)"},
		{"a node backwards", reduce, with(gr, func(k *TensorKey) { k.MicroBatch = 4<<16 | 2 }), "node [4,2)"},
		{"a node [0,0)", reduce, with(gr, func(k *TensorKey) { k.MicroBatch = 0 }), "node [0,0)"},
		{"grad-reduce without a tensor", reduce, with(gr, func(k *TensorKey) { k.Block = NoBlock }), "tensor 4294967295"},
		{"grad-reduce of tensor MaxModelTensors", reduce, with(gr, func(k *TensorKey) { k.Block = MaxModelTensors }), "tensor 1048576"},
		{"grad-reduce of replica MaxReplicas", reduce, with(gr, func(k *TensorKey) { k.Expert = MaxReplicas }), "replica 4096"},
		{"grad-reduce without a replica", reduce, with(gr, func(k *TensorKey) { k.Expert = NoExpert }), "replica 4294967295"},
		{"a signature as outer-delta", delta, os, "want outer-delta"},
		{"a part of segment MaxReplicas", delta, with(od, func(k *TensorKey) { k.MicroBatch = OuterParts*MaxReplicas + 2 }), "part 2 of segment 4096, want segments below 4096"},
		{"outer-delta of tensor MaxModelTensors", delta, with(od, func(k *TensorKey) { k.Block = MaxModelTensors }), "tensor 1048576"},
		{"outer-delta of replica MaxReplicas", delta, with(od, func(k *TensorKey) { k.Expert = MaxReplicas }), "replica 4096"},
		{"outer-delta as a signature", sig, od, "want outer-sig"},
		{"a batch's signature of segment MaxReplicas", sig, with(os, func(k *TensorKey) { k.MicroBatch = 4*MaxReplicas + 1 }), "micro-batch field 16385, want below 16384"},
		{"a signature without a tensor", sig, with(os, func(k *TensorKey) { k.Block = NoBlock }), "tensor 4294967295"},
		{"a signature of replica MaxReplicas", sig, with(os, func(k *TensorKey) { k.Expert = MaxReplicas }), "replica 4096"},
		{"a signature as state", state, os, "want state"},
		{"state of a micro-batch", state, with(sk, func(k *TensorKey) { k.MicroBatch = 1 }), "want micro-batch 0"},
		{"state of an expert", state, with(sk, func(k *TensorKey) { k.Expert = 2 }), "want micro-batch 0 and expert 0"},
		{"state of tensor 3·MaxModelTensors", state, with(sk, func(k *TensorKey) { k.Block = 3 * MaxModelTensors }), "tensor 3145728"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.parse(tt.k)
			if err == nil {
				t.Fatalf("%+v parsed", tt.k)
			}
			if !errors.Is(err, ErrBadHeader) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%v, want ErrBadHeader saying %q", err, tt.want)
			}
			if parseAny(tt.k) == nil {
				return // another family's key, which the header check takes
			}
			if _, err := AppendFrame(nil, FrameHeader{TensorKey: tt.k, DType: I32, Shape: Shape{OuterSigEntryWords, 1, 1, 1}, ChunkCount: 1}, make([]byte, 4*OuterSigEntryWords), Limits{}); !errors.Is(err, ErrBadHeader) {
				t.Errorf("AppendFrame of an invalid key: %v", err)
			}
		})
	}
}

// TestKeyOutOfRange: a typed key whose fields the wire cannot carry gives a wire key that does not
// parse — never the key of another tensor — so sending it fails.
func TestKeyOutOfRange(t *testing.T) {
	tests := []TypedKey{
		StageKey{Kind: KindTokens, Block: 1},
		StageKey{Kind: KindActivation, MicroBatch: -1, Block: 1},
		StageKey{Kind: KindActivation, MicroBatch: 1 << 32, Block: 1},
		StageKey{Kind: KindActivation, Block: int(NoBlock)},
		StageKey{Kind: KindActivationGrad, Block: -1},
		TokenKey{Kind: KindActivation},
		TokenKey{Kind: KindTokens, MicroBatch: -1},
		TokenKey{Kind: KindTargets, MicroBatch: 1 << 32},
		ExpertKey{Kind: KindTokens, Block: 1, Expert: 1},
		ExpertKey{Kind: KindExpertIn, MicroBatch: MaxExpertMicroBatch + 1, Block: 1, Expert: 1},
		ExpertKey{Kind: KindExpertIn, MicroBatch: -1, Block: 1, Expert: 1},
		ExpertKey{Kind: KindExpertIn, Group: ExpertGroups, Block: 1, Expert: 1},
		ExpertKey{Kind: KindExpertIn, Group: -1, Block: 1, Expert: 1},
		ExpertKey{Kind: KindExpertIn, Block: int(NoBlock), Expert: 1},
		ExpertKey{Kind: KindExpertIn, Block: 1, Expert: int(NoExpert)},
		ExpertKey{Kind: KindExpertGradIn, Block: 1, Expert: 1, Partial: true},
		ExpertKey{Kind: KindExpertGradOut, MicroBatch: 1, Block: 1, Expert: 1, Partial: true},
		GradReduceKey{Tensor: 1, Replica: 1, Lo: 2, Hi: 2},
		GradReduceKey{Tensor: 1, Replica: 1, Lo: -1, Hi: 2},
		GradReduceKey{Tensor: 1, Replica: 1, Lo: 0, Hi: MaxReduceMicroBatches + 1},
		GradReduceKey{Tensor: 1, Replica: 1, Lo: 1 << 16, Hi: 1<<16 + 1},
		GradReduceKey{Tensor: MaxModelTensors, Replica: 1, Lo: 0, Hi: 1},
		GradReduceKey{Tensor: 1, Replica: MaxReplicas, Lo: 0, Hi: 1},
		OuterDeltaKey{Tensor: 1, Replica: 1, Part: OuterParts},
		OuterDeltaKey{Tensor: 1, Replica: 1, Part: -1},
		OuterDeltaKey{Tensor: -1, Replica: 1},
		OuterDeltaKey{Tensor: 1, Replica: -1},
		OuterSigKey{Tensor: MaxModelTensors, Replica: 1},
		OuterSigKey{Tensor: 1, Replica: MaxReplicas},
	}
	for _, k := range tests {
		w := k.Key()
		if got, err := ParseKey(w); err == nil {
			t.Errorf("%#v gives %+v, which parses as %#v", k, w, got)
		}
		if _, err := SplitTensor(Tensor{Key: w, DType: F32, Shape: Shape{1, 1, 1, 1}, Data: make([]byte, 4)}, Limits{}); !errors.Is(err, ErrBadHeader) {
			t.Errorf("%#v: sending it: %v", k, err)
		}
	}
}

// TestOuterSigFrames: a signature's entry is OuterSigEntryWords int32s, a batch's signature 16
// and 8 a leaf, at most OuterBatchSigMaxWords, and an outer step's values are
// float32 or int8, never int32, whoever sends them (the admission of who may send them is the
// worker's: client's TestAdmissionReplicaReduce).
func TestOuterSigFrames(t *testing.T) {
	sig := OuterSigKey{PlanVersion: 1, Step: 4, Tensor: 2, Replica: 1}.Key()
	delta := OuterDeltaKey{PlanVersion: 1, Step: 4, Tensor: 2, Replica: 1}.Key()
	tests := []struct {
		name  string
		key   TensorKey
		dt    DType
		shape Shape
		want  error
	}{
		{"an entry", sig, I32, Shape{OuterSigEntryWords, 1, 1, 1}, nil},
		{"a batch's signature", sig, I32, Shape{16 + 8*3, 1, 1, 1}, nil},
		{"a large batch", sig, I32, Shape{16 + 8*2000, 1, 1, 1}, nil},
		{"a batch of no leaves", sig, I32, Shape{16, 1, 1, 1}, ErrBadShape},
		{"a signature of float32s", sig, F32, Shape{OuterSigEntryWords, 1, 1, 1}, ErrBadHeader},
		{"a signature of int8", sig, I8, Shape{1, 4 * OuterSigEntryWords, 1, 1}, ErrBadHeader},
		{"an entry a word longer", sig, I32, Shape{OuterSigEntryWords + 1, 1, 1, 1}, ErrBadShape},
		{"a leaf a word short", sig, I32, Shape{16 + 8*3 - 1, 1, 1, 1}, ErrBadShape},
		{"a batch as a matrix", sig, I32, Shape{12, 2, 1, 1}, ErrBadShape},
		{"an empty signature", sig, I32, Shape{0, 1, 1, 1}, ErrBadShape},
		{"θ_r", delta, F32, Shape{10, 1, 1, 1}, nil},
		{"int8 chunks", delta, I8, Shape{2, 4, 1, 1}, nil},
		{"int32 values at an outer step", delta, I32, Shape{OuterSigEntryWords, 1, 1, 1}, ErrBadHeader},
		{"bfloat16 values at an outer step", delta, BF16, Shape{10, 1, 1, 1}, ErrBadHeader},
		{"state in float32", StateKey{PlanVersion: 1, Step: 4, Tensor: 2}.Key(), F32, Shape{10, 1, 1, 1}, nil},
		{"state in int8", StateKey{PlanVersion: 1, Step: 4, Tensor: 2}.Key(), I8, Shape{10, 1, 1, 1}, ErrBadHeader},
	}
	// The largest batch is a tensor, one too large is not.
	if _, err := SplitTensor(Tensor{Key: sig, DType: I32, Shape: Shape{OuterBatchSigMaxWords, 1, 1, 1}, Data: make([]byte, 4*OuterBatchSigMaxWords)}, Limits{}); err != nil {
		t.Errorf("the largest batch: %v", err)
	}
	if _, err := SplitTensor(Tensor{Key: sig, DType: I32, Shape: Shape{OuterBatchSigMaxWords + 8, 1, 1, 1}, Data: make([]byte, 4*OuterBatchSigMaxWords+32)}, Limits{}); !errors.Is(err, ErrBadShape) {
		t.Errorf("a batch too large: %v, want %v", err, ErrBadShape)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := tt.shape.Bytes(tt.dt, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			tn := Tensor{Key: tt.key, DType: tt.dt, Shape: tt.shape, Data: make([]byte, n)}
			_, err = SplitTensor(tn, Limits{})
			if tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Fatalf("SplitTensor: %v, want %v", err, tt.want)
			}
			// The decoder refuses what a sender that skipped the check would write.
			h := FrameHeader{TensorKey: tt.key, DType: tt.dt, Shape: tt.shape, ChunkCount: 1}
			if len(tn.Data) > MaxChunkPayload {
				h.ChunkCount = uint32((len(tn.Data) + MaxChunkPayload - 1) / MaxChunkPayload)
				tn.Data = tn.Data[:MaxChunkPayload]
			}
			b := rawFrame(h, tn.Data)
			if _, err := DecodeFrame(b, Limits{}); tt.want == nil && err != nil || !errors.Is(err, tt.want) {
				t.Fatalf("DecodeFrame: %v, want %v", err, tt.want)
			}
		})
	}
}

// rawFrame encodes a frame without AppendFrame's checks.
func rawFrame(h FrameHeader, payload []byte) []byte {
	ok := FrameHeader{TensorKey: actKey(), DType: F32, Shape: Shape{0, 1, 1, 1}, ChunkCount: 1}
	b, err := AppendFrame(nil, ok, nil, Limits{})
	if err != nil {
		panic(err)
	}
	b[3], b[4] = byte(h.Kind), byte(h.DType)
	le := binary.LittleEndian
	le.PutUint32(b[8:], h.PlanVersion)
	le.PutUint32(b[12:], h.MicroBatch)
	le.PutUint64(b[16:], h.Step)
	le.PutUint32(b[24:], h.Block)
	le.PutUint32(b[28:], h.Expert)
	for i, d := range h.Shape {
		le.PutUint32(b[32+4*i:], d)
	}
	le.PutUint32(b[48:], h.ChunkIndex)
	le.PutUint32(b[52:], h.ChunkCount)
	le.PutUint32(b[56:], uint32(len(payload)))
	return append(b, payload...)
}

// FuzzParseKey: no parser panics on any TensorKey; what one accepts is what ParseKey accepts, it
// gives the key back (Key), and the header check takes exactly those keys.
func FuzzParseKey(f *testing.F) {
	f.Fuzz(func(t *testing.T, kind uint8, plan uint32, step uint64, mb, block, expert uint32) {
		k := TensorKey{Kind: Kind(kind), PlanVersion: plan, Step: step, MicroBatch: mb, Block: block, Expert: expert}
		_ = k.String()
		typed, err := ParseKey(k)
		if (err == nil) != (k.check() == nil) {
			t.Fatalf("ParseKey %v, header check %v", err, k.check())
		}
		if err != nil {
			if !errors.Is(err, ErrBadHeader) {
				t.Fatalf("error wraps no sentinel: %v", err)
			}
		} else if typed.Key() != k {
			t.Fatalf("%+v parses as %#v, whose key is %+v", k, typed, typed.Key())
		}
		parsers := []func(TensorKey) (TypedKey, error){
			func(k TensorKey) (TypedKey, error) { return ParseStageKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseTokenKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseExpertKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseGradReduceKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseOuterDeltaKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseOuterSigKey(k) },
			func(k TensorKey) (TypedKey, error) { return ParseStateKey(k) },
		}
		accepted := 0
		for _, p := range parsers {
			got, perr := p(k)
			if perr != nil {
				if !errors.Is(perr, ErrBadHeader) {
					t.Fatalf("error wraps no sentinel: %v", perr)
				}
				continue
			}
			accepted++
			if err != nil || got != typed {
				t.Fatalf("%+v: a family parser gives %#v, ParseKey %#v, %v", k, got, typed, err)
			}
		}
		if accepted > 1 || (accepted == 1) != (err == nil) {
			t.Fatalf("%+v: %d parsers accept it, ParseKey: %v", k, accepted, err)
		}
	})
}

// FuzzTypedKey: a typed key of any fields either parses back from its wire key, or, out of
// range, gives one that does not parse: Key never names another tensor.
func FuzzTypedKey(f *testing.F) {
	f.Fuzz(func(t *testing.T, family, kind uint8, plan uint32, step uint64, a, b, c, d int64, partial bool) {
		var k TypedKey
		switch family % 7 {
		case 0:
			k = StageKey{Kind: Kind(kind), PlanVersion: plan, Step: step, MicroBatch: int(a), Block: int(b)}
		case 1:
			k = TokenKey{Kind: Kind(kind), PlanVersion: plan, Step: step, MicroBatch: int(a)}
		case 2:
			k = ExpertKey{Kind: Kind(kind), PlanVersion: plan, Step: step, MicroBatch: int(a), Group: int(b), Block: int(c), Expert: int(d), Partial: partial}
		case 3:
			k = GradReduceKey{PlanVersion: plan, Step: step, Tensor: int(a), Replica: int(b), Lo: int(c), Hi: int(d)}
		case 4:
			k = OuterDeltaKey{PlanVersion: plan, Step: step, Tensor: int(a), Replica: int(b), Part: int(c)}
		case 5:
			k = OuterSigKey{PlanVersion: plan, Step: step, Tensor: int(a), Replica: int(b)}
		case 6:
			k = StateKey{PlanVersion: plan, Step: step, Tensor: int(a)}
		}
		w := k.Key()
		got, err := ParseKey(w)
		if err == nil && got != k {
			t.Fatalf("%#v gives %+v, the key of %#v", k, w, got)
		}
		valid := false
		switch k := k.(type) {
		case StageKey:
			valid = k.check() == nil
		case TokenKey:
			valid = k.check() == nil
		case ExpertKey:
			valid = k.check() == nil
		case GradReduceKey:
			valid = k.check() == nil
		case OuterDeltaKey:
			valid = k.check() == nil
		case OuterSigKey:
			valid = checkOuter(k.Tensor, k.Replica) == nil
		case StateKey:
			valid = inU32(k.Tensor, 3*MaxModelTensors)
		}
		if valid != (err == nil) {
			t.Fatalf("%#v: in range %v, its key %+v parses: %v", k, valid, w, err)
		}
	})
}

// TestDecodeFrameAllocatesNothing: checking a key on the hot path costs no allocation, whatever
// its kind.
func TestDecodeFrameAllocatesNothing(t *testing.T) {
	for _, k := range typedKeys() {
		w := k.Key()
		dt, shape := F32, Shape{2, 1, 1, 1}
		switch w.Kind {
		case KindTokens, KindTargets:
			dt = I32
		case KindOuterSig:
			dt, shape = I32, Shape{OuterSigEntryWords, 1, 1, 1}
		}
		b, err := AppendFrame(nil, FrameHeader{TensorKey: w, DType: dt, Shape: shape, ChunkCount: 1}, make([]byte, 4*shape[0]), Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if n := testing.AllocsPerRun(100, func() { DecodeFrame(b, Limits{}) }); n != 0 {
			t.Errorf("%v: DecodeFrame allocates %v times", k, n)
		}
	}
}

// TestOuterSig: an entry and a batch's signature cross as they were; payloads of other sizes,
// of no entries, of an entry beyond them or a batch's first segment beyond any are refused.
func TestOuterSig(t *testing.T) {
	e := OuterSigEntry{Entry: 2, Entries: 3, First: 9}
	et := e.Tensor(OuterSigKey{PlanVersion: 1, Step: 4, Tensor: 2, Replica: 1}.Key())
	if _, err := SplitTensor(et, Limits{}); err != nil {
		t.Fatalf("SplitTensor: %v", err)
	}
	if got, err := ParseOuterSigEntry(et.Data); err != nil || got != e {
		t.Fatalf("parsed %+v, %v; want %+v", got, err, e)
	}
	sig := make([]byte, 64)
	sig[0], sig[63] = 7, 9
	b := OuterBatchSig{Signature: sig, Leaves: make([][32]byte, 3)}
	b.Leaves[1][31] = 5
	bt := b.Tensor(OuterSigKey{PlanVersion: 1, Step: 4, Tensor: 2, Replica: 1, Segment: 9, Batch: true}.Key())
	if _, err := SplitTensor(bt, Limits{}); err != nil {
		t.Fatalf("SplitTensor: %v", err)
	}
	got, err := ParseOuterBatchSig(bt.Data)
	if err != nil || !bytes.Equal(got.Signature, sig) || !slices.Equal(got.Leaves, b.Leaves) {
		t.Fatalf("parsed %+v, %v; want %+v", got, err, b)
	}
	for name, data := range map[string][]byte{
		"an entry a word short": et.Data[:8],
		"no entries":            OuterSigEntry{Entry: 0, Entries: 0}.Tensor(TensorKey{}).Data,
		"beyond":                OuterSigEntry{Entry: 3, Entries: 3}.Tensor(TensorKey{}).Data,
		"too many":              OuterSigEntry{Entry: 3, Entries: MaxOuterBatch + 1}.Tensor(TensorKey{}).Data,
		"first beyond any":      OuterSigEntry{Entry: 0, Entries: 1, First: MaxReplicas}.Tensor(TensorKey{}).Data,
	} {
		if _, err := ParseOuterSigEntry(data); err == nil {
			t.Errorf("entry %s: parsed", name)
		}
	}
	for name, data := range map[string][]byte{
		"no leaves":  sig,
		"a torn one": bt.Data[:len(bt.Data)-4],
		"too many":   make([]byte, 4*OuterBatchSigMaxWords+32),
	} {
		if _, err := ParseOuterBatchSig(data); err == nil {
			t.Errorf("batch %s: parsed", name)
		}
	}
}
