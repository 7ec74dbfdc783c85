package coordinator

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/internal/browsertest"
	"github.com/shoal-ml/shoal/storage"
)

// TestDashboardInBrowser drives the admin dashboard in headless Chromium against a coordinator
// training a job with two in-process workers, everything on 127.0.0.1: strangers are refused and
// change nothing; an admin signs in on the form, sees the job live (step, loss curve, pipeline
// map, peers, events), and pauses and resumes the job with the page's buttons. A full-page
// screenshot is saved in $SHOAL_ARTIFACTS (or the test's temporary directory).
func TestDashboardInBrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the browser test starts Chromium and trains a job")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	began := time.Now()
	phase := func(what string) { t.Logf("%6.2fs  %s", time.Since(began).Seconds(), what) }
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// Far more steps than the test lasts: the job is training whenever the browser looks, and
	// the test stops it.
	spec := tinyJob(t, 5000)
	spec.CheckpointEvery = 10
	c := startCluster(t, spec, 2, false)
	const token = "dashboard-test-token"
	c.srv.auth.token = []byte(token)
	base := c.http.URL

	// The job loop, stopped (and waited for) before startCluster's cleanup stops the workers and
	// closes the store. Defers run before cleanups; this one runs after the browser's.
	runCtx, stopRun := context.WithCancel(ctx)
	runDone := make(chan struct{})
	var runErr error
	go func() {
		defer close(runDone)
		runErr = c.srv.Run(runCtx)
	}()
	defer func() {
		stopRun()
		select {
		case <-runDone:
		case <-time.After(20 * time.Second):
			t.Error("the job loop has not stopped 20 s after its context ended; waiting for it")
			<-runDone
		}
		if runErr != nil && !errors.Is(runErr, context.Canceled) {
			t.Errorf("job loop: %v", runErr)
		}
	}()

	// waitFor polls cond (on the test's side) until it holds, the job loop stops or the time is up.
	waitFor := func(what string, d time.Duration, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(d)
		for !cond() {
			select {
			case <-runDone:
				t.Fatalf("waiting for %s: the job loop stopped: %v", what, runErr)
			case <-ctx.Done():
				t.Fatalf("waiting for %s: %v", what, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %v (status %+v)", what, d, jobOf(c.srv))
			}
		}
	}
	waitFor("the job to train", 30*time.Second, func() bool {
		j := jobOf(c.srv)
		return j.State == "running" && j.Step > 0
	})
	jobID := jobOf(c.srv).ID
	phase("training")

	// Strangers: the dashboard sends them to the sign-in form; actions are refused and do nothing.
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.Get(base + "/admin/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/admin/login" {
		t.Errorf("GET /admin/ without a session: %d, Location %q; want 303 to /admin/login", resp.StatusCode, resp.Header.Get("Location"))
	}
	for _, auth := range []string{"", "Bearer wrong-token"} {
		req, _ := http.NewRequestWithContext(ctx, "POST", base+"/api/job/pause", nil)
		req.Header.Set(actionHeader, "1") // the header alone authorises nothing
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST /api/job/pause with Authorization %q: %d, want 401", auth, resp.StatusCode)
		}
	}
	// A pause the job loop had accepted would have been applied before the handler answered.
	if j := jobOf(c.srv); j.State != "running" {
		t.Errorf("after refused pauses the job is %q, want running", j.State)
	}
	if evs, err := c.srv.db.ListEvents(ctx, storage.EventFilter{Kind: "admin.pause"}); err != nil || len(evs) != 0 {
		t.Errorf("refused pauses recorded %d admin.pause events (%v)", len(evs), err)
	}

	// The browser: a fresh profile, loopback only, closed before the cluster stops (an open
	// status stream would hold up the HTTP server's Close).
	b := browsertest.Start(t, ctx, browsertest.Options{})
	bctx := b.Ctx
	phase("browser started")

	artifacts := os.Getenv("SHOAL_ARTIFACTS")
	if artifacts == "" {
		artifacts = t.TempDir()
	} else if err := os.MkdirAll(artifacts, 0o755); err != nil {
		t.Fatal(err)
	}
	screenshot := func(name string) string {
		t.Helper()
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Errorf("screenshot: %v", err)
			return ""
		}
		p := filepath.Join(artifacts, name)
		if err := os.WriteFile(p, png, 0o644); err != nil {
			t.Errorf("screenshot: %v", err)
			return ""
		}
		return p
	}
	// pageState is what the page shows, for failure messages.
	pageState := func() string {
		s, err := chromedp.Run(bctx, chromedp.Evaluate[string](`JSON.stringify({
			url: location.href,
			step: document.getElementById('step')?.textContent,
			state: document.getElementById('job-state')?.textContent,
			conn: document.getElementById('conn')?.textContent,
			points: document.getElementById('loss-chart')?.getAttribute('data-points'),
			stages: document.querySelectorAll('#map .stage').length,
			peers: document.querySelectorAll('#peers tbody tr[data-peer]').length,
			events: document.querySelectorAll('#events .kind').length,
			pause: document.getElementById('btn-pause')?.disabled,
			resume: document.getElementById('btn-resume')?.disabled,
			toast: document.getElementById('toast')?.textContent,
		})`))
		if err != nil {
			return "(page state unreadable: " + err.Error() + ")"
		}
		return s
	}
	// waitPage polls a JavaScript predicate in the page.
	waitPage := func(what, predicate string, d time.Duration) {
		t.Helper()
		if _, err := chromedp.Run(bctx, chromedp.Poll[bool](predicate,
			chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(d))); err != nil {
			p := screenshot("dashboard-failed.png")
			t.Fatalf("page: %s: %v\npage state %s\njob %+v\nscreenshot %s", what, err, pageState(), jobOf(c.srv), p)
		}
	}

	// Sign in: /admin/ sends the browser to the form; the token takes it to the dashboard.
	if err := chromedp.Do(bctx, chromedp.Navigate(base+"/admin/")); err != nil {
		t.Fatal(err)
	}
	if loc, err := chromedp.Run(bctx, chromedp.Location()); err != nil || loc != base+"/admin/login" {
		t.Fatalf("/admin/ without a session shows %q (%v), want the sign-in form", loc, err)
	}
	if err := chromedp.Do(bctx, chromedp.SendKeys(chromedp.ID("token"), token)); err != nil {
		t.Fatal(err)
	}
	resp2, err := chromedp.RunResponse(bctx, chromedp.Click(chromedp.CSS(`form button[type="submit"]`)))
	if err != nil {
		t.Fatalf("sign in: %v", err)
	}
	if loc, err := chromedp.Run(bctx, chromedp.Location()); err != nil || loc != base+"/admin/" || resp2.Status != http.StatusOK {
		t.Fatalf("after signing in: %q, status %d (%v); want the dashboard", loc, resp2.Status, err)
	}
	if cookies, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.cookie`)); err != nil || strings.Contains(cookies, sessionCookie) {
		t.Errorf("the session cookie is readable by scripts (HttpOnly missing): %q (%v)", cookies, err)
	}
	phase("signed in")

	// The live picture: the step, a loss curve with points, the pipeline map, both peers, events,
	// and a checkpoint (taken after the page loaded: the list follows checkpoint events).
	waitPage("step, chart, map, peers, events and a checkpoint", `(() => {
		const m = /^(\d+)\/(\d+)$/.exec(document.getElementById('step').textContent.trim());
		return !!m && +m[1] > 0 &&
			+document.getElementById('loss-chart').getAttribute('data-points') > 0 &&
			document.querySelectorAll('#map .stage').length > 0 &&
			document.querySelectorAll('#map .replica').length === 0 && // one pipeline: no replica rows
			document.querySelectorAll('#peers tbody tr[data-peer]').length === 2 &&
			document.querySelectorAll('#events .kind').length > 0 &&
			document.querySelector('#checkpoints a[href$="/model"]') !== null;
	})()`, 20*time.Second)
	// The checkpoint's link downloads the whole model with the session cookie.
	dl, err := chromedp.Run(bctx, chromedp.Evaluate[string](`fetch(document.querySelector('#checkpoints a[href$="/model"]').href)
		.then(async (r) => r.status + ' ' + (await r.arrayBuffer()).byteLength + ' ' + r.headers.get('Content-Disposition'))`,
		chromedp.EvalAwaitPromise))
	if err != nil || !strings.HasPrefix(dl, "200 ") || !strings.Contains(dl, "attachment") || strings.HasPrefix(dl, "200 0 ") {
		t.Errorf("the checkpoint's download link: %q (%v), want 200, a body, Content-Disposition: attachment", dl, err)
	}
	text, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil {
		t.Fatal(err)
	}
	// The header shows the id's last 8 characters (a v7 UUID starts with its timestamp), with the
	// whole id as its title.
	if !strings.Contains(text, jobID[len(jobID)-8:]) {
		t.Errorf("the page's text lacks the job id %s:\n%s", jobID, text)
	}
	if title, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById('job-id').title`)); err != nil || title != jobID {
		t.Errorf("#job-id's title is %q (%v), want the job id %s", title, err, jobID)
	}
	// The jobs list shows the running job.
	if !strings.Contains(text, "Jobs") || !strings.Contains(text, "running") {
		t.Errorf("the page shows no jobs list with the running job:\n%s", text)
	}
	shot := screenshot("dashboard.png")
	t.Logf("screenshot: %s", shot)
	phase("dashboard live")

	// Pause with the page's button: the job stops at a step boundary and the page says so.
	waitPage("Pause enabled", `!document.getElementById('btn-pause').disabled`, 10*time.Second)
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.ID("btn-pause"))); err != nil {
		t.Fatal(err)
	}
	waitFor("the job to pause", 10*time.Second, func() bool { return jobOf(c.srv).State == "paused" })
	paused := jobOf(c.srv).Step
	waitPage("the page to show paused and offer Resume", `document.getElementById('job-state').textContent === 'paused' &&
		!document.getElementById('btn-resume').disabled && document.getElementById('btn-pause').disabled`, 10*time.Second)
	if now := jobOf(c.srv).Step; now != paused {
		t.Errorf("the job trained from step %d to %d while paused", paused, now)
	}
	phase("paused")

	// Resume: it trains on.
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.ID("btn-resume"))); err != nil {
		t.Fatal(err)
	}
	waitFor("the job to train again", 15*time.Second, func() bool {
		j := jobOf(c.srv)
		return j.State == "running" && j.Step > paused
	})
	waitPage("the page to show running and the admin events", `document.getElementById('job-state').textContent === 'running' &&
		[...document.querySelectorAll('#events .kind')].some((e) => e.textContent === 'admin.resume') &&
		[...document.querySelectorAll('#events .kind')].some((e) => e.textContent === 'admin.pause')`, 10*time.Second)
	for _, kind := range []string{"admin.pause", "admin.resume"} {
		if evs, err := c.srv.db.ListEvents(ctx, storage.EventFilter{Kind: kind}); err != nil || len(evs) != 1 {
			t.Errorf("%d %s events (%v), want 1", len(evs), kind, err)
		}
	}
	phase("resumed")

	for _, e := range b.Errors() {
		t.Errorf("page: %s", e)
	}

	// Close the browser gracefully (browsertest's cleanup then waits for the process).
	if err := chromedp.Cancel(bctx); err != nil {
		t.Errorf("close Chromium: %v", err)
	}
	phase("browser closed")
}

