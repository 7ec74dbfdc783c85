// layernorm_backward_params: the parameter half of kernels.LayerNormBackward, accumulating
// db += Σ_rows dout and dw += Σ_rows (inp − mean)·rstd·dout. Grid: one invocation per column,
// which adds the rows in order — the order of the Go reference, so the sum never depends on how
// the rows were split across invocations.

struct Params {
	off_dw: u32,
	off_db: u32,
	off_dout: u32,
	off_inp: u32,
	off_mean: u32,
	off_rstd: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dw: array<f32>;
@group(0) @binding(2) var<storage, read_write> db: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<f32>;
@group(0) @binding(5) var<storage, read> mean: array<f32>;
@group(0) @binding(6) var<storage, read> rstd: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn layernorm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.c) {
		return;
	}
	var sw = dw[p.off_dw + i];
	var sb = db[p.off_db + i];
	for (var r = 0u; r < p.rows; r++) {
		let d = dout[p.off_dout + r * p.c + i];
		sb += d;
		sw += (inp[p.off_inp + r * p.c + i] - mean[p.off_mean + r]) * rstd[p.off_rstd + r] * d;
	}
	dw[p.off_dw + i] = sw;
	db[p.off_db + i] = sb;
}
