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
	for _, t := range tensors {
		if n := Elements(t.Shape); n != len(t.Data) {
			return fmt.Errorf("write %s: shape %v holds %d values, data has %d", t.Name, t.Shape, n, len(t.Data))
		}
	}
	if err := WriteHeader(w, tensors, meta); err != nil {
		return err
	}
	bw := &errWriter{w: w}
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

// WriteHeader writes the header of a file of tensors (their names and shapes, in the order
// given; their Data is not read) with metadata meta (may be nil): what Write writes before the
// values. The caller then writes each tensor's values, 4·(its shape's product) little-endian
// bytes, in the same order — a file too large to hold at once, written a tensor at a time.
func WriteHeader(w io.Writer, tensors []Tensor, meta map[string]string) error {
	header := make(map[string]any, len(tensors)+1)
	var off int64
	for _, t := range tensors {
		n := Elements(t.Shape)
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
	return bw.err
}

// Elements is the number of values of a tensor of shape.
func Elements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
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

// Entry is one tensor as a header describes it: its shape and where its bytes lie in the data
// section that follows the header.
type Entry struct {
	Name       string
	Shape      []int
	Begin, End int64 // byte range in the data section
}

// Elements is the number of values the shape holds.
func (e Entry) Elements() int64 { return (e.End - e.Begin) / 4 }

// Header is a decoded safetensors header.
type Header struct {
	// Tensors are sorted by offset (file order); they tile the data section from 0 without gaps
	// or overlaps.
	Tensors []Entry
	Meta    map[string]string // nil when the file has no __metadata__
	Len     int64             // bytes of the JSON header, after the 8-byte length
}

// DataBytes is the size of the data section the header describes.
func (h Header) DataBytes() int64 {
	if len(h.Tensors) == 0 {
		return 0
	}
	return h.Tensors[len(h.Tensors)-1].End
}

// FileBytes is the size of the whole file the header describes.
func (h Header) FileBytes() int64 { return 8 + h.Len + h.DataBytes() }

// ReadHeader reads the length and the JSON header from r and nothing of the data, which follows
// in r in the order of Header.Tensors. A header longer than max (or MaxHeader) is refused before
// anything is allocated for it: a reader of an untrusted stream passes the largest header it
// expects.
func ReadHeader(r io.Reader, max int64) (Header, error) {
	var n [8]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return Header{}, fmt.Errorf("read header length: %w", err)
	}
	hn := binary.LittleEndian.Uint64(n[:])
	if max <= 0 || max > MaxHeader {
		max = MaxHeader
	}
	if hn > uint64(max) {
		return Header{}, fmt.Errorf("%w: header of %d bytes, at most %d expected", ErrFormat, hn, max)
	}
	b := make([]byte, hn)
	if _, err := io.ReadFull(r, b); err != nil {
		return Header{}, fmt.Errorf("read header of %d bytes: %w", hn, err)
	}
	return parseHeader(b)
}

// maxElements bounds one tensor's values, so that no product of dimensions overflows.
const maxElements = 1 << 50

// parseHeader decodes and checks a JSON header: F32 only, sane shapes, and offsets that tile the
// data section exactly in their order.
func parseHeader(b []byte) (Header, error) {
	bad := func(f string, a ...any) error { return fmt.Errorf("%w: %s", ErrFormat, fmt.Sprintf(f, a...)) }
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return Header{}, bad("header: %v", err)
	}
	h := Header{Len: int64(len(b)), Tensors: make([]Entry, 0, len(raw))}
	type named struct {
		name string
		e    entry
	}
	var entries []named
	for name, r := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(r, &h.Meta); err != nil {
				return Header{}, bad("__metadata__ must map strings to strings: %v", err)
			}
			continue
		}
		var e entry
		if err := json.Unmarshal(r, &e); err != nil {
			return Header{}, bad("%s: %v", name, err)
		}
		entries = append(entries, named{name, e})
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].e.Offsets[0] < entries[j].e.Offsets[0] })
	var end int64
	for _, ne := range entries {
		e := ne.e
		if e.DType != "F32" {
			return Header{}, bad("%s: dtype %s, only F32 is supported", ne.name, e.DType)
		}
		n := int64(1)
		for _, d := range e.Shape {
			if d < 0 || d > 1<<31 {
				return Header{}, bad("%s: dimension %d", ne.name, d)
			}
			if d > 0 && n > maxElements/int64(d) {
				return Header{}, bad("%s: shape %v holds more than 2^50 values", ne.name, e.Shape)
			}
			n *= int64(d)
		}
		lo, hi := e.Offsets[0], e.Offsets[1]
		if lo != end || hi < lo || hi-lo != 4*n {
			return Header{}, bad("%s: data_offsets [%d,%d) for shape %v (expected to start at %d)", ne.name, lo, hi, e.Shape, end)
		}
		end = hi
		h.Tensors = append(h.Tensors, Entry{Name: ne.name, Shape: append([]int{}, e.Shape...), Begin: lo, End: hi})
	}
	return h, nil
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
	h, err := parseHeader(b[8 : 8+hn])
	if err != nil {
		return nil, nil, err
	}
	data := b[8+hn:]
	// Checked before any tensor is allocated: the shapes cannot ask for more than the file holds.
	if end := h.DataBytes(); end != int64(len(data)) {
		return nil, nil, bad("tensors end at byte %d of a data section of %d", end, len(data))
	}
	out := make([]Tensor, 0, len(h.Tensors))
	for _, e := range h.Tensors {
		v := make([]float32, e.Elements())
		DecodeF32(v, data[e.Begin:e.End])
		out = append(out, Tensor{Name: e.Name, Shape: e.Shape, Data: v})
	}
	return out, h.Meta, nil
}

// DecodeF32 decodes little-endian float32 values from b into dst, min(len(dst), len(b)/4) of
// them.
func DecodeF32(dst []float32, b []byte) {
	for i := range min(len(dst), len(b)/4) {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
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
