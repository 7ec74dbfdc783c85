package storage

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
)

func TestEvents(t *testing.T) {
	db, clock := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	other := newJob(t, db)

	add := func(e Event) Event {
		t.Helper()
		got, err := db.AppendEvent(ctx, e)
		if err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second)
		return got
	}
	e1 := add(Event{Kind: "coordinator.start"})
	e2 := add(Event{JobID: id, Kind: "worker.joined", WorkerID: "w1", Message: json.RawMessage(`{"backend":"avx2"}`)})
	e3 := add(Event{JobID: other, Kind: "plan.changed"})
	explicit := time.Date(2024, 12, 31, 23, 59, 59, 0, time.UTC)
	e4 := add(Event{JobID: id, Kind: "worker.lost", WorkerID: "w1", Time: explicit})

	if !(e1.ID < e2.ID && e2.ID < e3.ID && e3.ID < e4.ID) {
		t.Errorf("ids %d %d %d %d do not grow", e1.ID, e2.ID, e3.ID, e4.ID)
	}
	if string(e1.Message) != "{}" || e1.JobID != uuid.Nil {
		t.Errorf("e1 = %+v, want message {} and no job", e1)
	}
	if !e4.Time.Equal(explicit) {
		t.Errorf("e4 time %v, want the given %v", e4.Time, explicit)
	}

	ids := func(es []Event) []int64 {
		var out []int64
		for _, e := range es {
			out = append(out, e.ID)
		}
		return out
	}
	for _, tc := range []struct {
		name string
		f    EventFilter
		want []int64
	}{
		{"all", EventFilter{}, []int64{e1.ID, e2.ID, e3.ID, e4.ID}},
		{"job", EventFilter{JobID: id}, []int64{e2.ID, e4.ID}},
		{"worker", EventFilter{WorkerID: "w1"}, []int64{e2.ID, e4.ID}},
		{"kind", EventFilter{Kind: "plan.changed"}, []int64{e3.ID}},
		{"tail", EventFilter{AfterID: e2.ID}, []int64{e3.ID, e4.ID}},
		{"oldest 2", EventFilter{Limit: 2}, []int64{e1.ID, e2.ID}},
		{"newest 2", EventFilter{Limit: 2, Newest: true}, []int64{e3.ID, e4.ID}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := db.ListEvents(ctx, tc.f)
			if err != nil {
				t.Fatal(err)
			}
			if g := ids(got); !slices.Equal(g, tc.want) {
				t.Errorf("ListEvents(%+v) = %v, want %v", tc.f, g, tc.want)
			}
		})
	}
	got, _ := db.ListEvents(ctx, EventFilter{JobID: id, Limit: 1})
	if got[0].WorkerID != "w1" || string(got[0].Message) != `{"backend":"avx2"}` || got[0].JobID != id {
		t.Errorf("round trip: %+v", got[0])
	}

	if _, err := db.AppendEvent(ctx, Event{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("event without kind = %v, want ErrInvalid", err)
	}
	if _, err := db.AppendEvent(ctx, Event{Kind: "x", Message: json.RawMessage(`nope`)}); !errors.Is(err, ErrInvalid) {
		t.Errorf("event with malformed message = %v, want ErrInvalid", err)
	}
	if _, err := db.AppendEvent(ctx, Event{Kind: "x", JobID: uuid.New()}); !errors.Is(err, ErrNotFound) {
		t.Errorf("event of unknown job = %v, want ErrNotFound", err)
	}
}
