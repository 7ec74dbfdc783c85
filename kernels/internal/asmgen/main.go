// Command asmgen writes kernels/gemm_amd64.s, the AVX-512 and AVX2+FMA GEMM micro-kernels.
//
// The kernels are generated rather than written by hand because they are long, regular
// unrolled sequences (one FMA per accumulator per k step) and because the tile shape is a
// tuning knob: changing MR or NR here and re-running `go generate ./kernels/` must not
// require re-deriving register numbers and offsets by hand.
//
// Every kernel has the same contract, which is what makes the results deterministic:
//
//	func kern(kc int, a, b, c *float32, ldb, ldc int, load int)
//
// a is a packed A micro-panel (kc steps of MR floats, one per tile row); b points at kc steps of
// NR floats, one per tile column, ldb floats apart (a packed B micro-panel has ldb = NR; a
// row-major k×n B read in place has ldb = n); c is the tile, ldc floats between rows. Each accumulator lane starts from
// the C element (load != 0) or from zero, then for p = 0..kc-1 in order does
// acc = fma(a[p][row], b[p][col], acc), and is stored back to C. Every element of C therefore
// goes through one sequential chain of fused multiply-adds over k, whatever the tile shape,
// the vector width or the lane it sits in — so the AVX-512 and AVX2 kernels agree bit for bit,
// and splitting K into blocks whose partial sums pass through C (float32 stores and loads are
// exact) cannot change a result either.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"go/format"
	"log"
	"os"
	"strings"
)

// isa describes one vector instruction set as the generator needs it.
type isa struct {
	name  string // function name prefix
	reg   string // register letter: Z or Y
	lanes int    // float32 lanes per vector
	nregs int    // vector registers available
	zero  string // instruction that zeroes a register
}

var (
	avx512 = isa{name: "AVX512", reg: "Z", lanes: 16, nregs: 32, zero: "VPXORD"}
	avx2   = isa{name: "AVX2", reg: "Y", lanes: 8, nregs: 16, zero: "VXORPS"}
)

// tile is one micro-kernel shape: mr rows (broadcast from A) by nv vectors (loaded from B).
type tile struct {
	isa    isa
	mr, nv int
	unroll int
}

func (t tile) nr() int { return t.nv * t.isa.lanes }

func (t tile) fname() string { return fmt.Sprintf("gemm%s_%dx%d", t.isa.name, t.mr, t.nr()) }

type gen struct{ bytes.Buffer }

func (g *gen) p(format string, args ...any) { fmt.Fprintf(&g.Buffer, format+"\n", args...) }

func (t tile) acc(r, v int) string { return fmt.Sprintf("%s%d", t.isa.reg, r*t.nv+v) }

func (t tile) emit(g *gen) {
	x := t.isa
	nacc := t.mr * t.nv
	if nacc+t.nv+1 > x.nregs {
		log.Fatalf("%s: %d accumulators + %d B vectors + 1 broadcast exceed %d registers", t.fname(), nacc, t.nv, x.nregs)
	}
	breg := func(v int) string { return fmt.Sprintf("%s%d", x.reg, nacc+v) }
	areg := fmt.Sprintf("%s%d", x.reg, nacc+t.nv)
	vbytes := x.lanes * 4
	astep := t.mr * 4
	name := t.fname()

	g.p("// func %s(kc int, a, b, c *float32, ldb, ldc int, load int)", name)
	g.p("TEXT ·%s(SB), NOSPLIT, $0-56", name)
	g.p("\tMOVQ kc+0(FP), CX")
	g.p("\tMOVQ a+8(FP), SI")
	g.p("\tMOVQ b+16(FP), DI")
	g.p("\tMOVQ c+24(FP), DX")
	g.p("\tMOVQ ldb+32(FP), R11")
	g.p("\tSHLQ $2, R11")
	g.p("\tMOVQ ldc+40(FP), R8")
	g.p("\tSHLQ $2, R8")
	g.p("\tMOVQ load+48(FP), R9")
	g.p("\tTESTQ R9, R9")
	g.p("\tJZ %s_zero", name)
	g.p("\tMOVQ DX, R10")
	for r := 0; r < t.mr; r++ {
		for v := 0; v < t.nv; v++ {
			g.p("\tVMOVUPS %d(R10), %s", v*vbytes, t.acc(r, v))
		}
		if r < t.mr-1 {
			g.p("\tADDQ R8, R10")
		}
	}
	g.p("\tJMP %s_body", name)
	g.p("%s_zero:", name)
	for i := 0; i < nacc; i++ {
		r := fmt.Sprintf("%s%d", x.reg, i)
		g.p("\t%s %s, %s, %s", x.zero, r, r, r)
	}
	g.p("%s_body:", name)
	// B advances by ldb bytes (R11) per k step; A by a constant, folded into displacements.
	step := func(u int) {
		for v := 0; v < t.nv; v++ {
			g.p("\tVMOVUPS %d(DI), %s", v*vbytes, breg(v))
		}
		g.p("\tADDQ R11, DI")
		for r := 0; r < t.mr; r++ {
			g.p("\tVBROADCASTSS %d(SI), %s", u*astep+r*4, areg)
			for v := 0; v < t.nv; v++ {
				g.p("\tVFMADD231PS %s, %s, %s", breg(v), areg, t.acc(r, v))
			}
		}
	}
	if t.unroll > 1 {
		g.p("\tMOVQ CX, BX")
		g.p("\tSHRQ $%d, BX", log2(t.unroll))
		g.p("\tJZ %s_tail", name)
		g.p("%s_loop:", name)
		for u := 0; u < t.unroll; u++ {
			step(u)
		}
		g.p("\tADDQ $%d, SI", t.unroll*astep)
		g.p("\tDECQ BX")
		g.p("\tJNZ %s_loop", name)
		g.p("%s_tail:", name)
		g.p("\tANDQ $%d, CX", t.unroll-1)
	} else {
		g.p("\tTESTQ CX, CX")
	}
	g.p("\tJZ %s_store", name)
	g.p("%s_one:", name)
	step(0)
	g.p("\tADDQ $%d, SI", astep)
	g.p("\tDECQ CX")
	g.p("\tJNZ %s_one", name)
	g.p("%s_store:", name)
	for r := 0; r < t.mr; r++ {
		for v := 0; v < t.nv; v++ {
			g.p("\tVMOVUPS %s, %d(DX)", t.acc(r, v), v*vbytes)
		}
		if r < t.mr-1 {
			g.p("\tADDQ R8, DX")
		}
	}
	g.p("\tVZEROUPPER")
	g.p("\tRET")
	g.p("")
}

