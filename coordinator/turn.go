package coordinator

// The coordinator's own TURN server (shoal serve --turn), so that workers that ICE cannot
// connect directly (symmetric NATs, shoal serve --ice-relay-only) relay their links through it
// over UDP rather than through the coordinator's WebSocket relay, which costs a TCP stream, a
// hub queue and a rate limiter per frame.
//
// Who may use it: only workers connected to this coordinator, each with a credential of its own
// that its Welcome carries (TURN REST style: username "expiry:workerID", password the base64
// HMAC-SHA1 of it under a secret made at start and never stored, so a restart voids every
// credential). Every authenticated request (allocate, refresh, permission, channel bind) checks
// the signature, the expiry and that the worker is still connected; when a worker leaves or is
// dropped (a ban drops it), its relays are closed at once and their allocations deleted. A
// worker holds at most MaxAllocations relays (one per neighbour link and address family in
// practice), only UDP ones, sending on at most BytesPerS together, and may open permissions only
// to this server's own relays and to the public addresses workers are connected from: never the
// coordinator host's private networks, nor any other host on the internet, so that admission to
// a public job does not make the coordinator an open UDP proxy (on a loopback server, loopback
// only). A worker whose UDP leaves from another address than its WebSocket still links through
// relays on both ends.

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/logging"
	"github.com/pion/turn/v5"
	"golang.org/x/time/rate"

	"github.com/shoal-ml/shoal/proto"
)

// TURNConfig is the coordinator's embedded TURN server.
type TURNConfig struct {
	// Listen is the UDP address it listens on (host:port; shoal serve --turn).
	Listen string
	// PublicIP is the address workers reach it at, which its relayed addresses carry too (shoal
	// serve --turn-public-ip). Nil: Listen's host, which must then be an IP other than 0.0.0.0 or ::.
	PublicIP net.IP
	// TTL is how long a credential stays valid after its Welcome (default DefaultTURNTTL). A
	// worker that leaves loses it at once; the TTL bounds a credential that outlives the
	// connection check, and a connection older than it gets no new relays until it reconnects
	// (its links fall back to the WebSocket relay).
	TTL time.Duration
	// MaxAllocations bounds the relays one worker holds at once (default DefaultTURNAllocations).
	MaxAllocations int
	// Lifetime is an allocation's lifetime without a refresh (default 10 minutes; a client may
	// ask for less, or up to an hour).
	Lifetime time.Duration
	// MinPort and MaxPort, when set, are the UDP ports relays are made on (shoal serve
	// --turn-relay-ports), for a firewall to open; 0: the kernel's ephemeral ports.
	MinPort, MaxPort uint16
	// BytesPerS bounds what one worker's relays send on, together, in bytes per second on
	// average (a burst of up to 16 MiB); packets past it are dropped, as a congested link drops
	// them.
	// 0 means DefaultTURNBytesPerS.
	BytesPerS float64
}

const (
	// DefaultTURNTTL is TURNConfig.TTL's default: longer than a volunteer's night, so that a
	// worker connected since the evening still relays in the morning.
	DefaultTURNTTL = 24 * time.Hour
	// DefaultTURNAllocations is TURNConfig.MaxAllocations's default: a stage has two neighbours,
	// an expert host or an outer-mode replica a few more, and an ICE agent allocates one relay
	// per link and address family; a plan change closes the old ones as it opens the new.
	DefaultTURNAllocations = 16
	// DefaultTURNBytesPerS is TURNConfig.BytesPerS's default: the hub's relay allowance.
	DefaultTURNBytesPerS = 256 << 20
)

// turnBurst is the burst of a worker's relay allowance at most: a few pipeline messages of the
// large model at once (a second's worth when the allowance is lower, and never under 64 KiB).
const turnBurst = 16 << 20

// turnRealm is the realm of every credential; clients echo what the server says.
const turnRealm = "shoal"

type turnServer struct {
	srv       *turn.Server
	url       string
	secret    []byte
	ttl       time.Duration
	maxAllocs int
	loopback  bool   // relays on a loopback address: permissions to loopback peers only
	public    net.IP // the relays' address: permissions to it are always allowed
	member    func(workerID string) bool
	fromPeer  func(netip.Addr) bool // a connected worker is at this address
	now       func() time.Time
	log       *slog.Logger

	bytesPerS float64

	mu     sync.Mutex
	relays map[string]map[*relayConn]struct{} // open relays by worker
	rates  map[string]*rate.Limiter           // what each worker with relays may send on

	relayed atomic.Int64 // bytes the relays sent on to peers
	refused atomic.Int64 // authenticated requests refused: bad, expired or revoked credentials
	dropped atomic.Int64 // packets dropped past a worker's BytesPerS
}

