package devcheck

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/shoal-ml/shoal/model"
)

// Device is a device under check: the model's ops, squared norms, and the matrix products its
// layers are built from (each as kernels.MatMulNN, MatMulNT, MatMulTN).
type Device interface {
	model.NormDevice
	MatMulNN(c, a, b model.Buf, m, k, n int, acc bool)
	MatMulNT(c, a, b model.Buf, m, k, n int, acc bool)
	MatMulTN(c, a, b model.Buf, m, k, n int, acc bool)
}

// Primitives are kernels that a device builds its ops from and exposes on their own (WebGPU's):
// a device that has them is checked on them too.
type Primitives interface {
	AddOut(out, a, b model.Buf) // out = a + b, element by element; out may be a
	Fill(dst model.Buf, v float32)
	BiasAdd(out, bias model.Buf, N, C int) // out[r, :] += bias
	BiasGrad(db, dout model.Buf, N, C int) // db += Σ_r dout[r, :]
	// GELUBackwardInPlace is GELUBackward with dinp = dout, as kernels.GELUBackward allows.
	GELUBackwardInPlace(dinout, inp, th model.Buf)
}

// Variants is a device with more than one implementation of some kernels (WebGPU's GPU and
// fallback-adapter variants): each case of those kernels runs on every variant, so that no
// variant the device could pick goes unchecked.
type Variants interface {
	// Variants returns the names of the variants that the case of kernel (a Result.Kernel) runs
	// on, or nil when there is one.
	Variants(kernel string) []string
	// UseVariant makes the ops recorded from now on run the named variant until restore.
	UseVariant(name string) (restore func())
}

// GridLimiter is a device that spreads workgroups over a 2-D grid when one dimension would exceed
// its limit. LimitGrid lowers that limit to groups until restore, so that small tensors take the
// 2-D path; flat is the elements one workgroup of an elementwise kernel covers, sumSq those of one
// chunk of the sum of squares.
type GridLimiter interface {
	LimitGrid(groups int) (flat, sumSq int, restore func())
}

// Options configures Run.
type Options struct {
	// Seed makes the random inputs; each case draws from its own stream of (Seed, case index).
	Seed uint64
	// Perturb moves every element of one input of each case by ±1% of that input's RMS
	// (alternating in sign; for a scalar parameter the value by 1%, for cross-entropy each target
	// to the next class), on the device's side only. Every case must then fail.
	Perturb bool
	// Only, when not empty, runs only the cases of the kernels it names (Result.Kernel values).
	Only []string
	// Twice runs each case a second time from the same inputs and adds a result that holds the
	// device to the same bits.
	Twice bool
}

// Result is the comparison of one output of one case with the Go reference.
type Result struct {
	Kernel string `json:"kernel"`
	Shape  string `json:"shape"`
	Output string `json:"output"`
	// RelErr is ‖got − ref‖₂ / ‖ref‖₂ (‖got − ref‖₂ when the reference is all zeros). Where the
	// output is the small difference of larger float32 terms (cross-entropy), the denominator
	// is the larger terms' norm when that is bigger: see TolSoftmax.
	RelErr float64 `json:"rel_err"`
	MaxAbs float64 `json:"max_abs"` // max |got − ref|
	Tol    float64 `json:"tol"`     // the largest RelErr that passes
	Pass   bool    `json:"pass"`
	// Note says what failed besides the error: a device error, a panic, a write outside the view.
	Note string `json:"note,omitempty"`
}

// Case names a case: its kernel and its shape (with the variant, where the device has several).
func (r Result) Case() string { return r.Kernel + " " + r.Shape }

// Run runs every case on d and returns one result per output compared.
func Run(d Device, o Options) []Result {
	var out []Result
	only := map[string]bool{}
	for _, k := range o.Only {
		only[k] = true
	}
	vd, _ := d.(Variants)
	for i, c := range cases() {
		if len(only) > 0 && !only[c.kernel] {
			continue
		}
		if c.needs != nil && !c.needs(d) {
			continue
		}
		variants := []string{""}
		if vd != nil {
			if vs := vd.Variants(c.kernel); len(vs) > 0 {
				variants = vs
			}
		}
		for _, variant := range variants {
			shape := c.shape
			restore := func() {}
			if variant != "" {
				shape += " " + variant
				restore = vd.UseVariant(variant)
			}
			first := runCase(d, c, shape, o.Seed, uint64(i), o.Perturb)
			out = append(out, first.results...)
			if o.Twice {
				again := runCase(d, c, shape, o.Seed, uint64(i), o.Perturb)
				out = append(out, sameBits(first, again))
			}
			restore()
		}
	}
	return out
}

