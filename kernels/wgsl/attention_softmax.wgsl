// attention_softmax: the causal softmax of kernels.AttentionForward, in place on the scores
// S = Q·Kᵀ (B,H,T,T) that matmul left in att. Row t of each (batch, head) becomes
// softmax(scale·S[t, 0..t]) followed by exact zeros, as causalSoftmax does.
// Grid: one invocation per row (B·H·T rows); a row is at most T long, so a serial loop over it
// is cheaper than a workgroup reduction with its barriers.

struct Params {
	off_att: u32,
	rows: u32,
	t: u32,
	scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> att: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn attention_softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let q = r % p.t; // the query position: keys 0..q are visible
	let base = p.off_att + r * p.t;
	var mx = -3.4028234663852886e38;
	for (var j = 0u; j <= q; j++) {
		let v = att[base + j] * p.scale;
		att[base + j] = v;
		mx = max(mx, v);
	}
	var sum = 0.0;
	for (var j = 0u; j <= q; j++) {
		let e = exp(att[base + j] - mx);
		att[base + j] = e;
		sum += e;
	}
	let inv = 1.0 / sum;
	for (var j = 0u; j <= q; j++) {
		att[base + j] *= inv;
	}
	for (var j = q + 1u; j < p.t; j++) {
		att[base + j] = 0.0;
	}
}
