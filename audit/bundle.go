package audit

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Bundle is the evidence of one shard's training step: the state it started from, every tensor
// it received (neighbours' and the coordinator's) and sent, and the state it reached after the
// step's update.
//
// A lean bundle (proto.Audit.Lean) has no StateOut and no Sent: when the coordinator recomputes
// bit for bit, the digests the worker committed to bind them, and the recomputation is compared
// with those (CompareLean). What is left is what a recomputation cannot do without: the start
// state and the tensors received.
type Bundle struct {
	Step        uint64
	PlanVersion uint32
	Lean        bool
	// Sample, when not 0, makes the bundle thin (thin.go, Thin): the seed of the groups it carries
	// of each large Adam moment of the start state and, not lean, of each large tensor of the end
	// state; once read, those tensors hold zeros outside the groups. InCVs holds the start
	// moments' groups' chaining values, OutCVs those of every large tensor of the end state.
	Sample   uint64
	InCVs    map[string][][32]byte
	OutCVs   map[string][][32]byte
	StateIn  []safetensors.Tensor
	StateOut []safetensors.Tensor
	Recv     []proto.Tensor
	Sent     []Sent
}

// magic opens every bundle; the digit is the format version.
const magic = "SHOALAUDIT/1\n"

// maxHeader bounds a bundle's JSON header: a few hundred state tensors and at most
// 2·proto.MaxCommitEntries tensors of traffic, each described in about 100 bytes.
const maxHeader = 4 << 20

type header struct {
	Step        uint64  `json:"step"`
	PlanVersion uint32  `json:"plan_version"`
	Lean        bool    `json:"lean,omitempty"`
	Sample      uint64  `json:"sample,omitempty"`
	Entries     []entry `json:"entries"`
}

// entry describes one tensor of the payload, in order.
type entry struct {
	// in, out: state; recv, sent: traffic; in-part, out-part, in-cvs, out-cvs: a thin bundle's
	// sampled groups of a start moment or an end tensor, and the chaining values of a start
	// moment's or an end tensor's groups.
	Role  string    `json:"role"`
	Name  string    `json:"name,omitempty"`
	Dims  []int     `json:"dims,omitempty"` // a state tensor's shape
	To    string    `json:"to,omitempty"`
	Key   [4]uint32 `json:"key"` // kind, micro-batch, block, expert
	DType uint8     `json:"dtype,omitempty"`
	Shape [4]uint32 `json:"shape"`
	Bytes int64     `json:"bytes"`
}

// key is the wire key of a traffic entry of the bundle whose header is h.
func (e entry) key(h header) proto.TensorKey {
	return proto.TensorKey{Kind: proto.Kind(e.Key[0]), PlanVersion: h.PlanVersion, Step: h.Step, MicroBatch: e.Key[1], Block: e.Key[2], Expert: e.Key[3]}
}

// Write encodes b.
func (b *Bundle) Write(w io.Writer) error {
	segs, err := b.Segments()
	if err != nil {
		return err
	}
	for _, s := range segs {
		if _, err := w.Write(s); err != nil {
			return err
		}
	}
	return nil
}

