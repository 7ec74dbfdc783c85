//go:build !purego && !amd64.v3

#include "textflag.h"

// func axpyAVX2(dst, x *float32, n int, s float32)
//
// dst[i] += s·x[i] for n floats (a multiple of 8), with the Go loop's operations in its order:
// the product rounded to float32, then the sum (no fused multiply-add, which is why this loop is
// only used below GOAMD64=v3, where the compiler does not fuse the Go loop either).
TEXT ·axpyAVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         x+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS s+24(FP), Y8
	SHRQ         $3, CX
	JZ           axdone

axloop:
	VMULPS  (SI), Y8, Y0 // s·x
	VMOVUPS (DI), Y1
	VADDPS  Y0, Y1, Y1   // dst + s·x
	VMOVUPS Y1, (DI)
	ADDQ    $32, SI
	ADDQ    $32, DI
	DECQ    CX
	JNZ     axloop

axdone:
	VZEROUPPER
	RET

// func scaleToAVX2(dst, x *float32, n int, s float32)
//
// dst[i] = s·x[i] for n floats (a multiple of 8).
TEXT ·scaleToAVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         x+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS s+24(FP), Y8
	SHRQ         $3, CX
	JZ           stdone

stloop:
	VMULPS  (SI), Y8, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, SI
	ADDQ    $32, DI
	DECQ    CX
	JNZ     stloop

stdone:
	VZEROUPPER
	RET
