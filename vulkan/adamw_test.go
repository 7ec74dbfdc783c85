package vulkan

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/shoal-ml/shoal/internal/devcheck"
	"github.com/shoal-ml/shoal/internal/stagecheck"
	"github.com/shoal-ml/shoal/kernels"
)

// TestAdamWRun: a shard's update, one AdamW call per tensor over consecutive views of its slabs
// (decayed matrices and undecayed vectors), is dispatched once (adamw_slab) and gives each
// element what adamw gives it: against kernels.AdamW within devcheck.TolAdamW on the change from the start.
// A call over other memory, or any other op, ends the run first.
func TestAdamWRun(t *testing.T) {
	d := device(t)
	r := rand.New(rand.NewPCG(5, 6))
	sizes := []int{37, 5, 300, 1, 64}
	decays := []float32{0.99, 1, 0.99, 1, 0.99}
	n := 0
	for _, s := range sizes {
		n += s
	}
	host := [4][]float32{stagecheck.RandFloats(r, n, 1), stagecheck.RandFloats(r, n, 1e-2), stagecheck.RandFloats(r, n, 1e-3), make([]float32, n)}
	for i := range host[3] {
		host[3][i] = float32(r.Float64() * 1e-4) // v ≥ 0
	}
	var bufs [4]*buffer
	for k := range bufs {
		bufs[k] = d.Alloc(n).(*buffer)
		d.Write(bufs[k], host[k])
	}
	w0 := append([]float32(nil), host[0]...)
	const stepSize, gradScale = 1e-2 / 0.1, 0.8
	sqrtBC2 := math.Sqrt(0.05)
	before := d.adamDispatch
	off := 0
	for i, s := range sizes {
		d.AdamW(d.Slice(bufs[0], off, s), d.Slice(bufs[1], off, s), d.Slice(bufs[2], off, s), d.Slice(bufs[3], off, s),
			decays[i], stepSize, sqrtBC2, gradScale)
		kernels.AdamW(host[0][off:off+s], host[1][off:off+s], host[2][off:off+s], host[3][off:off+s],
			decays[i], stepSize, sqrtBC2, gradScale)
		off += s
	}
	got := make([]float32, n)
	d.Read(got, bufs[0])
	if k := d.adamDispatch - before; k != 1 {
		t.Errorf("%d AdamW dispatches for a run of %d tensors, want 1", k, len(sizes))
	}
	dg, dh := make([]float32, n), make([]float32, n)
	for i := range got {
		dg[i], dh[i] = got[i]-w0[i], host[0][i]-w0[i]
	}
	if e := devcheck.RelErr(dg, dh); !(e <= devcheck.TolAdamW) {
		t.Errorf("the run's update is %.3g from kernels.AdamW's (tolerance %g)", e, devcheck.TolAdamW)
	}
	// The moments too: m exactly as adamw computes it (one product and sum, unfused).
	gotM := make([]float32, n)
	d.Read(gotM, bufs[2])
	if e := devcheck.RelErr(gotM, host[2]); !(e <= devcheck.TolAdamW) {
		t.Errorf("the run's first moment is %.3g from kernels.AdamW's", e)
	}
	// A gap ends the run: two dispatches.
	before = d.adamDispatch
	d.AdamW(d.Slice(bufs[0], 0, 5), d.Slice(bufs[1], 0, 5), d.Slice(bufs[2], 0, 5), d.Slice(bufs[3], 0, 5), 1, stepSize, sqrtBC2, gradScale)
	d.AdamW(d.Slice(bufs[0], 10, 5), d.Slice(bufs[1], 10, 5), d.Slice(bufs[2], 10, 5), d.Slice(bufs[3], 10, 5), 1, stepSize, sqrtBC2, gradScale)
	d.Read(got[:1], d.Slice(bufs[0], 0, 1))
	if k := d.adamDispatch - before; k != 2 {
		t.Errorf("%d AdamW dispatches for two calls with a gap between, want 2", k)
	}
	for _, b := range bufs {
		d.Free(b)
	}
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
}
