package proto

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// relayFrame is a small valid frame for the envelope tests.
func relayFrame(t testing.TB) []byte {
	t.Helper()
	b, err := AppendFrame(nil, FrameHeader{TensorKey: actKey(), DType: F32, Shape: Shape{2, 1, 1, 1}, ChunkIndex: 0, ChunkCount: 1},
		AppendFloat32s(nil, []float32{1, -2}), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRelayEnvelopeRoundTrip(t *testing.T) {
	frame := relayFrame(t)
	big := make([]byte, MaxFrameSize) // only the length matters to the envelope
	id64 := strings.Repeat("a", 64)
	tests := []struct {
		name  string
		kind  BinKind
		peer  string
		frame []byte
	}{
		{"direct", BinDirect, "", frame},
		{"relay", BinRelay, "w-1.b_C", frame},
		{"relay longest id and frame", BinRelay, id64, big},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b []byte
			var err error
			if tt.kind == BinDirect {
				b, err = AppendDirect([]byte("keep"), tt.frame)
			} else {
				b, err = AppendRelay([]byte("keep"), tt.peer, tt.frame)
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(b, []byte("keep")) {
				t.Fatalf("dst prefix lost: %q", b[:8])
			}
			b = b[4:]
			if len(b) > MaxBinarySize {
				t.Fatalf("%d bytes, MaxBinarySize %d", len(b), MaxBinarySize)
			}
			kind, peer, got, err := DecodeBinary(b)
			if err != nil {
				t.Fatal(err)
			}
			if kind != tt.kind || peer != tt.peer || !bytes.Equal(got, tt.frame) {
				t.Fatalf("got %v %q %d bytes, want %v %q %d bytes", kind, peer, len(got), tt.kind, tt.peer, len(tt.frame))
			}
		})
	}
}

func TestRelayDecodeBinaryErrors(t *testing.T) {
	frame := relayFrame(t)
	relay := func(idLen byte, id string, frame []byte) []byte {
		return append(append([]byte{byte(BinRelay), idLen}, id...), frame...)
	}
	tests := []struct {
		name string
		b    []byte
		want error
		text string
	}{
		{"empty", nil, ErrShortFrame, "empty"},
		{"unknown kind", append([]byte{7}, frame...), ErrFrameVersion, "envelope kind 7"},
		{"zero kind", append([]byte{0}, frame...), ErrFrameVersion, "envelope kind 0"},
		{"direct without frame", []byte{byte(BinDirect)}, ErrShortFrame, "0 bytes"},
		{"direct short frame", append([]byte{byte(BinDirect)}, frame[:HeaderSize-1]...), ErrShortFrame, ""},
		{"direct frame too large", append([]byte{byte(BinDirect)}, make([]byte, MaxFrameSize+1)...), ErrFrameTooLarge, ""},
		{"message too large", make([]byte, MaxBinarySize+1), ErrFrameTooLarge, "limit"},
		{"relay no id length", []byte{byte(BinRelay)}, ErrShortFrame, "no peer id length"},
		{"relay empty id", relay(0, "", frame), ErrBadHeader, "length 0"},
		{"relay id too long", relay(65, strings.Repeat("a", 65), frame), ErrBadHeader, "length 65"},
		{"relay id cut", relay(10, "abc", nil), ErrShortFrame, "cut"},
		{"relay bad id byte", relay(3, "a/b", frame), ErrBadHeader, `"a/b"`},
		{"relay id with NUL", relay(2, "a\x00", frame), ErrBadHeader, "may only use"},
		{"relay no frame", relay(1, "a", nil), ErrShortFrame, "relay"},
		{"relay frame too large", relay(1, "a", make([]byte, MaxFrameSize+1)), ErrFrameTooLarge, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := DecodeBinary(tt.b)
			if !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.text) {
				t.Fatalf("error %q does not say %q", err, tt.text)
			}
		})
	}
}

