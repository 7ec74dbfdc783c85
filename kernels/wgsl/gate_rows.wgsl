// gate_rows: kernels.GateRows. dst (N,C) = src (N,C) with each row r scaled by gate[r, expert]
// (gate is (N,E)), or dst += that with acc: the combination of an expert's outputs and its
// share of the output gradient (MoE's dense path). One multiply per element, as the Go reference;
// with acc the multiply and the add, which WGSL may fuse (wasm/webgpu's tolGate).
// Grid: one invocation per element.

struct Params {
	off_dst: u32,
	off_src: u32,
	off_gate: u32,
	rows: u32,
	c: u32,
	expert: u32,
	experts: u32,
	acc: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> src: array<f32>;
@group(0) @binding(3) var<storage, read> gate: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn gate_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.rows * p.c) {
		return;
	}
	let w = gate[p.off_gate + (i / p.c) * p.experts + p.expert];
	let v = w * src[p.off_src + i];
	if (p.acc != 0u) {
		dst[p.off_dst + i] += v;
	} else {
		dst[p.off_dst + i] = v;
	}
}
