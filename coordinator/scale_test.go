//go:build unix

package coordinator

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

var (
	scalePeers    = flag.Int("scale.peers", 0, "TestScale: WebSocket workers to connect (0: skip the load test; make scale runs 10000)")
	scaleDuration = flag.Duration("scale.duration", 30*time.Second, "TestScale: length of the churn phase")
	scaleChurn    = flag.Float64("scale.churn", 0.01, "TestScale: fraction of the workers that leave per second during churn, replaced by as many joins")
	scaleSeed     = flag.Uint64("scale.seed", 0, "TestScale: seed of the churn's choices (0: a new one, printed)")
	scaleDialers  = flag.Int("scale.dialers", 32, "TestScale: connections dialled at once")
	scaleHeap     = flag.String("scale.heapprofile", "", "TestScale: write the coordinator's heap profile to `FILE` with every peer connected")
)

// scaleClientEnv, set to the coordinator's ws:// URL, makes TestScale the client side of the
// load test, in the process the test started for it.
const scaleClientEnv = "SHOAL_SCALE_CLIENT"

// TestScale is the coordinator-at-scale load test (issue 13, item 6). It runs only when asked:
//
//	go test ./coordinator -run TestScale -v -timeout 20m -scale.peers=10000   (make scale)
//
// A real coordinator — New over SQLite in a temporary directory, served by NewHTTPServer behind
// LimitListener on 127.0.0.1 as shoal serve serves it, its job waiting for more workers than will
// ever come, so that every join and departure goes through the job loop (a worker row, an event)
// — takes -scale.peers raw WebSocket workers. The workers live in a second process, the test
// binary started again (scaleClient): each end of a loopback connection is a file descriptor,
// and both ends in one process would halve the workers a hard open-file limit allows; it also
// leaves the coordinator alone in this process, where its memory is measured. All the workers heartbeat at
// the interval of their Welcome: a few driver goroutines send the beats of all of them, spread
// over the interval, and one goroutine per connection reads; nothing else runs per connection.
// After the ramp (every worker joining as fast as -scale.dialers dial), a churn phase
// (-scale.duration) makes a fraction of the workers per second (-scale.churn) leave — a third
// each with a Bye, an abrupt close, or by going silent until the hub's heartbeat timeout drops
// them — and as many new ones join. The test prints a table of:
//
//   - heartbeat latency, from a Heartbeat written to its Ack read, at the client (the hub answers
//     in hubConn.handleText); target p99 < 50 ms. That round trip also holds the client
//     process's own scheduling of its thousands of goroutines, on the same cores; so the
//     coordinator's handling time is measured too, inside it (Hub.observeAck): from the
//     heartbeat read off the socket to its Ack written to it, and of that the wait in the
//     connection's send queue for its writer;
//   - memory per idle peer: the coordinator process's HeapInuse+StackInuse after GC with N
//     connected, less the same before, over N (target < 64 KiB); the client process's, measured
//     the same way, beside it;
//   - SQLite write transactions per second while joins and departures are recorded (per join a
//     session, a worker upsert and an event; per departure a state update and an event), counted
//     as the job loop's OnEvent reports them and checked against the rows in the store at the
//     end; the join rate; the time from a join or departure to its rows;
//   - what the calls that walk the whole registry cost at N (Hub.Workers, Hub.SessionWorker,
//     GET /api/status, GET /metrics).
//
// Latencies and rates are reported, never asserted: they are the machine's as much as the
// coordinator's. The test fails when the coordinator drops a worker that kept heartbeating, or
// when the rows written disagree with the joins and departures made.
func TestScale(t *testing.T) {
	if url := os.Getenv(scaleClientEnv); url != "" && *scalePeers > 0 {
		scaleClient(t, url)
		return
	}
	n := *scalePeers
	if n <= 0 {
		t.Skip("the load test runs with -scale.peers=N (make scale: 10,000)")
	}
	raiseFileLimit(t, uint64(n+n/2+1024)) // a socket per worker, departures in flight, the store
	seed := *scaleSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("scale: %d peers, churn %.2f%% of them per second for %v, seed %d (replay its choices with -scale.seed=%d)",
		n, 100**scaleChurn, *scaleDuration, seed, seed)
	if *scaleHeap != "" {
		runtime.MemProfileRate = 4096 // finer than the default, to attribute a few KiB per peer
	}

	// The coordinator, served as shoal serve serves it.
	spec := tinyJob(t, 10)
	discard := slog.New(slog.DiscardHandler)
	rec := &scaleRecorder{joinedAt: map[string]int64{}, leftAt: map[string]int64{}}
	hubHists := new([2]scaleHubHists) // ramp, churn; before the baseline, as the client's
	var hubPhase atomic.Pointer[scaleHubHists]
	hubPhase.Store(&hubHists[0])
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Job: &spec, Loopback: true,
		MinWorkers: math.MaxInt32, // the job gathers workers for as long as the test runs
		Logger:     discard, MaxWorkers: 2*n + 64, MaxWorkersPerAddr: 2*n + 64, OnEvent: rec.onEvent})
	if err != nil {
		t.Fatal(err)
	}
	srv.hub.observeAck = func(handled, queued time.Duration) { // before the first connection
		h := hubPhase.Load()
		h.handled.add(handled)
		h.queued.add(queued)
	}
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := NewHTTPServer(srv.Handler(), HTTPLimits{Logger: discard})
	go hs.Serve(LimitListener(tcp, ConnLimits{Max: 3*n + 64, PerIP: 3*n + 64}))
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()
	defer func() {
		cancel()
		<-runDone
		hs.Close()
		srv.Close()
	}()
	scaleWait(t, 30*time.Second, "the job loop to start its job", func() bool { return srv.status.Load().Job != nil })
	memBefore := memInUse()

	// Ramp: the client process joins n workers and reports.
	cl := startScaleClient(t, "ws://"+tcp.Addr().String()+"/ws", seed)
	ramp := cl.next(t, "ramped", 10*time.Minute)
	if ramp.Welcomed < int64(n) {
		t.Fatalf("%d of %d workers joined (%d failed); first failure: %s", ramp.Welcomed, n, ramp.DialFails, ramp.FirstErr)
	}
	scaleWait(t, 5*time.Minute, "the job loop to record every join", func() bool { return rec.joined.Load() >= int64(n) })
	rampRecorded := time.Duration(rec.lastJoined.Load() - ramp.RampStart)

	// Memory with n idle peers (heartbeating, nothing else).
	memAfter := memInUse()
	perPeer := memAfter.cost(memBefore, n)
	if *scaleHeap != "" {
		writeHeapProfile(t, *scaleHeap)
	}
	probes := probeRegistry(t, srv, "http://"+tcp.Addr().String())

	// Churn.
	j0, l0 := rec.joined.Load(), rec.left.Load()
	churnStart := time.Now()
	hubPhase.Store(&hubHists[1])
	cl.send(t, "churn")
	cl.next(t, "churned", *scaleDuration+time.Minute)
	churnTime := time.Since(churnStart)
	j1, l1 := rec.joined.Load(), rec.left.Load()
	done := cl.next(t, "done", 2*time.Minute) // once the silent workers were dropped
	joins, departures := done.Welcomed, done.Byes+done.Closes+done.SilentDropped+done.Unexpected
	scaleWait(t, 2*time.Minute, "every join and departure to be recorded", func() bool {
		return rec.joined.Load() >= joins && rec.left.Load() >= departures
	})

	// The rows in the store, against the joins and departures made, while the rest stay
	// connected.
	rows := countRows(t, srv.DB())
	for _, c := range []struct {
		what      string
		got, want int64
	}{
		{"worker rows", rows.workers, joins},
		{"worker rows with a session", rows.sessions, joins},
		{"worker rows gone", rows.gone, departures},
		{"worker.joined events", rows.joinedEvents, joins},
		{"worker.left events", rows.leftEvents, departures},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %d, want %d", c.what, c.got, c.want)
		}
	}
	if done.Unexpected > 0 {
		t.Errorf("%d workers were dropped while they heartbeated; first: %s", done.Unexpected, done.FirstDrop)
	}
	rampRows, churnRows, leaveRows := rec.lags(done.Joins[:n]), rec.lags(done.Joins[n:]), rec.lags(done.Leaves)
	cl.finish(t)

	// The report.
	var b strings.Builder
	table := func(rows ...string) {
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
		for _, row := range rows {
			fmt.Fprintln(tw, row+"\t")
		}
		tw.Flush()
		b.WriteString("\n")
	}
	lat := []string{"latency\tsamples\tp50\tp99\tmax"}
	for _, h := range []struct {
		name string
		s    histSummary
	}{{"client: heartbeat written → ack read, ramp", done.HeartbeatRamp}, {"client: heartbeat written → ack read, churn", done.HeartbeatChurn},
		{"coordinator: heartbeat read → ack written, ramp", hubHists[0].handled.summary()},
		{"coordinator: of that, queued for the writer, ramp", hubHists[0].queued.summary()},
		{"coordinator: heartbeat read → ack written, churn", hubHists[1].handled.summary()},
		{"coordinator: of that, queued for the writer, churn", hubHists[1].queued.summary()},
		{"join: dial → welcome", done.Join}, {"join: dial → rows written, ramp", rampRows},
		{"join: dial → rows written, churn", churnRows}, {"departure → rows written", leaveRows}, {"silent: last beat → dropped", done.Silent}} {
		lat = append(lat, fmt.Sprintf("%s\t%d\t%s\t%s\t%s", h.name, h.s.N, fmtMS(h.s.P50), fmtMS(h.s.P99), fmtMS(h.s.Max)))
	}
	table(lat...)
	fmt.Fprintf(&b, "heartbeats written %d, acked %d (the rest lost to departures); client driver lag max %v\n\n",
		done.Beats, done.Acks, done.DriverLag.Round(time.Millisecond))
	table("memory per idle peer\tKiB\theap\tstacks\tgoroutines",
		"coordinator process\t"+perPeer.String(), "client process\t"+ramp.ClientPerConn.String())
	fmt.Fprintf(&b, "(HeapInuse+StackInuse after GC, coordinator: %.0f MiB before the ramp, %.0f MiB after it; kernel socket buffers are not counted)\n\n",
		float64(memBefore.heap+memBefore.stack)/(1<<20), float64(memAfter.heap+memAfter.stack)/(1<<20))
	// A join's session is written before its Welcome (one transaction), its worker row and event
	// after its EventJoined (one transaction: Server.recordJoin); a departure's state and event
	// are two.
	rw, cw := 2*int64(n), 2*(j1-j0)+2*(l1-l0)
	table("SQLite\tjoins\tdepartures\twrite txns\tseconds\ttxns/s",
		fmt.Sprintf("ramp (until all recorded)\t%d\t0\t%d\t%.2f\t%.0f", n, rw, rampRecorded.Seconds(), float64(rw)/rampRecorded.Seconds()),
		fmt.Sprintf("churn\t%d\t%d\t%d\t%.1f\t%.0f", j1-j0, l1-l0, cw, churnTime.Seconds(), float64(cw)/churnTime.Seconds()))
	fmt.Fprintf(&b, "ramp: %d joins welcomed in %v (%.0f joins/s), all recorded %v after the first dial\n",
		n, ramp.RampTook.Round(time.Millisecond), float64(n)/ramp.RampTook.Seconds(), rampRecorded.Round(time.Millisecond))
	fmt.Fprintf(&b, "churn: %d byes, %d closes, %d silent (%d dropped by the hub), %d joins; dropped while heartbeating: %d\n",
		done.Byes, done.Closes, done.Silents, done.SilentDropped, joins-int64(n), done.Unexpected)
	fmt.Fprintf(&b, "rows: %d workers (%d gone, %d with a session), %d worker.joined and %d worker.left events\n\n",
		rows.workers, rows.gone, rows.sessions, rows.joinedEvents, rows.leftEvents)
	pr := []string{fmt.Sprintf("at %d peers\tmedian\tsize", n)}
	for _, p := range probes {
		pr = append(pr, fmt.Sprintf("%s\t%s\t%s", p.name, fmtMS(p.took), p.size))
	}
	table(pr...)
	t.Logf("figures at %d peers, GOMAXPROCS %d:\n%s", n, runtime.GOMAXPROCS(0), b.String())
	t.Logf("targets: heartbeat p99 < 50 ms (client round trip: ramp %s, churn %s; coordinator handling: ramp %s, churn %s); coordinator < 64 KiB per idle peer (%.1f KiB)",
		fmtMS(done.HeartbeatRamp.P99), fmtMS(done.HeartbeatChurn.P99), fmtMS(hubHists[0].handled.quantile(0.99)),
		fmtMS(hubHists[1].handled.quantile(0.99)), (perPeer.Heap+perPeer.Stack)/1024)
}

