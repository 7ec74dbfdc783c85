package coordinator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// Export writes the whole model of a complete checkpoint in dataDir to out (safetensors, loadable
// by the anchor's eval and by shoal eval/sample): checkpoint id, or with id 0 the newest complete
// checkpoint of the newest job. It works on the files alone, with or without a coordinator running
// on them.
func Export(ctx context.Context, dataDir string, id int64, out string) (storage.Checkpoint, error) {
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
	if id > 0 {
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
	s := &Server{db: db, blobs: blobs, log: slog.New(slog.DiscardHandler)}
	sha, err := s.assemble(ctx, ck)
	if err != nil {
		return ck, err
	}
	f, err := blobs.OpenVerified(sha)
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
