package client

import (
	"context"
	"runtime"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// TestStageMemoryFlatAcrossSteps: a stage's memory between steps does not creep up. Routing
// sends each expert a different number of rows every micro-batch; an expert run alone kept
// buffers grown (with slack) to the most it had ever been sent, so a stage's heap rose step after
// step. Its local experts now share one arena of the micro-batch's assignments
// (ExpertDispatch.exchange), sized once.
func TestStageMemoryFlatAcrossSteps(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: 12 steps of the default model")
	}
	// The default model: the tiny one's rows are too few for the creep to stand out from the
	// collector's noise (0.4 MB against up to 0.15).
	cfg := model.DefaultConfig()
	p, err := NewLocalPipeline(cfg, 1, []int{2}, 0.1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const B, M = 16, 4
	var after []uint64
	for s := range 12 {
		x, y := testBatch(t, s, B, cfg.BlockSize)
		if _, _, _, err := p.Step(context.Background(), uint64(s), x, y, B, M, 1e-3, 1); err != nil {
			t.Fatal(err)
		}
		after = append(after, liveHeap())
	}
	runtime.KeepAlive(p)
	// After a few steps every buffer has its size; what is left is the collector's noise.
	grew := int64(after[len(after)-1]) - int64(after[3])
	t.Logf("the heap between steps: %v; %d bytes more from step 3 to step 11", after, grew)
	if grew > 3<<19 { // 1.5 MiB: the creep was 3.3–3.8 MB here, what is left up to 0.6
		t.Errorf("the heap between steps grew by %d bytes from step 3 to step 11: %v", grew, after)
	}
}

// liveHeap is the heap's live bytes: a collection, then HeapAlloc.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