// scaleRecorder counts the joins and departures the job loop records (Config.OnEvent, called on
// the job loop's goroutine once the event's row is written) and notes when.
type scaleRecorder struct {
	joined, left, lastJoined atomic.Int64
	mu                       sync.Mutex
	joinedAt, leftAt         map[string]int64 // unix ns, by worker id
}

func (rec *scaleRecorder) onEvent(kind, worker, _ string) {
	now := time.Now().UnixNano()
	switch kind {
	case "worker.joined":
		rec.mu.Lock()
		rec.joinedAt[worker] = now
		rec.mu.Unlock()
		rec.lastJoined.Store(now)
		rec.joined.Add(1)
	case "worker.left":
		rec.mu.Lock()
		rec.leftAt[worker] = now
		rec.mu.Unlock()
		rec.left.Add(1)
	}
}

// lags is the time from each of the client's joins (its dial) or departures (its Bye or close)
// to its rows.
func (rec *scaleRecorder) lags(ss []scaleStamp) histSummary {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	h := new(latHist)
	for _, s := range ss {
		at, ok := rec.joinedAt[s.ID]
		if s.Leave {
			at, ok = rec.leftAt[s.ID]
		}
		if ok {
			h.add(time.Duration(at - s.At))
		}
	}
	return h.summary()
}

