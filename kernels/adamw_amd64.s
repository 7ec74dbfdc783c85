//go:build !purego && !amd64.v3

#include "textflag.h"

// func adamwAVX2(w, grad, m, v *float32, n int, c *[8]float32, sqrtBC2 float64)
//
// adamwRange on n floats (a multiple of 8), eight at a time, with the Go loop's operations in
// its order: float32 products and sums rounded one by one (no FMA, as the Go loop compiles below
// GOAMD64=v3), the denominator's square root and division in float64, converted to float32 with
// the same rounding as CVTSD2SS. c holds β1, 1−β1, β2, 1−β2, eps, decay, stepSize, gradScale as
// float32.
//
// Registers: Y8…Y15 the float32 constants, Y7 √bc2 (four float64), Y0…Y6 the work.
TEXT ·adamwAVX2(SB), NOSPLIT, $0-56
	MOVQ w+0(FP), DI
	MOVQ grad+8(FP), SI
	MOVQ m+16(FP), DX
	MOVQ v+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSS 0(R8), Y9   // β1
	VBROADCASTSS 4(R8), Y10  // 1−β1
	VBROADCASTSS 8(R8), Y11  // β2
	VBROADCASTSS 12(R8), Y12 // 1−β2
	VBROADCASTSS 16(R8), Y13 // eps
	VBROADCASTSS 20(R8), Y14 // decay
	VBROADCASTSS 24(R8), Y15 // stepSize
	VBROADCASTSS 28(R8), Y8  // gradScale
	VBROADCASTSD sqrtBC2+48(FP), Y7
	SHRQ $3, CX
	JZ   done

loop:
	// gr = g·gradScale; m = β1·m + (1−β1)·gr; v = β2·v + ((1−β2)·gr)·gr
	VMOVUPS (SI), Y0
	VMULPS  Y8, Y0, Y0
	VMOVUPS (DX), Y1
	VMULPS  Y9, Y1, Y1
	VMULPS  Y10, Y0, Y2
	VADDPS  Y2, Y1, Y1
	VMOVUPS (BX), Y3
	VMULPS  Y11, Y3, Y3
	VMULPS  Y12, Y0, Y4
	VMULPS  Y0, Y4, Y4
	VADDPS  Y4, Y3, Y3
	VMOVUPS Y1, (DX)
	VMOVUPS Y3, (BX)

	// denom = float32(√float64(v) / √bc2) + eps, four lanes at a time in float64
	VCVTPS2PD    X3, Y4
	VEXTRACTF128 $1, Y3, X5
	VCVTPS2PD    X5, Y5
	VSQRTPD      Y4, Y4
	VSQRTPD      Y5, Y5
	VDIVPD       Y7, Y4, Y4
	VDIVPD       Y7, Y5, Y5
	VCVTPD2PSY   Y4, X4
	VCVTPD2PSY   Y5, X5
	VINSERTF128  $1, X5, Y4, Y4
	VADDPS       Y13, Y4, Y4

	// w = w·decay − (stepSize·m)/denom
	VMULPS  Y15, Y1, Y5
	VDIVPS  Y4, Y5, Y5
	VMOVUPS (DI), Y6
	VMULPS  Y14, Y6, Y6
	VSUBPS  Y5, Y6, Y6
	VMOVUPS Y6, (DI)

	ADDQ $32, DI
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, BX
	DECQ CX
	JNZ  loop

done:
	VZEROUPPER
	RET
