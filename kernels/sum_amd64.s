//go:build !purego

#include "textflag.h"

// func sumAVX2(dst, a, b *float32, n int)
//
// dst[i] = a[i] + b[i] for n floats (a multiple of 8): one rounded addition each, as the Go loop
// does, 32 at a time while they last, then 8 at a time. dst may be a or b.
TEXT ·sumAVX2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX
	MOVQ CX, BX
	SHRQ $5, BX
	JZ   eights

loop32:
	VMOVUPS 0(SI), Y0
	VMOVUPS 32(SI), Y1
	VMOVUPS 64(SI), Y2
	VMOVUPS 96(SI), Y3
	VADDPS  0(DX), Y0, Y0
	VADDPS  32(DX), Y1, Y1
	VADDPS  64(DX), Y2, Y2
	VADDPS  96(DX), Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, SI
	ADDQ    $128, DX
	ADDQ    $128, DI
	DECQ    BX
	JNZ     loop32

eights:
	ANDQ $31, CX
	SHRQ $3, CX
	JZ   done

loop8:
	VMOVUPS 0(SI), Y0
	VADDPS  0(DX), Y0, Y0
	VMOVUPS Y0, 0(DI)
	ADDQ    $32, SI
	ADDQ    $32, DX
	ADDQ    $32, DI
	DECQ    CX
	JNZ     loop8

done:
	VZEROUPPER
	RET

// func scaleMaxAVX2(x *float32, n int, s float32, m *[8]float32)
//
// x[i] *= s for n floats (a multiple of 8), each one rounded product as in the Go loop, and the
// lanes' running maxima of the products into m (which holds −Inf on entry): the caller takes the
// max of the eight. VMAXPS differs from Go's max only on NaN and on the sign of a zero maximum,
// neither of which changes what a softmax computes from it (x − max, then exp).
TEXT ·scaleMaxAVX2(SB), NOSPLIT, $0-32
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	VBROADCASTSS s+16(FP), Y1
	MOVQ         m+24(FP), R8
	VMOVUPS      (R8), Y2
	SHRQ         $3, CX
	JZ           smdone

smloop:
	VMULPS  (DI), Y1, Y0
	VMOVUPS Y0, (DI)
	VMAXPS  Y0, Y2, Y2
	ADDQ    $32, DI
	DECQ    CX
	JNZ     smloop

smdone:
	VMOVUPS Y2, (R8)
	VZEROUPPER
	RET

// func scaleAVX2(x *float32, n int, s float32)
//
// x[i] *= s for n floats (a multiple of 8).
TEXT ·scaleAVX2(SB), NOSPLIT, $0-20
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	VBROADCASTSS s+16(FP), Y1
	SHRQ         $3, CX
	JZ           scdone

scloop:
	VMULPS  (DI), Y1, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, DI
	DECQ    CX
	JNZ     scloop

scdone:
	VZEROUPPER
	RET
