package proto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// i4Tensor is rows×cols int4 codes in [-7, 7] with positive bfloat16 scales; row 0's first group
// is a zero group (scale 0, codes 0) when zeroGroup. An odd row's padding nibbles are 0.
func i4Tensor(key TensorKey, rows, cols int, seed uint64, zeroGroup bool) Tensor {
	r := rand.New(rand.NewPCG(seed, 3))
	_, groups, rowBytes := i4Layout(rows, cols)
	scales, codes := make([]uint16, rows*groups), make([]byte, rows*rowBytes)
	for i := range scales {
		scales[i] = uint16(math.Float32bits(float32(r.Float64()+1e-3)) >> 16)
	}
	for row := 0; row < rows; row++ {
		for c := 0; c < cols; c++ {
			q := int8(r.IntN(15) - 7)
			if zeroGroup && row == 0 && c < I4Group {
				q = 0
			}
			codes[row*rowBytes+c/2] |= byte(q&0xf) << (4 * (c & 1))
		}
	}
	if zeroGroup && rows > 0 {
		scales[0] = 0
	}
	return Tensor{Key: key, DType: I4, Shape: Shape{uint32(rows), uint32(cols), 1, 1}, Data: AppendI4Rows(nil, scales, codes)}
}

func TestShapeBytesI4(t *testing.T) {
	tests := []struct {
		name  string
		shape Shape
		max   int
		want  int
		err   error
	}{
		{"default activation rows", Shape{512, 256, 1, 1}, 1 << 20, 512 * (2*8 + 128), nil},
		{"one short group", Shape{3, 33, 1, 1}, 1 << 20, 3 * (2*2 + 17), nil},
		{"one value", Shape{1, 1, 1, 1}, 1 << 20, 3, nil},
		{"no rows", Shape{0, 64, 1, 1}, 1 << 20, 0, nil},
		{"at the limit", Shape{2, 64, 1, 1}, 72, 72, nil},
		{"over the limit", Shape{2, 65, 1, 1}, 72, 0, ErrTensorTooLarge},
		{"overflow", Shape{math.MaxUint32, math.MaxUint32, 1, 1}, math.MaxInt, 0, ErrTensorTooLarge},
		{"three dimensions", Shape{2, 3, 4, 1}, 1 << 20, 0, ErrBadShape},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.shape.Bytes(I4, tt.max)
			if !errors.Is(err, tt.err) || err == nil && got != tt.want {
				t.Errorf("Bytes = %d, %v; want %d, %v", got, err, tt.want, tt.err)
			}
		})
	}
}

// TestI4Rows: I4Rows reads back what AppendI4Rows wrote (TestCompressedRoundTrip sends I4
// tensors through frames).
func TestI4Rows(t *testing.T) {
	for _, c := range []struct{ rows, cols int }{{512, 256}, {5, 33}, {1, 1}, {0, 64}} {
		tn := i4Tensor(actKey(), c.rows, c.cols, 5, true)
		scales, codes, err := I4Rows(tn.Data, c.rows, c.cols)
		if err != nil || !bytes.Equal(AppendI4Rows(nil, scales, codes), tn.Data) {
			t.Errorf("%d rows of %d: %v", c.rows, c.cols, err)
		}
	}
}

// TestDecodeI4Errors: a frame of I4 is refused for each rule of the format, a one-chunk rule at
// the chunk, a zero group's codes when the tensor is whole.
func TestDecodeI4Errors(t *testing.T) {
	good := i4Tensor(expertInKey(), 3, 33, 4, true) // 12 bytes of scales (2 groups a row), then 17 a row
	edited := func(edit func(p []byte)) Tensor {
		b := append([]byte(nil), good.Data...)
		edit(b)
		return Tensor{Key: good.Key, DType: I4, Shape: good.Shape, Data: b}
	}
	// frame is tn's one frame: good's, with tn's payload written over it, so that DecodeFrame
	// sees what a sender that skipped the checks would send.
	frame := func(tn Tensor) []byte {
		b, err := AppendFrame(nil, FrameHeader{TensorKey: good.Key, DType: I4, Shape: good.Shape, ChunkCount: 1}, good.Data, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		copy(b[HeaderSize:], tn.Data)
		return b
	}
	scale := func(i int, v uint16) Tensor {
		return edited(func(p []byte) { binary.LittleEndian.PutUint16(p[2*i:], v) })
	}
	const codes = 12
	tests := []struct {
		name  string
		t     Tensor
		chunk error // DecodeFrame's verdict on the one chunk
		whole error // the whole tensor's: SplitTensor, the Reassembler and I4Rows
	}{
		{"good", good, nil, nil},
		{"negative scale", scale(3, 0xbf80), ErrBadQuantization, ErrBadQuantization},
		{"negative zero scale", scale(1, 0x8000), ErrBadQuantization, ErrBadQuantization},
		{"NaN scale", scale(2, 0x7fc0), ErrNonFinite, ErrNonFinite},
		{"Inf scale", scale(5, 0x7f80), ErrNonFinite, ErrNonFinite},
		{"code -8, low nibble", edited(func(p []byte) { p[codes+20] = p[codes+20]&0xf0 | 0x8 }), ErrBadQuantization, ErrBadQuantization},
		{"code -8, high nibble", edited(func(p []byte) { p[codes+3] = p[codes+3]&0x0f | 0x80 }), ErrBadQuantization, ErrBadQuantization},
		{"padding nibble", edited(func(p []byte) { p[codes+17+16] |= 0x10 }), ErrBadQuantization, ErrBadQuantization},
		{"code in a zero group", edited(func(p []byte) { p[codes+4] |= 0x01 }), nil, ErrBadQuantization},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := frame(tt.t)
			if _, err := DecodeFrame(f, Limits{}); !errors.Is(err, tt.chunk) || (err == nil) != (tt.chunk == nil) {
				t.Errorf("DecodeFrame: %v, want %v", err, tt.chunk)
			}
			if tt.chunk == nil {
				if _, _, err := NewReassembler(Limits{}).Add(f); !errors.Is(err, tt.whole) || (err == nil) != (tt.whole == nil) {
					t.Errorf("Reassembler: %v, want %v", err, tt.whole)
				}
			}
			if _, err := SplitTensor(tt.t, Limits{}); !errors.Is(err, tt.whole) || (err == nil) != (tt.whole == nil) {
				t.Errorf("SplitTensor: %v, want %v", err, tt.whole)
			}
			if _, _, err := I4Rows(tt.t.Data, 3, 33); !errors.Is(err, tt.whole) || (err == nil) != (tt.whole == nil) {
				t.Errorf("I4Rows: %v, want %v", err, tt.whole)
			}
		})
	}
	for _, c := range []struct {
		name       string
		b          []byte
		rows, cols int
	}{
		{"short", good.Data[:len(good.Data)-1], 3, 33},
		{"long", append(append([]byte(nil), good.Data...), 0), 3, 33},
		{"rows for nothing", nil, 3, 33},
		{"huge rows", good.Data, math.MaxInt32, 33},
		{"negative", good.Data, -3, 33},
	} {
		if _, _, err := I4Rows(c.b, c.rows, c.cols); !errors.Is(err, ErrPayloadLength) {
			t.Errorf("I4Rows %s: %v", c.name, err)
		}
	}
	// Only boundary tensors may be I4.
	for _, k := range []Kind{KindTokens, KindGradReduce, KindOuterDelta, KindState} {
		if err := k.checkTensor(I4, Shape{1, 1, 1, 1}); !errors.Is(err, ErrBadHeader) {
			t.Errorf("%v as I4: %v", k, err)
		}
	}
}
