#version 450
// adamw_slab: adamw over a run of consecutive tensors of a parameter slab in one dispatch, where
// the model calls AdamW once per tensor (model.Shard.Apply): the tensors differ only in their
// decay — 1 for vectors, 1 − lr·weight_decay for tensors of 2+ dims (decoupled weight decay) — so
// segs lists, per tensor, where it ends (elements from the run's start, increasing, as uint bits)
// and whether it decays; invocation i finds its tensor by binary search and applies adamw.comp's
// arithmetic, in its order, with that tensor's decay: each element's update is adamw's bits. The
// same design as kernels/wgsl/adamw_slab.wgsl.

#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(push_constant) uniform Params {
	uint off_w;
	uint off_g;
	uint off_m;
	uint off_v;
	uint off_segs;
	uint n;
	uint nsegs;
	float decay;
	float step_size;
	float sqrt_bc2;
	float grad_scale;
} p;

layout(std430, set = 0, binding = 0) buffer Wb { float w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Gb { float g[]; };
layout(std430, set = 0, binding = 2) buffer Mb { float m[]; };
layout(std430, set = 0, binding = 3) buffer Vb { float v[]; };
// segs[2s] is where tensor s ends, segs[2s+1] is 1 if it decays (by p.decay), else 0 (by 1):
// uints stored as float bits.
layout(std430, set = 0, binding = 4) readonly buffer Sb { float segs[]; };

void main() {
	uint i = flat_index();
	if (i >= p.n) {
		return;
	}
	uint lo = 0u; // the first segment that ends after i
	uint hi = p.nsegs - 1u;
	while (lo < hi) {
		uint mid = (lo + hi) / 2u;
		if (floatBitsToUint(segs[p.off_segs + 2u * mid]) > i) {
			hi = mid;
		} else {
			lo = mid + 1u;
		}
	}
	float decay = floatBitsToUint(segs[p.off_segs + 2u * lo + 1u]) != 0u ? p.decay : 1.0;
	precise float gr = g[p.off_g + i] * p.grad_scale;
	precise float mj = 0.9 * m[p.off_m + i] + 0.1 * gr;
	precise float vj = 0.95 * v[p.off_v + i] + 0.05 * gr * gr;
	m[p.off_m + i] = mj;
	v[p.off_v + i] = vj;
	precise float denom = sqrt(vj) / p.sqrt_bc2 + 1e-8;
	precise float wn = w[p.off_w + i] * decay - p.step_size * mj / denom;
	w[p.off_w + i] = wn;
}
