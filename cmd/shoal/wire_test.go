package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestTrainWorkersWireEqualsLocal: with int8 boundaries, `shoal train --workers 3` — two stages
// and an expert host holding half of MoE block 1's experts, three worker processes moving int8
// activations, expert rows and gradients over WebRTC — prints bitwise the losses of `shoal train`
// in one process, and ends on its parameters. The single process quantises at the same
// boundaries (model/wire.go), so the plan does not change the numbers.
func TestTrainWorkersWireEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts worker processes")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc to check for leftover processes")
	}
	t.Setenv("SHOAL_TEST_AS_MAIN", "1")
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, 6)
	spec, err := job.ReadFile(jobPath)
	if err != nil {
		t.Fatal(err)
	}
	spec.Wire = model.Wire{Activations: model.Int8, Gradients: model.Int8}
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}, Experts: []job.ExpertShard{{Block: 1, Experts: []int{1, 3}, Host: 0}}}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(jobPath, b, 0o644); err != nil {
		t.Fatal(err)
	}

	got, _ := trainBothWays(t, jobPath, dir)
	for i := range got {
		if got[i]["bytes_sent"] <= 0 {
			t.Errorf("step %d: the workers sent %v bytes", i, got[i]["bytes_sent"])
		}
	}
	name := local.CheckpointName(spec.Steps)
	one, _, err := model.LoadModel(filepath.Join(dir, "one", name))
	if err != nil {
		t.Fatal(err)
	}
	cluster, _, err := model.LoadModel(filepath.Join(dir, "cluster", name))
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range one.P.Tensors {
		for j, v := range tt.Data {
			if w := cluster.P.Tensors[i].Data[j]; math.Float32bits(w) != math.Float32bits(v) {
				t.Fatalf("final %s[%d]: cluster %v, one process %v", tt.Name, j, w, v)
			}
		}
	}
	assertNoChildren(t)
}
