//go:build !purego

package kernels

import "golang.org/x/sys/cpu"

// cpuFeatures reports which of the vector instruction sets the kernels use are usable: the CPU
// reports them and the OS saves their registers on a context switch (x/sys/cpu checks XCR0, and
// on darwin, where AVX-512 state is enabled lazily, asks the kernel).
func cpuFeatures() (hasAVX2FMA, hasAVX512 bool) {
	hasAVX2FMA = cpu.X86.HasAVX2 && cpu.X86.HasFMA
	hasAVX512 = hasAVX2FMA && cpu.X86.HasAVX512F
	return hasAVX2FMA, hasAVX512
}
