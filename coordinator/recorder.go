package coordinator

import (
	"context"
	"log/slog"
	"sync"

	"github.com/shoal-ml/shoal/storage"
)

// recorder writes the job loop's bookkeeping — worker rows and events — to SQLite on a goroutine
// of its own, as many as are waiting in one transaction. Each transaction costs an fsync; written
// by the job loop itself, a wave of joins and departures (a flood, or churn at scale) held up the
// steps behind it for as long as its writes took. Writes keep their order (one queue, one
// writer); whoever reads them back first waits for what is queued (flush): the status handler
// and the end of a job.
type recorder struct {
	db  *storage.DB
	log *slog.Logger
	ops chan recOp

	// mu is held to send on ops (read) and to close it (write), so that no send meets a closed
	// queue; the writer never takes it.
	mu      sync.RWMutex
	stopped bool
	done    chan struct{}
}

type recOp struct {
	f     func(tx *storage.Tx) error // nil: a flush barrier
	what  string
	flush chan struct{}
}

// recordBatch bounds the writes in one transaction, so that a reader's flush waits for a bounded
// transaction at most beside the queue.
const recordBatch = 512

func newRecorder(db *storage.DB, log *slog.Logger) *recorder {
	r := &recorder{db: db, log: log, ops: make(chan recOp, 4096), done: make(chan struct{})}
	go r.loop()
	return r
}

// record queues f (what names it in a warning if it fails). It blocks while the queue is full:
// the job loop slows to the pace of the disk rather than holding an unbounded backlog. After
// stop it writes at once.
func (r *recorder) record(what string, f func(tx *storage.Tx) error) {
	r.mu.RLock()
	if r.stopped {
		r.mu.RUnlock()
		r.write([]recOp{{f: f, what: what}})
		return
	}
	r.ops <- recOp{f: f, what: what}
	r.mu.RUnlock()
}

// flush waits until everything queued before it is written, or ctx ends.
func (r *recorder) flush(ctx context.Context) {
	done := make(chan struct{})
	r.mu.RLock()
	if r.stopped {
		r.mu.RUnlock()
		return
	}
	select {
	case r.ops <- recOp{flush: done}:
		r.mu.RUnlock()
	case <-ctx.Done():
		r.mu.RUnlock()
		return
	}
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// stop writes what is queued and ends the writer; later records are written at once.
func (r *recorder) stop() {
	r.flush(context.Background())
	r.mu.Lock()
	if !r.stopped {
		r.stopped = true
		close(r.ops)
	}
	r.mu.Unlock()
	<-r.done
}

func (r *recorder) loop() {
	defer close(r.done)
	for op := range r.ops {
		batch := []recOp{op}
	more:
		for len(batch) < recordBatch {
			select {
			case op, ok := <-r.ops:
				if !ok {
					break more
				}
				batch = append(batch, op)
			default:
				break more
			}
		}
		r.write(batch)
	}
}

// write runs the batch's writes in one transaction (a failed one is logged; SQLite keeps the
// others), then releases its flush barriers.
func (r *recorder) write(batch []recOp) {
	var writes int
	for _, op := range batch {
		if op.f != nil {
			writes++
		}
	}
	if writes > 0 {
		err := r.db.Tx(context.Background(), func(tx *storage.Tx) error {
			for _, op := range batch {
				if op.f == nil {
					continue
				}
				if err := op.f(tx); err != nil {
					r.log.Warn("record", "what", op.what, "err", err)
				}
			}
			return nil
		})
		if err != nil {
			r.log.Warn("record", "writes", writes, "err", err)
		}
	}
	for _, op := range batch {
		if op.flush != nil {
			close(op.flush)
		}
	}
}
