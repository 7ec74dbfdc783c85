#version 450
// attention_softmax_backward: dS = P∘(dP − rowsum(P∘dP))·scale in place of dP, zeros above the
// diagonal, one workgroup per row of (B,H,T,T), as kernels.AttentionBackward. The row dot product
// goes through the fixed tree of reduce.glsl.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_ds;
	uint off_att;
	uint rows;
	uint t;
	float scale;
} p;

layout(std430, set = 0, binding = 0) buffer D { float ds[]; };
layout(std430, set = 0, binding = 1) readonly buffer A { float att[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint q = r % p.t;
	uint bd = p.off_ds + r * p.t;
	uint bp = p.off_att + r * p.t;
	float dot = 0.0;
	for (uint j = l; j <= q; j += WG) {
		dot += att[bp + j] * ds[bd + j];
	}
	dot = wg_sum(dot);
	for (uint j = l; j < p.t; j += WG) {
		precise float v = att[bp + j] * (ds[bd + j] - dot) * p.scale;
		ds[bd + j] = j <= q ? v : 0.0;
	}
}