func runCase(d Device, c validationCase, shape string, seed, i uint64, perturb bool) *vcase {
	v := &vcase{
		d: d, rng: rand.New(rand.NewPCG(seed, i)), perturb: perturb,
		kernel: c.kernel, shape: shape, where: map[model.Buf]placed{}, sentinels: map[model.Buf][]bool{},
	}
	v.run(c.fn)
	return v
}

// sameBits compares the outputs of two runs of a case bit for bit.
func sameBits(first, again *vcase) Result {
	r := Result{Kernel: first.kernel, Shape: first.shape, Output: "run 2 vs run 1, bit for bit", Tol: 0, Pass: true}
	if len(first.outs) != len(again.outs) {
		r.Pass, r.RelErr, r.Note = false, math.Inf(1), fmt.Sprintf("%d outputs, then %d", len(first.outs), len(again.outs))
		return r
	}
	var dd, rr float64
	for j, a := range first.outs {
		b := again.outs[j]
		for k := range a {
			if math.Float64bits(a[k]) != math.Float64bits(b[k]) {
				r.Pass = false
			}
			e := b[k] - a[k]
			dd += e * e
			rr += a[k] * a[k]
			r.MaxAbs = math.Max(r.MaxAbs, math.Abs(e))
		}
	}
	r.RelErr = relErr(dd, rr)
	if !r.Pass && r.RelErr == 0 {
		r.RelErr = math.SmallestNonzeroFloat64 // different NaNs, or -0 for 0: still not the same bits
	}
	return r
}

type validationCase struct {
	kernel, shape string
	// needs, when set, reports whether d can run the case (an optional interface).
	needs func(d Device) bool
	fn    func(v *vcase)
}

// vcase is one case being run: its random stream, its buffers, and its results.
type vcase struct {
	d             Device
	rng           *rand.Rand
	perturb       bool
	kernel, shape string
	where         map[model.Buf]placed
	sentinels     map[model.Buf][]bool // per buffer the case allocated, the elements that must stay sentinel
	results       []Result
	outs          [][]float64 // every output compared, as the device gave it (for Options.Twice)
}

// placed is where a view lies in the buffer the case made for it.
type placed struct {
	root model.Buf
	off  int
}

// sentinel fills the elements around every view; an op that writes outside its view changes
// them.
const sentinel = -7777.25

func (v *vcase) run(fn func(v *vcase)) {
	defer func() {
		if r := recover(); r != nil {
			v.results = append(v.results, Result{Kernel: v.kernel, Shape: v.shape, Output: "-", Note: fmt.Sprint("panic: ", r)})
		}
		for root := range v.sentinels {
			v.d.Free(root)
		}
	}()
	fn(v)
	if err := v.d.Err(); err != nil {
		v.results = append(v.results, Result{Kernel: v.kernel, Shape: v.shape, Output: "device", Note: err.Error()})
	}
}

// randn returns n random values of either sign with magnitudes scale·(0.25 + |N(0,1)|):
// normal-like, but never near zero, so that no case hinges on a draw too small to matter —
// Perturb needs every input of a case to move its outputs.
func (v *vcase) randn(n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		m := 0.25 + math.Abs(v.rng.NormFloat64())
		if v.rng.IntN(2) == 0 {
			m = -m
		}
		x[i] = float32(m * scale)
	}
	return x
}

