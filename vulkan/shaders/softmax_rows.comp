#version 450
// softmax_rows: each row of x (N,E) normalised in place (the MoE router), one workgroup per row:
// max and sum of exponentials through the fixed tree of reduce.glsl, in float32 where Go sums
// in float64.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_x;
	uint rows;
	uint e;
} p;

layout(std430, set = 0, binding = 0) buffer X { float x[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint x0 = p.off_x + r * p.e;
	float mx = -3.4028234663852886e38;
	for (uint i = l; i < p.e; i += WG) {
		mx = max(mx, x[x0 + i]);
	}
	mx = wg_max(mx);
	float s = 0.0;
	for (uint i = l; i < p.e; i += WG) {
		float e = exp(x[x0 + i] - mx);
		x[x0 + i] = e;
		s += e;
	}
	float inv = 1.0 / wg_sum(s);
	for (uint i = l; i < p.e; i += WG) {
		x[x0 + i] = x[x0 + i] * inv; // each element stays with the invocation that wrote it
	}
}