// startTURN starts the TURN server of cfg; member says whether a worker is connected, fromPeer
// whether a connected worker's remote address is an address's.
func startTURN(cfg TURNConfig, member func(string) bool, fromPeer func(netip.Addr) bool, log *slog.Logger) (*turnServer, error) {
	host, port, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("--turn %s: %w", cfg.Listen, err)
	}
	bind := net.ParseIP(host)
	if host != "" && bind == nil {
		return nil, fmt.Errorf("--turn %s: the host must be an IP address", cfg.Listen)
	}
	public := cfg.PublicIP
	if public == nil {
		if bind == nil || bind.IsUnspecified() {
			return nil, fmt.Errorf("--turn %s listens on every address: say which one workers reach it at (--turn-public-ip)", cfg.Listen)
		}
		public = bind
	}
	relayBind := "0.0.0.0"
	if bind != nil && !bind.IsUnspecified() {
		relayBind = bind.String()
	} else if public.To4() == nil {
		relayBind = "::"
	}
	t := &turnServer{secret: make([]byte, 32), ttl: cfg.TTL, maxAllocs: cfg.MaxAllocations, loopback: public.IsLoopback(), public: public,
		bytesPerS: cfg.BytesPerS, member: member, fromPeer: fromPeer, now: time.Now, log: log,
		relays: map[string]map[*relayConn]struct{}{}, rates: map[string]*rate.Limiter{}}
	if t.bytesPerS <= 0 {
		t.bytesPerS = DefaultTURNBytesPerS
	}
	var gen turn.RelayAddressGenerator = &turn.RelayAddressGeneratorStatic{RelayAddress: public, Address: relayBind}
	switch {
	case cfg.MinPort == 0 && cfg.MaxPort == 0:
	case cfg.MinPort == 0 || cfg.MaxPort < cfg.MinPort:
		return nil, fmt.Errorf("--turn-relay-ports %d-%d: want MIN-MAX with 0 < MIN <= MAX", cfg.MinPort, cfg.MaxPort)
	default:
		gen = &turn.RelayAddressGeneratorPortRange{RelayAddress: public, Address: relayBind, MinPort: cfg.MinPort, MaxPort: cfg.MaxPort}
	}
	if t.ttl <= 0 {
		t.ttl = DefaultTURNTTL
	}
	if t.maxAllocs <= 0 {
		t.maxAllocs = DefaultTURNAllocations
	}
	rand.Read(t.secret)
	pc, err := net.ListenPacket("udp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("--turn: %w", err)
	}
	if port == "0" { // tests: the port the kernel chose
		port = strconv.Itoa(pc.LocalAddr().(*net.UDPAddr).Port)
	}
	t.url = "turn:" + net.JoinHostPort(public.String(), port) + "?transport=udp"
	lf := logging.NewDefaultLoggerFactory()
	lf.DefaultLogLevel = logging.LogLevelDisabled
	t.srv, err = turn.NewServer(turn.ServerConfig{
		Realm:              turnRealm,
		AuthHandler:        t.auth,
		QuotaHandler:       t.quota,
		AllocationLifetime: cfg.Lifetime,
		LoggerFactory:      lf,
		PacketConnConfigs: []turn.PacketConnConfig{{
			PacketConn:            pc,
			RelayAddressGenerator: &relayGenerator{t: t, inner: gen},
			PermissionHandler:     t.permit,
		}},
	})
	if err != nil {
		pc.Close()
		return nil, fmt.Errorf("--turn: %w", err)
	}
	return t, nil
}

// URL is the server's address as workers are told it.
func (t *turnServer) URL() string { return t.url }

// credentials is worker id's TURN server and credential, valid for the TTL from now.
func (t *turnServer) credentials(id string) proto.ICEServer { return t.credentialsAt(id, t.now()) }

func (t *turnServer) credentialsAt(id string, now time.Time) proto.ICEServer {
	user := strconv.FormatInt(now.Add(t.ttl).Unix(), 10) + ":" + id
	return proto.ICEServer{URLs: []string{t.url}, Username: user, Credential: t.password(user)}
}

func (t *turnServer) password(user string) string {
	mac := hmac.New(sha1.New, t.secret)
	mac.Write([]byte(user))
	return base64.StdEncoding.EncodeToString(mac.Sum(nil))
}

// auth is pion's AuthHandler: the key of a credential this server made, unexpired, of a worker
// still connected. pion checks the request's MESSAGE-INTEGRITY with the key, so a credential
// that was not signed here fails there.
func (t *turnServer) auth(ra *turn.RequestAttributes) (string, []byte, bool) {
	id, err := t.check(ra.Username)
	if err != nil {
		t.refused.Add(1)
		t.log.Debug("TURN request refused", "from", ra.SrcAddr, "user", ra.Username, "err", err)
		return "", nil, false
	}
	return id, turn.GenerateAuthKey(ra.Username, ra.Realm, t.password(ra.Username)), true
}

