package coordinator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// serving is a coordinator (admin token servingAdmin) on a NewHTTPServer at 127.0.0.1 with one
// job submitted over the API and published by the job loop, a recorded step, one worker joined
// (with the join token when the job is private) and an event that carries HTML, a peer's address
// and more text than a status shows. The job waits for a second worker that never comes, so
// nothing changes under the test. setup, if given, runs before the worker joins, and what it
// writes to the store is in the status the join publishes.
type serving struct {
	srv            *Server
	url            string
	jobID, token   string // token: "" for a public job
	worker, wsName string
}

const servingAdmin = "serving-admin-token"

// evilDetail is a peer's error text: markup, an address and a long tail.
var evilDetail = "<img src=y onerror=window.__xss=2> read tcp 127.0.0.1:8470->127.0.0.1:51234: connection reset " + strings.Repeat("x", 4096)

func startServing(t *testing.T, private bool, workerName string, setup ...func(ctx context.Context, db *storage.DB, job uuid.UUID, plan int64)) *serving {
	t.Helper()
	spec := tinyJob(t, 50)
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Loopback: true, KeepServing: true, MinWorkers: 2,
		Settle: 50 * time.Millisecond, AdminToken: servingAdmin, HeartbeatInterval: 30 * time.Second, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	hs := httptest.NewUnstartedServer(srv.Handler())
	hs.Config = NewHTTPServer(srv.Handler(), HTTPLimits{Logger: slog.New(slog.DiscardHandler)})
	hs.Start()
	t.Cleanup(hs.Close)
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-runDone; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
	})

	sub := submitJob(t, hs.URL, spec, private)
	c := &serving{srv: srv, url: hs.URL, jobID: sub.ID, token: sub.Token}
	deadline := time.Now().Add(10 * time.Second)
	for j := jobOf(srv); j.ID != sub.ID; j = jobOf(srv) {
		if time.Now().After(deadline) {
			t.Fatalf("the job loop did not publish job %s (status %+v)", sub.ID, j)
		}
		time.Sleep(10 * time.Millisecond)
	}
	id := uuid.MustParse(sub.ID)
	plan, err := srv.db.SavePlan(ctx, id, json.RawMessage(`{"stages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.db.RecordStep(ctx, storage.Step{JobID: id, Step: 0, PlanVersion: plan.Version, Loss: 5.5, Tokens: 256}); err != nil {
		t.Fatal(err)
	}
	for _, f := range setup {
		f(ctx, srv.db, id, plan.Version)
	}

	hello := testHello(workerName)
	hello.JoinToken = sub.Token
	_, c.worker = rawJoin(t, "ws"+strings.TrimPrefix(hs.URL, "http")+"/ws", hello)
	c.wsName = workerName
	for !strings.Contains(c.body(t, "/api/status", servingAdmin, ""), c.worker) {
		if time.Now().After(deadline) {
			t.Fatal("the worker does not show in the status")
		}
		time.Sleep(10 * time.Millisecond)
	}
	srv.event(id, "worker.error", c.worker, map[string]any{"code": "step", "message": evilDetail})
	return c
}

// get fetches path as a viewer: with the admin token (admin), the join token in the header
// (join), or neither.
func (c *serving) get(t *testing.T, path, admin, join string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url+path, nil)
	if admin != "" {
		req.Header.Set("Authorization", "Bearer "+admin)
	}
	if join != "" {
		req.Header.Set(JoinHeader, join)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

func (c *serving) body(t *testing.T, path, admin, join string) string {
	t.Helper()
	_, b := c.get(t, path, admin, join)
	return b
}

// TestPrivateJobHidden: a private job's status, steps, sample and listing are shown to the admin
// and to requests with its join token (header or ?join=), and to nobody else, who sees a
// coordinator without a job or peers. No response to anyone but the admin's submission holds the
// token, and none names a peer's address.
func TestPrivateJobHidden(t *testing.T) {
	c := startServing(t, true, "private-worker")
	type viewer struct {
		name         string
		path         string // query added to every path
		admin, join  string
		sees         bool
		isAdmin      bool
		wantNotFound string // /api/sample's error
	}
	viewers := []viewer{
		{name: "a stranger", sees: false, wantNotFound: "no job"},
		{name: "a wrong token in the header", join: c.token + "x", wantNotFound: "no job"},
		{name: "a wrong token in the query", path: "join=" + url.QueryEscape(c.token[:len(c.token)-1]), wantNotFound: "no job"},
		{name: "a wrong admin token", admin: "wrong", wantNotFound: "no job"},
		{name: "the join token in the header", join: c.token, sees: true, wantNotFound: "no complete checkpoint yet"},
		{name: "the join token in the query", path: "join=" + url.QueryEscape(c.token), sees: true, wantNotFound: "no complete checkpoint yet"},
		{name: "the admin", admin: servingAdmin, sees: true, isAdmin: true, wantNotFound: "no complete checkpoint yet"},
	}
	with := func(path, query string) string {
		if query == "" {
			return path
		}
		if strings.Contains(path, "?") {
			return path + "&" + query
		}
		return path + "?" + query
	}
	for _, v := range viewers {
		t.Run(v.name, func(t *testing.T) {
			// Each viewer stands for its own client; all share 127.0.0.1 here, where the sign-in
			// back-off (TestAdminGuessingBacksOff) would hold the wrong-token cases' guesses
			// against the admin's.
			c.srv.auth.guesses.forget(remoteKey("127.0.0.1:1"))
			resp, body := c.get(t, with("/api/status", v.path), v.admin, v.join)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Cache-Control") != "no-store" {
				t.Errorf("GET /api/status: %s, Cache-Control %q", resp.Status, resp.Header.Get("Cache-Control"))
			}
			var st Status
			if err := json.Unmarshal([]byte(body), &st); err != nil {
				t.Fatalf("status: %v\n%s", err, body)
			}
			if v.sees {
				if st.Job == nil || st.Job.ID != c.jobID || len(st.Peers) != 1 || st.Peers[0].ID != c.worker || len(st.Events) == 0 {
					t.Errorf("status: want the job, its peer and its events:\n%s", body)
				}
			} else {
				if st.Job != nil || len(st.Peers) != 0 || len(st.Events) != 0 || st.Plan != nil || len(st.Steps) != 0 || len(st.Router) != 0 {
					t.Errorf("status shows the private job or its peers:\n%s", body)
				}
				for _, secret := range []string{c.jobID, c.worker, c.wsName} {
					if strings.Contains(body, secret) {
						t.Errorf("status names %q", secret)
					}
				}
			}

			var steps []StepStatus
			json.Unmarshal([]byte(c.body(t, with("/api/steps?from=0", v.path), v.admin, v.join)), &steps)
			if want := map[bool]int{true: 1, false: 0}[v.sees]; len(steps) != want {
				t.Errorf("/api/steps: %d steps, want %d", len(steps), want)
			}

			resp, body = c.get(t, with("/api/sample", v.path), v.admin, v.join)
			if resp.StatusCode != http.StatusNotFound || !strings.Contains(body, v.wantNotFound) {
				t.Errorf("/api/sample: %s %s, want 404 %q", resp.Status, body, v.wantNotFound)
			}

			// A private job's figures are not scraped by anyone but the admin; nor are its blobs.
			resp, body = c.get(t, "/metrics", v.admin, v.join)
			if open := resp.StatusCode == http.StatusOK; open != v.isAdmin || (!v.isAdmin && strings.Contains(body, "shoal_step")) {
				t.Errorf("/metrics of a private job: %s", resp.Status)
			}

			var jobs []JobListing
			json.Unmarshal([]byte(c.body(t, with("/api/jobs", v.path), v.admin, v.join)), &jobs)
			listed := false
			for _, j := range jobs {
				listed = listed || j.ID == c.jobID
			}
			if listed != v.sees {
				t.Errorf("/api/jobs lists the private job: %v, want %v (%+v)", listed, v.sees, jobs)
			}

			// The token is in no response of the open endpoints, nor a peer's address.
			for _, p := range []string{"/api/status", "/api/steps?from=0", "/api/jobs", "/api/sample", "/api/stream", "/metrics", "/", "/admin/login"} {
				if p == "/api/stream" && v.isAdmin {
					continue // a stream does not end; the admin's status is checked above
				}
				_, body := c.get(t, with(p, v.path), v.admin, v.join)
				if strings.Contains(body, c.token) {
					t.Errorf("GET %s shows the join token", p)
				}
				if strings.Contains(body, "127.0.0.1") {
					t.Errorf("GET %s shows a peer's address:\n%s", p, body)
				}
			}
		})
	}
}

// TestStatusShowsPeerStringsAsText: a worker's name and a peer's error text with markup reach the
// status as JSON text (encoding/json writes < and > as \u003c, \u003e, and nosniff keeps any
// browser from reading the body as a page); an event's text is cut to a bounded length and loses
// the peer's address; the sign-in page never echoes its query.
func TestStatusShowsPeerStringsAsText(t *testing.T) {
	const evil = `<img src=x onerror=window.__xss=1>`
	c := startServing(t, false, evil)
	for _, v := range []struct{ name, admin string }{{"public", ""}, {"admin", servingAdmin}} {
		t.Run(v.name, func(t *testing.T) {
			resp, body := c.get(t, "/api/status", v.admin, "")
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" || resp.Header.Get("X-Content-Type-Options") != "nosniff" {
				t.Errorf("Content-Type %q, X-Content-Type-Options %q", ct, resp.Header.Get("X-Content-Type-Options"))
			}
			for _, raw := range []string{"<img", "<script", "127.0.0.1"} {
				if strings.Contains(body, raw) {
					t.Errorf("the status body holds %q as is", raw)
				}
			}
			var st Status
			if err := json.Unmarshal([]byte(body), &st); err != nil {
				t.Fatal(err)
			}
			if len(st.Peers) != 1 || st.Peers[0].Name != evil {
				t.Errorf("peers %+v, want one named %q", st.Peers, evil)
			}
			var shown string
			for _, e := range st.Events {
				var d struct{ Message string }
				if e.Kind == "worker.error" && json.Unmarshal(e.Detail, &d) == nil {
					shown = d.Message
				}
			}
			if !strings.HasPrefix(shown, "<img src=y onerror=window.__xss=2> read tcp [address]->[address]: connection reset xxx") ||
				len(shown) > maxShownText || !strings.HasSuffix(shown, "…") {
				t.Errorf("the error event's message, %d bytes: %.160q", len(shown), shown)
			}
		})
	}
	resp, body := c.get(t, "/admin/login?error=<script>alert(1)</script>", "", "")
	if strings.Contains(body, "<script>alert") || resp.Header.Get("Content-Security-Policy") == "" {
		t.Errorf("the sign-in page echoes its query or has no policy:\n%s", body)
	}
}

func TestShownText(t *testing.T) {
	tests := []struct {
		name, in, want string
		max            int
	}{
		{"plain", "worker 3", "worker 3", 64},
		{"markup is text, left for the page to escape", "<b>x</b>", "<b>x</b>", 64},
		{"control characters", "a\x1b[2Jb\nc\td", "a [2Jb c d", 64},
		{"bidi override", "abc\u202edcba", "abc\ufffddcba", 64},
		{"invalid UTF-8", "a\xffb", "a\ufffdb", 64},
		{"ipv4 with port", "dial tcp 192.0.2.1:8470: refused", "dial tcp [address]: refused", 64},
		{"ipv6 with port", "read tcp [2001:db8::1]:443->[::1]:5555: reset", "read tcp [address]->[address]: reset", 64},
		{"ipv4 alone", "from 10.1.2.3", "from [address]", 64},
		{"cut at a rune", "ééééé", "éé…", 8},
		{"within the bound", "abcdefgh", "abcdefgh", 8},
		{"past the bound", "abcdefghi", "abcde…", 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := shownText(tt.in, tt.max)
			if got != tt.want || len(got) > tt.max || !utf8.ValidString(got) {
				t.Errorf("shownText(%q, %d) = %q, want %q", tt.in, tt.max, got, tt.want)
			}
		})
	}
}

func TestBoundDetail(t *testing.T) {
	large := `{"a":[` + strings.Repeat(`"xxxxxxxxxx",`, 2000) + `"x"]}` // written as json.Marshal writes it
	tests := []struct {
		name, in, want string
	}{
		{"numbers as written", `{"id":12345678901234567890,"step":3}`, `{"id":12345678901234567890,"step":3}`},
		{"strings inside arrays and objects", `{"stages":[{"peer":"a\u001bb"}],"reason":"x 127.0.0.1:5"}`,
			`{"reason":"x [address]","stages":[{"peer":"a b"}]}`},
		{"not JSON", `{`, `{}`},
		{"too large", large, fmt.Sprintf(`{"bytes":%d,"truncated":true}`, len(large))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := string(boundDetail(json.RawMessage(tt.in))); got != tt.want {
				t.Errorf("boundDetail = %s, want %s", got, tt.want)
			}
		})
	}
}

func TestJoinMatches(t *testing.T) {
	tests := []struct {
		name             string
		presented, token string
		want             bool
	}{
		{"same", "abc", "abc", true},
		{"different", "abd", "abc", false},
		{"prefix", "ab", "abc", false},
		{"nothing presented", "", "abc", false},
		{"a public job has no token to match", "", "", false},
	}
	for _, tt := range tests {
		if got := joinMatches(tt.presented, tt.token); got != tt.want {
			t.Errorf("%s: joinMatches(%q, %q) = %v, want %v", tt.name, tt.presented, tt.token, got, tt.want)
		}
	}
}

// TestStatusCredits: the status carries the leaderboard (the top statusCredits workers, named
// while connected) and the bans, both from the store; ?worker= adds a worker below the top; a
// private job's outsiders see neither, as empty lists.
func TestStatusCredits(t *testing.T) {
	for _, private := range []bool{false, true} {
		t.Run(map[bool]string{false: "public", true: "private"}[private], func(t *testing.T) {
			// More workers than the status lists, with verified work; "low" has only pending
			// work, and "cheat" is banned (with a peer's address in the reason). The worker's
			// join publishes them.
			c := startServing(t, private, "credit-worker", func(ctx context.Context, db *storage.DB, id uuid.UUID, plan int64) {
				var work []storage.Work
				for i := range statusCredits + 5 {
					work = append(work, storage.Work{Worker: fmt.Sprintf("w%03d", i), MicroBatches: 4, FLOPs: float64(2e9 + i)})
				}
				work = append(work, storage.Work{Worker: "low", MicroBatches: 2, FLOPs: 1.5e9}, storage.Work{Worker: "cheat", MicroBatches: 3, FLOPs: 9e12})
				if err := db.RecordWork(ctx, id, 0, plan, work); err != nil {
					t.Fatal(err)
				}
				for _, w := range work[:len(work)-2] {
					if _, err := db.VerifyWork(ctx, id, w.Worker, 0); err != nil {
						t.Fatal(err)
					}
				}
				if err := db.Ban(ctx, id, "cheat", "audit of step 0 <b>differs</b> from 10.0.0.7:8470", 0); err != nil {
					t.Fatal(err)
				}
			})
			ctx := t.Context()
			id := uuid.MustParse(c.jobID)
			join := c.token
			status := func(path string) Status {
				t.Helper()
				body := c.body(t, path, "", join)
				var st Status
				if err := json.Unmarshal([]byte(body), &st); err != nil {
					t.Fatalf("GET %s: %v\n%s", path, err, body)
				}
				return st
			}
			has := func(cs []CreditStatus, worker string) bool {
				return slices.ContainsFunc(cs, func(c CreditStatus) bool { return c.Worker == worker })
			}
			// startServing saw the worker connected, which the hub says at once; the job loop's
			// publication of its join may come a moment later.
			st := status("/api/status")
			for deadline := time.Now().Add(10 * time.Second); len(st.Credits) == 0 && time.Now().Before(deadline); st = status("/api/status") {
				time.Sleep(10 * time.Millisecond)
			}
			if len(st.Credits) != statusCredits {
				t.Fatalf("%d credits, want the top %d", len(st.Credits), statusCredits)
			}
			for i, cr := range st.Credits {
				want := CreditStatus{Worker: fmt.Sprintf("w%03d", statusCredits+4-i), VerifiedMicroBatches: 4, VerifiedGFLOP: float64(2e9+statusCredits+4-i) / 1e9}
				if cr != want {
					t.Errorf("credit %d = %+v, want %+v (most verified first, unnamed: not connected)", i, cr, want)
					break
				}
			}
			if has(st.Credits, "low") || has(st.Credits, "cheat") {
				t.Errorf("a worker without verified work is in the top %d", statusCredits)
			}
			if len(st.Bans) != 1 || st.Bans[0].Worker != "cheat" || st.Bans[0].Reason != "audit of step 0 <b>differs</b> from [address]" ||
				st.Bans[0].Step != 0 || st.Bans[0].Time.IsZero() {
				t.Errorf("bans %+v, want cheat's, its reason as text without the address", st.Bans)
			}

			// A contributor's page asks for its own line, wherever it stands: named while connected.
			plan, err := c.srv.db.LatestPlan(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if err := c.srv.db.RecordWork(ctx, id, 1, plan.Version, []storage.Work{{Worker: c.worker, MicroBatches: 2, FLOPs: 2.5e9}}); err != nil {
				t.Fatal(err)
			}
			for _, tc := range []struct {
				worker string
				want   CreditStatus
			}{
				{c.worker, CreditStatus{Worker: c.worker, Name: c.wsName, PendingMicroBatches: 2, PendingGFLOP: 2.5}},
				{"low", CreditStatus{Worker: "low", PendingMicroBatches: 2, PendingGFLOP: 1.5}},
				{"cheat", CreditStatus{Worker: "cheat", RejectedMicroBatches: 3}},
			} {
				mine := status("/api/status?worker=" + url.QueryEscape(tc.worker))
				if n := len(mine.Credits); n != statusCredits+1 || mine.Credits[n-1] != tc.want {
					t.Errorf("with ?worker=%s, %d credits ending %+v; want the top and %+v", tc.worker, n, mine.Credits[n-1], tc.want)
				}
				if len(mine.Bans) != 1 {
					t.Errorf("with ?worker=%s, bans %+v, want cheat's once", tc.worker, mine.Bans)
				}
			}
			if mine := status("/api/status?worker=w104"); len(mine.Credits) != statusCredits {
				t.Errorf("with ?worker= naming a listed worker, %d credits, want it listed once", len(mine.Credits))
			}
			// The published lists are shared by every request: one request's addition stays its own.
			if again := status("/api/status"); len(again.Credits) != statusCredits || has(again.Credits, "low") {
				t.Errorf("a later status without ?worker= has %d credits (low listed: %v)", len(again.Credits), has(again.Credits, "low"))
			}

			if !private {
				return
			}
			for _, q := range []string{"/api/status", "/api/status?worker=cheat", "/api/status?worker=low"} {
				body := c.body(t, q, "", "")
				var out Status
				if err := json.Unmarshal([]byte(body), &out); err != nil {
					t.Fatal(err)
				}
				if out.Credits == nil || out.Bans == nil || len(out.Credits) != 0 || len(out.Bans) != 0 || out.Audit != nil {
					t.Errorf("GET %s without the token: credits %v, bans %v, audit %v; want empty lists and no audit", q, out.Credits, out.Bans, out.Audit)
				}
				for _, secret := range []string{"cheat", "w000", "differs", `"low"`} {
					if strings.Contains(body, secret) {
						t.Errorf("GET %s without the token names %q", q, secret)
					}
				}
			}
		})
	}
}

// TestPlanPeriod: a plan's period (what plans.json records for `shoal train --replay`) after a
// replica is dropped starts at the drop; one dropped at the step its plan began from is the
// plan's period too, and says so (local.Period.Replan), so that a replay restores before it
// drops — the soak in which it did not ended 1,501 tensors away from the cluster's.
func TestPlanPeriod(t *testing.T) {
	st := func(r int) StageStatus {
		return StageStatus{Blocks: [2]int{0, 4}, Replica: r, MicroBatches: [2]int{r, r + 1}}
	}
	calm := PlanStatus{FromStep: 15, Stages: []StageStatus{st(0), st(1), st(2), st(3)}, Replicas: 4, Sync: "outer"}
	if per := calm.Period(); per.From != 15 || len(per.Replicas) != 4 || len(per.Dropped) != 0 || per.Replan {
		t.Fatalf("calm plan: %+v", per)
	}
	p := calm
	p.Stages, p.Replicas = []StageStatus{st(0), st(1), st(3)}, 3
	for _, tt := range []struct {
		step   int
		replan bool
	}{{15, true}, {17, false}} {
		q := p
		q.Dropped = []DroppedReplica{{Replica: 2, Step: tt.step, Stages: [][2]int{{0, 4}}, MicroBatches: [2]int{2, 3}}}
		per := q.Period()
		if per.From != tt.step || len(per.Replicas) != 4 || !slices.Equal(per.Dropped, []int{2}) || per.Replan != tt.replan {
			t.Errorf("replica 2 dropped at step %d of a plan from 15: %+v, want from %d, replan %v", tt.step, per, tt.step, tt.replan)
		}
	}
}

// submission is the admin's answer to POST /api/jobs.
type submission struct {
	ID    string `json:"id"`
	Token string `json:"join_token"`
}

// submitJob submits spec as the admin (servingAdmin) to the coordinator at url, private or not,
// and fails the test unless it is created (with a join token when private).
func submitJob(t *testing.T, url string, spec job.Spec, private bool) submission {
	t.Helper()
	b, _ := json.Marshal(spec)
	q := ""
	if private {
		q = "?private=1"
	}
	req, _ := http.NewRequest("POST", url+"/api/jobs"+q, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+servingAdmin)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sub submission
	json.NewDecoder(resp.Body).Decode(&sub)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || (private && sub.Token == "") {
		t.Fatalf("submit: %s %+v", resp.Status, sub)
	}
	return sub
}
