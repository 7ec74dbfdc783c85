//go:build !js

package client

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/coder/websocket"
)

// newTransport is the transport of a worker's requests to its coordinator: connecting, the TLS
// handshake and the wait for a response's headers are bounded, where Go's default transport
// bounds only the first two and the coordinator could leave a request unanswered for good.
func newTransport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.TLSHandshakeTimeout = 30 * time.Second
	t.ResponseHeaderTimeout = DefaultStallTimeout
	t.ExpectContinueTimeout = time.Second
	return t
}

// dialWS opens the control WebSocket at url with hc (nil: coordinatorHTTP's, held to url's
// origin).
func dialWS(ctx context.Context, url string, hc *http.Client) (*websocket.Conn, error) {
	if hc == nil {
		var err error
		if hc, err = coordinatorHTTP(url, nil); err != nil {
			return nil, err
		}
	}
	ws, resp, err := websocket.Dial(ctx, url, &websocket.DialOptions{HTTPClient: hc})
	if err != nil && resp != nil && resp.StatusCode == http.StatusNotFound {
		return nil, fmt.Errorf("%w (it answers 404 Not Found): check the address", ErrNotCoordinator)
	}
	return ws, err
}
