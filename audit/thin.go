package audit

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"
	"unsafe"

	b3 "github.com/shoal-ml/shoal/internal/blake3"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Thin evidence (proto.Audit.Sample) is evidence whose large Adam moments, and end state where
// it carries one, are sampled.
//
// A lean bundle's start state is 12 bytes a parameter: the parameters and both moments. The
// parameters are needed whole — every one enters the forward pass, so the gradient, the
// tensors sent and the report can be recomputed only from all of them. The moments enter only
// AdamW, element by element. So a thin bundle carries the parameters whole and, of each large
// parameter's moments, only some groups of ThinGroup bytes (the same groups of m and v, one in
// ThinEvery, drawn from the audit's seed after the worker committed to the step), with the
// BLAKE3 chaining values of all the groups; and the chaining values of every large tensor of the
// end state. The state digests are unchanged — a tensor's value hash is BLAKE3, whose tree the
// chaining values open at the level of groups (internal/blake3.Groups) — so:
//
//   - the start state is bound to the commitment whole: the parameters by their values, each
//     sampled moment by its chaining values, which must give its hash, and its sampled groups,
//     which must give their chaining values;
//   - the forward and backward passes are recomputed from the whole parameters and checked bit
//     for bit as in a lean audit (what was sent, the report with every tensor's ‖g‖²);
//   - the update is recomputed on the sampled groups alone: their end values (parameters and
//     moments) must give the end chaining values the worker uploaded, which must give the end
//     state's digest the worker committed to before the audit.
//
// Evidence that is not lean (a worker of another kernel family, judged within tolerances)
// carries the end state's large tensors as the same groups, bound the same way, and the
// tolerances read those groups (Bundle.view).
//
// What it gives up: an update that is wrong only outside the sampled groups — a change of a few
// parameters beyond what the step computed, in a group not drawn — passes a thin audit. Every
// cheat that moves the gradient, the clip factor, the learning rate or the moments' decay moves
// every group and is caught as before; a change confined to one group of a tensor is caught by
// an audit of that step with probability 1/ThinEvery instead of 1 (docs/design.md, "Verification
// and credit"). For that, an audited MoE stage of the default job uploads about 4.5 bytes a
// parameter instead of 12 (docs/benchmarks.md, "Audits").

const (
	// ThinGroup is the bytes of a group of a thin bundle's large tensors: 16 chunks of BLAKE3
	// (4,096 float32 values), small enough that a sample of one group in ThinEvery spreads over
	// every tensor, large enough that the chaining values are 0.2% of a tensor.
	ThinGroup       = thinGroupChunks * 1024
	thinGroupChunks = 16
	// ThinEvery: a thin bundle carries one group in ThinEvery (at least one) of each large
	// parameter's moments.
	ThinEvery = 16
)

// thinGroups is the number of groups of a tensor of n float32 values when it is large (more
// than one group), else 0: a small tensor travels whole.
func thinGroups(n int) int {
	if 4*n <= ThinGroup {
		return 0
	}
	return (4*n + ThinGroup - 1) / ThinGroup
}

// SampledGroups is which groups of parameter param's state tensors (the parameter and its
// moments, each of groups groups) a thin bundle of the audit seeded with seed carries, in order: the worker and the coordinator
// draw the same from the seed, which the coordinator chose after the worker committed.
func SampledGroups(seed uint64, param string, groups int) []int {
	if groups <= 0 {
		return nil
	}
	h := fnv.New64a()
	h.Write([]byte(param))
	r := rand.New(rand.NewPCG(seed, h.Sum64()))
	k := min(groups, (groups+ThinEvery-1)/ThinEvery)
	// Floyd's sample: k distinct draws without a permutation of all the groups.
	picked := make(map[int]bool, k)
	out := make([]int, 0, k)
	for j := groups - k; j < groups; j++ {
		x := r.IntN(j + 1)
		if picked[x] {
			x = j
		}
		picked[x] = true
		out = append(out, x)
	}
	slices.Sort(out)
	return out
}

