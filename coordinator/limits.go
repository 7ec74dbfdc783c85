package coordinator

// The HTTP edge (issue 14): what a coordinator that faces the internet bounds before a request
// reaches a handler. Two layers:
//
//   - LimitListener caps the TCP connections open at once, in all and per remote address, and
//     closes those over the cap as they are accepted, before a byte of them is read: a flood of
//     idle sockets costs file descriptors and goroutines long before any handler runs.
//   - NewHTTPServer bounds every phase of a request that a slow or silent client could stretch:
//     the header (ReadHeaderTimeout, MaxHeaderBytes), the pause between requests (IdleTimeout),
//     and the body and response per kind of route (see routeClass), because one ReadTimeout or
//     WriteTimeout for the whole server would cut the worker WebSockets, the dashboard's event
//     stream and multi-gigabyte checkpoint downloads.

import (
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// HTTPLimits are the timeouts and sizes of NewHTTPServer; zero fields take the defaults.
type HTTPLimits struct {
	// ReadHeaderTimeout bounds the TLS handshake and the request line and headers (default 10 s):
	// a client that sends half a header is cut then.
	ReadHeaderTimeout time.Duration
	// IdleTimeout is how long a keep-alive connection may wait for its next request (default
	// 120 s); an idle connection still counts against LimitListener's caps.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds the request line and headers (default 64 KiB; ours are a cookie or a
	// bearer token, far less).
	MaxHeaderBytes int
	// ReadTimeout bounds an ordinary request that has a body, from the moment its handler starts
	// (default 30 s). Ordinary: every route but the worker WebSocket, the event stream,
	// downloads and shard uploads. Once the body is read net/http reads the connection in the
	// background, and the deadline passing there cancels the request's context: for these
	// requests it bounds the handler too.
	ReadTimeout time.Duration
	// WriteTimeout bounds an ordinary response, from the moment its handler starts (default
	// 60 s: a sample of a large model takes seconds to generate).
	WriteTimeout time.Duration
	// StallTimeout is how long a write of a download or of the event stream may block on a
	// client that does not read (default 60 s). Such responses have no overall deadline — a
	// checkpoint of several GiB takes what the link takes — but one that stops moving ends.
	StallTimeout time.Duration
	// Logger receives the server's own errors (TLS handshake failures, accept errors) at Info
	// level: scanners on the internet cause plenty of them. Nil: slog.Default().
	Logger *slog.Logger
}

// Defaults of HTTPLimits.
const (
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultIdleTimeout       = 120 * time.Second
	DefaultMaxHeaderBytes    = 64 << 10
	DefaultReadTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 60 * time.Second
	DefaultStallTimeout      = 60 * time.Second
)

func (l HTTPLimits) withDefaults() HTTPLimits {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&l.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	def(&l.IdleTimeout, DefaultIdleTimeout)
	def(&l.ReadTimeout, DefaultReadTimeout)
	def(&l.WriteTimeout, DefaultWriteTimeout)
	def(&l.StallTimeout, DefaultStallTimeout)
	if l.MaxHeaderBytes <= 0 {
		l.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if l.Logger == nil {
		l.Logger = slog.Default()
	}
	return l
}

// NewHTTPServer returns the http.Server that `shoal serve` and `shoal train --workers` run h
// (Server.Handler()) on. Its own ReadTimeout and WriteTimeout stay zero on purpose: net/http
// applies them to every request alike, and a deadline on the connection would also hit the
// hijacked /ws connections and the long responses. Deadlines are set per request instead, by
// kind of route (routeClass), through http.ResponseController. Every response also carries
// X-Content-Type-Options: nosniff, so that no browser takes a JSON body with a peer's string in it
// for a page.
func NewHTTPServer(h http.Handler, lim HTTPLimits) *http.Server {
	lim = lim.withDefaults()
	return &http.Server{
		Handler:           withDeadlines(h, lim),
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
		ErrorLog:          log.New(slogWriter{lim.Logger}, "", 0),
	}
}

// slogWriter turns the http.Server's log lines into slog records.
type slogWriter struct{ log *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.log.Info("http server", "msg", strings.TrimSpace(string(p)))
	return len(p), nil
}

// Kinds of route, by what their deadlines must allow.
type routeKind int

const (
	routeOrdinary routeKind = iota // a small body, a response in seconds: read and write deadlines
	routeUpload                    // shard uploads: the upload handler sets its own deadlines
	routeSocket                    // /ws: hijacked, kept alive by the hub's heartbeats
	routeStream                    // GET /api/stream: open as long as the dashboard is
	routeDownload                  // blobs, whole models, the wasm worker: as long as the link needs
)

// routeClass sorts a request by the routes of Server (New); a route not named here is ordinary,
// so that a new route is bounded unless it says otherwise.
func routeClass(r *http.Request) routeKind {
	p := r.URL.Path
	switch {
	case p == "/ws":
		return routeSocket
	case p == "/api/stream":
		return routeStream
	case r.Method == http.MethodPost && strings.HasPrefix(p, "/api/checkpoints/") && strings.Contains(p, "/shards/"),
		r.Method == http.MethodPost && strings.HasPrefix(p, "/api/audits/"):
		return routeUpload
	case strings.HasPrefix(p, "/blobs/"),
		strings.HasPrefix(p, "/api/checkpoints/") && strings.HasSuffix(p, "/model"),
		p == "/"+WasmFile, p == "/"+WasmExecFile:
		return routeDownload
	}
	return routeOrdinary
}

// withDeadlines sets each request's deadlines by its routeClass.
func withDeadlines(h http.Handler, lim HTTPLimits) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Content-Type-Options", "nosniff")
		switch routeClass(r) {
		case routeOrdinary:
			// Errors are ErrNotSupported from writers without a connection (tests' recorders):
			// nothing to bound there.
			rc := http.NewResponseController(w)
			now := time.Now()
			if r.Body != nil && r.Body != http.NoBody {
				rc.SetReadDeadline(now.Add(lim.ReadTimeout))
			}
			rc.SetWriteDeadline(now.Add(lim.WriteTimeout))
		case routeStream, routeDownload:
			// No read deadline: net/http reads the connection in the background while a handler
			// runs, and a read deadline passing there would cancel the request's context in the
			// middle of a download.
			w = &stallWriter{ResponseWriter: w, rc: http.NewResponseController(w), stall: lim.StallTimeout}
		case routeSocket, routeUpload:
			// The hub and the upload handler bound these themselves; /ws must get the
			// connection's own ResponseWriter, which it hijacks.
		}
		h.ServeHTTP(w, r)
	})
}

