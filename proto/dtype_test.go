package proto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// The compressed dtypes of boundary tensors: BF16 and I8 (a float32 scale per row, then codes).

// bf16Tensor is n bfloat16 values (the top halves of normal float32s) of the given shape.
func bf16Tensor(key TensorKey, shape Shape, n int, seed uint64) Tensor {
	r := rand.New(rand.NewPCG(seed, 1))
	h := make([]uint16, n)
	for i := range h {
		h[i] = uint16(math.Float32bits(float32(r.NormFloat64())) >> 16)
	}
	return Tensor{Key: key, DType: BF16, Shape: shape, Data: AppendBF16s(nil, h)}
}

// i8Tensor is rows×cols codes in [-127, 127] with positive scales; row 0 is a zero row (scale 0,
// codes 0) when zeroRow.
func i8Tensor(key TensorKey, rows, cols int, seed uint64, zeroRow bool) Tensor {
	r := rand.New(rand.NewPCG(seed, 2))
	scale, q := make([]float32, rows), make([]int8, rows*cols)
	for i := range scale {
		scale[i] = float32(r.Float64() + 1e-3)
	}
	for i := range q {
		q[i] = int8(r.IntN(255) - 127)
	}
	if zeroRow && rows > 0 {
		scale[0] = 0
		clear(q[:cols])
	}
	return Tensor{Key: key, DType: I8, Shape: Shape{uint32(rows), uint32(cols), 1, 1}, Data: AppendI8Rows(nil, scale, q)}
}

func expertInKey() TensorKey {
	return TensorKey{Kind: KindExpertIn, PlanVersion: 2, Step: 7, MicroBatch: 3, Block: 1, Expert: 2}
}

func TestShapeBytes(t *testing.T) {
	tests := []struct {
		name  string
		shape Shape
		dtype DType
		max   int
		want  int
		err   error
	}{
		{"f32", Shape{2, 3, 4, 1}, F32, 1 << 20, 96, nil},
		{"bf16", Shape{2, 3, 4, 1}, BF16, 1 << 20, 48, nil},
		{"i8", Shape{5, 64, 1, 1}, I8, 1 << 20, 5 * (4 + 64), nil},
		{"i8 one column", Shape{3, 1, 1, 1}, I8, 1 << 20, 15, nil},
		{"i8 no rows", Shape{0, 64, 1, 1}, I8, 1 << 20, 0, nil},
		{"i8 empty rows", Shape{5, 0, 1, 1}, I8, 1 << 20, 0, nil},
		{"i8 at the limit", Shape{4, 60, 1, 1}, I8, 256, 256, nil},
		{"i8 over the limit", Shape{4, 61, 1, 1}, I8, 256, 0, ErrTensorTooLarge},
		{"i8 row over the limit", Shape{1, math.MaxUint32, 1, 1}, I8, 1 << 30, 0, ErrTensorTooLarge},
		{"i8 overflow", Shape{math.MaxUint32, math.MaxUint32, 1, 1}, I8, math.MaxInt, 0, ErrTensorTooLarge},
		{"i8 three dimensions", Shape{2, 3, 4, 1}, I8, 1 << 20, 0, ErrBadShape},
		{"i8 four dimensions", Shape{2, 3, 1, 4}, I8, 1 << 20, 0, ErrBadShape},
		{"unknown dtype", Shape{1, 1, 1, 1}, DType(9), 1 << 20, 0, ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.shape.Bytes(tt.dtype, tt.max)
			if !errors.Is(err, tt.err) || err == nil && got != tt.want {
				t.Errorf("Bytes = %d, %v; want %d, %v", got, err, tt.want, tt.err)
			}
		})
	}
}