// emitTranspose writes transpose16, the AVX-512 16×16 transpose the packing routines use for
// the operands stored across the grain of the packed panels (B of NT, A of NN):
//
//	func transpose16(dlo, dhi *float32, ldd int, src *float32, lds int)
//
// It reads 16 rows of 16 floats, lds floats apart, and writes column x as two halves of 8
// floats: rows 0–7 at dlo[x·ldd:], rows 8–15 at dhi[x·ldd:]. The halves let one call fill two
// 8-row A panels, or 16 columns of a 32-wide B panel (dhi = dlo+8). It is the usual four
// shuffle stages: 32-bit and 64-bit interleaves within 128-bit lanes, then two rounds of
// 128-bit lane shuffles.
func emitTranspose(g *gen) {
	z := func(i int) string { return fmt.Sprintf("Z%d", i) }
	g.p("// func transpose16(dlo, dhi *float32, ldd int, src *float32, lds int)")
	g.p("TEXT ·transpose16(SB), NOSPLIT, $0-40")
	g.p("\tMOVQ dlo+0(FP), DI")
	g.p("\tMOVQ dhi+8(FP), R9")
	g.p("\tMOVQ ldd+16(FP), R8")
	g.p("\tSHLQ $2, R8")
	g.p("\tMOVQ src+24(FP), SI")
	g.p("\tMOVQ lds+32(FP), DX")
	g.p("\tSHLQ $2, DX")
	for r := 0; r < 16; r++ {
		g.p("\tVMOVUPS (SI), %s", z(r))
		if r < 15 {
			g.p("\tADDQ DX, SI")
		}
	}
	// Stage 1: rows 2i and 2i+1 interleaved by 32 bits (Go operand order: src2, src1, dst).
	for i := 0; i < 8; i++ {
		g.p("\tVUNPCKLPS %s, %s, %s", z(2*i+1), z(2*i), z(16+2*i))
		g.p("\tVUNPCKHPS %s, %s, %s", z(2*i+1), z(2*i), z(16+2*i+1))
	}
	// Stage 2: within each group of four rows, interleave by 64 bits. Afterwards register 4g+j
	// holds, in 128-bit lane l, rows 4g..4g+3 of column 4l+j.
	for gr := 0; gr < 4; gr++ {
		t := 16 + 4*gr
		g.p("\tVUNPCKLPD %s, %s, %s", z(t+2), z(t), z(4*gr))
		g.p("\tVUNPCKHPD %s, %s, %s", z(t+2), z(t), z(4*gr+1))
		g.p("\tVUNPCKLPD %s, %s, %s", z(t+3), z(t+1), z(4*gr+2))
		g.p("\tVUNPCKHPD %s, %s, %s", z(t+3), z(t+1), z(4*gr+3))
	}
	// Stage 3: pair groups (0,1) and (2,3) by 128-bit lanes.
	for j := 0; j < 4; j++ {
		g.p("\tVSHUFF32X4 $0x88, %s, %s, %s", z(4+j), z(j), z(16+j))
		g.p("\tVSHUFF32X4 $0xdd, %s, %s, %s", z(4+j), z(j), z(20+j))
		g.p("\tVSHUFF32X4 $0x88, %s, %s, %s", z(12+j), z(8+j), z(24+j))
		g.p("\tVSHUFF32X4 $0xdd, %s, %s, %s", z(12+j), z(8+j), z(28+j))
	}
	// Stage 4: register x holds column x.
	for x := 0; x < 8; x++ {
		g.p("\tVSHUFF32X4 $0x88, %s, %s, %s", z(24+x), z(16+x), z(x))
		g.p("\tVSHUFF32X4 $0xdd, %s, %s, %s", z(24+x), z(16+x), z(8+x))
	}
	for x := 0; x < 16; x++ {
		g.p("\tVMOVUPS %s, (DI)", fmt.Sprintf("Y%d", x))
		g.p("\tVEXTRACTF64X4 $1, %s, (R9)", z(x))
		if x < 15 {
			g.p("\tADDQ R8, DI")
			g.p("\tADDQ R8, R9")
		}
	}
	g.p("\tVZEROUPPER")
	g.p("\tRET")
	g.p("")
}

