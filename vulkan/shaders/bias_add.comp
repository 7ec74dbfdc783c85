#version 450
// bias_add: out (N,C) += bias (C) on every row, the bias half of LinearForward; one add per
// element after the product, as kernels.LinearForward adds it.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_out;
	uint off_bias;
	uint rows;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer O { float outp[]; };
layout(std430, set = 0, binding = 1) readonly buffer Bi { float bias[]; };

void main() {
	uint i = flat_index();
	if (i >= p.rows * p.c) {
		return;
	}
	outp[p.off_out + i] = outp[p.off_out + i] + bias[p.off_bias + i % p.c];
}
