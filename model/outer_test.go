package model

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func outerParams(vals ...[]float32) *Params {
	p := NewParams([]Spec{{"a", []int{2}}, {"b", []int{1}}})
	for i, t := range p.Tensors {
		copy(t.Data, vals[i])
	}
	return p
}

func near(a, b float32) bool { return math.Abs(float64(a-b)) <= 1e-6*math.Max(1, math.Abs(float64(b))) }

// The outer step against a hand-computed case: two replicas, momentum carried over two rounds.
func TestOuterStepByHand(t *testing.T) {
	g := outerParams([]float32{1, 2}, []float32{-1})
	r1 := outerParams([]float32{0.5, 2.5}, []float32{-1})
	r2 := outerParams([]float32{1.5, 1}, []float32{0})
	o := NewOuter(g.Specs(), 0.5, 0.5, false)
	o.V.Tensors[0].Data[0] = 0.2
	if err := o.Step(g, []*Params{r1, r2}, nil); err != nil {
		t.Fatal(err)
	}
	// Δ1 = (0.5, −0.5, 0), Δ2 = (−0.5, 1, −1): Δ = (0, 0.25, −0.5).
	// v = 0.5·(0.2, 0, 0) + Δ = (0.1, 0.25, −0.5); θ −= 0.5·(Δ + 0.5·v) = 0.5·(0.05, 0.375, −0.75).
	wantV := []float32{0.1, 0.25, -0.5}
	wantG := []float32{0.975, 1.8125, -0.625}
	check := func(round int, wantG, wantV []float32) {
		t.Helper()
		i := 0
		for ti, gt := range g.Tensors {
			for k := range gt.Data {
				if got, want := gt.Data[k], wantG[i]; !near(got, want) {
					t.Errorf("round %d: θ[%d] = %v, want %v", round, i, got, want)
				}
				if got, want := o.V.Tensors[ti].Data[k], wantV[i]; !near(got, want) {
					t.Errorf("round %d: v[%d] = %v, want %v", round, i, got, want)
				}
				for _, r := range []*Params{r1, r2} {
					if r.Tensors[ti].Data[k] != gt.Data[k] {
						t.Errorf("round %d: a replica's θ[%d] = %v, not the global %v", round, i, r.Tensors[ti].Data[k], gt.Data[k])
					}
				}
				i++
			}
		}
	}
	check(1, wantG, wantV)

	// Round 2: both replicas moved by (−0.1, 0, +0.2) and (−0.3, 0, 0): Δ = (0.2, 0, −0.1).
	for _, c := range []struct {
		r *Params
		d []float32
	}{{r1, []float32{-0.1, 0, 0.2}}, {r2, []float32{-0.3, 0, 0}}} {
		c.r.Tensors[0].Data[0] += c.d[0]
		c.r.Tensors[1].Data[0] += c.d[2]
	}
	if err := o.Step(g, []*Params{r1, r2}, nil); err != nil {
		t.Fatal(err)
	}
	// v = 0.5·(0.1, 0.25, −0.5) + (0.2, 0, −0.1) = (0.25, 0.125, −0.35);
	// θ −= 0.5·(Δ + 0.5·v) = 0.5·(0.325, 0.0625, −0.275).
	check(2, []float32{0.975 - 0.1625, 1.8125 - 0.03125, -0.625 + 0.1375}, []float32{0.25, 0.125, -0.35})
}

