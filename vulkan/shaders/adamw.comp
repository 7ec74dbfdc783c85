#version 450
// adamw: one AdamW update per element, in torch.optim.AdamW's order as kernels.AdamW, over any
// number of elements in one dispatch (a shard's whole slab when the caller passes one). The
// square root is float32 here where Go takes it in float64; precise keeps the rest unfused.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_w;
	uint off_g;
	uint off_m;
	uint off_v;
	uint n;
	float decay;
	float step_size;
	float sqrt_bc2;
	float grad_scale;
} p;

layout(std430, set = 0, binding = 0) buffer Wb { float w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Gb { float g[]; };
layout(std430, set = 0, binding = 2) buffer Mb { float m[]; };
layout(std430, set = 0, binding = 3) buffer Vb { float v[]; };

void main() {
	uint i = flat_index();
	if (i >= p.n) {
		return;
	}
	precise float gr = g[p.off_g + i] * p.grad_scale;
	precise float mj = 0.9 * m[p.off_m + i] + 0.1 * gr;
	precise float vj = 0.95 * v[p.off_v + i] + 0.05 * gr * gr;
	m[p.off_m + i] = mj;
	v[p.off_v + i] = vj;
	precise float denom = sqrt(vj) / p.sqrt_bc2 + 1e-8;
	precise float wn = w[p.off_w + i] * p.decay - p.step_size * mj / denom;
	w[p.off_w + i] = wn;
}
