#version 450
// gate_rows: dst (N,C) = gate[r,e]·src (N,C) row by row, or dst += that with acc, as
// kernels.GateRows: one invocation per element, one multiply (and one add), precise so that the
// compiler does not fuse them where Go does not.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dst;
	uint off_src;
	uint off_gate;
	uint rows;
	uint c;
	uint experts;
	uint e;
	uint acc;
} p;

layout(std430, set = 0, binding = 0) buffer D { float dst[]; };
layout(std430, set = 0, binding = 1) readonly buffer S { float src[]; };
layout(std430, set = 0, binding = 2) readonly buffer G { float gate[]; };

void main() {
	uint i = flat_index();
	if (i >= p.rows * p.c) {
		return;
	}
	float w = gate[p.off_gate + (i / p.c) * p.experts + p.e];
	precise float v = w * src[p.off_src + i];
	if (p.acc != 0u) {
		v = dst[p.off_dst + i] + v;
	}
	dst[p.off_dst + i] = v;
}
