package coordinator

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// awaitStatus waits, on the status's own notifications, until ok holds of the published status.
func awaitStatus(t *testing.T, srv *Server, what string, ok func(*Status) bool) *Status {
	t.Helper()
	sig, stop := srv.subscribe()
	defer stop()
	deadline := time.After(2 * time.Minute)
	for {
		if st := srv.status.Load(); ok(st) {
			return st
		}
		select {
		case <-sig:
		case <-deadline:
			t.Fatalf("no status with %s within 2 minutes; the last: %+v", what, srv.status.Load().Job)
		}
	}
}

// served is a coordinator serving on loopback HTTP with its job loop running, and the in-process
// workers a test starts on it; stop (also at the test's end) ends them all.
type served struct {
	srv     *Server
	url     string
	ctx     context.Context
	cancel  context.CancelFunc
	runDone chan error
	workers sync.WaitGroup
	once    sync.Once
}

func serveCoordinator(t *testing.T, cfg Config) *served {
	t.Helper()
	srv, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := newTestHTTP(srv.Handler())
	s := &served{srv: srv, url: hs.URL, runDone: make(chan error, 1)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	go func() { s.runDone <- srv.Run(s.ctx) }()
	t.Cleanup(func() {
		s.stop()
		hs.Close()
		srv.Close()
	})
	return s
}

// worker starts an in-process worker on the coordinator (cfg's Coordinator, Logger and backoff
// filled in).
func (s *served) worker(cfg client.WorkerConfig) {
	cfg.Coordinator, cfg.Logger = s.url, testLogger()
	cfg.BackoffBase, cfg.BackoffMax = 50*time.Millisecond, 200*time.Millisecond
	s.workers.Go(func() { client.RunWorker(s.ctx, cfg) })
}

// stop ends the job loop and the workers, and waits for both.
func (s *served) stop() {
	s.once.Do(func() {
		s.cancel()
		<-s.runDone
		s.workers.Wait()
	})
}

// TestJobSaysWhyItWaits: a job short of workers says why in its status and with a job.waiting
// event, in sizes — a pinned plan's stage without a worker and the memory it needs; a planner
// that finds no plan for the workers there are — and runs once the worker it waits for joins
// (a planner's failure no longer fails the job).
func TestJobSaysWhyItWaits(t *testing.T) {
	for _, tc := range []struct {
		name   string
		pinned bool
		first  int64 // the first worker's offer
		want   []string
	}{
		{"pinned", true, 1 << 30, []string{"stage 2 of 2 (blocks [2,4)) has no worker: waiting for one with ≥ ", "MiB", "the pinned plan needs 2 workers; 1 connected"}},
		{"planner", false, 1 << 20, []string{"no plan fits the connected workers, waiting for more: ", "1.0 MiB at most on one"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := tinyJob(t, 2)
			spec.CheckpointEvery = 0
			if tc.pinned {
				spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
			}
			sv := serveCoordinator(t, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, MinWorkers: 1, KeepServing: true,
				Settle: 100 * time.Millisecond, AdminToken: servingAdmin, Logger: testLogger()})
			srv := sv.srv
			worker := func(id string, mem int64) {
				sv.worker(client.WorkerConfig{WorkerID: id, MemoryBytes: mem, Threads: 1})
			}
			worker("w-a", tc.first)
			// The reason may first be that no worker is there at all; wait for the one about w-a.
			st := awaitStatus(t, srv, "the reason "+tc.want[0], func(st *Status) bool {
				return st.Job != nil && strings.Contains(st.Job.Waiting, tc.want[0])
			})
			for _, w := range tc.want {
				if !strings.Contains(st.Job.Waiting, w) {
					t.Errorf("waiting %q, want it to say %q", st.Job.Waiting, w)
				}
			}
			worker("w-b", 1<<30)
			awaitStatus(t, srv, "the job done", func(st *Status) bool { return st.Job != nil && st.Job.State == "done" })
			if w := srv.status.Load().Job.Waiting; w != "" {
				t.Errorf("the finished job still waits: %q", w)
			}
			sv.stop()
			evs, _ := srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "job.waiting"})
			if len(evs) == 0 || !strings.Contains(string(evs[len(evs)-1].Message), "waiting") {
				t.Errorf("job.waiting events: %v", evs)
			}
		})
	}
}