// scaleMsg is what the client process reports, one JSON line per phase on its descriptor 3:
// "ramped" when every join of the ramp has been made, "churned" at the end of the churn,
// "done" once the silent workers have been dropped.
type scaleMsg struct {
	Phase string

	// ramped
	RampStart     int64 // unix ns of the first dial
	RampTook      time.Duration
	DialFails     int64
	FirstErr      string
	ClientPerConn memCost // of the client process

	// ramped, done
	Welcomed int64

	// done
	Byes, Closes, Silents, SilentDropped, Unexpected int64
	FirstDrop                                        string
	Beats, Acks                                      int64
	DriverLag                                        time.Duration
	HeartbeatRamp, HeartbeatChurn, Join, Silent      histSummary
	Joins, Leaves                                    []scaleStamp
}

// scaleStamp is when the client joined (dialled) or left (Bye, close) as worker ID.
type scaleStamp struct {
	ID    string
	At    int64 // unix ns
	Leave bool  `json:",omitempty"`
}

// scaleClientProc is the client process, seen from the test.
type scaleClientProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	msgs  chan scaleMsg
	log   string
}

// startScaleClient starts the test binary again as the client side, against url.
func startScaleClient(t *testing.T, url string, seed uint64) *scaleClientProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &scaleClientProc{msgs: make(chan scaleMsg, 4), log: filepath.Join(t.TempDir(), "client.log")}
	logf, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(exe, "-test.run=^TestScale$", "-test.v", fmt.Sprintf("-scale.peers=%d", *scalePeers),
		fmt.Sprintf("-scale.duration=%v", *scaleDuration), fmt.Sprintf("-scale.churn=%v", *scaleChurn),
		fmt.Sprintf("-scale.seed=%d", seed), fmt.Sprintf("-scale.dialers=%d", *scaleDialers))
	p.cmd.Env = append(os.Environ(), scaleClientEnv+"="+url)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	p.cmd.ExtraFiles = []*os.File{ctlW} // descriptor 3
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ctlW.Close()
	logf.Close()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		p.cmd.Wait()
	})
	go func() {
		defer close(p.msgs)
		dec := json.NewDecoder(ctlR)
		for {
			var m scaleMsg
			if dec.Decode(&m) != nil {
				ctlR.Close()
				return
			}
			p.msgs <- m
		}
	}()
	return p
}

