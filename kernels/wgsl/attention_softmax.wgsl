// attention_softmax: the causal softmax of kernels.AttentionForward, in place on the scores
// S = Q·Kᵀ (B,H,T,T) that matmul left in att. Row t of each (batch, head) becomes
// softmax(scale·S[t, 0..t]) followed by exact zeros, as causalSoftmax does.
// Grid: LANES invocations per row (Rows, B·H·T rows: a workgroup each on a GPU), max and sum by reduce.wgsl's fixed trees. Each
// invocation rewrites only the elements it read, so no barrier guards the row in memory.

struct Params {
	off_att: u32,
	rows: u32,
	t: u32,
	scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> att: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn attention_softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let q = r % p.t; // the query position: keys 0..q are visible
	let base = p.off_att + r * p.t;
	var mx = -3.4028234663852886e38;
	for (var j = lane; live && j <= q; j += LANES) {
		let v = att[base + j] * p.scale;
		att[base + j] = v;
		mx = max(mx, v);
	}
	mx = row_max(mx, li);
	var sum = 0.0;
	for (var j = lane; live && j <= q; j += LANES) {
		let e = exp(att[base + j] - mx);
		att[base + j] = e;
		sum += e;
	}
	let inv = 1.0 / row_sum(sum, li);
	for (var j = lane; live && j <= q; j += LANES) {
		att[base + j] *= inv;
	}
	for (var j = q + 1u + lane; live && j < p.t; j += LANES) {
		att[base + j] = 0.0;
	}
}
