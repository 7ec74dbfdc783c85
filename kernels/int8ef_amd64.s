//go:build !purego

#include "textflag.h"

// The vector loops of Int8ErrorFeedback (int8ef.go), eight floats at a time; n is a multiple of
// 8 and at least 8.

// func int8AddAVX2(x, e *float32, n int)
//
// x = x + e.
TEXT ·int8AddAVX2(SB), NOSPLIT, $0-24
	MOVQ x+0(FP), DI
	MOVQ e+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $3, CX

add:
	VMOVUPS (DI), Y0
	VADDPS  (SI), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, DI
	ADDQ    $32, SI
	DECQ    CX
	JNZ     add
	VZEROUPPER
	RET

// func int8AbsMaxAVX2(x *float32, n int, m *[16]float32)
//
// m[k] = max |x[i]| over the lanes i ≡ k (mod 8), and m[8+k] nonzero when one of them is a NaN
// (VMAXPS would drop it).
TEXT ·int8AbsMaxAVX2(SB), NOSPLIT, $0-24
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	MOVQ         m+16(FP), R8
	MOVL         $0x7fffffff, AX
	MOVL         AX, X7
	VBROADCASTSS X7, Y7          // |·| mask
	VXORPS       Y1, Y1, Y1      // the lanes' maxima, from +0
	VXORPS       Y2, Y2, Y2      // the lanes' NaN flags
	SHRQ         $3, CX

absmax:
	VMOVUPS (DI), Y0
	VANDPS  Y7, Y0, Y0
	VCMPPS  $3, Y0, Y0, Y3       // unordered: all ones where a NaN
	VORPS   Y3, Y2, Y2
	VMAXPS  Y1, Y0, Y1
	ADDQ    $32, DI
	DECQ    CX
	JNZ     absmax
	VMOVUPS Y1, 0(R8)
	VMOVUPS Y2, 32(R8)
	VZEROUPPER
	RET

// func int8QuantAVX2(x, e *float32, codes *int8, n int, s float32)
//
// For each u = x[i]: c = clamp(roundeven(u/s), −127, 127) as an int8, r = float32(c)·s,
// e[i] = u − r, x[i] = r, codes[i] = c. r is formed from the integer c, so a u that rounds to
// zero gives r = +0 as the scalar code does, never −0.
TEXT ·int8QuantAVX2(SB), NOSPLIT, $0-36
	MOVQ         x+0(FP), DI
	MOVQ         e+8(FP), SI
	MOVQ         codes+16(FP), DX
	MOVQ         n+24(FP), CX
	VBROADCASTSS s+32(FP), Y7
	MOVL         $0x42fe0000, AX // 127
	MOVL         AX, X6
	VBROADCASTSS X6, Y6
	MOVL         $0xc2fe0000, AX // −127
	MOVL         AX, X5
	VBROADCASTSS X5, Y5
	SHRQ         $3, CX

quant:
	VMOVUPS      (DI), Y0        // u
	VDIVPS       Y7, Y0, Y1      // u/s
	VROUNDPS     $8, Y1, Y1      // to the nearest integer, ties to even
	VMINPS       Y6, Y1, Y1
	VMAXPS       Y5, Y1, Y1
	VCVTTPS2DQ   Y1, Y1          // c, exact
	VCVTDQ2PS    Y1, Y2
	VMULPS       Y7, Y2, Y2      // r = float32(c)·s
	VSUBPS       Y2, Y0, Y3      // u − r
	VMOVUPS      Y3, (SI)
	VMOVUPS      Y2, (DI)
	VEXTRACTI128 $1, Y1, X4
	VPACKSSDW    X4, X1, X1      // eight int16, in order
	VPACKSSWB    X1, X1, X1      // eight int8 (twice)
	VMOVQ        X1, (DX)
	ADDQ         $32, DI
	ADDQ         $32, SI
	ADDQ         $8, DX
	DECQ         CX
	JNZ          quant
	VZEROUPPER
	RET

// func nesterovAVX2(w, v *float32, d *float64, n int, c *[2]float64)
//
// The outer step's Nesterov update (model/outer.go), four elements at a time in float64, each
// product and sum rounded as the Go loop rounds it (no fused multiply-add): with μ = c[0] and
// lr = c[1], v = float32(μ·v + d); w = float32(w − lr·(d + μ·v)), w the parameters.
TEXT ·nesterovAVX2(SB), NOSPLIT, $0-40
	MOVQ         w+0(FP), DI
	MOVQ         v+8(FP), SI
	MOVQ         d+16(FP), DX
	MOVQ         n+24(FP), CX
	MOVQ         c+32(FP), R8
	VBROADCASTSD 0(R8), Y6       // μ
	VBROADCASTSD 8(R8), Y7       // lr
	SHRQ         $2, CX

nesterov:
	VCVTPS2PD  (SI), Y0          // v
	VMOVUPD    (DX), Y1          // d
	VMULPD     Y6, Y0, Y0
	VADDPD     Y1, Y0, Y0
	VCVTPD2PSY Y0, X0            // the new v, float32
	VMOVUPS    X0, (SI)
	VCVTPS2PD  X0, Y0
	VMULPD     Y6, Y0, Y0
	VADDPD     Y0, Y1, Y0        // d + μ·v
	VMULPD     Y7, Y0, Y0
	VCVTPS2PD  (DI), Y2          // g
	VSUBPD     Y0, Y2, Y2
	VCVTPD2PSY Y2, X2
	VMOVUPS    X2, (DI)
	ADDQ       $16, DI
	ADDQ       $16, SI
	ADDQ       $32, DX
	DECQ       CX
	JNZ        nesterov
	VZEROUPPER
	RET
