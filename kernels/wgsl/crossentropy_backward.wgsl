// crossentropy_backward: kernels.CrossEntropyBackward. Turns logits (N,V) into their gradient
// in place: scale·(softmax − onehot(target))/N. Grid: LANES invocations per row (Rows: a workgroup each on a GPU), max and sum
// by reduce.wgsl's fixed trees. The invocation that writes the target's element also subtracts
// k from it, after rounding exp·k, as the Go reference does in two steps.

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
fn crossentropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
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
	let k = p.scale / f32(p.rows);
	let t = u32(targets[p.off_targets + min(r, p.rows - 1u)]); // used by live rows only
	for (var i = lane; live && i < p.v; i += LANES) {
		var g = exp(logits[l0 + i] - lse) * k;
		if (i == t) {
			g -= k;
		}
		logits[l0 + i] = g;
	}
}
