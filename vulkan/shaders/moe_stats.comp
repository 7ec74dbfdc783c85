#version 450
// moe_stats: stats (E+1) = each expert's assignment count Σ_r mask[r,e], then the Switch
// balancing loss E·Σ_e f_e·P_e (f_e = count_e/(N·K), P_e the mean of column e of probs), as
// kernels.MoEStats, in one workgroup: for each expert in order, strided partials over the rows
// and the fixed tree of reduce.glsl, and invocation 0 adds the experts' terms in expert order.
// Go sums in float64; Vulkan's float64 is optional, so the sums are float32: the counts, sums of
// exact 0s and 1s below 2^24, are exact in any order, the loss is within tolMoEStats. E·N
// elements once per block and step: one workgroup reads them in a few microseconds.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_stats;
	uint off_mask;
	uint off_probs;
	uint rows;
	uint experts;
	uint k;
} p;

layout(std430, set = 0, binding = 0) buffer S { float stats[]; };
layout(std430, set = 0, binding = 1) readonly buffer M { float mask[]; };
layout(std430, set = 0, binding = 2) readonly buffer P { float probs[]; };

void main() {
	uint l = gl_LocalInvocationID.x;
	float aux = 0.0; // invocation 0's
	for (uint e = 0u; e < p.experts; e++) {
		float pm = 0.0;
		float n = 0.0;
		for (uint r = l; r < p.rows; r += WG) {
			pm += probs[p.off_probs + r * p.experts + e];
			n += mask[p.off_mask + r * p.experts + e];
		}
		pm = wg_sum(pm);
		n = wg_sum(n);
		if (l == 0u) {
			stats[p.off_stats + e] = n;
			precise float t = n / float(p.rows * p.k) * pm / float(p.rows);
			aux = aux + t;
		}
	}
	if (l == 0u) {
		precise float a = float(p.experts) * aux;
		stats[p.off_stats + p.experts] = a;
	}
}
