package coordinator

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// listenLimited serves h through NewHTTPServer on a LimitListener at 127.0.0.1, and stops both
// at the test's end.
func listenLimited(t *testing.T, h http.Handler, conns ConnLimits, lim HTTPLimits) (*Listener, string) {
	t.Helper()
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := LimitListener(tcp, conns)
	if lim.Logger == nil {
		lim.Logger = slog.New(slog.DiscardHandler)
	}
	hs := NewHTTPServer(h, lim)
	done := make(chan struct{})
	go func() {
		defer close(done)
		hs.Serve(ln)
	}()
	t.Cleanup(func() {
		hs.Close()
		<-done
	})
	return ln, tcp.Addr().String()
}

func okHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
}

// dialRaw opens a TCP connection that the test closes at its end.
func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, waitFor)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer reports whether the server closes c within d without answering anything.
func closedByServer(c net.Conn, d time.Duration) (bool, string) {
	c.SetReadDeadline(time.Now().Add(d))
	b, err := io.ReadAll(c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false, "still open"
	}
	return len(b) == 0, fmt.Sprintf("read %q, %v", b, err)
}

// get sends one HTTP/1.1 request on c and returns the status line.
func rawGet(t *testing.T, c net.Conn, path string) string {
	t.Helper()
	c.SetDeadline(time.Now().Add(waitFor))
	defer c.SetDeadline(time.Time{})
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: test\r\n\r\n", path); err != nil {
		t.Fatalf("write a request: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read the response: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.Status
}

func waitStats(t *testing.T, ln *Listener, what string, cond func(ConnStats) bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond(ln.Stats()) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: stats %+v", what, ln.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestLimitListenerPerIP: past the per-address cap, new connections from 127.0.0.1 are closed as
// they are accepted, without an answer; those within it are served; a place freed is taken again.
func TestLimitListenerPerIP(t *testing.T) {
	const perIP = 4
	ln, addr := listenLimited(t, okHandler(), ConnLimits{Max: 100, PerIP: perIP}, HTTPLimits{})
	var held []net.Conn
	for i := 0; i < perIP; i++ {
		held = append(held, dialRaw(t, addr))
	}
	waitStats(t, ln, "the first connections to be open", func(s ConnStats) bool { return s.Open == perIP })
	for i := 0; i < 3; i++ {
		c := dialRaw(t, addr)
		if closed, how := closedByServer(c, waitFor); !closed {
			t.Errorf("connection %d over the per-address cap of %d: %s, want closed at accept", perIP+i+1, perIP, how)
		}
	}
	if got := ln.Stats(); got.RefusedPerIP != 3 || got.RefusedTotal != 0 || got.Open != perIP {
		t.Errorf("stats %+v, want 3 refused per address, %d open", got, perIP)
	}
	// The connections within the cap are served.
	for i, c := range held {
		if got := rawGet(t, c, "/"); got != "200 OK" {
			t.Errorf("held connection %d: %s", i, got)
		}
	}
	// One place freed: the next connection gets it.
	held[0].Close()
	waitStats(t, ln, "a place to free up", func(s ConnStats) bool { return s.Open == perIP-1 })
	if got := rawGet(t, dialRaw(t, addr), "/"); got != "200 OK" {
		t.Errorf("a connection after one closed: %s", got)
	}
	for _, c := range held[1:] {
		c.Close()
	}
}

// TestLimitListenerTotal: the cap in all refuses whatever the address.
func TestLimitListenerTotal(t *testing.T) {
	ln, addr := listenLimited(t, okHandler(), ConnLimits{Max: 2}, HTTPLimits{})
	a, b := dialRaw(t, addr), dialRaw(t, addr)
	waitStats(t, ln, "two open", func(s ConnStats) bool { return s.Open == 2 })
	if closed, how := closedByServer(dialRaw(t, addr), waitFor); !closed {
		t.Errorf("a third connection past a cap of 2: %s", how)
	}
	if got := ln.Stats(); got.RefusedTotal != 1 || got.RefusedPerIP != 0 {
		t.Errorf("stats %+v, want 1 refused in all", got)
	}
	for _, c := range []net.Conn{a, b} {
		if got := rawGet(t, c, "/"); got != "200 OK" {
			t.Errorf("a connection within the cap: %s", got)
		}
		c.Close()
	}
	waitStats(t, ln, "all closed", func(s ConnStats) bool { return s.Open == 0 })
}

// TestLimitListenerCountsHijacked: a WebSocket holds its place until it is closed, by either side.
func TestLimitListenerCountsHijacked(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		ws, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer ws.CloseNow()
		for {
			if _, _, err := ws.Read(r.Context()); err != nil {
				return
			}
		}
	})
	ln, addr := listenLimited(t, mux, ConnLimits{Max: 10, PerIP: 1}, HTTPLimits{})
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ws, _, err := websocket.Dial(ctx, "ws://"+addr+"/ws", nil)
	if err != nil {
		t.Fatal(err)
	}
	if closed, how := closedByServer(dialRaw(t, addr), waitFor); !closed {
		t.Errorf("a second connection beside a WebSocket, cap 1: %s", how)
	}
	ws.Close(websocket.StatusNormalClosure, "")
	waitStats(t, ln, "the WebSocket's place to free up", func(s ConnStats) bool { return s.Open == 0 })
}

