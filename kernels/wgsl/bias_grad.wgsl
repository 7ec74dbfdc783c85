// bias_grad: the first pass of the bias half of kernels.LinearBackward, db (C) += Σ_rows dout
// (N,C). The rows are cut into fixed chunks of COL_CHUNK rows (the last may be short); invocation
// (chunk, col) sums its chunk's rows of column col in row order into partials[chunk·C + col].
// colsum_tree then adds each column's chunk sums in a fixed pairwise tree and the result to db.
// The split depends on N alone, so the sum is the same bits run after run (no atomics), but it is
// not the Go reference's row-order chain: wasm/webgpu's tolColSum says by how much it may differ.
// A column of N rows is N·C-parallel work in N/COL_CHUNK·C invocations instead of C: a GPU has
// thousands of lanes and C is a few hundred.
// Grid: one invocation per (chunk, column), consecutive invocations on consecutive columns so
// that their loads of a row coalesce.

struct Params {
	off_partials: u32,
	off_dout: u32,
	rows: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> partials: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;

const COL_CHUNK: u32 = 32u; // wgsl.ColumnChunk

@compute @workgroup_size(128, 1, 1)
fn bias_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let e = flat_index(wid, nwg, lid);
	let chunks = (p.rows + COL_CHUNK - 1u) / COL_CHUNK;
	if (e >= chunks * p.c) {
		return;
	}
	let chunk = e / p.c;
	let col = e % p.c;
	let hi = min(p.rows, (chunk + 1u) * COL_CHUNK);
	var s = 0.0;
	for (var r = chunk * COL_CHUNK; r < hi; r++) {
		s += dout[p.off_dout + r * p.c + col];
	}
	partials[p.off_partials + e] = s;
}