// next waits for the client's report of phase.
func (p *scaleClientProc) next(t *testing.T, phase string, limit time.Duration) scaleMsg {
	t.Helper()
	select {
	case m, ok := <-p.msgs:
		if !ok {
			t.Fatalf("the client process ended before %q:\n%s", phase, scaleLogTail(p.log))
		}
		if m.Phase != phase {
			t.Fatalf("the client process reported %q, want %q", m.Phase, phase)
		}
		return m
	case <-time.After(limit):
		t.Fatalf("no %q from the client process within %v:\n%s", phase, limit, scaleLogTail(p.log))
	}
	panic("unreachable")
}

func (p *scaleClientProc) send(t *testing.T, cmd string) {
	t.Helper()
	if _, err := fmt.Fprintln(p.stdin, cmd); err != nil {
		t.Fatalf("tell the client process %q: %v", cmd, err)
	}
}

// finish tells the client process to close its connections and exit, and waits for it.
func (p *scaleClientProc) finish(t *testing.T) {
	t.Helper()
	p.stdin.Close()
	if err := p.cmd.Wait(); err != nil {
		t.Errorf("client process: %v\n%s", err, scaleLogTail(p.log))
	}
}

// scaleLogTail is the end of a log file.
func scaleLogTail(path string) string {
	b, _ := os.ReadFile(path)
	return string(b[max(len(b)-4096, 0):])
}

// scaleClient is the client side of TestScale, in the process the test started for it: it
// reports on descriptor 3 and takes "churn" on its stdin; stdin's end closes every connection.
func scaleClient(t *testing.T, url string) {
	n := *scalePeers
	raiseFileLimit(t, uint64(n+n/2+1024))
	ctl := json.NewEncoder(os.NewFile(3, "scale-control"))
	report := func(m scaleMsg) {
		if err := ctl.Encode(m); err != nil {
			t.Fatalf("report %s: %v", m.Phase, err)
		}
	}
	cmds := bufio.NewScanner(os.Stdin)
	rng := rand.New(rand.NewPCG(*scaleSeed, 13))
	hists := new(scaleHists) // before the baseline: its memory is nobody's per-connection cost
	r := newScaleRun(url, hists)
	defer r.closeAll()
	memBefore := memInUse()

	r.hb.Store(&hists.hbRamp)
	r.startDialers(*scaleDialers)
	defer close(r.joinq)
	start := time.Now()
	r.enqueueJoins(n)
	r.joinsDone.Wait()
	took := time.Since(start)
	m := scaleMsg{Phase: "ramped", RampStart: start.UnixNano(), RampTook: took, Welcomed: r.welcomed.Load(),
		DialFails: r.dialFails.Load(), ClientPerConn: memInUse().cost(memBefore, n)}
	if err := r.firstDialErr(); err != nil {
		m.FirstErr = err.Error()
	}
	report(m)
	if !cmds.Scan() || cmds.Text() != "churn" {
		return
	}

	r.hb.Store(&hists.hbChurn)
	ctx, cancel := context.WithTimeout(context.Background(), *scaleDuration)
	r.churn(ctx, rng, *scaleChurn*float64(n))
	cancel()
	report(scaleMsg{Phase: "churned"})
	r.joinsDone.Wait()
	// A silent worker is dropped a heartbeat timeout (5 intervals) after its last beat.
	for deadline := time.Now().Add(time.Minute); r.silentDropped.Load() < r.silents.Load() && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	r.mu.Lock()
	joins, leaves := slices.Clone(r.joinStamps), slices.Clone(r.leaveStamps)
	r.mu.Unlock()
	report(scaleMsg{Phase: "done", Welcomed: r.welcomed.Load(),
		Byes: r.byes.Load(), Closes: r.closes.Load(), Silents: r.silents.Load(), SilentDropped: r.silentDropped.Load(),
		Unexpected: r.unexpected.Load(), FirstDrop: r.firstDrop(), Beats: r.beats.Load(), Acks: r.acks.Load(),
		DriverLag:     time.Duration(r.driverLag.Load()),
		HeartbeatRamp: hists.hbRamp.summary(), HeartbeatChurn: hists.hbChurn.summary(), Join: hists.join.summary(),
		Silent: hists.silent.summary(), Joins: joins, Leaves: leaves})
	for cmds.Scan() {
	}
}

