package coordinator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// auditEvent is an event of a cluster's job, with when the test heard of it.
type auditEvent struct {
	kind, worker string
	detail       map[string]any
	at           time.Time
}

// auditEvents makes the next test cluster recompute audits here, and returns what it has recorded
// so far of the events of kinds; the cluster config is reset when the test ends.
func auditEvents(t *testing.T, kinds ...string) func() []auditEvent {
	var mu sync.Mutex
	var events []auditEvent
	clusterConfig = func(cfg *Config) {
		cfg.Recompute = recomputeHere
		cfg.OnEvent = func(kind, worker, detail string) {
			for _, k := range kinds {
				if k == kind {
					var d map[string]any
					json.Unmarshal([]byte(detail), &d)
					mu.Lock()
					events = append(events, auditEvent{kind, worker, d, time.Now()})
					mu.Unlock()
				}
			}
		}
	}
	t.Cleanup(func() { clusterConfig = nil })
	return func() []auditEvent {
		mu.Lock()
		defer mu.Unlock()
		return append([]auditEvent(nil), events...)
	}
}

func eventsOf(evs []auditEvent, kind string) []auditEvent {
	var out []auditEvent
	for _, e := range evs {
		if e.kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// creditOf is worker's credit in the cluster's job (zero when it has none).
func creditOf(t *testing.T, c *cluster, worker string) storage.Credit {
	t.Helper()
	credits, err := c.srv.db.Credits(context.Background(), c.srv.status.Load().jobID(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, cr := range credits {
		if cr.Worker == worker {
			return cr
		}
	}
	return storage.Credit{Worker: worker}
}

// TestAuditLeaveOnAudit: a worker that cheats and leaves for good when an audit arrives
// (SHOAL_FAULT leave-on-audit) is not banned — it is gone, and leaving is no verdict — but its
// cheat does not stay: its unverified work is rejected, every checkpoint that held it is
// discarded, and the job replays from before its first step to exactly the single process's
// parameters. The job audits rarely, so that the worker is audited late (by the forced audit of
// the last step at the latest) and checkpoints hold its work when it leaves.
func TestAuditLeaveOnAudit(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 12)
	spec.Plan = auditPlan
	spec.AuditRate = 0.001
	_, ref := localReports(t, spec)
	events := auditEvents(t, "audit.abandoned", "peer.banned", "job.rollback")
	c := startCluster(t, spec, 4, false, faulty(1, client.FaultLeaveOnAudit))
	c.run(t)
	evs := events()
	if bans := eventsOf(evs, "peer.banned"); len(bans) > 0 {
		t.Fatalf("banned: %+v; a worker that left once is not", bans)
	}
	ab := eventsOf(evs, "audit.abandoned")
	if len(ab) != 1 || ab[0].worker != "w1" {
		t.Fatalf("abandoned audits %+v, want one of w1", ab)
	}
	d := ab[0].detail
	t.Logf("audit.abandoned: %v", d)
	target, ok1 := d["rollback_to_step"].(float64)
	from, ok2 := d["rejected_from_step"].(float64)
	rejected, _ := d["rejected_steps"].(float64)
	if !ok1 || !ok2 || rejected < 1 || target > from {
		t.Fatalf("audit.abandoned says %v: want what was rejected, from which step, and the rollback before it", d)
	}
	cr := creditOf(t, c, "w1")
	if cr.VerifiedMicroBatches != 0 || cr.PendingMicroBatches != 0 || cr.RejectedMicroBatches == 0 {
		t.Errorf("the leaver's credit %+v, want its work rejected", cr)
	}
	for _, w := range []string{"w0", "w2"} {
		if cr := creditOf(t, c, w); cr.VerifiedMicroBatches == 0 || cr.RejectedMicroBatches != 0 {
			t.Errorf("honest %s's credit %+v, want verified work and none rejected", w, cr)
		}
	}
	// No checkpoint keeps its work: every one taken before it left, after the step the job went
	// back to, was discarded.
	cks, err := c.srv.db.ListCheckpoints(context.Background(), c.srv.status.Load().jobID(t))
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, ck := range cks {
		if ck.Step <= int64(target) || !ck.CreatedAt.Before(ab[0].at) || ck.State == storage.CheckpointPending {
			continue
		}
		held++
		if ck.State != storage.CheckpointDiscarded {
			t.Errorf("checkpoint %d (step %d), taken with the leaver's work, is %s", ck.ID, ck.Step, ck.State)
		}
	}
	t.Logf("%d checkpoints held the leaver's work", held)
	assertFinalCheckpoint(t, c, ref)
}

// TestAuditAbandonedTwiceBanned: a worker whose connection is lost whenever it is audited — its
// session ends before it shows the evidence, and it reconnects under its id — abandons an audit
// each time; the first costs it its unverified work and the job a replay, the second (maxAbandons)
// a ban. The job still ends on the single process's parameters.
func TestAuditAbandonedTwiceBanned(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	// Steps enough that w1, back after its first abandonment, is audited again before the job
	// ends: with 8 a fresh clone at load once finished the job first (one abandonment seen).
	spec := tinyJob(t, 16)
	spec.Plan = auditPlan
	spec.AuditRate = 1
	_, ref := localReports(t, spec)
	events := auditEvents(t, "audit.abandoned", "peer.banned")
	var c *cluster
	var drops atomic.Int32
	c = startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
		faulty(-1, "")(i, cfg)
		if i != 1 {
			return
		}
		// Instead of the evidence, the coordinator hears the worker's connection drop.
		cfg.HTTP = &http.Client{Transport: roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if req.Method == http.MethodPost && strings.HasPrefix(req.URL.Path, "/api/audits/") {
				drops.Add(1)
				c.srv.hub.Drop("w1", errors.New("test: the connection is lost when audited"))
				return nil, errors.New("test: connection lost")
			}
			return http.DefaultTransport.RoundTrip(req)
		})}
	})
	c.run(t)
	evs := events()
	ab := eventsOf(evs, "audit.abandoned")
	bans := eventsOf(evs, "peer.banned")
	if len(ab) != 2 || ab[0].worker != "w1" || ab[1].worker != "w1" {
		t.Fatalf("abandoned audits %+v, want two of w1", ab)
	}
	if _, ok := ab[0].detail["rollback_to_step"]; !ok || ab[0].detail["banned"] != nil {
		t.Errorf("the first abandonment %v: want a rollback and no ban", ab[0].detail)
	}
	if ab[1].detail["banned"] != true || len(bans) != 1 || bans[0].worker != "w1" {
		t.Errorf("the second abandonment %v, bans %+v: want w1 banned", ab[1].detail, bans)
	}
	t.Logf("connection dropped %d times; banned: %v", drops.Load(), bans[0].detail["reason"])
	if cr := creditOf(t, c, "w1"); cr.VerifiedMicroBatches != 0 || cr.PendingMicroBatches != 0 {
		t.Errorf("w1's credit %+v, want none but rejected", cr)
	}
	assertFinalCheckpoint(t, c, ref)
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// cutFirstAudit is a worker's HTTP transport that closes the TCP connection of its first audit
// upload once half the evidence has gone out, and records the outcome of every audit upload by
// path.
type cutFirstAudit struct {
	base *http.Transport
	cut  atomic.Bool

	mu       sync.Mutex
	cutPath  string
	outcomes map[string][]string // path → "204", "error: …" in order
}