// A replica left out of a round changes nothing of it: the average is over the participants, and
// the absent replica keeps its own θ.
func TestOuterParticipants(t *testing.T) {
	g := outerParams([]float32{1, 2}, []float32{-1})
	r1 := outerParams([]float32{0, 2}, []float32{-1})
	r2 := outerParams([]float32{4, 4}, []float32{4})
	r3 := outerParams([]float32{2, 2}, []float32{-3})
	o := NewOuter(g.Specs(), 1, 0, false)
	if err := o.Step(g, []*Params{r1, r3}, nil); err != nil {
		t.Fatal(err)
	}
	// Δ1 = (1, 0, 0), Δ3 = (−1, 0, 2): Δ = (0, 0, 1); lr 1, μ 0: θ = (1, 2, −2). With r2 it would
	// have been Δ = (−1, −2/3, −1).
	want := []float32{1, 2, -2}
	for i, v := range append(append([]float32{}, g.Tensors[0].Data...), g.Tensors[1].Data...) {
		if v != want[i] {
			t.Errorf("θ[%d] = %v, want %v", i, v, want[i])
		}
	}
	if got := r2.Tensors[0].Data[0]; got != 4 {
		t.Errorf("the absent replica was changed: %v", got)
	}
	if got := r3.Tensors[1].Data[0]; got != -2 {
		t.Errorf("a participant does not continue from the global θ: %v", got)
	}
	if err := o.Step(g, nil, nil); !errors.Is(err, ErrNoParticipants) {
		t.Errorf("no participants: %v, want ErrNoParticipants", err)
	}
	if err := NewOuter(g.Specs(), 1, 0, true).Step(g, []*Params{r1}, nil); err == nil {
		t.Error("int8 without error-feedback states was accepted")
	}
}

// With one participant, lr 1 and μ 0 the outer step sets θ to the replica's θ bit for bit, even
// where θ − θ_r is not a float32.
func TestOuterOneReplicaIsIdentity(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	specs := []Spec{{"w", []int{1000}}}
	g, r := NewParams(specs), NewParams(specs)
	for i := range g.Slab {
		g.Slab[i] = float32(rng.NormFloat64() * 0.02)
		r.Slab[i] = g.Slab[i] + float32(rng.NormFloat64()*1e-3)
	}
	g.Slab[0], r.Slab[0] = 1, 1e-7 // 1 − 1e-7 is not a float32
	want := append([]float32(nil), r.Slab...)
	o := NewOuter(specs, 1, 0, false)
	for round := 0; round < 3; round++ {
		if err := o.Step(g, []*Params{r}, nil); err != nil {
			t.Fatal(err)
		}
		for i, v := range g.Slab {
			if math.Float32bits(v) != math.Float32bits(want[i]) {
				t.Fatalf("round %d: θ[%d] = %v, want %v", round, i, v, want[i])
			}
		}
	}
}

// Error feedback: over rounds, the sum of what crossed as int8 tracks the sum of the true values to
// within the error kept — even for a value far below the chunk's quantum, which rounding alone
// would drop every round.
func TestInt8EFTracksSum(t *testing.T) {
	seed := uint64(7)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const n, rounds = OuterChunk, 200
	e := make([]float32, n)
	sumX, sumR, sumPlain := make([]float64, n), make([]float64, n), make([]float64, n)
	x, plain, zero := make([]float32, n), make([]float32, n), make([]float32, n)
	for k := 0; k < rounds; k++ {
		for i := range x {
			x[i] = float32(rng.NormFloat64() * 1e-3)
		}
		x[0] = 1       // sets the scale: a quantum of 1/127
		x[1] = 1e-4    // far below half a quantum
		x[2] = -2.5e-3 // below half a quantum too
		for i, v := range x {
			sumX[i] += float64(v)
		}
		copy(plain, x)
		clear(zero)
		Int8EF(plain, zero) // no feedback: every round starts from a zero error
		for i, v := range plain {
			sumPlain[i] += float64(v)
		}
		Int8EF(x, e)
		for i, v := range x {
			sumR[i] += float64(v)
		}
	}
	for i := range sumX {
		if d := math.Abs(sumR[i] + float64(e[i]) - sumX[i]); d > 1e-5 {
			t.Errorf("value %d: Σ crossed + e = %v, Σ true = %v (|Δ| %v)", i, sumR[i]+float64(e[i]), sumX[i], d)
		}
		if math.Abs(float64(e[i])) > 0.5/127+1e-7 {
			t.Errorf("value %d: error %v exceeds half a quantum", i, e[i])
		}
	}
	if sumPlain[1] != 0 || sumPlain[2] != 0 {
		t.Errorf("without feedback the small values should vanish: Σ %v, %v", sumPlain[1], sumPlain[2])
	}
	if got, want := sumR[1], sumX[1]; math.Abs(got-want) > 0.5/127 {
		t.Errorf("with feedback the small value's sum is %v, want %v within half a quantum", got, want)
	}
}

