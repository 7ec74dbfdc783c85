package vulkan

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// result is the comparison of one output of one case with the Go reference.
type result struct {
	output string
	rel    float64 // ‖vulkan − host‖/‖host‖ (see tensor.norm)
	tol    float64
	note   string // a write outside the view, a device error
}

func (r result) pass() bool { return r.note == "" && r.rel <= r.tol }

// sentinel fills the elements around every view, which no op may change.
const sentinel = float32(-1234.5)

// run runs c on Host and on d, every device tensor a view at an odd offset inside a larger
// buffer; with perturb, the tensor c.perturb is moved by ±1% of its RMS on the device side only.
// It returns one result per output and the device's outputs (for the determinism test).
func run(d *Device, c vcase, perturb bool) ([]result, [][]float32) {
	// The reference.
	h := model.Host{}
	hb := make([]model.Buf, len(c.tensors))
	for i, t := range c.tensors {
		if t.i != nil {
			hb[i] = h.AllocInt32(len(t.i))
			h.WriteInt32(hb[i], t.i)
		} else {
			hb[i] = h.Alloc(len(t.f))
			h.Write(hb[i], t.f)
		}
	}
	wantS := c.op(h, hb)

	// The device, at offsets 3, 4, 5, … into buffers with 5 sentinels after.
	type placed struct {
		parent model.Buf
		pre, n int
	}
	ps := make([]placed, len(c.tensors))
	db := make([]model.Buf, len(c.tensors))
	for i, t := range c.tensors {
		pre := 3 + i
		if t.i != nil {
			n := len(t.i)
			full := make([]int32, pre+n+5)
			copy(full[pre:], t.i)
			p := d.AllocInt32(len(full))
			d.WriteInt32(p, full)
			ps[i], db[i] = placed{p, pre, n}, d.Slice(p, pre, n)
			continue
		}
		n := len(t.f)
		full := make([]float32, pre+n+5)
		for j := range full {
			full[j] = sentinel
		}
		copy(full[pre:], t.f)
		if perturb && i == c.perturb {
			var ss float64
			for _, v := range t.f {
				ss += float64(v) * float64(v)
			}
			rms := float32(math.Sqrt(ss / float64(max(n, 1))))
			for j := range n {
				full[pre+j] += float32(1-2*(j%2)) * 0.01 * rms
			}
		}
		p := d.Alloc(len(full))
		d.Write(p, full)
		ps[i], db[i] = placed{p, pre, n}, d.Slice(p, pre, n)
	}
	gotS := c.op(d, db)

	var res []result
	var outs [][]float32
	for i, t := range c.tensors {
		if t.i != nil {
			d.Free(ps[i].parent)
			continue
		}
		full := make([]float32, ps[i].pre+ps[i].n+5)
		d.Read(full, ps[i].parent)
		d.Free(ps[i].parent)
		if !t.out {
			continue
		}
		got := full[ps[i].pre : ps[i].pre+ps[i].n]
		want := make([]float32, len(t.f))
		h.Read(want, hb[i])
		r := result{output: fmt.Sprintf("tensor %d", i), tol: c.tol}
		for j, v := range full {
			if (j < ps[i].pre || j >= ps[i].pre+ps[i].n) && v != sentinel {
				r.note = fmt.Sprintf("element %d outside the view changed to %v", j, v)
				break
			}
		}
		if t.step {
			for j := range got {
				got[j] -= t.f[j]
				want[j] -= t.f[j]
			}
		}
		r.rel = relErr(got, want, t.norm)
		res = append(res, r)
		outs = append(outs, slices.Clone(got))
	}
	if wantS != nil {
		var d2, w2 float64
		for j := range wantS {
			d2 += (gotS[j] - wantS[j]) * (gotS[j] - wantS[j])
			w2 += wantS[j] * wantS[j]
		}
		res = append(res, result{output: "host value", rel: math.Sqrt(d2 / max(w2, 1e-300)), tol: c.tol})
		s := make([]float32, len(gotS))
		for j, v := range gotS {
			s[j] = float32(v)
			s = append(s, float32(v-float64(float32(v)))) // every bit of the float64
		}
		outs = append(outs, s)
	}
	if err := d.Err(); err != nil {
		res = append(res, result{output: "device", note: err.Error()})
	}
	return res, outs
}

// relErr is ‖got − want‖/max(‖want‖, floor) in float64 (‖got − want‖ when both are zero).
func relErr(got, want []float32, floor float64) float64 {
	var d, w float64
	for i := range want {
		e := float64(got[i]) - float64(want[i])
		d += e * e
		w += float64(want[i]) * float64(want[i])
	}
	w = max(math.Sqrt(w), floor)
	if w == 0 {
		return math.Sqrt(d)
	}
	if math.IsNaN(d) {
		return math.Inf(1)
	}
	return math.Sqrt(d) / w
}

// TestOps checks every op against its Go reference (model.Host, package kernels) within the
// tolerance table of ops_test.go, that no op writes outside its views, and logs the worst error
// of each kernel.
func TestOps(t *testing.T) {
	d := device(t)
	t.Logf("seed %d (-vulkan.seed)", *seed)
	for _, c := range cases(rand.New(rand.NewPCG(*seed, 1))) {
		res, _ := run(d, c, false)
		for _, r := range res {
			if !r.pass() {
				t.Errorf("%s, %s: relative error %.3g, tolerance %.3g %s", c.name, r.output, r.rel, r.tol, r.note)
			} else if testing.Verbose() {
				t.Logf("%-50s %-10s rel %.3g (tol %.3g)", c.name, r.output, r.rel, r.tol)
			}
		}
	}
}

// TestOpsPerturbed shows that every comparison of TestOps can fail, and that each tolerance is
// far below the effect of a 1% error in one input: with one input of each case moved by ±1% of
// its RMS on the device side, every case must fail.
func TestOpsPerturbed(t *testing.T) {
	d := device(t)
	for _, c := range cases(rand.New(rand.NewPCG(*seed, 1))) {
		res, _ := run(d, c, true)
		failed := false
		for _, r := range res {
			failed = failed || !r.pass()
		}
		if !failed {
			t.Errorf("%s: passes with input %d perturbed by 1%%: its comparison cannot fail", c.name, c.perturb)
		}
	}
}

// TestDeterminism runs every case twice: the device's outputs must be the same bits, since
// every reduction has a fixed order and nothing uses atomics.
func TestDeterminism(t *testing.T) {
	d := device(t)
	var first [][][]float32
	for pass := range 2 {
		for i, c := range cases(rand.New(rand.NewPCG(*seed, 2))) {
			_, outs := run(d, c, false)
			if pass == 0 {
				first = append(first, outs)
				continue
			}
			for j := range outs {
				for k := range outs[j] {
					if math.Float32bits(outs[j][k]) != math.Float32bits(first[i][j][k]) {
						t.Fatalf("%s: output %d element %d: %v, then %v", c.name, j, k, first[i][j][k], outs[j][k])
					}
				}
			}
		}
	}
}
