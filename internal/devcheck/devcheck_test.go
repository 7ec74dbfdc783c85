package devcheck

import (
	"math"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
)

// host is model.Host as a Device, with the primitives: the reference itself, computed through
// buffers, views and sentinels as a device's results are. The suite must find it exact, and must
// fail every case of it when an input is perturbed: a check of the suite that needs no GPU.
type host struct{ model.Host }

var (
	_ Device     = host{}
	_ Primitives = host{}
)

func (h host) floats(b model.Buf) []float32 {
	x := make([]float32, b.Len())
	h.Read(x, b)
	return x
}

func (h host) matmul(f func(c, a, b []float32, m, k, n int, acc bool), c, a, b model.Buf, m, k, n int, acc bool) {
	hc := h.floats(c)
	f(hc, h.floats(a), h.floats(b), m, k, n, acc)
	h.Write(c, hc)
}

func (h host) MatMulNN(c, a, b model.Buf, m, k, n int, acc bool) {
	h.matmul(kernels.MatMulNN, c, a, b, m, k, n, acc)
}
func (h host) MatMulNT(c, a, b model.Buf, m, k, n int, acc bool) {
	h.matmul(kernels.MatMulNT, c, a, b, m, k, n, acc)
}
func (h host) MatMulTN(c, a, b model.Buf, m, k, n int, acc bool) {
	h.matmul(kernels.MatMulTN, c, a, b, m, k, n, acc)
}

func (h host) SquaredNorms(bufs []model.Buf) []float64 { return h.SquaredNormsWith(bufs, nil, nil) }

func (h host) SquaredNormsWith(bufs []model.Buf, also model.Buf, alsoDst []float32) []float64 {
	out := make([]float64, len(bufs))
	for i, b := range bufs {
		for _, x := range h.floats(b) {
			out[i] += float64(x) * float64(x)
		}
	}
	if also != nil {
		h.Read(alsoDst, also)
	}
	return out
}

func (h host) AddOut(out, a, b model.Buf) {
	ha, hb := h.floats(a), h.floats(b)
	for i := range ha {
		ha[i] += hb[i]
	}
	h.Write(out, ha)
}

func (h host) Fill(dst model.Buf, v float32) {
	x := make([]float32, dst.Len())
	for i := range x {
		x[i] = v
	}
	h.Write(dst, x)
}

func (h host) BiasAdd(out, bias model.Buf, N, C int) {
	ho, hb := h.floats(out), h.floats(bias)
	for r := range N {
		for i := range C {
			ho[r*C+i] += hb[i]
		}
	}
	h.Write(out, ho)
}

func (h host) BiasGrad(db, dout model.Buf, N, C int) {
	hdb, hd := h.floats(db), h.floats(dout)
	for r := range N {
		for i := range C {
			hdb[i] += hd[r*C+i]
		}
	}
	h.Write(db, hdb)
}

func (h host) GELUBackwardInPlace(dinout, inp, th model.Buf) {
	d := h.floats(dinout)
	kernels.GELUBackward(d, h.floats(inp), h.floats(th), d)
	h.Write(dinout, d)
}

// TestHost: the Go reference, run as a device, passes every case with no error at all.
func TestHost(t *testing.T) {
	res := Run(host{}, Options{Seed: 1})
	cases := map[string]bool{}
	for _, r := range res {
		cases[r.Case()] = true
		if !r.Pass || r.RelErr != 0 {
			t.Errorf("%s, %s: relative error %.3g (tolerance %.3g) %s", r.Case(), r.Output, r.RelErr, r.Tol, r.Note)
		}
	}
	if len(cases) < 300 {
		t.Errorf("%d cases ran", len(cases))
	}
	t.Logf("%d cases, %d outputs compared", len(cases), len(res))
}

// TestHostPerturbed: with one input of each case moved by 1% on the device's side, every case
// fails its comparison.
func TestHostPerturbed(t *testing.T) {
	all, failed := map[string]bool{}, map[string]bool{}
	for _, r := range Run(host{}, Options{Seed: 2, Perturb: true}) {
		all[r.Case()] = true
		if !r.Pass && r.Note == "" {
			failed[r.Case()] = true
		}
	}
	for c := range all {
		if !failed[c] {
			t.Errorf("%s: passes with a perturbed input", c)
		}
	}
}

// drifting is a host whose MatMulNN moves the first element of every other product by one ulp:
// within every tolerance, but not the same bits twice.
type drifting struct {
	host
	calls *int
}

func (d drifting) MatMulNN(c, a, b model.Buf, m, k, n int, acc bool) {
	d.host.MatMulNN(c, a, b, m, k, n, acc)
	if *d.calls++; *d.calls%2 == 0 {
		x := d.floats(c)
		x[0] = math.Nextafter32(x[0], float32(math.Inf(1)))
		d.Write(c, x)
	}
}

// TestTwice: Options.Twice finds a device that is within tolerance but not deterministic, and
// passes one that is.
func TestTwice(t *testing.T) {
	calls := 0
	var n, caught int
	for _, r := range Run(drifting{calls: &calls}, Options{Seed: 3, Only: []string{"MatMulNN"}, Twice: true}) {
		if r.Output != "run 2 vs run 1, bit for bit" {
			if !r.Pass {
				t.Errorf("%s, %s: relative error %.3g: one ulp must pass", r.Case(), r.Output, r.RelErr)
			}
			continue
		}
		n++
		if !r.Pass {
			caught++
		}
	}
	if n == 0 || caught != n {
		t.Errorf("Twice caught %d of %d cases that gave other bits the second time", caught, n)
	}
	for _, r := range Run(host{}, Options{Seed: 3, Only: []string{"MatMulNN", "LayerNormBackward"}, Twice: true}) {
		if !r.Pass {
			t.Errorf("%s, %s: the reference itself is not deterministic", r.Case(), r.Output)
		}
	}
}
