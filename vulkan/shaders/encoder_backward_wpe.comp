#version 450
// encoder_backward_wpe: dwpe (T,C) += Σ_b dout[b,t] in batch order, one invocation per element of
// dwpe. kernels.EncoderBackward adds the rows of each position in the same (batch) order, so this
// is its chain exactly, with T·C invocations working in parallel.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dwpe;
	uint off_dout;
	uint b;
	uint t;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer W { float dwpe[]; };
layout(std430, set = 0, binding = 1) readonly buffer D { float dout[]; };

void main() {
	uint i = flat_index();
	uint tc = p.t * p.c;
	if (i >= tc) {
		return;
	}
	float s = dwpe[p.off_dwpe + i];
	for (uint bb = 0u; bb < p.b; bb++) {
		s = s + dout[p.off_dout + bb * tc + i];
	}
	dwpe[p.off_dwpe + i] = s;
}
