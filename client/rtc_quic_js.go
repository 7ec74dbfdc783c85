//go:build js

package client

import (
	"context"

	"github.com/shoal-ml/shoal/proto"
)

// A browser tab has no socket of its own: its links stay on data channels (rtc_quic.go is the
// native QUIC path). These stand-ins keep rtc_peer.go one file for both.

type quicEndpoint struct{ fp string }

type quicLink struct{}

func openQUIC(*RTCTransport) (*quicEndpoint, error) { return nil, nil }

func (*quicEndpoint) close() {}

func (*rtcPeer) dialQUIC() {}

func (*rtcPeer) watchSelectedPair() {}

func (*quicLink) close() {}

func (*quicLink) sendChunk(context.Context, proto.Tensor, int, int) error { return nil }
