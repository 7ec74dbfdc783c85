// softmax_backward_rows: kernels.SoftmaxBackwardRows. dx (N,E) = probs·(dprobs − Σ_e probs·dprobs)
// for each row of the softmax output probs and its gradient dprobs (the MoE router's backward).
// E is small (the experts), so an invocation takes a whole row: the sum is one float32 chain in
// e order, the Go reference's (a multiply-add may fuse: wasm/webgpu's tolGate).
// Grid: one invocation per row.

struct Params {
	off_dx: u32,
	off_probs: u32,
	off_dprobs: u32,
	rows: u32,
	e: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dx: array<f32>;
@group(0) @binding(2) var<storage, read> probs: array<f32>;
@group(0) @binding(3) var<storage, read> dprobs: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn softmax_backward_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let o = r * p.e;
	var s = 0.0;
	for (var i = 0u; i < p.e; i++) {
		s += probs[p.off_probs + o + i] * dprobs[p.off_dprobs + o + i];
	}
	for (var i = 0u; i < p.e; i++) {
		dx[p.off_dx + o + i] = probs[p.off_probs + o + i] * (dprobs[p.off_dprobs + o + i] - s);
	}
}