// Segments is b encoded (Write) as the byte slices that follow each other: the framing, then
// every tensor's values. A state's values are its own memory on a little-endian machine (every
// platform Shoal builds for; proto.Float32Bytes), and a tensor received or sent is its payload: no
// segment is copied, so the bundle is valid only while b's tensors are not changed. A worker
// uploads its evidence from these (client's evidence bodies), before its next update.
func (b *Bundle) Segments() ([][]byte, error) {
	if b.Lean && (len(b.StateOut) > 0 || len(b.Sent) > 0) {
		return nil, errors.New("a lean bundle carries no end state and no tensors sent")
	}
	if b.Sample == 0 && (len(b.InCVs) > 0 || len(b.OutCVs) > 0) {
		return nil, errors.New("chaining values only in a thin bundle")
	}
	h := header{Step: b.Step, PlanVersion: b.PlanVersion, Lean: b.Lean, Sample: b.Sample}
	// A thin bundle's sampled tensors travel as their groups, each a slice of the tensor's own
	// memory; a start moment's are followed by their chaining values (an end tensor's follow the
	// state, out-cvs).
	var parts [][]byte
	state := func(role string, ts []safetensors.Tensor) {
		for _, t := range ts {
			cvs, thin := b.InCVs[t.Name]
			if role == "out" {
				_, thin = b.OutCVs[t.Name]
			}
			if !thin {
				h.Entries = append(h.Entries, entry{Role: role, Name: t.Name, Dims: t.Shape, Bytes: 4 * int64(len(t.Data))})
				var buf []byte // a copy only where the machine is big-endian
				if v := proto.Float32Bytes(t.Data, &buf); len(v) > 0 {
					parts = append(parts, v)
				}
				continue
			}
			var buf []byte
			v := proto.Float32Bytes(t.Data, &buf)
			var n int64
			for _, g := range spans(b.Sample, t.Name, len(v)) {
				parts = append(parts, v[g.lo:g.hi])
				n += int64(g.hi - g.lo)
			}
			h.Entries = append(h.Entries, entry{Role: role + "-part", Name: t.Name, Dims: t.Shape, Bytes: n})
			if role == "in" {
				h.Entries = append(h.Entries, entry{Role: "in-cvs", Name: t.Name, Bytes: 32 * int64(len(cvs))})
				parts = append(parts, cvBytes(cvs))
			}
		}
	}
	traffic := func(role, to string, t proto.Tensor) {
		h.Entries = append(h.Entries, entry{Role: role, To: to, Key: [4]uint32{uint32(t.Key.Kind), t.Key.MicroBatch, t.Key.Block, t.Key.Expert},
			DType: uint8(t.DType), Shape: t.Shape, Bytes: int64(len(t.Data))})
	}
	state("in", b.StateIn)
	state("out", b.StateOut)
	var outs []string
	for name := range b.OutCVs {
		outs = append(outs, name)
	}
	slices.Sort(outs)
	for _, name := range outs {
		h.Entries = append(h.Entries, entry{Role: "out-cvs", Name: name, Bytes: 32 * int64(len(b.OutCVs[name]))})
		parts = append(parts, cvBytes(b.OutCVs[name]))
	}
	for _, t := range b.Recv {
		traffic("recv", "", t)
	}
	for _, s := range b.Sent {
		traffic("sent", s.To, s.T)
	}
	js, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	head := make([]byte, 0, len(magic)+4+len(js))
	head = append(head, magic...)
	head = binary.LittleEndian.AppendUint32(head, uint32(len(js)))
	head = append(head, js...)
	segs := append([][]byte{head}, parts...)
	for _, t := range b.Recv {
		segs = append(segs, t.Data)
	}
	for _, s := range b.Sent {
		segs = append(segs, s.T.Data)
	}
	return segs, nil
}

// readPayload reads n bytes, growing its buffer only as they arrive: a header may claim up to
// Read's maxBytes, and a stream that ends early must not have cost that much memory.
func readPayload(r io.Reader, n int64) ([]byte, error) {
	const step = 1 << 20
	data := make([]byte, 0, min(n, step))
	for int64(len(data)) < n {
		if len(data) == cap(data) {
			data = append(data, make([]byte, min(n-int64(len(data)), int64(cap(data))))...)[:len(data)]
		}
		m := min(n, int64(cap(data)))
		k, err := io.ReadFull(r, data[len(data):m])
		data = data[:len(data)+k]
		if err != nil {
			return nil, err
		}
	}
	return data, nil
}

// ErrFormat is wrapped by every error about a malformed bundle.
var ErrFormat = errors.New("malformed audit bundle")

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrFormat, fmt.Sprintf(format, args...))
}

// ShortError is a bundle whose stream ended, or failed, before the bundle's declared end: what a
// cut upload looks like, as opposed to a bundle that says what it should not. It is an ErrFormat
// error too, and unwraps to the stream's own error (io.ErrUnexpectedEOF, a connection's error).
type ShortError struct {
	What string // the part being read: "header", "entry 3"
	Err  error
}

func (e *ShortError) Error() string {
	return fmt.Sprintf("%v: %s ends early: %v", ErrFormat, e.What, e.Err)
}

