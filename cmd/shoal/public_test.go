package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/acme"
	"golang.org/x/crypto/acme/autocert"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestServePublicFlags: the --acme-* and --turn* flags refuse what cannot work, before anything
// listens.
func TestServePublicFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--acme-domain", "shoal.example.org", "--tls-cert", "c.pem", "--tls-key", "k.pem"}, "two ways"},
		{[]string{"--acme-domain", "203.0.113.7"}, "DNS name"},
		{[]string{"--acme-domain", "localhost"}, "DNS name"},
		{[]string{"--acme-domain", "shoal.example.org", "--listen", "127.0.0.1:8470"}, "--acme-http"},
		{[]string{"--acme-http", ":80"}, "go with --acme-domain"},
		{[]string{"--acme-email", "a@example.org"}, "go with --acme-domain"},
		{[]string{"--turn-public-ip", "203.0.113.7"}, "go with --turn"},
		{[]string{"--turn-relay-ports", "49152-65535"}, "go with --turn"},
		{[]string{"--turn", "127.0.0.1:0", "--turn-relay-ports", "65535-49152"}, "MIN-MAX"},
		{[]string{"--turn", "127.0.0.1:0", "--turn-relay-ports", "0-10"}, "MIN-MAX"},
		{[]string{"--turn", "127.0.0.1:0", "--turn-relay-ports", "70000"}, "MIN-MAX"},
		{[]string{"--turn", "127.0.0.1:0", "--turn-public-ip", "turn.example.org"}, "not an IP"},
		{[]string{"--turn", ":0", "--listen", "127.0.0.1:0"}, "--turn-public-ip"},
		{[]string{"--ice-relay-only", "--listen", "127.0.0.1:0"}, "needs a TURN server"},
	} {
		args := append([]string{"serve", "--data-dir", t.TempDir(), "--admin-token", "serve-test-admin-token"}, c.args...)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // one that started would run until then
		err := (&Main{Stdout: io.Discard, Stderr: io.Discard}).Run(ctx, args)
		cancel()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("serve %q: %v, want an error saying %q", c.args, err, c.want)
		}
	}
}

// TestACMEManager: the certificate manager --acme-domain uses asks for NAME's certificate only,
// keeps it in the data directory, and answers the TLS-ALPN-01 challenge in its TLS config.
func TestACMEManager(t *testing.T) {
	dir := t.TempDir()
	m := acmeManager(dir, "shoal.example.org", "admin@example.org")
	ctx := context.Background()
	if err := m.HostPolicy(ctx, "shoal.example.org"); err != nil {
		t.Errorf("the domain itself refused: %v", err)
	}
	for _, other := range []string{"evil.example.org", "example.org", "127.0.0.1"} {
		if m.HostPolicy(ctx, other) == nil {
			t.Errorf("host policy admits %s", other)
		}
	}
	if c, ok := m.Cache.(autocert.DirCache); !ok || string(c) != filepath.Join(dir, "acme") {
		t.Errorf("cache %#v, want DirCache(%s)", m.Cache, filepath.Join(dir, "acme"))
	}
	if m.Email != "admin@example.org" || m.Prompt == nil {
		t.Errorf("email %q, prompt set %v", m.Email, m.Prompt != nil)
	}
	if !slices.Contains(m.TLSConfig().NextProtos, acme.ALPNProto) {
		t.Errorf("TLS config offers %v, not %s", m.TLSConfig().NextProtos, acme.ALPNProto)
	}
}

// TestServeACME: `shoal serve --acme-domain NAME` serves TLS whose certificates come from the
// ACME manager: a handshake for another name, or none, is refused (without asking Let's Encrypt,
// which tests cannot reach), and --acme-http answers challenges for NAME only and redirects the
// rest to HTTPS.
func TestServeACME(t *testing.T) {
	// The challenge server starts, and logs, before the coordinator listens.
	w := &watchWriter{want: "coordinator listening", seen: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		m := &Main{Stdout: io.Discard, Stderr: w}
		done <- m.Run(ctx, []string{"serve", "--data-dir", t.TempDir(), "--admin-token", "serve-test-admin-token",
			"--acme-domain", "shoal.example.org", "--listen", "127.0.0.1:0", "--acme-http", "127.0.0.1:0"})
	}()
	select {
	case <-w.seen:
	case err := <-done:
		t.Fatalf("serve ended: %v\n%s", err, w)
	case <-time.After(2 * time.Minute):
		t.Fatalf("serve did not listen within 2 minutes:\n%s", w)
	}
	m := regexp.MustCompile(`coordinator listening" url=https://(127\.0\.0\.1:\d+) dashboard=https://shoal\.example\.org:`).FindStringSubmatch(w.String())
	if m == nil {
		t.Fatalf("serve does not say it listens for HTTPS as shoal.example.org:\n%s", w)
	}
	addr := m[1]
	httpAddr := regexp.MustCompile(`answering ACME HTTP-01 challenges" addr=(127\.0\.0\.1:\d+)`).FindStringSubmatch(w.String())
	if httpAddr == nil {
		t.Fatalf("no challenge server address in the log:\n%s", w)
	}

	// The handshakes fail in the ACME manager's GetCertificate, which the server logs.
	for name, says := range map[string]string{"evil.example.org": `acme/autocert: host \"evil.example.org\" not configured in HostWhitelist`, "": "acme/autocert: missing server name"} {
		w.mu.Lock()
		w.want, w.seen = says, make(chan struct{})
		w.mu.Unlock()
		d := &tls.Dialer{NetDialer: &net.Dialer{Timeout: time.Minute}, Config: &tls.Config{ServerName: name, InsecureSkipVerify: true}}
		if c, err := d.DialContext(ctx, "tcp", addr); err == nil {
			c.Close()
			t.Errorf("a TLS handshake for %q succeeded", name)
		}
		select {
		case <-w.seen:
		case <-time.After(time.Minute):
			t.Errorf("the handshake for %q did not fail in the ACME manager:\n%s", name, w)
		}
	}

	noRedirect := &http.Client{Timeout: time.Minute, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.Get("http://" + httpAddr[1] + "/admin/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if loc := resp.Header.Get("Location"); resp.StatusCode != http.StatusFound || !strings.HasPrefix(loc, "https://") || !strings.HasSuffix(loc, "/admin/") {
		t.Errorf("plain HTTP: %s to %q, want a redirect to HTTPS", resp.Status, loc)
	}
	// A challenge for a name other than the domain (here the address asked) is refused.
	resp, err = noRedirect.Get("http://" + httpAddr[1] + "/.well-known/acme-challenge/token")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("a challenge for another host: %s, want 403", resp.Status)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("serve did not stop within a minute")
	}
}

