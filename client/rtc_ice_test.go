package client

import (
	"testing"

	"github.com/shoal-ml/shoal/proto"
)

// TestLoopbackICEServer: loopback mode keeps an ICE server only when every URL names a loopback
// IP, so that the coordinator's TURN server on 127.0.0.1 serves tests and nothing else is asked.
func TestLoopbackICEServer(t *testing.T) {
	for _, c := range []struct {
		urls []string
		want bool
	}{
		{[]string{"turn:127.0.0.1:3478?transport=udp"}, true},
		{[]string{"turn:127.0.0.1:3478"}, true},
		{[]string{"stun:127.0.0.1"}, true},
		{[]string{"turn:[::1]:3478?transport=udp"}, true},
		{[]string{"turn:127.0.0.1:3478", "turn:203.0.113.1:3478"}, false},
		{[]string{"turn:localhost:3478"}, false},
		{[]string{"stun:stun.example.org:3478"}, false},
		{[]string{"turn:10.0.0.1:3478"}, false},
		{[]string{"127.0.0.1"}, false},
		{nil, false},
	} {
		if got := loopbackICEServer(proto.ICEServer{URLs: c.urls}); got != c.want {
			t.Errorf("%q: %v, want %v", c.urls, got, c.want)
		}
	}
}
