#version 450
// aux_grad: dgate (N,E) += scale·E·f_e/N, f_e = stats[e]/(N·K), the balancing loss's gradient,
// as kernels.AuxGrad: one invocation per element, Go's float32 operations in its order, precise.
// Go's divisions are correctly rounded, Vulkan's within 2.5 ulp (tolAuxGrad).

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dgate;
	uint off_stats;
	uint rows;
	uint experts;
	uint k;
	float scale;
} p;

layout(std430, set = 0, binding = 0) buffer D { float dgate[]; };
layout(std430, set = 0, binding = 1) readonly buffer S { float stats[]; };

void main() {
	uint i = flat_index();
	if (i >= p.rows * p.experts) {
		return;
	}
	precise float f = stats[p.off_stats + i % p.experts] / float(p.rows * p.k);
	precise float g = p.scale * float(p.experts) * f / float(p.rows);
	precise float v = dgate[p.off_dgate + i] + g;
	dgate[p.off_dgate + i] = v;
}
