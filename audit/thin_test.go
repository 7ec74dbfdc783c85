package audit

import (
	"bytes"
	"errors"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// thinState is a shard's state with one large parameter (50 groups, the last one short) and one
// small, each with both moments.
func thinState(seed uint64) []safetensors.Tensor {
	r := rand.New(rand.NewPCG(seed, 9))
	var ts []safetensors.Tensor
	for _, p := range []struct {
		name  string
		shape []int
	}{{"transformer.h.0.mlp.c_fc.weight", []int{199, 1025}}, {"transformer.h.0.ln_1.bias", []int{64}}} {
		for _, prefix := range []string{"", optimM, optimV} {
			t := safetensors.Tensor{Name: prefix + p.name, Shape: p.shape, Data: make([]float32, p.shape[0]*p.shape[len(p.shape)-1])}
			if len(p.shape) == 1 {
				t.Data = make([]float32, p.shape[0])
			}
			for i := range t.Data {
				t.Data[i] = r.Float32() - 0.5
			}
			ts = append(ts, t)
		}
	}
	return ts
}

// thinFull is a whole bundle of a step from thinState(1) to thinState(2).
func thinFull() *Bundle {
	b := testBundle()
	b.StateIn, b.StateOut = thinState(1), thinState(2)
	return b
}

func cloneState(ts []safetensors.Tensor) []safetensors.Tensor {
	out := make([]safetensors.Tensor, len(ts))
	for i, t := range ts {
		out[i] = safetensors.Tensor{Name: t.Name, Shape: slices.Clone(t.Shape), Data: slices.Clone(t.Data)}
	}
	return out
}

// TestSampledGroups: the same seed draws the same groups, in order, distinct, one in ThinEvery.
func TestSampledGroups(t *testing.T) {
	for _, n := range []int{2, 15, 16, 17, 50, 1000} {
		g := SampledGroups(42, "w", n)
		if !slices.Equal(g, SampledGroups(42, "w", n)) {
			t.Fatalf("%d groups: two draws of one seed differ", n)
		}
		if want := (n + ThinEvery - 1) / ThinEvery; len(g) != want {
			t.Fatalf("%d groups: %d sampled, want %d", n, len(g), want)
		}
		if !slices.IsSorted(g) || len(slices.Compact(slices.Clone(g))) != len(g) || g[0] < 0 || g[len(g)-1] >= n {
			t.Fatalf("%d groups: sample %v", n, g)
		}
	}
	if slices.Equal(SampledGroups(1, "w", 1000), SampledGroups(2, "w", 1000)) {
		t.Fatal("two seeds draw the same 63 of 1000 groups")
	}
}

// TestThinBundle: thin evidence binds to the commitments of the whole state, carries a sixteenth
// of the large moments, and a recomputation is judged on the sampled groups: a difference there,
// in a small tensor, or in what the worker committed to is seen; one outside the sampled groups
// is not (the price of thin evidence, thin.go).
func TestThinBundle(t *testing.T) {
	full := thinFull()
	commit, next := commitOf(full)
	const seed = 77
	got := readThin(t, Thin(full, seed, true), leanOf(full), 2)
	if err := Check(got, 7, 3, commit, next, true, seed); err != nil {
		t.Fatalf("honest thin bundle: %v", err)
	}
	if err := Check(got, 7, 3, commit, next, true, seed+1); err == nil || !strings.Contains(err.Error(), "seed") {
		t.Fatalf("thin bundle of another seed: err = %v", err)
	}
	if err := Check(got, 7, 3, commit, next, false, seed); err == nil {
		t.Fatal("thin bundle where all was asked: no error")
	}
	if err := Check(leanOf(full), 7, 3, commit, next, true, seed); err == nil {
		t.Fatal("lean bundle where thin was asked: no error")
	}

	const big = "transformer.h.0.mlp.c_fc.weight"
	groups := thinGroups(199 * 1025)
	sample := SampledGroups(seed, big, groups)
	unsampled := 0
	for slices.Contains(sample, unsampled) {
		unsampled++
	}
	at := func(ts []safetensors.Tensor, name string) []float32 { return tensorNamed(t, ts, name) }
	// The start state: a sampled group changed after its chaining values were taken, or
	// chaining values that do not give the committed hash.
	for _, tc := range []struct {
		name   string
		change func(b *Bundle)
	}{
		{"sampled group of m", func(b *Bundle) { at(b.StateIn, optimM+big)[sample[0]*ThinGroup/4+3] += 1 }},
		{"chaining values", func(b *Bundle) {
			b.InCVs[optimV+big] = slices.Clone(b.InCVs[optimV+big])
			b.InCVs[optimV+big][unsampled][0] ^= 1
		}},
		{"parameters", func(b *Bundle) { at(b.StateIn, big)[1] += 1 }},
		{"small moment", func(b *Bundle) { at(b.StateIn, optimV+"transformer.h.0.ln_1.bias")[1] += 1 }},
	} {
		b := thinFull()
		b.StateIn = cloneState(b.StateIn)
		tb := Thin(b, seed, true)
		tc.change(tb)
		if err := Check(tb, 7, 3, commit, next, true, seed); err == nil || !strings.Contains(err.Error(), "start state") {
			t.Errorf("%s changed: err = %v", tc.name, err)
		}
	}

	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5}, GradSq: map[string]float64{big: 0.5}, Commit: commit}
	// The end state. An honest recomputation from thin evidence is right on the sampled groups
	// and the small tensors only: scramble the rest, as the zeros of the unsent moments do.
	honest := func() *Outcome {
		o := outcomeOf(full, rep)
		for _, x := range o.StateOut {
			if thinGroups(len(x.Data)) == 0 {
				continue
			}
			for j := range groups {
				if !slices.Contains(sample, j) {
					lo, hi := j*ThinGroup/4, min(len(x.Data), (j+1)*ThinGroup/4)
					for i := lo; i < hi; i++ {
						x.Data[i] = -x.Data[i] * 3
					}
				}
			}
		}
		return o
	}
	if msg := CompareLean(honest(), got, rep, next); msg != "" {
		t.Fatalf("honest recomputation: %q", msg)
	}
	for _, tc := range []struct {
		name   string
		change func(o *Outcome, b *Bundle)
		caught bool
	}{
		{"a parameter in a sampled group", func(o *Outcome, _ *Bundle) { at(o.StateOut, big)[sample[len(sample)-1]*ThinGroup/4] += 1e-3 }, true},
		{"a moment in a sampled group", func(o *Outcome, _ *Bundle) { at(o.StateOut, optimM+big)[sample[0]*ThinGroup/4+7] *= 2 }, true},
		{"a small tensor", func(o *Outcome, _ *Bundle) { at(o.StateOut, "transformer.h.0.ln_1.bias")[0] += 1e-3 }, true},
		{"end chaining values withheld", func(_ *Outcome, b *Bundle) { delete(b.OutCVs, optimV+big) }, true},
		{"end chaining values forged", func(_ *Outcome, b *Bundle) {
			b.OutCVs[big] = slices.Clone(b.OutCVs[big])
			b.OutCVs[big][unsampled][5] ^= 1
		}, true},
		// What thin evidence gives up: a parameter changed outside the sampled groups.
		{"a parameter outside the sampled groups", func(o *Outcome, _ *Bundle) { at(o.StateOut, big)[unsampled*ThinGroup/4] += 1 }, false},
	} {
		o, b := honest(), *got
		b.OutCVs = map[string][][32]byte{}
		for k, v := range got.OutCVs {
			b.OutCVs[k] = v
		}
		tc.change(o, &b)
		if msg := CompareLean(o, &b, rep, next); (msg != "") != tc.caught {
			t.Errorf("%s: %q, want caught: %v", tc.name, msg, tc.caught)
		}
	}
}

