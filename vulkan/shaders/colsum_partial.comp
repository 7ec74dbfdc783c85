#version 450
// colsum_partial: the first pass of a column sum over rows (LinearBackward's bias gradient):
// rows are cut into chunks of ROWS_CHUNK, fixed by the shape alone, and one invocation per
// (chunk, column) sums its chunk in row order, consecutive invocations on consecutive columns.
// Chunk 0 starts from the old db, so with one chunk the result is written straight to db and is
// the Go kernel's chain exactly; with more, colsum_combine adds the chunks in order. No atomics:
// the order is the same on every run and every GPU.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

#define ROWS_CHUNK 32u

layout(push_constant) uniform Params {
	uint off_db;
	uint off_part;
	uint off_dout;
	uint rows;
	uint c;
	uint chunks;
} p;

layout(std430, set = 0, binding = 0) buffer D { float db[]; };
layout(std430, set = 0, binding = 1) buffer P { float part[]; };
layout(std430, set = 0, binding = 2) readonly buffer DO { float dout[]; };

void main() {
	uint i = flat_index();
	if (i >= p.chunks * p.c) {
		return;
	}
	uint ch = i / p.c;
	uint col = i % p.c;
	float s = ch == 0u ? db[p.off_db + col] : 0.0;
	uint hi = min(p.rows, (ch + 1u) * ROWS_CHUNK);
	for (uint r = ch * ROWS_CHUNK; r < hi; r++) {
		s += dout[p.off_dout + r * p.c + col];
	}
	if (p.chunks == 1u) {
		db[p.off_db + col] = s;
	} else {
		part[p.off_part + i] = s;
	}
}