// pack uploads xs as views of one buffer, in order, each after a gap of sentinels of random
// length (so views start at odd, unaligned offsets), with sentinels after the last one too.
func (v *vcase) pack(xs ...[]float32) []model.Buf {
	var buf []float32
	var mask []bool
	offs := make([]int, len(xs))
	gap := func() {
		for g := 1 + 2*v.rng.IntN(34); g > 0; g-- {
			buf = append(buf, sentinel)
			mask = append(mask, true)
		}
	}
	for i, x := range xs {
		gap()
		offs[i] = len(buf)
		buf = append(buf, x...)
		mask = append(mask, make([]bool, len(x))...)
	}
	gap()
	root := v.d.Alloc(len(buf))
	v.d.Write(root, buf)
	v.sentinels[root] = mask
	ts := make([]model.Buf, len(xs))
	for i, x := range xs {
		ts[i] = v.d.Slice(root, offs[i], len(x))
		v.where[ts[i]] = placed{root, offs[i]}
	}
	return ts
}

// in uploads x as a view at a random odd offset inside a larger buffer.
func (v *vcase) in(x []float32) model.Buf { return v.pack(x)[0] }

// perturbed returns x, or with Perturb a copy of x with every element moved by 1% of x's RMS,
// up and down alternately: for the one input of a case that Perturb changes. A shift of fixed
// size (rather than a random one, or a scaling) moves every output the case checks, whatever
// the values drawn: the two logits of a softmax of width 2 move apart, a single element moves
// by 1% of itself.
func (v *vcase) perturbed(x []float32) []float32 {
	if !v.perturb {
		return x
	}
	var ss float64
	for _, e := range x {
		ss += float64(e) * float64(e)
	}
	step := float32(0.01 * math.Sqrt(ss/float64(max(len(x), 1))))
	y := make([]float32, len(x))
	for i, e := range x {
		if i%2 == 0 {
			y[i] = e + step
		} else {
			y[i] = e - step
		}
	}
	return y
}

// perturbedAway is perturbed for a sum of squares: every element moves 1% of the RMS away from
// zero, so that the sum grows by at least 1e-4 of itself, where alternating shifts could cancel.
func (v *vcase) perturbedAway(x []float32) []float32 {
	y := v.perturbed(x)
	if !v.perturb {
		return y
	}
	for i := range y {
		if d := y[i] - x[i]; (d < 0) != (x[i] < 0) {
			y[i] = x[i] - d
		}
	}
	return y
}

// primary uploads the input that Perturb perturbs.
func (v *vcase) primary(x []float32) model.Buf { return v.in(v.perturbed(x)) }

// scalar is primary for an op whose only input is a parameter.
func (v *vcase) scalar(x float32) float32 {
	if v.perturb {
		return x * 1.01
	}
	return x
}

// primaryTargets is primary for the class targets of a cross-entropy (ids below V): Perturb
// moves each to the next class. A shift of the logits would not do: where the softmax
// saturates, its gradient barely moves.
func (v *vcase) primaryTargets(x []int32, V int) model.Buf {
	if !v.perturb {
		return v.ints(x)
	}
	y := make([]int32, len(x))
	for i, e := range x {
		y[i] = (e + 1) % int32(V)
	}
	return v.ints(y)
}

func (v *vcase) ints(x []int32) model.Buf {
	pre := 1 + 2*v.rng.IntN(34)
	buf := make([]int32, pre+len(x)+3)
	copy(buf[pre:], x)
	root := v.d.AllocInt32(len(buf))
	v.d.WriteInt32(root, buf)
	v.sentinels[root] = nil
	return v.d.Slice(root, pre, len(x))
}

// cp returns a copy, for references that work in place.
func cp(x []float32) []float32 { return append([]float32(nil), x...) }

// read returns the view t and reports whether every sentinel of its buffer is intact.
func (v *vcase) read(t model.Buf) ([]float32, bool, error) {
	p, ok := v.where[t]
	if !ok {
		x := make([]float32, t.Len())
		v.d.Read(x, t)
		return x, true, v.d.Err()
	}
	all := make([]float32, len(v.sentinels[p.root]))
	v.d.Read(all, p.root)
	if err := v.d.Err(); err != nil {
		return nil, false, err
	}
	intact := true
	for i, s := range v.sentinels[p.root] {
		if s && all[i] != sentinel {
			intact = false
		}
	}
	return all[p.off : p.off+t.Len()], intact, nil
}

