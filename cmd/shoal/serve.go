package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func (m *Main) runServe(ctx context.Context, args []string) error {
	fs := m.newFlagSet("serve", "--data-dir DIR [--listen ADDR] [--job FILE] [flags]")
	dataDir := fs.String("data-dir", "", "`DIR` for the SQLite database and checkpoint blobs (required)")
	listen := fs.String("listen", "127.0.0.1:8470", "`ADDR` to serve HTTP and the workers' WebSockets on (with --acme-domain: default :443)")
	jobFile := fs.String("job", "", "job spec `FILE` to run when no job is queued or running; \"default\" runs the default job (what shoal train runs without --job)")
	var ice stringList
	fs.Var(&ice, "ice-server", "STUN/TURN `URL` handed to workers (repeatable); none means loopback-only ICE")
	tlsCert := fs.String("tls-cert", "", "TLS certificate `F` (browsers expose WebGPU only in a secure context)")
	tlsKey := fs.String("tls-key", "", "TLS key `F`")
	acmeDomain := fs.String("acme-domain", "", "serve HTTPS with a certificate for `NAME` from Let's Encrypt (ACME TLS-ALPN-01 on :443, or HTTP-01 with --acme-http), kept in DIR/acme; by using it you accept Let's Encrypt's terms")
	acmeEmail := fs.String("acme-email", "", "with --acme-domain: the `ADDRESS` Let's Encrypt may write to about the certificate")
	acmeHTTP := fs.String("acme-http", "", "with --acme-domain: also serve ACME HTTP-01 challenges on `ADDR` (e.g. :80), redirecting everything else there to HTTPS; needed when --listen is not on port 443")
	turnAddr := fs.String("turn", "", "run a TURN server on UDP `ADDR` (e.g. :3478) that only this coordinator's workers may use, each with a credential of its own, so that peers behind NATs relay their links through it rather than through the coordinator's WebSocket relay")
	turnIP := fs.String("turn-public-ip", "", "with --turn: the `IP` workers reach the TURN server at (default: --turn's host, which must then be an IP)")
	turnPorts := fs.String("turn-relay-ports", "", "with --turn: the UDP ports `MIN-MAX` relays are made on, for a firewall to open (default: the kernel's ephemeral ports)")
	relayOnly := fs.Bool("ice-relay-only", false, "workers connect to each other only through TURN (--turn or a turn: --ice-server): no volunteer learns another's address, at the cost of a relayed hop per link")
	relay := fs.Bool("relay", false, "move tensors through the coordinator instead of WebRTC data channels")
	minWorkers := fs.Int("min-workers", 1, "workers to wait for before the first plan")
	logJSON := fs.Bool("log-json", false, "log as JSON instead of text")
	ckInterval := fs.Duration("checkpoint-interval", 0, "also checkpoint when this long has passed since the last one (e.g. 10m)")
	keep := fs.Int("keep-checkpoints", 0, "keep the newest `N` complete checkpoints (0: keep all)")
	keepEvery := fs.Int("keep-every", 0, "with --keep-checkpoints: also keep every checkpoint whose step is a multiple of `M`")
	wasmDir := fs.String("wasm-dir", "", "`DIR` holding the browser worker (shoal.wasm and its wasm_exec.js) that the contributor page at / loads (default: the directory of this executable, where make build puts them)")
	adminToken := fs.String("admin-token", "", "`TOKEN` for /admin and the mutating API (default: $SHOAL_ADMIN_TOKEN, else one generated and stored in the data dir)")
	maxConns := fs.Int("max-conns", coordinator.DefaultMaxConns, "at most `N` open TCP connections in all; more are closed as they are accepted (0: no cap)")
	maxConnsPerIP := fs.Int("max-conns-per-ip", coordinator.DefaultMaxConnsPerIP,
		"at most `N` open TCP connections from one IPv4 address or IPv6 /64 (0: no cap); on loopback every local worker and browser tab shares 127.0.0.1")
	maxWorkers := fs.Int("max-workers", coordinator.DefaultMaxWorkers, "at most `N` workers connected at once; more are refused at their hello (Error busy) and retry later")
	maxWorkersPerIP := fs.Int("max-workers-per-ip", coordinator.DefaultMaxWorkersPerAddr, "at most `N` workers connected at once from one IP address")
	banAddrFor := fs.Duration("ban-address-for", 24*time.Hour, "after a ban, refuse new workers from the banned worker's IPv4 address or IPv6 /64 for this long (0: never)")
	auditMemory := bytesFlag(fs, "audit-memory", coordinator.DefaultAuditMemory, "at most `BYTES` of audit evidence held at once (2GiB, 512MB or plain bytes); further uploads wait for a verdict")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *dataDir == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--data-dir is required"))
	}
	if *maxConns < 0 || *maxConnsPerIP < 0 {
		return errors.New("--max-conns and --max-conns-per-ip take a count, or 0 for no cap")
	}
	if *maxWorkers < 1 || *maxWorkersPerIP < 1 {
		return errors.New("--max-workers and --max-workers-per-ip take a count of at least 1")
	}
	if *banAddrFor < 0 {
		return errors.New("--ban-address-for takes a duration, or 0 to ban no address")
	}
	if (*tlsCert == "") != (*tlsKey == "") {
		return errors.New("--tls-cert and --tls-key go together")
	}
	listenSet := false
	fs.Visit(func(f *flag.Flag) { listenSet = listenSet || f.Name == "listen" })
	if err := checkACME(*acmeDomain, *acmeEmail, *acmeHTTP, *tlsCert, listen, listenSet); err != nil {
		return err
	}
	turnCfg, loopbackTURN, err := turnConfig(*turnAddr, *turnIP, *turnPorts)
	if err != nil {
		return err
	}
	log := m.logger(*logJSON)
	if *wasmDir == "" {
		*wasmDir = exeDir()
	}
	cfg := coordinator.Config{DataDir: *dataDir, Relay: *relay, MinWorkers: *minWorkers, Logger: log, WasmDir: *wasmDir,
		CheckpointInterval: *ckInterval, KeepCheckpoints: *keep, KeepEvery: *keepEvery, AdminToken: *adminToken, KeepServing: true,
		MaxWorkers: *maxWorkers, MaxWorkersPerAddr: *maxWorkersPerIP, Recompute: recompute, AuditMemory: int64(*auditMemory),
		BanAddressFor: *banAddrFor, TURN: turnCfg, ICERelayOnly: *relayOnly,
		OnAdminToken: func(tok string) {
			fmt.Fprintf(m.Stderr, "admin token (shown once; stored in %s): %s\n", filepath.Join(*dataDir, "admin-token"), tok)
		}}
	// Without ICE servers, or with only a TURN server on loopback (tests), workers keep to
	// loopback candidates.
	if len(ice) == 0 && (turnCfg == nil || loopbackTURN) {
		cfg.Loopback = true
	}
	for _, u := range ice {
		cfg.ICEServers = append(cfg.ICEServers, proto.ICEServer{URLs: []string{u}})
	}
	if *jobFile != "" {
		spec := job.Default()
		if *jobFile != "default" {
			if spec, err = job.ReadFile(*jobFile); err != nil {
				return err
			}
		}
		if err := spec.CheckData(); err != nil {
			return fmt.Errorf("--job %s: %w", *jobFile, err)
		}
		cfg.Job = &spec
	}
	srv, err := coordinator.New(ctx, cfg)
	if err != nil {
		return err
	}
	defer srv.Close()
	tcp, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	ln := coordinator.LimitListener(tcp, coordinator.ConnLimits{Max: *maxConns, PerIP: *maxConnsPerIP, Logger: log})
	hs := coordinator.NewHTTPServer(srv.Handler(), coordinator.HTTPLimits{Logger: log})
	scheme, public := "http", ln.Addr().String()
	var challenges *http.Server
	switch {
	case *tlsCert != "":
		scheme = "https"
	case *acmeDomain != "":
		scheme = "https"
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		public = *acmeDomain
		if port != "443" {
			public = net.JoinHostPort(*acmeDomain, port)
		}
		mgr := acmeManager(*dataDir, *acmeDomain, *acmeEmail)
		hs.TLSConfig = mgr.TLSConfig()
		if *acmeHTTP != "" {
			if challenges, err = serveACMEHTTP(mgr, *acmeHTTP, log); err != nil {
				return err
			}
			defer challenges.Close()
		}
	}
	log.Info("coordinator listening", "url", fmt.Sprintf("%s://%s", scheme, ln.Addr()), "dashboard", fmt.Sprintf("%s://%s/admin/", scheme, public),
		"data_dir", *dataDir, "loopback_ice", cfg.Loopback, "max_conns", *maxConns, "max_conns_per_ip", *maxConnsPerIP, "acme_domain", *acmeDomain)
	if raw, _ := srv.WasmSize(); raw > 0 {
		log.Info("contributors join from a browser at the coordinator's address", "url", fmt.Sprintf("%s://%s/", scheme, public))
	} else {
		log.Warn("no browser worker to offer: the contributor page will say so", "wasm_dir", *wasmDir,
			"fix", "make build (bin/shoal.wasm and bin/wasm_exec.js), or --wasm-dir")
	}
	errc := make(chan error, 2)
	go func() {
		if scheme == "https" {
			// With ACME the certificate comes from hs.TLSConfig (GetCertificate), not files.
			errc <- hs.ServeTLS(ln, *tlsCert, *tlsKey)
		} else {
			errc <- hs.Serve(ln)
		}
	}()
	// SIGTERM (or Ctrl-C) stops the job at its next step boundary after a checkpoint of that
	// step, so that the next `shoal serve` resumes where this one stopped; a second signal, or
	// stopWait without a boundary, stops it at once (a restart then resumes from the newest
	// checkpoint).
	runCtx, hardStop := context.WithCancel(context.WithoutCancel(ctx))
	defer hardStop()
	go func() { errc <- srv.Run(runCtx) }()
	select {
	case <-ctx.Done():
		log.Info("stopping at the next step boundary, after a checkpoint of it (signal again to stop at once)", "wait", stopWait)
		again := make(chan os.Signal, 1)
		signal.Notify(again, os.Interrupt, syscall.SIGTERM)
		defer signal.Stop(again)
		srv.Stop()
		select {
		case err = <-errc:
		case <-again:
			log.Warn("stopping at once")
			hardStop()
		case <-time.After(stopWait):
			log.Warn("no step boundary within the wait: stopping at once", "wait", stopWait)
			hardStop()
		}
	case err = <-errc:
	}
	if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, http.ErrServerClosed) {
		log.Error("coordinator stopped", "err", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hs.Shutdown(sctx)
	return err
}

// stopWait bounds how long a stopping `shoal serve` waits for the job's step boundary and the
// checkpoint of it.
const stopWait = 2 * time.Minute

// exeDir is the directory of the running executable, where make build puts the browser worker
// beside it; "" when it cannot be told.
func exeDir() string {
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	if p, err := filepath.EvalSymlinks(exe); err == nil {
		exe = p
	}
	return filepath.Dir(exe)
}

func (m *Main) logger(asJSON bool) *slog.Logger {
	if asJSON {
		return slog.New(slog.NewJSONHandler(m.Stderr, nil))
	}
	return slog.New(slog.NewTextHandler(m.Stderr, nil))
}

// recompute is the coordinator's auditor: a shard's step recomputed on this machine's CPU, with
// the worker runtime's own code (the coordinator does not import client; this binary has both).
func recompute(ctx context.Context, r *audit.Replay) (*audit.Outcome, error) {
	return client.Recompute(ctx, model.Host{}, r)
}
