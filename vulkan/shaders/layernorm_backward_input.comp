#version 450
// layernorm_backward_input: dinp (N,C) += the input gradient of LayerNorm, one workgroup per row;
// the row sums of w·dout and w·dout·n go through the fixed tree of reduce.glsl (float32, where
// Go sums in float64).

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dinp;
	uint off_dout;
	uint off_inp;
	uint off_w;
	uint off_mean;
	uint off_rstd;
	uint rows;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer DI { float dinp[]; };
layout(std430, set = 0, binding = 1) readonly buffer DO { float dout[]; };
layout(std430, set = 0, binding = 2) readonly buffer I { float inp[]; };
layout(std430, set = 0, binding = 3) readonly buffer Wt { float w[]; };
layout(std430, set = 0, binding = 4) readonly buffer Mn { float mean[]; };
layout(std430, set = 0, binding = 5) readonly buffer Rs { float rstd[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint row = r * p.c;
	float m = mean[p.off_mean + r];
	float rs = rstd[p.off_rstd + r];
	float dm = 0.0;
	float dnm = 0.0;
	for (uint i = l; i < p.c; i += WG) {
		precise float n = (inp[p.off_inp + row + i] - m) * rs;
		precise float g = w[p.off_w + i] * dout[p.off_dout + row + i];
		dm += g;
		dnm += g * n;
	}
	float dmf = wg_sum(dm) / float(p.c);
	float dnmf = wg_sum(dnm) / float(p.c);
	for (uint i = l; i < p.c; i += WG) {
		precise float n = (inp[p.off_inp + row + i] - m) * rs;
		uint j = p.off_dinp + row + i;
		precise float d = dinp[j] + (w[p.off_w + i] * dout[p.off_dout + row + i] - dmf - n * dnmf) * rs;
		dinp[j] = d;
	}
}
