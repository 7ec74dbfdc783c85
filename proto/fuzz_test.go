package proto

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// The seed corpus lives in testdata/fuzz/<FuzzName>/ in go test's corpus format, and `go test`
// runs every file there as a test case. Regenerate it after a format change with
//
//	go test ./proto -run TestWriteFuzzCorpus -write-fuzz-corpus
var writeCorpus = flag.Bool("write-fuzz-corpus", false, "rewrite proto/testdata/fuzz from the seed generators")

var messageErrors = []error{ErrMessageTooLarge, ErrProtocolVersion, ErrUnknownType, ErrUnexpectedMessage, ErrBadMessage}

var frameErrors = []error{ErrShortFrame, ErrFrameTooLarge, ErrFrameVersion, ErrBadHeader, ErrBadShape,
	ErrTensorTooLarge, ErrPayloadLength, ErrNonFinite, ErrBadQuantization, ErrDuplicateChunk, ErrChunkMismatch, ErrInFlight, ErrStalePlan}

func isOneOf(err error, targets []error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}

// FuzzDecodeMessage checks that DecodeMessage never panics, that every error wraps a sentinel, and
// that whatever it accepts re-encodes to a message that decodes to the same encoding.
func FuzzDecodeMessage(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, local := range []Role{RoleWorker, RoleCoordinator} {
			m, err := DecodeMessage(b, local)
			if err != nil {
				if !isOneOf(err, messageErrors) {
					t.Fatalf("error wraps no sentinel: %v", err)
				}
				continue
			}
			enc, err := EncodeMessage(m)
			if errors.Is(err, ErrMessageTooLarge) {
				continue // escaping (e.g. '<' as \u003c) can grow a message near the limit
			}
			if err != nil {
				t.Fatalf("decoded %#v but cannot encode it: %v", m, err)
			}
			m2, err := DecodeMessage(enc, local)
			if err != nil {
				t.Fatalf("cannot decode own encoding %s: %v", enc, err)
			}
			enc2, err := EncodeMessage(m2)
			if err != nil || !bytes.Equal(enc, enc2) {
				t.Fatalf("encoding not stable:\n%s\n%s (%v)", enc, enc2, err)
			}
		}
	})
}

// FuzzDecodeFrame checks that DecodeFrame never panics, that every error wraps a sentinel, and that
// the frame format is canonical: what it accepts re-encodes to the very same bytes.
func FuzzDecodeFrame(f *testing.F) {
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, err := DecodeFrame(b, Limits{MaxTensorBytes: 1 << 24})
		if err != nil {
			if !isOneOf(err, frameErrors) {
				t.Fatalf("error wraps no sentinel: %v", err)
			}
			return
		}
		enc, err := AppendFrame(nil, fr.Header, fr.Payload, Limits{MaxTensorBytes: 1 << 24})
		if err != nil {
			t.Fatalf("decoded %+v but cannot encode it: %v", fr.Header, err)
		}
		if !bytes.Equal(enc, b) {
			t.Fatalf("re-encoding differs:\n got %x\nwant %x", enc, b)
		}
	})
}

// fuzzLimits are small enough that the fuzzer reaches the in-flight bound with a 4-chunk tensor.
var fuzzLimits = Limits{MaxTensorBytes: 1 << 20, MaxInFlightBytes: 3 * MaxChunkPayload}

