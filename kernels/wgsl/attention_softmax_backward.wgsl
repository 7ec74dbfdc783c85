// attention_softmax_backward: the softmax step of kernels.AttentionBackward, in place on
// dP = dO·Vᵀ (B,H,T,T): dS = P∘(dP − rowsum(P∘dP))·scale on the causal part, exact zeros above.
// Grid: one invocation per row (B·H·T rows).

struct Params {
	off_ds: u32,
	off_att: u32,
	rows: u32,
	t: u32,
	scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> ds: array<f32>;
@group(0) @binding(2) var<storage, read> att: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn attention_softmax_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let q = r % p.t;
	let bd = p.off_ds + r * p.t;
	let bp = p.off_att + r * p.t;
	var dot = 0.0;
	for (var j = 0u; j <= q; j++) {
		dot += att[bp + j] * ds[bd + j];
	}
	for (var j = 0u; j <= q; j++) {
		ds[bd + j] = att[bp + j] * (ds[bd + j] - dot) * p.scale;
	}
	for (var j = q + 1u; j < p.t; j++) {
		ds[bd + j] = 0.0;
	}
}