// TestCompressedRoundTrip splits tensors of the new dtypes into frames and reassembles them in
// reverse order: the same bytes come back, and the frames have the sizes the format says. The
// large I8 and I4 tensors' scales alone span more than one chunk.
func TestCompressedRoundTrip(t *testing.T) {
	bigRows := MaxChunkPayload/4 + 100 // the scales end inside chunk 1
	tests := []struct {
		name   string
		t      Tensor
		bytes  int
		chunks int
	}{
		{"bf16 activation", bf16Tensor(actKey(), Shape{2, 3, 4, 1}, 24, 1), 48, 1},
		{"bf16 default activation", bf16Tensor(actKey(), Shape{4, 128, 256, 1}, 4*128*256, 2), 4 * 128 * 256 * 2, 5},
		{"i8 expert rows", i8Tensor(expertInKey(), 5, 64, 3, true), 5 * 68, 1},
		{"i8 empty", Tensor{Key: expertInKey(), DType: I8, Shape: Shape{0, 64, 1, 1}}, 0, 1},
		{"i8 default activation", i8Tensor(actKey(), 4*128, 256, 4, false), 4 * 128 * 260, 3},
		{"i8 scales over two chunks", i8Tensor(expertInKey(), bigRows, 3, 5, true), bigRows * 7, 2},
		{"i4 default activation", i4Tensor(actKey(), 512, 256, 1, true), 512 * (16 + 128), 2},
		{"i4 odd rows", i4Tensor(expertInKey(), 5, 33, 2, true), 5 * (4 + 17), 1},
		{"i4 empty", Tensor{Key: expertInKey(), DType: I4, Shape: Shape{0, 64, 1, 1}}, 0, 1},
		// One group a row: the scales end inside chunk 1.
		{"i4 scales over two chunks", i4Tensor(expertInKey(), MaxChunkPayload/2+100, 3, 3, false), (MaxChunkPayload/2 + 100) * 4, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if len(tt.t.Data) != tt.bytes {
				t.Fatalf("payload of %d bytes, want %d", len(tt.t.Data), tt.bytes)
			}
			frames, err := SplitTensor(tt.t, Limits{})
			if err != nil {
				t.Fatal(err)
			}
			if len(frames) != tt.chunks {
				t.Fatalf("%d frames, want %d", len(frames), tt.chunks)
			}
			r := NewReassembler(Limits{})
			for i := len(frames) - 1; i >= 0; i-- {
				got, done, err := r.Add(frames[i])
				if err != nil {
					t.Fatalf("frame %d: %v", i, err)
				}
				if done != (i == 0) {
					t.Fatalf("frame %d: done %v", i, done)
				}
				if done && (got.DType != tt.t.DType || got.Shape != tt.t.Shape || !bytes.Equal(got.Data, tt.t.Data)) {
					t.Fatalf("reassembled %v %v, %d bytes; sent %v %v, %d bytes", got.DType, got.Shape, len(got.Data), tt.t.DType, tt.t.Shape, len(tt.t.Data))
				}
			}
		})
	}
}

