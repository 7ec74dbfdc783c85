//go:build !purego

#include "textflag.h"

// func expAVX2(dst, x *float64, n int, c *[14][4]float64) int
//
// dst[i] = math.Exp(x[i]) bit for bit, four at a time, for as many whole groups of four from the
// start as have every x in [−700, 700]; returns how many it did (a multiple of 4), stopping at
// the first group with an x outside (or NaN), which the caller computes with math.Exp. It is the
// standard library's amd64 archExp on its FMA path, lane by lane: the same operations in the same
// order with the same roundings. In that range no lane takes archExp's overflow, underflow or
// denormal branches (k = round(x·log2e) stays within ±1010, so k + 1023 is a normal exponent).
//
// c holds, each broadcast to four lanes: log2e, ln2 (upper), ln2 (lower), 1/16, the Taylor
// coefficients 1/8!, 1/7!, 1/6!, 1/5!, 1/4!, 1/3!, 1/2, then 1, 2, and the exponent bias 1023
// as an int64, then the range −700 and 700.
TEXT ·expAVX2(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ c+24(FP), R8
	XORQ AX, AX
	VMOVUPD 0(R8), Y8    // log2e
	VMOVUPD 32(R8), Y9   // ln2 upper
	VMOVUPD 64(R8), Y10  // ln2 lower
	VMOVUPD 96(R8), Y11  // 0.0625
	VMOVUPD 352(R8), Y12 // 1.0
	VMOVUPD 384(R8), Y13 // 2.0
	VMOVUPD 416(R8), Y14 // 1023 (int64)
	VMOVUPD 448(R8), Y15 // -700
	SUBQ $4, CX
	JL   done

loop:
	VMOVUPD (SI)(AX*8), Y0
	// every lane in [−700, 700]? (ordered compares: NaN fails)
	VCMPPD   $0x1d, Y15, Y0, Y5   // x >= −700
	VCMPPD   $0x12, 480(R8), Y0, Y6 // x <= 700
	VANDPD   Y6, Y5, Y5
	VMOVMSKPD Y5, DX
	CMPQ     DX, $15
	JNE      done

	// k = round(x·log2e) as int32 and as float64
	VMULPD     Y8, Y0, Y1
	VCVTPD2DQY Y1, X3
	VCVTDQ2PD  X3, Y1
	// x −= k·ln2u; x −= k·ln2l (fused, as VFNMADD231SD)
	VFNMADD231PD Y9, Y1, Y0
	VFNMADD231PD Y10, Y1, Y0
	VMULPD       Y11, Y0, Y0
	// p = ((((((c8·x + c7)·x + c6)·x + c5)·x + c4)·x + c3)·x + 1/2)·x + 1, each step fused
	VMOVUPD      128(R8), Y1
	VFMADD213PD  160(R8), Y0, Y1
	VFMADD213PD  192(R8), Y0, Y1
	VFMADD213PD  224(R8), Y0, Y1
	VFMADD213PD  256(R8), Y0, Y1
	VFMADD213PD  288(R8), Y0, Y1
	VFMADD213PD  320(R8), Y0, Y1
	VFMADD213PD  Y12, Y0, Y1
	// x = x·p, then three times x = x·(x + 2), then x = x·(x + 2) + 1 (fused)
	VMULPD       Y1, Y0, Y0
	VADDPD       Y13, Y0, Y1
	VMULPD       Y1, Y0, Y0
	VADDPD       Y13, Y0, Y1
	VMULPD       Y1, Y0, Y0
	VADDPD       Y13, Y0, Y1
	VMULPD       Y1, Y0, Y0
	VADDPD       Y13, Y0, Y1
	VFMADD213PD  Y12, Y1, Y0
	// · 2^k
	VPMOVSXDQ X3, Y4
	VPADDQ    Y14, Y4, Y4
	VPSLLQ    $52, Y4, Y4
	VMULPD    Y4, Y0, Y0
	VMOVUPD   Y0, (DI)(AX*8)
	ADDQ      $4, AX
	CMPQ      AX, CX
	JLE       loop

done:
	MOVQ AX, ret+32(FP)
	VZEROUPPER
	RET

// func expAVX512(dst, x *float64, n int, c *[16][4]float64) int
//
// expAVX2 on eight lanes: the same operations in the same order, each constant broadcast from
// lane 0 of c's rows into a register of its own (AVX-512 has 32), the range test into a mask.
// Returns how many it did, a multiple of 8.
TEXT ·expAVX512(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ c+24(FP), R8
	XORQ AX, AX
	VBROADCASTSD 0(R8), Z8    // log2e
	VBROADCASTSD 32(R8), Z9   // ln2 upper
	VBROADCASTSD 64(R8), Z10  // ln2 lower
	VBROADCASTSD 96(R8), Z11  // 0.0625
	VBROADCASTSD 128(R8), Z16 // 1/8!
	VBROADCASTSD 160(R8), Z17 // 1/7!
	VBROADCASTSD 192(R8), Z18 // 1/6!
	VBROADCASTSD 224(R8), Z19 // 1/5!
	VBROADCASTSD 256(R8), Z20 // 1/4!
	VBROADCASTSD 288(R8), Z21 // 1/3!
	VBROADCASTSD 320(R8), Z22 // 1/2
	VBROADCASTSD 352(R8), Z12 // 1.0
	VBROADCASTSD 384(R8), Z13 // 2.0
	VPBROADCASTQ 416(R8), Z14 // 1023 (int64)
	VBROADCASTSD 448(R8), Z15 // -700
	VBROADCASTSD 480(R8), Z23 // 700
	SUBQ $8, CX
	JL   done512

loop512:
	VMOVUPD (SI)(AX*8), Z0
	// every lane in [−700, 700]? (ordered compares: NaN fails)
	VCMPPD  $0x1d, Z15, Z0, K1 // x >= −700
	VCMPPD  $0x12, Z23, Z0, K2 // x <= 700
	KANDB   K1, K2, K1
	KMOVB   K1, DX
	CMPQ    DX, $0xff
	JNE     done512

	// k = round(x·log2e) as int32 and as float64
	VMULPD    Z8, Z0, Z1
	VCVTPD2DQ Z1, Y3
	VCVTDQ2PD Y3, Z1
	// x −= k·ln2u; x −= k·ln2l (fused)
	VFNMADD231PD Z9, Z1, Z0
	VFNMADD231PD Z10, Z1, Z0
	VMULPD       Z11, Z0, Z0
	// p = ((((((c8·x + c7)·x + c6)·x + c5)·x + c4)·x + c3)·x + 1/2)·x + 1, each step fused
	VMOVAPD     Z16, Z1
	VFMADD213PD Z17, Z0, Z1
	VFMADD213PD Z18, Z0, Z1
	VFMADD213PD Z19, Z0, Z1
	VFMADD213PD Z20, Z0, Z1
	VFMADD213PD Z21, Z0, Z1
	VFMADD213PD Z22, Z0, Z1
	VFMADD213PD Z12, Z0, Z1
	// x = x·p, then three times x = x·(x + 2), then x = x·(x + 2) + 1 (fused)
	VMULPD      Z1, Z0, Z0
	VADDPD      Z13, Z0, Z1
	VMULPD      Z1, Z0, Z0
	VADDPD      Z13, Z0, Z1
	VMULPD      Z1, Z0, Z0
	VADDPD      Z13, Z0, Z1
	VMULPD      Z1, Z0, Z0
	VADDPD      Z13, Z0, Z1
	VFMADD213PD Z12, Z1, Z0
	// · 2^k
	VPMOVSXDQ Y3, Z4
	VPADDQ    Z14, Z4, Z4
	VPSLLQ    $52, Z4, Z4
	VMULPD    Z4, Z0, Z0
	VMOVUPD   Z0, (DI)(AX*8)
	ADDQ      $8, AX
	CMPQ      AX, CX
	JLE       loop512

done512:
	MOVQ AX, ret+32(FP)
	VZEROUPPER
	RET
