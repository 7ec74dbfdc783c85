package proto

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"testing"
)

func actKey() TensorKey {
	return TensorKey{Kind: KindActivation, PlanVersion: 3, Step: 1 << 40, MicroBatch: 2, Block: 4, Expert: NoExpert}
}

// f32Frame encodes a one-chunk f32 tensor of shape dims with values 0, 1, 2, ….
func f32Frame(t *testing.T, key TensorKey, dims ...int) []byte {
	t.Helper()
	s, err := ShapeOf(dims...)
	if err != nil {
		t.Fatal(err)
	}
	n := 1
	for _, d := range dims {
		n *= d
	}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i)
	}
	b, err := AppendFrame(nil, FrameHeader{TensorKey: key, DType: F32, Shape: s, ChunkCount: 1}, AppendFloat32s(nil, x), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFrameRoundTrip(t *testing.T) {
	tests := []struct {
		name    string
		h       FrameHeader
		payload []byte
	}{
		{"activation", FrameHeader{TensorKey: actKey(), DType: F32, Shape: Shape{2, 3, 4, 1}, ChunkCount: 1},
			AppendFloat32s(nil, make([]float32, 24))},
		{"activation-grad-middle-chunk", FrameHeader{TensorKey: TensorKey{Kind: KindActivationGrad, PlanVersion: math.MaxUint32,
			Step: math.MaxUint64, MicroBatch: 15, Block: 0, Expert: NoExpert}, DType: F32, Shape: Shape{16, 128, 256, 1},
			ChunkIndex: 5, ChunkCount: 33}, make([]byte, MaxChunkPayload)},
		{"activation-grad-last-chunk", FrameHeader{TensorKey: TensorKey{Kind: KindActivationGrad, Block: 1, Expert: NoExpert},
			DType: F32, Shape: Shape{16, 128, 256, 1}, ChunkIndex: 32, ChunkCount: 33},
			make([]byte, 16*128*256*4-32*MaxChunkPayload)},
		{"expert-in-empty", FrameHeader{TensorKey: TensorKey{Kind: KindExpertIn, Block: 1, Expert: 3}, DType: F32,
			Shape: Shape{0, 64, 1, 1}, ChunkCount: 1}, nil},
		{"expert-grad-out", FrameHeader{TensorKey: TensorKey{Kind: KindExpertGradOut, Block: 3, Expert: 0}, DType: F32,
			Shape: Shape{5, 2, 1, 1}, ChunkCount: 1}, AppendFloat32s(nil, []float32{1, -2, 3.5, 0, -0, 1e-45, 3e38, -3e38, 7, 8})},
		{"tokens", FrameHeader{TensorKey: TensorKey{Kind: KindTokens, Block: NoBlock, Expert: NoExpert}, DType: I32,
			Shape: Shape{2, 4, 1, 1}, ChunkCount: 1}, AppendInt32s(nil, []int32{0, 255, -1, 7, 0x7f800000, 1, 2, 3})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := AppendFrame(nil, tt.h, tt.payload, Limits{})
			if err != nil {
				t.Fatalf("AppendFrame: %v", err)
			}
			if len(b) > MaxFrameSize || len(b) != HeaderSize+len(tt.payload) {
				t.Fatalf("frame is %d bytes", len(b))
			}
			f, err := DecodeFrame(b, Limits{})
			if err != nil {
				t.Fatalf("DecodeFrame: %v", err)
			}
			if f.Header != tt.h {
				t.Errorf("header\n got %+v\nwant %+v", f.Header, tt.h)
			}
			if string(f.Payload) != string(tt.payload) {
				t.Errorf("payload differs")
			}
		})
	}
}