func TestAddrKey(t *testing.T) {
	tests := []struct {
		name string
		addr net.Addr
		want string
	}{
		{"ipv4", &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 5}, "192.0.2.7"},
		{"loopback", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 80}, "127.0.0.1"},
		{"ipv4-mapped ipv6 counts as ipv4", &net.TCPAddr{IP: net.ParseIP("::ffff:198.51.100.1"), Port: 5}, "198.51.100.1"},
		{"ipv6 by /64", &net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:3:4:5:6"), Port: 5}, "2001:db8:1:2::/64"},
		{"another address of the same /64", &net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:ffff::1"), Port: 9}, "2001:db8:1:2::/64"},
		{"a zone is dropped", &net.TCPAddr{IP: net.ParseIP("fe80::1"), Zone: "eth0", Port: 5}, "fe80::/64"},
		{"not IP", pipeAddr{}, "pipe"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := addrKey(tt.addr); got != tt.want {
				t.Errorf("addrKey(%v) = %q, want %q", tt.addr, got, tt.want)
			}
		})
	}
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

// TestReadHeaderTimeout: a client that sends half a header is cut after ReadHeaderTimeout, and
// the server goes on serving.
func TestReadHeaderTimeout(t *testing.T) {
	const timeout = 200 * time.Millisecond
	ln, addr := listenLimited(t, okHandler(), ConnLimits{Max: 10, PerIP: 10}, HTTPLimits{ReadHeaderTimeout: timeout})
	// The server's clock starts when it accepts, so ours starts before the dial: never later.
	began := time.Now()
	c := dialRaw(t, addr)
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: test\r\nX-Half: "); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(waitFor))
	io.ReadAll(c) // returns when the server closes the connection
	took := time.Since(began)
	if took < timeout || took > 10*timeout {
		t.Errorf("half a header was cut after %v, want about %v", took, timeout)
	}
	if took >= waitFor {
		t.Fatalf("half a header is still open after %v", took)
	}
	if got := rawGet(t, dialRaw(t, addr), "/"); got != "200 OK" {
		t.Errorf("after cutting a slow client: %s", got)
	}
	waitStats(t, ln, "the cut connection to be counted out", func(s ConnStats) bool { return s.Open <= 1 })
}

// TestMaxHeaderBytes: a header past the limit is refused.
func TestMaxHeaderBytes(t *testing.T) {
	_, addr := listenLimited(t, okHandler(), ConnLimits{}, HTTPLimits{MaxHeaderBytes: 4 << 10})
	req, _ := http.NewRequest("GET", "http://"+addr+"/", nil)
	req.Header.Set("X-Big", strings.Repeat("a", 64<<10))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("a 64 KiB header under a 4 KiB limit: %s", resp.Status)
	}
}

func TestRouteClass(t *testing.T) {
	tests := []struct {
		method, path string
		want         routeKind
	}{
		{"GET", "/ws", routeSocket},
		{"GET", "/api/stream", routeStream},
		{"GET", "/blobs/" + strings.Repeat("ab", 32), routeDownload},
		{"GET", "/api/checkpoints/7/model", routeDownload},
		{"HEAD", "/shoal.wasm", routeDownload},
		{"GET", "/wasm_exec.js", routeDownload},
		{"POST", "/api/checkpoints/7/shards/stage-0", routeUpload},
		{"GET", "/api/status", routeOrdinary},
		{"GET", "/api/checkpoints", routeOrdinary},
		{"POST", "/api/jobs", routeOrdinary},
		{"GET", "/admin/", routeOrdinary},
		{"GET", "/", routeOrdinary},
		{"GET", "/api/checkpoints/7/shards/stage-0", routeOrdinary},
	}
	for _, tt := range tests {
		r := httptest.NewRequest(tt.method, tt.path, nil)
		if got := routeClass(r); got != tt.want {
			t.Errorf("%s %s: class %d, want %d", tt.method, tt.path, got, tt.want)
		}
	}
}

