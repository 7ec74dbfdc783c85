// layernorm_backward_input: the input half of kernels.LayerNormBackward, accumulating
// dinp += (w·dout − mean(w·dout) − n·mean(w·dout·n))·rstd per row, n the normalised input.
// Grid: one invocation per row. The parameter half (layernorm_backward_params) sums over rows
// and runs per column.

struct Params {
	off_dinp: u32,
	off_dout: u32,
	off_inp: u32,
	off_w: u32,
	off_mean: u32,
	off_rstd: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dinp: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<storage, read> inp: array<f32>;
@group(0) @binding(4) var<storage, read> w: array<f32>;
@group(0) @binding(5) var<storage, read> mean: array<f32>;
@group(0) @binding(6) var<storage, read> rstd: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn layernorm_backward_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let row = r * p.c;
	let m = mean[p.off_mean + r];
	let rs = rstd[p.off_rstd + r];
	var dm = 0.0;
	var dnm = 0.0;
	for (var i = 0u; i < p.c; i++) {
		let n = (inp[p.off_inp + row + i] - m) * rs;
		let g = w[p.off_w + i] * dout[p.off_dout + row + i];
		dm += g;
		dnm += g * n;
	}
	dm = dm / f32(p.c);
	dnm = dnm / f32(p.c);
	for (var i = 0u; i < p.c; i++) {
		let n = (inp[p.off_inp + row + i] - m) * rs;
		let j = p.off_dinp + row + i;
		dinp[j] += (w[p.off_w + i] * dout[p.off_dout + row + i] - dm - n * dnm) * rs;
	}
}
