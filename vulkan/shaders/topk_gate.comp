#version 450
// topk_gate: for each row of probs (N,E), gate = probs and mask = 1 at the K experts of largest
// probability, 0 elsewhere, as kernels.TopKGate: one invocation per row (E is a handful of
// experts), K scans of the row in expert order with a strict >, so a tie goes to the lower index,
// and the mask being built is what marks an expert taken. Only comparisons and copies: the bits
// are Go's.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_gate;
	uint off_mask;
	uint off_probs;
	uint rows;
	uint e;
	uint k;
} p;

layout(std430, set = 0, binding = 0) buffer G { float gate[]; };
layout(std430, set = 0, binding = 1) buffer M { float mask[]; };
layout(std430, set = 0, binding = 2) readonly buffer P { float probs[]; };

void main() {
	uint r = flat_index();
	if (r >= p.rows) {
		return;
	}
	uint g0 = p.off_gate + r * p.e;
	uint m0 = p.off_mask + r * p.e;
	uint p0 = p.off_probs + r * p.e;
	for (uint j = 0u; j < p.e; j++) {
		gate[g0 + j] = 0.0;
		mask[m0 + j] = 0.0;
	}
	for (uint s = 0u; s < p.k; s++) {
		uint best = p.e; // none yet
		float bv = 0.0;
		for (uint j = 0u; j < p.e; j++) {
			float v = probs[p0 + j];
			if (mask[m0 + j] == 0.0 && (best == p.e || v > bv)) {
				best = j;
				bv = v;
			}
		}
		mask[m0 + best] = 1.0;
		gate[g0 + best] = bv;
	}
}
