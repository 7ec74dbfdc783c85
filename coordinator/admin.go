package coordinator

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
	"github.com/shoal-ml/shoal/web"
)

// Admin access (issue 9): one admin token guards the dashboard and every mutating /api call. API
// clients send it as "Authorization: Bearer TOKEN"; a person signs in once on /admin/login and
// gets a session cookie (HttpOnly, SameSite=Strict). Worker endpoints (/ws, /blobs/, shard
// uploads) need no admin token — workers do not have it — and neither do the read-only views that
// hold nothing secret: GET /api/status, /api/steps, /api/jobs, /api/sample and /metrics — except
// that a private job shows in the first four only to the admin and to holders of its join token
// (status.go, issue 14). The checkpoint list (it names the shards' blobs) and the model download
// need the admin token.

const (
	sessionCookie = "shoal_admin"
	tokenFile     = "admin-token"
	// actionHeader must accompany a cookie-authenticated POST: a cross-site form cannot set it,
	// on top of SameSite=Strict.
	actionHeader = "X-Shoal-Action"
)

// adminAuth holds the token, the signed-in sessions, and who has been guessing.
type adminAuth struct {
	token    []byte
	mu       sync.Mutex
	sessions map[string]time.Time // session id → expiry
	guesses  signinGuard
}

// MinAdminTokenLen is the shortest admin token a coordinator accepts: anyone can reach it and
// guess, so a token must be out of reach of guessing even before signinGuard slows the guesses.
const MinAdminTokenLen = 16

// loadAdminToken returns the configured token, or the one stored in the data directory, or a new
// one (stored with mode 0600; generated says so, to print it once).
func loadAdminToken(dataDir, configured string) (token string, generated bool, err error) {
	given := func(t, from string) (string, bool, error) {
		if len(t) < MinAdminTokenLen {
			return "", false, fmt.Errorf("the admin token from %s has %d characters: use at least %d (or let the coordinator generate one)", from, len(t), MinAdminTokenLen)
		}
		return t, false, nil
	}
	if configured != "" {
		return given(configured, "--admin-token")
	}
	if v := os.Getenv("SHOAL_ADMIN_TOKEN"); v != "" {
		return given(v, "$SHOAL_ADMIN_TOKEN")
	}
	p := filepath.Join(dataDir, tokenFile)
	if b, err := os.ReadFile(p); err == nil {
		if t := strings.TrimSpace(string(b)); t != "" {
			return given(t, p)
		}
	}
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", false, err
	}
	t := hex.EncodeToString(b[:])
	if err := os.WriteFile(p, []byte(t+"\n"), 0o600); err != nil {
		return "", false, fmt.Errorf("store the admin token: %w", err)
	}
	return t, true, nil
}

// check compares a presented token with the admin token in constant time (hashing both first, so
// that not even the length leaks).
func (a *adminAuth) check(presented string) bool {
	x, y := sha256.Sum256([]byte(presented)), sha256.Sum256(a.token)
	return subtle.ConstantTimeCompare(x[:], y[:]) == 1
}

func (a *adminAuth) newSession() string {
	var b [24]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	a.mu.Lock()
	a.sessions[id] = time.Now().Add(7 * 24 * time.Hour)
	a.mu.Unlock()
	return id
}

func (a *adminAuth) session(r *http.Request) bool {
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, exp := range a.sessions {
		if subtle.ConstantTimeCompare([]byte(id), []byte(c.Value)) == 1 {
			return time.Now().Before(exp)
		}
	}
	return false
}

// tokenFrom checks a token presented by the client at remote (an http.Request's RemoteAddr):
// after signinFree wrong tokens from one address (an IPv6 /64 counts as one) it must wait before
// its next token is even compared, and the wait doubles with each wrong one; a right token clears
// its record. wait > 0 says the token was not compared.
func (a *adminAuth) tokenFrom(remote, presented string) (ok bool, wait time.Duration) {
	key := remoteKey(remote)
	if wait := a.guesses.wait(key, time.Now()); wait > 0 {
		return false, wait
	}
	if a.check(presented) {
		a.guesses.forget(key)
		return true, 0
	}
	a.guesses.wrong(key, time.Now())
	return false, 0
}

// authorized reports whether r carries the admin token or a session; a cookie-authenticated
// mutating request must also carry actionHeader.
func (a *adminAuth) authorized(r *http.Request) bool {
	if tok := bearerToken(r); tok != "" {
		ok, _ := a.tokenFrom(r.RemoteAddr, tok)
		return ok
	}
	if !a.session(r) {
		return false
	}
	return r.Method == http.MethodGet || r.Method == http.MethodHead || r.Header.Get(actionHeader) != ""
}

