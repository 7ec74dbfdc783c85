// softmax_rows: kernels.SoftmaxRows, normalising each row of x (N,E) in place (the MoE router's
// probabilities). Grid: LANES invocations per row (Rows: a workgroup each on a GPU), max and sum by reduce.wgsl's fixed trees.
// Each invocation rewrites only the elements it read, so no barrier guards the row in memory.

struct Params {
	off_x: u32,
	rows: u32,
	e: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn softmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let rl = row_of(wid, nwg, li);
	let r = rl.x;
	let lane = rl.y;
	let live = r < p.rows; // a row past the end still takes part in the reductions
	let x0 = p.off_x + r * p.e;
	var mx = -3.4028234663852886e38;
	for (var i = lane; live && i < p.e; i += LANES) {
		mx = max(mx, x[x0 + i]);
	}
	mx = row_max(mx, li);
	var s = 0.0;
	for (var i = lane; live && i < p.e; i += LANES) {
		let e = exp(x[x0 + i] - mx);
		x[x0 + i] = e;
		s += e;
	}
	let inv = 1.0 / row_sum(s, li);
	for (var i = lane; live && i < p.e; i += LANES) {
		x[x0 + i] *= inv;
	}
}
