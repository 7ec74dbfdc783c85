#version 450
// encoder_backward_wte: dwte[inp[r]] += dout[r] for rows r in order, one invocation per channel.
// Rows with the same token add into the same row of dwte, so a split over rows would need either
// atomics (float atomics are neither portable nor deterministic) or a per-token gather; walking
// the rows in order per channel is the Go kernel's exact chain, with C invocations in flight. It
// runs once per step and reads N·C floats, a small part of the step.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dwte;
	uint off_dout;
	uint off_inp;
	uint rows;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer W { float dwte[]; };
layout(std430, set = 0, binding = 1) readonly buffer D { float dout[]; };
layout(std430, set = 0, binding = 2) readonly buffer I { int inp[]; };

void main() {
	uint i = flat_index();
	if (i >= p.c) {
		return;
	}
	for (uint r = 0u; r < p.rows; r++) {
		uint j = p.off_dwte + uint(inp[p.off_inp + r]) * p.c + i;
		dwte[j] = dwte[j] + dout[p.off_dout + r * p.c + i];
	}
}