// tensorNamed is the values of ts's tensor name.
func tensorNamed(t *testing.T, ts []safetensors.Tensor, name string) []float32 {
	t.Helper()
	for _, x := range ts {
		if x.Name == name {
			return x.Data
		}
	}
	t.Fatalf("no %s", name)
	return nil
}

// readThin encodes thin, which must be at most 1/less of other's size, and reads it back within
// other's bound: Read counts the large moments' whole size, which the recomputation loads.
func readThin(t *testing.T, thin, other *Bundle, less int) *Bundle {
	t.Helper()
	raw, ref := encode(t, thin), encode(t, other)
	t.Logf("thin %d bytes, the other %d", len(raw), len(ref))
	if len(raw)*less > len(ref) {
		t.Fatalf("thin evidence of %d bytes, the other %d: not under 1/%d", len(raw), len(ref), less)
	}
	got, err := Read(bytes.NewReader(raw), int64(len(ref))+1<<16)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestThinBundleMalformed: a thin bundle's header is checked before anything it describes is
// allocated or believed.
func TestThinBundleMalformed(t *testing.T) {
	thin := Thin(thinFull(), 5, true)
	raw := encode(t, thin)
	hl := int(uint32(raw[len(magic)]) | uint32(raw[len(magic)+1])<<8 | uint32(raw[len(magic)+2])<<16 | uint32(raw[len(magic)+3])<<24)
	head := string(raw[len(magic)+4 : len(magic)+4+hl])
	body := raw[len(magic)+4+hl:]
	reframe := func(h string) []byte {
		out := []byte(magic)
		out = append(out, byte(len(h)), byte(len(h)>>8), byte(len(h)>>16), byte(len(h)>>24))
		out = append(out, h...)
		return append(out, body...)
	}
	for _, tc := range []struct {
		name      string
		old, repl string
	}{
		{"no seed", `"sample":5,`, ``},
		{"groups of a parameter", `"role":"in-part","name":"optim.m.transformer.h.0.mlp.c_fc.weight"`, `"role":"in-part","name":"transformer.h.0.mlp.c_fc.weight"`},
		{"unknown role", `"role":"in-cvs"`, `"role":"in-cv"`},
		{"chaining values of a small tensor", `"role":"out-cvs","name":"optim.m.transformer.h.0.mlp.c_fc.weight"`, `"role":"out-cvs","name":"transformer.h.0.ln_1.bias"`},
		{"chaining values of no tensor", `"role":"out-cvs","name":"optim.m.transformer.h.0.mlp.c_fc.weight"`, `"role":"out-cvs","name":"x"`},
	} {
		if !strings.Contains(head, tc.old) {
			t.Fatalf("%s: the header has no %s: %s", tc.name, tc.old, head)
		}
		_, err := Read(bytes.NewReader(reframe(strings.Replace(head, tc.old, tc.repl, 1))), 1<<30)
		if !errors.Is(err, ErrFormat) {
			t.Errorf("%s: err = %v, want a malformed bundle", tc.name, err)
		}
	}
	// A whole tensor's size counts against the bound even where only its groups travel.
	if _, err := Read(bytes.NewReader(raw), int64(len(raw))); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("thin bundle bounded by its own length: err = %v", err)
	}
}