// TestDeadlinesByRoute runs every kind of route under deadlines far shorter than the test: an
// ordinary request whose body stalls is cut; a WebSocket, the event stream and a download that
// take longer than every deadline go on; a download nobody reads ends after StallTimeout.
func TestDeadlinesByRoute(t *testing.T) {
	const short = 150 * time.Millisecond
	lim := HTTPLimits{ReadTimeout: short, WriteTimeout: short, StallTimeout: short, IdleTimeout: time.Minute}
	bodyErr := make(chan error, 1)
	stalled := make(chan error, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /api/jobs", func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		bodyErr <- err
	})
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		ws, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer ws.CloseNow()
		for {
			typ, b, err := ws.Read(r.Context())
			if err != nil {
				return
			}
			if err := ws.Write(r.Context(), typ, b); err != nil {
				return
			}
		}
	})
	mux.HandleFunc("GET /api/stream", func(w http.ResponseWriter, r *http.Request) {
		fl := w.(http.Flusher) // the dashboard's stream asserts it too
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 8; i++ {
			if _, err := fmt.Fprintf(w, "data: %d\n\n", i); err != nil {
				return
			}
			fl.Flush()
			time.Sleep(short / 2)
		}
	})
	mux.HandleFunc("GET /blobs/{sha}", func(w http.ResponseWriter, r *http.Request) {
		chunk := bytes.Repeat([]byte("x"), 32<<10)
		n := 8
		if r.PathValue("sha") == "stall" {
			n = 1 << 20 // 32 GiB: more than any socket buffer holds
		}
		for i := 0; i < n; i++ {
			if _, err := w.Write(chunk); err != nil {
				stalled <- err
				return
			}
			if r.PathValue("sha") != "stall" {
				time.Sleep(short / 3)
			}
		}
		stalled <- nil
	})
	_, addr := listenLimited(t, mux, ConnLimits{}, lim)
	base := "http://" + addr

	t.Run("a stalled body is cut", func(t *testing.T) {
		c := dialRaw(t, addr)
		fmt.Fprintf(c, "POST /api/jobs HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\nhalf")
		select {
		case err := <-bodyErr:
			if err == nil {
				t.Error("the handler read the whole of a body that never came")
			}
		case <-time.After(waitFor):
			t.Fatal("a stalled body is still being read")
		}
	})
	t.Run("a WebSocket outlives every deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		ws, _, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(base, "http")+"/ws", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer ws.CloseNow()
		for i := 0; i < 3; i++ {
			time.Sleep(2 * short)
			if err := ws.Write(ctx, websocket.MessageText, []byte("ping")); err != nil {
				t.Fatalf("write after %v: %v", time.Duration(i+1)*2*short, err)
			}
			if _, b, err := ws.Read(ctx); err != nil || string(b) != "ping" {
				t.Fatalf("echo after %v: %q %v", time.Duration(i+1)*2*short, b, err)
			}
		}
		ws.Close(websocket.StatusNormalClosure, "")
	})
	t.Run("the event stream outlives the write timeout", func(t *testing.T) {
		resp, err := http.Get(base + "/api/stream")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || strings.Count(string(b), "data: ") != 8 {
			t.Errorf("stream: %q, %v; want 8 events over %v", b, err, 4*short)
		}
	})
	t.Run("a slow download completes while it moves", func(t *testing.T) {
		resp, err := http.Get(base + "/blobs/slow")
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != 8*32<<10 {
			t.Errorf("download: %d bytes, %v", n, err)
		}
		if err := <-stalled; err != nil {
			t.Errorf("the slow download's handler: %v", err)
		}
	})
	t.Run("a download nobody reads ends", func(t *testing.T) {
		c := dialRaw(t, addr)
		fmt.Fprintf(c, "GET /blobs/stall HTTP/1.1\r\nHost: test\r\n\r\n")
		select {
		case err := <-stalled:
			if err == nil {
				t.Error("the stalled download's handler wrote everything")
			}
		case <-time.After(waitFor):
			t.Fatal("a download nobody reads is still being written")
		}
	})
}

// TestNoSniff: every response says its type is to be believed.
func TestNoSniff(t *testing.T) {
	_, addr := listenLimited(t, okHandler(), ConnLimits{}, HTTPLimits{})
	resp, err := http.Get("http://" + addr + "/api/status")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got := resp.Header.Get("X-Content-Type-Options"); got != "nosniff" {
		t.Errorf("X-Content-Type-Options %q, want nosniff", got)
	}
}
