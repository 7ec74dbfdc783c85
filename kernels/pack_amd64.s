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

// func scatterRowsAVX(d *float32, ldd int, src *float32, w, n int)
//
// Copies n runs of w floats (w a multiple of 16), consecutive in src, to runs ldd floats apart in
// d: gatherRowsAVX's inverse (attention's head outputs and masked products written back into
// their rows). YMM moves, each pair of loads before its pair of stores.
TEXT ·scatterRowsAVX(SB), NOSPLIT, $0-40
	MOVQ  d+0(FP), DI
	MOVQ  ldd+8(FP), DX
	SHLQ  $2, DX
	MOVQ  src+16(FP), SI
	MOVQ  w+24(FP), R8
	SHRQ  $4, R8
	MOVQ  n+32(FP), CX
	TESTQ CX, CX
	JZ    sdone
	TESTQ R8, R8
	JZ    sdone

srow:
	MOVQ DI, R9
	MOVQ R8, BX

srun:
	VMOVUPS (SI), Y0
	VMOVUPS 32(SI), Y1
	VMOVUPS Y0, (R9)
	VMOVUPS Y1, 32(R9)
	ADDQ    $64, SI
	ADDQ    $64, R9
	DECQ    BX
	JNZ     srun
	ADDQ    DX, DI
	DECQ    CX
	JNZ     srow

sdone:
	VZEROUPPER
	RET
