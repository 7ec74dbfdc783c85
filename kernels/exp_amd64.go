//go:build !purego

package kernels

import (
	"math"

	"golang.org/x/sys/cpu"
)

// The exponential's vector loop (exp_amd64.s): math.Exp's own amd64 algorithm on four lanes (or
// eight, with AVX-512: twice the exponentials an instruction, BenchmarkExpInto), so that softmax
// and cross-entropy keep their bits. It is used only where the standard library's archExp takes
// the same FMA path (AVX and FMA; the loop needs AVX2 besides), which TestExpVector checks
// against math.Exp at both widths.

//go:noescape
func expAVX2(dst, x *float64, n int, c *[16][4]float64) int

// expAVX512 is expAVX2 on eight lanes (the same bits), for as many whole groups of eight.
//
//go:noescape
func expAVX512(dst, x *float64, n int, c *[16][4]float64) int

// expVector reports whether expInto uses the vector loop; tests turn it off to compare. expWide
// says whether that loop takes eight at a time (AVX-512, with its DQ mask moves).
var expVector, expWide = func() (bool, bool) {
	avx2, avx512 := cpuFeatures()
	return avx2, avx512 && cpu.X86.HasAVX512DQ
}()

// expConsts are the loop's constants, each in four lanes, spelled as math's exp_amd64.s spells
// them so that they round to the same float64s.
var expConsts = func() *[16][4]float64 {
	vals := [16]float64{
		1.4426950408889634073599246810018920,                  // log2e
		0.69314718055966295651160180568695068359375,           // ln2, upper half
		0.28235290563031577122588448175013436025525412068e-12, // ln2, lower half
		0.0625,
		2.4801587301587301587e-5, 1.9841269841269841270e-4, 1.3888888888888888889e-3,
		8.3333333333333333333e-3, 4.1666666666666666667e-2, 1.6666666666666666667e-1, 0.5,
		1.0, 2.0,
		0, // the exponent bias, set below as an int64
		-700, 700,
	}
	var c [16][4]float64
	for i, v := range vals {
		for l := range 4 {
			c[i][l] = v
		}
	}
	for l := range 4 {
		c[13][l] = math.Float64frombits(1023)
	}
	return &c
}()

// expVec computes dst[i] = math.Exp(x[i]) for the first whole groups of four whose x are all in
// [−700, 700], and returns how many it did.
func expVec(dst, x []float64) int {
	n := len(x)
	if !expVector || n < 4 {
		return 0
	}
	_ = dst[n-1]
	i := 0
	if expWide && n >= 8 {
		i = expAVX512(&dst[0], &x[0], n, expConsts)
	}
	// What is left: fewer than eight, or a group of eight with an x outside, whose first four
	// may still be in range.
	if n-i >= 4 {
		i += expAVX2(&dst[i], &x[i], n-i, expConsts)
	}
	return i
}
