// add: out = a + b elementwise (the residual stream); out may be a or b.
// Grid: one invocation per element.

struct Params {
	off_out: u32,
	off_a: u32,
	off_b: u32,
	n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	out[p.off_out + i] = a[p.off_a + i] + b[p.off_b + i];
}