// emitTranspose8 writes transpose8AVX, the AVX 8×8 transpose for CPUs without AVX-512:
//
//	func transpose8AVX(d *float32, ldd int, src *float32, lds int)
//
// It reads 8 rows of 8 floats, lds apart, and writes column x at d[x·ldd:]: 32-bit interleaves,
// 64-bit shuffles within 128-bit lanes, then a swap of lane halves.
func emitTranspose8(g *gen) {
	y := func(i int) string { return fmt.Sprintf("Y%d", i) }
	g.p("// func transpose8AVX(d *float32, ldd int, src *float32, lds int)")
	g.p("TEXT ·transpose8AVX(SB), NOSPLIT, $0-32")
	g.p("\tMOVQ d+0(FP), DI")
	g.p("\tMOVQ ldd+8(FP), R8")
	g.p("\tSHLQ $2, R8")
	g.p("\tMOVQ src+16(FP), SI")
	g.p("\tMOVQ lds+24(FP), DX")
	g.p("\tSHLQ $2, DX")
	for r := 0; r < 8; r++ {
		g.p("\tVMOVUPS (SI), %s", y(r))
		if r < 7 {
			g.p("\tADDQ DX, SI")
		}
	}
	for i := 0; i < 4; i++ {
		g.p("\tVUNPCKLPS %s, %s, %s", y(2*i+1), y(2*i), y(8+2*i))
		g.p("\tVUNPCKHPS %s, %s, %s", y(2*i+1), y(2*i), y(8+2*i+1))
	}
	// Registers 8–11 hold rows 0–3, 12–15 rows 4–7; afterwards register j (j < 4) holds, in lane
	// l, rows 0–3 of column 4l+j, and register 4+j rows 4–7.
	for h := 0; h < 2; h++ {
		t := 8 + 4*h
		g.p("\tVSHUFPS $0x44, %s, %s, %s", y(t+2), y(t), y(4*h))
		g.p("\tVSHUFPS $0xee, %s, %s, %s", y(t+2), y(t), y(4*h+1))
		g.p("\tVSHUFPS $0x44, %s, %s, %s", y(t+3), y(t+1), y(4*h+2))
		g.p("\tVSHUFPS $0xee, %s, %s, %s", y(t+3), y(t+1), y(4*h+3))
	}
	for j := 0; j < 4; j++ {
		g.p("\tVPERM2F128 $0x20, %s, %s, %s", y(4+j), y(j), y(8+j))
		g.p("\tVPERM2F128 $0x31, %s, %s, %s", y(4+j), y(j), y(12+j))
	}
	for x := 0; x < 8; x++ {
		g.p("\tVMOVUPS %s, (DI)", y(8+x))
		if x < 7 {
			g.p("\tADDQ R8, DI")
		}
	}
	g.p("\tVZEROUPPER")
	g.p("\tRET")
	g.p("")
}

