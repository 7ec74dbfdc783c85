package coordinator

import (
	"bufio"
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
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/storage"
)

func TestAdminTokenGeneratedOnceAndStored(t *testing.T) {
	t.Setenv("SHOAL_ADMIN_TOKEN", "")
	dir := t.TempDir()
	var shown []string
	cfg := Config{DataDir: dir, Logger: slog.New(slog.DiscardHandler), OnAdminToken: func(tok string) { shown = append(shown, tok) }}
	s1, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	s1.Close()
	s2, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if len(shown) != 1 || len(shown[0]) < 32 {
		t.Fatalf("token shown %d times: %q", len(shown), shown)
	}
	st, err := os.Stat(filepath.Join(dir, tokenFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v %v", st, err)
	}
	if !s2.auth.check(shown[0]) || s2.auth.check(shown[0]+"x") {
		t.Fatal("the stored token is not the one in use")
	}
}

// adminReq sends a request with the admin token (tok "" sends none).
func adminReq(t *testing.T, method, u, tok string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(method, u, nil)
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// TestAdminActions: without the token every mutating call is refused and changes nothing; with
// it the admin pauses and resumes the job, triggers a checkpoint and kicks a peer — each recorded
// as an event — and the job still ends with the single process's parameters. The dashboard
// signs in with a cookie, and the status stream is guarded.
func TestAdminActions(t *testing.T) {
	spec := tinyJob(t, 40)
	_, ref := localReports(t, spec)
	c := startCluster(t, spec, 2, false)
	tok := "test-admin-token"
	c.srv.auth.token = []byte(tok)
	base := c.http.URL

	for _, p := range []string{"/api/job/pause", "/api/job/resume", "/api/checkpoint", "/api/peers/x/kick"} {
		if r := adminReq(t, "POST", base+p, ""); r.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST %s without a token: %d", p, r.StatusCode)
		}
		if r := adminReq(t, "POST", base+p, "wrong"); r.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST %s with a wrong token: %d", p, r.StatusCode)
		}
	}
	if r := adminReq(t, "GET", base+"/api/stream", ""); r.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /api/stream without a token: %d", r.StatusCode)
	}

	var once sync.Once
	actions := make(chan error, 1)
	c.onStep = func(r local.Report) {
		if r.Step != 5 {
			return
		}
		once.Do(func() {
			go func() {
				actions <- func() error {
					if r := adminReq(t, "POST", base+"/api/job/pause", tok); r.StatusCode != http.StatusNoContent {
						return fmt.Errorf("pause: %d", r.StatusCode)
					}
					// The job loop takes the pause at its next step boundary.
					st := c.srv.status.Load()
					for deadline := time.Now().Add(time.Minute); st.Job.State != "paused"; st = c.srv.status.Load() {
						if time.Now().After(deadline) {
							return fmt.Errorf("state a minute after pause: %s", st.Job.State)
						}
						time.Sleep(5 * time.Millisecond)
					}
					step := st.Job.Step
					// A paused job stands at a step boundary with its plan: the pause is a hold, not a phase.
					if st.Job.Phase != "boundary" {
						return fmt.Errorf("phase while paused: %q, want boundary", st.Job.Phase)
					}
					time.Sleep(500 * time.Millisecond) // nothing may happen meanwhile: a window, not a sync
					if now := c.srv.status.Load().Job.Step; now != step {
						return fmt.Errorf("trained from step %d to %d while paused", step, now)
					}
					if r := adminReq(t, "POST", base+"/api/checkpoint", tok); r.StatusCode != http.StatusNoContent {
						return fmt.Errorf("checkpoint: %d", r.StatusCode)
					}
					if r := adminReq(t, "POST", base+"/api/job/resume", tok); r.StatusCode != http.StatusNoContent {
						return fmt.Errorf("resume: %d", r.StatusCode)
					}
					return nil
				}()
			}()
		})
	}
	c.run(t)
	if err := <-actions; err != nil {
		t.Fatal(err)
	}
	assertFinalCheckpoint(t, c, ref)
	for _, kind := range []string{"admin.pause", "admin.resume", "admin.checkpoint"} {
		evs, _ := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: kind})
		if len(evs) != 1 {
			t.Errorf("%d %s events, want 1", len(evs), kind)
		}
	}

	// Cookie sign-in: a wrong token is refused, the right one sets an HttpOnly, SameSite=Strict
	// session that authorises actions carrying the action header.
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.PostForm(base+"/admin/login", url.Values{"token": {"nope"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Cookies()) != 0 || !strings.Contains(resp.Header.Get("Location"), "error") {
		t.Errorf("wrong token: cookies %v, location %q", resp.Cookies(), resp.Header.Get("Location"))
	}
	resp, err = noRedirect.PostForm(base+"/admin/login", url.Values{"token": {tok}})
	if err != nil {
		t.Fatal(err)
	}
	cookies := resp.Cookies()
	if len(cookies) != 1 || !cookies[0].HttpOnly || cookies[0].SameSite != http.SameSiteStrictMode {
		t.Fatalf("session cookie %+v", cookies)
	}
	kick := func(header bool) int {
		req, _ := http.NewRequest("POST", base+"/api/peers/nobody/kick", nil)
		req.AddCookie(cookies[0])
		if header {
			req.Header.Set(actionHeader, "1")
		}
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		return r.StatusCode
	}
	if code := kick(false); code != http.StatusUnauthorized {
		t.Errorf("cookie POST without %s: %d", actionHeader, code)
	}
	if code := kick(true); code != http.StatusNoContent {
		t.Errorf("cookie POST with %s: %d", actionHeader, code)
	}

	// The stream sends status events to the admin.
	req, _ := http.NewRequest("GET", base+"/api/stream", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err = http.DefaultClient.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	resp.Body.Close()
	if strings.TrimSpace(line) != "event: status" {
		t.Errorf("stream starts with %q", line)
	}
}

// TestJobQueuePrivateAndSample: a serving coordinator (KeepServing) with no job idles until jobs
// are submitted over the API; they queue and run one at a time. A private job refuses workers
// without its join token and trains with those that have it; a queued job is cancelled before it
// runs; the dashboard's sample comes from the newest checkpoint.
func TestJobQueuePrivateAndSample(t *testing.T) {
	spec := tinyJob(t, 6)
	spec.CheckpointEvery = 3
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Loopback: true, KeepServing: true,
		MinWorkers: 1, Settle: 100 * time.Millisecond, AdminToken: "tok-of-sixteen-chars", Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hs := httptest.NewServer(srv.Handler())
	defer hs.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()

	submit := func(query string) map[string]any {
		b, _ := json.Marshal(spec)
		req, _ := http.NewRequest("POST", hs.URL+"/api/jobs"+query, bytes.NewReader(b))
		req.Header.Set("Authorization", "Bearer tok-of-sixteen-chars")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		json.NewDecoder(resp.Body).Decode(&out)
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("submit: %d %v", resp.StatusCode, out)
		}
		return out
	}
	private := submit("?private=1")
	token, _ := private["join_token"].(string)
	if token == "" || !strings.Contains(fmt.Sprint(private["join_link"]), token) {
		t.Fatalf("private job: %v", private)
	}
	queued := submit("")
	if r := adminReq(t, "POST", hs.URL+"/api/jobs/"+queued["id"].(string)+"/cancel", "tok-of-sixteen-chars"); r.StatusCode != http.StatusNoContent {
		t.Fatalf("cancel the queued job: %d", r.StatusCode)
	}

	log := testLogger()
	wctx, stopWorkers := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i, tok := range []string{"", token} { // a stranger, then a worker with the link
		wg.Add(1)
		go func() {
			defer wg.Done()
			client.RunWorker(wctx, client.WorkerConfig{Coordinator: hs.URL, JoinToken: tok, Name: fmt.Sprint(i),
				MemoryBytes: 1 << 30, Logger: log, BackoffBase: 50 * time.Millisecond, BackoffMax: 100 * time.Millisecond})
		}()
	}
	defer func() { stopWorkers(); wg.Wait() }()

	deadline := time.Now().Add(time.Minute)
	for {
		if time.Now().After(deadline) {
			t.Fatal("the private job did not finish")
		}
		jb, err := srv.db.Job(context.Background(), uuid.MustParse(private["id"].(string)))
		if err == nil && jb.State == storage.JobDone {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The stranger is refused at its hello (or dropped when the job starts, had it joined while
	// no job ran): it never joins the private job.
	joins, _ := srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: "worker.joined"})
	for _, e := range joins {
		if strings.Contains(string(e.Message), `"name":"0"`) {
			t.Errorf("the worker without the join token joined the private job: %s", e.Message)
		}
	}
	if len(joins) == 0 {
		t.Error("the worker with the link never joined")
	}
	jb, _ := srv.db.Job(context.Background(), uuid.MustParse(queued["id"].(string)))
	if jb.State != storage.JobCancelled {
		t.Errorf("the cancelled job is %s", jb.State)
	}
	// A private job's sample is shown to those with its join token (and the admin).
	req, _ := http.NewRequest("GET", hs.URL+"/api/sample", nil)
	req.Header.Set(JoinHeader, token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sample struct {
		Step int64  `json:"step"`
		Text string `json:"text"`
	}
	json.NewDecoder(resp.Body).Decode(&sample)
	resp.Body.Close()
	if sample.Step != int64(spec.Steps) || !strings.HasPrefix(sample.Text, "func ") || len(sample.Text) < 100 {
		t.Errorf("sample %+v", sample)
	}
	cancel()
	if err := <-runDone; !errors.Is(err, context.Canceled) {
		t.Errorf("Run ended with %v", err)
	}
}

func testLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.DiscardHandler)
}
