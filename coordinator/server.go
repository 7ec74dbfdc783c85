package coordinator

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// Config is how `shoal serve` (and `shoal train --workers`) runs a coordinator.
type Config struct {
	DataDir    string            // SQLite database and blob store
	Job        *job.Spec         // submitted at start when no job is queued or running
	ICEServers []proto.ICEServer // handed to workers; empty in loopback mode
	Loopback   bool              // workers gather ICE candidates on lo only (tests, the demo)
	Relay      bool              // tensors travel through the coordinator instead of WebRTC
	// TURN, when set, runs the coordinator's own TURN server (turn.go), which each worker's
	// Welcome names with a credential of its own.
	TURN *TURNConfig
	// ICERelayOnly has workers use relayed candidates only (shoal serve --ice-relay-only): every
	// link goes through TURN, and no volunteer learns another's address. It needs a TURN server
	// (TURN, or one in ICEServers).
	ICERelayOnly bool
	// MinWorkers is how many workers to wait for before the first plan (default: the pinned
	// plan's stages, or 1). Workers that join later become standbys or trigger a replan.
	MinWorkers int
	// Settle is how long to wait after the last join before planning, so that workers starting
	// together land in one plan (default 500 ms).
	Settle time.Duration
	// OutDir, when set, receives every complete checkpoint assembled into one whole-model file
	// (ckpt-NNNNNN.safetensors), as `shoal train --out` writes them.
	OutDir string
	// OnStep is called by the job loop after every step (progress output).
	OnStep func(local.Report)
	// OnPlan is called by the job loop when a plan is assigned: which peer holds what.
	OnPlan func(PlanStatus)
	// OnEvent is called with every event the job loop records (kind, worker, details as JSON):
	// joins, departures, abandoned steps, checkpoints.
	OnEvent func(kind, worker, detail string)
	// CheckpointInterval, when set, also takes a checkpoint after any step that ends this long
	// after the previous one, so slow jobs do not lose hours to a failure.
	CheckpointInterval time.Duration
	// KeepCheckpoints and KeepEvery are the retention: the newest KeepCheckpoints complete
	// checkpoints are kept, and every checkpoint whose step is a multiple of KeepEvery; the rest
	// are deleted and their blobs collected. KeepCheckpoints 0 keeps everything.
	KeepCheckpoints, KeepEvery int
	Logger                     *slog.Logger
	// Hub settings; zero values take the hub's defaults (HubConfig).
	HeartbeatInterval, HeartbeatTimeout, QuickTimeout time.Duration
	// AdminToken guards /admin and the mutating API. Empty: $SHOAL_ADMIN_TOKEN, else the token
	// stored in DataDir/admin-token, else a new one stored there (OnAdminToken hears of it).
	AdminToken string
	// OnAdminToken is told the token when it was just generated, to show it once.
	OnAdminToken func(token string)
	// KeepServing makes Run go on from job to job and wait for submissions (shoal serve);
	// without it Run returns when its job is done (shoal train --workers).
	KeepServing bool
	// JoinReplanGap is the least time between two replans that take in workers that joined
	// (default 10 s): a wave of joins costs one checkpoint and one replan.
	JoinReplanGap time.Duration
	// MaxWorkers and MaxWorkersPerAddr cap the connected workers (HubConfig's defaults).
	MaxWorkers, MaxWorkersPerAddr int
	// HelloTimeout bounds a new WebSocket's wait for its hello (HubConfig's default).
	HelloTimeout time.Duration
	// BanAddressFor is how long a ban also refuses new workers from the banned worker's address
	// (an IPv4 address, an IPv6 /64: shoal serve --ban-address-for); 0 refuses none. Workers
	// rejoining with their session credential are not refused: they were there before the ban.
	BanAddressFor time.Duration
	// WorkerRetention is how long the rows of a worker that never took part in a step (its
	// worker row, events and session credential) outlive its departure; 0 means
	// DefaultWorkerRetention.
	WorkerRetention time.Duration
	// WasmDir is where the browser worker is read from at start: shoal.wasm (GOOS=js
	// GOARCH=wasm ./wasm/worker) and the wasm_exec.js of the Go that built it. The contributor
	// page at / loads them on Start. Empty, or a directory without shoal.wasm: the page says that
	// no browser worker is on offer.
	WasmDir string
	// Recompute recomputes an audited shard's step on the coordinator's cores (client.Recompute;
	// cmd/shoal wires it in, the coordinator does not import the worker runtime). Nil: jobs run
	// without verification, whatever their audit_rate, and say so.
	Recompute audit.Recomputer
	// AuditMemory bounds the audit evidence the coordinator holds at once, in bytes, as the
	// shards' bundles are sized (evidenceBytes): an upload past it waits, unread, until a verdict
	// frees room. One bundle larger than the bound is still taken, alone. 0 means
	// DefaultAuditMemory.
	AuditMemory int64
}