func writeHeapProfile(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		t.Fatal(err)
	}
}

// fmtMS formats d in milliseconds, to the histograms' resolution.
func fmtMS(d time.Duration) string {
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

// raiseFileLimit raises RLIMIT_NOFILE to need (Go already raised the soft limit to the hard one
// at start): up to the hard limit, or past it where the process may (CAP_SYS_RESOURCE). It skips
// the test when need cannot be had, and puts the limit back afterwards.
func raiseFileLimit(t *testing.T, need uint64) {
	t.Helper()
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Skipf("cannot read the open-file limit: %v", err)
	}
	if old.Cur >= need {
		return
	}
	lim := syscall.Rlimit{Cur: min(need, old.Max), Max: old.Max}
	if need > old.Max {
		lim = syscall.Rlimit{Cur: need, Max: need}
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil && need > old.Max {
		lim = syscall.Rlimit{Cur: old.Max, Max: old.Max}
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	var now syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &now)
	t.Cleanup(func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) })
	if now.Cur < need {
		t.Skipf("%d peers need %d open files in each of the coordinator's and the client's processes, the limit is %d (hard %d): "+
			"raise it (ulimit -Hn) or lower -scale.peers", *scalePeers, need, now.Cur, now.Max)
	}
}

// memSample is the heap and stack memory in use after a full collection, and the goroutines.
type memSample struct {
	heap, stack uint64
	goroutines  int
}

func memInUse() memSample {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return memSample{heap: m.HeapInuse, stack: m.StackInuse, goroutines: runtime.NumGoroutine()}
}

// memCost is memory (bytes) and goroutines per peer.
type memCost struct{ Heap, Stack, Goroutines float64 }

// cost is what each of n peers added between before and m.
func (m memSample) cost(before memSample, n int) memCost {
	d := func(a, b uint64) float64 { return (float64(a) - float64(b)) / float64(n) }
	return memCost{Heap: d(m.heap, before.heap), Stack: d(m.stack, before.stack),
		Goroutines: float64(m.goroutines-before.goroutines) / float64(n)}
}

// String is a table row's cells: KiB in all, of heap, of stacks, goroutines.
func (c memCost) String() string {
	return fmt.Sprintf("%.1f\t%.1f\t%.1f\t%.2f", (c.Heap+c.Stack)/1024, c.Heap/1024, c.Stack/1024, c.Goroutines)
}

