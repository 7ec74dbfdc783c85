#version 450
// attention_softmax: the causal softmax of each row of att (B,H,T,T) in place, one workgroup per
// row: scores of query t scaled, softmax over keys 0…t, zeros after, as kernels.AttentionForward
// (causalSoftmax). Reductions through the fixed tree of reduce.glsl.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_att;
	uint rows;
	uint t;
	float scale;
} p;

layout(std430, set = 0, binding = 0) buffer A { float att[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint q = r % p.t; // the query position: keys 0…q are visible
	uint base = p.off_att + r * p.t;
	float mx = -3.4028234663852886e38;
	for (uint j = l; j <= q; j += WG) {
		float v = att[base + j] * p.scale;
		att[base + j] = v;
		mx = max(mx, v);
	}
	mx = wg_max(mx);
	float sum = 0.0;
	for (uint j = l; j <= q; j += WG) {
		float e = exp(att[base + j] - mx);
		att[base + j] = e;
		sum += e;
	}
	float inv = 1.0 / wg_sum(sum);
	for (uint j = l; j < p.t; j += WG) {
		att[base + j] = j <= q ? att[base + j] * inv : 0.0;
	}
}