// requireAdmin wraps an API handler: 401 without the token, and nothing done.
func (s *Server) requireAdmin(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if tok := bearerToken(r); tok != "" {
			if wait := s.auth.guesses.wait(remoteKey(r.RemoteAddr), time.Now()); wait > 0 {
				tooManyGuesses(w, wait)
				return
			}
		}
		if !s.auth.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="shoal"`)
			writeJSONError(w, http.StatusUnauthorized, "admin token required: send Authorization: Bearer TOKEN, or sign in at /admin/login")
			return
		}
		h(w, r)
	}
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// handleLogin signs a person in with the token from a form and sets the session cookie.
func (s *Server) handleLogin(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Redirect(w, r, "/admin/login?error=wrong+token", http.StatusSeeOther)
		return
	}
	ok, wait := s.auth.tokenFrom(r.RemoteAddr, r.PostFormValue("token"))
	if wait > 0 {
		http.Redirect(w, r, "/admin/login?error=wait", http.StatusSeeOther)
		return
	}
	if !ok {
		http.Redirect(w, r, "/admin/login?error=wrong+token", http.StatusSeeOther)
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: s.auth.newSession(), Path: "/",
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: 7 * 24 * 3600})
	http.Redirect(w, r, "/admin/", http.StatusSeeOther)
}

// command is an admin action for the job loop, taken at the next step boundary.
type command struct {
	kind   string // "pause", "resume", "checkpoint", "drain"
	worker string // the worker to drain
	done   chan error
}

// act hands a command to the job loop and waits (briefly) for it to be accepted.
func (s *Server) act(kind string) http.HandlerFunc {
	return s.requireAdmin(func(w http.ResponseWriter, r *http.Request) {
		c := command{kind: kind, done: make(chan error, 1)}
		select {
		case s.commands <- c:
		case <-time.After(5 * time.Second):
			writeJSONError(w, http.StatusServiceUnavailable, "the job loop is busy; try again")
			return
		}
		select {
		case err := <-c.done:
			if err != nil {
				writeJSONError(w, http.StatusConflict, err.Error())
				return
			}
		case <-r.Context().Done():
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
}

// handlePeer drains or kicks a peer. Kick drops it at once (it may rejoin); drain asks it to
// leave for good at the job's next step boundary, after a checkpoint of that step when it holds a
// shard (jobRun.drain), so that the job resumes where it was; it then exits.
func (s *Server) handlePeer(w http.ResponseWriter, r *http.Request) {
	id, action := r.PathValue("id"), r.PathValue("action")
	var err error
	switch action {
	case "kick":
		s.hub.Drop(id, errors.New("kicked by the admin"))
	case "drain":
		if st := s.status.Load(); st != nil && st.Job != nil && (st.Job.State == "running" || st.Job.State == "paused") {
			select {
			case s.commands <- command{kind: "drain", worker: id, done: make(chan error, 1)}:
				// The job loop takes it at its step boundary (jobRun.drain records admin.drain).
				w.WriteHeader(http.StatusNoContent)
				return
			case <-time.After(5 * time.Second):
			}
		}
		// No job loop to take it: nothing to hand over.
		err = s.hub.Send(id, &proto.Bye{Reason: proto.ByeDrain})
	default:
		writeJSONError(w, http.StatusNotFound, "unknown peer action "+strconv.Quote(action)+": drain or kick")
		return
	}
	if err != nil {
		writeJSONError(w, http.StatusNotFound, err.Error())
		return
	}
	s.event(s.jobID(), "admin."+action, id, nil)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) jobID() uuid.UUID {
	if st := s.status.Load(); st != nil && st.Job != nil {
		if id, err := uuid.Parse(st.Job.ID); err == nil {
			return id
		}
	}
	return uuid.Nil
}

// handleSteps returns every recorded step from ?from=N: the dashboard's whole loss curve. A
// private job's steps go only to the admin and to holders of its join token (mayView).
func (s *Server) handleSteps(w http.ResponseWriter, r *http.Request) {
	from, _ := strconv.ParseInt(r.URL.Query().Get("from"), 10, 64)
	id := s.viewableJob(r)
	out := []StepStatus{}
	if id != uuid.Nil {
		steps, err := s.db.ListSteps(r.Context(), id, max(from, 0), -1)
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
		for _, st := range steps {
			out = append(out, StepStatus{Step: int(st.Step), Loss: st.Loss, Aux: st.Aux, ValLoss: st.ValLoss,
				TokensPerS: tokensPerS(st)})
		}
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// tokensPerS is a recorded step's throughput from its per-stage timings (the slowest stage's
// total time bounds the step).
func tokensPerS(st storage.Step) float64 {
	var timings map[string]proto.Timings
	if json.Unmarshal(st.Timings, &timings) != nil {
		return 0
	}
	var slowest int64
	for _, t := range timings {
		slowest = max(slowest, t.TotalNS)
	}
	if slowest == 0 {
		return 0
	}
	return float64(st.Tokens) / (float64(slowest) / 1e9)
}

// CheckpointStatus is one checkpoint as GET /api/checkpoints lists it.
type CheckpointStatus struct {
	ID        int64         `json:"id"`
	Job       string        `json:"job"`
	JobState  string        `json:"job_state"`
	Step      int64         `json:"step"`
	State     string        `json:"state"`
	Created   time.Time     `json:"created"`
	Completed *time.Time    `json:"completed,omitempty"`
	Shards    []ShardStatus `json:"shards"`
}

// ShardStatus is one shard file of a checkpoint.
type ShardStatus struct {
	Name   string `json:"name"`
	SHA256 string `json:"sha256"`
	Bytes  int64  `json:"bytes"`
}

// handleCheckpoints is GET /api/checkpoints: every job's checkpoints, finished jobs' included, so
// that any of them can be downloaded or exported by id (`shoal export --checkpoint ID`); ?job=ID
// lists one job's.
func (s *Server) handleCheckpoints(w http.ResponseWriter, r *http.Request) {
	only := uuid.Nil
	if v := r.URL.Query().Get("job"); v != "" {
		id, err := uuid.Parse(v)
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, "bad job id")
			return
		}
		only = id
	}
	out, err := listCheckpoints(r.Context(), s.db, only)
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// handleModel serves the whole model of a complete checkpoint, assembling it if need be.
func (s *Server) handleModel(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, "bad checkpoint id")
		return
	}
	ck, err := s.db.Checkpoint(r.Context(), id)
	if err != nil || ck.State != storage.CheckpointComplete {
		writeJSONError(w, http.StatusNotFound, fmt.Sprintf("no complete checkpoint %d", id))
		return
	}
	sha, err := s.assemble(r.Context(), ck)
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	f, err := s.blobs.Open(sha)
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	defer f.Close()
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="shoal-ckpt-%06d.safetensors"`, ck.Step))
	http.ServeContent(w, r, "model.safetensors", ck.CompletedAt, f)
}