func TestDecodeFrameErrors(t *testing.T) {
	good := f32Frame(t, actKey(), 2, 3)
	// mutate returns a copy of good changed by f.
	mutate := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	put32 := func(off int, v uint32) []byte {
		return mutate(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[off:], v); return b })
	}
	setF32 := func(i int, v float32) []byte {
		return mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[HeaderSize+4*i:], math.Float32bits(v))
			return b
		})
	}
	tests := []struct {
		name string
		in   []byte
		lim  Limits
		want error
	}{
		{"empty", nil, Limits{}, ErrShortFrame},
		{"header-only-short", good[:HeaderSize-1], Limits{}, ErrShortFrame},
		{"too-large", make([]byte, MaxFrameSize+1), Limits{}, ErrFrameTooLarge},
		{"magic", mutate(func(b []byte) []byte { b[0] = '{'; return b }), Limits{}, ErrFrameVersion},
		{"version", mutate(func(b []byte) []byte { b[2] = 2; return b }), Limits{}, ErrFrameVersion},
		{"reserved-5", mutate(func(b []byte) []byte { b[5] = 1; return b }), Limits{}, ErrBadHeader},
		{"reserved-63", mutate(func(b []byte) []byte { b[63] = 1; return b }), Limits{}, ErrBadHeader},
		{"kind-zero", mutate(func(b []byte) []byte { b[3] = 0; return b }), Limits{}, ErrBadHeader},
		{"kind-unknown", mutate(func(b []byte) []byte { b[3] = 99; return b }), Limits{}, ErrBadHeader},
		{"dtype-unknown", mutate(func(b []byte) []byte { b[4] = 9; return b }), Limits{}, ErrBadHeader},
		{"dtype-i32-activation", mutate(func(b []byte) []byte { b[4] = byte(I32); return b }), Limits{}, ErrBadHeader},
		{"activation-with-expert", put32(28, 1), Limits{}, ErrBadHeader},
		{"activation-without-block", put32(24, NoBlock), Limits{}, ErrBadHeader},
		{"expert-kind-without-expert", mutate(func(b []byte) []byte { b[3] = byte(KindExpertIn); return b }), Limits{}, ErrBadHeader},
		{"tokens-with-block", mutate(func(b []byte) []byte { b[3] = byte(KindTokens); b[4] = byte(I32); return b }), Limits{}, ErrBadHeader},
		{"shape-overflow", mutate(func(b []byte) []byte {
			for i := 0; i < 4; i++ {
				binary.LittleEndian.PutUint32(b[32+4*i:], math.MaxUint32)
			}
			return b
		}), Limits{}, ErrTensorTooLarge},
		{"shape-over-limit", good, Limits{MaxTensorBytes: 23}, ErrTensorTooLarge},
		{"shape-payload-mismatch", put32(32, 3), Limits{}, ErrPayloadLength},
		{"chunk-count-zero", put32(52, 0), Limits{}, ErrBadHeader},
		{"chunk-count-wrong", put32(52, 2), Limits{}, ErrBadHeader},
		{"chunk-index-out-of-range", mutate(func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[32:], MaxChunkPayload/4) // shape (16368, 2): 2 chunks
			binary.LittleEndian.PutUint32(b[36:], 2)
			binary.LittleEndian.PutUint32(b[52:], 2)
			binary.LittleEndian.PutUint32(b[48:], 2)
			return b
		}), Limits{}, ErrBadHeader},
		{"payload-field", put32(56, 23), Limits{}, ErrPayloadLength},
		{"payload-truncated", good[:len(good)-4], Limits{}, ErrPayloadLength},
		{"payload-extra", append(append([]byte(nil), good...), 0, 0, 0, 0), Limits{}, ErrPayloadLength},
		{"nan", setF32(3, float32(math.NaN())), Limits{}, ErrNonFinite},
		{"inf", setF32(0, float32(math.Inf(1))), Limits{}, ErrNonFinite},
		{"neg-inf", setF32(5, float32(math.Inf(-1))), Limits{}, ErrNonFinite},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := DecodeFrame(tt.in, tt.lim)
			if !errors.Is(err, tt.want) {
				t.Fatalf("DecodeFrame = %+v, %v; want error %v", f.Header, err, tt.want)
			}
		})
	}
}

func TestAppendFrameErrors(t *testing.T) {
	h := FrameHeader{TensorKey: actKey(), DType: F32, Shape: Shape{2, 1, 1, 1}, ChunkCount: 1}
	tests := []struct {
		name    string
		h       FrameHeader
		payload []byte
		want    error
	}{
		{"nan", h, AppendFloat32s(nil, []float32{1, float32(math.NaN())}), ErrNonFinite},
		{"short-payload", h, AppendFloat32s(nil, []float32{1}), ErrPayloadLength},
		{"bad-kind", FrameHeader{DType: F32, Shape: h.Shape, ChunkCount: 1}, make([]byte, 8), ErrBadHeader},
		{"bad-count", FrameHeader{TensorKey: actKey(), DType: F32, Shape: h.Shape}, make([]byte, 8), ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dst := []byte("keep")
			got, err := AppendFrame(dst, tt.h, tt.payload, Limits{})
			if !errors.Is(err, tt.want) {
				t.Fatalf("AppendFrame = %v, want %v", err, tt.want)
			}
			if string(got) != "keep" {
				t.Errorf("dst changed on error: %q", got)
			}
		})
	}
}