// stallWriter gives each write of a long response StallTimeout to complete, pushing the write
// deadline forward as the response moves. It moves the deadline at most every eighth of the
// timeout, so that a download in 32 KiB writes does not reset a timer per write.
type stallWriter struct {
	http.ResponseWriter
	rc       *http.ResponseController
	stall    time.Duration
	deadline time.Time // zero until the first write
}

func (w *stallWriter) extend() {
	now := time.Now()
	if w.deadline.Sub(now) > w.stall-w.stall/8 {
		return
	}
	w.deadline = now.Add(w.stall)
	w.rc.SetWriteDeadline(w.deadline)
}

func (w *stallWriter) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

// Flush is what the event stream calls after each message (it asserts http.Flusher).
func (w *stallWriter) Flush() {
	w.extend()
	w.rc.Flush()
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *stallWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// ConnLimits are LimitListener's caps. Zero means no cap.
type ConnLimits struct {
	// Max caps the connections open at once in all; PerIP those from one remote address (an
	// IPv4 address, or an IPv6 /64: one subscriber's allocation, which a client can walk through
	// at will).
	Max, PerIP int
	// Logger hears of refused connections, at most once per LogEvery (default 10 s) so that a
	// flood does not flood the log too. Nil: not logged.
	Logger   *slog.Logger
	LogEvery time.Duration
}

// Defaults of `shoal serve --max-conns` and `--max-conns-per-ip`. The per-address cap stays far
// above what one machine of honest peers opens: on loopback (the demo, tests) every worker and
// browser tab shares 127.0.0.1, each worker holds a WebSocket and a few keep-alive connections,
// and a browser up to six per origin besides its stream.
const (
	DefaultMaxConns      = 4096
	DefaultMaxConnsPerIP = 256
)

// ConnStats counts a LimitListener's connections.
type ConnStats struct {
	Open int // open now
	// RefusedTotal and RefusedPerIP count the connections closed at accept because the cap in
	// all, or the cap of their address, was reached.
	RefusedTotal, RefusedPerIP uint64
}

// Listener is a net.Listener that caps its open connections (LimitListener).
type Listener struct {
	net.Listener
	lim ConnLimits

	mu      sync.Mutex
	open    int
	byAddr  map[string]int
	lastLog time.Time

	refusedTotal, refusedPerIP atomic.Uint64
}

// LimitListener wraps ln: Accept closes, at once and without reading from it, every connection
// that would take the open connections past lim.Max, or those of its remote address past
// lim.PerIP, and goes on accepting. A connection counts until it is closed — by the HTTP server,
// or by whoever hijacked it.
func LimitListener(ln net.Listener, lim ConnLimits) *Listener {
	if lim.LogEvery <= 0 {
		lim.LogEvery = 10 * time.Second
	}
	return &Listener{Listener: ln, lim: lim, byAddr: map[string]int{}}
}

// Accept returns the next connection within the caps.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		key := addrKey(c.RemoteAddr())
		if reason := l.take(key); reason != "" {
			c.Close()
			l.logRefused(key, reason)
			continue
		}
		return &limitedConn{Conn: c, l: l, key: key}, nil
	}
}

