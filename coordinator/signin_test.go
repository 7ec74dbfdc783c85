package coordinator

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

// TestAdminGuessingBacksOff is the attacker of the admin sign-in: anyone who reaches the
// coordinator may guess its token, through the API's bearer header or the sign-in form. After
// signinFree wrong tokens its address must wait before the next one is even compared — the right
// token too — and the wait doubles with each wrong one, so guessing runs at a few tokens a minute
// rather than thousands a second. The admin's own right token, once the wait is over, clears the
// record.
func TestAdminGuessingBacksOff(t *testing.T) {
	const tok = "the-right-admin-token"
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), Loopback: true, KeepServing: true, AdminToken: tok, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	hs := httptest.NewServer(srv.Handler())
	defer hs.Close()
	pause := hs.URL + "/api/job/pause"

	// Guess as fast as the coordinator answers, for a second.
	compared, refused := 0, 0
	for start := time.Now(); time.Since(start) < time.Second; {
		switch r := adminReq(t, "POST", pause, "guess-"+time.Now().String()); r.StatusCode {
		case http.StatusUnauthorized:
			compared++
		case http.StatusTooManyRequests:
			refused++
			if r.Header.Get("Retry-After") == "" {
				t.Fatal("429 without Retry-After")
			}
		default:
			t.Fatalf("a wrong token: status %d", r.StatusCode)
		}
	}
	t.Logf("in one second: %d wrong tokens compared, %d refused unread", compared, refused)
	// signinFree free ones, then one that starts a 1 s wait, and — when the loop's last request
	// lands just as that wait ends — one more; the next would wait 2 s more.
	if compared > signinFree+2 || refused == 0 {
		t.Fatalf("%d guesses compared in a second (%d refused): want at most %d", compared, refused, signinFree+2)
	}
	// While it waits, even the right token is not compared: a guess that happened to be right
	// would learn nothing. (The wait is made a minute, so that a slow machine cannot end it
	// before the checks below.)
	key := remoteKey("127.0.0.1:1")
	srv.auth.guesses.mu.Lock()
	srv.auth.guesses.addrs[key].until = time.Now().Add(time.Minute)
	srv.auth.guesses.mu.Unlock()
	if r := adminReq(t, "POST", pause, tok); r.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("the right token during the wait: status %d, want 429", r.StatusCode)
	}
	// The sign-in form is the same door.
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.PostForm(hs.URL+"/admin/login", url.Values{"token": {tok}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if loc := resp.Header.Get("Location"); !strings.Contains(loc, "error=wait") {
		t.Fatalf("sign-in form during the wait: sent to %q, want the wait message", loc)
	}
	// Once the wait is over the admin gets in, and the record is cleared.
	srv.auth.guesses.mu.Lock()
	srv.auth.guesses.addrs[key].until = time.Now()
	srv.auth.guesses.mu.Unlock()
	req, _ := http.NewRequest("GET", hs.URL+"/admin/", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err = noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the dashboard with the right token after the wait: status %d", resp.StatusCode)
	}
	if w := srv.auth.guesses.wait(key, time.Now()); w != 0 || srv.auth.guesses.addrs[key] != nil {
		t.Fatalf("still waiting %v after the right token", w)
	}
}

// TestSigninGuard: the wait doubles past signinFree, is per address (an IPv6 /64 is one), and
// the remembered addresses are bounded.
func TestSigninGuard(t *testing.T) {
	var g signinGuard
	now := time.Unix(1e9, 0)
	a, b := remoteKey("[2001:db8::1]:9"), remoteKey("[2001:db8::2]:9")
	if a != b {
		t.Fatalf("one /64, two keys: %s %s", a, b)
	}
	var waits []time.Duration
	for range signinFree + 3 {
		g.wrong(a, now)
		waits = append(waits, g.wait(a, now))
	}
	want := []time.Duration{0, 0, 0, 0, 0, time.Second, 2 * time.Second, 4 * time.Second}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("waits %v, want %v", waits, want)
		}
	}
	if w := g.wait(remoteKey("192.0.2.1:9"), now); w != 0 {
		t.Fatalf("another address waits %v", w)
	}
	for i := range maxSigninAddrs + 100 {
		g.wrong(remoteKey("10.0."+string(rune('0'+i%10))+".1:1")+string(rune(i)), now)
	}
	if n := len(g.addrs); n > maxSigninAddrs {
		t.Fatalf("%d addresses remembered, at most %d", n, maxSigninAddrs)
	}
}

// TestAdminTokenTooShort: a coordinator refuses a guessable admin token rather than serve with it.
func TestAdminTokenTooShort(t *testing.T) {
	_, err := New(context.Background(), Config{DataDir: t.TempDir(), Loopback: true, KeepServing: true, AdminToken: "hunter2", Logger: testLogger()})
	if err == nil || !strings.Contains(err.Error(), "at least 16") {
		t.Fatalf("admin token of 7 characters: %v, want a refusal naming the minimum", err)
	}
}
