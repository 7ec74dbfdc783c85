// colsum_tree: the second pass of the column sums over rows (bias_grad, layernorm_backward_params):
// dst[col] += the chunk sums partials[chunk·C + col], combined in a fixed pairwise tree
// — neighbours first (0+1, 2+3, …), then pairs of pairs, an odd one out carried up unchanged —
// computed in place in partials. The tree depends on the number of chunks alone, so the result
// does too: the same bits run after run, whatever the launch. dst is added last, once, as the
// old value of an accumulated gradient.
// Grid: one invocation per column (consecutive columns, coalesced loads).

struct Params {
	off_dst: u32,
	off_partials: u32,
	chunks: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn colsum_tree(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let col = flat_index(wid, nwg, lid);
	if (col >= p.c) {
		return;
	}
	let base = p.off_partials + col;
	for (var w = 1u; w < p.chunks; w *= 2u) {
		for (var i = 0u; i + w < p.chunks; i += 2u * w) {
			partials[base + i * p.c] += partials[base + (i + w) * p.c];
		}
	}
	dst[p.off_dst + col] += partials[base];
}