// emitGather8 writes gather8AVX, used to pack A for TN (8-row panels):
//
//	func gather8AVX(d, src *float32, lds, n int)
//
// It copies n runs of 8 floats, lds floats apart in src, to consecutive groups of 8 in d.
// Plain Go does the same at a third of the speed (bounds checks and scalar moves).
func emitGather8(g *gen) {
	g.p("// func gather8AVX(d, src *float32, lds, n int)")
	g.p("TEXT ·gather8AVX(SB), NOSPLIT, $0-32")
	g.p("\tMOVQ d+0(FP), DI")
	g.p("\tMOVQ src+8(FP), SI")
	g.p("\tMOVQ lds+16(FP), DX")
	g.p("\tSHLQ $2, DX")
	g.p("\tMOVQ n+24(FP), CX")
	g.p("\tTESTQ CX, CX")
	g.p("\tJZ gather8_done")
	g.p("gather8_loop:")
	g.p("\tVMOVUPS (SI), Y0")
	g.p("\tVMOVUPS Y0, (DI)")
	g.p("\tADDQ DX, SI")
	g.p("\tADDQ $32, DI")
	g.p("\tDECQ CX")
	g.p("\tJNZ gather8_loop")
	g.p("gather8_done:")
	g.p("\tVZEROUPPER")
	g.p("\tRET")
	g.p("")
}

func lower(s string) string { return strings.ToLower(s) }

func log2(n int) int {
	k := 0
	for 1<<k < n {
		k++
	}
	if 1<<k != n {
		log.Fatalf("unroll %d is not a power of two", n)
	}
	return k
}

func main() {
	out := flag.String("out", "gemm_amd64.s", "assembly output file")
	goOut := flag.String("goout", "gemm_decl_amd64.go", "Go declarations output file")
	flag.Parse()

	// One kernel per row count: a partial row panel at the bottom of C runs a kernel of its
	// exact height instead of a padded one, which costs nothing in determinism (the chain per
	// element is the same) and saves up to MR-1 wasted rows when M is small (MoE token groups).
	// 8×32 on AVX-512 (16 accumulators) and 6×16 on AVX2 (12): with 8 accumulators (4×32) the
	// two FMA pipes of four-cycle latency are not kept busy, measured 20% slower at 1024³; 12×32
	// and 14×32 measured the same as 8×32.
	var tiles []tile
	for mr := 1; mr <= 8; mr++ {
		tiles = append(tiles, tile{isa: avx512, mr: mr, nv: 2, unroll: 4})
	}
	for mr := 1; mr <= 6; mr++ {
		tiles = append(tiles, tile{isa: avx2, mr: mr, nv: 2, unroll: 4})
	}

	var s gen
	s.p("// Code generated by kernels/internal/asmgen; DO NOT EDIT.")
	s.p("")
	s.p("//go:build !purego")
	s.p("")
	s.p("#include \"textflag.h\"")
	s.p("")
	for _, t := range tiles {
		t.emit(&s)
	}
	emitTranspose(&s)
	emitGather8(&s)
	emitTranspose8(&s)
	if err := os.WriteFile(*out, s.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}

	var d gen
	d.p("// Code generated by kernels/internal/asmgen; DO NOT EDIT.")
	d.p("")
	d.p("//go:build !purego")
	d.p("")
	d.p("package kernels")
	d.p("")
	for _, t := range tiles {
		d.p("// %s is the %s micro-kernel for a %d×%d tile; see gemm_amd64.go.", t.fname(), t.isa.name, t.mr, t.nr())
		d.p("//")
		d.p("//go:noescape")
		d.p("func %s(kc int, a, b, c *float32, ldb, ldc int, load int)", t.fname())
		d.p("")
	}
	d.p("// transpose16 is the AVX-512 16×16 transpose; see internal/asmgen.")
	d.p("//")
	d.p("//go:noescape")
	d.p("func transpose16(dlo, dhi *float32, ldd int, src *float32, lds int)")
	d.p("")
	d.p("// transpose8AVX is the AVX 8×8 transpose; see internal/asmgen.")
	d.p("//")
	d.p("//go:noescape")
	d.p("func transpose8AVX(d *float32, ldd int, src *float32, lds int)")
	d.p("")
	d.p("// gather8AVX copies 8-float runs, lds apart, into a packed panel; see internal/asmgen.")
	d.p("//")
	d.p("//go:noescape")
	d.p("func gather8AVX(d, src *float32, lds, n int)")
	d.p("")
	for _, x := range []isa{avx512, avx2} {
		d.p("// %sKernels holds the %s micro-kernels by tile height: [mr] computes an mr-row tile.", lower(x.name), x.name)
		d.p("var %sKernels = [...]asmKernelFunc{", lower(x.name))
		d.p("nil,")
		for _, t := range tiles {
			if t.isa == x {
				d.p("%s,", t.fname())
			}
		}
		d.p("}")
		d.p("")
	}
	src, err := format.Source(d.Bytes())
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(*goOut, src, 0o644); err != nil {
		log.Fatal(err)
	}
}
