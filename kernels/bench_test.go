package kernels

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
)

// BenchmarkGEMMSmall is BenchmarkGEMM on shapes small enough for the pure-Go kernel at one
// thread, native and under wasm (scripts/bench.sh compares the two); BenchmarkGEMM's 1024³ takes
// seconds per call there. Names follow BenchmarkGEMM:
// BenchmarkGEMMSmall/<layout>/<isa>/<shape>/threads=<n>, e.g.
// -bench 'GEMMSmall/NN/purego/256x256x256/threads=1'.
func BenchmarkGEMMSmall(b *testing.B) {
	shapes := [][3]int{{256, 256, 256}, {512, 256, 512}}
	threads := []int{1}
	if p := runtime.GOMAXPROCS(0); p > 1 {
		threads = append(threads, p)
	}
	old := ISA()
	defer SetISA(old)
	// Under node, V8 runs wasm in a baseline compiler first and swaps in optimised code only once
	// a function has run a while; without this warm-up the first row measured ~25% slow.
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
	for _, l := range layouts {
		for _, name := range ISAs() {
			for _, s := range shapes {
				m, k, n := s[0], s[1], s[2]
				for _, th := range threads {
					b.Run(fmt.Sprintf("%s/%s/%dx%dx%d/threads=%d", l.name, name, m, k, n, th), func(b *testing.B) {
						SetISA(name)
						withThreads(th, func() {
							r := rand.New(rand.NewPCG(1, 1))
							x, y, c := randMat(r, m*k), randMat(r, k*n), make([]float32, m*n)
							for b.Loop() {
								l.fn(c, x, y, m, k, n, false)
							}
							b.ReportMetric(2*float64(m*k*n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
						})
					})
				}
			}
		}
	}
}