func (e *ShortError) Unwrap() []error { return []error{ErrFormat, e.Err} }

func endsEarly(what string, err error) error { return &ShortError{What: what, Err: err} }

// Read decodes a bundle of at most maxBytes of payload, checking the header before allocating
// anything it describes: sizes against shapes, the total against maxBytes, entry counts against
// the commitment's bounds, and every float32 for finiteness.
func Read(r io.Reader, maxBytes int64) (*Bundle, error) {
	br := bufio.NewReaderSize(r, 1<<16)
	var pre [len(magic) + 4]byte
	if _, err := io.ReadFull(br, pre[:]); err != nil {
		return nil, endsEarly("header", err)
	}
	if string(pre[:len(magic)]) != magic {
		return nil, bad("not a Shoal audit bundle (or another format version)")
	}
	hl := binary.LittleEndian.Uint32(pre[len(magic):])
	if hl > maxHeader {
		return nil, bad("header of %d bytes, at most %d", hl, maxHeader)
	}
	js := make([]byte, hl)
	if _, err := io.ReadFull(br, js); err != nil {
		return nil, endsEarly("header", err)
	}
	var h header
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return nil, bad("header: %v", err)
	}
	if len(h.Entries) > 4*proto.MaxCommitEntries {
		return nil, bad("%d tensors", len(h.Entries))
	}
	var total int64
	counts := map[string]int{}
	// sizes: each start tensor's values, by name, for the chaining values that follow it (in-cvs)
	// and the end state's (out-cvs), whose tensors are the start's.
	sizes := map[string]int{}
	full := make([]int64, len(h.Entries)) // each state entry's whole size
	for i, e := range h.Entries {
		counts[e.Role]++
		var n int64
		switch e.Role {
		case "in", "out", "in-part", "out-part":
			if e.Name == "" || len(e.Name) > 256 || len(e.Dims) > 8 {
				return nil, bad("entry %d: state tensor %q with %d dimensions", i, e.Name, len(e.Dims))
			}
			n = 4
			for _, d := range e.Dims {
				// n ≤ maxBytes before each product, and checked by division: no overflow
				// whatever maxBytes is.
				if d < 0 || d > 1<<30 || d > 0 && n > maxBytes/int64(d) {
					return nil, bad("entry %d: %s of shape %v", i, e.Name, e.Dims)
				}
				n *= int64(d)
			}
			if e.Role == "in" || e.Role == "in-part" {
				if _, dup := sizes[e.Name]; dup {
					return nil, bad("entry %d: start tensor %s twice", i, e.Name)
				}
				sizes[e.Name] = int(n / 4)
			}
			if e.Role == "in-part" || e.Role == "out-part" {
				// Its values are read into a tensor of its whole shape: that is what it costs. A
				// start tensor sampled is a moment (the parameters enter the forward pass whole);
				// an end tensor sampled is any large one, of a thin bundle that is not lean.
				_, moment := momentOf(e.Name)
				if h.Sample == 0 || thinGroups(int(n/4)) == 0 || e.Role == "in-part" && !moment || e.Role == "out-part" && h.Lean {
					return nil, bad("entry %d: sampled groups of %s, which is not a large tensor of a thin bundle that samples it", i, e.Name)
				}
				if want := sampledBytes(h.Sample, e.Name, int(n/4)); e.Bytes != want {
					return nil, bad("entry %d: %d bytes of %s's sampled groups, the sample has %d", i, e.Bytes, e.Name, want)
				}
				if e.Role == "in-part" && (i+1 >= len(h.Entries) || h.Entries[i+1].Role != "in-cvs" || h.Entries[i+1].Name != e.Name) {
					return nil, bad("entry %d: sampled groups of %s without their chaining values", i, e.Name)
				}
			}
		case "in-cvs", "out-cvs":
			size, ok := sizes[e.Name]
			if h.Sample == 0 || !ok || thinGroups(size) == 0 || e.Role == "in-cvs" && (i == 0 || h.Entries[i-1].Role != "in-part") {
				return nil, bad("entry %d: chaining values of %s, which is not a large tensor of a thin bundle", i, e.Name)
			}
			n = 32 * int64(thinGroups(size))
		case "recv", "sent":
			// A key the wire would not carry names no tensor of the step (proto.ParseKey).
			if _, err := proto.ParseKey(e.key(h)); err != nil {
				return nil, bad("entry %d: %v", i, err)
			}
			// The wire's own sizing: int8 rows carry a float32 scale each (proto.Shape.Bytes).
			nb, err := proto.Shape(e.Shape).Bytes(proto.DType(e.DType), int(min(maxBytes, math.MaxInt32)))
			if err != nil {
				return nil, bad("entry %d: %v", i, err)
			}
			n = int64(nb)
			if e.Role == "sent" && (e.To == "" || len(e.To) > 64) {
				return nil, bad("entry %d: a sent tensor without its recipient", i)
			}
		default:
			return nil, bad("entry %d: role %q", i, e.Role)
		}
		if h.Lean && (e.Role == "out" || e.Role == "sent") {
			return nil, bad("entry %d: a lean bundle with a tensor of role %q", i, e.Role)
		}
		if e.Role != "in-part" && e.Role != "out-part" && e.Bytes != n {
			return nil, bad("entry %d: %d bytes for a shape of %d", i, e.Bytes, n)
		}
		full[i] = n
		total += n
		if total > maxBytes {
			return nil, bad("more than %d bytes of tensors", maxBytes)
		}
	}
	if counts["recv"] > proto.MaxCommitEntries || counts["sent"] > proto.MaxCommitEntries {
		return nil, bad("%d received and %d sent tensors, at most %d each", counts["recv"], counts["sent"], proto.MaxCommitEntries)
	}
	b := &Bundle{Step: h.Step, PlanVersion: h.PlanVersion, Lean: h.Lean, Sample: h.Sample}
	for i, e := range h.Entries {
		data, err := readPayload(br, e.Bytes)
		if err != nil {
			return nil, endsEarly(fmt.Sprintf("entry %d", i), err)
		}
		switch e.Role {
		case "in", "out", "in-part", "out-part":
			if proto.CheckFinite(data) != nil {
				return nil, bad("%s %s: non-finite value", e.Role, e.Name)
			}
			if e.Role == "in-part" || e.Role == "out-part" {
				// The sampled groups in their places, zeros elsewhere: what a recomputation
				// loads, and compares on those groups alone.
				whole := make([]byte, full[i])
				at := 0
				for _, g := range spans(h.Sample, e.Name, len(whole)) {
					at += copy(whole[g.lo:g.hi], data[at:])
				}
				data = whole
			}
			vals, err := proto.Float32s(data)
			if err != nil {
				return nil, bad("%s %s: %v", e.Role, e.Name, err)
			}
			t := safetensors.Tensor{Name: e.Name, Shape: append([]int{}, e.Dims...), Data: vals}
			if e.Role == "out" || e.Role == "out-part" {
				b.StateOut = append(b.StateOut, t)
			} else {
				b.StateIn = append(b.StateIn, t)
			}
		case "in-cvs", "out-cvs":
			cvs := make([][32]byte, len(data)/32)
			for k := range cvs {
				copy(cvs[k][:], data[32*k:])
			}
			m := &b.InCVs
			if e.Role == "out-cvs" {
				m = &b.OutCVs
			}
			if *m == nil {
				*m = map[string][][32]byte{}
			}
			if _, dup := (*m)[e.Name]; dup {
				return nil, bad("%s %s twice", e.Role, e.Name)
			}
			(*m)[e.Name] = cvs
		default:
			t := proto.Tensor{Key: e.key(h), DType: proto.DType(e.DType), Shape: e.Shape, Data: data}
			if t.DType == proto.F32 && proto.CheckFinite(data) != nil {
				return nil, bad("%s %v: non-finite value", e.Role, t.Key)
			}
			if e.Role == "recv" {
				b.Recv = append(b.Recv, t)
			} else {
				b.Sent = append(b.Sent, Sent{To: e.To, T: t})
			}
		}
	}
	if _, err := br.ReadByte(); err != io.EOF {
		return nil, bad("data after the last tensor")
	}
	return b, nil
}
