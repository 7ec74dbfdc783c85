package kernels

// The portable micro-kernel: the wasm worker's CPU fallback and the path for CPUs without
// AVX2. Each product is rounded to float32 before it is added (the explicit conversion forbids
// the compiler from fusing it into an FMA, which it may do on arm64, ppc64 or GOAMD64=v3), so
// this kernel gives the same bits on every architecture, wasm included.

// A 2×4 tile: eight accumulators plus the six operands of a k step fit the sixteen float
// registers of amd64 (and of the x86-64 a browser runs wasm on) without spilling. Measured on
// a 256×256×512 multiply: 5.5 GFLOP/s native, 5.2 under node's wasm; 4×4 spills, 4.7 and 3.7–4.1;
// 3×4, 5.0 and 4.7.
var goImpl = gemmImpl{name: PureGo, mr: 2, nr: 4, kerns: []microKernel{nil, goEdge(1, 4), gemmGo2x4}}

// goEdge returns a plain kernel for tiles of mr rows and nr columns: the same chain per
// element as the unrolled kernel, for the tiles at the bottom edge.
func goEdge(mr, nr int) microKernel {
	return func(kc int, a, b, c []float32, ldb, ldc int, load bool) {
		for r := range mr {
			for j := range nr {
				var s float32
				if load {
					s = c[r*ldc+j]
				}
				for p := range kc {
					s += float32(a[p*mr+r] * b[p*ldb+j])
				}
				c[r*ldc+j] = s
			}
		}
	}
}

func gemmGo2x4(kc int, a, b, c []float32, ldb, ldc int, load bool) {
	var c00, c01, c02, c03, c10, c11, c12, c13 float32
	if load {
		r := (*[4]float32)(c)
		c00, c01, c02, c03 = r[0], r[1], r[2], r[3]
		r = (*[4]float32)(c[ldc:])
		c10, c11, c12, c13 = r[0], r[1], r[2], r[3]
	}
	a = a[:kc*2]
	for p := 0; p < len(a); p += 2 {
		ap, bp := (*[2]float32)(a[p:]), (*[4]float32)(b[p/2*ldb:])
		b0, b1, b2, b3 := bp[0], bp[1], bp[2], bp[3]
		a0 := ap[0]
		c00 += float32(a0 * b0)
		c01 += float32(a0 * b1)
		c02 += float32(a0 * b2)
		c03 += float32(a0 * b3)
		a1 := ap[1]
		c10 += float32(a1 * b0)
		c11 += float32(a1 * b1)
		c12 += float32(a1 * b2)
		c13 += float32(a1 * b3)
	}
	r := (*[4]float32)(c)
	r[0], r[1], r[2], r[3] = c00, c01, c02, c03
	r = (*[4]float32)(c[ldc:])
	r[0], r[1], r[2], r[3] = c10, c11, c12, c13
}
