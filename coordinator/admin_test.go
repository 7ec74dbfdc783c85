package coordinator

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

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
					time.Sleep(300 * time.Millisecond)
					st := c.srv.status.Load()
					if st.Job.State != "paused" {
						return fmt.Errorf("state after pause: %s", st.Job.State)
					}
					step := st.Job.Step
					time.Sleep(500 * time.Millisecond)
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
