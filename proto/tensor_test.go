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
)

// TestLittleEndianCopies: the payload codecs' copies of a slice's memory (hostLittleEndian)
// write and read the bytes their value-by-value loops do, for every value's bits — NaN payloads,
// −0, subnormals — and for the empty slice; a payload of the wrong length is refused either way.
func TestLittleEndianCopies(t *testing.T) {
	if !hostLittleEndian {
		t.Skip("a big-endian host runs the loops alone")
	}
	r := rand.New(rand.NewPCG(1, 2))
	f := []float32{0, float32(math.Copysign(0, -1)), float32(math.NaN()), math.Float32frombits(0x7fc00001),
		math.Float32frombits(1), float32(math.Inf(-1)), 3.5}
	for range 1000 {
		f = append(f, math.Float32frombits(r.Uint32()))
	}
	i32 := []int32{0, -1, math.MinInt32, math.MaxInt32}
	for range 1000 {
		i32 = append(i32, int32(r.Uint32()))
	}
	u16 := []uint16{0, 1, 0x7fc0, 0xffff}
	for range 1000 {
		u16 = append(u16, uint16(r.Uint32()))
	}
	// each runs f with the loops (hostLittleEndian false) and with the copies.
	each := func(f func(copies bool) ([]byte, any, error)) (loop, copied []byte, lv, cv any, lerr, cerr error) {
		defer func() { hostLittleEndian = true }()
		hostLittleEndian = false
		loop, lv, lerr = f(false)
		hostLittleEndian = true
		copied, cv, cerr = f(true)
		return
	}
	prefix := []byte{9, 8, 7}
	check := func(name string, enc func() []byte, dec func([]byte) (any, error), sent any) {
		t.Helper()
		for _, cut := range []int{0, 1} { // the whole payload, and one byte short
			lb, cb, lv, cv, lerr, cerr := each(func(bool) ([]byte, any, error) {
				b := enc()
				v, err := dec(b[len(prefix) : len(b)-cut])
				return b, v, err
			})
			if !bytes.Equal(lb, cb) || !bytes.Equal(lb[:len(prefix)], prefix) {
				t.Errorf("%s: the copy encodes other bytes than the loop", name)
			}
			if (lerr == nil) != (cerr == nil) || (cerr == nil) != (cut == 0) {
				t.Errorf("%s, %d bytes short: loop %v, copy %v", name, cut, lerr, cerr)
			}
			if cut == 0 && (fmt.Sprint(bitsOf(lv)) != fmt.Sprint(bitsOf(sent)) || fmt.Sprint(bitsOf(cv)) != fmt.Sprint(bitsOf(sent))) {
				t.Errorf("%s: decoded values differ from those sent", name)
			}
		}
	}
	check("float32", func() []byte { return AppendFloat32s(slices.Clone(prefix), f) },
		func(b []byte) (any, error) { return Float32s(b) }, f)
	check("int32", func() []byte { return AppendInt32s(slices.Clone(prefix), i32) },
		func(b []byte) (any, error) { return Int32s(b) }, i32)
	check("bfloat16", func() []byte { return AppendBF16s(slices.Clone(prefix), u16) },
		func(b []byte) (any, error) { return BF16s(b) }, u16)
	if got := AppendFloat32s(nil, nil); len(got) != 0 {
		t.Errorf("empty: %v", got)
	}
	if x, err := Float32s(nil); err != nil || len(x) != 0 {
		t.Errorf("empty payload: %v %v", x, err)
	}
}

// bitsOf is a decoded slice with float32s as their bits (NaN ≠ NaN would hide a difference).
func bitsOf(v any) any {
	if f, ok := v.([]float32); ok {
		u := make([]uint32, len(f))
		for i, x := range f {
			u[i] = math.Float32bits(x)
		}
		return u
	}
	return v
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
