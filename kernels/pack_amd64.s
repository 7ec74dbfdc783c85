//go:build !purego

#include "textflag.h"

// func gather32AVX(d, src *float32, lds, n int)
//
// Copies n runs of 32 floats, lds floats apart in src, to consecutive runs of 32 in d: a B panel
// of an AVX-512 multiply packed from B stored k×n (one run per k step). Four YMM moves a run,
// where copy would call memmove for every 128 bytes.
TEXT ·gather32AVX(SB), NOSPLIT, $0-32
	MOVQ  d+0(FP), DI
	MOVQ  src+8(FP), SI
	MOVQ  lds+16(FP), DX
	SHLQ  $2, DX
	MOVQ  n+24(FP), CX
	TESTQ CX, CX
	JZ    done32

loop32:
	VMOVUPS 0(SI), Y0
	VMOVUPS 32(SI), Y1
	VMOVUPS 64(SI), Y2
	VMOVUPS 96(SI), Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    DX, SI
	ADDQ    $128, DI
	DECQ    CX
	JNZ     loop32

done32:
	VZEROUPPER
	RET

// func gather16AVX(d, src *float32, lds, n int)
//
// gather32AVX for runs of 16 floats: the B panels of an AVX2 multiply.
TEXT ·gather16AVX(SB), NOSPLIT, $0-32
	MOVQ  d+0(FP), DI
	MOVQ  src+8(FP), SI
	MOVQ  lds+16(FP), DX
	SHLQ  $2, DX
	MOVQ  n+24(FP), CX
	TESTQ CX, CX
	JZ    done16

loop16:
	VMOVUPS 0(SI), Y0
	VMOVUPS 32(SI), Y1
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	ADDQ    DX, SI
	ADDQ    $64, DI
	DECQ    CX
	JNZ     loop16

done16:
	VZEROUPPER
	RET
