package kernels

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkGEMMSmall is BenchmarkGEMM on shapes small enough for the pure-Go kernel at one
// thread, native and under wasm (scripts/bench.sh compares the two); BenchmarkGEMM's 1024³ takes
// seconds per call there. Names follow BenchmarkGEMM:
// BenchmarkGEMMSmall/<layout>/<isa>/<shape>/threads=<n>, e.g.
// -bench 'GEMMSmall/NN/purego/256x256x256/threads=1'.
func BenchmarkGEMMSmall(b *testing.B) {
	// Under node, V8 runs wasm in a baseline compiler first and swaps in optimised code only once
	// a function has run a while; without this warm-up the first row measured ~25% slow.
	old := ISA()
	r := rand.New(rand.NewPCG(1, 1))
	x, y, c := randMat(r, 256*256), randMat(r, 256*256), make([]float32, 256*256)
	for _, name := range ISAs() {
		SetISA(name)
		for _, l := range layouts {
			for range 10 {
				l.fn(c, x, y, 256, 256, 256, false)
			}
		}
	}
	SetISA(old)
	benchGEMM(b, [][3]int{{256, 256, 256}, {512, 256, 512}})
}
