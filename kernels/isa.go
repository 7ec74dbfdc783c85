package kernels

import (
	"fmt"
	"os"
	"sync/atomic"
)

// Instruction sets the GEMM kernels can run on. Each has its own micro-kernels; results are
// deterministic within one ISA (see doc.go). AVX2 and AVX512 agree with each other bit for bit
// (both run one fused multiply-add chain per element); PureGo rounds the product before the
// add, so it differs from them by float32 rounding and agrees with itself on every GOARCH,
// wasm included.
const (
	PureGo = "purego"
	AVX2   = "avx2"
	AVX512 = "avx512"
)

// EnvKernels names the environment variable that forces an instruction set at start-up, e.g.
// SHOAL_KERNELS=purego to reproduce a browser worker's CPU fallback on a native machine.
const EnvKernels = "SHOAL_KERNELS"

// isa is the instruction set the public multiplies use. It is process-wide, like GOMAXPROCS,
// because it describes the machine rather than a caller; tests switch it with SetISA.
var isa atomic.Pointer[gemmImpl]

// impls holds every instruction set this CPU and build can run, best last.
var impls = availableImpls()

func init() {
	best := impls[len(impls)-1]
	isa.Store(best)
	if name := os.Getenv(EnvKernels); name != "" {
		if err := SetISA(name); err != nil {
			// An unusable override must not stop a worker: say so and keep the best one.
			fmt.Fprintf(os.Stderr, "kernels: %v; using %s\n", err, best.name)
		}
	}
}

// ISA reports the instruction set the multiplies currently use.
func ISA() string { return isa.Load().name }

// ISAs lists the instruction sets usable on this CPU and build, slowest first.
func ISAs() []string {
	names := make([]string, len(impls))
	for i, im := range impls {
		names[i] = im.name
	}
	return names
}

// SetISA makes the multiplies use the named instruction set (PureGo, AVX2 or AVX512). It fails,
// changing nothing, when this CPU or build cannot run it.
func SetISA(name string) error {
	for _, im := range impls {
		if im.name == name {
			isa.Store(im)
			return nil
		}
	}
	return fmt.Errorf("instruction set %q is not usable here (usable: %v)", name, ISAs())
}
