package coordinator

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// TestRetentionBoundsBlobs: with --keep-checkpoints the blob store holds what the kept
// checkpoints need and no more, the moment retention has run — not an hour later. A job of 12
// steps checkpoints every 2 (each one assembled at once: the cluster writes OutDir), keeping 1,
// and loses a worker after step 5, so that a replan restores from a checkpoint that retention
// deletes while that plan still runs. At the end the store holds the final checkpoint's shards
// and its assembled file, and the shards of the checkpoint the running plan restored from (a
// restore reads shards, no whole-model file: restore.go); every other
// shard and assembled file was removed, though all were written seconds ago (the collection used
// to spare everything younger than an hour: a job checkpointing every few seconds to a minute kept
// an hour of checkpoints whatever the retention — half a gigabyte each for the default model in
// outer mode). The final state is the one process's, and it exports.
func TestRetentionBoundsBlobs(t *testing.T) {
	spec := tinyJob(t, 12)
	spec.CheckpointEvery = 2
	_, ref := localReports(t, spec)
	var mu sync.Mutex
	restoredFrom := -1 // the from_step of the last plan that restored
	completed := 0
	clusterConfig = func(cfg *Config) {
		cfg.KeepCheckpoints = 1
		cfg.OnEvent = func(kind, _, detail string) {
			var d map[string]any
			json.Unmarshal([]byte(detail), &d)
			mu.Lock()
			defer mu.Unlock()
			switch kind {
			case "plan":
				// A plan that kept its shards (a reshare, a grow) restored nothing: the
				// running plan's restore point is the last one that did.
				if kept, _ := d["kept"].(bool); !kept {
					restoredFrom = int(d["from_step"].(float64))
				}
			case "checkpoint.complete":
				completed++
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	c := startCluster(t, spec, 3, false)
	c.killHolderAfter(t, 5, 1)
	c.run(t)
	assertFinalCheckpoint(t, c, ref)
	ctx := context.Background()
	mu.Lock()
	from, n := restoredFrom, completed
	mu.Unlock()
	t.Logf("%d checkpoints completed; the last plan restored from step %d", n, from)
	if n < 3 {
		t.Fatalf("%d checkpoints completed; the test needs retention to delete some", n)
	}

	cks, err := c.srv.db.ListCheckpoints(ctx, mustJobID(t, c.srv))
	if err != nil {
		t.Fatal(err)
	}
	if len(cks) != 1 || cks[0].Step != int64(spec.Steps) || cks[0].State != storage.CheckpointComplete {
		t.Fatalf("checkpoints left: %+v; want only the final one", cks)
	}
	refs, err := c.srv.db.ReferencedBlobs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Every blob not a kept checkpoint's shard must be the whole-model file of the final step, or
	// a shard of the checkpoint the running plan restored from (none when it restored from the
	// seed).
	want := []int{spec.Steps}
	var got []int
	var stray []string
	held := 0
	for _, sha := range blobFiles(t, c.srv.blobs.Dir()) {
		// A whole-model file first: when the last plan gave one worker the whole model, its
		// shard is byte for byte the assembled file, one blob both referenced and assembled.
		step, whole := wholeModelStep(t, c, sha)
		referenced := refs[sha]
		delete(refs, sha)
		switch {
		case whole:
			if referenced {
				t.Logf("blob %s… is both a shard of a checkpoint and the whole model of step %d", sha[:8], step)
			}
			got = append(got, step)
		case !referenced && from > 0 && shardStep(t, c, sha) == from:
			held++ // the running plan's restore point
		case !referenced:
			stray = append(stray, sha[:8]+" (not a whole model: a shard no checkpoint names)")
		}
	}
	if len(refs) > 0 {
		t.Errorf("blobs the final checkpoint references are gone: %v", refs)
	}
	slices.Sort(got)
	slices.Sort(want)
	if len(stray) > 0 || !slices.Equal(got, want) {
		t.Errorf("the store holds, beside the final checkpoint's shards, assembled files of steps %v and %d other blobs %v; want assembled files of steps %v only (final), and the shards of step %d (the running plan's restore point)",
			got, len(stray), stray, want, from)
	}
	if from > 0 && held == 0 {
		t.Errorf("the shards of step %d, which the running plan restored from, are gone", from)
	}

	// What a resume needs is there: the newest checkpoint assembles and exports, and the export
	// leaves nothing in the data directory.
	before := len(blobFiles(t, c.srv.blobs.Dir()))
	out := filepath.Join(t.TempDir(), "export.safetensors")
	if _, err := Export(ctx, c.srv.cfg.DataDir, 0, out); err != nil {
		t.Fatal(err)
	}
	assertModelFile(t, out, ref)
	if after := len(blobFiles(t, c.srv.blobs.Dir())); after != before {
		t.Errorf("the export left %d blobs in the data directory", after-before)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".shoal-export-*")); len(left) > 0 {
		t.Errorf("the export left its scratch store: %v", left)
	}
}

// mustJobID is the id of the job the server ran (a cluster runs one).
func mustJobID(t *testing.T, srv *Server) uuid.UUID {
	t.Helper()
	jobs, err := srv.db.ListJobs(context.Background())
	if err != nil || len(jobs) != 1 {
		t.Fatalf("jobs: %v, %v; want one", jobs, err)
	}
	return jobs[0].ID
}

// blobFiles lists the blobs in a store's directory (not its temporary files).
func blobFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && storage.ValidSHA256(d.Name()) {
			out = append(out, d.Name())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// wholeModelStep reports the step of an assembled whole-model file of the cluster's job: a blob
// whose header holds every tensor of the model and its moments, as assemble writes it.
func wholeModelStep(t *testing.T, c *cluster, sha string) (int, bool) {
	t.Helper()
	f, err := c.srv.blobs.Open(sha)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfg := c.srv.cfg.Job.Model
	h, err := safetensors.ReadHeader(bufio.NewReader(f), newLayout(cfg, 0, cfg.Specs()).header)
	if err != nil {
		return 0, false
	}
	step, err := strconv.Atoi(h.Meta["step"])
	if err != nil {
		return 0, false
	}
	if newLayout(cfg, int64(step), cfg.Specs()).checkHeader(h, true) != nil {
		return 0, false
	}
	return step, true
}

// shardStep is the step of the checkpoint shard blob sha, as its metadata says; -1 when it is
// not a checkpoint's file.
func shardStep(t *testing.T, c *cluster, sha string) int {
	t.Helper()
	f, err := c.srv.blobs.Open(sha)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h, err := safetensors.ReadHeader(bufio.NewReader(f), 0)
	if err != nil {
		return -1
	}
	step, err := strconv.Atoi(h.Meta["step"])
	if err != nil {
		return -1
	}
	return step
}

// TestUnrecordedUploadCollected: a shard that streams in while its checkpoint goes — deleted by
// retention (a pending checkpoint older than the newest complete one) or discarded by a rollback
// — is committed, then refused by the store (409). Nothing will ever reference that blob, and the
// next collection removes it, young as it is; it used to stay for an hour.
func TestUnrecordedUploadCollected(t *testing.T) {
	for _, tc := range []struct {
		name string
		gone func(r *uploadRig) error
	}{
		{"deleted", func(r *uploadRig) error { return r.srv.db.DeleteCheckpoint(context.Background(), r.ck.ID) }},
		{"discarded", func(r *uploadRig) error {
			_, err := r.srv.db.DiscardCheckpointsAfter(context.Background(), r.jobID, uploadStep-1)
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newUploadRig(t, Config{})
			if err := tc.gone(r); err != nil {
				t.Fatal(err)
			}
			// The expert host's shard: its layout needs nothing of the checkpoint's row.
			if code, msg := r.post(t, "experts-0", r.b.Session, r.experts); code != http.StatusConflict {
				t.Fatalf("upload to a checkpoint %s: %d %q, want 409", tc.name, code, msg)
			}
			sha := sha256Hex(r.experts)
			if has, _ := r.srv.blobs.Has(sha); !has {
				t.Fatalf("the refused shard's blob %s… is not in the store: the test no longer sees a commit before the record", sha[:8])
			}
			r.srv.collectBlobs(context.Background(), nil)
			if files := r.blobFiles(t); len(files) != 0 {
				t.Errorf("after a collection the store holds %v; want nothing (the only blob was the refused shard)", files)
			}
		})
	}
}

// TestExportLeavesNoBlob: shoal export assembles the whole model in a scratch store beside its
// output, not in the data directory, where it used to leave a model-sized blob that no checkpoint
// references (half a gigabyte for the default model in outer mode, at every export).
func TestExportLeavesNoBlob(t *testing.T) {
	r := newUploadRig(t, Config{})
	for _, up := range []struct {
		name, session string
		body          []byte
	}{{"stage-0", r.a.Session, r.stage}, {"experts-0", r.b.Session, r.experts}} {
		if code, msg := r.post(t, up.name, up.session, up.body); code != http.StatusNoContent {
			t.Fatalf("upload %s: %d %q", up.name, code, msg)
		}
	}
	before := r.blobFiles(t)
	out := filepath.Join(t.TempDir(), "model.safetensors")
	ck, err := Export(context.Background(), r.srv.cfg.DataDir, r.ck.ID, out)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != uploadStep {
		t.Fatalf("exported checkpoint %d after step %d, want step %d", ck.ID, ck.Step, uploadStep)
	}
	if _, _, err := safetensors.ReadFile(out); err != nil {
		t.Fatalf("the exported file: %v", err)
	}
	if after := r.blobFiles(t); !slices.Equal(after, before) {
		t.Errorf("the data directory's blobs were %v before the export, %v after", before, after)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".shoal-export-*")); len(left) > 0 {
		t.Errorf("the export left its scratch store: %v", left)
	}
}
