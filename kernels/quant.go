package kernels

// Quantisation of the tensors that cross a boundary (a pipeline stage's input, an expert's rows,
// and their gradients) into the job's wire format: bfloat16, int8 with one scale per row, or int4
// with one scale per group of 32 values of a row. All are pure functions of their input, element
// by element, row by row or group by group in order, so the sender, the receiver and the single
// process that quantises at the same boundary without sending anything all get the same bits.
// Each quantiser's round trip — Quantise then Dequantise — is also offered in place (RoundBF16,
// RoundInt8, RoundInt4), computing with the very same scalar functions, for the boundaries that
// do not cross the network in a given plan.
//
// Non-finite values never become finite: a NaN or an infinity in a row (in int4, in a group) makes
// the round trip of that row (group) non-finite, so a diverged step still fails loudly (the single
// process refuses the step, a sender refuses to put the tensor on the wire) rather than training
// on silently clipped values.

import "math"

// BF16Max is the largest finite bfloat16, 0x7f7f: (2 − 2⁻⁷)·2¹²⁷ ≈ 3.39e38.
const BF16Max = 0x7f7f

// BF16Bits returns the bfloat16 nearest to x — the top 16 bits of its float32 rounded to
// nearest, ties to even. A finite x beyond ±BF16Max, which that rounding would carry to infinity,
// saturates to ±BF16Max instead: finite in, finite out. A NaN stays a (quiet) NaN; ±Inf stay ±Inf.
func BF16Bits(x float32) uint16 {
	b := math.Float32bits(x)
	if b&0x7f800000 == 0x7f800000 { // Inf or NaN: truncating keeps Inf; set a mantissa bit of a NaN
		if b&0x007fffff != 0 {
			return uint16(b>>16) | 0x0040
		}
		return uint16(b >> 16)
	}
	r := (b + 0x7fff + (b>>16)&1) >> 16
	if r&0x7f80 == 0x7f80 { // a finite value rounded up to infinity
		return uint16(b>>16)&0x8000 | BF16Max
	}
	return uint16(r)
}