func TestShapeOf(t *testing.T) {
	tests := []struct {
		name string
		dims []int
		want Shape
		err  error
	}{
		{"scalar", nil, Shape{1, 1, 1, 1}, nil},
		{"btc", []int{16, 128, 256}, Shape{16, 128, 256, 1}, nil},
		{"four", []int{1, 2, 3, 4}, Shape{1, 2, 3, 4}, nil},
		{"zero", []int{0, 64}, Shape{0, 64, 1, 1}, nil},
		{"five", []int{1, 1, 1, 1, 1}, Shape{}, ErrBadShape},
		{"negative", []int{2, -1}, Shape{}, ErrBadShape},
		{"too-big", []int{1 << 33}, Shape{}, ErrBadShape},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ShapeOf(tt.dims...)
			if !errors.Is(err, tt.err) || got != tt.want {
				t.Fatalf("ShapeOf(%v) = %v, %v; want %v, %v", tt.dims, got, err, tt.want, tt.err)
			}
		})
	}
}

func TestPayloadHelpers(t *testing.T) {
	x := []float32{0, -1.5, float32(math.Inf(1)), 3e-40}
	got, err := Float32s(AppendFloat32s(nil, x))
	if err != nil || !reflect.DeepEqual(got, x) {
		t.Errorf("Float32s round trip = %v, %v", got, err)
	}
	ids := []int32{0, -1, math.MaxInt32, math.MinInt32}
	gotIDs, err := Int32s(AppendInt32s(nil, ids))
	if err != nil || !reflect.DeepEqual(gotIDs, ids) {
		t.Errorf("Int32s round trip = %v, %v", gotIDs, err)
	}
	if _, err := Float32s(make([]byte, 3)); !errors.Is(err, ErrPayloadLength) {
		t.Errorf("Float32s(3 bytes) = %v", err)
	}
	if _, err := Int32s(make([]byte, 5)); !errors.Is(err, ErrPayloadLength) {
		t.Errorf("Int32s(5 bytes) = %v", err)
	}
}

// TestFrameKeyFields: a header whose fields its kind does not give a meaning is refused by the
// encoder and the decoder alike, before anything is allocated for it.
func TestFrameKeyFields(t *testing.T) {
	tests := []struct {
		name string
		key  TensorKey
		dt   DType
	}{
		{"expert rows marked partial", TensorKey{Kind: KindExpertIn, MicroBatch: 1<<31 | 1, Block: 1, Expert: 2}, F32},
		{"expert output marked partial", TensorKey{Kind: KindExpertOut, MicroBatch: 1 << 31, Block: 1, Expert: 2}, F32},
		{"a partial gradient of a third group", TensorKey{Kind: KindExpertGradOut, MicroBatch: 1<<31 | 2, Block: 1, Expert: 2}, F32},
		{"an empty gradient-tree node", TensorKey{Kind: KindGradReduce, MicroBatch: 3<<16 | 3, Block: 1, Expert: 0}, F32},
		{"a gradient-tree node backwards", TensorKey{Kind: KindGradReduce, MicroBatch: 4<<16 | 1, Block: 1, Expert: 0}, F32},
		{"a gradient-tree node of replica 2^12", TensorKey{Kind: KindGradReduce, MicroBatch: 0<<16 | 1, Block: 1, Expert: 1 << 12}, F32},
		{"an outer step's tensor of attempt MaxReplicas", TensorKey{Kind: KindOuterDelta, MicroBatch: OuterParts * MaxReplicas, Block: 1, Expert: 0}, F32},
		{"an outer step's tensor as int32", TensorKey{Kind: KindOuterDelta, MicroBatch: 0, Block: 1, Expert: 0}, I32},
		{"an outer step's tensor of tensor 2^20", TensorKey{Kind: KindOuterDelta, MicroBatch: 0, Block: 1 << 20, Expert: 0}, F32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := FrameHeader{TensorKey: tt.key, DType: tt.dt, Shape: Shape{16, 1, 1, 1}, ChunkCount: 1}
			payload := make([]byte, 64)
			if _, err := AppendFrame(nil, h, payload, Limits{}); !errors.Is(err, ErrBadHeader) {
				t.Errorf("AppendFrame: %v, want ErrBadHeader", err)
			}
			if _, err := DecodeFrame(rawFrame(h, payload), Limits{}); !errors.Is(err, ErrBadHeader) {
				t.Errorf("DecodeFrame: %v, want ErrBadHeader", err)
			}
		})
	}
}
