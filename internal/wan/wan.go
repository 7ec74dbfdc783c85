package wan

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/pion/logging"
	"github.com/pion/transport/v5"
	"github.com/pion/transport/v5/vnet"
)

// Link is what every host's link to the others is like.
type Link struct {
	// RateBitsPerS limits each host's ingress, in bits of UDP payload per second; 0 leaves it
	// unlimited.
	RateBitsPerS int64
	// RTT is the round-trip time between two hosts: each packet waits RTT/2 on its way.
	RTT time.Duration
	// Loss is the fraction of packets dropped on the way, in [0, 1), each packet independently
	// (no bursts of loss): 0.2 drops about one packet in five.
	Loss float64
	// Seed seeds the loss generator: the same seed and the same packets drop the same ones.
	Seed uint64
	// QueueBytes is the drop-tail queue in front of each host's token bucket, in payload bytes.
	// 0 means one bandwidth-delay product (RateBitsPerS × RTT), at least MinQueueBytes: the
	// classic buffer size at which one congestion-controlled flow (SCTP halves its window on a
	// loss, as TCP Reno does) keeps the link busy through the halving, without the larger
	// buffers' extra delay ("bufferbloat") that a real path would not have either.
	QueueBytes int
	// BurstBytes is the token bucket's depth: how much may pass at once after an idle spell.
	// 0 means 5 ms of the rate, at least MinBurstBytes. A bucket is needed at all because the
	// ingress is a goroutine woken by timers: a wake-up late by a few ms (a busy or noisy machine)
	// then catches up from the bucket instead of losing the link's time for good.
	BurstBytes int
}

const (
	// MinBurstBytes is the smallest bucket: one UDP datagram of the largest size. vnet's bucket
	// waits for enough tokens for the whole packet at its head, so a packet larger than the
	// bucket would block that host's ingress for ever.
	MinBurstBytes = 64 << 10
	// MinQueueBytes is the smallest queue: a few SCTP bursts, so that a link without delay (RTT
	// 0, whose bandwidth-delay product is 0) still takes what a sender's window puts on it at once.
	MinQueueBytes = 256 << 10
)

// withDefaults fills the zero size fields of l.
func (l Link) withDefaults() Link {
	if l.BurstBytes <= 0 {
		l.BurstBytes = int(l.RateBitsPerS / 8 * 5 / 1000)
	}
	l.BurstBytes = max(l.BurstBytes, MinBurstBytes)
	if l.QueueBytes <= 0 {
		l.QueueBytes = int(float64(l.RateBitsPerS) / 8 * l.RTT.Seconds())
	}
	l.QueueBytes = max(l.QueueBytes, MinQueueBytes)
	return l
}

// Network is a simulated network of hosts joined by one router.
type Network struct {
	link   Link
	router *vnet.Router

	mu     sync.Mutex
	queues []*vnet.Queue // the hosts' ingresses, closed with the network
	closed bool
}

// subnet holds the hosts' addresses: private, and in any case only ever inside this process.
const subnet = "10.77.0.0/24"

// New starts a network whose hosts are joined by links like l.
func New(l Link) (*Network, error) {
	switch {
	case l.RateBitsPerS < 0:
		return nil, fmt.Errorf("wan: rate %d bits/s is negative", l.RateBitsPerS)
	case l.RateBitsPerS > 1<<40:
		// vnet's bucket counts bits in an int; a rate past a terabit is a mistake anyway.
		return nil, fmt.Errorf("wan: rate %d bits/s is past 1 Tb/s", l.RateBitsPerS)
	case l.RTT < 0:
		return nil, fmt.Errorf("wan: RTT %v is negative", l.RTT)
	case !(l.Loss >= 0 && l.Loss < 1):
		return nil, fmt.Errorf("wan: loss %v is not in [0, 1)", l.Loss)
	}
	l = l.withDefaults()
	r, err := vnet.NewRouter(&vnet.RouterConfig{
		CIDR:     subnet,
		MinDelay: l.RTT / 2,
		// vnet logs at the level PION_LOG_* set (errors only by default), as pion does elsewhere.
		LoggerFactory: logging.NewDefaultLoggerFactory(),
	})
	if err != nil {
		return nil, fmt.Errorf("wan: %w", err)
	}
	if l.Loss > 0 {
		// The router calls its filters from its one goroutine, one packet at a time, in the
		// order the packets arrived: a seeded generator drops the same packets of the same
		// traffic. The mutex only keeps the race detector's word on it.
		var mu sync.Mutex
		rng := rand.New(rand.NewPCG(l.Seed, 0x5eed))
		r.AddChunkFilter(func(vnet.Chunk) bool {
			mu.Lock()
			defer mu.Unlock()
			return rng.Float64() >= l.Loss
		})
	}
	if err := r.Start(); err != nil {
		return nil, fmt.Errorf("wan: %w", err)
	}
	return &Network{link: l, router: r}, nil
}

// Link returns the network's link, with the defaults it runs with filled in.
func (n *Network) Link() Link { return n.link }

// Host adds a host with an address of its own on the network, and returns its network stack:
// hand it to client.WorkerConfig.Network, or use its ListenUDP and Dial directly. Its ingress is
// shaped; it reaches the other hosts at their 10.77.0.x addresses (and its own lo, 127.0.0.1,
// which goes nowhere else).
func (n *Network) Host() (transport.Net, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, errors.New("wan: network closed")
	}
	h, err := vnet.NewNet(&vnet.NetConfig{})
	if err != nil {
		return nil, fmt.Errorf("wan: %w", err)
	}
	if n.link.RateBitsPerS == 0 {
		err = n.router.AddNet(h)
	} else {
		// Between the router and the host: the packets the router delivers to this host queue
		// in the bucket, which hands them to the host at the rate.
		tbf := vnet.NewTBFQueue(int(n.link.RateBitsPerS), n.link.BurstBytes, int64(n.link.QueueBytes))
		var q *vnet.Queue
		if q, err = vnet.NewQueue(h, tbf); err != nil {
			return nil, fmt.Errorf("wan: %w", err)
		}
		n.queues = append(n.queues, q)
		err = n.router.AddNet(q)
	}
	if err != nil {
		return nil, fmt.Errorf("wan: add host: %w", err)
	}
	return h, nil
}

// Close stops the router and the hosts' ingresses: what was in flight is dropped, and the hosts'
// sockets stay open but receive nothing more. Close the connections on it first.
func (n *Network) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil
	}
	n.closed = true
	err := n.router.Stop()
	for _, q := range n.queues {
		err = errors.Join(err, q.Close())
	}
	return err
}
