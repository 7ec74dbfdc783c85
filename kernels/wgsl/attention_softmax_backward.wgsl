// attention_softmax_backward: the softmax step of kernels.AttentionBackward, in place on
// dP = dO·Vᵀ (B,H,T,T): dS = P∘(dP − rowsum(P∘dP))·scale on the causal part, exact zeros above.
// Grid: LANES invocations per row (Rows, B·H·T rows: a workgroup each on a GPU), the row sum by reduce.wgsl's fixed tree.

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
fn attention_softmax_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let q = r % p.t;
	let bd = p.off_ds + r * p.t;
	let bp = p.off_att + r * p.t;
	var dot = 0.0;
	for (var j = lane; live && j <= q; j += LANES) {
		dot += att[bp + j] * ds[bd + j];
	}
	dot = row_sum(dot, li);
	for (var j = lane; live && j <= q; j += LANES) {
		ds[bd + j] = att[bp + j] * (ds[bd + j] - dot) * p.scale;
	}
	for (var j = q + 1u + lane; live && j < p.t; j += LANES) {
		ds[bd + j] = 0.0;
	}
}
