#version 450
// encoder_forward: out (B,T,C) = wte[inp] + wpe[t], one add per element as in the Go kernel.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_out;
	uint off_inp;
	uint off_wte;
	uint off_wpe;
	uint rows;
	uint t;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer O { float outp[]; };
layout(std430, set = 0, binding = 1) readonly buffer I { int inp[]; };
layout(std430, set = 0, binding = 2) readonly buffer E { float wte[]; };
layout(std430, set = 0, binding = 3) readonly buffer P { float wpe[]; };

void main() {
	uint i = flat_index();
	if (i >= p.rows * p.c) {
		return;
	}
	uint r = i / p.c;
	uint ch = i % p.c;
	uint ix = uint(inp[p.off_inp + r]);
	outp[p.off_out + i] = wte[p.off_wte + ix * p.c + ch] + wpe[p.off_wpe + (r % p.t) * p.c + ch];
}
