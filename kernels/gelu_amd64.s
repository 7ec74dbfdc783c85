//go:build !purego && !amd64.v3

#include "textflag.h"

// func geluForwardAVX2(out, th, inp *float32, n int, c *[geluConsts * 8]float32)
//
// GELUForward on n floats (a multiple of 8), eight at a time, with the operations of the Go
// loop in kernels/layers.go in their order: separate VMULPS and VADDPS where Go rounds a product
// before adding it (GOAMD64 below v3 fuses nothing), VDIVPS for Tanh32's quotient, VMINPS/VMAXPS
// for its clamp (with the constant as the first source, so that a NaN passes through as the Go
// comparisons let it) and a blend for its small-argument branch. Each constant of c is eight
// copies of the float32 the Go code converts it to (geluConstants).
//
// Registers: Y0 x, Y1 u (the argument of tanh), Y2 u², Y3 a constant, Y4 the small-|u| mask,
// Y5 scratch, Y6 p then tanh, Y7 q, Y8 the output.
TEXT ·geluForwardAVX2(SB), NOSPLIT, $0-40
	MOVQ out+0(FP), DX
	MOVQ th+8(FP), DI
	MOVQ inp+16(FP), SI
	MOVQ n+24(FP), CX
	MOVQ c+32(FP), R8
	SHRQ $3, CX
	JZ   done

loop:
	VMOVUPS (SI), Y0
	// u = geluScale · (x + ((0.044715·x)·x)·x)
	VMULPS 0(R8), Y0, Y1
	VMULPS Y0, Y1, Y1
	VMULPS Y0, Y1, Y1
	VADDPS Y1, Y0, Y1
	VMULPS 32(R8), Y1, Y1

	// Clamp to ±clampAt: min(clampAt, u) = clampAt < u ? clampAt : u, then likewise for max.
	VMOVUPS 64(R8), Y3
	VMINPS  Y1, Y3, Y1
	VMOVUPS 96(R8), Y3
	VMAXPS  Y1, Y3, Y1

	// |u| < 0.0004 (u < 0.0004 && u > -0.0004): tanh u = u.
	VCMPPS $0x11, 128(R8), Y1, Y4
	VCMPPS $0x1e, 160(R8), Y1, Y5
	VANDPS Y5, Y4, Y4

	VMULPS Y1, Y1, Y2

	// p = ((((((x2·P0 + P1)·x2 + P2)·x2 + P3)·x2 + P4)·x2 + P5)·x2 + P6)·u
	VMULPS 192(R8), Y2, Y6
	VADDPS 224(R8), Y6, Y6
	VMULPS Y2, Y6, Y6
	VADDPS 256(R8), Y6, Y6
	VMULPS Y2, Y6, Y6
	VADDPS 288(R8), Y6, Y6
	VMULPS Y2, Y6, Y6
	VADDPS 320(R8), Y6, Y6
	VMULPS Y2, Y6, Y6
	VADDPS 352(R8), Y6, Y6
	VMULPS Y2, Y6, Y6
	VADDPS 384(R8), Y6, Y6
	VMULPS Y1, Y6, Y6

	// q = ((x2·Q0 + Q1)·x2 + Q2)·x2 + Q3
	VMULPS 416(R8), Y2, Y7
	VADDPS 448(R8), Y7, Y7
	VMULPS Y2, Y7, Y7
	VADDPS 480(R8), Y7, Y7
	VMULPS Y2, Y7, Y7
	VADDPS 512(R8), Y7, Y7

	// t = p / q, or u where |u| is small.
	VDIVPS    Y7, Y6, Y6
	VBLENDVPS Y4, Y1, Y6, Y6
	VMOVUPS   Y6, (DI)

	// out = (0.5·x)·(1 + t)
	VMULPS  544(R8), Y0, Y8
	VADDPS  576(R8), Y6, Y5
	VMULPS  Y5, Y8, Y8
	VMOVUPS Y8, (DX)

	ADDQ $32, SI
	ADDQ $32, DI
	ADDQ $32, DX
	DECQ CX
	JNZ  loop

done:
	VZEROUPPER
	RET

// func geluBackwardAVX2(dinp, inp, th, dout *float32, n int, c *[4]float32)
//
// GELUBackward on n floats (a multiple of 8), eight at a time, with the Go loop's operations in
// its order: g = 0.5·(1+t) + (((0.5·x)·(1 − t·t))·geluScale)·(1 + (0.134145·x)·x), dinp = g·dout.
// c holds 0.5, 1, geluScale and 3·0.044715 as float32. dinp may be dout: each group of eight is
// read before it is written.
TEXT ·geluBackwardAVX2(SB), NOSPLIT, $0-48
	MOVQ dinp+0(FP), DI
	MOVQ inp+8(FP), SI
	MOVQ th+16(FP), DX
	MOVQ dout+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSS 0(R8), Y12  // 0.5
	VBROADCASTSS 4(R8), Y13  // 1
	VBROADCASTSS 8(R8), Y14  // geluScale
	VBROADCASTSS 12(R8), Y15 // 3·0.044715
	SHRQ $3, CX
	JZ   bdone

bloop:
	VMOVUPS (SI), Y0
	VMOVUPS (DX), Y1
	VADDPS  Y13, Y1, Y2
	VMULPS  Y12, Y2, Y2
	VMULPS  Y12, Y0, Y3
	VMULPS  Y1, Y1, Y4
	VSUBPS  Y4, Y13, Y4
	VMULPS  Y4, Y3, Y3
	VMULPS  Y14, Y3, Y3
	VMULPS  Y15, Y0, Y5
	VMULPS  Y0, Y5, Y5
	VADDPS  Y13, Y5, Y5
	VMULPS  Y5, Y3, Y3
	VADDPS  Y3, Y2, Y2
	VMULPS  (BX), Y2, Y2
	VMOVUPS Y2, (DI)

	ADDQ $32, DI
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, BX
	DECQ CX
	JNZ  bloop

bdone:
	VZEROUPPER
	RET
