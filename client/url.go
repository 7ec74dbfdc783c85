package client

import (
	"errors"
	"strings"
)

// CoordinatorURL is a coordinator address as people type it: "host:port" without a scheme
// means http://host:port, as `shoal serve` prints it; anything with a scheme is left as it is.
// The worker and `shoal status` take addresses alike through it.
func CoordinatorURL(addr string) string {
	addr = strings.TrimSpace(addr)
	if addr != "" && !strings.Contains(addr, "://") {
		return "http://" + addr
	}
	return addr
}

// ErrNotCoordinator is wrapped by Dial when the server at the coordinator's address answers the
// worker's WebSocket with 404: something else listens there, and asking again will not change
// that, where an unreachable coordinator may yet come up.
var ErrNotCoordinator = errors.New("this is not a Shoal coordinator")