// DefaultAuditMemory is Config.AuditMemory's default. A bundle is about 24 bytes per parameter
// of its shard, so this holds a few of the default model's and one of the large model's at a
// time; before the bound, six evidence bundles of the large model and their recomputation took a
// coordinator past 6 GB.
const DefaultAuditMemory = 2 << 30

// Server is a coordinator: the HTTP API, the worker hub and the job loop over one data directory.
type Server struct {
	cfg   Config
	log   *slog.Logger
	db    *storage.DB
	blobs *storage.BlobStore
	hub   *Hub
	// quicLinks is what the planner's link bound believes of a worker (dataPlaneBytesPerS):
	// Hub.QUICLinks, or a planning test's stand-in for workers it never connects.
	quicLinks func(id string) bool
	metrics   *metrics
	mux       *http.ServeMux
	contrib   *contribSite
	status    atomic.Pointer[Status]

	// uploads reports checkpoints completed by the upload handler to the job loop.
	uploads chan int64
	// slots are the checkpoint shards the job loop asked for: who may upload each, and what.
	slots uploadSlots
	// freed are the blobs this coordinator stopped needing — the shards of the checkpoints it
	// deleted, the assembled files it dropped, uploads it could not record — which the next
	// collection removes at once unless something references them again (freeBlobs,
	// collectBlobs). Any other unreferenced blob waits an hour: nothing says where it came from.
	freedMu sync.Mutex
	freed   map[string]bool
	// blobMu orders that removal against the uploads, which commit a blob before a row
	// references it: an upload holds it for reading from its Commit to its AddShard, the
	// collector for writing while it reads the references and removes. Training is bitwise
	// deterministic, so a shard of a checkpoint of the same step again has a freed blob's very
	// bytes, and its Commit renames it over that blob: unordered, the collector could remove it
	// between the rename and the record, and leave a complete checkpoint without its file.
	blobMu sync.RWMutex
	// auditReg holds the audits waiting for evidence; auditResults carries verdicts to the job
	// loop; recomputeMu keeps to one recomputation at a time.
	auditReg     auditRegistry
	auditResults chan auditResult
	recomputeMu  sync.Mutex
	// evidence is the room for audit evidence held (Config.AuditMemory).
	evidence *byteBudget
	// uplinks is what the uploads received measured of each worker's uplink (evidenceWait).
	uplinks uplinkMeter
	// commands carries admin actions to the job loop; submitted wakes an idle loop.
	commands  chan command
	submitted chan struct{}
	// stopping is closed by Stop: the job loop stops at its next step boundary, after a
	// checkpoint of that step.
	stopping chan struct{}
	stopOnce sync.Once
	auth     *adminAuth
	subMu    sync.Mutex
	subs     map[chan struct{}]struct{} // status stream subscribers
	// sample caches the dashboard's sample of the newest checkpoint.
	sampleMu sync.Mutex
	sample   struct {
		checkpoint, step int64
		text             string
	}
	// peerCounts is the job loop's per-peer counters, published with the status.
	peerCounts atomic.Pointer[map[string]peerCount]
	// joinToken is the running job's join token ("" public; nil no job): the hub refuses a
	// private job's outsiders at their hello.
	joinToken atomic.Pointer[string]
	// bans are the identities banned from the running job and the addresses banned for now,
	// which the hub refuses at their hello.
	bans banList
	// tookPart are the workers recorded as having taken part in a step (markTookPart); only the
	// job loop touches it.
	tookPart map[string]bool
	// joined remembers the peers that joined lately, so that a worker banned after it left (an
	// abandoned audit) is banned with its identity and address; only the job loop touches it.
	joined map[string]*peer
	mu     sync.Mutex
	done   bool
	// rec writes worker rows and events off the job loop (recorder.go).
	rec *recorder
	// lock is held on the data directory from New to Close.
	lock *dirLock
	// turn is the embedded TURN server (Config.TURN); nil when there is none.
	turn *turnServer
}

