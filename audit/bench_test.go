package audit

import (
	"testing"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/safetensors"
)

// BenchmarkStateDigest is the commitment's cost per step on the default model: the digest of the
// whole model's state (parameters and both Adam moments), which the shards of a run take between
// them after every update. b.SetBytes makes the result a throughput.
func BenchmarkStateDigest(b *testing.B) {
	ts := defaultState(b)
	for b.Loop() {
		StateDigest(ts)
	}
}

// defaultState is the default model's whole state at initialisation, its bytes set as b's.
func defaultState(b *testing.B) []safetensors.Tensor {
	m, err := model.NewModel(model.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	m.Init(0)
	ts := model.CheckpointTensors(m.P, m.Opt)
	var n int64
	for _, t := range ts {
		n += 4 * int64(len(t.Data))
	}
	b.SetBytes(n)
	return ts
}

// BenchmarkOuterBaseLeaves: the Merkle leaves of the default model's global θ (6.5 M float32s),
// what a stage hashes at every outer step before it signs (outer.go); what it sends and receives
// is hashed alike.
func BenchmarkOuterBaseLeaves(b *testing.B) {
	g := make([]float32, 6478848)
	b.SetBytes(int64(4 * len(g)))
	for b.Loop() {
		OuterBaseLeaves(g)
	}
}

// BenchmarkTensorSumsGroups: the digest's value hashes with the groups' chaining values kept
// (what a worker of an audited job takes after every update, so that an audit need not hash its
// state again), against BenchmarkStateDigest's hashes alone on the same state.
func BenchmarkTensorSumsGroups(b *testing.B) {
	ts := defaultState(b)
	for b.Loop() {
		TensorSumsGroups(ts)
	}
}
