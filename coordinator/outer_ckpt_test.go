package coordinator

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// TestOuterShardLayout: in outer mode a stage of replica r may upload only its replica's part
// (θ_r, its moments, its error feedback) and, on the first replica, the global part — the names
// of another replica's state, or the global part from another replica, are refused before
// anything is read; and a whole checkpoint needs every replica's part.
func TestOuterShardLayout(t *testing.T) {
	cfg := model.TinyConfig()
	specs := cfg.StageSpecs(0, 1, true)
	meta := model.CheckpointMeta(cfg, 4)
	header := func(names ...string) safetensors.Header {
		h := safetensors.Header{Meta: meta}
		for _, n := range names {
			h.Tensors = append(h.Tensors, safetensors.Entry{Name: n, Shape: specs[0].Shape})
		}
		return h
	}
	name := specs[0].Name
	r1 := newLayoutPrefixed(cfg, 4, specs, outerPrefixes(false, []int{1}, true, false))
	r0 := newLayoutPrefixed(cfg, 4, specs, outerPrefixes(true, []int{0}, true, false))
	for _, tc := range []struct {
		l     *ckptLayout
		names []string
		ok    bool
	}{
		{r1, []string{model.ReplicaPrefix(1) + name, model.ReplicaPrefix(1) + "optim.m." + name, model.ReplicaPrefix(1) + model.ReplicaErrPrefix + name}, true},
		{r1, []string{name}, false},                             // the global θ from replica 1
		{r1, []string{model.OuterMomentumPrefix + name}, false}, // the outer momentum from replica 1
		{r1, []string{model.ReplicaPrefix(0) + name}, false},    // replica 0's state from replica 1
		{r1, []string{"optim.m." + name}, false},                // step mode's names
		{r0, []string{name, model.OuterErrPrefix + name, model.ReplicaPrefix(0) + name}, true},
		{r0, []string{model.ReplicaPrefix(1) + name}, false},
	} {
		err := tc.l.checkHeader(header(tc.names...), false)
		if (err == nil) != tc.ok {
			t.Errorf("%v: %v, want ok %v", tc.names, err, tc.ok)
		}
	}
	// The whole checkpoint of two replicas: every replica's part and the global one, exactly.
	whole := newLayoutPrefixed(cfg, 4, specs, outerPrefixes(true, []int{0, 1}, false, false))
	var all []string
	for _, p := range outerPrefixes(true, []int{0, 1}, false, false) {
		all = append(all, p+name)
	}
	if err := whole.checkHeader(header(all...), true); err == nil {
		t.Error("a checkpoint with one tensor of each part taken as complete")
	}
	if n := len(whole.names); n != len(specs)*len(outerPrefixes(true, []int{0, 1}, false, false)) {
		t.Errorf("%d names in the whole layout", n)
	}
	// After a replica was dropped (sched.DropReplica) a checkpoint holds the replicas left, by
	// index, and the first of them uploads the global part: replica 2's stage may then, and
	// replica 0's state from it is still refused.
	for names, want := range map[string]string{
		"stage-0 r2-stage-0":         "[0 2]",
		"r1-stage-0 r1-stage-1":      "[1]",
		"r3-stage-0 r1-stage-0":      "[1 3]",
		"stage-0 stage-1 r1-stage-0": "[0 1]",
	} {
		var shards []storage.Shard
		for _, n := range strings.Fields(names) {
			shards = append(shards, storage.Shard{Name: n})
		}
		if got := fmt.Sprint(outerReplicas(shards)); got != want {
			t.Errorf("shards %s: replicas %s, want %s", names, got, want)
		}
	}
	r2 := newLayoutPrefixed(cfg, 4, specs, outerPrefixes(true, []int{2}, true, false))
	if err := r2.checkHeader(header(name, model.OuterMomentumPrefix+name, model.ReplicaPrefix(2)+name), false); err != nil {
		t.Errorf("the global part from replica 2, asked for: %v", err)
	}
	if err := r2.checkHeader(header(model.ReplicaPrefix(0)+name), false); err == nil {
		t.Error("replica 0's state from replica 2 accepted")
	}
}