// With int8 both legs are quantised with feedback, deterministically; the replicas' and the
// average's errors are what was left behind.
func TestOuterInt8(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	specs := []Spec{{"w", []int{600}}, {"b", []int{7}}}
	run := func() (*Params, *Outer, []*Params) {
		g := NewParams(specs)
		for i := range g.Slab {
			g.Slab[i] = float32(rng.NormFloat64())
		}
		var rs, es []*Params
		for k := 0; k < 3; k++ {
			r := NewParams(specs)
			for i := range r.Slab {
				r.Slab[i] = g.Slab[i] + float32(rng.NormFloat64()*1e-2)
			}
			rs, es = append(rs, r), append(es, NewParams(specs))
		}
		o := NewOuter(specs, 0.7, 0.9, true)
		if err := o.Step(g, rs, es); err != nil {
			t.Fatal(err)
		}
		return g, o, es
	}
	rng = rand.New(rand.NewPCG(3, 4))
	g1, o1, e1 := run()
	rng = rand.New(rand.NewPCG(3, 4))
	g2, o2, e2 := run()
	same := func(what string, a, b *Params) {
		for i := range a.Slab {
			if math.Float32bits(a.Slab[i]) != math.Float32bits(b.Slab[i]) {
				t.Fatalf("%s differs at %d: %v vs %v", what, i, a.Slab[i], b.Slab[i])
			}
		}
	}
	same("θ", g1, g2)
	same("v", o1.V, o2.V)
	same("average error", o1.Err, o2.Err)
	for k := range e1 {
		same("replica error", e1[k], e2[k])
	}
	var nz int
	for _, v := range e1[0].Slab {
		if v != 0 {
			nz++
		}
	}
	if nz == 0 {
		t.Error("int8 left no error behind")
	}
}

func TestOuterBytes(t *testing.T) {
	specs := []Spec{{"w", []int{4, 256}}, {"b", []int{300}}}
	if got, want := OuterPayload(specs, false), int64(4*(1024+300)); got != want {
		t.Errorf("float32 payload %d, want %d", got, want)
	}
	if got, want := OuterPayload(specs, true), int64(1024+4*4+300+4*2); got != want {
		t.Errorf("int8 payload %d, want %d", got, want)
	}
	for _, c := range []struct {
		name string
		size int64
		r    int
		want int64
	}{
		{"one replica", 1000, 1, 0},
		{"two", 1000, 2, 1000},
		{"four", 1000, 4, 1500},
	} {
		if got := AllReduceBytes(c.size, c.r); got != c.want {
			t.Errorf("%s: got %d, want %d", c.name, got, c.want)
		}
	}
}

