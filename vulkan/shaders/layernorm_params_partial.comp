#version 450
// layernorm_params_partial: colsum_partial for LayerNorm's dw and db at once (one read of dout,
// inp and the row statistics): per (chunk of ROWS_CHUNK rows, column), in row order, chunk 0
// starting from the old gradients; colsum_combine finishes each when there is more than one chunk.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

#define ROWS_CHUNK 32u

layout(push_constant) uniform Params {
	uint off_dw;
	uint off_db;
	uint off_pw;
	uint off_pb;
	uint off_dout;
	uint off_inp;
	uint off_mean;
	uint off_rstd;
	uint rows;
	uint c;
	uint chunks;
} p;

layout(std430, set = 0, binding = 0) buffer DW { float dw[]; };
layout(std430, set = 0, binding = 1) buffer DB { float db[]; };
layout(std430, set = 0, binding = 2) buffer P { float part[]; };
layout(std430, set = 0, binding = 3) readonly buffer DO { float dout[]; };
layout(std430, set = 0, binding = 4) readonly buffer I { float inp[]; };
layout(std430, set = 0, binding = 5) readonly buffer Mn { float mean[]; };
layout(std430, set = 0, binding = 6) readonly buffer Rs { float rstd[]; };

void main() {
	uint i = flat_index();
	if (i >= p.chunks * p.c) {
		return;
	}
	uint ch = i / p.c;
	uint col = i % p.c;
	precise float sw = ch == 0u ? dw[p.off_dw + col] : 0.0;
	precise float sb = ch == 0u ? db[p.off_db + col] : 0.0;
	uint hi = min(p.rows, (ch + 1u) * ROWS_CHUNK);
	for (uint r = ch * ROWS_CHUNK; r < hi; r++) {
		float d = dout[p.off_dout + r * p.c + col];
		sb = sb + d;
		sw = sw + (inp[p.off_inp + r * p.c + col] - mean[p.off_mean + r]) * rstd[p.off_rstd + r] * d;
	}
	if (p.chunks == 1u) {
		dw[p.off_dw + col] = sw;
		db[p.off_db + col] = sb;
	} else {
		part[p.off_pw + i] = sw;
		part[p.off_pb + i] = sb;
	}
}
