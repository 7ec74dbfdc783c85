package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// A volunteer trusts its coordinator with its compute, not with its machine: everything a worker
// fetches from or sends to the coordinator's HTTP server is bounded in time and held to the
// coordinator's own origin, and every download in size (restore.go) — so that a hostile or broken
// coordinator can waste a volunteer's time but never make it hang for good, exceed the memory it
// offered, or fill its disk.

const (
	// DefaultStallTimeout is how long a request to the coordinator may go without a byte moving
	// (connecting, waiting for the response's headers, or a body in either direction) before it is
	// cut. A slow transfer that keeps moving is never cut: only silence is. It is longer than the
	// coordinator's own stall timeout for uploads (30 s), and than its wait for a staging place
	// under load.
	DefaultStallTimeout = 2 * time.Minute
	// handshakeTimeout bounds joining: the WebSocket handshake and the coordinator's welcome.
	handshakeTimeout = 2 * time.Minute
)

// errStalled is a request's cause when it went DefaultStallTimeout (WorkerConfig.StallTimeout)
// without progress.
var errStalled = errors.New("no byte moved")

// origin is a URL's scheme, host and port, with the scheme's default port spelled out and ws(s)
// taken as http(s), the origin of a WebSocket's handshake.
func origin(u *url.URL) string {
	scheme := strings.ToLower(u.Scheme)
	switch scheme {
	case "ws":
		scheme = "http"
	case "wss":
		scheme = "https"
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[scheme]
	}
	return scheme + "://" + strings.ToLower(u.Hostname()) + ":" + port
}

// sameOriginRedirects is a CheckRedirect that follows a redirect only within base's origin: a
// coordinator must not send its workers, with their session credential, to another server.
func sameOriginRedirects(base string) (func(*http.Request, []*http.Request) error, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("coordinator URL %q: %w", base, err)
	}
	want := origin(u)
	return func(req *http.Request, via []*http.Request) error {
		if got := origin(req.URL); got != want {
			return fmt.Errorf("redirect to %s refused: a worker follows redirects only within its coordinator's origin %s", got, want)
		}
		if len(via) >= 10 {
			return errors.New("stopped after 10 redirects")
		}
		return nil
	}, nil
}

// coordinatorHTTP is the client a worker talks to the coordinator at base with: c's (nil: a new
// one with connect, TLS and header timeouts) with redirects held to base's origin. Bodies are
// bounded in time by watch, not by the client: a checkpoint may take long to move, and only a
// transfer that stops moving is cut.
func coordinatorHTTP(base string, c *http.Client) (*http.Client, error) {
	check, err := sameOriginRedirects(base)
	if err != nil {
		return nil, err
	}
	var out http.Client
	if c != nil && c != http.DefaultClient {
		out = *c
	} else {
		out.Transport = newTransport()
	}
	out.CheckRedirect = check
	return &out, nil
}

// CoordinatorClient is an HTTP client for requests to the coordinator at base outside a worker's
// sessions (`shoal worker` asking for the job's model before it joins): held to base's origin,
// with connect, TLS and header timeouts.
func CoordinatorClient(base string) (*http.Client, error) { return coordinatorHTTP(base, nil) }

// watch bounds a request to the coordinator by its progress: the context it returns is cancelled,
// with errStalled as its cause, when stall passes without a call to the returned touch. The
// caller touches it for every byte that moves and calls stop when done.
func watch(ctx context.Context, stall time.Duration) (_ context.Context, touch, stop func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	t := time.AfterFunc(stall, func() { cancel(fmt.Errorf("%w for %v", errStalled, stall)) })
	var mu sync.Mutex
	return ctx, func() {
			mu.Lock()
			t.Reset(stall)
			mu.Unlock()
		}, func() {
			t.Stop()
			cancel(nil)
		}
}

// stallErr is err, or the cause of ctx's end when that is a stall: "context canceled" says
// nothing of why.
func stallErr(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if c := context.Cause(ctx); errors.Is(c, errStalled) {
		return c
	}
	return err
}

// progressReader touches its watch for every read that moves bytes.
type progressReader struct {
	r     io.Reader
	touch func()
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		p.touch()
	}
	return n, err
}