// New opens the data directory and builds the server; Run starts the job loop.
func New(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.DataDir == "" {
		return nil, errors.New("coordinator: a data directory is required (--data-dir)")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Settle == 0 {
		cfg.Settle = 500 * time.Millisecond
	}
	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return nil, err
	}
	lock, err := lockDataDir(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	db, err := storage.Open(ctx, filepath.Join(cfg.DataDir, "shoal.db"), storage.Options{})
	if err != nil {
		lock.release()
		return nil, err
	}
	fail := func(err error) (*Server, error) {
		db.Close()
		lock.release()
		return nil, err
	}
	blobs, err := storage.OpenBlobStore(filepath.Join(cfg.DataDir, "blobs"))
	if err != nil {
		return fail(err)
	}
	token, generated, err := loadAdminToken(cfg.DataDir, cfg.AdminToken)
	if err != nil {
		return fail(err)
	}
	contrib, err := loadContrib(cfg.WasmDir)
	if err != nil {
		return fail(err)
	}
	if generated && cfg.OnAdminToken != nil {
		cfg.OnAdminToken(token)
	}
	s := &Server{cfg: cfg, log: cfg.Logger, db: db, blobs: blobs, uploads: make(chan int64, 64), auditResults: make(chan auditResult, 16), mux: http.NewServeMux(),
		commands: make(chan command, 16), submitted: make(chan struct{}, 1), stopping: make(chan struct{}), auth: &adminAuth{token: []byte(token), sessions: map[string]time.Time{}},
		subs: map[chan struct{}]struct{}{}, contrib: contrib, lock: lock}
	s.rec = newRecorder(db, s.log)
	if err := s.loadAddrBans(ctx); err != nil {
		db.Close()
		return nil, err
	}
	s.evidence = newByteBudget(cmp.Or(cfg.AuditMemory, DefaultAuditMemory))
	if raw, gz := s.WasmSize(); raw > 0 {
		s.log.Info("browser worker on offer", "dir", cfg.WasmDir, "wasm_bytes", raw, "gzip_bytes", gz)
	}
	hc := HubConfig{HeartbeatInterval: cfg.HeartbeatInterval, HeartbeatTimeout: cfg.HeartbeatTimeout, QuickTimeout: cfg.QuickTimeout, ICEServers: cfg.ICEServers, Loopback: cfg.Loopback, ICERelayOnly: cfg.ICERelayOnly, Logger: cfg.Logger,
		Admit: s.admitWorker, Sessions: db, MaxWorkers: cfg.MaxWorkers, MaxWorkersPerAddr: cfg.MaxWorkersPerAddr, HelloTimeout: cfg.HelloTimeout}
	// The TURN server answers packets from its start on, before the hub it asks exists (a stray
	// packet, or a client of an earlier server on the same port): it sees the hub once it is made.
	var hubOf atomic.Pointer[Hub]
	if cfg.TURN != nil {
		connected := func(id string) bool { h := hubOf.Load(); return h != nil && h.Connected(id) }
		connectedFrom := func(ip netip.Addr) bool { h := hubOf.Load(); return h != nil && h.ConnectedFrom(ip) }
		if s.turn, err = startTURN(*cfg.TURN, connected, connectedFrom, s.log); err != nil {
			db.Close()
			lock.release()
			return nil, err
		}
		hc.Credentials, hc.Departed = s.turn.credentials, s.turn.revoke
		s.log.Info("TURN server for the workers", "url", s.turn.URL(), "relay_only", cfg.ICERelayOnly)
	}
	if cfg.ICERelayOnly && cfg.TURN == nil && !hasTURN(cfg.ICEServers) {
		db.Close()
		lock.release()
		return nil, errors.New("coordinator: relay-only ICE needs a TURN server (--turn, or a turn: --ice-server)")
	}
	s.hub = NewHub(hc)
	s.quicLinks = s.hub.QUICLinks
	hubOf.Store(s.hub)
	s.status.Store(&Status{Job: nil, Peers: []PeerStatus{}})
	s.metrics = newMetrics(s.hub.Workers)
	if s.turn != nil {
		s.metrics.addTURN(s.turn)
	}
	s.mux.Handle("/ws", s.hub)
	// /metrics holds no secrets (no worker names, no tokens): it stays open for scrapers, but
	// for a private job's figures (guardMetrics).
	s.mux.Handle("GET /metrics", s.guardMetrics(s.metrics.handler()))
	s.mux.HandleFunc("GET /api/status", s.handleStatus)
	s.mux.HandleFunc("GET /blobs/{sha}", s.handleBlob)
	s.mux.HandleFunc("POST /api/checkpoints/{id}/shards/{name}", s.handleUpload)
	s.mux.HandleFunc("POST /api/audits/{id}", s.handleAudit)
	s.mux.HandleFunc("GET /api/steps", s.handleSteps)
	s.mux.HandleFunc("GET /api/checkpoints", s.requireAdmin(s.handleCheckpoints))
	s.mux.HandleFunc("GET /api/checkpoints/{id}/model", s.requireAdmin(s.handleModel))
	s.mux.HandleFunc("GET /api/stream", s.requireAdmin(s.handleStream))
	s.mux.HandleFunc("POST /api/job/pause", s.act("pause"))
	s.mux.HandleFunc("POST /api/job/resume", s.act("resume"))
	s.mux.HandleFunc("POST /api/checkpoint", s.act("checkpoint"))
	s.mux.HandleFunc("GET /api/jobs", s.handleJobs)
	s.mux.HandleFunc("POST /api/jobs", s.requireAdmin(s.handleSubmit))
	s.mux.HandleFunc("POST /api/jobs/{id}/cancel", s.requireAdmin(s.handleCancel))
	s.mux.HandleFunc("GET /api/sample", s.handleSample)
	s.mux.HandleFunc("POST /api/peers/{id}/{action}", s.requireAdmin(s.handlePeer))
	s.mux.HandleFunc("POST /admin/login", s.handleLogin)
	s.mux.HandleFunc("GET /admin/login", s.handleLoginPage)
	s.mux.Handle("GET /admin", http.RedirectHandler("/admin/", http.StatusMovedPermanently))
	s.mux.Handle("GET /admin/", s.adminPages())
	s.contrib.register(s.mux)
	return s, nil
}

// The store keeps the workers' session credentials (as digests) across coordinator restarts.
var _ SessionStore = (*storage.DB)(nil)

// admitWorker is the hub's admission check: a banned identity or, unless it rejoins, a worker
// from a banned address is refused; while a private job runs, only workers holding its join
// token may join (compared in constant time).
func (s *Server) admitWorker(h *proto.Hello, addr string, rejoin bool) *proto.Error {
	if perr := s.bans.admit(proto.Fingerprint(h.SigningKey), addr, rejoin, time.Now()); perr != nil {
		return perr
	}
	if tok := s.joinToken.Load(); tok == nil || *tok == "" || joinMatches(h.JoinToken, *tok) {
		return nil
	}
	return &proto.Error{Code: proto.ErrCodeForbidden, Message: "this job is private: join with its link"}
}

// banList is what the hub must refuse at a hello, shared between the job loop (which bans) and
// the hub's connections (which are refused).
type banList struct {
	mu    sync.Mutex
	ids   map[string]bool      // identities banned from the running job
	addrs map[string]time.Time // banned addresses, each until when
}

// maxBannedAddrs bounds the addresses remembered; past it the one whose ban ends first goes. A
// sybil attack banned from that many addresses has cost its maker that many bans.
const maxBannedAddrs = 1 << 16

func (b *banList) admit(identity, addr string, rejoin bool, now time.Time) *proto.Error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if identity != "" && b.ids[identity] {
		return &proto.Error{Code: proto.ErrCodeBanned, Message: "banned from this job: this volunteer's identity (" + identity + ") was caught with false results"}
	}
	if until, ok := b.addrs[addr]; ok && !rejoin {
		if now.Before(until) {
			return &proto.Error{Code: proto.ErrCodeBanned, Message: "a worker from this address was banned; new workers from it are refused until " + until.UTC().Format(time.RFC3339)}
		}
		delete(b.addrs, addr)
	}
	return nil
}

