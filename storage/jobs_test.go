package storage

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
)

func TestCreateAndGetJob(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	j, err := db.CreateJob(ctx, testSpec)
	if err != nil {
		t.Fatal(err)
	}
	if j.State != JobQueued || j.Step != 0 || j.Reason != "" {
		t.Errorf("new job: state %s step %d reason %q; want queued, 0, empty", j.State, j.Step, j.Reason)
	}
	if !j.CreatedAt.Equal(clock.Now()) || !j.UpdatedAt.Equal(clock.Now()) {
		t.Errorf("timestamps %v/%v, want %v", j.CreatedAt, j.UpdatedAt, clock.Now())
	}
	if j.ID.Version() != 7 {
		t.Errorf("job id %s is UUID version %d, want 7", j.ID, j.ID.Version())
	}
	got, err := db.Job(ctx, j.ID)
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Spec) != string(testSpec) {
		t.Errorf("spec round trip:\n got %s\nwant %s", got.Spec, testSpec)
	}
	if _, err := db.Job(ctx, uuid.New()); !errors.Is(err, ErrNotFound) {
		t.Errorf("Job(unknown) = %v, want ErrNotFound", err)
	}
}

func TestCreateJobRejectsBadSpec(t *testing.T) {
	db, _ := openTestDB(t)
	for _, tc := range []struct {
		name string
		spec string
	}{
		{"empty", ``},
		{"malformed", `{"model":`},
		{"array", `[1,2]`},
		{"null", `null`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := db.CreateJob(t.Context(), json.RawMessage(tc.spec)); !errors.Is(err, ErrInvalid) {
				t.Errorf("CreateJob(%q) = %v, want ErrInvalid", tc.spec, err)
			}
		})
	}
}

func TestListJobs(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	var ids []uuid.UUID
	for range 3 {
		j, err := db.CreateJob(ctx, testSpec)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, j.ID)
		clock.Advance(time.Second)
	}
	if _, err := db.SetJobState(ctx, ids[1], JobRunning, ""); err != nil {
		t.Fatal(err)
	}
	all, err := db.ListJobs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 3 || all[0].ID != ids[0] || all[2].ID != ids[2] {
		t.Errorf("ListJobs() = %v, want the 3 jobs oldest first", all)
	}
	queued, err := db.ListJobs(ctx, JobQueued, JobPaused)
	if err != nil {
		t.Fatal(err)
	}
	if len(queued) != 2 || queued[0].ID != ids[0] || queued[1].ID != ids[2] {
		t.Errorf("ListJobs(queued, paused) = %v, want jobs 0 and 2", queued)
	}
	if _, err := db.ListJobs(ctx, "bogus"); !errors.Is(err, ErrInvalid) {
		t.Errorf("ListJobs(bogus) = %v, want ErrInvalid", err)
	}
}

func TestSetJobState(t *testing.T) {
	tests := []struct {
		name string
		path []JobState // from queued
		ok   bool       // whether the last transition is allowed
	}{
		{"start", []JobState{JobRunning}, true},
		{"pause and resume", []JobState{JobRunning, JobPaused, JobRunning}, true},
		{"finish", []JobState{JobRunning, JobDone}, true},
		{"requeue", []JobState{JobRunning, JobQueued}, true},
		{"cancel queued", []JobState{JobCancelled}, true},
		{"same state", []JobState{JobRunning, JobRunning}, true},
		{"queued to done", []JobState{JobDone}, false},
		{"leave done", []JobState{JobRunning, JobDone, JobRunning}, false},
		{"leave failed", []JobState{JobFailed, JobQueued}, false},
		{"leave cancelled", []JobState{JobCancelled, JobPaused}, false},
		{"paused to done", []JobState{JobRunning, JobPaused, JobDone}, false},
	}
	db, clock := openTestDB(t)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			j, err := db.CreateJob(ctx, testSpec)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range tc.path {
				clock.Advance(time.Millisecond)
				got, err := db.SetJobState(ctx, j.ID, s, "because "+string(s))
				last := i == len(tc.path)-1
				switch {
				case !last && err != nil:
					t.Fatalf("step %d to %s: %v", i, s, err)
				case last && tc.ok && err != nil:
					t.Fatalf("to %s: %v", s, err)
				case last && !tc.ok:
					if !errors.Is(err, ErrInvalidTransition) {
						t.Fatalf("to %s = %v, want ErrInvalidTransition", s, err)
					}
					prev := JobQueued
					if i > 0 {
						prev = tc.path[i-1]
					}
					if stored, _ := db.Job(ctx, j.ID); stored.State != prev {
						t.Errorf("state is %s after a refused transition, want %s unchanged", stored.State, prev)
					}
				case last:
					if got.State != s || got.Reason != "because "+string(s) || !got.UpdatedAt.Equal(clock.Now()) {
						t.Errorf("got %+v, want state %s, its reason, updated now", got, s)
					}
				}
			}
		})
	}
	if _, err := db.SetJobState(t.Context(), uuid.New(), JobRunning, ""); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetJobState(unknown) = %v, want ErrNotFound", err)
	}
}

func TestSetJobStep(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	if err := db.SetJobStep(ctx, id, 40); err != nil {
		t.Fatal(err)
	}
	if j, _ := db.Job(ctx, id); j.Step != 40 {
		t.Errorf("step = %d, want 40", j.Step)
	}
	// Rewinding to a checkpoint moves it back.
	if err := db.SetJobStep(ctx, id, 30); err != nil {
		t.Fatal(err)
	}
	if j, _ := db.Job(ctx, id); j.Step != 30 {
		t.Errorf("step = %d, want 30", j.Step)
	}
	if err := db.SetJobStep(ctx, id, -1); !errors.Is(err, ErrInvalid) {
		t.Errorf("SetJobStep(-1) = %v, want ErrInvalid", err)
	}
	if err := db.SetJobStep(ctx, uuid.New(), 1); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetJobStep(unknown) = %v, want ErrNotFound", err)
	}
}
