package coordinator

import (
	"fmt"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/sched"
)

// A restore reads the checkpoint's shards that hold the stage's tensors, not a file of the whole
// model. A checkpoint is the shards its stages uploaded (upload.go checked each: the shard's
// tensors exactly, finite values), so a worker whose stage is cut as one of them was reads that
// one shard: its own state, 12 bytes a parameter of its blocks in step mode. The whole-model file
// it read before held every stage's state and, in outer mode, every replica's: a replan of the 1B
// job's fleet had each of its thousands of workers download the whole model once per replica
// (terabytes each), where the simulator — and any plan — charges a stage its own shard
// (sched.ReplanSeconds). Nor does the coordinator assemble that file for a restore any more: only
// an export, the sample and `shoal train --out` ask for it (assembled).
//
// restoreFor picks, for one Assign, few of the checkpoint's shards that hold every tensor its
// restore reads, greedily: of the tensors still unread, the one with the fewest holders, and of
// its first few holders the one that holds the most of them (the smallest among equals). The
// client holds the coordinator to
// that (client: restore): each blob it is sent must add a tensor the blobs before it did not, no
// more blobs than tensors are fetched, and no more bytes than one checkpoint of the job holds.

// restoreFor is ref (the restore point: every shard blob of the checkpoint, restorePoint) narrowed
// to the blobs a's shard reads.
func (j *jobRun) restoreFor(ref *proto.CheckpointRef, a *proto.Assign) *proto.CheckpointRef {
	if ref == nil || len(ref.Blobs) <= 1 {
		return ref
	}
	want := restoreNames(j.spec, int(ref.Step), a)
	if len(want) == 0 {
		return ref
	}
	// holders: each wanted tensor's blobs, in the checkpoint's order (restorePoint's index: an
	// Assign looks up its own tensors, not every name of a checkpoint of thousands of shards).
	holders := make(map[string][]string, len(want))
	for n := range want {
		if hs := j.blobHolders[n]; len(hs) > 0 {
			holders[n] = hs
		}
	}
	left := map[string]bool{}
	for n := range holders {
		left[n] = true
	}
	out := &proto.CheckpointRef{Step: ref.Step}
	for len(left) > 0 {
		// Of the tensors still unread, the one with the fewest holders (a replica's own part
		// has one; the global θ, which every replica's stage holds, hundreds on a fleet), and
		// of its first few holders the one that holds the most of them, the smallest among
		// equals.
		first := ""
		for n := range left {
			if first == "" || len(holders[n]) < len(holders[first]) || len(holders[n]) == len(holders[first]) && n < first {
				first = n
			}
		}
		best, most := "", 0
		for _, sha := range holders[first][:min(len(holders[first]), restoreCandidates)] {
			k := 0
			for _, n := range j.blobNames[sha] {
				if left[n] {
					k++
				}
			}
			// Among equals the smaller blob: less to download beside what is read.
			if k > most || k == most && len(j.blobNames[sha]) < len(j.blobNames[best]) {
				best, most = sha, k
			}
		}
		out.Blobs = append(out.Blobs, best)
		for _, n := range j.blobNames[best] {
			delete(left, n)
		}
	}
	if len(out.Blobs) == 0 {
		return ref // no shard holds any of them: the worker's restore says what it lacks
	}
	return out
}

// restoreCandidates is how many of a tensor's holders restoreFor weighs when it picks the next blob.
const restoreCandidates = 8

// restoreNames are the names in a checkpoint after step of the tensors a's shard reads when it
// restores from it (client: restore): its tensors — a stage's own, the experts of its blocks no
// host holds, or an expert shard's experts — under the prefixes of the checkpoint's sync mode:
// step mode's parameters and Adam moments (also a synchronous warm-up's, which outer mode starts
// from); in outer mode the global part (θ, outer momentum, int8's error feedback) and its
// replica's (θ_r, its moments and error feedback, a delayed outer step's snapshot).
func restoreNames(spec job.Spec, step int, a *proto.Assign) map[string]bool {
	specs, err := shardSpecs(spec.Model, a.Shard, hostedBy(a.ExpertHosts))
	if err != nil {
		return nil
	}
	phase := spec.StatePhase(step)
	prefixes := append([]string{""}, momentPrefixes...)
	if phase.Outer() {
		r := 0
		if a.Replica != nil {
			r = a.Replica.Index
		}
		prefixes = outerPrefixes(true, []int{r}, phase.Sync.Compress == "int8", true)
	}
	want := make(map[string]bool, len(prefixes)*len(specs))
	for _, p := range prefixes {
		for _, sp := range specs {
			want[p+sp.Name] = true
		}
	}
	return want
}

// handoverBytes is what a handover of blocks [b, e) carries before its taker is Ready: in step
// mode the blocks' parameters and AdamW's moments, in outer mode the global θ (the momentum
// follows while everyone trains: client giveState) — what the simulator charges a handover.
func (j *jobRun) handoverBytes(b, e int) int64 {
	params := blockParams(j.spec.Model, b, e)
	if j.spec.Outer() {
		return int64(sched.OuterHandoverBytes(params))
	}
	return sched.LoadBytesPerParam * params
}

// blockParams is the number of parameters of blocks [b, e) with every expert of them, 0 for no
// blocks.
func blockParams(cfg model.Config, b, e int) int64 {
	if b < 0 || e > cfg.NLayer || b >= e {
		return 0
	}
	n := int64(0)
	for _, sp := range cfg.StageShardSpecs(b, e, func(int, int) bool { return true }) {
		n += int64(sp.Size())
	}
	return n
}

// checkpointWait is how long a checkpoint of the active plan may take to land: every stage and
// expert host uploads its shard (sched.StateBytesPerParam a parameter of its blocks, all of them
// at once over their own uplinks), which on a fleet takes as long as a restore (transferWait) — a
// stage of the 1B job in outer mode uploads 14 GB — and never less than a step's deadline, the
// wait it had before whatever the shard's size.
func (j *jobRun) checkpointWait() time.Duration {
	cfg, per := j.spec.Model, j.spec.ReplicaOptions().StateBytesPerParam()
	bytes := map[string]int64{}
	for _, st := range j.stages {
		bytes[st.peer] += int64(per * float64(blockParams(cfg, st.begin, st.end)))
	}
	for _, h := range j.hosts {
		params := 0
		for _, e := range h.experts {
			for _, sp := range cfg.ExpertSpecs(h.block, e) {
				params += sp.Size()
			}
		}
		bytes[h.peer] += int64(per * float64(params))
	}
	return j.s.transferWait(bytes, j.deadline())
}

// blobTensors are the names of the tensors blob sha holds, from its header.
func (s *Server) blobTensors(sha string) ([]string, error) {
	f, err := s.blobs.Open(sha)
	if err != nil {
		return nil, fmt.Errorf("blob %s: %w", sha, err)
	}
	defer f.Close()
	h, err := safetensors.ReadHeader(f, 0)
	if err != nil {
		return nil, fmt.Errorf("blob %s: %w", sha, err)
	}
	names := make([]string, len(h.Tensors))
	for i, e := range h.Tensors {
		names[i] = e.Name
	}
	return names, nil
}
