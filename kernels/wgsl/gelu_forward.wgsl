// gelu_forward: kernels.GELUForward. out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), keeping
// the tanh in th for backward. Grid: one invocation per element.

struct Params {
	off_out: u32,
	off_th: u32,
	off_inp: u32,
	n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read_write> th: array<f32>;
@group(0) @binding(3) var<storage, read> inp: array<f32>;

const GELU_SCALE: f32 = 0.7978845608028654; // √(2/π)

@compute @workgroup_size(128, 1, 1)
fn gelu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	let x = inp[p.off_inp + i];
	let t = tanh32(GELU_SCALE * (x + 0.044715 * x * x * x));
	th[p.off_th + i] = t;
	out[p.off_out + i] = 0.5 * x * (1.0 + t);
}
