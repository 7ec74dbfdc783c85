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

// func geluForwardAVX512(out, th, inp *float32, n int, c *[geluConsts * 8]float32)
//
// geluForwardAVX2 sixteen at a time, for n a multiple of 16: the same operations in the same
// order on ZMM registers, each constant broadcast from the first of its eight copies, the
// small-argument branch as a mask and VBLENDMPS.
TEXT ·geluForwardAVX512(SB), NOSPLIT, $0-40
	MOVQ out+0(FP), DX
	MOVQ th+8(FP), DI
	MOVQ inp+16(FP), SI
	MOVQ n+24(FP), CX
	MOVQ c+32(FP), R8
	SHRQ $4, CX
	JZ   done512

loop512:
	VMOVUPS (SI), Z0
	VMULPS.BCST 0(R8), Z0, Z1
	VMULPS      Z0, Z1, Z1
	VMULPS      Z0, Z1, Z1
	VADDPS      Z1, Z0, Z1
	VMULPS.BCST 32(R8), Z1, Z1

	VBROADCASTSS 64(R8), Z3
	VMINPS       Z1, Z3, Z1
	VBROADCASTSS 96(R8), Z3
	VMAXPS       Z1, Z3, Z1

	VCMPPS.BCST $0x11, 128(R8), Z1, K1
	VCMPPS.BCST $0x1e, 160(R8), Z1, K2
	KANDW       K2, K1, K1

	VMULPS Z1, Z1, Z2

	VMULPS.BCST 192(R8), Z2, Z6
	VADDPS.BCST 224(R8), Z6, Z6
	VMULPS      Z2, Z6, Z6
	VADDPS.BCST 256(R8), Z6, Z6
	VMULPS      Z2, Z6, Z6
	VADDPS.BCST 288(R8), Z6, Z6
	VMULPS      Z2, Z6, Z6
	VADDPS.BCST 320(R8), Z6, Z6
	VMULPS      Z2, Z6, Z6
	VADDPS.BCST 352(R8), Z6, Z6
	VMULPS      Z2, Z6, Z6
	VADDPS.BCST 384(R8), Z6, Z6
	VMULPS      Z1, Z6, Z6

	VMULPS.BCST 416(R8), Z2, Z7
	VADDPS.BCST 448(R8), Z7, Z7
	VMULPS      Z2, Z7, Z7
	VADDPS.BCST 480(R8), Z7, Z7
	VMULPS      Z2, Z7, Z7
	VADDPS.BCST 512(R8), Z7, Z7

	VDIVPS    Z7, Z6, Z6
	VBLENDMPS Z1, Z6, K1, Z6
	VMOVUPS   Z6, (DI)

	VMULPS.BCST 544(R8), Z0, Z8
	VADDPS.BCST 576(R8), Z6, Z5
	VMULPS      Z5, Z8, Z8
	VMOVUPS     Z8, (DX)

	ADDQ $64, SI
	ADDQ $64, DI
	ADDQ $64, DX
	DECQ CX
	JNZ  loop512

done512:
	VZEROUPPER
	RET

// func geluBackwardAVX512(dinp, inp, th, dout *float32, n int, c *[4]float32)
//
// geluBackwardAVX2 sixteen at a time, for n a multiple of 16.
TEXT ·geluBackwardAVX512(SB), NOSPLIT, $0-48
	MOVQ dinp+0(FP), DI
	MOVQ inp+8(FP), SI
	MOVQ th+16(FP), DX
	MOVQ dout+24(FP), BX
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), R8
	VBROADCASTSS 0(R8), Z12
	VBROADCASTSS 4(R8), Z13
	VBROADCASTSS 8(R8), Z14
	VBROADCASTSS 12(R8), Z15
	SHRQ $4, CX
	JZ   bdone512

bloop512:
	VMOVUPS (SI), Z0
	VMOVUPS (DX), Z1
	VADDPS  Z13, Z1, Z2
	VMULPS  Z12, Z2, Z2
	VMULPS  Z12, Z0, Z3
	VMULPS  Z1, Z1, Z4
	VSUBPS  Z4, Z13, Z4
	VMULPS  Z4, Z3, Z3
	VMULPS  Z14, Z3, Z3
	VMULPS  Z15, Z0, Z5
	VMULPS  Z0, Z5, Z5
	VADDPS  Z13, Z5, Z5
	VMULPS  Z5, Z3, Z3
	VADDPS  Z3, Z2, Z2
	VMULPS  (BX), Z2, Z2
	VMOVUPS Z2, (DI)

	ADDQ $64, DI
	ADDQ $64, SI
	ADDQ $64, DX
	ADDQ $64, BX
	DECQ CX
	JNZ  bloop512

bdone512:
	VZEROUPPER
	RET
