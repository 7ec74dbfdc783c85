#version 450
// crossentropy_forward: each row's −log softmax(logits)[target] into losses (N), one workgroup per
// row; the host reads them and takes the mean in float64 in row order, as the Go reference.
// logsumexp is float32 here (float64 in Go).

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_losses;
	uint off_logits;
	uint off_targets;
	uint rows;
	uint v;
} p;

layout(std430, set = 0, binding = 0) buffer L { float losses[]; };
layout(std430, set = 0, binding = 1) readonly buffer G { float logits[]; };
layout(std430, set = 0, binding = 2) readonly buffer T { int targets[]; };

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
	s = wg_sum(s);
	if (l == 0u) {
		float lse = mx + log(s);
		losses[p.off_losses + r] = lse - logits[l0 + uint(targets[p.off_targets + r])];
	}
}
