package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
)

// Tensor is one named float32 tensor.
type Tensor struct {
	Name  string
	Shape []int
	Data  []float32
}

// MaxHeader bounds the JSON header a reader accepts.
const MaxHeader = 64 << 20

// ErrFormat is wrapped by every error about a malformed file.
var ErrFormat = errors.New("malformed safetensors")

type entry struct {
	DType   string   `json:"dtype"`
	Shape   []int    `json:"shape"`
	Offsets [2]int64 `json:"data_offsets"`
}

// Write encodes tensors, in the order given, with metadata meta (may be nil).
func Write(w io.Writer, tensors []Tensor, meta map[string]string) error {
	header := make(map[string]any, len(tensors)+1)
	var off int64
	for _, t := range tensors {
		n := 1
		for _, d := range t.Shape {
			n *= d
		}
		if n != len(t.Data) {
			return fmt.Errorf("write %s: shape %v holds %d values, data has %d", t.Name, t.Shape, n, len(t.Data))
		}
		if _, dup := header[t.Name]; dup || t.Name == "__metadata__" {
			return fmt.Errorf("write %s: duplicate or reserved name", t.Name)
		}
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		header[t.Name] = entry{"F32", shape, [2]int64{off, off + int64(4*n)}}
		off += int64(4 * n)
	}
	if meta != nil {
		header["__metadata__"] = meta
	}
	h, err := json.Marshal(header)
	if err != nil {
		return err
	}
	// Pad the header with spaces so the data starts 8-byte aligned, as the reference writer does.
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(h)))
	bw := &errWriter{w: w}
	bw.write(n[:])
	bw.write(h)
	buf := make([]byte, 0, 1<<16)
	for _, t := range tensors {
		for _, v := range t.Data {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
			if len(buf) == cap(buf) {
				bw.write(buf)
				buf = buf[:0]
			}
		}
	}
	bw.write(buf)
	return bw.err
}

type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) write(b []byte) {
	if e.err == nil {
		_, e.err = e.w.Write(b)
	}
}

// WriteFile writes atomically: a temporary file in the same directory, fsynced, then renamed, so
// a crash leaves either the old file or the new one, never half of one.
func WriteFile(path string, tensors []Tensor, meta map[string]string) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	var buf bytes.Buffer
	if err = Write(&buf, tensors, meta); err != nil {
		return err
	}
	if _, err = f.Write(buf.Bytes()); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(f.Name(), path); err != nil {
		return err
	}
	if d, derr := os.Open(filepath.Dir(path)); derr == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// Read decodes a whole file held in b. Tensors come back sorted by data offset (file order).
func Read(b []byte) ([]Tensor, map[string]string, error) {
	bad := func(f string, a ...any) error { return fmt.Errorf("%w: %s", ErrFormat, fmt.Sprintf(f, a...)) }
	if len(b) < 8 {
		return nil, nil, bad("%d bytes, shorter than the header length", len(b))
	}
	hn := binary.LittleEndian.Uint64(b[:8])
	if hn > MaxHeader || hn > uint64(len(b)-8) {
		return nil, nil, bad("header of %d bytes in a file of %d", hn, len(b))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+hn], &raw); err != nil {
		return nil, nil, bad("header: %v", err)
	}
	data := b[8+hn:]
	var meta map[string]string
	type named struct {
		name string
		e    entry
	}
	var entries []named
	for name, r := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(r, &meta); err != nil {
				return nil, nil, bad("__metadata__ must map strings to strings: %v", err)
			}
			continue
		}
		var e entry
		if err := json.Unmarshal(r, &e); err != nil {
			return nil, nil, bad("%s: %v", name, err)
		}
		entries = append(entries, named{name, e})
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].e.Offsets[0] < entries[j].e.Offsets[0] })
	out := make([]Tensor, 0, len(entries))
	var end int64
	for _, ne := range entries {
		e := ne.e
		if e.DType != "F32" {
			return nil, nil, bad("%s: dtype %s, only F32 is supported", ne.name, e.DType)
		}
		n := int64(1)
		for _, d := range e.Shape {
			if d < 0 || d > 1<<31 {
				return nil, nil, bad("%s: dimension %d", ne.name, d)
			}
			n *= int64(d)
			if n > int64(len(data)) {
				return nil, nil, bad("%s: shape %v larger than the file", ne.name, e.Shape)
			}
		}
		lo, hi := e.Offsets[0], e.Offsets[1]
		if lo != end || hi < lo || hi > int64(len(data)) || hi-lo != 4*n {
			return nil, nil, bad("%s: data_offsets [%d,%d) for shape %v (expected to start at %d, within %d bytes)", ne.name, lo, hi, e.Shape, end, len(data))
		}
		end = hi
		v := make([]float32, n)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[lo+4*int64(i):]))
		}
		out = append(out, Tensor{Name: ne.name, Shape: append([]int{}, e.Shape...), Data: v})
	}
	if end != int64(len(data)) {
		return nil, nil, bad("%d trailing bytes after the last tensor", int64(len(data))-end)
	}
	return out, meta, nil
}

// ReadFile reads and decodes path.
func ReadFile(path string) ([]Tensor, map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	t, m, err := Read(b)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, m, nil
}
