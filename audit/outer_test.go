package audit

import (
	"crypto/ed25519"
	crand "crypto/rand"
	"errors"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestMerkle: every leaf's path leads to the root, for every tree size up to 17; a changed leaf,
// another index, a path cut short or lengthened, a changed hash in it do not.
func TestMerkle(t *testing.T) {
	for n := 1; n <= 17; n++ {
		chunks := make([][]byte, n)
		for i := range chunks {
			chunks[i] = []byte{byte(i), byte(n)}
		}
		leaves := make([][32]byte, n)
		for i, c := range chunks {
			leaves[i] = merkleLeaf(c)
		}
		root := MerkleRoot(leaves)
		for i := range n {
			path := MerklePath(leaves, i)
			if !MerkleVerify(root, leaves[i], i, n, path) {
				t.Fatalf("n %d: leaf %d's path does not verify", n, i)
			}
			if MerkleVerify(root, merkleLeaf([]byte{byte(i), byte(n), 0}), i, n, path) {
				t.Fatalf("n %d: a changed leaf %d verifies", n, i)
			}
			if n > 1 && MerkleVerify(root, leaves[i], i^1, n, path) && leaves[i] != leaves[i^1] {
				t.Fatalf("n %d: leaf %d verifies as leaf %d", n, i, i^1)
			}
			if len(path) > 0 {
				if MerkleVerify(root, leaves[i], i, n, path[:len(path)-1]) {
					t.Fatalf("n %d: leaf %d verifies with a path cut short", n, i)
				}
				bad := append([][]byte(nil), path...)
				bad[0] = append([]byte(nil), bad[0]...)
				bad[0][5] ^= 1
				if MerkleVerify(root, leaves[i], i, n, bad) {
					t.Fatalf("n %d: leaf %d verifies with a changed path", n, i)
				}
			}
			if MerkleVerify(root, leaves[i], i, n, append(path, make([]byte, 32))) {
				t.Fatalf("n %d: leaf %d verifies with a path too long", n, i)
			}
		}
	}
}

// outerFixture is a tensor's global θ, a replica's θ_r an honest round could reach, the job, and
// a sender's key.
func outerFixture(t *testing.T, n int) (job.Spec, []float32, []float32, ed25519.PublicKey, ed25519.PrivateKey) {
	t.Helper()
	spec := job.Default()
	spec.Steps, spec.Warmup = 40, 0
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	g, r := make([]float32, n), make([]float32, n)
	for i := range g {
		g[i] = float32(math.Sin(float64(i))) * 0.1
		r[i] = g[i] - float32(math.Cos(float64(i)))*float32(spec.LR)*0.5
	}
	pub, key, err := ed25519.GenerateKey(crand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return spec, g, r, pub, key
}

// batch is a sender's signature of a batch of three entries, the one under test second among
// them, and that entry's place and path.
type batch struct {
	sig            []byte
	entry, entries int
	path           [][]byte
}

// signBatch signs entry e of tensor 5 from replica 1 of job "job" at plan 3, between two others.
func signBatch(key ed25519.PrivateKey, step uint64, compressed, average bool, e OuterEntry) batch {
	before, after := e, e
	before.Tensor, after.Tensor = 4, 6
	leaves := [][32]byte{before.Leaf(), e.Leaf(), after.Leaf()}
	msg := OuterBatchMessage("job", 3, step, 1, compressed, average, len(leaves), MerkleRoot(leaves))
	return batch{sig: ed25519.Sign(key, msg), entry: 1, entries: len(leaves), path: MerklePath(leaves, 1)}
}

// sign is what a sender does with parts of a tensor of g's size: its leaves and signature.
func sign(t *testing.T, spec job.Spec, key ed25519.PrivateKey, step uint64, g []float32, parts [2][]byte, compressed bool) ([][32]byte, [][32]byte, batch) {
	t.Helper()
	base := OuterBaseLeaves(g)
	given, err := OuterGivenLeaves(len(g), parts, compressed)
	if err != nil {
		t.Fatal(err)
	}
	return base, given, signBatch(key, step, compressed, false, OuterEntry{Tensor: 5, Segment: [2]int{0, len(base)}, Base: MerkleRoot(base), Given: MerkleRoot(given)})
}

func evidenceOf(g []float32, parts [2][]byte, compressed bool, base, given [][32]byte, b batch, c int) *proto.OuterEvidence {
	return &proto.OuterEvidence{Sender: "w1", Tensor: 5, Chunk: c, Segment: [2]int{0, len(base)}, Signature: b.sig,
		Base: OuterBaseChunk(nil, g, c), BasePath: MerklePath(base, c),
		Given: OuterGivenChunk(nil, len(g), parts, compressed, c), GivenPath: MerklePath(given, c),
		Entry: b.entry, Entries: b.entries, EntryPath: b.path}
}

// TestCheckOuterEvidence: a signed chunk beyond the bound convicts its sender, float32 and int8
// alike; evidence of a chunk within it, a chunk changed after signing, another step, another
// sender's key, another chunk's path or a base the sender did not sign from convicts the accuser.
func TestCheckOuterEvidence(t *testing.T) {
	const n = 3*model.OuterChunk + 41
	const step = 6
	spec, g, r, pub, key := outerFixture(t, n)
	other, _, _ := ed25519.GenerateKey(crand.Reader)
	b := NewOuterBound(spec, step, false)
	if _, _, _, ok := b.Check(g, r); !ok {
		t.Fatal("the honest fixture is beyond the bound")
	}
	poisoned := append([]float32(nil), r...)
	poisoned[2*model.OuterChunk+7] = 1e30
	parts := [2][]byte{proto.AppendFloat32s(nil, poisoned)}
	base, given, sig := sign(t, spec, key, step, g, parts, false)
	check := func(e *proto.OuterEvidence, st uint64, k []byte) error {
		return CheckOuterEvidence(spec, "job", 3, st, 1, e, k, n)
	}
	if err := check(evidenceOf(g, parts, false, base, given, sig, 2), step, pub); !errors.Is(err, ErrOuterSenderFalse) {
		t.Fatalf("the poisoned chunk: %v, want the sender convicted", err)
	}
	for name, tc := range map[string]struct {
		e   func() *proto.OuterEvidence
		st  uint64
		key []byte
	}{
		"honest chunk": {func() *proto.OuterEvidence { return evidenceOf(g, parts, false, base, given, sig, 1) }, step, pub},
		"last chunk":   {func() *proto.OuterEvidence { return evidenceOf(g, parts, false, base, given, sig, 3) }, step, pub},
		"changed": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 1)
			copy(e.Given, proto.AppendFloat32s(nil, []float32{1e30}))
			return e
		}, step, pub},
		"another step": {func() *proto.OuterEvidence { return evidenceOf(g, parts, false, base, given, sig, 2) }, step + 4, pub},
		"another key":  {func() *proto.OuterEvidence { return evidenceOf(g, parts, false, base, given, sig, 2) }, step, other},
		"no key":       {func() *proto.OuterEvidence { return evidenceOf(g, parts, false, base, given, sig, 2) }, step, nil},
		"wrong path": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 2)
			e.GivenPath = MerklePath(given, 1)
			return e
		}, step, pub},
		"other base": {func() *proto.OuterEvidence {
			h := append([]float32(nil), g...)
			h[2*model.OuterChunk] = 1e30 // a receiver claiming a global θ that makes the chunk look bad
			return evidenceOf(h, parts, false, OuterBaseLeaves(h), given, sig, 2)
		}, step, pub},
		"another entry": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 2)
			e.Entry = 2
			return e
		}, step, pub},
		"fewer entries": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 2)
			e.Entries, e.EntryPath = 2, e.EntryPath[:1]
			return e
		}, step, pub},
		"another tensor": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 2)
			e.Tensor = 4 // the batch's first entry, whose roots are this one's
			return e
		}, step, pub},
		"beyond the tensor": {func() *proto.OuterEvidence {
			e := evidenceOf(g, parts, false, base, given, sig, 3)
			e.Chunk = 4
			return e
		}, step, pub},
	} {
		if err := check(tc.e(), tc.st, tc.key); !errors.Is(err, ErrOuterAccuserFalse) {
			t.Errorf("%s: %v, want the accuser convicted", name, err)
		}
	}

	// int8: the chunk as it crossed is its scale and codes; a poisoned scale convicts, and so
	// does a code of -128 that the sender signed.
	codes := make([]byte, 0, n)
	scales := make([]byte, 0, 4*(n/model.OuterChunk))
	for row := 0; row < n/model.OuterChunk; row++ {
		s := float32(1e-6)
		if row == 1 {
			s = 1e30
		}
		scales = proto.AppendFloat32s(scales, []float32{s})
		for range model.OuterChunk {
			codes = append(codes, 3)
		}
	}
	last := proto.AppendFloat32s(nil, []float32{1e-6})
	for range n % model.OuterChunk {
		last = append(last, 0x80)
	}
	i8 := [2][]byte{append(scales, codes...), last}
	base, given, sig = sign(t, spec, key, step, g, i8, true)
	spec.Sync.Compress = "int8"
	for c, want := range []error{ErrOuterAccuserFalse, ErrOuterSenderFalse, ErrOuterAccuserFalse, ErrOuterSenderFalse} {
		if err := check(evidenceOf(g, i8, true, base, given, sig, c), step, pub); !errors.Is(err, want) {
			t.Errorf("int8 chunk %d: %v, want %v", c, err, want)
		}
	}
}

