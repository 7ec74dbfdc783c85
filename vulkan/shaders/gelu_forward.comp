#version 450
// gelu_forward: out = GELU(inp) (tanh form) and th = the tanh, as kernels.GELUForward: the same
// polynomial and formula, unfused (precise), so only the division may differ from Go by an ulp.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_out;
	uint off_th;
	uint off_inp;
	uint n;
} p;

layout(std430, set = 0, binding = 0) buffer O { float outp[]; };
layout(std430, set = 0, binding = 1) buffer T { float th[]; };
layout(std430, set = 0, binding = 2) readonly buffer I { float inp[]; };

const float GELU_SCALE = 0.7978845608028654;

void main() {
	uint i = flat_index();
	if (i >= p.n) {
		return;
	}
	float x = inp[p.off_inp + i];
	precise float u = GELU_SCALE * (x + 0.044715 * x * x * x);
	float t = tanh32(u);
	th[p.off_th + i] = t;
	precise float o = 0.5 * x * (1.0 + t);
	outp[p.off_out + i] = o;
}
