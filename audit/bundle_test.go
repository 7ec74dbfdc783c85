package audit

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// testBundle is a small bundle of every part: two state tensors in and out, tokens and an
// activation received, an activation gradient and an empty expert group sent.
func testBundle() *Bundle {
	st := proto.StepSpec{Step: 7, PlanVersion: 3, MicroBatches: 2, Rows: 1}
	state := func(scale float32) []safetensors.Tensor {
		w := safetensors.Tensor{Name: "transformer.h.0.attn.c_attn.weight", Shape: []int{2, 3}, Data: []float32{1, -2, 3, -4, 5, -6}}
		b := safetensors.Tensor{Name: "optim.m.transformer.h.0.attn.c_attn.weight", Shape: []int{2, 3}, Data: make([]float32, 6)}
		for i := range w.Data {
			w.Data[i] *= scale
			b.Data[i] = float32(i) * 1e-3 * scale
		}
		return []safetensors.Tensor{w, b}
	}
	tok, _, _ := proto.TokenTensors(st, 1, 4, []int32{1, 2, 3, 4}, []int32{2, 3, 4, 5})
	act := func(kind proto.Kind, mb uint32, x ...float32) proto.Tensor {
		sh, _ := proto.ShapeOf(1, len(x))
		return proto.Tensor{Key: proto.TensorKey{Kind: kind, PlanVersion: 3, Step: 7, MicroBatch: mb, Block: 2, Expert: proto.NoExpert},
			DType: proto.F32, Shape: sh, Data: proto.AppendFloat32s(nil, x)}
	}
	empty, _ := proto.ShapeOf(0, 4)
	return &Bundle{Step: 7, PlanVersion: 3, StateIn: state(1), StateOut: state(1.01),
		Recv: []proto.Tensor{tok, act(proto.KindActivation, 0, 0.5, -0.25, 1e-30, 3)},
		Sent: []Sent{
			{To: "w-next", T: act(proto.KindActivationGrad, 0, 1, 2, 3, 4)},
			{To: "w-host", T: proto.Tensor{Key: proto.TensorKey{Kind: proto.KindExpertIn, PlanVersion: 3, Step: 7, MicroBatch: 1, Block: 1, Expert: 2},
				DType: proto.F32, Shape: empty, Data: []byte{}}},
		}}
}

