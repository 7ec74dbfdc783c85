//go:build !purego && !amd64.v3

#include "textflag.h"

// func lnDxAVX2(di, x, w, d *float32, n int, c *[4]float32)
//
// LayerNormBackward's input gradient on n floats (a multiple of 8), eight at a time, with the Go
// loop's operations in its order, each rounded to float32: nn = (x − m)·rs,
// di += ((w·d − dm) − nn·dnm)·rs. c holds m, rs, dm, dnm.
TEXT ·lnDxAVX2(SB), NOSPLIT, $0-48
	MOVQ di+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ w+16(FP), DX
	MOVQ d+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSS 0(R8), Y8  // m
	VBROADCASTSS 4(R8), Y9  // rs
	VBROADCASTSS 8(R8), Y10 // dm
	VBROADCASTSS 12(R8), Y11 // dnm
	SHRQ $3, CX
	JZ   dxdone

dxloop:
	VMOVUPS (SI), Y0
	VSUBPS  Y8, Y0, Y0 // x − m
	VMULPS  Y9, Y0, Y0 // nn
	VMOVUPS (DX), Y1
	VMULPS  (BX), Y1, Y1 // w·d
	VSUBPS  Y10, Y1, Y1  // − dm
	VMULPS  Y11, Y0, Y2  // nn·dnm
	VSUBPS  Y2, Y1, Y1
	VMULPS  Y9, Y1, Y1   // ·rs
	VADDPS  (DI), Y1, Y1 // di + …
	VMOVUPS Y1, (DI)
	ADDQ    $32, SI
	ADDQ    $32, DX
	ADDQ    $32, BX
	ADDQ    $32, DI
	DECQ    CX
	JNZ     dxloop

dxdone:
	VZEROUPPER
	RET

// func lnParamsAVX2(db, dw, x, d *float32, n int, c *[2]float32)
//
// One row's share of LayerNormBackward's parameter gradients on n floats (a multiple of 8), with
// the Go loop's operations in its order: db += d, dw += ((x − m)·rs)·d. c holds m, rs.
TEXT ·lnParamsAVX2(SB), NOSPLIT, $0-48
	MOVQ db+0(FP), DI
	MOVQ dw+8(FP), R9
	MOVQ x+16(FP), SI
	MOVQ d+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSS 0(R8), Y8 // m
	VBROADCASTSS 4(R8), Y9 // rs
	SHRQ $3, CX
	JZ   pdone

ploop:
	VMOVUPS (BX), Y0      // d
	VADDPS  (DI), Y0, Y1  // db + d
	VMOVUPS Y1, (DI)
	VMOVUPS (SI), Y2
	VSUBPS  Y8, Y2, Y2    // x − m
	VMULPS  Y9, Y2, Y2    // ·rs
	VMULPS  Y0, Y2, Y2    // ·d
	VADDPS  (R9), Y2, Y2  // dw + …
	VMOVUPS Y2, (R9)
	ADDQ    $32, SI
	ADDQ    $32, BX
	ADDQ    $32, DI
	ADDQ    $32, R9
	DECQ    CX
	JNZ     ploop

pdone:
	VZEROUPPER
	RET

// func lnRowAVX2(o, x, w, b *float32, n int, c *[2]float64)
//
// One row of LayerNormForward's normalisation on n floats (a multiple of 8), eight at a time, with
// the Go loop's operations in its order: o = float32((float64(x) − m)·rs)·w + b, the difference
// and the product in float64, rounded to float32 before the weight. c holds m, rs.
TEXT ·lnRowAVX2(SB), NOSPLIT, $0-48
	MOVQ o+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ w+16(FP), DX
	MOVQ b+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSD 0(R8), Y8 // m
	VBROADCASTSD 8(R8), Y9 // rs
	SHRQ $3, CX
	JZ   rowdone

rowloop:
	VCVTPS2PD   (SI), Y0   // x[0:4] in float64
	VCVTPS2PD   16(SI), Y1 // x[4:8]
	VSUBPD      Y8, Y0, Y0 // − m
	VSUBPD      Y8, Y1, Y1
	VMULPD      Y9, Y0, Y0 // ·rs
	VMULPD      Y9, Y1, Y1
	VCVTPD2PSY  Y0, X0     // to float32
	VCVTPD2PSY  Y1, X1
	VINSERTF128 $1, X1, Y0, Y0
	VMULPS      (DX), Y0, Y0 // ·w
	VADDPS      (BX), Y0, Y0 // + b
	VMOVUPS     Y0, (DI)
	ADDQ        $32, SI
	ADDQ        $32, DX
	ADDQ        $32, BX
	ADDQ        $32, DI
	DECQ        CX
	JNZ         rowloop

rowdone:
	VZEROUPPER
	RET
