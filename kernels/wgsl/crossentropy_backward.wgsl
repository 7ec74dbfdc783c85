// crossentropy_backward: kernels.CrossEntropyBackward. Turns logits (N,V) into their gradient
// in place: scale·(softmax − onehot(target))/N. Grid: one invocation per row.

struct Params {
	off_logits: u32,
	off_targets: u32,
	rows: u32,
	v: u32,
	scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn crossentropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
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
	let k = p.scale / f32(p.rows);
	for (var i = 0u; i < p.v; i++) {
		logits[l0 + i] = exp(logits[l0 + i] - lse) * k;
	}
	let t = l0 + u32(targets[p.off_targets + r]);
	logits[t] -= k;
}