// record keeps what the device gave for an output, for Options.Twice.
func (v *vcase) record(got []float32) {
	x := make([]float64, len(got))
	for i, e := range got {
		x[i] = float64(e)
	}
	v.outs = append(v.outs, x)
}

// expect compares the output view t with the reference want.
func (v *vcase) expect(name string, t model.Buf, want []float32, tol float64) {
	v.expectFloor(name, t, want, 0, tol)
}

// expectFloor is expect with the error relative to max(‖want‖, floor).
func (v *vcase) expectFloor(name string, t model.Buf, want []float32, floor, tol float64) {
	got, intact, err := v.read(t)
	v.compareOutput(name, got, intact, err, want, floor, tol)
}

// compareOutput adds the result of comparing got (read from the device: err, and whether the
// elements around it were intact) with want.
func (v *vcase) compareOutput(name string, got []float32, intact bool, err error, want []float32, floor, tol float64) {
	r := Result{Kernel: v.kernel, Shape: v.shape, Output: name, Tol: tol}
	switch {
	case err != nil:
		r.Note = err.Error()
	default:
		v.record(got)
		r.RelErr, r.MaxAbs = compare(got, want, floor)
		r.Pass = r.RelErr <= tol
		if !intact {
			r.Pass = false
			r.Note = "wrote outside its view"
		}
	}
	v.results = append(v.results, r)
}

// expectStep compares the change of t from its start w0 with the reference's (want − w0): for an
// update whose size is far below the values it updates (AdamW's weights).
func (v *vcase) expectStep(name string, t model.Buf, w0, want []float32, tol float64) {
	got, intact, err := v.read(t)
	var dg, dw []float32
	if err == nil {
		dg, dw = make([]float32, len(w0)), make([]float32, len(w0))
		for i := range w0 {
			dg[i], dw[i] = got[i]-w0[i], want[i]-w0[i]
		}
	}
	v.compareOutput(name, dg, intact, err, dw, 0, tol)
}

// expectValues is expectFloor for values the device returns on the host (a mean loss, norms).
func (v *vcase) expectValues(name string, got []float64, want []float64, floor, tol float64) {
	r := Result{Kernel: v.kernel, Shape: v.shape, Output: name, Tol: tol}
	if err := v.d.Err(); err != nil {
		r.Note = err.Error()
	} else {
		v.outs = append(v.outs, append([]float64(nil), got...))
		var dd, rr float64
		for i := range want {
			e := got[i] - want[i]
			dd += e * e
			rr += want[i] * want[i]
			r.MaxAbs = math.Max(r.MaxAbs, math.Abs(e))
		}
		r.RelErr = relErr(dd, max(rr, floor*floor))
		if math.IsNaN(r.RelErr) {
			r.RelErr, r.MaxAbs = math.Inf(1), math.Inf(1)
		}
		r.Pass = r.RelErr <= tol
	}
	v.results = append(v.results, r)
}

// compare returns ‖got − want‖/max(‖want‖, floor) and max |got − want|, in float64. A NaN or an
// infinity in got makes the error infinite, so it never passes.
func compare(got, want []float32, floor float64) (rel, maxAbs float64) {
	if len(got) != len(want) {
		return math.Inf(1), math.Inf(1)
	}
	var dd, rr float64
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		if math.IsNaN(g) || math.IsInf(g, 0) {
			return math.Inf(1), math.Inf(1)
		}
		e := g - w
		dd += e * e
		rr += w * w
		maxAbs = math.Max(maxAbs, math.Abs(e))
	}
	return relErr(dd, max(rr, floor*floor)), maxAbs
}

func relErr(dd, rr float64) float64 {
	if rr == 0 {
		return math.Sqrt(dd)
	}
	return math.Sqrt(dd / rr)
}

// RelErr is ‖got − want‖/‖want‖ in float64 (‖got − want‖ when want is all zeros; infinite when
// got holds a NaN or an infinity): the measure of every comparison of this package, for checks
// that compose ops (a stage's outputs, an optimizer's run).
func RelErr(got, want []float32) float64 {
	rel, _ := compare(got, want, 0)
	return rel
}
