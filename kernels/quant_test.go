package kernels

import (
	"math"
	"math/rand/v2"
	"testing"
)

func f32(bits uint32) float32 { return math.Float32frombits(bits) }

func TestBF16(t *testing.T) {
	tests := []struct {
		name string
		in   float32
		want uint16
	}{
		{"one", 1, 0x3f80},
		{"exact", -1.5, 0xbfc0},
		{"zero", 0, 0x0000},
		{"negative zero", f32(0x80000000), 0x8000},
		{"below half", f32(0x3f807fff), 0x3f80},
		{"tie to even, down", f32(0x3f808000), 0x3f80}, // 1 + 2⁻⁸: halfway between 1 and 1 + 2⁻⁷
		{"tie to even, up", f32(0x3f818000), 0x3f82},
		{"above half", f32(0x3f808001), 0x3f81},
		{"pi", float32(math.Pi), 0x4049},
		{"negative tie", f32(0xbf818000), 0xbf82},
		{"smallest subnormal", f32(0x00000001), 0x0000},
		{"subnormal tie to even", f32(0x00018000), 0x0002},
		{"carry into the exponent", f32(0x3fffffff), 0x4000},
		{"largest finite bf16", f32(0x7f7f0000), 0x7f7f},
		{"below the overflow tie", f32(0x7f7f7fff), 0x7f7f},
		{"overflow tie saturates", f32(0x7f7f8000), 0x7f7f},
		{"max float32 saturates", math.MaxFloat32, 0x7f7f},
		{"-max float32 saturates", -math.MaxFloat32, 0xff7f},
		{"+inf", float32(math.Inf(1)), 0x7f80},
		{"-inf", float32(math.Inf(-1)), 0xff80},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := BF16Bits(tt.in); got != tt.want {
				t.Errorf("BF16Bits(%v = %#08x) = %#04x, want %#04x", tt.in, math.Float32bits(tt.in), got, tt.want)
			}
			back := BF16Float(tt.want)
			if math.Float32bits(back) != uint32(tt.want)<<16 {
				t.Errorf("BF16Float(%#04x) = %#08x", tt.want, math.Float32bits(back))
			}
			x := []float32{tt.in}
			RoundBF16(x)
			if math.Float32bits(x[0]) != uint32(tt.want)<<16 {
				t.Errorf("RoundBF16(%v) = %v, want %v", tt.in, x[0], back)
			}
		})
	}
	// NaN stays NaN, even one whose payload is only in the bits rounding drops.
	for _, bits := range []uint32{0x7fc00000, 0x7f800001, 0xff800001, 0x7fbfffff} {
		if h := BF16Bits(f32(bits)); !math.IsNaN(float64(BF16Float(h))) {
			t.Errorf("BF16Bits(NaN %#08x) = %#04x, not a NaN", bits, h)
		}
	}
}

// TestBF16Sweep: for float32s spread over every exponent and sign (a stride through all 2³² bit
// patterns), BF16Bits is one of the two neighbouring bfloat16s, the nearer one, or saturates; and
// a bfloat16 value rounds to itself.
func TestBF16Sweep(t *testing.T) {
	const stride = 509 // prime: every low-16-bit pattern recurs at many exponents
	for b := uint64(0); b < 1<<32; b += stride {
		x := f32(uint32(b))
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			continue
		}
		h := BF16Bits(x)
		y := BF16Float(h)
		if math.IsInf(float64(y), 0) || math.IsNaN(float64(y)) {
			t.Fatalf("%#08x: non-finite %#04x", b, h)
		}
		lo := uint32(b) &^ 0xffff
		if uint32(h)<<16 != lo && uint32(h)<<16 != lo+0x10000 && h&0x7fff != BF16Max {
			t.Fatalf("%#08x: %#04x is neither neighbour", b, h)
		}
		if uint32(b)&0xffff == 0 && uint32(h)<<16 != uint32(b) {
			t.Fatalf("bfloat16 value %#08x rounds to %#04x", b, h)
		}
		d := math.Abs(float64(y) - float64(x))
		for _, n := range []uint32{lo, lo + 0x10000} {
			if v := float64(f32(n)); !math.IsInf(v, 0) && !math.IsNaN(v) && math.Abs(v-float64(x)) < d {
				t.Fatalf("%#08x: %v is farther than %v", b, y, v)
			}
		}
	}
}

func TestInt8Rows(t *testing.T) {
	tests := []struct {
		name  string
		row   []float32
		scale float32
		q     []int8
		want  []float32 // nil: q·scale
	}{
		{"zero row", []float32{0, 0, 0}, 0, []int8{0, 0, 0}, nil},
		{"negative zeros come back +0", []float32{f32(0x80000000), 0}, 0, []int8{0, 0}, []float32{0, 0}},
		// max 127 makes the scale 1: x/s is x, and the ties show.
		{"ties to even", []float32{127, -63.5, 0.5, 1.5, 2.5, -2.5, 126.5}, 1, []int8{127, -64, 0, 2, 2, -2, 126}, nil},
		{"scale 2", []float32{-254, 1, 3, 5}, 2, []int8{-127, 0, 2, 2}, nil},
		{"single value", []float32{-3}, float32(3.0 / 127), []int8{-127}, nil},
		// The scale underflows to 0: the row quantises to zeros.
		{"underflowing scale", []float32{f32(0x00000001), 0}, 0, []int8{0, 0}, []float32{0, 0}},
		// A subnormal row whose scale rounds down to 2⁻¹⁴⁹: x/s is 190, clamped to 127.
		{"subnormal clamp", []float32{f32(190), f32(5)}, f32(1), []int8{127, 5}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if s := Int8Scale(tt.row); math.Float32bits(s) != math.Float32bits(tt.scale) {
				t.Fatalf("scale %v, want %v", s, tt.scale)
			}
			q, scale := make([]int8, len(tt.row)), make([]float32, 1)
			QuantizeInt8(q, scale, tt.row, len(tt.row))
			want := tt.want
			if want == nil {
				for _, v := range tt.q {
					want = append(want, float32(v)*tt.scale)
				}
			}
			for i := range q {
				if q[i] != tt.q[i] {
					t.Errorf("q[%d] = %d, want %d", i, q[i], tt.q[i])
				}
			}
			x := make([]float32, len(q))
			DequantizeInt8(x, q, scale, len(q))
			r := append([]float32(nil), tt.row...)
			RoundInt8(r, len(r))
			for i := range x {
				if math.Float32bits(x[i]) != math.Float32bits(want[i]) || math.Float32bits(r[i]) != math.Float32bits(want[i]) {
					t.Errorf("value %d: dequantised %v, rounded %v, want %v", i, x[i], r[i], want[i])
				}
			}
		})
	}
}

