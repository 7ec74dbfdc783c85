// adamw_slab: adamw over a run of consecutive tensors of a parameter slab in one dispatch, where
// the model calls kernels.AdamW once per tensor. The tensors differ only in their decay: 1 for
// vectors, 1 − lr·weight_decay for tensors of 2+ dims (decoupled weight decay, docs/design.md "A training step"), so
// segs lists, per tensor, where it ends (elements from the run's start, increasing) and whether
// it decays; invocation i finds its tensor by binary search and applies adamw's arithmetic, in
// adamw's order, with that tensor's decay. Each element's update is adamw's, so the results
// are its bits.
// Grid: one invocation per element of the run.

struct Params {
	off_w: u32,
	off_g: u32,
	off_m: u32,
	off_v: u32,
	off_segs: u32,
	n: u32,
	nsegs: u32,
	decay: f32,
	step_size: f32,
	sqrt_bc2: f32,
	grad_scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> w: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
// segs[2s] is where tensor s ends, segs[2s+1] is 1 if it decays (by p.decay), else 0 (by 1).
@group(0) @binding(5) var<storage, read> segs: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn adamw_slab(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	var lo = 0u; // the first segment that ends after i
	var hi = p.nsegs - 1u;
	while (lo < hi) {
		let mid = (lo + hi) / 2u;
		if (u32(segs[p.off_segs + 2u * mid]) > i) {
			hi = mid;
		} else {
			lo = mid + 1u;
		}
	}
	var decay = 1.0;
	if (segs[p.off_segs + 2u * lo + 1u] != 0) {
		decay = p.decay;
	}
	let gr = g[p.off_g + i] * p.grad_scale;
	let mj = 0.9 * m[p.off_m + i] + 0.1 * gr;
	let vj = 0.95 * v[p.off_v + i] + 0.05 * gr * gr;
	m[p.off_m + i] = mj;
	v[p.off_v + i] = vj;
	let denom = sqrt(vj) / p.sqrt_bc2 + 1e-8;
	w[p.off_w + i] = w[p.off_w + i] * decay - p.step_size * mj / denom;
}