// TestServeTURNProcesses: `shoal serve --turn 127.0.0.1:0 --ice-relay-only` and two `shoal
// worker` processes train a two-stage job: the workers cannot link directly, so their link goes
// through the coordinator's TURN server — /metrics counts its relayed bytes, and neither worker
// fell back to the WebSocket relay — and the final checkpoint is bitwise the one process's.
func TestServeTURNProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts processes")
	}
	const steps = 4
	dir := t.TempDir()
	jobPath := tinyJob(t, dir, steps)
	editJob(t, jobPath, func(s *job.Spec) { s.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}} })
	refDir := filepath.Join(dir, "ref")
	if _, _, err := run(t, "train", "--job", jobPath, "--out", refDir, "--json"); err != nil {
		t.Fatal(err)
	}
	ref, _, err := model.LoadModel(filepath.Join(refDir, local.CheckpointName(steps)))
	if err != nil {
		t.Fatal(err)
	}

	addr := freeAddr(t)
	url := "http://" + addr
	data := filepath.Join(dir, "data")
	procs := []*proc{startProc(t, dir, "coordinator", "serve", "--data-dir", data, "--listen", addr, "--job", jobPath,
		"--min-workers", "2", "--admin-token", "serve-test-admin-token", "--turn", "127.0.0.1:0", "--ice-relay-only")}
	for i := range 2 {
		procs = append(procs, startProc(t, dir, fmt.Sprintf("worker-%d", i), "worker", "--coordinator", url, "--threads", "1", "--name", fmt.Sprintf("w%d", i)))
	}
	t.Cleanup(func() {
		for _, p := range procs {
			p.kill()
			<-p.done
		}
	})
	for deadline := time.Now().Add(4 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the job did not finish within 4 minutes (logs in %s):\n%s", dir, tail(filepath.Join(dir, "coordinator.log")))
		}
		var st chaosStatus
		if resp, err := http.Get(url + "/api/status"); err == nil {
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil && st.Job != nil && st.Job.State == "done" {
				break
			}
		}
	}
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`(?m)^shoal_turn_relayed_bytes_total (\S+)$`).FindSubmatch(metrics)
	if m == nil {
		t.Fatalf("/metrics has no shoal_turn_relayed_bytes_total:\n%s", metrics)
	}
	if n, _ := strconv.ParseFloat(string(m[1]), 64); n < 1<<16 {
		t.Errorf("the TURN relays sent %v bytes", n)
	}
	for i := range 2 {
		b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("worker-%d.log", i)))
		if strings.Contains(string(b), "using the relay through the coordinator") {
			t.Errorf("worker %d fell back to the WebSocket relay:\n%s", i, b)
		}
	}

	out := filepath.Join(dir, "final.safetensors")
	if _, stderr, err := run(t, "export", "--data-dir", data, "--out", out); err != nil {
		t.Fatalf("export: %v\n%s", err, stderr)
	}
	got, ck, err := model.LoadModel(out)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != steps {
		t.Fatalf("final checkpoint after step %d, want %d", ck.Step, steps)
	}
	for _, set := range [][2]*model.Params{{got.P, ref.P}, {got.Opt.M, ref.Opt.M}, {got.Opt.V, ref.Opt.V}} {
		for i, tt := range set[1].Tensors {
			for j, v := range set[0].Tensors[i].Data {
				if math.Float32bits(v) != math.Float32bits(tt.Data[j]) {
					t.Fatalf("%s[%d] = %v through TURN, %v in one process", tt.Name, j, v, tt.Data[j])
				}
			}
		}
	}
}
