//go:build !purego

package kernels

// CPU feature detection, done here rather than through golang.org/x/sys/cpu so that kernels
// stays free of dependencies. It follows internal/cpu: an instruction set counts only when the
// CPU reports it (CPUID) and the OS saves its registers on context switch (XGETBV's XCR0).

func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)

func xgetbv() (eax, edx uint32)

// cpuFeatures reports which of the vector instruction sets the kernels use are usable.
func cpuFeatures() (hasAVX2FMA, hasAVX512 bool) {
	maxID, _, _, _ := cpuid(0, 0)
	if maxID < 7 {
		return false, false
	}
	_, _, ecx1, _ := cpuid(1, 0)
	const (
		fma     = 1 << 12
		osxsave = 1 << 27
		avx     = 1 << 28
	)
	if ecx1&(fma|osxsave|avx) != fma|osxsave|avx {
		return false, false
	}
	xcr0, _ := xgetbv()
	// XCR0 bits 1 and 2: the OS saves SSE and AVX (upper YMM) state.
	if xcr0&0b110 != 0b110 {
		return false, false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	const (
		avx2    = 1 << 5
		avx512f = 1 << 16
	)
	hasAVX2FMA = ebx7&avx2 != 0
	// XCR0 bits 5, 6, 7: opmask registers, upper halves of Z0–Z15, and Z16–Z31. On darwin these
	// start clear until a process first uses AVX-512, so there we simply stay on AVX2.
	hasAVX512 = hasAVX2FMA && ebx7&avx512f != 0 && xcr0&0b1110_0000 == 0b1110_0000
	return hasAVX2FMA, hasAVX512
}
