package coordinator

import (
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/storage"
)

// TestCheckpointsOfEveryJob: GET /api/checkpoints lists the checkpoints of finished jobs too,
// each with its job, and any of them exports by id (or by its job) — not only the newest job's.
func TestCheckpointsOfEveryJob(t *testing.T) {
	spec := tinyJob(t, 2)
	spec.CheckpointEvery = 0 // one checkpoint, at the end
	dir := t.TempDir()
	sv := serveCoordinator(t, Config{DataDir: dir, Loopback: true, KeepServing: true, MinWorkers: 1,
		Settle: 100 * time.Millisecond, AdminToken: servingAdmin, Logger: testLogger()})
	srv := sv.srv
	sv.worker(client.WorkerConfig{MemoryBytes: 1 << 30, Threads: 1})
	var ids []uuid.UUID
	for range 2 {
		code, out := submitSpec(t, sv.url, spec)
		if code != http.StatusCreated {
			t.Fatalf("submit: %d %v", code, out)
		}
		id := uuid.MustParse(out["id"].(string))
		ids = append(ids, id)
		awaitStatus(t, srv, "job "+id.String()+" done", func(st *Status) bool {
			return st.Job != nil && st.Job.ID == id.String() && st.Job.State == "done"
		})
	}

	req, _ := http.NewRequest("GET", sv.url+"/api/checkpoints", nil)
	req.Header.Set("Authorization", "Bearer "+servingAdmin)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var list []CheckpointStatus
	json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	byJob := map[string]CheckpointStatus{}
	for _, ck := range list {
		if ck.State == string(storage.CheckpointComplete) && ck.Step == int64(spec.Steps) {
			byJob[ck.Job] = ck
		}
	}
	first, ok := byJob[ids[0].String()]
	if len(byJob) != 2 || !ok || first.JobState != string(storage.JobDone) {
		t.Fatalf("/api/checkpoints lists %+v; want the final checkpoint of both jobs, each with its job", list)
	}
	if list[0].Job != ids[1].String() {
		t.Errorf("the newest job's checkpoints come first: %+v", list)
	}
	all, err := Checkpoints(context.Background(), dir)
	if err != nil || len(all) != len(list) {
		t.Errorf("Checkpoints(%s): %d, %v; the API lists %d", dir, len(all), err, len(list))
	}

	// The finished, older job's checkpoint exports by id and by its job.
	for _, how := range []struct {
		id  int64
		job uuid.UUID
	}{{first.ID, uuid.Nil}, {0, ids[0]}} {
		out := filepath.Join(t.TempDir(), "model.safetensors")
		ck, err := ExportJob(context.Background(), dir, how.id, how.job, out)
		if err != nil || ck.ID != first.ID {
			t.Fatalf("export %+v: checkpoint %d, %v; want %d", how, ck.ID, err, first.ID)
		}
		if _, _, err := model.LoadModel(out); err != nil {
			t.Errorf("the exported file: %v", err)
		}
	}
	sv.stop()
}
