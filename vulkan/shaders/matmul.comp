#version 450
// matmul: C (m×n) = op(A) (m×k) · op(B) (k×n), or C += … with acc, for a batch of matrices at
// strided offsets: kernels.MatMulNN/NT/TN are the batch-of-one cases, and attention runs its
// per-(batch, head) products through the batch strides straight out of the (B,T,3C) qkv tensor.
// Compiled three times: -DTRANS_A=1 (A stored k×m, MatMulTN), -DTRANS_B=1 (B stored n×k,
// MatMulNT), neither (MatMulNN).
//
// Each element of C is one sequential chain over k = 0 … K-1 that starts from 0, or from the old
// C with acc, and every step is an explicit fma: the chain of the Go kernels (kernels/gemm.go,
// whose AVX2/AVX-512 micro-kernels fuse too), so results never depend on the tile an element
// falls in and differ from the Go kernels only where Go does not fuse (the pure-Go fallback).
//
// Tiling, for GPUs: a workgroup of 128 invocations (8 along n × 16 along m) computes a 64×64
// tile of C; each invocation keeps 4×8 outputs in registers, rows ty+16i and columns tx+8j,
// interleaved so that neighbouring invocations store neighbouring addresses. K advances in
// steps of 16: the workgroup stages a 64×16 slice of A and a 16×64 slice of B in shared memory,
// both k-major, so the inner loop reads one broadcast A value per row and eight consecutive B
// values. Global loads are mapped per layout so that consecutive invocations read consecutive
// addresses (along k for a row-major A or an n×k B, along m or n otherwise). The shared rows are
// 66 floats long: for the layouts whose loads run along k, a warp writes 16 k values of two rows,
// and a stride of 66 ≡ 2 (mod 32 banks) puts them in 32 different banks. Rows and k steps past
// the edges load zeros that are never stored, and the last k step stops at K, so odd shapes
// compute exactly the same chain.

#extension GL_GOOGLE_include_directive : require

#ifndef TRANS_A
#define TRANS_A 0
#endif
#ifndef TRANS_B
#define TRANS_B 0
#endif

layout(local_size_x = 8, local_size_y = 16, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_c;
	uint off_a;
	uint off_b;
	uint m;
	uint k;
	uint n;
	uint ldc;
	uint lda;
	uint ldb;
	uint acc;
	// Batch index z = outer·batch_inner + inner; a matrix starts s_outer·outer + s_inner·inner
	// elements after its operand's offset.
	uint batch_inner;
	uint sc_outer;
	uint sc_inner;
	uint sa_outer;
	uint sa_inner;
	uint sb_outer;
	uint sb_inner;
} p;

layout(std430, set = 0, binding = 0) buffer CBuf { float c[]; };
layout(std430, set = 0, binding = 1) readonly buffer ABuf { float a[]; };
layout(std430, set = 0, binding = 2) readonly buffer BBuf { float b[]; };

#define BM 64u
#define BN 64u
#define BK 16u
#define TM 4u
#define TN 8u
#define WX 8u
#define WY 16u
#define NT 128u
#define PAD 66u

shared float As[BK * PAD];
shared float Bs[BK * PAD];

void main() {
	uint z = gl_WorkGroupID.z;
	uint outer = z / p.batch_inner;
	uint inner = z % p.batch_inner;
	uint base_c = p.off_c + outer * p.sc_outer + inner * p.sc_inner;
	uint base_a = p.off_a + outer * p.sa_outer + inner * p.sa_inner;
	uint base_b = p.off_b + outer * p.sb_outer + inner * p.sb_inner;
	uint tx = gl_LocalInvocationID.x;
	uint ty = gl_LocalInvocationID.y;
	uint tid = ty * WX + tx;
	uint m0 = gl_WorkGroupID.y * BM;
	uint n0 = gl_WorkGroupID.x * BN;

	float s[TM][TN];
	for (uint i = 0u; i < TM; i++) {
		uint row = m0 + ty + WY * i;
		for (uint j = 0u; j < TN; j++) {
			uint col = n0 + tx + WX * j;
			s[i][j] = (p.acc != 0u && row < p.m && col < p.n) ? c[base_c + row * p.ldc + col] : 0.0;
		}
	}

	for (uint k0 = 0u; k0 < p.k; k0 += BK) {
		for (uint l = tid; l < BM * BK; l += NT) {
#if TRANS_A
			uint i = l % BM; // A is k×m: consecutive invocations, consecutive rows of C
			uint kk = l / BM;
			uint row = m0 + i;
			uint kg = k0 + kk;
			As[kk * PAD + i] = (row < p.m && kg < p.k) ? a[base_a + kg * p.lda + row] : 0.0;
#else
			uint kk = l % BK; // A is m×k: consecutive invocations, consecutive k
			uint i = l / BK;
			uint row = m0 + i;
			uint kg = k0 + kk;
			As[kk * PAD + i] = (row < p.m && kg < p.k) ? a[base_a + row * p.lda + kg] : 0.0;
#endif
		}
		for (uint l = tid; l < BN * BK; l += NT) {
#if TRANS_B
			uint kk = l % BK; // B is n×k: consecutive k
			uint j = l / BK;
			uint col = n0 + j;
			uint kg = k0 + kk;
			Bs[kk * PAD + j] = (col < p.n && kg < p.k) ? b[base_b + col * p.ldb + kg] : 0.0;
#else
			uint j = l % BN; // B is k×n: consecutive columns
			uint kk = l / BN;
			uint col = n0 + j;
			uint kg = k0 + kk;
			Bs[kk * PAD + j] = (col < p.n && kg < p.k) ? b[base_b + kg * p.ldb + col] : 0.0;
#endif
		}
		barrier();
		uint kn = min(BK, p.k - k0); // uniform: the chain stops exactly at K
		for (uint kk = 0u; kk < kn; kk++) {
			float av[TM];
			float bv[TN];
			for (uint i = 0u; i < TM; i++) {
				av[i] = As[kk * PAD + ty + WY * i];
			}
			for (uint j = 0u; j < TN; j++) {
				bv[j] = Bs[kk * PAD + tx + WX * j];
			}
			for (uint i = 0u; i < TM; i++) {
				for (uint j = 0u; j < TN; j++) {
					s[i][j] = fma(av[i], bv[j], s[i][j]);
				}
			}
		}
		barrier();
	}

	for (uint i = 0u; i < TM; i++) {
		uint row = m0 + ty + WY * i;
		if (row < p.m) {
			for (uint j = 0u; j < TN; j++) {
				uint col = n0 + tx + WX * j;
				if (col < p.n) {
					c[base_c + row * p.ldc + col] = s[i][j];
				}
			}
		}
	}
}
