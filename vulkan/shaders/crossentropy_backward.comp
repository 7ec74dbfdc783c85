#version 450
// crossentropy_backward: logits (N,V) turned into their gradient scale·(softmax − onehot)/N in
// place, one workgroup per row, as kernels.CrossEntropyBackward.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_logits;
	uint off_targets;
	uint rows;
	uint v;
	float scale;
} p;

layout(std430, set = 0, binding = 0) buffer G { float logits[]; };
layout(std430, set = 0, binding = 1) readonly buffer T { int targets[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint l0 = p.off_logits + r * p.v;
	float mx = -3.4028234663852886e38;
	for (uint i = l; i < p.v; i += WG) {
		mx = max(mx, logits[l0 + i]);
	}
	mx = wg_max(mx);
	float s = 0.0;
	for (uint i = l; i < p.v; i += WG) {
		s += exp(logits[l0 + i] - mx);
	}
	// wg_sum ends with a barrier: every read of the row is done before the first write.
	float lse = mx + log(wg_sum(s));
	float k = p.scale / float(p.rows);
	uint t = uint(targets[p.off_targets + r]);
	for (uint i = l; i < p.v; i += WG) {
		precise float g = exp(logits[l0 + i] - lse) * k;
		if (i == t) {
			g = g - k;
		}
		logits[l0 + i] = g;
	}
}