func (ct *cutFirstAudit) RoundTrip(req *http.Request) (*http.Response, error) {
	audit := req.Method == http.MethodPost && strings.HasPrefix(req.URL.Path, "/api/audits/")
	if audit && req.ContentLength > 0 && ct.cut.CompareAndSwap(false, true) {
		var mu sync.Mutex
		var conn net.Conn
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
			mu.Lock()
			conn = i.Conn
			mu.Unlock()
		}}
		req = req.Clone(httptrace.WithClientTrace(req.Context(), trace))
		req.Body = &cutBody{r: req.Body, left: req.ContentLength / 2, cut: func() {
			mu.Lock()
			defer mu.Unlock()
			if conn != nil {
				conn.Close()
			}
		}}
		ct.mu.Lock()
		ct.cutPath = req.URL.Path
		ct.mu.Unlock()
	}
	resp, err := ct.base.RoundTrip(req)
	if audit {
		out := "error: "
		if err != nil {
			out += err.Error()
		} else {
			out = resp.Status
		}
		ct.mu.Lock()
		if ct.outcomes == nil {
			ct.outcomes = map[string][]string{}
		}
		ct.outcomes[req.URL.Path] = append(ct.outcomes[req.URL.Path], out)
		ct.mu.Unlock()
	}
	return resp, err
}

