//go:build js

package client

import (
	"context"
	"net/http"

	"github.com/coder/websocket"
)

// newTransport is the transport of a browser tab's requests to its coordinator: the browser's
// fetch, which follows redirects itself without asking Go's CheckRedirect, so that it is told to
// refuse them all (the coordinator redirects none of a worker's requests).
func newTransport() http.RoundTripper { return noRedirects{} }

type noRedirects struct{}

func (noRedirects) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("js.fetch:redirect", "error")
	return http.DefaultTransport.RoundTrip(req)
}

// dialWS opens the control WebSocket at url: the browser's, which follows no redirects.
func dialWS(ctx context.Context, url string, _ *http.Client) (*websocket.Conn, error) {
	ws, _, err := websocket.Dial(ctx, url, nil)
	return ws, err
}
