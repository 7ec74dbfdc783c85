package main

// What `shoal serve` needs to face the public: a certificate from Let's Encrypt (--acme-domain)
// and the embedded TURN server (--turn). docs/operating.md, "Running a public coordinator".

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/acme/autocert"

	"github.com/shoal-ml/shoal/coordinator"
)

// checkACME checks the --acme-* flags against the others; with --acme-domain and no --listen
// given, the coordinator listens on :443, where Let's Encrypt's TLS-ALPN-01 challenge arrives.
func checkACME(domain, email, httpAddr, tlsCert string, listen *string, listenSet bool) error {
	if domain == "" {
		if email != "" || httpAddr != "" {
			return errors.New("--acme-email and --acme-http go with --acme-domain")
		}
		return nil
	}
	if tlsCert != "" {
		return errors.New("--acme-domain and --tls-cert/--tls-key are two ways to get a certificate: give one")
	}
	if net.ParseIP(domain) != nil || strings.ContainsAny(domain, ":/ ") || !strings.Contains(domain, ".") {
		return fmt.Errorf("--acme-domain %q: Let's Encrypt certifies a DNS name such as shoal.example.org", domain)
	}
	if !listenSet {
		*listen = ":443"
	}
	_, port, err := net.SplitHostPort(*listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", *listen, err)
	}
	if port != "443" && httpAddr == "" {
		return fmt.Errorf("--acme-domain with --listen %s: Let's Encrypt validates on port 443 (TLS-ALPN-01) or 80 (HTTP-01); listen on :443, or add --acme-http :80", *listen)
	}
	return nil
}

// acmeManager gets and renews the certificate of domain alone from Let's Encrypt, keeping it and
// the account key in DATA/acme; a handshake for any other name is refused before Let's Encrypt
// is asked anything.
func acmeManager(dataDir, domain, email string) *autocert.Manager {
	return &autocert.Manager{
		Prompt:     autocert.AcceptTOS,
		Cache:      autocert.DirCache(filepath.Join(dataDir, "acme")),
		HostPolicy: autocert.HostWhitelist(domain),
		Email:      email,
	}
}

// serveACMEHTTP answers HTTP-01 challenges on addr and redirects every other request to HTTPS.
func serveACMEHTTP(m *autocert.Manager, addr string, log *slog.Logger) (*http.Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--acme-http: %w", err)
	}
	hs := &http.Server{Handler: m.HTTPHandler(nil), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 10 * time.Second, IdleTimeout: time.Minute, MaxHeaderBytes: 8 << 10}
	go func() {
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("ACME HTTP-01 server stopped", "addr", addr, "err", err)
		}
	}()
	log.Info("answering ACME HTTP-01 challenges", "addr", ln.Addr().String())
	return hs, nil
}

// turnConfig is the coordinator's TURN server of --turn, --turn-public-ip and
// --turn-relay-ports (nil without --turn), and whether it is on loopback (tests, a demo): then workers keep to loopback ICE.
func turnConfig(addr, publicIP, ports string) (*coordinator.TURNConfig, bool, error) {
	if addr == "" {
		if publicIP != "" || ports != "" {
			return nil, false, errors.New("--turn-public-ip and --turn-relay-ports go with --turn")
		}
		return nil, false, nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, false, fmt.Errorf("--turn %s: %w", addr, err)
	}
	cfg := &coordinator.TURNConfig{Listen: addr}
	if ports != "" {
		lo, hi, ok := strings.Cut(ports, "-")
		a, err1 := strconv.ParseUint(lo, 10, 16)
		b, err2 := strconv.ParseUint(hi, 10, 16)
		if !ok || err1 != nil || err2 != nil || a == 0 || b < a {
			return nil, false, fmt.Errorf("--turn-relay-ports %q: want MIN-MAX, such as 49152-65535", ports)
		}
		cfg.MinPort, cfg.MaxPort = uint16(a), uint16(b)
	}
	ip := net.ParseIP(host)
	if publicIP != "" {
		if cfg.PublicIP = net.ParseIP(publicIP); cfg.PublicIP == nil {
			return nil, false, fmt.Errorf("--turn-public-ip %q is not an IP address", publicIP)
		}
		ip = cfg.PublicIP
	}
	return cfg, ip != nil && ip.IsLoopback(), nil
}