func encode(t testing.TB, b *Bundle) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := b.Write(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestBundleRoundTrip(t *testing.T) {
	want := testBundle()
	raw := encode(t, want)
	got, err := Read(bytes.NewReader(raw), int64(len(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("read back\n%+v\nwant\n%+v", got, want)
	}
	// The digests a commitment holds survive the trip too.
	if StateDigest(got.StateIn) != StateDigest(want.StateIn) || TensorDigest(got.Sent[0].T) != TensorDigest(want.Sent[0].T) {
		t.Fatal("digests changed on the way")
	}
}

// TestBundleLean: a lean bundle (proto.Audit.Lean) goes without its end state and what it sent,
// reads back as lean, and is refused with either.
func TestBundleLean(t *testing.T) {
	full := testBundle()
	lean := &Bundle{Step: full.Step, PlanVersion: full.PlanVersion, Lean: true, StateIn: full.StateIn, Recv: full.Recv}
	raw := encode(t, lean)
	got, err := Read(bytes.NewReader(raw), int64(len(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, lean) {
		t.Fatalf("read back\n%+v\nwant\n%+v", got, lean)
	}
	if whole := len(encode(t, full)); len(raw) >= whole {
		t.Fatalf("lean bundle of %d bytes, the whole one %d", len(raw), whole)
	}
	withOut := *lean
	withOut.StateOut = full.StateOut
	if err := withOut.Write(io.Discard); err == nil {
		t.Fatal("wrote a lean bundle with an end state")
	}
	// A header that says lean over entries a lean bundle has no room for.
	onlySent := *full
	onlySent.StateOut = nil
	for name, b := range map[string]*Bundle{"end state": full, "sent": &onlySent} {
		in := withHeader(t, encode(t, b), func(h *header) { h.Lean = true })
		if _, err := Read(bytes.NewReader(in), 1<<20); !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "lean") {
			t.Fatalf("lean header over a bundle with its %s: err = %v", name, err)
		}
	}
}

// header rewrites raw's JSON header with f.
func withHeader(t *testing.T, raw []byte, f func(h *header)) []byte {
	t.Helper()
	n := binary.LittleEndian.Uint32(raw[len(magic):])
	var h header
	if err := json.Unmarshal(raw[len(magic)+4:len(magic)+4+int(n)], &h); err != nil {
		t.Fatal(err)
	}
	f(&h)
	js, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	out := append([]byte(magic), binary.LittleEndian.AppendUint32(nil, uint32(len(js)))...)
	out = append(out, js...)
	return append(out, raw[len(magic)+4+int(n):]...)
}

func TestReadRefuses(t *testing.T) {
	raw := encode(t, testBundle())
	hl := int(binary.LittleEndian.Uint32(raw[len(magic):]))
	payload := len(magic) + 4 + hl // where the tensors start
	nanState := bytes.Clone(raw)
	binary.LittleEndian.PutUint32(nanState[payload:], math.Float32bits(float32(math.NaN())))
	infRecv := encode(t, func() *Bundle {
		b := testBundle()
		b.Recv[1].Data = proto.AppendFloat32s(nil, []float32{0, float32(math.Inf(-1)), 0, 0})
		return b
	}())
	tests := []struct {
		name string
		in   []byte
		max  int64
	}{
		{"empty", nil, 1 << 20},
		{"garbage", []byte("this is not a bundle at all, not even close"), 1 << 20},
		{"other version", append([]byte("SHOALAUDIT/2\n"), raw[len(magic):]...), 1 << 20},
		{"header cut", raw[:len(magic)+10], 1 << 20},
		{"huge header length", append([]byte(magic), 0xff, 0xff, 0xff, 0x7f), 1 << 20},
		{"header not json", withRawHeader([]byte("{not json")), 1 << 20},
		{"unknown header field", withRawHeader([]byte(`{"step":1,"plan_version":1,"entries":[],"extra":1}`)), 1 << 20},
		{"payload cut", raw[:len(raw)-3], 1 << 20},
		{"trailing data", append(bytes.Clone(raw), 0), 1 << 20},
		{"over maxBytes", raw, 16},
		{"NaN in a state", nanState, 1 << 20},
		{"Inf received", infRecv, 1 << 20},
		{"bytes disagree with shape", withHeader(t, raw, func(h *header) { h.Entries[0].Bytes += 4 }), 1 << 20},
		{"negative dimension", withHeader(t, raw, func(h *header) { h.Entries[0].Dims = []int{-2, -3} }), 1 << 20},
		{"unknown role", withHeader(t, raw, func(h *header) { h.Entries[2].Role = "gift" }), 1 << 20},
		{"unknown dtype", withHeader(t, raw, func(h *header) { h.Entries[4].DType = 99 }), 1 << 20},
		{"a key the wire would not carry", withHeader(t, raw, func(h *header) { h.Entries[5].Key[2] = proto.NoBlock }), 1 << 20},
		{"sent to nobody", withHeader(t, raw, func(h *header) { h.Entries[6].To = "" }), 1 << 20},
		{"state without a name", withHeader(t, raw, func(h *header) { h.Entries[1].Name = "" }), 1 << 20},
		{"overflowing shape", withHeader(t, raw, func(h *header) {
			h.Entries[5].Shape = [4]uint32{1 << 31, 1 << 31, 1 << 31, 1 << 31}
			h.Entries[5].Bytes = 0 // what the product wraps to in 64 bits
		}), math.MaxInt64},
		{"too many tensors", withHeader(t, raw, func(h *header) {
			for range 2 * proto.MaxCommitEntries {
				h.Entries = append(h.Entries, entry{Role: "recv", DType: uint8(proto.F32), Shape: [4]uint32{0, 1, 1, 1}})
			}
		}), 1 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := Read(bytes.NewReader(tt.in), tt.max)
			if err == nil {
				t.Fatalf("read %+v", b)
			}
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("err = %v, want ErrFormat", err)
			}
			// Only a stream that ends early is short: a cut upload, not a lie.
			var se *ShortError
			if cut := tt.name == "empty" || strings.HasSuffix(tt.name, " cut"); errors.As(err, &se) != cut {
				t.Fatalf("err = %v: short %v, want %v", err, !cut, cut)
			} else if cut && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
				t.Fatalf("err = %v, does not unwrap to the stream's end", err)
			}
		})
	}
}

func withRawHeader(js []byte) []byte {
	out := append([]byte(magic), binary.LittleEndian.AppendUint32(nil, uint32(len(js)))...)
	return append(out, js...)
}

// TestReadAllocatesWhatArrives: a header may claim a tensor as large as Read's bound; when the
// stream ends after a few bytes, Read must not have allocated the claim.
func TestReadAllocatesWhatArrives(t *testing.T) {
	const claim = 1 << 30 // 1 GiB of float32
	raw := encode(t, &Bundle{Step: 1, PlanVersion: 1, Recv: []proto.Tensor{{
		Key:   proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 1, Block: 1, Expert: proto.NoExpert},
		DType: proto.F32, Shape: proto.Shape{1, 1, 1, 4}, Data: make([]byte, 16)}}})
	raw = withHeader(t, raw, func(h *header) {
		h.Entries[0].Shape = proto.Shape{claim / 4, 1, 1, 1}
		h.Entries[0].Bytes = claim
	})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Read(bytes.NewReader(raw), 2*claim)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrFormat) {
		t.Fatalf("err = %v, want ErrFormat", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 8<<20 {
		t.Fatalf("allocated %d bytes for a 16-byte payload claiming %d", got, claim)
	}
	// And a claim over the bound is refused from the header alone.
	runtime.ReadMemStats(&before)
	_, err = Read(bytes.NewReader(raw), claim-1)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrFormat) {
		t.Fatalf("err = %v, want ErrFormat", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("allocated %d bytes refusing a header", got)
	}
}

func FuzzRead(f *testing.F) {
	raw := encode(f, testBundle())
	f.Add(raw)
	f.Add(raw[:len(raw)/2])
	f.Add([]byte(magic))
	// Thin bundles, lean and not, of a state with a tensor of three groups.
	small := testBundle()
	for _, b := range []*Bundle{small} {
		for i, ts := range [][]safetensors.Tensor{b.StateIn, b.StateOut} {
			for k := range ts {
				ts[k].Shape = []int{2*ThinGroup/4 + 1}
				ts[k].Data = make([]float32, 2*ThinGroup/4+1)
				for j := range ts[k].Data {
					ts[k].Data[j] = float32(j%7+i) * 1e-3
				}
			}
		}
	}
	f.Add(encode(f, Thin(small, 3, true)))
	f.Add(encode(f, Thin(small, 3, false)))
	f.Fuzz(func(t *testing.T, in []byte) {
		b, err := Read(bytes.NewReader(in), 1<<20)
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("err = %v, not ErrFormat", err)
			}
			return
		}
		// Whatever reads writes back to the same bytes.
		if out := encode(t, b); !bytes.Equal(out, in) {
			b2, err := Read(bytes.NewReader(out), 1<<20)
			if err != nil || !reflect.DeepEqual(b, b2) {
				t.Fatalf("a bundle that reads does not survive a round trip: %v", err)
			}
		}
	})
}
