// layernorm_backward_params: the first pass of the parameter half of kernels.LayerNormBackward,
// db += Σ_rows dout and dw += Σ_rows (inp − mean)·rstd·dout. As bias_grad: invocation
// (chunk, col) sums the COL_CHUNK rows of its chunk in row order, dw's partial to
// partials[chunk·C + col] and db's to partials[(chunks + chunk)·C + col]; colsum_tree then adds
// each column's chunk sums in a fixed pairwise tree to dw and db. Deterministic, but not the Go
// reference's row-order chain (wasm/webgpu's tolLayerNorm covers it).
// Grid: one invocation per (chunk, column).

struct Params {
	off_partials: u32,
	off_dout: u32,
	off_inp: u32,
	off_mean: u32,
	off_rstd: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> partials: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<storage, read> inp: array<f32>;
@group(0) @binding(4) var<storage, read> mean: array<f32>;
@group(0) @binding(5) var<storage, read> rstd: array<f32>;

const COL_CHUNK: u32 = 32u; // wgsl.ColumnChunk

@compute @workgroup_size(128, 1, 1)
fn layernorm_backward_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let e = flat_index(wid, nwg, lid);
	let chunks = (p.rows + COL_CHUNK - 1u) / COL_CHUNK;
	if (e >= chunks * p.c) {
		return;
	}
	let chunk = e / p.c;
	let col = e % p.c;
	let hi = min(p.rows, (chunk + 1u) * COL_CHUNK);
	var sw = 0.0;
	var sb = 0.0;
	for (var r = chunk * COL_CHUNK; r < hi; r++) {
		let d = dout[p.off_dout + r * p.c + col];
		sb += d;
		sw += (inp[p.off_inp + r * p.c + col] - mean[p.off_mean + r]) * rstd[p.off_rstd + r] * d;
	}
	partials[p.off_partials + e] = sw;
	partials[p.off_partials + chunks * p.c + e] = sb;
}