// take counts a new connection from key, or says which cap refuses it.
func (l *Listener) take(key string) (refused string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lim.Max > 0 && l.open >= l.lim.Max {
		l.refusedTotal.Add(1)
		return "total"
	}
	if l.lim.PerIP > 0 && l.byAddr[key] >= l.lim.PerIP {
		l.refusedPerIP.Add(1)
		return "per-ip"
	}
	l.open++
	l.byAddr[key]++
	return ""
}

func (l *Listener) release(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if l.byAddr[key]--; l.byAddr[key] <= 0 {
		delete(l.byAddr, key)
	}
}

func (l *Listener) logRefused(key, reason string) {
	if l.lim.Logger == nil {
		return
	}
	l.mu.Lock()
	now := time.Now()
	due := now.Sub(l.lastLog) >= l.lim.LogEvery
	if due {
		l.lastLog = now
	}
	open, fromAddr := l.open, l.byAddr[key]
	l.mu.Unlock()
	if due {
		l.lim.Logger.Warn("connections refused at accept: cap reached", "cap", reason, "remote", key,
			"open", open, "open_from_remote", fromAddr, "max_conns", l.lim.Max, "max_conns_per_ip", l.lim.PerIP,
			"refused_total", l.refusedTotal.Load(), "refused_per_ip", l.refusedPerIP.Load())
	}
}

// Stats reports the open connections and how many were refused so far.
func (l *Listener) Stats() ConnStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	return ConnStats{Open: l.open, RefusedTotal: l.refusedTotal.Load(), RefusedPerIP: l.refusedPerIP.Load()}
}

// addrKey is the address a connection counts against: its IPv4 address, or its IPv6 /64.
func addrKey(a net.Addr) string {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ipKey(ta.AddrPort().Addr())
	}
	return remoteKey(a.String())
}

// remoteKey is addrKey of a "host:port" (an http.Request's RemoteAddr): the hub caps workers per
// address with the same grouping as the listener caps connections.
func remoteKey(remote string) string {
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return remote // not IP (a test's pipe): one bucket per address string
	}
	return ipKey(ap.Addr())
}

func ipKey(ip netip.Addr) string {
	ip = ip.Unmap().WithZone("")
	if ip.Is6() {
		return netip.PrefixFrom(ip, 64).Masked().String()
	}
	return ip.String()
}

// limitedConn gives its place back when it is closed, once however often Close is called.
type limitedConn struct {
	net.Conn
	l    *Listener
	key  string
	once sync.Once
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c.key) })
	return err
}

// ReadFrom keeps the kernel's sendfile path for downloads (net/http looks for io.ReaderFrom on
// the connection).
func (c *limitedConn) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(struct{ io.Writer }{c.Conn}, r)
}