// check parses a username "expiry:workerID" and says whether it may be used now.
func (t *turnServer) check(user string) (string, error) {
	exp, id, ok := strings.Cut(user, ":")
	if !ok || id == "" {
		return "", errors.New("not a credential of this server")
	}
	sec, err := strconv.ParseInt(exp, 10, 64)
	if err != nil {
		return "", errors.New("not a credential of this server")
	}
	if now := t.now(); now.Unix() > sec {
		return "", errors.New("expired")
	} else if time.Unix(sec, 0).Sub(now) > t.ttl+time.Minute {
		return "", errors.New("not a credential of this server") // this server never gives so long
	}
	if !t.member(id) {
		return "", errors.New("the worker is not connected")
	}
	return id, nil
}

// quota is pion's QuotaHandler: a new allocation while the worker holds fewer than maxAllocs.
func (t *turnServer) quota(id, _ string, _ net.Addr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.relays[id]) < t.maxAllocs
}

// permit is pion's PermissionHandler: which peers a relay may send to.
func (t *turnServer) permit(_ net.Addr, peer net.IP) bool {
	if t.loopback {
		return peer.IsLoopback()
	}
	if peer.Equal(t.public) {
		return true
	}
	a, ok := netip.AddrFromSlice(peer)
	return ok && peer.IsGlobalUnicast() && !peer.IsPrivate() && t.fromPeer(a.Unmap())
}

// revoke closes worker id's relays: pion deletes their allocations as their reads fail.
func (t *turnServer) revoke(id string) {
	t.mu.Lock()
	set := t.relays[id]
	delete(t.relays, id)
	delete(t.rates, id)
	t.mu.Unlock()
	for c := range set {
		c.close()
	}
}

// allocations is the number of open relays.
func (t *turnServer) allocations() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, s := range t.relays {
		n += len(s)
	}
	return n
}

func (t *turnServer) Close() error { return t.srv.Close() }

// relayGenerator makes the relays, on the public address (in the port range, if any), and
// keeps them by worker.
type relayGenerator struct {
	t     *turnServer
	inner turn.RelayAddressGenerator
}

func (g *relayGenerator) Validate() error { return g.inner.Validate() }

func (g *relayGenerator) AllocatePacketConn(c turn.AllocateListenerConfig) (net.PacketConn, net.Addr, error) {
	t := g.t
	// The quota was asked before; this holds it also if pion's order of calls changes.
	if !t.quota(c.UserID, "", nil) || !t.member(c.UserID) {
		return nil, nil, errors.New("TURN allocation refused")
	}
	pc, addr, err := g.inner.AllocatePacketConn(c)
	if err != nil {
		return nil, nil, err
	}
	rc := &relayConn{PacketConn: pc, t: t, id: c.UserID}
	t.mu.Lock()
	if t.relays[c.UserID] == nil {
		t.relays[c.UserID] = map[*relayConn]struct{}{}
		t.rates[c.UserID] = rate.NewLimiter(rate.Limit(t.bytesPerS), int(min(turnBurst, max(t.bytesPerS, 1<<16))))
	}
	t.relays[c.UserID][rc] = struct{}{}
	rc.rate = t.rates[c.UserID]
	t.mu.Unlock()
	// Asked again after the relay is in the set: a worker that left meanwhile either had it
	// closed by revoke, or is seen gone here (the hub forgets a worker before it revokes).
	if !t.member(c.UserID) {
		rc.close()
		return nil, nil, errors.New("TURN allocation refused")
	}
	return rc, addr, nil
}

var errNoTCPRelay = errors.New("this TURN server relays UDP only")

func (g *relayGenerator) AllocateListener(turn.AllocateListenerConfig) (net.Listener, net.Addr, error) {
	return nil, nil, errNoTCPRelay
}

func (g *relayGenerator) AllocateConn(turn.AllocateConnConfig) (net.Conn, error) {
	return nil, errNoTCPRelay
}

// relayConn is one relay's socket, counting what it sends on and leaving the worker's set when
// closed (by pion when the allocation ends, or by revoke).
type relayConn struct {
	net.PacketConn
	t    *turnServer
	id   string
	rate *rate.Limiter // the worker's, shared by its relays
	once sync.Once
}

func (c *relayConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if !c.rate.AllowN(time.Now(), len(p)) {
		c.t.dropped.Add(1)
		return len(p), nil // lost on the way, as UDP may be; the peers' SCTP resends
	}
	n, err := c.PacketConn.WriteTo(p, addr)
	c.t.relayed.Add(int64(n))
	return n, err
}

func (c *relayConn) Close() error {
	c.close()
	return nil
}

func (c *relayConn) close() {
	c.once.Do(func() {
		c.t.mu.Lock()
		if s := c.t.relays[c.id]; s != nil {
			delete(s, c)
			if len(s) == 0 {
				delete(c.t.relays, c.id)
				delete(c.t.rates, c.id)
			}
		}
		c.t.mu.Unlock()
		c.PacketConn.Close()
	})
}