// TestThinWhole: thin evidence that is not lean (a recomputation across kernel families) carries
// the end state's large tensors as their sampled groups, bound by their chaining values to the
// digest committed to next; the comparison within tolerances reads those groups: the moments
// against the recomputation's, the parameters against AdamW of the worker's own moments.
func TestThinWhole(t *testing.T) {
	full := adamThin()
	commit, next := commitOf(full)
	const seed = 31
	got := readThin(t, Thin(full, seed, false), full, 3)
	if err := Check(got, 7, 3, commit, next, false, seed); err != nil {
		t.Fatalf("honest thin bundle: %v", err)
	}
	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5}, GradSq: map[string]float64{"w": 0.5}, Commit: commit}
	const big = "transformer.h.0.mlp.c_fc.weight"
	sample := SampledGroups(seed, big, thinGroups(len(full.StateIn[0].Data)))
	at := func(ts []safetensors.Tensor, name string) []float32 { return tensorNamed(t, ts, name) }
	// A sampled end group changed after the commitment is refused by Check.
	tampered := Thin(full, seed, false)
	tampered.StateOut = cloneState(full.StateOut)
	at(tampered.StateOut, big)[sample[0]*ThinGroup/4] += 1
	if err := Check(tampered, 7, 3, commit, next, false, seed); err == nil || !strings.Contains(err.Error(), "end state") {
		t.Fatalf("a sampled end group changed: err = %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(o *Outcome)
		pass   bool
	}{
		{"honest", func(o *Outcome) {}, true},
		{"moments 1e-5 off", func(o *Outcome) {
			for i := range at(o.StateOut, optimV+big) {
				at(o.StateOut, optimV+big)[i] *= 1 + 1e-5
			}
		}, true},
		{"moments ×1.01", func(o *Outcome) {
			for i := range at(o.StateOut, optimM+big) {
				at(o.StateOut, optimM+big)[i] *= 1.01
			}
		}, false},
	} {
		o := outcomeOf(full, rep)
		o.Update = testUpdate
		tc.change(o)
		for _, exact := range []bool{false, true} {
			want := tc.pass && (!exact || tc.name == "honest")
			if msg := Compare(o, got, rep, next, exact); (msg == "") != want {
				t.Errorf("%s, exact %v: %q, want a pass: %v", tc.name, exact, msg, want)
			}
		}
	}
	// The worker's parameters must follow from its own moments on the sampled groups.
	skipped := Thin(full, seed, false)
	skipped.StateOut = cloneState(full.StateOut)
	w, win := at(skipped.StateOut, big), at(full.StateIn, big)
	for _, j := range sample {
		copy(w[j*ThinGroup/4:(j+1)*ThinGroup/4], win[j*ThinGroup/4:])
	}
	if msg := Compare(outcomeOf(full, rep), skipped, rep, "", false); !strings.Contains(msg, "does not follow") {
		t.Errorf("an update skipped on the sampled groups: %q", msg)
	}
}