func scaleWait(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// latHist is a histogram of durations: 10 µs buckets up to 2 s, 10 ms buckets from there to
// 60 s, the exact maximum. Lock-free: every reader goroutine records into it.
type latHist struct {
	buckets [histFine + histCoarse]atomic.Uint32
	n, top  atomic.Int64
}

const (
	histFineRes   = 10 * time.Microsecond
	histFineTop   = 2 * time.Second
	histFine      = int(histFineTop / histFineRes)
	histCoarseRes = 10 * time.Millisecond
	histCoarse    = int((60*time.Second - histFineTop) / histCoarseRes)
)

func (h *latHist) add(d time.Duration) {
	i := int(max(d, 0) / histFineRes)
	if d >= histFineTop {
		i = min(histFine+int((d-histFineTop)/histCoarseRes), len(h.buckets)-1)
	}
	h.buckets[i].Add(1)
	h.n.Add(1)
	storeMaxInt64(&h.top, int64(d))
}

func (h *latHist) count() int64       { return h.n.Load() }
func (h *latHist) max() time.Duration { return time.Duration(h.top.Load()) }

// quantile is the upper edge of the bucket that holds the q-th sample, or the maximum if less.
func (h *latHist) quantile(q float64) time.Duration {
	n := h.n.Load()
	if n == 0 {
		return 0
	}
	rank := max(int64(math.Ceil(q*float64(n))), 1)
	var seen int64
	for i := range h.buckets {
		if seen += int64(h.buckets[i].Load()); seen >= rank {
			edge := time.Duration(i+1) * histFineRes
			if i >= histFine {
				edge = histFineTop + time.Duration(i-histFine+1)*histCoarseRes
			}
			return min(edge, h.max())
		}
	}
	return h.max()
}

// histSummary is a histogram's figures, as the client process reports them.
type histSummary struct {
	N             int64
	P50, P99, Max time.Duration
}

func (h *latHist) summary() histSummary {
	return histSummary{N: h.count(), P50: h.quantile(0.5), P99: h.quantile(0.99), Max: h.max()}
}

// scaleHubHists are the coordinator's heartbeat handling times of one phase (Hub.observeAck).
type scaleHubHists struct{ handled, queued latHist }

// scaleHists are the client's latency histograms.
type scaleHists struct {
	hbRamp, hbChurn, join, silent latHist
}

// Peer states. The churn loop moves live peers to leaving or silent; a reader whose live
// connection fails moves its peer to gone.
const (
	peerLive int32 = iota
	peerLeaving
	peerSilent
	peerGone
)

// scalePeer is one worker connection on the client side: a raw WebSocket, read by one goroutine
// and written by its heartbeat driver (and the churn loop's Bye; the library serialises writes).
type scalePeer struct {
	ws    *websocket.Conn
	id    string
	state atomic.Int32
	seq   uint64          // the driver's
	sent  [4]atomic.Int64 // unix ns heartbeat seq was written, at seq%4; 0 once acked
	last  atomic.Int64    // unix ns of the last heartbeat written
}

// scaleRun is the client side: the connections, their heartbeat drivers and dialers, counters.
type scaleRun struct {
	url   string
	hc    *http.Client
	hists *scaleHists
	hb    atomic.Pointer[latHist] // the heartbeat histogram of the current phase

	mu      sync.Mutex
	live    []*scalePeer // candidates for departure (may hold some gone already)
	all     []*scalePeer // every connection made, closed at the end
	drivers [driverCount]*scaleDriver
	stop    context.CancelFunc
	driving sync.WaitGroup
	readers sync.WaitGroup
	// joinStamps and leaveStamps are when each join was dialled and each Bye or close made.
	joinStamps, leaveStamps []scaleStamp
	startDriving            sync.Once

	joinq     chan struct{}
	joinsDone sync.WaitGroup // one per join asked for
	names     atomic.Int64
	dialErr   atomic.Pointer[error]
	dropMsg   atomic.Pointer[string]

	welcomed, dialFails                  atomic.Int64
	beats, acks                          atomic.Int64
	byes, closes, silents, silentDropped atomic.Int64
	unexpected                           atomic.Int64
	driverLag                            atomic.Int64 // ns, the most a driver's slot ran behind its tick
}

const (
	driverCount = 4
	beatSlots   = 50 // each driver spreads its connections' beats over 50 slots of the interval
)

func newScaleRun(url string, hists *scaleHists) *scaleRun {
	r := &scaleRun{url: url, hists: hists,
		// Its own transport: no proxy from the environment, nothing shared with the rest of the
		// process. A 101 response hands its connection over, so nothing is pooled.
		hc: &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{}).DialContext}}}
	for i := range r.drivers {
		r.drivers[i] = &scaleDriver{}
	}
	return r
}

// scaleDriver sends the heartbeats of its share of the connections, one slot per tick.
type scaleDriver struct {
	mu    sync.Mutex
	slots [beatSlots][]*scalePeer
	next  int
}

func (d *scaleDriver) add(p *scalePeer) {
	d.mu.Lock()
	d.slots[d.next%beatSlots] = append(d.slots[d.next%beatSlots], p)
	d.next++
	d.mu.Unlock()
}

func (r *scaleRun) startDrivers(interval time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	r.stop = cancel
	for _, d := range r.drivers {
		r.driving.Add(1)
		go r.runDriver(ctx, d, interval)
	}
}

func (r *scaleRun) stopDrivers() {
	if r.stop != nil {
		r.stop()
		r.driving.Wait()
		r.stop = nil
	}
}

func (r *scaleRun) runDriver(ctx context.Context, d *scaleDriver, interval time.Duration) {
	defer r.driving.Done()
	tick := time.NewTicker(interval / beatSlots)
	defer tick.Stop()
	var batch []*scalePeer
	for k := 0; ; k = (k + 1) % beatSlots {
		var at time.Time
		select {
		case <-ctx.Done():
			return
		case at = <-tick.C:
		}
		d.mu.Lock()
		keep := d.slots[k][:0]
		for _, p := range d.slots[k] {
			if p.state.Load() == peerLive {
				keep = append(keep, p)
			}
		}
		clear(d.slots[k][len(keep):])
		d.slots[k] = keep
		batch = append(batch[:0], keep...)
		d.mu.Unlock()
		for _, p := range batch {
			r.beat(p)
		}
		storeMaxInt64(&r.driverLag, int64(time.Since(at)))
	}
}

func storeMaxInt64(v *atomic.Int64, x int64) {
	for {
		m := v.Load()
		if x <= m || v.CompareAndSwap(m, x) {
			return
		}
	}
}

func (r *scaleRun) beat(p *scalePeer) {
	p.seq++
	b, err := proto.EncodeMessage(&proto.Heartbeat{Seq: p.seq})
	if err != nil {
		panic(err) // a heartbeat always encodes
	}
	now := time.Now().UnixNano()
	p.sent[p.seq%4].Store(now)
	p.last.Store(now)
	if p.ws.Write(context.Background(), websocket.MessageText, b) == nil {
		r.beats.Add(1)
	} else {
		p.sent[p.seq%4].Store(0)
	}
}