// TestStepGivenEqualsStep: a holder that has the participants' θ_r (none) or their int8 codes and
// scales (int8) — as a replica's stage gets them over the network — takes exactly Step's outer
// step, round after round.
func TestStepGivenEqualsStep(t *testing.T) {
	for _, q8 := range []bool{false, true} {
		cfg := TinyConfig()
		specs := cfg.StageSpecs(0, 1, true)
		rnd := rand.New(rand.NewPCG(3, 4))
		fill := func(p *Params, scale float32) {
			for _, tt := range p.Tensors {
				for i := range tt.Data {
					tt.Data[i] = float32(rnd.NormFloat64()) * scale
				}
			}
		}
		const R = 3
		ref, dist := NewOuter(specs, 0.7, 0.9, q8), NewOuter(specs, 0.7, 0.9, q8)
		gRef, gDist := NewParams(specs), NewParams(specs)
		fill(gRef, 1)
		gDist.CopyFrom(gRef)
		errsRef, errsDist := make([]*Params, R), make([]*Params, R)
		for k := range R {
			errsRef[k], errsDist[k] = NewParams(specs), NewParams(specs)
		}
		for round := range 3 {
			reps := make([]*Params, R)
			given := make([]OuterGiven, R)
			for k := range R {
				reps[k] = NewParams(specs)
				reps[k].CopyFrom(gRef)
				for _, tt := range reps[k].Tensors {
					for i := range tt.Data {
						tt.Data[i] += float32(rnd.NormFloat64()) * 0.01
					}
				}
				theta := NewParams(specs)
				theta.CopyFrom(reps[k])
				given[k].Theta = theta
				if q8 {
					// What replica k sends: codes and a scale per chunk, decoded by the holder.
					d := NewParams(specs)
					for ti, tt := range gDist.Tensors {
						for a := 0; a < len(tt.Data); a += OuterChunk {
							b := min(a+OuterChunk, len(tt.Data))
							x := make([]float32, b-a)
							codes := make([]int8, b-a)
							s := PseudoGradient(tt.Data[a:b], theta.Tensors[ti].Data[a:b], x, errsDist[k].Tensors[ti].Data[a:b], codes)
							Int8Decode(d.Tensors[ti].Data[a:b], codes, s)
						}
					}
					given[k].Delta = d
				}
			}
			if err := ref.Step(gRef, reps, errsRef); err != nil {
				t.Fatal(err)
			}
			if err := dist.StepGiven(gDist, given); err != nil {
				t.Fatal(err)
			}
			for ti, tt := range gRef.Tensors {
				for i, v := range tt.Data {
					if math.Float32bits(v) != math.Float32bits(gDist.Tensors[ti].Data[i]) {
						t.Fatalf("int8 %v round %d: %s[%d] = %v, Step %v", q8, round, tt.Name, i, gDist.Tensors[ti].Data[i], v)
					}
				}
			}
		}
	}
}

