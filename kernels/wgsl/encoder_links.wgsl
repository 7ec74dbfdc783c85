// encoder_links: the first pass of encoder_backward. For each row r of the B·T token ids it
// writes links[2r] = the next row after r with the same token (−1 if none) and links[2r+1] = 1
// if r is the first row with its token, else 0. encoder_backward then walks each token's rows
// as a list, in row order, without atomics and without a pass per token.
// Grid: one invocation per row; each scans the ids (O(N) int compares per row, O(N²) in all:
// 67 M for N = 8192, some hundred microseconds on a GPU, and reads of one small int buffer that
// every invocation of a workgroup shares).

struct Params {
	off_links: u32,
	off_inp: u32,
	rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> links: array<i32>;
@group(0) @binding(2) var<storage, read> inp: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn encoder_links(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let tok = inp[p.off_inp + r];
	var first = 1;
	for (var q = 0u; q < r; q++) {
		if (inp[p.off_inp + q] == tok) {
			first = 0;
			break;
		}
	}
	var next = -1;
	for (var q = r + 1u; q < p.rows; q++) {
		if (inp[p.off_inp + q] == tok) {
			next = i32(q);
			break;
		}
	}
	links[p.off_links + 2u * r] = next;
	links[p.off_links + 2u * r + 1u] = first;
}
