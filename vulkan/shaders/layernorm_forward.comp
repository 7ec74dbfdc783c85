#version 450
// layernorm_forward: one workgroup per row of inp (N,C). Mean, then variance over the centred
// values (two passes, as the Go kernel), each a strided partial per invocation combined by the
// fixed tree of reduce.glsl; the statistics are float32 where Go keeps them in float64.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_out;
	uint off_mean;
	uint off_rstd;
	uint off_inp;
	uint off_w;
	uint off_b;
	uint rows;
	uint c;
} p;

layout(std430, set = 0, binding = 0) buffer O { float outp[]; };
layout(std430, set = 0, binding = 1) buffer Mn { float mean[]; };
layout(std430, set = 0, binding = 2) buffer Rs { float rstd[]; };
layout(std430, set = 0, binding = 3) readonly buffer I { float inp[]; };
layout(std430, set = 0, binding = 4) readonly buffer Wt { float w[]; };
layout(std430, set = 0, binding = 5) readonly buffer Bs { float b[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return; // uniform over the workgroup
	}
	uint l = gl_LocalInvocationID.x;
	uint x0 = p.off_inp + r * p.c;
	float cf = float(p.c);
	float s = 0.0;
	for (uint i = l; i < p.c; i += WG) {
		s += inp[x0 + i];
	}
	float m = wg_sum(s) / cf;
	float vs = 0.0;
	for (uint i = l; i < p.c; i += WG) {
		float d = inp[x0 + i] - m;
		vs += d * d;
	}
	float rs = 1.0 / sqrt(wg_sum(vs) / cf + 1e-5);
	uint o0 = p.off_out + r * p.c;
	for (uint i = l; i < p.c; i += WG) {
		precise float o = ((inp[x0 + i] - m) * rs) * w[p.off_w + i] + b[p.off_b + i];
		outp[o0 + i] = o;
	}
	if (l == 0u) {
		mean[p.off_mean + r] = m;
		rstd[p.off_rstd + r] = rs;
	}
}
