#version 450
// gelu_backward: dinp = GELU'(inp)·dout from the forward's tanh, as kernels.GELUBackward
// (overwriting dinp), unfused like the Go loop.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dinp;
	uint off_inp;
	uint off_th;
	uint off_dout;
	uint n;
} p;

layout(std430, set = 0, binding = 0) buffer O { float dinp[]; };
layout(std430, set = 0, binding = 1) readonly buffer I { float inp[]; };
layout(std430, set = 0, binding = 2) readonly buffer T { float th[]; };
layout(std430, set = 0, binding = 3) readonly buffer D { float dout[]; };

const float GELU_SCALE = 0.7978845608028654;

void main() {
	uint i = flat_index();
	if (i >= p.n) {
		return;
	}
	float x = inp[p.off_inp + i];
	float t = th[p.off_th + i];
	precise float g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
	precise float r = g * dout[p.off_dout + i];
	dinp[p.off_dinp + i] = r;
}
