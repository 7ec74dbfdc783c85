//go:build js && wasm

package webgpu

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// TimeMatMul returns the wall time per product of reps products c (m×n) = a (m×k) · b (k×n) on
// random matrices, recorded back to back and timed until the last result has been read back
// (so the time includes submitting them and one read, as a step's would). One product is run
// and read first, untimed. It waits for the GPU (see the package doc).
func TimeMatMul(d *Device, m, k, n, reps int) (time.Duration, error) {
	if reps < 1 {
		return 0, fmt.Errorf("webgpu: TimeMatMul with %d repetitions", reps)
	}
	r := rand.New(rand.NewPCG(uint64(m), uint64(n)))
	rnd := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		return x
	}
	a, b, c := d.FromFloat32(rnd(m*k)), d.FromFloat32(rnd(k*n)), d.Zeros(m*n)
	defer func() { d.Release(a); d.Release(b); d.Release(c) }()
	out := make([]float32, m*n)
	d.MatMulNN(c, a, b, m, k, n, false)
	if err := d.ReadInto(out, c); err != nil {
		return 0, err
	}
	t0 := time.Now()
	for i := 0; i < reps; i++ {
		d.MatMulNN(c, a, b, m, k, n, false)
	}
	if err := d.ReadInto(out, c); err != nil {
		return 0, err
	}
	return time.Since(t0) / time.Duration(reps), nil
}

// MatMulGFLOPS measures the device's matmul throughput on a 256×256×256 product, in GFLOP/s:
// what a browser worker reports to the planner for its WebGPU backend. It takes about 0.5 s on
// SwiftShader and waits for the GPU (see the package doc).
func MatMulGFLOPS(d *Device) (float64, error) {
	const n, reps = 256, 8
	t, err := TimeMatMul(d, n, n, n, reps)
	if err != nil {
		return 0, err
	}
	return 2 * n * n * n / t.Seconds() / 1e9, nil
}