// jobOf is the published job status (empty before the job loop publishes one).
func jobOf(s *Server) JobStatus {
	if st := s.status.Load(); st != nil && st.Job != nil {
		return *st.Job
	}
	return JobStatus{}
}

// TestPagesShowPeerStringsAsText drives both pages in headless Chromium against a coordinator
// whose peer is named with markup and whose events, credits and bans carry markup: the dashboard
// shows every such string as text (no element is made of it, no handler runs), the leaderboard and
// the bans included. The contributor page, for a private job, shows the job to a tab opened with
// the join link (it sends the token with its status requests) and no job to a tab without it; with
// the link it shows the tab's own credit, then its ban and the reason, as text.
func TestPagesShowPeerStringsAsText(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the browser test starts Chromium")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const evil = `<img src=x onerror=window.__xss=1>`
	const evilWorker, evilReason = `<img src=z onerror=window.__xss=3>`, `<img src=w onerror=window.__xss=4> from 10.1.2.3:99`
	pub := startServing(t, false, evil, func(ctx context.Context, db *storage.DB, job uuid.UUID, plan int64) {
		if err := db.RecordWork(ctx, job, 0, plan, []storage.Work{{Worker: evilWorker, MicroBatches: 3, FLOPs: 4.5e9}, {Worker: "w-honest", MicroBatches: 2, FLOPs: 2e9}}); err != nil {
			t.Fatal(err)
		}
		if _, err := db.VerifyWork(ctx, job, "w-honest", 0); err != nil {
			t.Fatal(err)
		}
		if err := db.Ban(ctx, job, evilWorker, evilReason, 0); err != nil {
			t.Fatal(err)
		}
	})
	priv := startServing(t, true, "with-the-link")

	b := browsertest.Start(t, ctx, browsertest.Options{})
	bctx := b.Ctx
	waitPage := func(what, predicate string, d time.Duration) { t.Helper(); pageWait(t, bctx, what, predicate, d) }

	// The dashboard, signed in.
	signIn(t, bctx, pub.url)
	waitPage("the peer's name and the error event as text", `(() => {
		const cells = [...document.querySelectorAll('#peers tbody tr[data-peer] td')].map((td) => td.textContent);
		const events = document.getElementById('events').textContent;
		return cells.includes(`+strconv.Quote(evil)+`) && events.includes('<img src=y onerror=window.__xss=2>') &&
			events.includes('[address]');
	})()`, 20*time.Second)
	waitPage("the leaderboard and the bans as text", `(() => {
		const rows = [...document.querySelectorAll('#credits tbody tr[data-worker]')];
		const bans = [...document.querySelectorAll('#bans tbody tr[data-worker]')];
		return rows.length === 2 && rows[0].getAttribute('data-worker') === 'w-honest' &&
			rows[0].children[2].textContent === '2' && rows[0].children[3].textContent === '2' &&
			rows[1].getAttribute('data-worker') === `+strconv.Quote(evilWorker)+` && rows[1].children[5].textContent === '3' &&
			bans.length === 1 && bans[0].children[1].textContent === '<img src=w onerror=window.__xss=4> from [address]';
	})()`, 10*time.Second)
	// Let any image the page might have made try to load and fail.
	time.Sleep(300 * time.Millisecond)
	got, err := chromedp.Run(bctx, chromedp.Evaluate[string](`JSON.stringify({
		imgs: document.querySelectorAll('img').length,
		xss: window.__xss === undefined ? null : window.__xss,
		addr: document.body.innerText.includes('127.0.0.1'),
	})`))
	if err != nil || got != `{"imgs":0,"xss":null,"addr":false}` {
		t.Errorf("the dashboard made markup of peer strings, or shows an address: %s (%v)", got, err)
	}

	// The contributor page of a private job, with the join link and without.
	for _, tc := range []struct {
		name, query string
		sees        bool
	}{
		{"with the link", "/?join=" + url.QueryEscape(priv.token), true},
		{"without", "/", false},
	} {
		if err := chromedp.Do(bctx, chromedp.Navigate(priv.url+tc.query)); err != nil {
			t.Fatal(err)
		}
		if tc.sees {
			waitPage("the private job "+tc.name, `document.getElementById('job').textContent.includes(`+
				strconv.Quote(priv.jobID[len(priv.jobID)-8:])+`) && /1 connected/.test(document.getElementById('peers').textContent)`, 10*time.Second)
			// The tab's own credit: the page knows its worker id from the worker's status, which
			// the test stands in for here (the browser worker's own test runs the real one).
			id := uuid.MustParse(priv.jobID)
			plan, err := priv.srv.db.LatestPlan(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			for step, w := range []storage.Work{{Worker: priv.worker, MicroBatches: 4, FLOPs: 3e9}, {Worker: priv.worker, MicroBatches: 2, FLOPs: 1.25e9}} {
				if err := priv.srv.db.RecordWork(ctx, id, int64(step), plan.Version, []storage.Work{w}); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := priv.srv.db.VerifyWork(ctx, id, priv.worker, 0); err != nil {
				t.Fatal(err)
			}
			if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`window.shoalPage.worker = {state: 'joined', micro_batches: 0, steps: 0, worker_id: `+
				strconv.Quote(priv.worker)+`}; true`)); err != nil {
				t.Fatal(err)
			}
			waitPage("the tab's own credit", `document.getElementById('my-verified').textContent === '4 micro-batches · 3 GFLOP' &&
				document.getElementById('my-pending').textContent === '2 micro-batches · 1.25 GFLOP' &&
				document.getElementById('my-banned').hidden`, 10*time.Second)
			if err := priv.srv.db.Ban(ctx, id, priv.worker, evilReason, 1); err != nil {
				t.Fatal(err)
			}
			waitPage("the tab's ban", `(() => {
				const b = document.getElementById('my-banned');
				return !b.hidden && b.textContent === 'This tab was banned from this job at step 1: <img src=w onerror=window.__xss=4> from [address]. Its work in this job earns no credit.' &&
					document.getElementById('my-verified').textContent === '0 micro-batches · 0 GFLOP' &&
					document.getElementById('my-rejected').textContent === '6 micro-batches' && !document.getElementById('my-rejected-row').hidden;
			})()`, 10*time.Second)
			if got, err := chromedp.Run(bctx, chromedp.Evaluate[string](`JSON.stringify({imgs: document.querySelectorAll('img').length, xss: window.__xss === undefined ? null : window.__xss})`)); err != nil ||
				got != `{"imgs":0,"xss":null}` {
				t.Errorf("the contributor page made markup of a ban's reason: %s (%v)", got, err)
			}
		} else {
			waitPage("no job "+tc.name, `document.getElementById('job').textContent === 'no job running' &&
				/^0 connected/.test(document.getElementById('peers').textContent)`, 10*time.Second)
		}
	}
	for _, e := range b.Errors() {
		// Expected: no checkpoint to sample yet, and no browser worker on offer.
		if strings.Contains(e, "status of 404") && (strings.Contains(e, "/api/sample") || strings.Contains(e, "/"+WasmFile)) {
			continue
		}
		t.Errorf("page: %s", e)
	}
	if err := chromedp.Cancel(bctx); err != nil {
		t.Errorf("close Chromium: %v", err)
	}
}

