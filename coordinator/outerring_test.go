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
	"github.com/shoal-ml/shoal/proto"
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
			sent := map[int]int64{}    // step 2's bytes by worker: the outer step after step 1
			sigs := map[int][2]int64{} // and the signatures it made and checked in that step
			c := startCluster(t, spec, tc.R, false, func(i int, cfg *client.WorkerConfig) {
				cfg.OnStatus = func(s client.Status) {
					if s.LastStep != nil && s.LastStep.Step == 2 {
						mu.Lock()
						sent[i] = s.LastStep.BytesSent
						sigs[i] = [2]int64{s.OuterSigned, s.OuterVerified}
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
			// A batch of contributions is checked once, by the stage it was handed to; a batch of
			// averages by every other participant: far fewer signatures than segments sent.
			var signed, verified int64
			for _, s := range sigs {
				signed, verified = signed+s[0], verified+s[1]
			}
			contribs, averages, segments := outerRingBatches(spec.Model.Specs(), tc.R)
			t.Logf("%d signatures made and %d checked: %d batches of contributions and %d of averages, where one a segment sent would be %d", signed, verified, contribs, averages, segments)
			if signed != contribs+averages || verified != contribs+averages*int64(tc.R-1) {
				t.Errorf("%d signatures made and %d checked, want %d and %d: %d batches of contributions, %d of averages", signed, verified, contribs+averages, contribs+averages*int64(tc.R-1), contribs, averages)
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

// ringOwners are the owners of the segments of an outer step's first attempt among replicas
// 0 … R−1.
func ringOwners(R int) []int {
	ps := make([]int, R)
	for i := range ps {
		ps[i] = i
	}
	return model.OuterOwners(ps)
}

// outerRingBatches is how many batches the R participants of an outer step sign: of
// contributions, one a partner and tensor; of averages, one a tensor (an owner sends its averages
// once it holds them all); and how many segments they send, contributions and averages.
func outerRingBatches(specs []model.Spec, R int) (contribs, averages, segments int64) {
	owners := ringOwners(R)
	for _, s := range specs {
		owns := map[int]bool{} // the owners of a segment of this tensor that is not empty
		for k, q := range owners {
			if lo, hi := model.OuterSegment(s.Size(), len(owners), k); lo < hi {
				owns[q] = true
				segments += 2 * int64(R-1) // its contributions in, its average out
			}
		}
		contribs += int64(len(owns)) * int64(R-1)
		averages += int64(len(owns))
	}
	return contribs, averages, segments
}

// outerRingBytes is what participant me of R sends at an outer step of tensors specs (payload
// bytes, signatures included): segment k of each tensor to its owner (model.OuterOwners: a few
// segments each), and the average of each segment it owns to the R−1 others. Each segment
// travels with its place in the batch it was signed in (proto.OuterSigEntry, 12 bytes), and each
// batch — the contributions a sender hands an owner of a tensor, an owner's averages of a tensor
// — with its signature and a leaf an entry (64 + 32n bytes), to each partner it goes to. all is
// what it would send were every contribution sent whole to every other holder, with a signature
// each.
func outerRingBytes(specs []model.Spec, R, me int, int8 bool) (ring, all int64) {
	const entry, sig, leaf = 4 * proto.OuterSigEntryWords, 64, 32
	owners := ringOwners(R)
	for _, s := range specs {
		n := s.Size()
		l := model.OuterLayout{N: n, Int8: int8}
		all += int64(R-1) * int64(l.Bytes(0)+l.Bytes(1)+sig)
		owns := map[int]bool{} // the owners of a segment of this tensor that is not empty
		for k, q := range owners {
			lo, hi := model.OuterSegment(n, len(owners), k)
			if lo == hi {
				continue
			}
			owns[q] = true
			sl := model.OuterLayout{N: hi - lo, Int8: int8}
			b := int64(sl.Bytes(0) + sl.Bytes(1) + entry + leaf)
			if q == me {
				ring += int64(R-1) * b
			} else {
				ring += b
			}
		}
		for q := range owns {
			if q == me {
				ring += int64(R-1) * sig // its averages' batch, to every partner
			} else {
				ring += sig // its contributions' batch, to the owner
			}
		}
	}
	return ring, all
}
