// gate_grad: kernels.GateGrad. Column expert of dgate (N,E): Σ_c dout[r,c]·y[r,c] for the rows
// routed to the expert (mask[r,expert] ≠ 0), 0 for the others; the other columns are left as
// they are. Each routed row's dot is one float32 chain in c order, the Go reference's (a
// multiply-add may fuse: wasm/webgpu's tolGate).
// Grid: one invocation per row.

struct Params {
	off_dgate: u32,
	off_dout: u32,
	off_y: u32,
	off_mask: u32,
	rows: u32,
	c: u32,
	expert: u32,
	experts: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dgate: array<f32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<storage, read> y: array<f32>;
@group(0) @binding(4) var<storage, read> mask: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn gate_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let j = r * p.experts + p.expert;
	if (mask[p.off_mask + j] == 0.0) {
		dgate[p.off_dgate + j] = 0.0;
		return;
	}
	let d0 = p.off_dout + r * p.c;
	let y0 = p.off_y + r * p.c;
	var s = 0.0;
	for (var c = 0u; c < p.c; c++) {
		s += dout[d0 + c] * y[y0 + c];
	}
	dgate[p.off_dgate + j] = s;
}
