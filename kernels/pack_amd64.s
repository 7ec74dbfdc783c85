//go:build !purego

#include "textflag.h"

// func gatherRowsAVX(d, src *float32, lds, w, n int)
//
// Copies n runs of w floats (w a multiple of 8), lds floats apart in src, to consecutive runs of
// w in d: a full B panel packed from B stored k×n, one run per k step (w = nr: 32 for the
// AVX-512 kernels, 16 for AVX2). YMM moves, where copy would call memmove for every run.
TEXT ·gatherRowsAVX(SB), NOSPLIT, $0-40
	MOVQ  d+0(FP), DI
	MOVQ  src+8(FP), SI
	MOVQ  lds+16(FP), DX
	SHLQ  $2, DX
	MOVQ  w+24(FP), R8
	SHRQ  $3, R8
	MOVQ  n+32(FP), CX
	TESTQ CX, CX
	JZ    done
	TESTQ R8, R8
	JZ    done

row:
	MOVQ SI, R9
	MOVQ R8, BX

run:
	VMOVUPS (R9), Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, R9
	ADDQ    $32, DI
	DECQ    BX
	JNZ     run
	ADDQ    DX, SI
	DECQ    CX
	JNZ     row

done:
	VZEROUPPER
	RET