// adamThin is a whole bundle of a genuine AdamW step of a large parameter and a small one, with
// both moments (as kernels.AdamW computes it).
func adamThin() *Bundle {
	b := testBundle()
	in := thinState(1)
	out := cloneState(in)
	r := rand.New(rand.NewPCG(5, 6))
	for p := 0; p < len(in); p += 3 {
		w, m, v := in[p], in[p+1], in[p+2]
		for i := range m.Data {
			v.Data[i] = v.Data[i] * v.Data[i] // a second moment is not negative
		}
		out[p+2].Data = slices.Clone(v.Data)
		g := make([]float32, len(w.Data))
		for i := range g {
			g[i] = r.Float32() - 0.5
		}
		om, ov, ow := out[p+1].Data, out[p+2].Data, out[p].Data
		for i := range g {
			om[i] = 0.9*m.Data[i] + 0.1*g[i]
			ov[i] = 0.999*v.Data[i] + 0.001*g[i]*g[i]
		}
		copy(ow, applyAdamW(w.Data, om, ov, w.Shape, testUpdate))
	}
	b.StateIn, b.StateOut = in, out
	return b
}

// TestThinKnown: the chaining values a worker took with its state digests (TensorSumsGroups)
// make the same thin bundle as hashing the state again at the audit, for both kinds of bundle;
// a list of the wrong length is hashed again; a list that is not of the values fails the check.
func TestThinKnown(t *testing.T) {
	full := thinFull()
	commit, next := commitOf(full)
	sums, in := TensorSumsGroups(full.StateIn)
	if want := TensorSums(full.StateIn); !slices.Equal(sums, want) {
		t.Fatalf("TensorSumsGroups' sums %v, TensorSums %v", sums, want)
	}
	if len(in) == 0 {
		t.Fatal("no large tensor in the fixture: the test would test nothing")
	}
	_, out := TensorSumsGroups(full.StateOut)
	const seed = 77
	for _, lean := range []bool{true, false} {
		want, got := Thin(full, seed, lean), ThinKnown(full, seed, lean, in, out)
		if !reflect.DeepEqual(got.InCVs, want.InCVs) || !reflect.DeepEqual(got.OutCVs, want.OutCVs) {
			t.Fatalf("lean %v: the lists known differ from those hashed at the audit", lean)
		}
		for name := range got.InCVs {
			if _, ok := momentOf(name); !ok {
				t.Fatalf("lean %v: the start state's lists hold %s, not a moment", lean, name)
			}
		}
	}
	// A list of another length (another layout's) is not taken.
	const big = "transformer.h.0.mlp.c_fc.weight"
	short := maps.Clone(in)
	short[optimM+big] = short[optimM+big][:1]
	if got := ThinKnown(full, seed, true, short, out); !reflect.DeepEqual(got.InCVs, Thin(full, seed, true).InCVs) {
		t.Fatal("a list of the wrong length was carried")
	}
	// A list of other values (the state changed after its digest) is carried, and the bundle
	// fails its check: the end state's lists where the whole end state is asked for (a lean
	// bundle's are checked against the recomputation, CompareLean), the start state's always.
	stale := maps.Clone(out)
	stale[optimV+big] = slices.Clone(stale[optimV+big])
	stale[optimV+big][0][0] ^= 1
	got := readThin(t, ThinKnown(full, seed, false, in, stale), full, 1)
	if err := Check(got, 7, 3, commit, next, false, seed); err == nil {
		t.Fatal("a bundle with a stale list of the end state passed its check")
	}
	staleIn := maps.Clone(in)
	staleIn[optimM+big] = slices.Clone(staleIn[optimM+big])
	staleIn[optimM+big][0][0] ^= 1
	got = readThin(t, ThinKnown(full, seed, true, staleIn, out), leanOf(full), 2)
	if err := Check(got, 7, 3, commit, next, true, seed); err == nil {
		t.Fatal("a bundle with a stale list of the start state passed its check")
	}
	for _, lean := range []bool{true, false} {
		other := full
		if lean {
			other = leanOf(full)
		}
		honest := readThin(t, ThinKnown(full, seed, lean, in, out), other, 1)
		if err := Check(honest, 7, 3, commit, next, lean, seed); err != nil {
			t.Fatalf("lean %v: a bundle of the known lists: %v", lean, err)
		}
	}
}