// TestPagesShowReplicas drives both pages in headless Chromium against a coordinator whose status
// holds a plan of two pipeline replicas (published by the test: no job loop runs, so that the
// check takes a second, not a training run). The dashboard draws one row per replica — its index,
// its micro-batches [a,b) of the step's M, its stages and their peers (named with markup, shown as
// text) — and the sync mode, and names the timed stages by replica; the contributor page says the
// plan has two replicas and shows the tab's shard in the worker's words (client.ShardStatus, whose
// own test checks them). TestDashboardInBrowser checks that a plan of one pipeline has no rows.
func TestPagesShowReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the browser test starts Chromium")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Loopback: true, AdminToken: servingAdmin, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)

	const evil = `<img src=x onerror=window.__xss=1>`
	job := uuid.Must(uuid.NewV7()).String()
	srv.status.Store(&Status{
		Job:   &JobStatus{ID: job, State: "running", Step: 3, Steps: 10, Model: "GPT-MoE, 4 blocks"},
		Steps: []StepStatus{{Step: 2, Loss: 5.25, Stages: []StageTiming{{Peer: "w-a", ComputeMS: 30}, {Peer: "w-b", ComputeMS: 20}, {Peer: "w-c", ComputeMS: 40}}}},
		Plan: &PlanStatus{Version: 3, Replicas: 2, Sync: "step", Standby: []string{}, ExpertHosts: []ExpertStatus{}, Stages: []StageStatus{
			{Blocks: [2]int{0, 2}, Peer: "w-a", PeerName: evil, Replica: 0, MicroBatches: [2]int{0, 3}},
			{Blocks: [2]int{2, 4}, Peer: "w-b", PeerName: "bee", Replica: 0, MicroBatches: [2]int{0, 3}},
			{Blocks: [2]int{0, 4}, Peer: "w-c", PeerName: "sea", Replica: 1, MicroBatches: [2]int{3, 4}},
		}},
		Peers: []PeerStatus{},
	})

	b := browsertest.Start(t, ctx, browsertest.Options{})
	bctx := b.Ctx
	waitPage := func(what, predicate string, d time.Duration) { t.Helper(); pageWait(t, bctx, what, predicate, d) }

	signIn(t, bctx, hs.URL)
	waitPage("a row per replica", `document.querySelectorAll('#map .replica').length === 2`, 10*time.Second)
	got, err := chromedp.Run(bctx, chromedp.Evaluate[string](`JSON.stringify({
		version: document.getElementById('plan-version').textContent,
		rows: [...document.querySelectorAll('#map .replica')].map((r) => ({
			replica: r.getAttribute('data-replica'),
			head: r.querySelector('.replica-head').textContent,
			stages: [...r.querySelectorAll('.stage')].map((s) => s.querySelector('h3').textContent + ' | ' + s.querySelector('.peer-line .name').textContent),
		})),
		sync: document.querySelector('#map .side .sync')?.textContent,
		bars: [...document.querySelectorAll('#stage-times .bar-label')].map((l) => l.firstChild.textContent),
		imgs: document.querySelectorAll('img').length,
		xss: window.__xss === undefined ? null : window.__xss,
	})`))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"version":"plan v3 · 2 pipeline replicas","rows":[` +
		`{"replica":"0","head":"Replica 0micro-batches [0,3) of 42 stages","stages":["Stage 0blocks 0–1 | ` + strings.ReplaceAll(evil, `"`, `\"`) + `","Stage 1blocks 2–3 | bee"]},` +
		`{"replica":"1","head":"Replica 1micro-batches [3,4) of 41 stage","stages":["Stage 0blocks 0–3 | sea"]}],` +
		`"sync":"Sync: step","bars":["r0 stage 0","r0 stage 1","r1 stage 0"],"imgs":0,"xss":null}`
	if got != want {
		t.Errorf("the dashboard's map of two replicas:\n got %s\nwant %s", got, want)
	}
	// Outer mode's own batches: each row says its replica trains a batch of its own, not a share.
	stepPlan := srv.status.Load()
	own := *stepPlan
	op := *own.Plan
	op.Sync, op.OwnBatches, op.Stages = "outer", true, slices.Clone(op.Stages)
	for i := range op.Stages {
		op.Stages[i].MicroBatches = [2]int{0, 4}
	}
	own.Plan = &op
	srv.status.Store(&own)
	waitPage("rows of own batches", `[...document.querySelectorAll('#map .replica .replica-head .mbs')].map((e) => e.textContent).join('|') ===
		'a batch of its own, 4 micro-batches|a batch of its own, 4 micro-batches'`, 10*time.Second)
	srv.status.Store(stepPlan)
	if dir := os.Getenv("SHOAL_ARTIFACTS"); dir != "" {
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, "dashboard-replicas.png"), png, 0o644)
		}
		if err != nil {
			t.Errorf("screenshot: %v", err)
		}
	}

	// The contributor page: the plan's replicas, and the tab's shard as its worker says it. The
	// test stands in for the worker's status (the browser worker's own test runs the real one).
	if err := chromedp.Do(bctx, chromedp.Navigate(hs.URL+"/")); err != nil {
		t.Fatal(err)
	}
	waitPage("the plan's replicas", `!document.getElementById('pipeline-row').hidden &&
		document.getElementById('pipeline').textContent === '2 pipeline replicas, step sync'`, 10*time.Second)
	const shard = "replica 2 of 2, stage 1 of 1: blocks [0,4), micro-batches [3,4) of every step"
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`window.shoalPage.started = true;
		window.shoalPage.worker = {state: 'joined', worker_id: 'w-c', plan_version: 3, micro_batches: 0, steps: 0,
			shard: {text: `+strconv.Quote(shard)+`, replica: {index: 1, count: 2, first: 3, micro_batches: 1, peers: 2}}};
		document.dispatchEvent(new Event('visibilitychange')); true`)); err != nil {
		t.Fatal(err)
	}
	waitPage("the tab's replica and stage", `document.getElementById('shard').textContent === `+strconv.Quote(shard+" (plan v3)"), 10*time.Second)

	for _, e := range b.Errors() {
		// Expected: no checkpoint to sample, and no browser worker on offer.
		if strings.Contains(e, "status of 404") && (strings.Contains(e, "/api/sample") || strings.Contains(e, "/"+WasmFile)) {
			continue
		}
		t.Errorf("page: %s", e)
	}
	if err := chromedp.Cancel(bctx); err != nil {
		t.Errorf("close Chromium: %v", err)
	}
}

// pageWait polls predicate (a JavaScript expression) in the page for up to d, and fails the test
// with the page's text if it never holds.
func pageWait(t *testing.T, bctx context.Context, what, predicate string, d time.Duration) {
	t.Helper()
	if _, err := chromedp.Run(bctx, chromedp.Poll[bool](predicate,
		chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(d))); err != nil {
		text, _ := chromedp.Run(bctx, chromedp.Evaluate[string](`document.body.innerText`))
		t.Fatalf("page: %s: %v\n%s", what, err, text)
	}
}

// signIn signs the browser into the dashboard at url with the admin token.
func signIn(t *testing.T, bctx context.Context, url string) {
	t.Helper()
	if err := chromedp.Do(bctx, chromedp.Navigate(url+"/admin/login")); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(bctx, chromedp.SendKeys(chromedp.ID("token"), servingAdmin)); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.RunResponse(bctx, chromedp.Click(chromedp.CSS(`form button[type="submit"]`))); err != nil {
		t.Fatalf("sign in: %v", err)
	}
}