// read is a connection's one goroutine: it times the acks and notes how the connection ended.
func (r *scaleRun) read(p *scalePeer) {
	defer r.readers.Done()
	last := ""
	for {
		_, b, err := p.ws.Read(context.Background())
		now := time.Now()
		if err != nil {
			switch {
			case p.state.CompareAndSwap(peerLive, peerGone):
				r.unexpected.Add(1)
				msg := fmt.Sprintf("%s: %v (the hub's last error: %q)", p.id, err, last)
				r.dropMsg.CompareAndSwap(nil, &msg)
			case p.state.Load() == peerSilent:
				r.silentDropped.Add(1)
				r.hists.silent.add(time.Duration(now.UnixNano() - p.last.Load()))
			}
			p.ws.CloseNow()
			return
		}
		m, err := proto.DecodeMessage(b, proto.RoleWorker)
		if err != nil {
			continue
		}
		switch m := m.(type) {
		case *proto.Heartbeat:
			if !m.Ack {
				continue
			}
			if sent := p.sent[m.Seq%4].Swap(0); sent != 0 {
				r.acks.Add(1)
				if h := r.hb.Load(); h != nil {
					h.add(time.Duration(now.UnixNano() - sent))
				}
			}
		case *proto.Error:
			last = m.Message
		}
	}
}

func (r *scaleRun) firstDialErr() error {
	if e := r.dialErr.Load(); e != nil {
		return *e
	}
	return nil
}

func (r *scaleRun) firstDrop() string {
	if s := r.dropMsg.Load(); s != nil {
		return *s
	}
	return ""
}

// adopt makes ws one of the run's connections: listed, read, driven.
func (r *scaleRun) adopt(ws *websocket.Conn, id string) {
	p := &scalePeer{ws: ws, id: id}
	p.last.Store(time.Now().UnixNano()) // the hub hears it last at its hello until it beats
	r.mu.Lock()
	r.live = append(r.live, p)
	r.all = append(r.all, p)
	d := r.drivers[len(r.all)%driverCount]
	r.mu.Unlock()
	r.readers.Add(1)
	go r.read(p)
	d.add(p)
}

// startDialers starts k goroutines that make the joins asked for with enqueueJoins.
func (r *scaleRun) startDialers(k int) {
	r.joinq = make(chan struct{}, 1<<20)
	for range max(k, 1) {
		go func() {
			for range r.joinq {
				if err := r.join(); err != nil {
					r.dialFails.Add(1)
					r.dialErr.CompareAndSwap(nil, &err)
				}
				r.joinsDone.Done()
			}
		}()
	}
}

func (r *scaleRun) enqueueJoins(k int) {
	r.joinsDone.Add(k)
	for range k {
		r.joinq <- struct{}{}
	}
}

// join dials, says hello and reads the welcome.
func (r *scaleRun) join() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	ws, _, err := websocket.Dial(ctx, r.url, &websocket.DialOptions{HTTPClient: r.hc})
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	w, err := r.hello(ctx, ws)
	if err != nil {
		ws.CloseNow()
		return err
	}
	r.hists.join.add(time.Since(start))
	// The drivers beat at the interval the coordinator asks for.
	r.startDriving.Do(func() { r.startDrivers(time.Duration(w.HeartbeatMS) * time.Millisecond) })
	r.adopt(ws, w.WorkerID)
	r.mu.Lock()
	r.joinStamps = append(r.joinStamps, scaleStamp{ID: w.WorkerID, At: start.UnixNano()})
	r.mu.Unlock()
	r.welcomed.Add(1)
	return nil
}

func (r *scaleRun) hello(ctx context.Context, ws *websocket.Conn) (*proto.Welcome, error) {
	hello := proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 10, MemoryBytes: 1 << 30, Threads: 1,
		Name: fmt.Sprintf("scale-%d", r.names.Add(1))}
	b, err := proto.EncodeMessage(&hello)
	if err != nil {
		return nil, err
	}
	if err := ws.Write(ctx, websocket.MessageText, b); err != nil {
		return nil, fmt.Errorf("hello: %w", err)
	}
	_, b, err = ws.Read(ctx)
	if err != nil {
		return nil, fmt.Errorf("welcome: %w", err)
	}
	m, err := proto.DecodeMessage(b, proto.RoleWorker)
	if err != nil {
		return nil, fmt.Errorf("welcome: %w", err)
	}
	w, ok := m.(*proto.Welcome)
	if !ok {
		return nil, fmt.Errorf("got %#v, want a welcome", m)
	}
	return w, nil
}

// churn makes perSecond departures and as many joins a second, in tenths of a second, until ctx
// ends.
func (r *scaleRun) churn(ctx context.Context, rng *rand.Rand, perSecond float64) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	due := 0.0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		due += perSecond / 10
		k := int(due)
		due -= float64(k)
		for range k {
			if p := r.pick(rng); p != nil {
				r.leave(p, rng.IntN(3))
			}
		}
		r.enqueueJoins(k)
	}
}