// FuzzReassemble splits a tensor of elems elements (up to four chunks) into frames, mangles the
// stream with ops (pairs of operation and argument: swap, duplicate, drop, flip a byte, truncate)
// and feeds it to a Reassembler. The corpus stays small because the fuzzer mutates a recipe, not
// 64 KiB frames. It checks that the Reassembler never panics, that every error wraps a sentinel,
// that its in-flight accounting matches what it holds and stays in bounds, that completed
// tensors are well-formed, and that an unmangled reordering gives back the original tensor.
func FuzzReassemble(f *testing.F) {
	perChunk := MaxChunkPayload / 4
	f.Fuzz(func(t *testing.T, elems uint32, seed uint64, ops []byte) {
		n := int(elems % uint32(3*perChunk+2))
		key := actKey()
		key.Step = seed % 3
		want := testTensor(key, n, seed)
		if seed%5 == 0 { // token ids: I32, no finiteness check
			key = TensorKey{Kind: KindTokens, Step: seed % 3, Block: NoBlock, Expert: NoExpert}
			want = Tensor{Key: key, DType: I32, Shape: want.Shape, Data: want.Data}
		} else {
			// The compressed dtypes of boundary tensors; seeds below 256 stay float32.
			switch (seed >> 8) % 4 {
			case 1:
				want = bf16Tensor(key, want.Shape, n, seed)
			case 2: // rows of 1–5 codes, the first a zero row for even seeds
				cols := 1 + int(seed>>10)%5
				want = i8Tensor(key, n/cols, cols, seed, seed%2 == 0)
			case 3: // rows of 1–70 int4 codes (up to three groups), the first group zero for even seeds
				cols := 1 + int(seed>>10)%70
				want = i4Tensor(key, n/cols, cols, seed, seed%2 == 0)
			}
		}
		frames, err := SplitTensor(want, fuzzLimits)
		if err != nil {
			t.Fatal(err)
		}
		type item struct {
			b    []byte
			orig int
		}
		stream := make([]item, len(frames))
		for i, fr := range frames {
			stream[i] = item{fr, i}
		}
		mangled := false
		if len(ops) > 128 {
			ops = ops[:128]
		}
		for i := 0; i+1 < len(ops) && len(stream) > 0; i += 2 {
			op, arg := ops[i]%5, int(ops[i+1])
			k := arg % len(stream)
			switch op {
			case 0:
				j := (arg*7 + 1) % len(stream)
				stream[k], stream[j] = stream[j], stream[k]
			case 1:
				stream = append(stream, item{append([]byte(nil), stream[k].b...), stream[k].orig})
			case 2:
				stream = append(stream[:k], stream[k+1:]...)
			case 3:
				b := append([]byte(nil), stream[k].b...)
				if len(b) > 0 { // truncation may have emptied it
					b[(arg*131)%len(b)] ^= byte(1 + arg%255)
				}
				stream[k].b, mangled = b, true
			case 4:
				b := stream[k].b
				stream[k].b, mangled = b[:len(b)-min(len(b), 1+arg%4)], true
			}
		}
		seen := make([]int, len(frames))
		for _, it := range stream {
			seen[it.orig]++
		}
		permutation := !mangled
		for _, c := range seen {
			permutation = permutation && c == 1
		}

		r := NewReassembler(fuzzLimits)
		completed := 0
		for _, it := range stream {
			got, done, err := r.Add(it.b)
			if err != nil && !isOneOf(err, frameErrors) {
				t.Fatalf("error wraps no sentinel: %v", err)
			}
			if permutation && err != nil && !errors.Is(err, ErrInFlight) {
				t.Fatalf("a reordering of good frames failed: %v", err)
			}
			held := 0
			for _, p := range r.parts {
				held += len(p.data)
			}
			if held != r.InFlight() || held > fuzzLimits.MaxInFlightBytes {
				t.Fatalf("InFlight %d, held %d, limit %d", r.InFlight(), held, fuzzLimits.MaxInFlightBytes)
			}
			if !done {
				continue
			}
			completed++
			size, err := got.Shape.Bytes(got.DType, fuzzLimits.MaxTensorBytes)
			if err != nil || size != len(got.Data) {
				t.Fatalf("completed tensor %v: shape %v, %d bytes (%v)", got.Key, got.Shape, len(got.Data), err)
			}
			if !mangled && got.Key == want.Key && !bytes.Equal(got.Data, want.Data) {
				t.Fatalf("completed tensor differs from the one sent")
			}
		}
		if permutation && len(want.Data) <= fuzzLimits.MaxInFlightBytes && completed != 1 {
			t.Fatalf("a reordering of good frames completed %d tensors, want 1", completed)
		}
	})
}

