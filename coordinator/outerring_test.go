package coordinator

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestOuterRingEqualsLocal: R whole-model replicas (R = 2, 3 and 5, one worker each, real pion
// peers over loopback) take their outer steps as a reduce-scatter and an all-gather — each owning
// a segment of every tensor, averaging the others' signed contributions to it and sending the
// signed average back — and the losses and the final parameters are bit for bit those of one
// process (local/outer.go), float32 and int8 alike; with int8 a checkpoint in the middle gathers
// the average's error feedback from its owners. What the workers send for the outer step after
// step 1 (whole-model replicas send nothing else) is exactly the reduce-scatter's and the
// all-gather's bytes, about 2(R−1)/R of a contribution each (outerRingBytes), not (R−1) of it.
func TestOuterRingEqualsLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cluster runs")
	}
	for _, tc := range []struct {
		R        int
		compress string
	}{{2, "none"}, {2, "int8"}, {3, "int8"}, {3, "none"}, {5, "int8"}, {5, "none"}} {
		t.Run(fmt.Sprintf("%d-%s", tc.R, tc.compress), func(t *testing.T) {
			shares := make([]int, tc.R)
			for i := range shares {
				shares[i] = 2
			}
			spec := outerJob(t, 5, job.Sync{Every: 2, Compress: tc.compress, Batches: job.BatchesOwn}, shares...)
			spec.CheckpointEvery = 4
			var mu sync.Mutex
			sent := map[int]int64{} // step 2's bytes by worker: the outer step after step 1
			c := startCluster(t, spec, tc.R, false, func(i int, cfg *client.WorkerConfig) {
				cfg.OnStatus = func(s client.Status) {
					if s.LastStep != nil && s.LastStep.Step == 2 {
						mu.Lock()
						sent[i] = s.LastStep.BytesSent
						mu.Unlock()
					}
				}
			})
			c.run(t)
			c.finished(t, spec.Steps)
			mu.Lock()
			var total, ring, all int64
			for _, b := range sent {
				total += b
			}
			for me := range tc.R {
				r, a := outerRingBytes(spec.Model.Specs(), tc.R, me, tc.compress == "int8")
				ring, all = ring+r, all+a
			}
			mu.Unlock()
			t.Logf("%d replicas, %s: the outer step after step 1 sent %d bytes over %d workers (%.3g a replica); all to all would send %d (%.3g)", tc.R, tc.compress, total, len(sent), float64(total)/float64(tc.R), all, float64(all)/float64(tc.R))
			if len(sent) != tc.R || total != ring {
				t.Errorf("workers sent %d bytes for the outer step after step 1 (%d reported), want the reduce-scatter's and the all-gather's %d", total, len(sent), ring)
			}
			var want []local.Report
			res, err := local.Run(context.Background(), spec, local.Options{OnStep: func(r local.Report) { want = append(want, r) }})
			if err != nil {
				t.Fatal(err)
			}
			c.mu.Lock()
			sameReports(t, c.reports, want)
			c.mu.Unlock()
			sameFinalCheckpoint(t, c, spec.Steps, res.Model, "one process")
		})
	}
}

// outerRingBytes is what participant me of R sends at an outer step of tensors specs (payload
// bytes, signatures included): segment k of each tensor to its owner (model.OuterOwners: a few
// segments each), and the average of each segment it owns to the R−1 others, each with a
// signature (64 bytes); and what it would send were every contribution sent whole to every other
// holder.
func outerRingBytes(specs []model.Spec, R, me int, int8 bool) (ring, all int64) {
	const sig = 64
	owners := model.OuterOwners(func() []int {
		ps := make([]int, R)
		for i := range ps {
			ps[i] = i
		}
		return ps
	}())
	for _, s := range specs {
		n := s.Size()
		l := model.OuterLayout{N: n, Int8: int8}
		all += int64(R-1) * int64(l.Bytes(0)+l.Bytes(1)+sig)
		for k, q := range owners {
			lo, hi := model.OuterSegment(n, len(owners), k)
			if lo == hi {
				continue
			}
			sl := model.OuterLayout{N: hi - lo, Int8: int8}
			b := int64(sl.Bytes(0) + sl.Bytes(1) + sig)
			if q == me {
				ring += int64(R-1) * b
			} else {
				ring += b
			}
		}
	}
	return ring, all
}
