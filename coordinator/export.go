package coordinator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// Export writes the whole model of a complete checkpoint in dataDir to out (safetensors, loadable
// by the anchor's eval and by shoal eval/sample): checkpoint id, of any job, or with id 0 the
// newest complete checkpoint of the newest job. It works on the files alone, with or without a
// coordinator running on them.
func Export(ctx context.Context, dataDir string, id int64, out string) (storage.Checkpoint, error) {
	return ExportJob(ctx, dataDir, id, uuid.Nil, out)
}

// ExportJob is Export where id 0 and a job other than uuid.Nil mean the newest complete
// checkpoint of that job.
func ExportJob(ctx context.Context, dataDir string, id int64, jobID uuid.UUID, out string) (storage.Checkpoint, error) {
	db, err := storage.Open(ctx, filepath.Join(dataDir, "shoal.db"), storage.Options{})
	if err != nil {
		return storage.Checkpoint{}, err
	}
	defer db.Close()
	blobs, err := storage.OpenBlobStore(filepath.Join(dataDir, "blobs"))
	if err != nil {
		return storage.Checkpoint{}, err
	}
	var ck storage.Checkpoint
	if id > 0 && jobID != uuid.Nil {
		return ck, errors.New("a checkpoint id names its job: give the id or the job, not both")
	}
	if id == 0 && jobID != uuid.Nil {
		if ck, err = db.LatestCheckpoint(ctx, jobID); err != nil {
			if errors.Is(err, storage.ErrNotFound) {
				return ck, fmt.Errorf("job %s has no complete checkpoint (a job that is not in %s has none either)", jobID, dataDir)
			}
			return ck, err
		}
	} else if id > 0 {
		if ck, err = db.Checkpoint(ctx, id); err != nil {
			return ck, fmt.Errorf("checkpoint %d: %w", id, err)
		}
		if ck.State != storage.CheckpointComplete {
			return ck, fmt.Errorf("checkpoint %d is not complete: a shard never landed", id)
		}
	} else {
		jobs, err := db.ListJobs(ctx)
		if err != nil {
			return ck, err
		}
		var newest uuid.UUID
		var at time.Time
		for _, j := range jobs {
			if newest == uuid.Nil || j.CreatedAt.After(at) {
				newest, at = j.ID, j.CreatedAt
			}
		}
		if newest == uuid.Nil {
			return ck, fmt.Errorf("%s holds no job", dataDir)
		}
		if ck, err = db.LatestCheckpoint(ctx, newest); err != nil {
			if errors.Is(err, storage.ErrNotFound) {
				return ck, fmt.Errorf("job %s has no complete checkpoint yet", newest)
			}
			return ck, err
		}
	}
	// The whole model is assembled into a scratch store beside out, not the data directory's:
	// there it would be a model-sized blob that no checkpoint references, left for a
	// coordinator's hourly sweep (or for ever, without one) at every export.
	scratchDir, err := os.MkdirTemp(filepath.Dir(out), ".shoal-export-")
	if err != nil {
		return ck, err
	}
	defer os.RemoveAll(scratchDir)
	scratch, err := storage.OpenBlobStore(scratchDir)
	if err != nil {
		return ck, err
	}
	s := &Server{db: db, blobs: blobs, log: slog.New(slog.DiscardHandler)}
	sha, err := s.assembleInto(ctx, ck, scratch)
	if err != nil {
		return ck, err
	}
	f, err := scratch.OpenVerified(sha)
	if err != nil {
		return ck, err
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		return ck, err
	}
	if _, _, err := safetensors.Read(b); err != nil {
		return ck, err
	}
	tmp := out + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return ck, err
	}
	return ck, os.Rename(tmp, out)
}

// Checkpoints lists the checkpoints of every job in dataDir (listCheckpoints), from the files
// alone, with or without a coordinator running on them: what `shoal export --list` prints.
func Checkpoints(ctx context.Context, dataDir string) ([]CheckpointStatus, error) {
	if _, err := os.Stat(filepath.Join(dataDir, "shoal.db")); err != nil {
		return nil, fmt.Errorf("%s holds no coordinator's data: %w", dataDir, err)
	}
	db, err := storage.Open(ctx, filepath.Join(dataDir, "shoal.db"), storage.Options{})
	if err != nil {
		return nil, err
	}
	defer db.Close()
	return listCheckpoints(ctx, db, uuid.Nil)
}

// listCheckpoints lists the checkpoints of job only, or of every job when only is uuid.Nil: the
// newest job first, and within a job the newest checkpoint first.
func listCheckpoints(ctx context.Context, db *storage.DB, only uuid.UUID) ([]CheckpointStatus, error) {
	jobs, err := db.ListJobs(ctx)
	if err != nil {
		return nil, err
	}
	slices.SortStableFunc(jobs, func(a, b storage.Job) int { return b.CreatedAt.Compare(a.CreatedAt) })
	out := []CheckpointStatus{}
	for _, jb := range jobs {
		if only != uuid.Nil && jb.ID != only {
			continue
		}
		cks, err := db.ListCheckpoints(ctx, jb.ID)
		if err != nil {
			return nil, err
		}
		for i := len(cks) - 1; i >= 0; i-- {
			ck := cks[i]
			cs := CheckpointStatus{ID: ck.ID, Job: jb.ID.String(), JobState: string(jb.State), Step: ck.Step, State: string(ck.State),
				Created: ck.CreatedAt, Shards: []ShardStatus{}}
			if !ck.CompletedAt.IsZero() {
				t := ck.CompletedAt
				cs.Completed = &t
			}
			for _, sh := range ck.Shards {
				cs.Shards = append(cs.Shards, ShardStatus{Name: sh.Name, SHA256: sh.SHA256, Bytes: sh.Bytes})
			}
			out = append(out, cs)
		}
	}
	return out, nil
}
