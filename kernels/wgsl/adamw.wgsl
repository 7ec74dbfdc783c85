// adamw: kernels.AdamW, one update of the parameters w in place with gradients g·grad_scale and
// moments m, v, in torch.optim.AdamW's order of operations (β₁ 0.9, β₂ 0.95, ε 1e-8 as in
// kernels.Beta1/Beta2/AdamEps). decay is 1 − lr·weight_decay, step_size lr/bc1, sqrt_bc2 √bc2.
// Grid: one invocation per element.

struct Params {
	off_w: u32,
	off_g: u32,
	off_m: u32,
	off_v: u32,
	n: u32,
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

@compute @workgroup_size(128, 1, 1)
fn adamw(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	let gr = g[p.off_g + i] * p.grad_scale;
	let mj = 0.9 * m[p.off_m + i] + 0.1 * gr;
	let vj = 0.95 * v[p.off_v + i] + 0.05 * gr * gr;
	m[p.off_m + i] = mj;
	v[p.off_v + i] = vj;
	let denom = sqrt(vj) / p.sqrt_bc2 + 1e-8;
	w[p.off_w + i] = w[p.off_w + i] * p.decay - p.step_size * mj / denom;
}
