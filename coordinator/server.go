package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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
	// Hub settings; zero values take the hub's defaults.
	HeartbeatInterval time.Duration
	// AdminToken guards /admin and the mutating API. Empty: $SHOAL_ADMIN_TOKEN, else the token
	// stored in DataDir/admin-token, else a new one stored there (OnAdminToken hears of it).
	AdminToken string
	// OnAdminToken is told the token when it was just generated, to show it once.
	OnAdminToken func(token string)
	// KeepServing makes Run go on from job to job and wait for submissions (shoal serve);
	// without it Run returns when its job is done (shoal train --workers).
	KeepServing bool
	// WasmDir is where the browser worker is read from at start: shoal.wasm (GOOS=js
	// GOARCH=wasm ./wasm/worker) and the wasm_exec.js of the Go that built it. The contributor
	// page at / loads them on Start. Empty, or a directory without shoal.wasm: the page says that
	// no browser worker is on offer.
	WasmDir string
}

// Server is a coordinator: the HTTP API, the worker hub and the job loop over one data directory.
type Server struct {
	cfg     Config
	log     *slog.Logger
	db      *storage.DB
	blobs   *storage.BlobStore
	hub     *Hub
	metrics *metrics
	mux     *http.ServeMux
	contrib *contribSite
	status  atomic.Pointer[Status]

	// uploads reports checkpoints completed by the upload handler to the job loop.
	uploads chan int64
	// commands carries admin actions to the job loop; submitted wakes an idle loop.
	commands  chan command
	submitted chan struct{}
	auth      *adminAuth
	subMu     sync.Mutex
	subs      map[chan struct{}]struct{} // status stream subscribers
	// sample caches the dashboard's sample of the newest checkpoint.
	sampleMu sync.Mutex
	sample   struct {
		checkpoint, step int64
		text             string
	}
	// peerCounts is the job loop's per-peer counters, published with the status.
	peerCounts atomic.Pointer[map[string]peerCount]
	mu         sync.Mutex
	done       bool
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
	db, err := storage.Open(ctx, filepath.Join(cfg.DataDir, "shoal.db"), storage.Options{})
	if err != nil {
		return nil, err
	}
	blobs, err := storage.OpenBlobStore(filepath.Join(cfg.DataDir, "blobs"))
	if err != nil {
		db.Close()
		return nil, err
	}
	token, generated, err := loadAdminToken(cfg.DataDir, cfg.AdminToken)
	if err != nil {
		db.Close()
		return nil, err
	}
	contrib, err := loadContrib(cfg.WasmDir)
	if err != nil {
		db.Close()
		return nil, err
	}
	if generated && cfg.OnAdminToken != nil {
		cfg.OnAdminToken(token)
	}
	s := &Server{cfg: cfg, log: cfg.Logger, db: db, blobs: blobs, uploads: make(chan int64, 64), mux: http.NewServeMux(),
		commands: make(chan command, 16), submitted: make(chan struct{}, 1), auth: &adminAuth{token: []byte(token), sessions: map[string]time.Time{}},
		subs: map[chan struct{}]struct{}{}, contrib: contrib}
	if raw, gz := s.WasmSize(); raw > 0 {
		s.log.Info("browser worker on offer", "dir", cfg.WasmDir, "wasm_bytes", raw, "gzip_bytes", gz)
	}
	s.hub = NewHub(HubConfig{HeartbeatInterval: cfg.HeartbeatInterval, ICEServers: cfg.ICEServers, Loopback: cfg.Loopback, Logger: cfg.Logger})
	s.status.Store(&Status{Job: nil, Peers: []PeerStatus{}})
	s.metrics = newMetrics(s.hub.Workers)
	s.mux.Handle("/ws", s.hub)
	// /metrics holds no secrets (no worker names, no tokens): it stays open for scrapers.
	s.mux.Handle("GET /metrics", s.metrics.handler())
	s.mux.HandleFunc("GET /api/status", s.handleStatus)
	s.mux.HandleFunc("GET /blobs/{sha}", s.handleBlob)
	s.mux.HandleFunc("POST /api/checkpoints/{id}/shards/{name}", s.handleUpload)
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

// Handler is the coordinator's HTTP API.
func (s *Server) Handler() http.Handler { return s.mux }

// DB is the server's store (tests and tools read it).
func (s *Server) DB() *storage.DB { return s.db }

// Close stops the hub and closes the store.
func (s *Server) Close() error {
	s.hub.Close()
	return s.db.Close()
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	st := s.currentStatus(r.Context())
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(st)
}

func (s *Server) handleBlob(w http.ResponseWriter, r *http.Request) {
	sha := r.PathValue("sha")
	if !storage.ValidSHA256(sha) {
		http.Error(w, "malformed blob name: want 64 hex digits", http.StatusBadRequest)
		return
	}
	f, err := s.blobs.Open(sha)
	if err != nil {
		http.Error(w, "no such blob", http.StatusNotFound)
		return
	}
	defer f.Close()
	w.Header().Set("ETag", `"`+sha+`"`)
	http.ServeContent(w, r, sha, time.Time{}, f)
}

// maxShardBytes bounds one uploaded shard checkpoint.
const maxShardBytes = 8 << 30

// handleUpload stores a worker's shard checkpoint and records it; the checkpoint becomes complete
// in the same transaction as its last shard (storage.AddShard), and the job loop hears of it.
func (s *Server) handleUpload(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	name := r.PathValue("name")
	if err != nil || id <= 0 || name == "" || strings.ContainsAny(name, "/\\") {
		http.Error(w, "bad checkpoint id or shard name", http.StatusBadRequest)
		return
	}
	sha, size, err := s.blobs.Put(r.Context(), io.LimitReader(r.Body, maxShardBytes))
	if err != nil {
		http.Error(w, "store shard: "+err.Error(), http.StatusInternalServerError)
		return
	}
	if err := s.checkShard(sha, id); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	completed, err := s.db.AddShard(r.Context(), id, name, sha, size)
	if err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, storage.ErrNotFound) || errors.Is(err, storage.ErrUnexpectedShard) || errors.Is(err, storage.ErrShardConflict) {
			status = http.StatusConflict
		}
		http.Error(w, fmt.Sprintf("record shard %s of checkpoint %d: %v", name, id, err), status)
		return
	}
	s.log.Debug("checkpoint shard stored", "checkpoint", id, "shard", name, "bytes", size, "complete", completed)
	if completed {
		select {
		case s.uploads <- id:
		default: // the loop also polls the store; a full channel loses nothing
		}
	}
	w.WriteHeader(http.StatusNoContent)
}
