package storage_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/storage"
)

// A coordinator's life with a job: create it, save a plan, record steps, and
// take a checkpoint whose shards are blobs.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "shoal-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := storage.Open(ctx, filepath.Join(dir, "shoal.db"), storage.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	blobs, err := storage.OpenBlobStore(filepath.Join(dir, "blobs"))
	if err != nil {
		log.Fatal(err)
	}

	job, err := db.CreateJob(ctx, json.RawMessage(`{"seed":1,"steps":2}`))
	if err != nil {
		log.Fatal(err)
	}
	plan, err := db.SavePlan(ctx, job.ID, json.RawMessage(`{"stages":[[0,2],[2,4]]}`))
	if err != nil {
		log.Fatal(err)
	}
	if _, err := db.SetJobState(ctx, job.ID, storage.JobRunning, ""); err != nil {
		log.Fatal(err)
	}

	// A step and the event announcing it, atomically.
	err = db.Tx(ctx, func(tx *storage.Tx) error {
		if _, err := tx.RecordStep(ctx, storage.Step{JobID: job.ID, Step: 0, PlanVersion: plan.Version, Loss: 5.5, Tokens: 256}); err != nil {
			return err
		}
		_, err := tx.AppendEvent(ctx, storage.Event{JobID: job.ID, Kind: "step.done"})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}

	// A checkpoint after step 0: each shard is stored as a blob first, then
	// recorded; the last one completes the checkpoint.
	cp, err := db.BeginCheckpoint(ctx, job.ID, 1, []string{"stage0", "stage1"})
	if err != nil {
		log.Fatal(err)
	}
	for _, name := range []string{"stage0", "stage1"} {
		sha, size, err := blobs.Put(ctx, strings.NewReader("safetensors bytes of "+name))
		if err != nil {
			log.Fatal(err)
		}
		completed, err := db.AddShard(ctx, cp.ID, name, sha, size)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s landed, checkpoint completed: %v\n", name, completed)
	}

	latest, err := db.LatestCheckpoint(ctx, job.ID)
	if err != nil {
		log.Fatal(err)
	}
	j, _ := db.Job(ctx, job.ID)
	fmt.Printf("job %s at step %d, restart point: step %d\n", j.State, j.Step, latest.Step)

	// Retention, then garbage collection of blobs no checkpoint uses.
	if _, err := db.PruneCheckpoints(ctx, job.ID, 2); err != nil {
		log.Fatal(err)
	}
	if _, err := storage.CollectGarbage(ctx, db, blobs, time.Now().Add(-time.Hour)); err != nil {
		log.Fatal(err)
	}
	// Output:
	// stage0 landed, checkpoint completed: false
	// stage1 landed, checkpoint completed: true
	// job running at step 1, restart point: step 1
}
