package coordinator

import (
	"context"
	"encoding/json"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// TestRestoreReadsItsShard: a replan from a checkpoint has each stage download the checkpoint's
// shard of its own blocks, not the whole model. A pinned pipeline of two stages over three
// workers loses the holder of its second stage after step 5; the next plan, the standby in its
// place, restores both stages from the checkpoint after step 4. The coordinator serves exactly
// that checkpoint's two shards, each once — where each stage used to download the whole-model
// file, twice the bytes here and, in a plan of S stages and R outer-mode replicas, S·R times —
// and the job ends with the single process's parameters.
func TestRestoreReadsItsShard(t *testing.T) {
	spec := tinyJob(t, 12)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	_, ref := localReports(t, spec)
	var mu sync.Mutex
	restoredFrom := -1
	clusterConfig = func(cfg *Config) {
		cfg.OnEvent = func(kind, _, detail string) {
			if kind != "plan" {
				return
			}
			var d map[string]any
			json.Unmarshal([]byte(detail), &d)
			if kept, _ := d["kept"].(bool); !kept {
				mu.Lock()
				restoredFrom = int(d["from_step"].(float64))
				mu.Unlock()
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	c := startCluster(t, spec, 3, false)
	c.killHolderAfter(t, 5, 1)
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	mu.Lock()
	from := restoredFrom
	mu.Unlock()
	if from <= 0 {
		t.Fatalf("the last plan that loaded its shards started at step %d: want a restore from a checkpoint", from)
	}
	cks, err := c.srv.db.ListCheckpoints(context.Background(), mustJobID(t, c.srv))
	if err != nil {
		t.Fatal(err)
	}
	var shards []storage.Shard
	for _, ck := range cks {
		if int(ck.Step) == from {
			shards = ck.Shards
		}
	}
	if len(shards) != 2 {
		t.Fatalf("the checkpoint after step %d has shards %+v, want the two stages'", from, shards)
	}
	var want int64
	for _, sh := range shards {
		want += sh.Bytes
	}
	if got := c.srv.metrics.blobBytes.Load(); got != want {
		t.Fatalf("the coordinator served %d bytes of blobs, want %d: the checkpoint's two shards, each once", got, want)
	}
	t.Logf("restored from step %d: %d bytes served, the two stages' shards", from, want)
}