// subscribe returns a channel that is signalled whenever the job loop publishes a new status.
func (s *Server) subscribe() (chan struct{}, func()) {
	c := make(chan struct{}, 1)
	s.subMu.Lock()
	s.subs[c] = struct{}{}
	s.subMu.Unlock()
	return c, func() {
		s.subMu.Lock()
		delete(s.subs, c)
		s.subMu.Unlock()
	}
}

func (s *Server) notify() {
	s.subMu.Lock()
	defer s.subMu.Unlock()
	for c := range s.subs {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// currentStatus is what GET /api/status and the stream send.
func (s *Server) currentStatus(ctx context.Context) Status {
	st := *s.status.Load()
	st.Peers = s.peerStatus()
	st.Events = s.recentEvents(ctx, &st)
	st.Now = time.Now().UTC()
	return st
}

// handleStream is GET /api/stream: Server-Sent Events, one status per change and at least every
// two seconds (the peers' heartbeats change without the job loop publishing).
func (s *Server) handleStream(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		writeJSONError(w, http.StatusInternalServerError, "streaming unsupported")
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	sig, cancel := s.subscribe()
	defer cancel()
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		t0 := time.Now()
		b, _ := json.Marshal(s.currentStatus(r.Context()))
		if _, err := fmt.Fprintf(w, "event: status\ndata: %s\n\n", b); err != nil {
			return
		}
		fl.Flush()
		cost := time.Since(t0)
		select {
		case <-r.Context().Done():
			return
		case <-sig:
		case <-tick.C:
		}
		// Changes are coalesced: at least streamMinGap between statuses, and at least
		// streamCostFactor times what the last one cost to build and send. A status carries every
		// peer (3.4 MB and 40 ms at 10,000 of them), and a job with churn changes many times a
		// second: sent at every change, one open dashboard took a third of the coordinator's CPU.
		wait := max(streamMinGap, streamCostFactor*cost) - time.Since(t0)
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-r.Context().Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

// The status stream's pacing (handleStream).
const (
	streamMinGap     = 100 * time.Millisecond
	streamCostFactor = 5
)

// JobListing is one job as GET /api/jobs lists it.
type JobListing struct {
	ID      string    `json:"id"`
	State   string    `json:"state"`
	Step    int64     `json:"step"`
	Steps   int       `json:"steps"`
	Private bool      `json:"private"`
	Created time.Time `json:"created"`
	Reason  string    `json:"reason,omitempty"`
}

func (s *Server) handleJobs(w http.ResponseWriter, r *http.Request) {
	jobs, err := s.db.ListJobs(r.Context())
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	// Private jobs are listed to the admin, and each to the holders of its join token.
	admin := s.auth.authorized(r)
	presented := presentedJoin(r)
	out := []JobListing{}
	for _, jb := range jobs {
		if jb.JoinToken != "" && !admin && !joinMatches(presented, jb.JoinToken) {
			continue
		}
		l := JobListing{ID: jb.ID.String(), State: string(jb.State), Step: jb.Step, Private: jb.JoinToken != "",
			Created: jb.CreatedAt, Reason: shownText(jb.Reason, maxShownText)}
		if spec, err := job.Parse(jb.Spec); err == nil {
			l.Steps = spec.Steps
		}
		out = append(out, l)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	json.NewEncoder(w).Encode(out)
}

// handleSubmit is POST /api/jobs: the body is a job spec (every field written out); ?private=1
// makes the job private and returns its join token and link. Jobs queue: one runs at a time.
func (s *Server) handleSubmit(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, err.Error())
		return
	}
	spec, err := job.Parse(body)
	if err == nil {
		err = spec.CheckData()
	}
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, err.Error())
		return
	}
	b, _ := json.Marshal(spec)
	tok := ""
	if v := r.URL.Query().Get("private"); v == "1" || v == "true" {
		var t [16]byte
		rand.Read(t[:])
		tok = hex.EncodeToString(t[:])
	}
	// Private from its first row: the job loop may take the job up at once.
	jb, err := s.db.CreateJobWithToken(r.Context(), b, tok)
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	resp := map[string]any{"id": jb.ID.String(), "state": jb.State}
	// A model too large for the workers there are is taken (more may join), with a warning: the
	// job would otherwise wait with no word of why until its turn came.
	offers := map[string]int64{}
	for _, w := range s.hub.Workers() {
		if w.Hello != nil {
			offers[w.ID] = plannedOffer(w.Hello, spec)
		}
	}
	warning := memoryFit(spec, offers)
	if warning != "" {
		resp["warning"] = warning
	}
	if tok != "" {
		scheme := "http"
		if r.TLS != nil {
			scheme = "https"
		}
		resp["join_token"] = tok
		resp["join_link"] = fmt.Sprintf("%s://%s/?join=%s", scheme, r.Host, tok)
		resp["worker_command"] = fmt.Sprintf("shoal worker --coordinator %s://%s --join %s", scheme, r.Host, tok)
	}
	detail := map[string]any{"private": resp["join_token"] != nil}
	if warning != "" {
		detail["warning"] = warning
	}
	s.event(jb.ID, "job.submitted", "", detail)
	select {
	case s.submitted <- struct{}{}:
	default:
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	json.NewEncoder(w).Encode(resp)
}

// handleCancel cancels a job: the running one at its next step boundary, a queued or paused one
// at once.
func (s *Server) handleCancel(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, "bad job id")
		return
	}
	if id == s.jobID() {
		s.act("cancel")(w, r)
		return
	}
	jb, err := s.db.Job(r.Context(), id)
	if err != nil {
		writeJSONError(w, http.StatusNotFound, err.Error())
		return
	}
	if _, err := s.db.SetJobState(r.Context(), id, storage.JobCancelled, "cancelled by the admin"); err != nil {
		writeJSONError(w, http.StatusConflict, fmt.Sprintf("job %s is %s: %v", id, jb.State, err))
		return
	}
	s.event(id, "admin.cancel", "", nil)
	w.WriteHeader(http.StatusNoContent)
}

