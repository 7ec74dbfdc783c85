// bias_add: out (N,C) += bias (C) on every row, the bias half of kernels.LinearForward.
// Grid: one invocation per element.

struct Params {
	off_out: u32,
	off_bias: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn bias_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let e = flat_index(wid, nwg, lid);
	if (e >= p.rows * p.c) {
		return;
	}
	out[p.off_out + e] += bias[p.off_bias + e % p.c];
}
