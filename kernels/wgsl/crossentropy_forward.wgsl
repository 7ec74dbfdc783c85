// crossentropy_forward: the per-row half of kernels.CrossEntropyForward. losses[r] =
// logsumexp(logits[r]) − logits[r, target[r]] for each of N rows; the host reads the N losses back
// and sums them in float64 in row order, as the Go reference does, so only the per-row values
// are float32. Grid: LANES invocations per row (Rows: a workgroup each on a GPU, since a row is V
// wide, 50257 for GPT-2's vocabulary, far too long for one invocation); max and sum by
// reduce.wgsl's fixed trees.

struct Params {
	off_losses: u32,
	off_logits: u32,
	off_targets: u32,
	rows: u32,
	v: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> losses: array<f32>;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
@group(0) @binding(3) var<storage, read> targets: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn crossentropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let l0 = p.off_logits + r * p.v;
	var mx = -3.4028234663852886e38;
	for (var i = lane; live && i < p.v; i += LANES) {
		mx = max(mx, logits[l0 + i]);
	}
	mx = row_max(mx, li);
	var s = 0.0;
	for (var i = lane; live && i < p.v; i += LANES) {
		s += exp(logits[l0 + i] - mx);
	}
	let lse = mx + log(row_sum(s, li));
	if (live && lane == 0u) {
		losses[p.off_losses + r] = lse - logits[l0 + u32(targets[p.off_targets + r])];
	}
}