// TestOuterGivenLeaves: parts that are not of the tensor are refused before anything is hashed.
func TestOuterGivenLeaves(t *testing.T) {
	const n = model.OuterChunk + 3
	for _, tc := range []struct {
		parts      [2][]byte
		compressed bool
	}{
		{[2][]byte{make([]byte, 4*n-4)}, false},
		{[2][]byte{make([]byte, 4*n), {1}}, false},
		{[2][]byte{make([]byte, 4+model.OuterChunk), nil}, true},
		{[2][]byte{make([]byte, 4+model.OuterChunk), make([]byte, 4+4)}, true},
	} {
		if _, err := OuterGivenLeaves(n, tc.parts, tc.compressed); err == nil {
			t.Errorf("parts of %d and %d bytes (int8 %v) taken for %d values", len(tc.parts[0]), len(tc.parts[1]), tc.compressed, n)
		}
	}
}

// TestCheckOuterSegmentEvidence: evidence of a segment — the chunks [1, 3) of a tensor of four,
// as a reduce-scatter's owner receives them — and of an owner's signed average. A poisoned
// chunk of the segment convicts its sender, and an honest one the accuser; a segment other than
// the one signed convicts the accuser. An average beyond twice the bound convicts its owner, one
// within it (though beyond the contributions' bound) the accuser, and so does an average shown
// as a contribution, which its owner never signed as one.
func TestCheckOuterSegmentEvidence(t *testing.T) {
	const n = 3*model.OuterChunk + 41
	const step = 6
	spec, g, r, pub, key := outerFixture(t, n)
	seg := [2]int{1, 3}
	lo, hi := seg[0]*model.OuterChunk, seg[1]*model.OuterChunk
	gs := g[lo:hi]
	check := func(e *proto.OuterEvidence) error { return CheckOuterEvidence(spec, "job", 3, step, 1, e, pub, n) }
	signed := func(x []float32, average bool) ([][32]byte, [][32]byte, batch) {
		parts := [2][]byte{proto.AppendFloat32s(nil, x)}
		base := OuterBaseLeaves(gs)
		given, err := OuterGivenLeaves(len(x), parts, false)
		if err != nil {
			t.Fatal(err)
		}
		return base, given, signBatch(key, step, false, average, OuterEntry{Tensor: 5, Segment: seg, Base: MerkleRoot(base), Given: MerkleRoot(given)})
	}
	evidence := func(x []float32, base, given [][32]byte, b batch, c int, average bool) *proto.OuterEvidence {
		return &proto.OuterEvidence{Sender: "w1", Tensor: 5, Chunk: seg[0] + c, Segment: seg, Average: average, Signature: b.sig,
			Base: OuterBaseChunk(nil, gs, c), BasePath: MerklePath(base, c),
			Given: OuterBaseChunk(nil, x, c), GivenPath: MerklePath(given, c),
			Entry: b.entry, Entries: b.entries, EntryPath: b.path}
	}
	x := append([]float32(nil), r[lo:hi]...)
	x[model.OuterChunk+3] = 1e30
	base, given, sig := signed(x, false)
	if err := check(evidence(x, base, given, sig, 1, false)); !errors.Is(err, ErrOuterSenderFalse) {
		t.Errorf("a poisoned chunk of the segment: %v, want the sender convicted", err)
	}
	if err := check(evidence(x, base, given, sig, 0, false)); !errors.Is(err, ErrOuterAccuserFalse) {
		t.Errorf("an honest chunk of the segment: %v, want the accuser convicted", err)
	}
	e := evidence(x, base, given, sig, 1, false)
	e.Segment = [2]int{1, 4}
	if err := check(e); !errors.Is(err, ErrOuterAccuserFalse) {
		t.Errorf("another segment than the one signed: %v, want the accuser convicted", err)
	}

	// An average: a pseudo-gradient, judged against twice the bound.
	b := NewOuterBound(spec, step, false)
	_, _, limit, _ := b.Check(gs[:model.OuterChunk], gs[:model.OuterChunk])
	avg := make([]float32, hi-lo)
	avg[3] = float32(1.5 * limit)           // beyond a contribution's bound, within an average's
	avg[model.OuterChunk+3] = float32(1e30) // beyond both
	base, given, sig = signed(avg, true)
	if err := check(evidence(avg, base, given, sig, 1, true)); !errors.Is(err, ErrOuterSenderFalse) {
		t.Errorf("a poisoned average: %v, want its owner convicted", err)
	}
	if err := check(evidence(avg, base, given, sig, 0, true)); !errors.Is(err, ErrOuterAccuserFalse) {
		t.Errorf("an average within twice the bound: %v, want the accuser convicted", err)
	}
	if err := check(evidence(avg, base, given, sig, 1, false)); !errors.Is(err, ErrOuterAccuserFalse) {
		t.Errorf("an average shown as a contribution: %v, want the accuser convicted", err)
	}
}
