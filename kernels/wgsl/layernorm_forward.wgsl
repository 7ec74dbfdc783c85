// layernorm_forward: kernels.LayerNormForward. out (N,C) = (inp − mean)·rstd·w + b per row,
// keeping mean and rstd (N) for backward. The Go reference accumulates the statistics in float64;
// WGSL has no f64, so the mean and the variance are two float32 passes (the second over
// centred values, which keeps the variance from cancelling), each summed by reduce.wgsl's fixed
// tree.
// Grid: LANES invocations per row (Rows: a workgroup each on a GPU, whose 128 invocations read
// the row's consecutive elements together, coalesced, and sum it in log₂ 128 barrier steps
// rather than C serial adds).

struct Params {
	off_out: u32,
	off_mean: u32,
	off_rstd: u32,
	off_inp: u32,
	off_w: u32,
	off_b: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read_write> mean: array<f32>;
@group(0) @binding(3) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<f32>;
@group(0) @binding(5) var<storage, read> w: array<f32>;
@group(0) @binding(6) var<storage, read> b: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn layernorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let x0 = p.off_inp + r * p.c;
	let cf = f32(p.c);
	var s = 0.0;
	for (var i = lane; live && i < p.c; i += LANES) {
		s += inp[x0 + i];
	}
	let m = row_sum(s, li) / cf;
	var vs = 0.0;
	for (var i = lane; live && i < p.c; i += LANES) {
		let d = inp[x0 + i] - m;
		vs += d * d;
	}
	let rs = 1.0 / sqrt(row_sum(vs, li) / cf + 1e-5);
	let o0 = p.off_out + r * p.c;
	for (var i = lane; live && i < p.c; i += LANES) {
		out[o0 + i] = ((inp[x0 + i] - m) * rs) * w[p.off_w + i] + b[p.off_b + i];
	}
	if (live && lane == 0u) {
		mean[p.off_mean + r] = m;
		rstd[p.off_rstd + r] = rs;
	}
}
