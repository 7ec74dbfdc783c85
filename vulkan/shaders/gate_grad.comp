#version 450
// gate_grad: column e of dgate (N,E) = Σ_c dout[r,c]·y[r,c] for the rows routed to expert e
// (mask[r,e] ≠ 0), 0 for the others, as kernels.GateGrad; the other columns are left as they
// are. One workgroup per row, as the other row reductions: C is the model's width, so one
// invocation per row would leave most of a GPU idle and read each row with a stride; here the
// row is read coalesced and its strided partials go through the fixed tree of reduce.glsl
// (Go's chain is in c order, so the rounding differs: tolGateGrad).

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dgate;
	uint off_dout;
	uint off_y;
	uint off_mask;
	uint rows;
	uint c;
	uint experts;
	uint e;
} p;

layout(std430, set = 0, binding = 0) buffer DG { float dgate[]; };
layout(std430, set = 0, binding = 1) readonly buffer DO { float dout[]; };
layout(std430, set = 0, binding = 2) readonly buffer Y { float y[]; };
layout(std430, set = 0, binding = 3) readonly buffer M { float mask[]; };

void main() {
	uint r = group_index();
	if (r >= p.rows) {
		return;
	}
	uint l = gl_LocalInvocationID.x;
	uint j = r * p.experts + p.e;
	if (mask[p.off_mask + j] == 0.0) { // the same for the whole workgroup: no barrier is skipped by some only
		if (l == 0u) {
			dgate[p.off_dgate + j] = 0.0;
		}
		return;
	}
	uint d0 = p.off_dout + r * p.c;
	uint y0 = p.off_y + r * p.c;
	float s = 0.0;
	for (uint c = l; c < p.c; c += WG) {
		s += dout[d0 + c] * y[y0 + c];
	}
	s = wg_sum(s);
	if (l == 0u) {
		dgate[p.off_dgate + j] = s;
	}
}
