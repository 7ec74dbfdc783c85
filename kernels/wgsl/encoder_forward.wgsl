// encoder_forward: kernels.EncoderForward. out (B,T,C) = wte[inp] + wpe[t].
// Grid: one invocation per element of out.

struct Params {
	off_out: u32,
	off_inp: u32,
	off_wte: u32,
	off_wpe: u32,
	rows: u32,
	t: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> inp: array<i32>;
@group(0) @binding(3) var<storage, read> wte: array<f32>;
@group(0) @binding(4) var<storage, read> wpe: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn encoder_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let e = flat_index(wid, nwg, lid);
	if (e >= p.rows * p.c) {
		return;
	}
	let r = e / p.c;
	let i = e % p.c;
	let ix = u32(inp[p.off_inp + r]);
	out[p.off_out + e] = wte[p.off_wte + ix * p.c + i] + wpe[p.off_wpe + (r % p.t) * p.c + i];
}
