// Included by every kernel of package vulkan (GL_GOOGLE_include_directive): the launch helpers
// and kernels.Tanh32.

// WG is the workgroup size of every kernel but matmul (128): 256 invocations, a multiple of every
// GPU's SIMD width (32 on NVIDIA, 64 on AMD). Vulkan guarantees only 128 invocations per
// workgroup; every desktop GPU, Apple's and lavapipe allow 1024, and Open refuses a device that
// allows fewer than 256.
#define WG 256u

// group_index is the workgroup's index in a 1-D launch that the host spread over a 2-D grid,
// because a dimension holds at most 65535 workgroups (the minimum maxComputeWorkGroupCount) and a
// tensor of 16.8 M elements, or attention's B·H·T rows, already needs more.
uint group_index() {
	return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
}

// flat_index is one invocation's index in such a launch.
uint flat_index() {
	return group_index() * WG + gl_LocalInvocationID.x;
}

// tanh32 is kernels.Tanh32 (Eigen's generic_fast_tanh_float): the same rational polynomial in
// the same order, so GELU agrees with the Go reference to an ulp or so whatever the driver's own
// tanh does. precise keeps the compiler from fusing the multiply-adds, as the Go code (and its
// vector loop) does not fuse them.
float tanh32(float x0) {
	float x = clamp(x0, -7.90531110763549805, 7.90531110763549805);
	if (abs(x) < 0.0004) {
		return x;
	}
	precise float x2 = x * x;
	precise float p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13;
	p = p * x2 + -8.60467152213735e-11;
	p = p * x2 + 5.12229709037114e-08;
	p = p * x2 + 1.48572235717979e-05;
	p = p * x2 + 6.37261928875436e-04;
	p = p * x2 + 4.89352455891786e-03;
	p = p * x;
	precise float q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04;
	q = q * x2 + 2.26843463243900e-03;
	q = q * x2 + 4.89352518554385e-03;
	return p / q;
}