// cutBody reads left bytes of r, then cuts the connection and fails.
type cutBody struct {
	r    io.ReadCloser
	left int64
	cut  func()
}

func (b *cutBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		b.cut()
		return 0, errors.New("test: connection cut mid-upload")
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}

func (b *cutBody) Close() error { return b.r.Close() }

// TestAuditUploadCut: an honest worker's evidence upload is cut halfway — its TCP connection
// closed under it. That is not evidence against it: it is not banned, the audit waits for
// another upload, the worker uploads the evidence again and the audit passes; its credit is
// verified, and the job runs as a single process does.
func TestAuditUploadCut(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a cluster run")
	}
	spec := tinyJob(t, 6)
	spec.Plan = auditPlan
	spec.AuditRate = 1
	want, ref := localReports(t, spec)
	events := auditEvents(t, "audit.abandoned", "peer.banned", "audit.passed")
	ct := &cutFirstAudit{base: http.DefaultTransport.(*http.Transport).Clone()}
	c := startCluster(t, spec, 4, false, func(i int, cfg *client.WorkerConfig) {
		faulty(-1, "")(i, cfg)
		if i == 1 {
			cfg.HTTP = &http.Client{Transport: ct}
		}
	})
	c.run(t)
	evs := events()
	if bad := append(eventsOf(evs, "peer.banned"), eventsOf(evs, "audit.abandoned")...); len(bad) > 0 {
		t.Fatalf("an honest worker whose upload was cut: %+v", bad)
	}
	ct.mu.Lock()
	path, outs := ct.cutPath, ct.outcomes[ct.cutPath]
	ct.mu.Unlock()
	if path == "" {
		t.Fatal("no audit upload was cut")
	}
	t.Logf("%s: %q", path, outs)
	if len(outs) < 2 || !strings.HasPrefix(outs[0], "error: ") || outs[len(outs)-1] != "204 No Content" {
		t.Fatalf("uploads of %s: %q; want the cut one, then one taken", path, outs)
	}
	// The evidence is thin (proto.Audit.Sample): less than the lean evidence's start state alone,
	// 12 bytes a parameter of the worker's shard.
	lean := map[string]float64{}
	plan := c.srv.status.Load().Plan
	hosted := func(b, e int) bool { return false }
	for _, h := range plan.ExpertHosts {
		for _, e := range h.Experts {
			for _, sp := range spec.Model.ExpertSpecs(h.Block, e) {
				lean[h.Peer] += 12 * float64(sp.Size())
			}
		}
		hosted = func(b, e int) bool { return b == h.Block && slices.Contains(h.Experts, e) }
	}
	for _, st := range plan.Stages {
		sps, err := shardSpecs(spec.Model, proto.Shard{Stage: &proto.StageShard{Begin: st.Blocks[0], End: st.Blocks[1]}}, hosted)
		if err != nil {
			t.Fatal(err)
		}
		for _, sp := range sps {
			lean[st.Peer] += 12 * float64(sp.Size())
		}
	}
	passed := 0
	for _, e := range eventsOf(evs, "audit.passed") {
		if e.worker == "w1" {
			passed++
		}
		if n, _ := e.detail["evidence_bytes"].(float64); !(n > 0 && n < lean[e.worker]) {
			t.Errorf("%s's evidence of step %v: %v bytes; its shard's start state alone is %v bytes: not thin", e.worker, e.detail["step"], n, lean[e.worker])
		}
	}
	if cr := creditOf(t, c, "w1"); passed == 0 || cr.VerifiedMicroBatches == 0 || cr.RejectedMicroBatches != 0 {
		t.Errorf("w1: %d audits passed, credit %+v; want passes, verified work and none rejected", passed, cr)
	}
	sameReports(t, c.reports, want)
	assertFinalCheckpoint(t, c, ref)
}