// BF16Float is the float32 whose value bfloat16 h is: exact.
func BF16Float(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// QuantizeBF16 writes the bfloat16 of each x into h (len(h) == len(x)).
func QuantizeBF16(h []uint16, x []float32) {
	h = h[:len(x)]
	for i, v := range x {
		h[i] = BF16Bits(v)
	}
}

// DequantizeBF16 writes the float32 value of each h into x (len(x) == len(h)).
func DequantizeBF16(x []float32, h []uint16) {
	x = x[:len(h)]
	for i, v := range h {
		x[i] = BF16Float(v)
	}
}

// RoundBF16 replaces each x by its bfloat16 value: DequantizeBF16 of QuantizeBF16, in place.
func RoundBF16(x []float32) {
	for i, v := range x {
		x[i] = BF16Float(BF16Bits(v))
	}
}

// Int8Scale is the scale of a row for int8: max|x|/127, rounded to float32. It is 0 for a row of
// zeros — and for a row so small that the division underflows, which then quantises to zeros —
// and not finite when the row holds a NaN or an infinity.
func Int8Scale(row []float32) float32 { return float32(maxAbs(row) / 127) }

// Int8Quant is x's int8 under scale s (s from Int8Scale of x's row): x/s rounded to float32, then
// to the nearest integer with ties to even, clamped to [-127, 127] (the division may round just
// past 127; -128 is never used, so the code is symmetric). 0 when s is 0 or not finite, or x is
// not finite.
func Int8Quant(x, s float32) int8 {
	if s == 0 || !finite32(s) || !finite32(x) {
		return 0
	}
	q := math.RoundToEven(float64(float32(x / s)))
	return int8(max(-127, min(127, q)))
}

// Int8Value is the float32 that int8 q of scale s stands for: q·s, one float32 product, except
// that a product rounding past the largest float32 — 127·s of a row whose largest value is
// ±MaxFloat32 can — saturates to ±MaxFloat32: finite in, finite out. A zero row (s = 0) gives +0;
// a non-finite scale gives a non-finite value whatever q.
func Int8Value(q int8, s float32) float32 {
	if !finite32(s) {
		return s * s // +Inf or NaN, whatever q (0·Inf would be NaN anyway, q·NaN is NaN)
	}
	v := float32(float32(q) * s)
	if !finite32(v) {
		return float32(math.Copysign(math.MaxFloat32, float64(q)))
	}
	return v
}

func finite32(v float32) bool { return math.Float32bits(v)&0x7f800000 != 0x7f800000 }

// QuantizeInt8 quantises x, rows of C, into q (len(x)) and one scale per row in scale (len(x)/C).
func QuantizeInt8(q []int8, scale []float32, x []float32, C int) {
	for r := range scale[:len(x)/C] {
		row := x[r*C : (r+1)*C]
		s := Int8Scale(row)
		scale[r] = s
		qr := q[r*C : (r+1)*C]
		for i, v := range row {
			qr[i] = Int8Quant(v, s)
		}
	}
}

// DequantizeInt8 writes the values of q, rows of C with one scale each, into x (len(q)).
func DequantizeInt8(x []float32, q []int8, scale []float32, C int) {
	for r, s := range scale[:len(q)/C] {
		xr := x[r*C : (r+1)*C]
		for i, v := range q[r*C : (r+1)*C] {
			xr[i] = Int8Value(v, s)
		}
	}
}

// RoundInt8 replaces x, rows of C, by its int8 values: DequantizeInt8 of QuantizeInt8, in place,
// with no buffer for the codes.
func RoundInt8(x []float32, C int) {
	for r := 0; r < len(x)/C; r++ {
		row := x[r*C : (r+1)*C]
		s := Int8Scale(row)
		for i, v := range row {
			row[i] = Int8Value(Int8Quant(v, s), s)
		}
	}
}

// Int4Group is how many consecutive values of a row share one int4 scale. Groups of 32 with a
// bfloat16 scale are 4.5 bits a value (GGML's Q4_0 and the OCP microscaling formats use groups of
// 32 too): a row's scale, as int8 uses, would let one large value of a row of 1,024 flatten
// the other 1,023 to a handful of codes, where 15 codes are all int4 has.
const Int4Group = 32

// Int4Groups is the number of scale groups in a row of C values: the last one may be shorter.
func Int4Groups(C int) int { return (C + Int4Group - 1) / Int4Group }

// Int4RowBytes is the size of a row of C values in int4: a bfloat16 scale per group, and two
// codes a byte.
func Int4RowBytes(C int) int { return 2*Int4Groups(C) + (C+1)/2 }

// Int4Scale is the scale of a group for int4, as bfloat16 bits: max|x|/7 rounded to float32,
// then to bfloat16 (BF16Bits). It is 0 for a group of zeros (or one so small that the division
// underflows), and not finite when the group holds a NaN or an infinity. Rounded to bfloat16 the
// scale may be a little below max|x|/7; Int4Quant's clamp keeps the code in range.
func Int4Scale(group []float32) uint16 { return BF16Bits(float32(maxAbs(group) / 7)) }

// maxAbs is max|x| over x, or the first NaN it meets (Int8Scale's loop).
func maxAbs(x []float32) float32 {
	var m float32
	for _, v := range x {
		a := float32(math.Abs(float64(v)))
		if a > m || a != a {
			m = a
		}
		if m != m {
			break
		}
	}
	return m
}

// Int4Quant is x's int4 code under scale s (the float32 value of Int4Scale of x's group): x/s
// rounded to float32, then to the nearest integer with ties to even, clamped to [-7, 7] (the code
// is symmetric, as int8's; -8 is never used). 0 when s is 0 or not finite, or x is not finite.
func Int4Quant(x, s float32) int8 {
	if s == 0 || !finite32(s) || !finite32(x) {
		return 0
	}
	q := math.RoundToEven(float64(float32(x / s)))
	return int8(max(-7, min(7, q)))
}

// Int4Value is the float32 that code q of scale s stands for: Int8Value's product and its
// saturation (7·s of a scale of BF16Max rounds past the largest float32).
func Int4Value(q int8, s float32) float32 { return Int8Value(q, s) }

// QuantizeInt4 quantises x, rows of C, into codes (len(x)/C rows of (C+1)/2 bytes: code i of a
// row in the low nibble of byte i/2 when i is even, the high one when odd, two's complement; an odd
// row's last high nibble 0) and scales (len(x)/C rows of Int4Groups(C) bfloat16 bits).
func QuantizeInt4(codes []byte, scales []uint16, x []float32, C int) {
	G, rb := Int4Groups(C), (C+1)/2
	for r := 0; r < len(x)/C; r++ {
		row, cr := x[r*C:(r+1)*C], codes[r*rb:(r+1)*rb]
		clear(cr)
		for g := 0; g < G; g++ {
			lo, hi := g*Int4Group, min((g+1)*Int4Group, C)
			sb := Int4Scale(row[lo:hi])
			scales[r*G+g] = sb
			s := BF16Float(sb)
			for i := lo; i < hi; i++ {
				cr[i/2] |= byte(Int4Quant(row[i], s)&0xf) << (4 * (i & 1))
			}
		}
	}
}

// Int4Code is code i of a row's codes (QuantizeInt4's layout), sign-extended.
func Int4Code(codes []byte, i int) int8 { return int8(codes[i/2]>>(4*(i&1))<<4) >> 4 }

// DequantizeInt4 writes the values of codes and scales (QuantizeInt4's layout), rows of C, into
// x (len(scales)/Int4Groups(C) rows).
func DequantizeInt4(x []float32, codes []byte, scales []uint16, C int) {
	G, rb := Int4Groups(C), (C+1)/2
	for r := 0; r < len(scales)/G; r++ {
		xr, cr := x[r*C:(r+1)*C], codes[r*rb:(r+1)*rb]
		for i := range xr {
			xr[i] = Int4Value(Int4Code(cr, i), BF16Float(scales[r*G+i/Int4Group]))
		}
	}
}

// RoundInt4 replaces x, rows of C, by its int4 values: DequantizeInt4 of QuantizeInt4, in place,
// with no buffer for the codes.
func RoundInt4(x []float32, C int) {
	for r := 0; r < len(x)/C; r++ {
		row := x[r*C : (r+1)*C]
		for lo := 0; lo < C; lo += Int4Group {
			g := row[lo:min(lo+Int4Group, C)]
			s := BF16Float(Int4Scale(g))
			for i, v := range g {
				g[i] = Int4Value(Int4Quant(v, s), s)
			}
		}
	}
}
