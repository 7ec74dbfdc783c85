// layernorm_forward: kernels.LayerNormForward. out (N,C) = (inp − mean)·rstd·w + b per row,
// keeping mean and rstd (N) for backward. The Go reference accumulates the statistics in float64;
// WGSL has no f64, so the mean and the variance are two float32 passes (the second over
// centred values, which keeps the variance from cancelling).
// Grid: one invocation per row.

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
fn layernorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let x0 = p.off_inp + r * p.c;
	let cf = f32(p.c);
	var s = 0.0;
	for (var i = 0u; i < p.c; i++) {
		s += inp[x0 + i];
	}
	let m = s / cf;
	var vs = 0.0;
	for (var i = 0u; i < p.c; i++) {
		let d = inp[x0 + i] - m;
		vs += d * d;
	}
	let rs = 1.0 / sqrt(vs / cf + 1e-5);
	let o0 = p.off_out + r * p.c;
	for (var i = 0u; i < p.c; i++) {
		out[o0 + i] = ((inp[x0 + i] - m) * rs) * w[p.off_w + i] + b[p.off_b + i];
	}
	mean[p.off_mean + r] = m;
	rstd[p.off_rstd + r] = rs;
}