// momentOf returns the parameter whose Adam moment name is, if it is one.
func momentOf(name string) (string, bool) {
	for _, p := range []string{optimM, optimV} {
		if s, ok := strings.CutPrefix(name, p); ok {
			return s, true
		}
	}
	return "", false
}

// paramOf is the parameter a state tensor belongs to: itself, or the parameter of a moment.
func paramOf(name string) string {
	if p, ok := momentOf(name); ok {
		return p
	}
	return name
}

// span is where a sampled group of a tensor's bytes lies, [lo, hi).
type span struct{ lo, hi int }

// spans is where the groups of seed's sample of state tensor name, of n bytes, lie, in order:
// none for a small tensor. A group's first chunk is chunk lo/1024 of the tensor.
func spans(seed uint64, name string, n int) []span {
	groups := thinGroups(n / 4)
	var out []span
	for _, j := range SampledGroups(seed, paramOf(name), groups) {
		out = append(out, span{j * ThinGroup, min(n, (j+1)*ThinGroup)})
	}
	return out
}

// sampledBytes is the bytes of the sampled groups of a tensor of n float32 values.
func sampledBytes(seed uint64, name string, n int) int64 {
	var total int64
	for _, g := range spans(seed, name, 4*n) {
		total += int64(g.hi - g.lo)
	}
	return total
}

// Thin returns the thin evidence (Sample seed) of full, a worker's whole evidence of a step: its
// start state with the large moments sampled, the chaining values of those moments and of every
// large tensor of its end state (full.StateOut; none for an unapplied step), and the traffic it
// received. lean leaves out the end state and the traffic sent, as lean evidence does; otherwise
// (a recomputation across kernel families, compared within tolerances) the end state's large
// tensors travel as their sampled groups too, and the traffic sent whole. It shares full's
// tensors, so it is valid only while they do not change; it hashes the states' large tensors once
// more (about 12 bytes a parameter of BLAKE3, a few milliseconds a stage here).
func Thin(full *Bundle, seed uint64, lean bool) *Bundle { return ThinKnown(full, seed, lean, nil, nil) }

// ThinKnown is Thin with the groups' chaining values the worker already holds: in of the start
// state's tensors, out of the end state's, by name (TensorSumsGroups took them with the state
// digests it committed to). A large tensor either map lacks, or holds a list of the wrong length
// for, is hashed here as Thin does. The worker hashed its state with these lists on the way to
// each digest, so an audit need not hash it again (12 bytes a parameter: about 25 ms for a whole
// replica of the default model). A list that is not of the tensor's values makes the bundle
// fail its check, as any evidence that disagrees with what was committed does.
func ThinKnown(full *Bundle, seed uint64, lean bool, in, out map[string][][32]byte) *Bundle {
	if seed == 0 {
		panic("audit: thin evidence of seed 0")
	}
	b := &Bundle{Step: full.Step, PlanVersion: full.PlanVersion, Lean: lean, Sample: seed,
		StateIn: full.StateIn, Recv: full.Recv,
		InCVs:  groupsKnown(full.StateIn, in, func(name string) bool { _, ok := momentOf(name); return ok }),
		OutCVs: groupsKnown(full.StateOut, out, func(string) bool { return true })}
	if !lean {
		b.StateOut, b.Sent = full.StateOut, full.Sent
	}
	return b
}

// view is what of a state tensor's values a comparison reads: where b is thin and the tensor
// large, its sampled groups one after another; else all of them.
func (b *Bundle) view(name string, data []float32) []float32 {
	if b.Sample == 0 || thinGroups(len(data)) == 0 {
		return data
	}
	var out []float32
	for _, g := range spans(b.Sample, name, 4*len(data)) {
		out = append(out, data[g.lo/4:g.hi/4]...)
	}
	return out
}

// groupsOf is the groups' chaining values of each large tensor of ts that pick takes, in
// parallel (one tensor per goroutine, GOMAXPROCS at once).
func groupsOf(ts []safetensors.Tensor, pick func(name string) bool) map[string][][32]byte {
	return groupsKnown(ts, nil, pick)
}