// TestWriteFuzzCorpus writes the seed corpus; it runs only with -write-fuzz-corpus.
func TestWriteFuzzCorpus(t *testing.T) {
	if !*writeCorpus {
		t.Skip("run with -write-fuzz-corpus to rewrite testdata/fuzz")
	}
	write := func(fuzzer, name string, args ...any) {
		var buf bytes.Buffer
		buf.WriteString("go test fuzz v1\n")
		for _, a := range args {
			switch a := a.(type) {
			case []byte:
				fmt.Fprintf(&buf, "[]byte(%q)\n", a)
			case uint32:
				fmt.Fprintf(&buf, "uint32(%d)\n", a)
			case uint64:
				fmt.Fprintf(&buf, "uint64(%d)\n", a)
			case uint8:
				fmt.Fprintf(&buf, "uint8(%d)\n", a)
			case int64:
				fmt.Fprintf(&buf, "int64(%d)\n", a)
			case bool:
				fmt.Fprintf(&buf, "bool(%v)\n", a)
			default:
				t.Fatalf("corpus value of type %T", a)
			}
		}
		dir := filepath.Join("testdata", "fuzz", fuzzer)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, dir := range []string{"FuzzDecodeMessage", "FuzzDecodeFrame", "FuzzReassemble", "FuzzParseKey", "FuzzTypedKey"} {
		if err := os.RemoveAll(filepath.Join("testdata", "fuzz", dir)); err != nil {
			t.Fatal(err)
		}
	}

	for _, s := range sampleMessages() {
		b, err := EncodeMessage(s.msg)
		if err != nil {
			t.Fatal(err)
		}
		write("FuzzDecodeMessage", s.name, b)
	}
	for name, s := range map[string]string{
		"version-newer":  `{"v":18,"type":"welcome","body":{}}`,
		"unknown-type":   `{"v":18,"type":"gossip","body":{}}`,
		"unknown-field":  `{"v":18,"type":"bye","body":{"reason":"","why":1}}`,
		"step-report-ce": `{"v":18,"type":"step_report","body":{"step":1,"plan_version":1,"grad_sq":{"w":1e-300},"ce":[0],"aux":[{"block":1,"aux":[1]}],"timings":{"forward_ns":0,"backward_ns":0,"wait_ns":0,"total_ns":0}}}`,
	} {
		write("FuzzDecodeMessage", name, []byte(s))
	}

	small := func(key TensorKey, dt DType, shape Shape, index, count uint32, payload []byte) []byte {
		b, err := AppendFrame(nil, FrameHeader{TensorKey: key, DType: dt, Shape: shape, ChunkIndex: index, ChunkCount: count}, payload, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	write("FuzzDecodeFrame", "activation", small(actKey(), F32, Shape{2, 3, 1, 1}, 0, 1, AppendFloat32s(nil, []float32{0, 1, -2, 3.5, 1e-30, -0})))
	write("FuzzDecodeFrame", "expert-in-empty", small(TensorKey{Kind: KindExpertIn, Step: 9, Block: 1, Expert: 2}, F32, Shape{0, 64, 1, 1}, 0, 1, nil))
	write("FuzzDecodeFrame", "tokens", small(TensorKey{Kind: KindTokens, Block: NoBlock, Expert: NoExpert}, I32, Shape{2, 2, 1, 1}, 0, 1, AppendInt32s(nil, []int32{1, 2, 255, -1})))
	last := 2*MaxChunkPayload + 8 // a 3-chunk tensor whose last chunk holds 8 bytes
	write("FuzzDecodeFrame", "last-chunk", small(TensorKey{Kind: KindActivationGrad, PlanVersion: 2, Step: 5, MicroBatch: 3, Block: 2, Expert: NoExpert},
		F32, Shape{uint32(last / 4), 1, 1, 1}, 2, 3, AppendFloat32s(nil, []float32{1, 2})))
	nanFrame := small(actKey(), F32, Shape{1, 1, 1, 1}, 0, 1, AppendFloat32s(nil, []float32{1}))
	copy(nanFrame[HeaderSize:], []byte{0, 0, 0xc0, 0x7f})
	write("FuzzDecodeFrame", "nan", nanFrame)
	write("FuzzDecodeFrame", "short", []byte("SH\x01"))
	write("FuzzDecodeFrame", "bf16-activation", small(actKey(), BF16, Shape{2, 2, 1, 1}, 0, 1, AppendBF16s(nil, []uint16{0x3f80, 0x8000, 0x0001, 0xff7f})))
	i8 := i8Tensor(TensorKey{Kind: KindExpertOut, Step: 4, MicroBatch: 1, Block: 3, Expert: 0}, 3, 4, 1, true)
	write("FuzzDecodeFrame", "i8-expert-rows", small(i8.Key, I8, i8.Shape, 0, 1, i8.Data))
	negScale := small(i8.Key, I8, i8.Shape, 0, 1, i8.Data)
	negScale[HeaderSize+7] = 0x80 // row 1's scale negative
	write("FuzzDecodeFrame", "i8-negative-scale", negScale)
	rows := MaxChunkPayload/4 + 3 // chunk 1 of 2 starts with the last 3 scales
	write("FuzzDecodeFrame", "i8-scales-in-chunk-1", small(TensorKey{Kind: KindExpertGradIn, Step: 2, Block: 1, Expert: 1}, I8,
		Shape{uint32(rows), 1, 1, 1}, 1, 2, append(AppendFloat32s(nil, []float32{0, 1, 0.5}), make([]byte, rows)...)))
	i4 := i4Tensor(TensorKey{Kind: KindActivation, PlanVersion: 1, Step: 3, MicroBatch: 2, Block: 2, Expert: NoExpert}, 2, 33, 1, true)
	write("FuzzDecodeFrame", "i4-activation", small(i4.Key, I4, i4.Shape, 0, 1, i4.Data))
	padded := small(i4.Key, I4, i4.Shape, 0, 1, i4.Data)
	padded[len(padded)-1] |= 0x30 // row 1's padding nibble
	write("FuzzDecodeFrame", "i4-padding", padded)

	perChunk := uint32(MaxChunkPayload / 4)
	write("FuzzReassemble", "one-chunk", uint32(10), uint64(1), []byte{})
	write("FuzzReassemble", "empty-tokens", uint32(0), uint64(5), []byte{})
	write("FuzzReassemble", "three-chunks-reversed", 2*perChunk+1, uint64(2), []byte{0, 0, 0, 2})
	write("FuzzReassemble", "four-chunks-over-in-flight", 3*perChunk+1, uint64(3), []byte{})
	write("FuzzReassemble", "duplicate", perChunk+5, uint64(4), []byte{1, 0})
	write("FuzzReassemble", "drop", perChunk+5, uint64(6), []byte{2, 1})
	write("FuzzReassemble", "flip", 2*perChunk, uint64(7), []byte{3, 33})
	write("FuzzReassemble", "truncate", 2*perChunk, uint64(8), []byte{4, 1})
	emptied := append(bytes.Repeat([]byte{4, 3}, HeaderSize/4), 3, 0) // truncate a frame to nothing, then flip a byte of it
	write("FuzzReassemble", "flip-truncated-to-nothing", uint32(0), uint64(92), emptied)
	write("FuzzReassemble", "bf16-reversed", 2*perChunk+3, uint64(256+1), []byte{0, 0, 0, 2})
	write("FuzzReassemble", "i8-flip", 2*perChunk+6, uint64(512+2), []byte{3, 7})
	write("FuzzReassemble", "i8-scales-over-two-chunks", 2*perChunk, uint64(512+1024*3+1), []byte{0, 0})
	write("FuzzReassemble", "i4-flip", 2*perChunk+6, uint64(768+1024*40+2), []byte{3, 9})
	write("FuzzReassemble", "i4-reversed", 3*perChunk, uint64(768+1024*2+1), []byte{0, 0, 0, 2})

	// Every family's keys as the wire carries them, and the edges of their fields.
	for i, k := range typedKeys() {
		w := k.Key()
		write("FuzzParseKey", fmt.Sprintf("%02d-%v", i, w.Kind), uint8(w.Kind), w.PlanVersion, w.Step, w.MicroBatch, w.Block, w.Expert)
	}
	write("FuzzParseKey", "partial-bit-on-expert-in", uint8(KindExpertIn), uint32(1), uint64(2), uint32(PartialBit|1), uint32(1), uint32(0))
	write("FuzzParseKey", "empty-node", uint8(KindGradReduce), uint32(1), uint64(2), uint32(3<<16|3), uint32(1), uint32(0))
	write("FuzzParseKey", "signature-part-1", uint8(KindOuterSig), uint32(1), uint64(2), uint32(1), uint32(1), uint32(0))
	write("FuzzParseKey", "unknown-kind", uint8(kindEnd), uint32(1), uint64(2), uint32(0), NoBlock, NoExpert)
	write("FuzzTypedKey", "stage", uint8(0), uint8(KindActivation), uint32(3), uint64(9), int64(2), int64(4), int64(0), int64(0), false)
	write("FuzzTypedKey", "stage-micro-batch-too-large", uint8(0), uint8(KindActivationGrad), uint32(3), uint64(9), int64(1<<32), int64(4), int64(0), int64(0), false)
	write("FuzzTypedKey", "tokens-negative", uint8(1), uint8(KindTokens), uint32(3), uint64(9), int64(-1), int64(0), int64(0), int64(0), false)
	write("FuzzTypedKey", "expert", uint8(2), uint8(KindExpertGradIn), uint32(3), uint64(9), int64(5), int64(1), int64(2), int64(7), false)
	write("FuzzTypedKey", "expert-partial", uint8(2), uint8(KindExpertGradOut), uint32(3), uint64(9), int64(0), int64(1), int64(2), int64(7), true)
	write("FuzzTypedKey", "expert-micro-batch-too-large", uint8(2), uint8(KindExpertOut), uint32(3), uint64(9), int64(MaxExpertMicroBatch+1), int64(0), int64(2), int64(7), false)
	write("FuzzTypedKey", "grad-reduce", uint8(3), uint8(0), uint32(3), uint64(9), int64(12), int64(1), int64(3), int64(4), false)
	write("FuzzTypedKey", "grad-reduce-hi-too-large", uint8(3), uint8(0), uint32(3), uint64(9), int64(12), int64(1), int64(0), int64(1<<16), false)
	write("FuzzTypedKey", "outer-delta", uint8(4), uint8(0), uint32(3), uint64(9), int64(7), int64(3), int64(1), int64(0), false)
	write("FuzzTypedKey", "outer-sig", uint8(5), uint8(0), uint32(3), uint64(9), int64(7), int64(3), int64(0), int64(0), false)
}

// TestFuzzCorpusPresent keeps the committed corpus from silently disappearing.
func TestFuzzCorpusPresent(t *testing.T) {
	for _, dir := range []string{"FuzzDecodeMessage", "FuzzDecodeFrame", "FuzzReassemble", "FuzzParseKey", "FuzzTypedKey"} {
		entries, err := os.ReadDir(filepath.Join("testdata", "fuzz", dir))
		if err != nil || len(entries) < 5 {
			t.Errorf("testdata/fuzz/%s: %d seeds (%v); regenerate with -write-fuzz-corpus", dir, len(entries), err)
		}
	}
}
