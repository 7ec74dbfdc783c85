package proto

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"
)

// TestLittleEndianCopies: the payload codecs' copies of a slice's memory (hostLittleEndian)
// write and read the bytes their value-by-value loops do, for every value's bits — NaN payloads,
// −0, subnormals — and both refuse a payload one byte short; Float32Bytes is the slice's own
// memory here and the loop's encoding on a big-endian host.
func TestLittleEndianCopies(t *testing.T) {
	if !hostLittleEndian {
		t.Skip("a big-endian host runs the loops alone")
	}
	r := rand.New(rand.NewPCG(1, 2))
	f := []float32{0, float32(math.Copysign(0, -1)), float32(math.NaN()), math.Float32frombits(0x7fc00001),
		math.Float32frombits(1), float32(math.Inf(-1)), 3.5}
	i32 := []int32{0, -1, math.MinInt32, math.MaxInt32}
	u16 := []uint16{0, 1, 0x7fc0, 0xffff}
	for range 1000 {
		f = append(f, math.Float32frombits(r.Uint32()))
		i32 = append(i32, int32(r.Uint32()))
		u16 = append(u16, uint16(r.Uint32()))
	}
	bits := func(x []float32) []uint32 { // NaN ≠ NaN would hide a difference
		u := make([]uint32, len(x))
		for i, v := range x {
			u[i] = math.Float32bits(v)
		}
		return u
	}
	copiesMatchLoops(t, "float32", f, AppendFloat32s, Float32s, bits)
	copiesMatchLoops(t, "int32", i32, AppendInt32s, Int32s, func(x []int32) []int32 { return x })
	copiesMatchLoops(t, "bfloat16", u16, AppendBF16s, BF16s, func(x []uint16) []uint16 { return x })

	want := AppendFloat32s(nil, f)
	var buf []byte
	if got := Float32Bytes(f, &buf); !bytes.Equal(got, want) || &got[0] != (*byte)(unsafe.Pointer(&f[0])) || buf != nil {
		t.Error("Float32Bytes is not the slice's own memory")
	}
	hostLittleEndian = false
	got := Float32Bytes(f, &buf)
	hostLittleEndian = true
	if !bytes.Equal(got, want) || len(buf) == 0 || &got[0] != &buf[0] {
		t.Error("Float32Bytes on a big-endian host is not the encoding in buf")
	}
	if Float32Bytes(nil, &buf) != nil {
		t.Error("Float32Bytes of nothing is not nil")
	}
}

// copiesMatchLoops checks one codec's encoder and decoder by the loops and by the copies: the
// same bytes after a prefix the encoder keeps, the values sent decoded back, and a payload one
// byte short refused.
func copiesMatchLoops[T any, B comparable](t *testing.T, name string, x []T, enc func([]byte, []T) []byte,
	dec func([]byte) ([]T, error), bits func([]T) []B) {
	t.Helper()
	defer func() { hostLittleEndian = true }()
	prefix := []byte{9, 8, 7}
	var payloads [2][]byte
	for i, copies := range []bool{false, true} {
		hostLittleEndian = copies
		b := enc(slices.Clone(prefix), x)
		if !bytes.Equal(b[:len(prefix)], prefix) {
			t.Errorf("%s, copies %v: the prefix changed", name, copies)
		}
		payloads[i] = b[len(prefix):]
		y, err := dec(payloads[i])
		if err != nil || !slices.Equal(bits(y), bits(x)) {
			t.Errorf("%s, copies %v: decoded other values (%v)", name, copies, err)
		}
		if _, err := dec(payloads[i][:len(payloads[i])-1]); err == nil {
			t.Errorf("%s, copies %v: a payload one byte short was taken", name, copies)
		}
	}
	if !bytes.Equal(payloads[0], payloads[1]) {
		t.Errorf("%s: the copy encodes other bytes than the loop", name)
	}
}

// BenchmarkFloat32s is a default-job boundary tensor of a micro-batch (512 tokens × 256
// float32s) encoded and decoded, by the copy and by the value-by-value loop.
func BenchmarkFloat32s(b *testing.B) {
	x := make([]float32, 512*256)
	for i := range x {
		x[i] = float32(i)
	}
	buf := make([]byte, 0, 4*len(x))
	for _, copies := range []bool{false, true} {
		name := "loop"
		if copies {
			name = "copy"
		}
		b.Run(name, func(b *testing.B) {
			old := hostLittleEndian
			hostLittleEndian = copies && old
			defer func() { hostLittleEndian = old }()
			b.SetBytes(int64(8 * len(x)))
			for b.Loop() {
				buf = AppendFloat32s(buf[:0], x)
				if _, err := Float32s(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestCheckFinite: the word-at-a-time scan finds a NaN or ±Inf at every position of a payload
// of several runs and a tail, names its element, and passes the finite extremes (the largest
// float32 of either sign, subnormals, −0), as the value-by-value test it replaced does.
func TestCheckFinite(t *testing.T) {
	const n = 2*256/4*2 + 7 // four runs of 64 values and a tail
	finite := []float32{math.MaxFloat32, -math.MaxFloat32, math.Float32frombits(1), math.Float32frombits(0x807fffff),
		float32(math.Copysign(0, -1)), 1, -2.5}
	x := make([]float32, n)
	for i := range x {
		x[i] = finite[i%len(finite)]
	}
	if err := checkFinite(AppendFloat32s(nil, x)); err != nil {
		t.Fatalf("finite payload refused: %v", err)
	}
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), math.Float32frombits(0xff800001)} {
		for pos := range n {
			y := slices.Clone(x)
			y[pos] = bad
			err := checkFinite(AppendFloat32s(nil, y))
			if err == nil || !errors.Is(err, ErrNonFinite) || !strings.Contains(err.Error(), fmt.Sprintf("element %d ", pos)) {
				t.Fatalf("%v at element %d: %v", bad, pos, err)
			}
		}
	}
	// A payload cut short of a whole value checks the whole values it has.
	if err := checkFinite(AppendFloat32s(nil, x)[:4*n-2]); err != nil {
		t.Errorf("a short finite payload: %v", err)
	}
}