// groupsKnown is groupsOf taking each tensor's list from known where it is there with the
// tensor's number of groups, and hashing the rest.
func groupsKnown(ts []safetensors.Tensor, known map[string][][32]byte, pick func(name string) bool) map[string][][32]byte {
	m := make(map[string][][32]byte)
	var idx []int
	for i, t := range ts {
		n := thinGroups(len(t.Data))
		if n == 0 || !pick(t.Name) {
			continue
		}
		if c, ok := known[t.Name]; ok && len(c) == n {
			m[t.Name] = c
			continue
		}
		idx = append(idx, i)
	}
	out := make([][][32]byte, len(idx))
	eachParallel(len(idx), func(k int, buf *[]byte) {
		_, out[k] = b3.Groups(proto.Float32Bytes(ts[idx[k]].Data, buf), thinGroupChunks)
	})
	for k, i := range idx {
		m[ts[i].Name] = out[k]
	}
	return m
}

// thinSums is the value hash of each tensor of ts, as StateDigest takes them, where the tensors
// named in cvs are known only by their groups' chaining values and the groups of seed's sample:
// those sampled must give their chaining values (the rest of their values is not read), and the
// chaining values give the hash. It fails on a chaining value list of the wrong length or a
// sampled group that does not give its entry.
func thinSums(ts []safetensors.Tensor, cvs map[string][][32]byte, seed uint64) ([][ValueSize]byte, error) {
	sums := make([][ValueSize]byte, len(ts))
	var whole []safetensors.Tensor
	var wholeAt []int
	used := 0
	for i, t := range ts {
		c, ok := cvs[t.Name]
		if !ok {
			whole = append(whole, t)
			wholeAt = append(wholeAt, i)
			continue
		}
		used++
		n := thinGroups(len(t.Data))
		if n == 0 || len(c) != n {
			return nil, fmt.Errorf("%s: %d chaining values for %d groups", t.Name, len(c), n)
		}
		var buf []byte
		b := proto.Float32Bytes(t.Data, &buf)
		for _, g := range spans(seed, t.Name, len(b)) {
			j := g.lo / ThinGroup
			if b3.GroupCV(b[g.lo:g.hi], uint64(j*thinGroupChunks)) != c[j] {
				return nil, fmt.Errorf("%s: group %d is not the one its chaining value names", t.Name, j)
			}
		}
		root, err := b3.RootOf(c)
		if err != nil {
			return nil, err
		}
		sums[i] = root
	}
	if used != len(cvs) {
		return nil, fmt.Errorf("chaining values of %d tensors the state does not hold", len(cvs)-used)
	}
	for k, s := range valueSums(whole) {
		sums[wholeAt[k]] = s
	}
	return sums, nil
}

// thinStateDigest is StateDigest of ts, whose tensors named in cvs are known by their groups
// (thinSums).
func thinStateDigest(ts []safetensors.Tensor, cvs map[string][][32]byte, seed uint64) (string, error) {
	sums, err := thinSums(ts, cvs, seed)
	if err != nil {
		return "", err
	}
	return composeState(ts, sums), nil
}

// checkThinEnd decides whether the end state a recomputation from thin evidence reached (out:
// exact on the sampled groups of the large tensors and on the small tensors, whose moments
// travelled whole) is the one the worker committed to (next): the worker's end chaining values
// must be one per group of every large tensor, give its hash, and be given by the recomputation's
// sampled groups; with the small tensors' values, they must give next.
func checkThinEnd(out []safetensors.Tensor, b *Bundle, next string) string {
	for _, t := range out {
		if thinGroups(len(t.Data)) > 0 {
			if _, ok := b.OutCVs[t.Name]; !ok {
				return fmt.Sprintf("no chaining values of the end state's %s", t.Name)
			}
		}
	}
	d, err := thinStateDigest(out, b.OutCVs, b.Sample)
	if err != nil {
		return "the state after the update differs from the recomputation: " + err.Error()
	}
	if d != next {
		return "the state after the update differs from the recomputation (the digest committed to next)"
	}
	return ""
}

// cvBytes is cvs as the bytes of a bundle's payload.
func cvBytes(cvs [][32]byte) []byte {
	if len(cvs) == 0 {
		return nil
	}
	return unsafe.Slice(&cvs[0][0], 32*len(cvs))
}
