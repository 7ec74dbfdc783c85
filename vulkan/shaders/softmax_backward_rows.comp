#version 450
// softmax_backward_rows: dx = prob·(dprob − Σ_e prob·dprob) for each row of the router softmax
// (N,E), as kernels.SoftmaxBackwardRows: one invocation per row, since E is a handful of experts,
// the sum Go's float32 chain in e order, and precise, so that nothing is fused where Go does
// not fuse.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dx;
	uint off_p;
	uint off_dp;
	uint rows;
	uint e;
} p;

layout(std430, set = 0, binding = 0) buffer DX { float dx[]; };
layout(std430, set = 0, binding = 1) readonly buffer PR { float prob[]; };
layout(std430, set = 0, binding = 2) readonly buffer DP { float dprob[]; };

void main() {
	uint r = flat_index();
	if (r >= p.rows) {
		return;
	}
	uint x0 = p.off_dx + r * p.e;
	uint p0 = p.off_p + r * p.e;
	uint d0 = p.off_dp + r * p.e;
	precise float s = 0.0;
	for (uint j = 0u; j < p.e; j++) {
		s = s + prob[p0 + j] * dprob[d0 + j];
	}
	for (uint j = 0u; j < p.e; j++) {
		precise float v = prob[p0 + j] * (dprob[d0 + j] - s);
		dx[x0 + j] = v;
	}
}