// handleSample is GET /api/sample: text generated from the running job's newest complete
// checkpoint (cached per checkpoint), for the dashboard. A private job's sample goes only to the
// admin and to holders of its join token; others hear that no job runs.
func (s *Server) handleSample(w http.ResponseWriter, r *http.Request) {
	id := s.viewableJob(r)
	if id == uuid.Nil {
		writeJSONError(w, http.StatusNotFound, "no job")
		return
	}
	ck, err := s.db.LatestCheckpoint(r.Context(), id)
	if err != nil {
		writeJSONError(w, http.StatusNotFound, "no complete checkpoint yet")
		return
	}
	s.sampleMu.Lock()
	defer s.sampleMu.Unlock()
	if s.sample.checkpoint != ck.ID {
		sha, err := s.assemble(r.Context(), ck)
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
		b, err := s.readBlob(sha)
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
		m, err := model.LoadModelBytes(b)
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
		const prompt = "func "
		out, err := m.Sample(r.Context(), []byte(prompt), model.SampleOptions{Tokens: 200, Temperature: 0.8, TopK: 40, Seed: 1})
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
		s.sample.checkpoint, s.sample.step, s.sample.text = ck.ID, ck.Step, prompt+string(out)
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"checkpoint": s.sample.checkpoint, "step": s.sample.step, "text": s.sample.text})
}