// TestInt8Bounds: over rows of every magnitude, the codes stay in [-127, 127], the row's largest
// value gets ±127, every value is within half a scale step (plus the float32 rounding of x/s and
// of q·s), and nothing finite turns non-finite.
func TestInt8Bounds(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const C = 16
	for _, mag := range []float64{1e-38, 1e-20, 1e-3, 1, 1e3, 1e20, 3e38} {
		for trial := 0; trial < 50; trial++ {
			row := make([]float32, C)
			for i := range row {
				row[i] = float32(math.Max(-math.MaxFloat32, math.Min(math.MaxFloat32, r.NormFloat64()*mag/3)))
			}
			s := Int8Scale(row)
			top := 0
			for i := range row {
				if math.Abs(float64(row[i])) > math.Abs(float64(row[top])) {
					top = i
				}
			}
			for i, v := range row {
				q := Int8Quant(v, s)
				if q < -127 {
					t.Fatalf("mag %g: code %d", mag, q)
				}
				y := Int8Value(q, s)
				if math.IsInf(float64(y), 0) || math.IsNaN(float64(y)) {
					t.Fatalf("mag %g: %v → %v", mag, v, y)
				}
				if i == top && q != 127 && q != -127 {
					t.Errorf("mag %g: the largest value %v got code %d", mag, v, q)
				}
				// Half a step, and the float32 rounding of q·s (at most half the smallest
				// subnormal where s is one).
				if d := math.Abs(float64(y) - float64(v)); d > 0.5*float64(s)*(1+1e-5)+0x1p-150 {
					t.Errorf("mag %g: %v → %v, off by %g with scale %g", mag, v, y, d, s)
				}
			}
		}
	}
}

// TestRoundMatchesQuantize: the in-place round trips the model uses at boundaries that stay in a
// process give the bits a receiver gets from the quantised tensor, and a bfloat16 round is
// idempotent.
func TestRoundMatchesQuantize(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const rows, C = 37, 24
	x := make([]float32, rows*C)
	for i := range x {
		x[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(40)-20)))
	}
	copy(x[3*C:4*C], make([]float32, C)) // a zero row
	x[5*C+2] = f32(0x80000000)           // a negative zero
	x[7*C] = math.MaxFloat32
	h := make([]uint16, len(x))
	QuantizeBF16(h, x)
	got, want := append([]float32(nil), x...), make([]float32, len(x))
	DequantizeBF16(want, h)
	RoundBF16(got)
	sameBits(t, "bf16", got, want)
	again := append([]float32(nil), got...)
	RoundBF16(again)
	sameBits(t, "bf16 twice", again, got)

	q, scale := make([]int8, len(x)), make([]float32, rows)
	QuantizeInt8(q, scale, x, C)
	DequantizeInt8(want, q, scale, C)
	got = append(got[:0], x...)
	RoundInt8(got, C)
	sameBits(t, "int8", got, want)
}

// TestNonFiniteStaysNonFinite: a NaN or an infinity in a row never comes back finite, and the
// finite rows beside it are untouched by it.
func TestNonFiniteStaysNonFinite(t *testing.T) {
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		x := []float32{1, bad, 3, 4, 5, 6}
		RoundInt8(x, 2)
		if !math.IsNaN(float64(x[0])) && !math.IsInf(float64(x[0]), 0) || !math.IsNaN(float64(x[1])) && !math.IsInf(float64(x[1]), 0) {
			t.Errorf("int8 round of a row with %v: %v", bad, x[:2])
		}
		y := []float32{3, 4, 5, 6}
		RoundInt8(y, 2)
		sameBits(t, "int8 finite rows", x[2:], y)
		b := []float32{bad}
		RoundBF16(b)
		if !math.IsNaN(float64(b[0])) && !math.IsInf(float64(b[0]), 0) {
			t.Errorf("bf16 round of %v: %v", bad, b[0])
		}
	}
}

func sameBits(t *testing.T, name string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d]: %v (%#08x), want %v (%#08x)", name, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
	}
}

// TestInt8Saturates: a row holding ±MaxFloat32 comes back finite, though 127·(max/127) rounds
// past the largest float32.
func TestInt8Saturates(t *testing.T) {
	x := []float32{math.MaxFloat32, -math.MaxFloat32, 1e38}
	s := Int8Scale(x)
	if v := float32(127) * s; !math.IsInf(float64(v), 1) {
		t.Logf("127·scale = %v: the saturation is not exercised", v)
	}
	RoundInt8(x, 3)
	if x[0] != math.MaxFloat32 || x[1] != -math.MaxFloat32 {
		t.Errorf("round of ±MaxFloat32: %v", x)
	}
}