// TestStepSegments: an outer step whose exchange lost replicas (StepSegments) is Step when every
// segment is averaged over everyone; when every segment leaves replica 2 out it is Step over the
// others, from the same state; and when only some segments leave it out, those are the others'
// step and the rest everyone's, value for value — int8 and float32, four rounds, the error
// feedback carried from round to round. OuterReassign moves only a lost owner's segments.
func TestStepSegments(t *testing.T) {
	if got := OuterReassign([]int{0, 1, 2, 3}, func(q int) bool { return q != 1 && q != 2 }); fmt.Sprint(got) != "[0 3 0 3]" {
		t.Errorf("OuterReassign lost 1 and 2: %v, want [0 3 0 3]", got)
	}
	// OuterSegmentsPerReplica segments each, interleaved: a lost replica's spread over the
	// survivors.
	owners := OuterOwners([]int{0, 2, 5})
	if want := strings.Repeat("0 2 5 ", OuterSegmentsPerReplica); fmt.Sprint(owners) != "["+strings.TrimSpace(want)+"]" {
		t.Errorf("OuterOwners: %v", owners)
	}
	if got := OuterReassign(owners, func(q int) bool { return q != 2 }); fmt.Sprint(got) != "["+strings.TrimSpace(strings.Repeat("0 5 5 0 0 5 ", OuterSegmentsPerReplica/2))+"]" {
		t.Errorf("OuterReassign lost 2 of %v: %v", owners, got)
	}
	if got := OuterOwners(make([]int, 1000)); len(got) != maxOuterSegments/1000*1000 {
		t.Errorf("OuterOwners of 1,000: %d segments, want %d (at most maxOuterSegments)", len(got), maxOuterSegments/1000*1000)
	}
	if got := OuterOwners([]int{7}); fmt.Sprint(got) != "[7]" {
		t.Errorf("OuterOwners alone: %v", got)
	}
	if got := OuterReassign([]int{0, 1, 2}, func(q int) bool { return q == 1 }); fmt.Sprint(got) != "[1 1 1]" {
		t.Errorf("OuterReassign left 1: %v, want [1 1 1]", got)
	}
	if got := OuterReassign([]int{0, 1}, func(int) bool { return false }); got != nil {
		t.Errorf("OuterReassign with nobody left: %v, want nil", got)
	}
	for _, q8 := range []bool{false, true} {
		cfg := TinyConfig()
		specs := cfg.StageSpecs(0, 1, true)
		rnd := rand.New(rand.NewPCG(5, 6))
		const R = 3
		type run struct {
			o    *Outer
			g    *Params
			errs []*Params
		}
		newRun := func(g0 *Params) *run {
			r := &run{o: NewOuter(specs, 0.7, 0.9, q8), g: NewParams(specs)}
			r.g.CopyFrom(g0)
			for range R {
				r.errs = append(r.errs, NewParams(specs))
			}
			return r
		}
		g0 := NewParams(specs)
		for _, tt := range g0.Tensors {
			for i := range tt.Data {
				tt.Data[i] = float32(rnd.NormFloat64())
			}
		}
		all, seg := newRun(g0), newRun(g0)    // everyone in every segment
		two, segTwo := newRun(g0), newRun(g0) // replica 2 in none
		mix := newRun(g0)                     // replica 2 in segment 0 only
		everyone := func(int, int) []int { return []int{0, 1, 2} }
		others := func(int, int) []int { return []int{0, 1} }
		firstOnly := func(_, k int) []int {
			if k == 0 {
				return []int{0, 1, 2}
			}
			return []int{0, 1}
		}
		for round := range 4 {
			reps := make([]*Params, R)
			for k := range R {
				reps[k] = NewParams(specs)
				reps[k].CopyFrom(all.g)
				for _, tt := range reps[k].Tensors {
					for i := range tt.Data {
						tt.Data[i] += float32(rnd.NormFloat64()) * 0.01
					}
				}
			}
			clones := func() []*Params {
				out := make([]*Params, R)
				for k, p := range reps {
					out[k] = NewParams(specs)
					out[k].CopyFrom(p)
				}
				return out
			}
			if err := all.o.Step(all.g, clones(), all.errs); err != nil {
				t.Fatal(err)
			}
			if err := seg.o.StepSegments(seg.g, clones(), seg.errs, []int{0, 1, 2}, nil, everyone); err != nil {
				t.Fatal(err)
			}
			sameParams(t, fmt.Sprintf("int8 %v round %d, everyone", q8, round), seg.g, all.g)
			// Replica 2 lost before anything of it was averaged: the others' step, whose
			// error feedback restarts (the owners differ), as StepSegments' does (its
			// segment's owner lost).
			c := clones()
			two.o.Reset()
			if err := two.o.Step(two.g, c[:2], two.errs[:2]); err != nil {
				t.Fatal(err)
			}
			segTwo.o.Reset()
			if err := segTwo.o.StepSegments(segTwo.g, clones(), segTwo.errs, []int{0, 1, 2}, [][]int{{0, 1, 0}}, others); err != nil {
				t.Fatal(err)
			}
			sameParams(t, fmt.Sprintf("int8 %v round %d, replica 2 in no segment", q8, round), segTwo.g, two.g)
			two.g.CopyFrom(all.g)
			segTwo.g.CopyFrom(all.g)
			// Some segments with replica 2, the others without: each segment is one of the
			// two steps above, computed apart.
			mix.g.CopyFrom(all.g)
			mix.o.Reset()
			withRef := newRun(all.g)
			withoutRef := newRun(all.g)
			for k := range R {
				withRef.errs[k].CopyFrom(mix.errs[k])
				withoutRef.errs[k].CopyFrom(mix.errs[k])
			}
			if err := withRef.o.Step(withRef.g, clones(), withRef.errs); err != nil {
				t.Fatal(err)
			}
			if err := withoutRef.o.Step(withoutRef.g, clones()[:2], withoutRef.errs[:2]); err != nil {
				t.Fatal(err)
			}
			if err := mix.o.StepSegments(mix.g, clones(), mix.errs, []int{0, 1, 2}, [][]int{{0, 1, 0}}, firstOnly); err != nil {
				t.Fatal(err)
			}
			for ti, tt := range mix.g.Tensors {
				for k := range R {
					lo, hi := OuterSegment(len(tt.Data), R, k)
					want := withoutRef.g.Tensors[ti].Data
					if k == 0 {
						want = withRef.g.Tensors[ti].Data
					}
					for i := lo; i < hi; i++ {
						if math.Float32bits(tt.Data[i]) != math.Float32bits(want[i]) {
							t.Fatalf("int8 %v round %d, segment %d of %s: [%d] = %v, want %v", q8, round, k, tt.Name, i, tt.Data[i], want[i])
						}
					}
				}
			}
		}
	}
}

