package coordinator

import (
	"fmt"
	"maps"
	"net"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// freezer is a TCP proxy between one worker and the coordinator that can go silent without
// closing anything — a laptop whose lid closed, a network gone: nothing passes either way, and no
// socket closes, so only the coordinator's heartbeat bookkeeping can tell.
type freezer struct {
	ln     net.Listener
	target string
	frozen atomic.Bool
	done   chan struct{}
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newFreezer(t *testing.T, target string) *freezer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &freezer{ln: ln, target: target, done: make(chan struct{})}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			f.mu.Lock()
			f.conns = append(f.conns, c, u)
			f.mu.Unlock()
			f.wg.Add(2)
			go f.pipe(u, c)
			go f.pipe(c, u)
		}
	}()
	t.Cleanup(f.close)
	return f
}

// pipe copies src to dst, holding what it read while frozen.
func (f *freezer) pipe(dst, src net.Conn) {
	defer f.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		for f.frozen.Load() {
			select {
			case <-f.done:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (f *freezer) close() {
	close(f.done)
	f.ln.Close()
	f.mu.Lock()
	for _, c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// TestOuterVanishedAtRoundEnd: a worker whose machine vanishes mid-round — its links silent, none
// closed — holds every other replica at the round's end only until the quick timeout (2 s), not
// the heartbeat timeout (a minute here, so that only the quick one can drop it in the test's
// time): the job hastens the round's workers once one has reached its end (Hub.Hasten). Its
// replica is dropped, no shard is restored, and the run is bit for bit the replay of its recorded
// membership.
func TestOuterVanishedAtRoundEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run and its replay")
	}
	spec := outerJob(t, 16, job.Sync{Every: 4, Compress: "int8", Batches: job.BatchesOwn})
	spec.CheckpointEvery, spec.ValEvery = 100, 0
	log := watch(t, "plan", "replica.dropped", "worker.left", "step.abandoned")
	prev := clusterConfig
	clusterConfig = func(cfg *Config) {
		prev(cfg)
		cfg.HeartbeatTimeout = time.Minute
	}
	var fz *freezer
	var c *cluster
	c = startCluster(t, spec, 3, false, func(i int, cfg *client.WorkerConfig) {
		cfg.WorkerID = fmt.Sprintf("w%d", i)
		if i == 2 {
			if fz == nil {
				fz = newFreezer(t, strings.TrimPrefix(cfg.Coordinator, "http://"))
			}
			cfg.Coordinator = "http://" + fz.ln.Addr().String()
		}
	})
	var once sync.Once
	c.mu.Lock()
	c.onStep = func(r local.Report) {
		if r.Step == 5 { // mid-round: the round ends after step 7, at the outer step
			once.Do(func() { fz.frozen.Store(true) })
		}
	}
	c.mu.Unlock()
	c.run(t)
	c.finished(t, spec.Steps)
	// The quick timeout is 2 s, or twice the longest silence w2 kept before (a beat a second,
	// late by what the machine's load made it): well under the heartbeat timeout either way.
	left := log.of("worker.left")
	var quick time.Duration
	if len(left) == 1 {
		if m := regexp.MustCompile(`timeout ([0-9.]+m?s)\)`).FindStringSubmatch(left[0]); m != nil {
			quick, _ = time.ParseDuration(m[1])
		}
	}
	if len(left) != 1 || !strings.HasPrefix(left[0], "w2 ") || quick < 2*time.Second || quick > 4*time.Second {
		t.Fatalf("workers left: %v, want w2 dropped at the quick timeout (2s, or twice its longest silence)", left)
	}
	if d := log.of("replica.dropped"); len(d) != 1 || !strings.HasPrefix(d[0], "w2 ") {
		t.Fatalf("replica.dropped: %v, want w2's replica", d)
	}
	if ab := log.of("step.abandoned"); len(ab) > 0 {
		t.Errorf("steps abandoned: %v", ab)
	}
	sameAsReplay(t, c, spec, replayOf(t, log.planList()))
}

// TestHastenWaited: the plan's workers are hastened exactly while every replica waits on every
// other — an outer exchange, a delayed outer step pending, a round's end reached, a step-mode
// step in flight — and not while outer mode's replicas train free, between steps, or once the
// plan is left.
func TestHastenWaited(t *testing.T) {
	srv := jobServer(t, outerJob(t, 8, job.Sync{Every: 4, Compress: "none"}))
	j := &jobRun{s: srv, sync: outerRule{}, version: 1, phase: phaseTraining,
		stages: []placement{{peer: "a", end: 1}, {peer: "b", end: 1, replica: 1}}}
	hastened := func() []string {
		srv.hub.mu.Lock()
		defer srv.hub.mu.Unlock()
		return slices.Sorted(maps.Keys(srv.hub.hastened))
	}
	for _, c := range []struct {
		name string
		set  func()
		want bool
	}{
		{"outer mode training free", func() {}, false},
		{"a round's end reached", func() { j.atBarrier = true }, true},
		{"a delayed outer step pending", func() { j.atBarrier, j.delayed = false, &delayedOuter{} }, true},
		{"an outer exchange", func() { j.delayed, j.phase = nil, phaseExchange }, true},
		{"at a boundary", func() { j.phase = phaseBoundary }, false},
		{"a step-mode step", func() { j.sync, j.phase = stepRule{}, phaseTraining }, true},
		{"the plan left", func() { j.leave(true) }, false},
	} {
		c.set()
		j.hastenWaited()
		got := hastened()
		if want := []string{"a", "b"}; c.want && !slices.Equal(got, want) || !c.want && len(got) > 0 {
			t.Errorf("%s: hastened %v, want them: %v", c.name, got, c.want)
		}
	}
}
