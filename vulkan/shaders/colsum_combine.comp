#version 450
// colsum_combine: dst (C) = Σ_chunk part[chunk] (C each), chunks in order: the second pass of
// colsum_partial and layernorm_params_partial (whose chunk 0 already holds the old dst). The
// order is fixed by the shape, so the sum is the same bits on every run.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dst;
	uint off_part;
	uint c;
	uint chunks;
} p;

layout(std430, set = 0, binding = 0) buffer D { float dst[]; };
layout(std430, set = 0, binding = 1) readonly buffer P { float part[]; };

void main() {
	uint i = flat_index();
	if (i >= p.c) {
		return;
	}
	float s = part[p.off_part + i];
	for (uint ch = 1u; ch < p.chunks; ch++) {
		s += part[p.off_part + ch * p.c + i];
	}
	dst[p.off_dst + i] = s;
}