func TestDecodeCompressedErrors(t *testing.T) {
	i8 := i8Tensor(expertInKey(), 3, 4, 6, true) // 12 bytes of scales, 12 of codes
	i8Frame := func(edit func(b []byte)) []byte {
		frames, err := SplitTensor(i8, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		b := frames[0]
		if edit != nil {
			edit(b[HeaderSize:])
		}
		return b
	}
	scale := func(r int, v uint32) []byte {
		return i8Frame(func(p []byte) { binary.LittleEndian.PutUint32(p[4*r:], v) })
	}
	bf := bf16Tensor(actKey(), Shape{2, 2, 1, 1}, 4, 7)
	bfFrame := func(i int, v uint16) []byte {
		frames, err := SplitTensor(bf, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		binary.LittleEndian.PutUint16(frames[0][HeaderSize+2*i:], v)
		return frames[0]
	}
	header := func(b []byte, edit func(h []byte)) []byte { edit(b); return b }
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"i8 good", i8Frame(nil), nil},
		{"i8 negative scale", scale(1, math.Float32bits(-0.5)), ErrBadQuantization},
		{"i8 negative zero scale", scale(0, 0x80000000), ErrBadQuantization},
		{"i8 NaN scale", scale(2, 0x7fc00000), ErrNonFinite},
		{"i8 +Inf scale", scale(1, 0x7f800000), ErrNonFinite},
		{"i8 -Inf scale", scale(1, 0xff800000), ErrNonFinite},
		{"i8 code -128", i8Frame(func(p []byte) { p[12+5] = 0x80 }), ErrBadQuantization},
		{"i8 truncated", i8Frame(nil)[:HeaderSize+23], ErrPayloadLength},
		{"i8 extra byte", append(i8Frame(nil), 0), ErrPayloadLength},
		{"i8 not a matrix", header(i8Frame(nil), func(h []byte) { binary.LittleEndian.PutUint32(h[40:], 2) }), ErrBadShape},
		{"i8 tokens", header(i8Frame(nil), func(h []byte) {
			h[3] = byte(KindTokens)
			binary.LittleEndian.PutUint32(h[24:], NoBlock)
			binary.LittleEndian.PutUint32(h[28:], NoExpert)
		}), ErrBadHeader},
		{"bf16 good", bfFrame(0, 0x3f80), nil},
		{"bf16 +Inf", bfFrame(3, 0x7f80), ErrNonFinite},
		{"bf16 NaN", bfFrame(1, 0xffc1), ErrNonFinite},
		{"bf16 odd length", header(bfFrame(0, 0)[:HeaderSize+7], func(h []byte) { binary.LittleEndian.PutUint32(h[56:], 7) }), ErrPayloadLength},
		{"bf16 targets", header(bfFrame(0, 0), func(h []byte) {
			h[3] = byte(KindTargets)
			binary.LittleEndian.PutUint32(h[24:], NoBlock)
		}), ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeFrame(tt.in, Limits{})
			if !errors.Is(err, tt.want) || (err == nil) != (tt.want == nil) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
}

// TestI8ChunkScales: a bad scale in the part of the scales a later chunk holds is refused there,
// and a chunk of codes only is not read as scales.
func TestI8ChunkScales(t *testing.T) {
	rows := MaxChunkPayload/4 + 10
	tt := i8Tensor(expertInKey(), rows, 2, 8, false)
	frames, err := SplitTensor(tt, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range frames {
		if _, err := DecodeFrame(f, Limits{}); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
	}
	bad := append([]byte(nil), frames[1]...)
	binary.LittleEndian.PutUint32(bad[HeaderSize+4*3:], math.Float32bits(-1)) // row MaxChunkPayload/4 + 3
	if _, err := DecodeFrame(bad, Limits{}); !errors.Is(err, ErrBadQuantization) {
		t.Errorf("negative scale in chunk 1: %v", err)
	}
	// Past the scales, what would be a negative scale (0xff7f0101) is four good codes.
	codes := append([]byte(nil), frames[1]...)
	binary.LittleEndian.PutUint32(codes[HeaderSize+4*12:], 0xff7f0101)
	if _, err := DecodeFrame(codes, Limits{}); err != nil {
		t.Errorf("codes 1, 1, 127, -1 past the scales: %v", err)
	}
}

// TestI8ZeroRows: a row of scale 0 has only zero codes. One chunk cannot tell (its scales may be
// in another), so the whole tensor is checked: by the sender (SplitTensor), the Reassembler, and
// I8Rows.
func TestI8ZeroRows(t *testing.T) {
	good := i8Tensor(expertInKey(), 3, 4, 9, true)
	bad := Tensor{Key: good.Key, DType: I8, Shape: good.Shape, Data: append([]byte(nil), good.Data...)}
	bad.Data[12+2] = 1 // row 0, column 2
	if _, err := SplitTensor(bad, Limits{}); !errors.Is(err, ErrBadQuantization) {
		t.Errorf("SplitTensor: %v", err)
	}
	h := FrameHeader{TensorKey: bad.Key, DType: I8, Shape: bad.Shape, ChunkCount: 1}
	frame, err := AppendFrame(nil, h, bad.Data, Limits{})
	if err != nil {
		t.Fatalf("one chunk cannot tell, AppendFrame should take it: %v", err)
	}
	if _, _, err := NewReassembler(Limits{}).Add(frame); !errors.Is(err, ErrBadQuantization) {
		t.Errorf("Reassembler: %v", err)
	}
	if _, _, err := I8Rows(bad.Data, 3, 4); !errors.Is(err, ErrBadQuantization) {
		t.Errorf("I8Rows: %v", err)
	}
	scale, q, err := I8Rows(good.Data, 3, 4)
	if err != nil || len(scale) != 3 || len(q) != 12 || scale[0] != 0 || !bytes.Equal(AppendI8Rows(nil, scale, q), good.Data) {
		t.Errorf("I8Rows of a good payload: %v %v %v", scale, q, err)
	}
	for _, c := range []struct {
		name       string
		b          []byte
		rows, cols int
	}{
		{"short", good.Data[:23], 3, 4},
		{"long", append(append([]byte(nil), good.Data...), 0), 3, 4},
		{"rows for nothing", nil, 3, 4},
		{"huge rows", good.Data, math.MaxInt32, 4},
		{"negative", good.Data, -3, 4},
	} {
		if _, _, err := I8Rows(c.b, c.rows, c.cols); !errors.Is(err, ErrPayloadLength) {
			t.Errorf("I8Rows %s: %v", c.name, err)
		}
	}
	if _, err := BF16s([]byte{1, 2, 3}); !errors.Is(err, ErrPayloadLength) {
		t.Errorf("BF16s of 3 bytes: %v", err)
	}
}
