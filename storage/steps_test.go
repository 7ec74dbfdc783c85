package storage

import (
	"encoding/json"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/google/uuid"
)

func TestRecordAndListSteps(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	val := 2.5
	for s := int64(0); s < 5; s++ {
		st := Step{JobID: id, Step: s, PlanVersion: 1, Loss: 5 - float64(s)/10, Aux: 0.01, Tokens: 256,
			Timings: json.RawMessage(`{"stage0_ms":12.5,"stage1_ms":13}`)}
		if s == 4 {
			st.ValLoss = &val
		}
		got, err := db.RecordStep(ctx, st)
		if err != nil {
			t.Fatal(err)
		}
		if got.Attempts != 1 || !got.CreatedAt.Equal(clock.Now()) || got.Loss != st.Loss {
			t.Errorf("RecordStep(%d) = %+v", s, got)
		}
		if j, _ := db.Job(ctx, id); j.Step != s+1 {
			t.Errorf("after step %d the job's step is %d, want %d", s, j.Step, s+1)
		}
		clock.Advance(time.Second)
	}
	steps, err := db.ListSteps(ctx, id, 1, 4)
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) != 3 || steps[0].Step != 1 || steps[2].Step != 3 {
		t.Errorf("ListSteps [1,4) = %d steps from %d", len(steps), steps[0].Step)
	}
	if steps[0].ValLoss != nil {
		t.Errorf("step 1 val_loss = %v, want nil", *steps[0].ValLoss)
	}
	all, _ := db.ListSteps(ctx, id, 0, -1)
	if len(all) != 5 || all[4].ValLoss == nil || *all[4].ValLoss != val {
		t.Errorf("ListSteps all: %d steps, last val_loss %v", len(all), all[len(all)-1].ValLoss)
	}
	if string(all[0].Timings) != `{"stage0_ms":12.5,"stage1_ms":13}` {
		t.Errorf("timings = %s", all[0].Timings)
	}
}

// TestRecordStepReplay: after a rewind, a replayed step overwrites its row,
// counts the attempt and keeps its first CreatedAt.
func TestRecordStepReplay(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	first := clock.Now()
	for s := int64(0); s < 4; s++ {
		if _, err := db.RecordStep(ctx, Step{JobID: id, Step: s, PlanVersion: 1, Loss: 3, Tokens: 10}); err != nil {
			t.Fatal(err)
		}
	}
	// A peer died; the job rewinds to a checkpoint at step 2 under a new plan.
	clock.Advance(time.Minute)
	if err := db.SetJobStep(ctx, id, 2); err != nil {
		t.Fatal(err)
	}
	if _, err := db.SavePlan(ctx, id, json.RawMessage(`{"stages":[[0,4]]}`)); err != nil {
		t.Fatal(err)
	}
	got, err := db.RecordStep(ctx, Step{JobID: id, Step: 2, PlanVersion: 2, Loss: 2.75, Tokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	if got.Attempts != 2 || got.PlanVersion != 2 || got.Loss != 2.75 ||
		!got.CreatedAt.Equal(first) || !got.UpdatedAt.Equal(clock.Now()) {
		t.Errorf("replayed step = %+v; want attempts 2, plan 2, loss 2.75, created %v, updated %v", got, first, clock.Now())
	}
	if j, _ := db.Job(ctx, id); j.Step != 3 {
		t.Errorf("job step after replaying step 2 = %d, want 3", j.Step)
	}
	if steps, _ := db.ListSteps(ctx, id, 0, -1); len(steps) != 4 {
		t.Errorf("%d step rows, want 4 (the replay replaced, did not add)", len(steps))
	}
}

func TestRecordStepRejects(t *testing.T) {
	db, _ := openTestDB(t)
	id := newJob(t, db)
	nan := math.NaN()
	for _, tc := range []struct {
		name string
		s    Step
		want error
	}{
		{"negative step", Step{JobID: id, Step: -1, PlanVersion: 1}, ErrInvalid},
		{"NaN loss", Step{JobID: id, PlanVersion: 1, Loss: nan}, ErrInvalid},
		{"Inf aux", Step{JobID: id, PlanVersion: 1, Aux: math.Inf(1)}, ErrInvalid},
		{"NaN val_loss", Step{JobID: id, PlanVersion: 1, ValLoss: &nan}, ErrInvalid},
		{"negative tokens", Step{JobID: id, PlanVersion: 1, Tokens: -1}, ErrInvalid},
		{"no plan version", Step{JobID: id}, ErrInvalid},
		{"bad timings", Step{JobID: id, PlanVersion: 1, Timings: json.RawMessage(`{`)}, ErrInvalid},
		{"unknown plan", Step{JobID: id, PlanVersion: 7}, ErrNotFound},
		{"unknown job", Step{JobID: uuid.New(), PlanVersion: 1}, ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := db.RecordStep(t.Context(), tc.s); !errors.Is(err, tc.want) {
				t.Errorf("RecordStep = %v, want %v", err, tc.want)
			}
		})
	}
	if steps, _ := db.ListSteps(t.Context(), id, 0, -1); len(steps) != 0 {
		t.Errorf("%d steps recorded by rejected calls", len(steps))
	}
}

// TestTxComposes: a step, its router statistics and an event commit together
// or not at all.
func TestTxComposes(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	boom := errors.New("boom")
	err := db.Tx(ctx, func(tx *Tx) error {
		if _, err := tx.RecordStep(ctx, Step{JobID: id, Step: 0, PlanVersion: 1, Loss: 1}); err != nil {
			return err
		}
		if err := tx.RecordRouterStats(ctx, id, []RouterStat{{Step: 0, Block: 1, Expert: 0, Tokens: 5}}); err != nil {
			return err
		}
		if _, err := tx.AppendEvent(ctx, Event{JobID: id, Kind: "step"}); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatal(err)
	}
	steps, _ := db.ListSteps(ctx, id, 0, -1)
	stats, _ := db.ListRouterStats(ctx, id, 0, -1)
	events, _ := db.ListEvents(ctx, EventFilter{JobID: id})
	j, _ := db.Job(ctx, id)
	if len(steps)+len(stats)+len(events) != 0 || j.Step != 0 {
		t.Errorf("after rollback: %d steps, %d router stats, %d events, job step %d; want nothing",
			len(steps), len(stats), len(events), j.Step)
	}
}