// sameParams fails the test unless a and b hold the same values, bit for bit.
func sameParams(t *testing.T, what string, a, b *Params) {
	t.Helper()
	for ti, tt := range b.Tensors {
		for i, v := range tt.Data {
			if math.Float32bits(v) != math.Float32bits(a.Tensors[ti].Data[i]) {
				t.Fatalf("%s: %s[%d] = %v, want %v", what, tt.Name, i, a.Tensors[ti].Data[i], v)
			}
		}
	}
}

// TestOuterLayout: what crosses of a tensor at an outer step, laid out once (OuterLayout) for the
// sender, the receiver and the signature's chunks: with int8, every chunk's scale and codes are
// PseudoGradient's, at the places of an I8 matrix of the full chunks and a one-row matrix of the
// last, decode to exactly the sender's values, and AppendChunk gives each chunk's scale and codes;
// float32 is θ_r in one part.
func TestOuterLayout(t *testing.T) {
	rnd := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{1, OuterChunk - 1, OuterChunk, OuterChunk + 1, 2*OuterChunk + 37, 3 * OuterChunk} {
		g, r := make([]float32, n), make([]float32, n)
		for i := range g {
			g[i] = float32(rnd.NormFloat64())
			r[i] = g[i] + float32(rnd.NormFloat64())*1e-3
		}
		e := make([]float32, n)
		for i := range e {
			e[i] = float32(rnd.NormFloat64()) * 1e-6
		}
		l := OuterLayout{N: n, Int8: true}
		full, rest := n/OuterChunk, n%OuterChunk
		if rows, cols, first := l.Part(0); rows != full || cols != OuterChunk || first != 0 {
			t.Errorf("n %d: part 0 is %d × %d from %d", n, rows, cols, first)
		}
		if rows, cols, first := l.Part(1); rows != min(rest, 1) || cols != rest || first != full*OuterChunk {
			t.Errorf("n %d: part 1 is %d × %d from %d", n, rows, cols, first)
		}
		if got := int64(l.Bytes(0) + l.Bytes(1)); got != OuterPayload([]Spec{{"w", []int{n}}}, true) {
			t.Errorf("n %d: %d bytes, OuterPayload says otherwise", n, got)
		}
		// The reference: chunk by chunk, as Step's pseudo-gradient.
		eRef := append([]float32(nil), e...)
		xRef := make([]float32, n)
		var scales []float32
		var codes [][]int8
		for a := 0; a < n; a += OuterChunk {
			b := min(a+OuterChunk, n)
			c := make([]int8, b-a)
			scales = append(scales, PseudoGradient(g[a:b], r[a:b], xRef[a:b], eRef[a:b], c))
			codes = append(codes, c)
		}
		x := make([]float32, n)
		parts := l.EncodeInt8(g, r, x, e)
		if err := l.CheckParts(parts); err != nil {
			t.Fatalf("n %d: %v", n, err)
		}
		for i := range x {
			if math.Float32bits(x[i]) != math.Float32bits(xRef[i]) || math.Float32bits(e[i]) != math.Float32bits(eRef[i]) {
				t.Fatalf("n %d: value %d: x %v e %v, chunk by chunk %v %v", n, i, x[i], e[i], xRef[i], eRef[i])
			}
		}
		for c := range l.Chunks() {
			p, row, rows, cols := 0, c, full, OuterChunk
			if c == full {
				p, row, rows, cols = 1, 0, 1, rest
			}
			want := binary.LittleEndian.AppendUint32(nil, math.Float32bits(scales[c]))
			for _, q := range codes[c] {
				want = append(want, byte(q))
			}
			if got := l.AppendChunk(nil, parts, c); !bytes.Equal(got, want) {
				t.Fatalf("n %d: chunk %d crossed as %x, want %x", n, c, got, want)
			}
			b := parts[p]
			if !bytes.Equal(b[4*row:4*row+4], want[:4]) || !bytes.Equal(b[4*rows+row*cols:4*rows+(row+1)*cols], want[4:]) {
				t.Fatalf("n %d: chunk %d is not row %d of an I8 matrix of part %d", n, c, row, p)
			}
		}
		got := make([]float32, n)
		for p := range parts {
			l.DecodeInt8(got, p, parts[p])
		}
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(x[i]) {
				t.Fatalf("n %d: value %d decoded %v, sent %v", n, i, got[i], x[i])
			}
		}
		if err := l.CheckParts([2][]byte{parts[1], parts[0]}); err == nil && n%OuterChunk != 0 && n > OuterChunk {
			t.Errorf("n %d: swapped parts pass", n)
		}

		f := OuterLayout{N: n}
		fp := [2][]byte{binary.LittleEndian.AppendUint32(nil, 0)}
		if err := f.CheckParts(fp); (err == nil) != (n == 1) {
			t.Errorf("n %d: float32 parts of one value: %v", n, err)
		}
		fp[0] = make([]byte, 4*n)
		for i := range r {
			binary.LittleEndian.PutUint32(fp[0][4*i:], math.Float32bits(r[i]))
		}
		if err := f.CheckParts(fp); err != nil {
			t.Fatalf("n %d: float32: %v", n, err)
		}
		for c := range f.Chunks() {
			a, b := 4*c*OuterChunk, 4*min((c+1)*OuterChunk, n)
			if got := f.AppendChunk(nil, fp, c); !bytes.Equal(got, fp[0][a:b]) {
				t.Fatalf("n %d: float32 chunk %d", n, c)
			}
		}
	}
}

