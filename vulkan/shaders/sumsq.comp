#version 450
// sumsq: partial sums of squares of x, one per chunk of SUMSQ_CHUNK elements and one workgroup
// per chunk: each invocation sums a strided 16 elements in order, then the fixed tree of
// reduce.glsl. The host adds the partials in float64 in chunk order (SquaredNorms), so a
// tensor's ‖x‖² is the same bits on every run.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

#define SUMSQ_CHUNK 4096u

layout(push_constant) uniform Params {
	uint off_part;
	uint off_x;
	uint n;
} p;

layout(std430, set = 0, binding = 0) buffer P { float part[]; };
layout(std430, set = 0, binding = 1) readonly buffer X { float x[]; };

void main() {
	uint chunk = group_index();
	uint lo = chunk * SUMSQ_CHUNK;
	if (lo >= p.n) {
		return;
	}
	uint hi = min(lo + SUMSQ_CHUNK, p.n);
	float s = 0.0;
	for (uint i = lo + gl_LocalInvocationID.x; i < hi; i += WG) {
		float v = x[p.off_x + i];
		s += v * v;
	}
	s = wg_sum(s);
	if (gl_LocalInvocationID.x == 0u) {
		part[p.off_part + chunk] = s;
	}
}
