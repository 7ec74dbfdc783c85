// softmax_rows: kernels.SoftmaxRows, normalising each row of x (N,E) in place (the MoE router's
// probabilities). Grid: one invocation per row.

struct Params {
	off_x: u32,
	rows: u32,
	e: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn softmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let x0 = p.off_x + r * p.e;
	var mx = x[x0];
	for (var i = 1u; i < p.e; i++) {
		mx = max(mx, x[x0 + i]);
	}
	var s = 0.0;
	for (var i = 0u; i < p.e; i++) {
		let e = exp(x[x0 + i] - mx);
		x[x0 + i] = e;
		s += e;
	}
	let inv = 1.0 / s;
	for (var i = 0u; i < p.e; i++) {
		x[x0 + i] *= inv;
	}
}
