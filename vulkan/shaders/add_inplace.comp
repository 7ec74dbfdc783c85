#version 450
// add_inplace: dst += src element by element (Device.Add): one float32 add, as the Go loop.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_dst;
	uint off_src;
	uint n;
} p;

layout(std430, set = 0, binding = 0) buffer D { float dst[]; };
layout(std430, set = 0, binding = 1) readonly buffer S { float src[]; };

void main() {
	uint i = flat_index();
	if (i >= p.n) {
		return;
	}
	dst[p.off_dst + i] = dst[p.off_dst + i] + src[p.off_src + i];
}
