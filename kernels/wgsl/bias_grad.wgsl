// bias_grad: db (C) += Σ_rows dout (N,C), the bias half of kernels.LinearBackward. One
// invocation per column adds the rows in order, the Go reference's order.

struct Params {
	off_db: u32,
	off_dout: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> db: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn bias_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.c) {
		return;
	}
	var s = db[p.off_db + i];
	for (var r = 0u; r < p.rows; r++) {
		s += dout[p.off_dout + r * p.c + i];
	}
	db[p.off_db + i] = s;
}
