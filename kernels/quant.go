package kernels

// Quantisation of the tensors that cross a boundary (a pipeline stage's input, an expert's rows,
// and their gradients) into the job's wire format: bfloat16, or int8 with one scale per row. Both
// are pure functions of their input, element by element or row by row in order, so the sender, the
// receiver and the single process that quantises at the same boundary without sending anything
// all get the same bits. Each quantiser's round trip — Quantise then Dequantise — is also offered
// in place (RoundBF16, RoundInt8), computing with the very same scalar functions, for the
// boundaries that do not cross the network in a given plan.
//
// Non-finite values never become finite: a NaN or an infinity in a row makes the round trip of
// that row non-finite, so a diverged step still fails loudly (the single process refuses the step,
// a sender refuses to put the tensor on the wire) rather than training on silently clipped values.

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
func Int8Scale(row []float32) float32 {
	var m float32
	for _, v := range row {
		a := float32(math.Abs(float64(v)))
		if a > m || a != a { // a NaN, once seen, stays: NaN > m and m > NaN are both false
			m = a
		}
		if m != m {
			break
		}
	}
	return float32(m / 127)
}

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