// pick takes a random live peer off the departure candidates.
func (r *scaleRun) pick(rng *rand.Rand) *scalePeer {
	r.mu.Lock()
	defer r.mu.Unlock()
	for len(r.live) > 0 {
		i := rng.IntN(len(r.live))
		p := r.live[i]
		r.live[i] = r.live[len(r.live)-1]
		r.live[len(r.live)-1] = nil
		r.live = r.live[:len(r.live)-1]
		if p.state.Load() == peerLive {
			return p
		}
	}
	return nil
}

// leave makes p leave as how says: 0 with a Bye, 1 by closing its socket at once, 2 by going
// silent.
func (r *scaleRun) leave(p *scalePeer, how int) {
	switch how {
	case 0:
		if !p.state.CompareAndSwap(peerLive, peerLeaving) {
			return
		}
		r.byes.Add(1)
		r.stampLeave(p)
		b, err := proto.EncodeMessage(&proto.Bye{Reason: "scale test churn"})
		if err != nil {
			panic(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		p.ws.Write(ctx, websocket.MessageText, b) // the hub closes the connection after it
		cancel()
	case 1:
		if !p.state.CompareAndSwap(peerLive, peerLeaving) {
			return
		}
		r.closes.Add(1)
		r.stampLeave(p)
		p.ws.CloseNow()
	default:
		// The driver skips it from its next slot on; the hub drops it a heartbeat timeout after
		// its last beat, and its reader sees that.
		if p.state.CompareAndSwap(peerLive, peerSilent) {
			r.silents.Add(1)
		}
	}
}

func (r *scaleRun) stampLeave(p *scalePeer) {
	r.mu.Lock()
	r.leaveStamps = append(r.leaveStamps, scaleStamp{ID: p.id, At: time.Now().UnixNano(), Leave: true})
	r.mu.Unlock()
}

// closeAll closes every connection and waits for the readers.
func (r *scaleRun) closeAll() {
	r.stopDrivers()
	r.mu.Lock()
	all := r.all
	r.all, r.live = nil, nil
	r.mu.Unlock()
	for _, p := range all {
		p.state.CompareAndSwap(peerLive, peerLeaving)
		p.state.CompareAndSwap(peerSilent, peerLeaving)
		p.ws.CloseNow()
	}
	r.readers.Wait()
}

// scaleProbe is the cost of one call that walks the whole registry.
type scaleProbe struct {
	name string
	took time.Duration // median of 5
	size string
}

// probeRegistry times the calls whose cost grows with the connected workers.
func probeRegistry(t *testing.T, srv *Server, base string) []scaleProbe {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	median := func(f func() int) (time.Duration, int) {
		var d [5]time.Duration
		size := 0
		for i := range d {
			start := time.Now()
			size = f()
			d[i] = time.Since(start)
		}
		slices.Sort(d[:])
		return d[2], size
	}
	get := func(path string) func() int {
		return func() int {
			resp, err := hc.Get(base + path)
			if err != nil {
				t.Errorf("GET %s: %v", path, err)
				return 0
			}
			defer resp.Body.Close()
			n, _ := io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusOK {
				t.Errorf("GET %s: %s", path, resp.Status)
			}
			return int(n)
		}
	}
	var out []scaleProbe
	d, k := median(func() int { return len(srv.hub.Workers()) })
	out = append(out, scaleProbe{"Hub.Workers (dashboard, /metrics)", d, fmt.Sprintf("%d entries", k)})
	d, _ = median(func() int { srv.hub.SessionWorker("no such credential"); return 0 })
	out = append(out, scaleProbe{"Hub.SessionWorker, a miss (uploads, blobs)", d, "-"})
	d, k = median(get("/api/status"))
	out = append(out, scaleProbe{"GET /api/status", d, fmt.Sprintf("%d", k)})
	d, k = median(get("/metrics"))
	out = append(out, scaleProbe{"GET /metrics", d, fmt.Sprintf("%d", k)})
	return out
}

// scaleRows is what the store holds of the workers.
type scaleRows struct {
	sessions, workers, gone, joinedEvents, leftEvents int64
}

// countRows reads the store through its API: every worker row, its session, the join and
// departure events.
func countRows(t *testing.T, db *storage.DB) scaleRows {
	t.Helper()
	ctx := context.Background()
	var rows scaleRows
	ws, err := db.ListWorkers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range ws {
		rows.workers++
		if w.State == storage.WorkerGone {
			rows.gone++
		}
		if _, err := db.SessionHash(ctx, w.ID); err == nil {
			rows.sessions++
		}
	}
	for _, c := range []struct {
		kind string
		n    *int64
	}{{"worker.joined", &rows.joinedEvents}, {"worker.left", &rows.leftEvents}} {
		evs, err := db.ListEvents(ctx, storage.EventFilter{Kind: c.kind, Limit: math.MaxInt32})
		if err != nil {
			t.Fatal(err)
		}
		*c.n = int64(len(evs))
	}
	return rows
}