// handleLoginPage shows the sign-in form; a failed attempt comes back with ?error and gets a fixed
// message (never the parameter's text, which anyone could put in a link).
func (s *Server) handleLoginPage(w http.ResponseWriter, r *http.Request) {
	msg := ""
	switch r.URL.Query().Get("error") {
	case "":
	case "wait":
		msg = "Too many wrong tokens from your address: wait a little, then try again."
	default:
		msg = "That token is wrong."
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", web.LoginCSP())
	w.Write(web.LoginPage(msg))
}

// adminPages serves the dashboard to a signed-in admin and sends anyone else to the sign-in form.
func (s *Server) adminPages() http.Handler {
	files := http.StripPrefix("/admin", http.FileServerFS(web.Admin()))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.auth.authorized(r) {
			http.Redirect(w, r, "/admin/login", http.StatusSeeOther)
			return
		}
		w.Header().Set("Content-Security-Policy", web.AdminCSP)
		files.ServeHTTP(w, r)
	})
}

// tooManyGuesses answers a client that must wait before its next token is compared.
func tooManyGuesses(w http.ResponseWriter, wait time.Duration) {
	secs := int(math.Ceil(wait.Seconds()))
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	writeJSONError(w, http.StatusTooManyRequests, fmt.Sprintf("too many wrong admin tokens from your address: wait %d s", secs))
}

// Sign-in back-off: what one address may guess.
const (
	// signinFree is the wrong tokens an address may present before it has to wait: room for a
	// person's typos.
	signinFree = 5
	// signinBase is the first wait; each wrong token after it doubles the wait, up to signinMax.
	signinBase = time.Second
	signinMax  = 10 * time.Minute
	// maxSigninAddrs bounds the addresses remembered: past it, those whose wait has passed are
	// forgotten first, then any. An attacker with that many addresses gains a few free guesses
	// for each, which the token's length (MinAdminTokenLen) makes worthless.
	maxSigninAddrs = 1 << 14
)

// signinGuard remembers wrong admin tokens per address.
type signinGuard struct {
	mu    sync.Mutex
	addrs map[string]*guesser
}

type guesser struct {
	wrong int
	until time.Time
}

// wait is how long key must wait before its next token is compared.
func (g *signinGuard) wait(key string, now time.Time) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	if st := g.addrs[key]; st != nil && now.Before(st.until) {
		return st.until.Sub(now)
	}
	return 0
}

func (g *signinGuard) wrong(key string, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.addrs == nil {
		g.addrs = map[string]*guesser{}
	}
	st := g.addrs[key]
	if st == nil {
		if len(g.addrs) >= maxSigninAddrs {
			g.evict(now)
		}
		st = &guesser{}
		g.addrs[key] = st
	}
	st.wrong++
	if n := st.wrong - signinFree; n > 0 {
		st.until = now.Add(min(signinBase<<min(n-1, 20), signinMax))
	}
}

func (g *signinGuard) forget(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.addrs, key)
}

// evict makes room for one more address.
func (g *signinGuard) evict(now time.Time) {
	for k, st := range g.addrs {
		if !now.Before(st.until) {
			delete(g.addrs, k)
		}
	}
	for k := range g.addrs {
		if len(g.addrs) < maxSigninAddrs {
			return
		}
		delete(g.addrs, k)
	}
}
