// layernorm_backward_input: the input half of kernels.LayerNormBackward, accumulating
// dinp += (w·dout − mean(w·dout) − n·mean(w·dout·n))·rstd per row, n the normalised input.
// Grid: LANES invocations per row (Rows: a workgroup each on a GPU); the two row means are reduce.wgsl's fixed trees (Go sums
// them in float64). The parameter half (layernorm_backward_params, colsum_tree) sums over rows.

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
fn layernorm_backward_input(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let row = r * p.c;
	let rr = min(r, p.rows - 1u); // a dead row reads a live one's statistics, and uses nothing
	let m = mean[p.off_mean + rr];
	let rs = rstd[p.off_rstd + rr];
	var dm = 0.0;
	var dnm = 0.0;
	for (var i = lane; live && i < p.c; i += LANES) {
		let n = (inp[p.off_inp + row + i] - m) * rs;
		let g = w[p.off_w + i] * dout[p.off_dout + row + i];
		dm += g;
		dnm += g * n;
	}
	dm = row_sum(dm, li) / f32(p.c);
	dnm = row_sum(dnm, li) / f32(p.c);
	for (var i = lane; live && i < p.c; i += LANES) {
		let n = (inp[p.off_inp + row + i] - m) * rs;
		let j = p.off_dinp + row + i;
		dinp[j] += (w[p.off_w + i] * dout[p.off_dout + row + i] - dm - n * dnm) * rs;
	}
}
