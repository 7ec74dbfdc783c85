package storage

import (
	"errors"
	"reflect"
	"testing"

	"github.com/google/uuid"
)

func TestRouterStats(t *testing.T) {
	db, _ := openTestDB(t)
	ctx := t.Context()
	id := newJob(t, db)
	first := []RouterStat{
		{Step: 0, Block: 1, Expert: 0, Tokens: 100},
		{Step: 0, Block: 1, Expert: 1, Tokens: 28},
		{Step: 1, Block: 1, Expert: 0, Tokens: 64},
		{Step: 1, Block: 3, Expert: 2, Tokens: 64},
	}
	if err := db.RecordRouterStats(ctx, id, first); err != nil {
		t.Fatal(err)
	}
	got, err := db.ListRouterStats(ctx, id, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, first) {
		t.Errorf("ListRouterStats =\n %v\nwant\n %v", got, first)
	}

	// A replay of step 1 replaces step 1's rows whole (expert 2 of block 3
	// got no tokens this time) and leaves step 0 alone.
	replay := []RouterStat{{Step: 1, Block: 1, Expert: 1, Tokens: 128}}
	if err := db.RecordRouterStats(ctx, id, replay); err != nil {
		t.Fatal(err)
	}
	got, _ = db.ListRouterStats(ctx, id, 1, 2)
	if !reflect.DeepEqual(got, replay) {
		t.Errorf("step 1 after replay = %v, want %v", got, replay)
	}
	if got, _ := db.ListRouterStats(ctx, id, 0, 1); len(got) != 2 {
		t.Errorf("step 0 has %d rows after replaying step 1, want 2", len(got))
	}

	if err := db.RecordRouterStats(ctx, id, []RouterStat{{Step: 0, Expert: -1}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("negative expert = %v, want ErrInvalid", err)
	}
	if err := db.RecordRouterStats(ctx, uuid.New(), replay); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown job = %v, want ErrNotFound", err)
	}
}
