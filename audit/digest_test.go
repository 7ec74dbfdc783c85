package audit

import (
	"testing"

	"github.com/shoal-ml/shoal/safetensors"
)

// TestComposeState: a state digest composed from its tensors' digests (TensorSums) is
// StateDigest's, whatever their order; a missing or malformed digest is an error, and a changed
// value changes it.
func TestComposeState(t *testing.T) {
	ts := []safetensors.Tensor{
		{Name: "b", Shape: []int{2}, Data: []float32{1, 2}},
		{Name: "a", Shape: []int{1, 3}, Data: []float32{3, 4, 5}},
	}
	want := StateDigest(ts)
	sums := map[string]string{}
	for _, d := range TensorSums(ts) {
		sums[d.Key] = d.Digest
	}
	got, err := ComposeState([]safetensors.Tensor{{Name: "a", Shape: []int{1, 3}}, {Name: "b", Shape: []int{2}}}, sums)
	if err != nil || got != want {
		t.Fatalf("ComposeState = %s, %v; StateDigest %s", got, err, want)
	}
	if _, err := ComposeState(append(ts, safetensors.Tensor{Name: "c"}), sums); err == nil {
		t.Error("a tensor without a digest composed")
	}
	sums["a"] = "not-a-digest"
	if _, err := ComposeState(ts, sums); err == nil {
		t.Error("a malformed digest composed")
	}
	ts[1].Data[0] = 6
	if StateDigest(ts) == want {
		t.Error("a changed value left the digest")
	}
}
