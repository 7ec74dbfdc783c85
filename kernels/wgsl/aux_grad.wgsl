// aux_grad: kernels.AuxGrad. dgate (N,E) += scale·E·f_e/N on every row, f_e = stats[e]/(N·K)
// (the balancing loss's gradient with respect to the router probabilities; stats from
// moe_stats), in the Go reference's float32 order. The reference divides in float64 and rounds;
// WGSL's division is within 2.5 ulp (wasm/webgpu's tolAuxGrad).
// Grid: one invocation per element.

struct Params {
	off_dgate: u32,
	off_stats: u32,
	rows: u32,
	e: u32,
	k: u32,
	scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dgate: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn aux_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.rows * p.e) {
		return;
	}
	let f = stats[p.off_stats + i % p.e] / f32(p.rows * p.k);
	let g = p.scale * f32(p.e) * f / f32(p.rows);
	dgate[p.off_dgate + i] += g;
}
