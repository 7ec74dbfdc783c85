package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"path/filepath"
	"testing"
)

func sample() []Tensor {
	return []Tensor{
		{Name: "a", Shape: []int{2, 3}, Data: []float32{1, 2, 3, 4, 5, float32(math.Inf(1))}},
		{Name: "b.weight", Shape: []int{1}, Data: []float32{-0.5}},
		{Name: "empty", Shape: []int{0, 4}, Data: []float32{}},
	}
}

func TestRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.safetensors")
	if err := WriteFile(path, sample(), map[string]string{"step": "3"}); err != nil {
		t.Fatal(err)
	}
	got, meta, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if meta["step"] != "3" || len(got) != 3 {
		t.Fatalf("meta %v, %d tensors", meta, len(got))
	}
	for i, w := range sample() {
		g := got[i]
		if g.Name != w.Name || len(g.Data) != len(w.Data) {
			t.Fatalf("tensor %d: %s %v, want %s %v", i, g.Name, g.Shape, w.Name, w.Shape)
		}
		for j := range w.Data {
			if math.Float32bits(g.Data[j]) != math.Float32bits(w.Data[j]) {
				t.Fatalf("%s[%d] = %v, want %v", w.Name, j, g.Data[j], w.Data[j])
			}
		}
	}
}

func encode(t *testing.T) []byte {
	var buf bytes.Buffer
	if err := Write(&buf, sample(), nil); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func withHeader(h string, data []byte) []byte {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(h)))
	return append(append(n[:], h...), data...)
}

func TestReadRejects(t *testing.T) {
	good := encode(t)
	tests := []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"header longer than file", good[:20]},
		{"truncated data", good[:len(good)-1]},
		{"trailing bytes", append(append([]byte{}, good...), 0)},
		{"huge header length", append([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, good[8:]...)},
		{"not json", withHeader("{nope", nil)},
		{"dtype", withHeader(`{"x":{"dtype":"F16","shape":[1],"data_offsets":[0,2]}}`, []byte{0, 0})},
		{"shape mismatch", withHeader(`{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, make([]byte, 4))},
		{"negative dim", withHeader(`{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, make([]byte, 4))},
		{"giant shape", withHeader(`{"x":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4]}}`, make([]byte, 4))},
		{"gap", withHeader(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, make([]byte, 8))},
		{"overlap", withHeader(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, make([]byte, 4))},
		{"bad metadata", withHeader(`{"__metadata__":{"step":3}}`, nil)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := Read(tc.b); !errors.Is(err, ErrFormat) {
				t.Fatalf("got %v, want ErrFormat", err)
			}
		})
	}
}

func TestWriteRejectsShapeMismatch(t *testing.T) {
	var buf bytes.Buffer
	if err := Write(&buf, []Tensor{{Name: "x", Shape: []int{3}, Data: []float32{1}}}, nil); err == nil {
		t.Fatal("accepted")
	}
}

// FuzzRead: no input makes Read panic or return tensors that disagree with their shapes.
func FuzzRead(f *testing.F) {
	var buf bytes.Buffer
	Write(&buf, sample(), map[string]string{"k": "v"})
	f.Add(buf.Bytes())
	f.Add(withHeader(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, make([]byte, 4)))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		ts, _, err := Read(b)
		if err != nil {
			return
		}
		for _, tt := range ts {
			n := 1
			for _, d := range tt.Shape {
				n *= d
			}
			if n != len(tt.Data) {
				t.Fatalf("%s: shape %v, %d values", tt.Name, tt.Shape, len(tt.Data))
			}
		}
	})
}

// ReadHeader reads the header from a stream and leaves the data in it, in Header.Tensors order.
func TestReadHeader(t *testing.T) {
	var buf bytes.Buffer
	if err := Write(&buf, sample(), map[string]string{"step": "3"}); err != nil {
		t.Fatal(err)
	}
	file := buf.Bytes()
	r := bytes.NewReader(file)
	h, err := ReadHeader(r, 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	if h.Meta["step"] != "3" || len(h.Tensors) != 3 || h.FileBytes() != int64(len(file)) {
		t.Fatalf("header %+v of a %d-byte file", h, len(file))
	}
	if rest := int64(r.Len()); rest != h.DataBytes() {
		t.Errorf("%d bytes left in the stream, want the %d of the data", rest, h.DataBytes())
	}
	for i, w := range sample() {
		e := h.Tensors[i]
		if e.Name != w.Name || e.Elements() != int64(len(w.Data)) {
			t.Errorf("entry %d: %+v, want %s with %d values", i, e, w.Name, len(w.Data))
		}
		v := make([]float32, e.Elements())
		DecodeF32(v, file[8+h.Len+e.Begin:8+h.Len+e.End])
		for j := range v {
			if math.Float32bits(v[j]) != math.Float32bits(w.Data[j]) {
				t.Errorf("%s[%d] = %v, want %v", w.Name, j, v[j], w.Data[j])
			}
		}
	}
}

// A stream's header length is checked against the caller's bound before anything is allocated
// for it or read of it.
func TestReadHeaderBounds(t *testing.T) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], 1<<40)
	r := bytes.NewReader(append(n[:], "{}"...))
	if _, err := ReadHeader(r, 1<<20); !errors.Is(err, ErrFormat) {
		t.Errorf("a 1 TiB header: %v, want ErrFormat", err)
	}
	if r.Len() != 2 {
		t.Errorf("read %d bytes past the length of a refused header", 2-r.Len())
	}
	good := encode(t)
	if _, err := ReadHeader(bytes.NewReader(good), 16); !errors.Is(err, ErrFormat) {
		t.Errorf("a header over the caller's bound: %v, want ErrFormat", err)
	}
	if _, err := ReadHeader(bytes.NewReader(good[:20]), 0); err == nil {
		t.Error("a truncated header was read")
	}
	huge := withHeader(`{"x":{"dtype":"F32","shape":[2147483648,2147483648,2147483648],"data_offsets":[0,4]}}`, nil)
	if _, err := ReadHeader(bytes.NewReader(huge), 0); !errors.Is(err, ErrFormat) {
		t.Errorf("a shape past 2^50 values: %v, want ErrFormat", err)
	}
}

// FuzzReadHeader: no stream makes ReadHeader panic or return entries that do not tile the data.
func FuzzReadHeader(f *testing.F) {
	var buf bytes.Buffer
	Write(&buf, sample(), map[string]string{"k": "v"})
	f.Add(buf.Bytes())
	f.Add(withHeader(`{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, make([]byte, 4)))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ReadHeader(bytes.NewReader(b), 1<<16)
		if err != nil {
			return
		}
		var end int64
		for _, e := range h.Tensors {
			n := int64(1)
			for _, d := range e.Shape {
				n *= int64(d)
			}
			if e.Begin != end || e.End-e.Begin != 4*n {
				t.Fatalf("%s: [%d,%d) for shape %v after %d", e.Name, e.Begin, e.End, e.Shape, end)
			}
			end = e.End
		}
	})
}