// TestOuterSegmentsEqualStep: the outer step taken as a reduce-scatter and an all-gather — each
// of R owners averaging its segment of every tensor (ReduceSegment) from what crossed, and every
// holder taking the step from the gathered averages (ApplyAverage) — leaves θ, the momentum and
// the owners' error feedback of the average bit for bit as Step does, for 2, 3 and 5
// participants, float32 and int8, over three rounds (tensors smaller than a chunk, and with
// fewer chunks than owners, included).
func TestOuterSegmentsEqualStep(t *testing.T) {
	specs := []Spec{{"w", []int{2000}}, {"b", []int{7}}, {"c", []int{513}}}
	for _, int8 := range []bool{false, true} {
		for _, R := range []int{2, 3, 5} {
			t.Run(fmt.Sprintf("int8=%v/R=%d", int8, R), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(5, uint64(R)))
				ref, seg := NewParams(specs), NewParams(specs)
				for i := range ref.Slab {
					ref.Slab[i] = float32(rng.NormFloat64())
				}
				copy(seg.Slab, ref.Slab)
				o1, o2 := NewOuter(specs, 0.7, 0.9, int8), NewOuter(specs, 0.7, 0.9, int8)
				errs := make([]*Params, R) // the replicas' own error feedback, used by both
				errs2 := make([]*Params, R)
				for k := range errs {
					errs[k], errs2[k] = NewParams(specs), NewParams(specs)
				}
				for round := 0; round < 3; round++ {
					rs := make([]*Params, R)
					for k := range rs {
						rs[k] = NewParams(specs)
						for i := range rs[k].Slab {
							rs[k].Slab[i] = ref.Slab[i] + float32(rng.NormFloat64()*1e-2)
						}
					}
					// What crosses from each participant, formed against seg's θ (= ref's).
					given := make([]*Params, R)
					for k, r := range rs {
						given[k] = NewParams(specs)
						if !int8 {
							copy(given[k].Slab, r.Slab)
							continue
						}
						for ti, tt := range seg.Tensors {
							l := OuterLayout{N: len(tt.Data), Int8: true}
							l.EncodeInt8(tt.Data, r.Tensors[ti].Data, given[k].Tensors[ti].Data, errs2[k].Tensors[ti].Data)
						}
					}
					if err := o1.StepDelayed(ref, rs, errs); err != nil {
						t.Fatal(err)
					}
					avgs := make([][]float32, len(specs))
					for ti, tt := range seg.Tensors {
						avgs[ti] = make([]float32, len(tt.Data))
						for q := range R {
							lo, hi := OuterSegment(len(tt.Data), R, q)
							var xs [][]float32
							for k := range R {
								xs = append(xs, given[k].Tensors[ti].Data[lo:hi])
							}
							parts, err := o2.ReduceSegment(seg, ti, lo, xs, avgs[ti][lo:hi])
							if err != nil {
								t.Fatal(err)
							}
							if int8 && hi > lo {
								// What a holder decodes is what the owner averaged.
								l := OuterLayout{N: hi - lo, Int8: true}
								got := make([]float32, hi-lo)
								for p := range parts {
									l.DecodeInt8(got, p, parts[p])
								}
								for i := range got {
									if math.Float32bits(got[i]) != math.Float32bits(avgs[ti][lo+i]) {
										t.Fatalf("decoded average %d differs", i)
									}
								}
							}
						}
					}
					for ti := range seg.Tensors {
						for q := range R {
							lo, hi := OuterSegment(len(seg.Tensors[ti].Data), R, q)
							if err := o2.ApplyAverage(seg, ti, lo, avgs[ti][lo:hi]); err != nil {
								t.Fatal(err)
							}
						}
					}
					for _, c := range []struct {
						what string
						a, b *Params
					}{{"θ", ref, seg}, {"v", o1.V, o2.V}, {"average error", o1.Err, o2.Err}} {
						if c.a == nil {
							continue
						}
						for i := range c.a.Slab {
							if math.Float32bits(c.a.Slab[i]) != math.Float32bits(c.b.Slab[i]) {
								t.Fatalf("round %d: %s differs at %d: %v vs %v", round, c.what, i, c.a.Slab[i], c.b.Slab[i])
							}
						}
					}
				}
			})
		}
	}
}

