package kernels

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// The worker pool. A multiply is cut into tiles (panels of B to pack, then blocks of C to
// compute); the caller and up to Threads()-1 pool goroutines claim tiles from one atomic counter
// until none are left. Which goroutine computes which tile is therefore up to timing, which is
// why no tile's arithmetic may depend on anything but its own position in the matrices.
//
// The pool is process-wide, like GOMAXPROCS: it sizes the machine's cores, not one caller's work,
// and several goroutines (pipeline stages, experts) multiplying at once share it. A caller posts
// offers of its job to a buffered channel and starts on the tiles itself; a helper that takes an
// offer joins only while the job is still open. When the caller runs out of tiles it closes the
// job and waits just for the helpers that joined, so it never waits for a helper busy elsewhere,
// and an offer a helper takes late costs it nothing.

var pool struct {
	mu      sync.Mutex
	threads int       // participants per multiply, caller included; 0 until first use
	workers int       // helper goroutines running
	offers  chan *job // offers of jobs to join; nil asks one helper to exit
}

// SetThreads sets how many goroutines, the caller included, work on one multiply or one of the
// layers' parallel loops. n < 1 means runtime.GOMAXPROCS(0), which is also the default. Results
// do not depend on it.
func SetThreads(n int) {
	if n < 1 {
		n = runtime.GOMAXPROCS(0)
	}
	pool.mu.Lock()
	defer pool.mu.Unlock()
	if pool.offers == nil {
		pool.offers = make(chan *job, 256)
	}
	pool.threads = n
	for pool.workers < n-1 {
		pool.workers++
		go worker(pool.offers)
	}
	for pool.workers > n-1 {
		pool.workers--
		pool.offers <- nil // the next idle helper exits
	}
}

// Threads reports how many goroutines work on one multiply or parallel loop: the pool's threads
// (SetThreads), shared among the lanes while Lanes runs.
func Threads() int {
	pool.mu.Lock()
	n := pool.threads
	pool.mu.Unlock()
	if n == 0 {
		SetThreads(0)
		return Threads()
	}
	if l := int(lanes.Load()); l > 1 {
		n = max(1, n/l)
	}
	return n
}

// lanes is how many lanes Lanes is running (0 or 1 outside it).
var lanes atomic.Int32

// Lanes runs fn(0), …, fn(n−1) at once, fn(0) on the caller's goroutine and each other on one of
// its own, and returns when all have returned. It is for work that splits into n independent
// parts, such as the two halves of a step's micro-batches: each lane then computes its kernels
// on its share of the threads (Threads divides the pool's among the lanes while they run) instead
// of every multiply and loop being cut across all of them — no fork and join per kernel, no core
// idle while another finishes a serial loop. Results do not depend on it, as they do not depend
// on Threads. Lanes running beside other kernel calls (another goroutine's) shrink those calls'
// threads too, for as long as they run.
func Lanes(n int, fn func(lane int)) {
	if n <= 1 {
		if n == 1 {
			fn(0)
		}
		return
	}
	lanes.Add(int32(n))
	defer lanes.Add(-int32(n))
	var wg sync.WaitGroup
	wg.Add(n - 1)
	for i := 1; i < n; i++ {
		go func() {
			defer wg.Done()
			fn(i)
		}()
	}
	fn(0)
	wg.Wait()
}

func worker(offers chan *job) {
	for j := range offers {
		if j == nil {
			return
		}
		if j.join() {
			j.work()
			j.wg.Done()
		}
	}
}

// job is one parallel loop over n tiles.
type job struct {
	n    int
	next atomic.Int64
	body func(s *scratch, t int)

	mu     sync.Mutex
	closed bool           // the caller is done claiming tiles; no more helpers join
	wg     sync.WaitGroup // helpers that joined
}

// join adds a helper to j unless the caller has already closed it.
func (j *job) join() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return false
	}
	j.wg.Add(1)
	return true
}

func (j *job) work() {
	s := getScratch()
	for {
		t := int(j.next.Add(1)) - 1
		if t >= j.n {
			break
		}
		j.body(s, t)
	}
	putScratch(s)
}

// parallelFor runs body(s, t) for t in [0, n) on up to threads goroutines, the caller being one
// of them, and returns when all are done. s is a per-goroutine scratch area.
func parallelFor(n, threads int, body func(s *scratch, t int)) {
	j := &job{n: n, body: body}
	if helpers := min(threads, n) - 1; helpers > 0 {
		offers := pool.offers
	offer:
		for range helpers {
			select {
			case offers <- j:
			default:
				break offer // the queue is full of others' offers; the caller does the rest
			}
		}
	}
	j.work()
	j.mu.Lock()
	j.closed = true
	j.mu.Unlock()
	j.wg.Wait()
}

// scratch is one goroutine's working memory: its packed A block, the B panels it packs for
// itself, and an edge tile; and for a loop over attention heads, one head's operands.
type scratch struct {
	ap, bp []float32
	tile   []float32
	head   []float32
	causal []float32 // the masked attention products' blocks (causalNT, causalTN)
}

// scratches is the free list of scratch areas. Unlike a sync.Pool, the garbage collector does not
// empty it, so areas grown once stay grown and a step of shapes seen before allocates nothing
// here. It holds at most as many as were ever in use at once (threads × nesting).
var scratches struct {
	mu   sync.Mutex
	free []*scratch
}

func getScratch() *scratch {
	scratches.mu.Lock()
	defer scratches.mu.Unlock()
	if n := len(scratches.free); n > 0 {
		s := scratches.free[n-1]
		scratches.free = scratches.free[:n-1]
		return s
	}
	return new(scratch)
}

func putScratch(s *scratch) {
	scratches.mu.Lock()
	scratches.free = append(scratches.free, s)
	scratches.mu.Unlock()
}

// grow returns buf resized to n, reallocating only when it is too small.
func grow(buf []float32, n int) []float32 {
	if cap(buf) < n {
		return make([]float32, n)
	}
	return buf[:n]
}
