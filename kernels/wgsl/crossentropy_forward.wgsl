// crossentropy_forward: the per-row half of kernels.CrossEntropyForward. losses[r] =
// logsumexp(logits[r]) − logits[r, target[r]] for each of N rows; the host reads the N losses back
// and sums them in float64 in row order, as the Go reference does, so only the per-row values
// are float32. Grid: one invocation per row.

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
fn crossentropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let l0 = p.off_logits + r * p.v;
	var mx = logits[l0];
	for (var i = 1u; i < p.v; i++) {
		mx = max(mx, logits[l0 + i]);
	}
	var s = 0.0;
	for (var i = 0u; i < p.v; i++) {
		s += exp(logits[l0 + i] - mx);
	}
	let lse = mx + log(s);
	losses[p.off_losses + r] = lse - logits[l0 + u32(targets[p.off_targets + r])];
}
