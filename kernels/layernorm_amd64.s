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