// TestOuterSegments: the owners' segments cover a tensor once, in order, at chunk boundaries.
func TestOuterSegments(t *testing.T) {
	for _, n := range []int{1, 255, 256, 257, 2000, 5 * 256} {
		for _, R := range []int{1, 2, 3, 5, 8} {
			at := 0
			for q := range R {
				lo, hi := OuterSegment(n, R, q)
				if lo != at || hi < lo || (lo%OuterChunk != 0 && lo != n) {
					t.Fatalf("n %d R %d: segment %d is [%d,%d), want from %d at a chunk", n, R, q, lo, hi, at)
				}
				at = hi
			}
			if at != n {
				t.Fatalf("n %d R %d: segments end at %d", n, R, at)
			}
		}
	}
}

// TestOuterOwners: int8's average error feedback lasts while the reduce-scatter's owners do. The
// same participants keep it; a checkpoint after an owner left zeroes that owner's segments only
// (Forget); other participants restart it from zero; a restored state keeps it whoever takes
// part.
func TestOuterOwners(t *testing.T) {
	specs := []Spec{{"w", []int{1000}}, {"b", []int{7}}}
	o := NewOuter(specs, 0.7, 0.9, true)
	fill := func() {
		for i := range o.Err.Slab {
			o.Err.Slab[i] = 1
		}
	}
	zeros := func() (n int) {
		for _, v := range o.Err.Slab {
			if v == 0 {
				n++
			}
		}
		return n
	}
	fill()
	o.Participate([]int{0, 1, 2})
	o.Participate([]int{0, 1, 2})
	if zeros() != 0 {
		t.Fatal("the same participants lost the average's error feedback")
	}
	o.Forget(func(r int) bool { return r != 1 })
	want := 0
	for _, s := range specs {
		lo, hi := OuterSegment(s.Size(), 3, 1)
		want += hi - lo
	}
	if got := zeros(); got != want {
		t.Fatalf("forgetting owner 1 zeroed %d values, want its segments' %d", got, want)
	}
	o.Participate([]int{0, 2})
	if zeros() != len(o.Err.Slab) {
		t.Fatal("other participants kept the average's error feedback")
	}
	fill()
	o.Restored()
	o.Participate([]int{4})
	if zeros() != 0 {
		t.Fatal("a restored state lost the average's error feedback")
	}
}