// TestAuditUploadCutIsNoVerdict: evidence whose connection is closed halfway through its
// declared length — a real TCP connection, cut — is not judged: no verdict, the audit takes
// another upload, and the whole one that follows is judged. Half a bundle sent as a whole body is
// no cut, and is judged.
func TestAuditUploadCutIsNoVerdict(t *testing.T) {
	r, pa := auditRig(t)
	var b bytes.Buffer
	if err := (&audit.Bundle{Step: 3, PlanVersion: 1, StateIn: []safetensors.Tensor{{Name: "w", Shape: []int{4096}, Data: make([]float32, 4096)}}}).Write(&b); err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: shoal\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n", proto.AuditPath(pa.id), r.a.Session, b.Len())
	conn.Write(b.Bytes()[:b.Len()/2])
	conn.Close()
	// The handler is done with the cut upload once the audit takes uploads again.
	deadline := time.Now().Add(time.Minute)
	for {
		st := r.srv.auditReg.snapshot(r.jobID.String())
		if len(st) == 1 && st[0].tries == 1 && !st[0].busy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("audit after a cut upload: %+v; want it waiting for another upload", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case v := <-r.srv.auditResults:
		t.Fatalf("a cut upload was judged: %+v", v)
	default:
	}
	if status, msg := r.postAudit(t, pa.id, r.a.Session, b.Bytes()); status != http.StatusNoContent {
		t.Fatalf("the whole upload after the cut: status %d (%s), want 204", status, msg)
	}
	if v := waitVerdict(t, r); v.id != pa.id || !strings.Contains(v.reason, "start state") {
		t.Fatalf("verdict %+v, want the whole evidence judged (its start state is not the one committed to)", v)
	}
	// A bundle that ends early inside a body that arrived whole was not cut: it is malformed.
	id := r.srv.auditReg.add(&pendingAudit{job: pa.job, worker: pa.worker, step: pa.step, maxBytes: pa.maxBytes, asked: time.Now(), rec: pa.rec, next: pa.next})
	if status, msg := r.postAudit(t, id, r.a.Session, b.Bytes()[:b.Len()/2]); status != http.StatusBadRequest {
		t.Fatalf("half a bundle, sent whole: status %d (%s), want 400", status, msg)
	}
	if v := waitVerdict(t, r); v.id != id || !strings.Contains(v.reason, "malformed evidence") {
		t.Fatalf("verdict %+v, want half a bundle sent whole judged malformed", v)
	}
}

// TestEvidenceWait: the wait for evidence is evidenceSafety times what it takes at the slowest of
// the worker's last timed uploads — the assumed 10 Mb/s before any — between the floor and the
// ceiling; uploads too short to time are not.
func TestEvidenceWait(t *testing.T) {
	s := &Server{}
	const mb = 1 << 20
	if got, want := s.evidenceWait("w", 100*mb), time.Duration(evidenceSafety*100*mb/assumedUplink*float64(time.Second)); got != want {
		t.Errorf("untimed worker, 100 MiB: %v, want %v (at 10 Mb/s)", got, want)
	}
	s.uplinks.record("w", 1<<10, time.Second) // 1 KiB: latency, not bandwidth
	s.uplinks.record("w", 10*mb, time.Second)
	s.uplinks.record("w", 8*mb, 4*time.Second) // 2 MiB/s: the slowest
	s.uplinks.record("w", 40*mb, time.Second)
	if r := s.uplinks.rate("w"); r != 2*mb {
		t.Errorf("rate %v, want the slowest of the timed uploads, 2 MiB/s", r)
	}
	if got, want := s.evidenceWait("w", 100*mb), 200*time.Second; got != want {
		t.Errorf("100 MiB at 2 MiB/s: %v, want %v", got, want)
	}
	if got := s.evidenceWait("w", mb); got != evidenceFloor {
		t.Errorf("1 MiB: %v, want the floor %v", got, evidenceFloor)
	}
	if got := s.evidenceWait("w", 1<<40); got != evidenceCeiling {
		t.Errorf("1 TiB: %v, want the ceiling %v", got, evidenceCeiling)
	}
	// The slow upload ages out of the last uplinkSamples.
	for range uplinkSamples {
		s.uplinks.record("w", 50*mb, time.Second)
	}
	if r := s.uplinks.rate("w"); r != 50*mb {
		t.Errorf("rate %v after %d uploads at 50 MiB/s, want 50 MiB/s", r, uplinkSamples)
	}
	for i := range maxUplinks + 10 {
		s.uplinks.record(fmt.Sprint("x", i), mb, time.Second)
	}
	if n := len(s.uplinks.by); n > maxUplinks {
		t.Errorf("%d workers remembered, at most %d", n, maxUplinks)
	}
}
