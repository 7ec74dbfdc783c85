package storage

import (
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"github.com/google/uuid"
)

func TestSavePlanVersions(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	j, err := db.CreateJob(ctx, testSpec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.LatestPlan(ctx, j.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("LatestPlan of a new job = %v, want ErrNotFound", err)
	}
	for v := int64(1); v <= 3; v++ {
		doc := json.RawMessage(`{"v":` + string(rune('0'+v)) + `}`)
		p, err := db.SavePlan(ctx, j.ID, doc)
		if err != nil {
			t.Fatal(err)
		}
		if p.Version != v || string(p.Plan) != string(doc) || p.JobID != j.ID {
			t.Errorf("SavePlan #%d = %+v", v, p)
		}
	}
	latest, err := db.LatestPlan(ctx, j.ID)
	if err != nil || latest.Version != 3 {
		t.Errorf("LatestPlan = %+v, %v; want version 3", latest, err)
	}
	p2, err := db.Plan(ctx, j.ID, 2)
	if err != nil || string(p2.Plan) != `{"v":2}` {
		t.Errorf("Plan(2) = %+v, %v", p2, err)
	}
	if _, err := db.Plan(ctx, j.ID, 9); !errors.Is(err, ErrNotFound) {
		t.Errorf("Plan(9) = %v, want ErrNotFound", err)
	}
	if _, err := db.SavePlan(ctx, uuid.New(), json.RawMessage(`{}`)); !errors.Is(err, ErrNotFound) {
		t.Errorf("SavePlan(unknown job) = %v, want ErrNotFound", err)
	}
	if _, err := db.SavePlan(ctx, j.ID, json.RawMessage(`[`)); !errors.Is(err, ErrInvalid) {
		t.Errorf("SavePlan(malformed) = %v, want ErrInvalid", err)
	}
}

// TestSavePlanConcurrent: versions are assigned inside the write
// transaction, so plans saved at once get distinct, gapless versions.
func TestSavePlanConcurrent(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	j, _ := db.CreateJob(ctx, testSpec)
	const n = 8
	versions := make(chan int64, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			p, err := db.SavePlan(ctx, j.ID, json.RawMessage(`{}`))
			if err != nil {
				t.Error(err)
				return
			}
			versions <- p.Version
		})
	}
	wg.Wait()
	close(versions)
	seen := map[int64]bool{}
	for v := range versions {
		if seen[v] || v < 1 || v > n {
			t.Errorf("version %d repeated or out of 1..%d", v, n)
		}
		seen[v] = true
	}
}