// setJob replaces the banned identities with those of the job starting (nil: none runs).
func (b *banList) setJob(ids map[string]bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ids = ids
}

// ban adds a ban: identity ("" none) from the running job, and addr ("" none) until until.
func (b *banList) ban(identity, addr string, until time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if identity != "" {
		if b.ids == nil {
			b.ids = map[string]bool{}
		}
		b.ids[identity] = true
	}
	if addr == "" || !until.After(time.Now()) {
		return
	}
	if b.addrs == nil {
		b.addrs = map[string]time.Time{}
	}
	if _, ok := b.addrs[addr]; !ok && len(b.addrs) >= maxBannedAddrs {
		first := ""
		for a, t := range b.addrs {
			if first == "" || t.Before(b.addrs[first]) {
				first = a
			}
		}
		delete(b.addrs, first)
	}
	if until.After(b.addrs[addr]) {
		b.addrs[addr] = until
	}
}

// guardMetrics keeps /metrics open for scrapers while the job shown is public, and asks for the
// admin token (Prometheus' bearer_token) while it is private: its loss and progress are the
// private job's.
func (s *Server) guardMetrics(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The status's job, not only a running one: a private job's figures stay private after
		// it ends, as its status does (statusFor).
		if st := s.status.Load(); st.joinToken != "" && !s.auth.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="shoal"`)
			http.Error(w, "the running job is private: /metrics needs the admin token", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (c Config) joinReplanGap() time.Duration {
	if c.JoinReplanGap > 0 {
		return c.JoinReplanGap
	}
	return 10 * time.Second
}

// Handler is the coordinator's HTTP API.
func (s *Server) Handler() http.Handler { return s.mux }

// DB is the server's store (tests and tools read it).
func (s *Server) DB() *storage.DB { return s.db }

// Stop asks Run to return at the job's next step boundary (outer mode: round boundary), after a
// checkpoint of that step, so that a coordinator started again on the same data directory
// resumes where this one stopped rather than at its last periodic checkpoint. Run returns nil
// then; cancelling its context stops it at once instead, which is what a caller does when the
// step or the checkpoint takes longer than it will wait.
func (s *Server) Stop() {
	s.stopOnce.Do(func() { close(s.stopping) })
}

// Close stops the hub, closes the store and releases the data directory.
func (s *Server) Close() error {
	s.hub.Close()
	if s.turn != nil {
		s.turn.Close()
	}
	s.rec.stop()
	err := s.db.Close()
	s.lock.release()
	return err
}

// handleStatus is GET /api/status: the status r may see (statusFor). It depends on who asks, so
// no cache keeps it.
func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	st := s.statusFor(r)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(st)
}

// hasTURN reports whether one of servers is a TURN server.
func hasTURN(servers []proto.ICEServer) bool {
	for _, s := range servers {
		for _, u := range s.URLs {
			if strings.HasPrefix(u, "turn:") || strings.HasPrefix(u, "turns:") {
				return true
			}
		}
	}
	return false
}

// TURNRelayedBytes is what the embedded TURN server's relays sent on to peers (0 without one).
func (s *Server) TURNRelayedBytes() int64 {
	if s.turn == nil {
		return 0
	}
	return s.turn.relayed.Load()
}

// isStopping reports whether the coordinator is stopping (Stop was called).
func (s *Server) isStopping() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}
