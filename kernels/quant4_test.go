package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestInt4Groups: every group of a row gets its own scale, a row's last group may be short, and
// the codes, their nibbles and the values are what the definitions say.
func TestInt4Groups(t *testing.T) {
	const C = 70 // two whole groups and one of 6; odd rows of codes need C odd, below
	row := make([]float32, C)
	for i := range row {
		row[i] = float32(i%7) - 3 // -3 … 3
	}
	row[5] = 7     // group 0: max 7, scale 1, every value exact
	row[40] = -700 // group 1: scale 100, its small values round to 0
	for i := 64; i < C; i++ {
		row[i] = 0 // group 2: zeros
	}
	codes, scales := make([]byte, (C+1)/2), make([]uint16, Int4Groups(C))
	QuantizeInt4(codes, scales, row, C)
	if got := []float32{BF16Float(scales[0]), BF16Float(scales[1]), BF16Float(scales[2])}; got[0] != 1 || got[1] != 100 || got[2] != 0 {
		t.Fatalf("scales %v, want [1 100 0]", got)
	}
	x := make([]float32, C)
	DequantizeInt4(x, codes, scales, C)
	r := append([]float32(nil), row...)
	RoundInt4(r, C)
	for i := range row {
		want := row[i] // group 0 is exact
		switch {
		case i >= 64:
			want = 0
		case i >= 32:
			want = float32(math.RoundToEven(float64(row[i])/100)) * 100
		}
		if x[i] != want || math.Float32bits(r[i]) != math.Float32bits(x[i]) {
			t.Errorf("value %d (%v): dequantised %v, rounded %v, want %v", i, row[i], x[i], r[i], want)
		}
		if q := Int4Code(codes, i); float32(q)*BF16Float(scales[i/Int4Group]) != x[i] {
			t.Errorf("code %d is %d", i, q)
		}
	}
	if got := codes[2] >> 4; got != 7 { // code 5: the high nibble of byte 2
		t.Errorf("code 5 in the high nibble of byte 2: %#x", got)
	}
	if got := codes[20] & 0xf; got != 0x9 { // code 40: -7, two's complement 1001, in the low nibble of byte 20
		t.Errorf("code 40 (-7) in the low nibble of byte 20: %#x", got)
	}
	// An odd row: its last byte's high nibble stays 0.
	odd := []float32{1, -2, 3}
	c3 := []byte{0xff, 0xff}
	QuantizeInt4(c3, make([]uint16, 1), odd, 3)
	if c3[1]>>4 != 0 {
		t.Errorf("the padding nibble of an odd row is %#x", c3[1]>>4)
	}
}

// TestInt4Bounds: over groups of every magnitude, the codes stay in [-7, 7], the group's largest
// value gets ±7 (a normal bfloat16 scale is within 2⁻⁹ of max/7, so the largest is 7·(1 ± 2⁻⁹)
// steps: it rounds, or is clamped, to 7), every value is within half a step plus what the clamp
// takes, and nothing finite turns non-finite.
func TestInt4Bounds(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	const C = 40
	for _, mag := range []float64{1e-38, 1e-20, 1e-3, 1, 1e3, 1e20, 3e38} {
		for trial := 0; trial < 50; trial++ {
			row := make([]float32, C)
			for i := range row {
				row[i] = float32(math.Max(-math.MaxFloat32, math.Min(math.MaxFloat32, r.NormFloat64()*mag/3)))
			}
			got := append([]float32(nil), row...)
			RoundInt4(got, C)
			for lo := 0; lo < C; lo += Int4Group {
				g := row[lo:min(lo+Int4Group, C)]
				s := BF16Float(Int4Scale(g))
				m := maxAbs(g)
				for i, v := range g {
					q := Int4Quant(v, s)
					if q < -7 || q > 7 {
						t.Fatalf("mag %g: code %d", mag, q)
					}
					y := got[lo+i]
					if y != Int4Value(q, s) || math.IsInf(float64(y), 0) || math.IsNaN(float64(y)) {
						t.Fatalf("mag %g: %v → %v", mag, v, y)
					}
					if float32(math.Abs(float64(v))) == m && s > 0x1p-126 && q != 7 && q != -7 {
						t.Errorf("mag %g: the largest value %v got code %d (scale %g)", mag, v, q, s)
					}
					// Half a step, the clamp's at most 7·2⁻⁸ steps of the scale's rounding, and
					// q·s's float32 rounding (at most half the smallest subnormal where s is one).
					if s > 0x1p-126 {
						if d := math.Abs(float64(y) - float64(v)); d > float64(s)*(0.5+7*0x1p-8)+0x1p-150 {
							t.Errorf("mag %g: %v → %v, off by %g with scale %g", mag, v, y, d, s)
						}
					}
				}
			}
		}
	}
}

// TestInt4RoundMatchesQuantize: the in-place round trip gives the bits a receiver gets from the
// codes, on rows of mixed magnitudes with zero groups, negative zeros and ±MaxFloat32; and a
// second round changes nothing that the first made exact.
func TestInt4RoundMatchesQuantize(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	for _, C := range []int{1, 31, 32, 33, 64, 100, 256} {
		const rows = 9
		x := make([]float32, rows*C)
		for i := range x {
			x[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(40)-20)))
		}
		copy(x[2*C:3*C], make([]float32, C)) // a zero row
		x[4*C] = f32(0x80000000)             // a negative zero
		x[5*C] = math.MaxFloat32
		x[6*C] = -math.MaxFloat32
		codes, scales := make([]byte, rows*((C+1)/2)), make([]uint16, rows*Int4Groups(C))
		QuantizeInt4(codes, scales, x, C)
		want := make([]float32, len(x))
		DequantizeInt4(want, codes, scales, C)
		got := append([]float32(nil), x...)
		RoundInt4(got, C)
		sameBits(t, "int4", got, want)
		if len(codes) != rows*(Int4RowBytes(C)-2*Int4Groups(C)) {
			t.Fatalf("C %d: %d code bytes", C, len(codes))
		}
		for _, v := range got {
			if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) {
				t.Fatalf("C %d: a finite row came back %v", C, v)
			}
		}
	}
}

// TestInt4NonFinite: a NaN or an infinity makes its group non-finite and leaves the other groups
// of its row as they would be without it.
func TestInt4NonFinite(t *testing.T) {
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		x := make([]float32, 2*Int4Group)
		for i := range x {
			x[i] = float32(i) - 20
		}
		y := append([]float32(nil), x[Int4Group:]...)
		x[3] = bad
		RoundInt4(x, len(x))
		for i := 0; i < Int4Group; i++ {
			if !math.IsNaN(float64(x[i])) && !math.IsInf(float64(x[i]), 0) {
				t.Fatalf("int4 round of a group with %v: value %d is %v", bad, i, x[i])
			}
		}
		RoundInt4(y, len(y))
		sameBits(t, "int4 finite group", x[Int4Group:], y)
	}
}