func TestRelayAppendErrors(t *testing.T) {
	frame := relayFrame(t)
	tests := []struct {
		name string
		f    func() ([]byte, error)
		want error
	}{
		{"direct short", func() ([]byte, error) { return AppendDirect(nil, frame[:10]) }, ErrShortFrame},
		{"direct too large", func() ([]byte, error) { return AppendDirect(nil, make([]byte, MaxFrameSize+1)) }, ErrFrameTooLarge},
		{"relay empty id", func() ([]byte, error) { return AppendRelay(nil, "", frame) }, ErrBadHeader},
		{"relay long id", func() ([]byte, error) { return AppendRelay(nil, strings.Repeat("x", 65), frame) }, ErrBadHeader},
		{"relay bad id", func() ([]byte, error) { return AppendRelay(nil, "a b", frame) }, ErrBadHeader},
		{"relay short", func() ([]byte, error) { return AppendRelay(nil, "a", nil) }, ErrShortFrame},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.f()
			if !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if len(b) != 0 {
				t.Fatalf("appended %d bytes on error", len(b))
			}
		})
	}
}

// FuzzDecodeBinary checks that DecodeBinary never panics, that every error wraps a frame sentinel,
// and that the envelope is canonical: what it accepts re-encodes to the very same bytes.
func FuzzDecodeBinary(f *testing.F) {
	frame := relayFrame(f)
	for _, s := range binarySeeds(frame) {
		f.Add(s.b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		kind, peer, fr, err := DecodeBinary(b)
		if err != nil {
			if !isOneOf(err, frameErrors) {
				t.Fatalf("error wraps no sentinel: %v", err)
			}
			return
		}
		var enc []byte
		switch kind {
		case BinDirect:
			if peer != "" {
				t.Fatalf("direct message with peer %q", peer)
			}
			enc, err = AppendDirect(nil, fr)
		case BinRelay:
			enc, err = AppendRelay(nil, peer, fr)
		default:
			t.Fatalf("accepted kind %v", kind)
		}
		if err != nil {
			t.Fatalf("decoded %v %q but cannot encode it: %v", kind, peer, err)
		}
		if !bytes.Equal(enc, b) {
			t.Fatalf("re-encoding differs:\n got %x\nwant %x", enc, b)
		}
	})
}

type binarySeed struct {
	name string
	b    []byte
}

// binarySeeds are the seeds of FuzzDecodeBinary, both added in code and written to
// testdata/fuzz/FuzzDecodeBinary by TestRelayWriteFuzzCorpus.
func binarySeeds(frame []byte) []binarySeed {
	must := func(b []byte, err error) []byte {
		if err != nil {
			panic(err)
		}
		return b
	}
	return []binarySeed{
		{"direct", must(AppendDirect(nil, frame))},
		{"relay", must(AppendRelay(nil, "w-7f3a", frame))},
		{"relay-longest-id", must(AppendRelay(nil, strings.Repeat("Z", 64), frame))},
		{"relay-bad-id", append([]byte{byte(BinRelay), 3, 'a', '/', 'b'}, frame...)},
		{"relay-cut-id", []byte{byte(BinRelay), 40, 'a', 'b'}},
		{"unknown-kind", append([]byte{3}, frame...)},
		{"empty", []byte{}},
	}
}

// TestRelayWriteFuzzCorpus writes FuzzDecodeBinary's seed corpus; it runs only with
// -write-fuzz-corpus (the flag of fuzz_test.go, which regenerates the other corpora).
func TestRelayWriteFuzzCorpus(t *testing.T) {
	if !*writeCorpus {
		t.Skip("run with -write-fuzz-corpus to rewrite testdata/fuzz/FuzzDecodeBinary")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeBinary")
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, s := range binarySeeds(relayFrame(t)) {
		var buf bytes.Buffer
		buf.WriteString("go test fuzz v1\n")
		fmt.Fprintf(&buf, "[]byte(%q)\n", s.b)
		if err := os.WriteFile(filepath.Join(dir, s.name), buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRelayFuzzCorpusPresent keeps the committed corpus from silently disappearing.
func TestRelayFuzzCorpusPresent(t *testing.T) {
	entries, err := os.ReadDir(filepath.Join("testdata", "fuzz", "FuzzDecodeBinary"))
	if err != nil || len(entries) < 5 {
		t.Errorf("testdata/fuzz/FuzzDecodeBinary: %d seeds (%v); regenerate with -write-fuzz-corpus", len(entries), err)
	}
}
