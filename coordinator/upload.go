package coordinator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// Checkpoint shards reach the coordinator from untrusted peers over the internet (issue 14). An
// upload is accepted only
//
//   - from the connected worker the job loop asked for that shard (uploadSlots), as its session
//     credential proves — checked before a byte of the body is read;
//   - if it is exactly the shard asked for: the header, read from the stream with its length
//     bounded first, names the job's model config and the checkpoint's step, and exactly the
//     shard's tensors with their shapes; the body is exactly as long as that header says; every
//     value is finite;
//   - while it keeps a minimum pace, with at most storage.StagingLimit uploads on disk at once.
//
// The bytes are hashed and written to a temporary file of the blob store as they arrive; only an
// upload that passed every check is committed under its hash and recorded. Anything refused
// leaves nothing on disk.

const (
	// stallHeartbeats is how many heartbeat timeouts an upload may go without progress before
	// it is cut (30 s with the hub's defaults): the hub's heartbeat is the coordinator's one
	// clock for "this peer went quiet", and a bulk transfer across a congested link gets more
	// slack than a control message.
	stallHeartbeats = 6
	// paceBytes is the progress that moves an upload's read deadline: a peer must send this much
	// per stall period (about 2 KiB/s by default), so that trickling a byte now and then does not
	// hold a staging place and a temporary file for ever.
	paceBytes = 64 << 10
)

// uploadStall is how long an upload may go without paceBytes of progress.
func (s *Server) uploadStall() time.Duration { return stallHeartbeats * s.hub.cfg.HeartbeatTimeout }

// handleUpload is POST /api/checkpoints/{id}/shards/{name}: a worker's shard of a checkpoint.
// The shard is stored and recorded; the checkpoint becomes complete in the same transaction as
// its last shard (storage.AddShard), and the job loop hears of it.
func (s *Server) handleUpload(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	name := r.PathValue("name")
	if err != nil || id <= 0 || name == "" || strings.ContainsAny(name, "/\\") {
		http.Error(w, "bad checkpoint id or shard name", http.StatusBadRequest)
		return
	}
	worker, ok := s.hub.SessionWorker(bearerToken(r))
	if !ok {
		w.Header().Set("WWW-Authenticate", `Bearer realm="shoal-worker"`)
		http.Error(w, "upload refused: send the session credential of a connected worker (Authorization: Bearer <the session of its welcome>)", http.StatusUnauthorized)
		return
	}
	slot, ok := s.slots.lookup(id, name)
	if !ok {
		http.Error(w, s.noSlot(ctx, id, name), http.StatusConflict)
		return
	}
	if slot.Worker != worker {
		s.log.Warn("upload of another worker's shard refused", "worker", worker, "checkpoint", id, "shard", name)
		http.Error(w, fmt.Sprintf("shard %s of checkpoint %d was asked of another worker", name, id), http.StatusForbidden)
		return
	}
	// One upload of a slot at a time: a worker cannot hold several staging places (of the few
	// there are for everyone) with copies of its own shard.
	if !s.slots.begin(id, name) {
		http.Error(w, fmt.Sprintf("shard %s of checkpoint %d is being uploaded already", name, id), http.StatusConflict)
		return
	}
	defer s.slots.end(id, name)
	l, err := s.uploadLayout(ctx, id, slot)
	if err != nil {
		http.Error(w, fmt.Sprintf("shard %s of checkpoint %d: %v", name, id, err), http.StatusInternalServerError)
		return
	}
	if r.ContentLength > l.maxFile() {
		http.Error(w, fmt.Sprintf("shard %s of checkpoint %d is at most %d bytes, this upload says %d", name, id, l.maxFile(), r.ContentLength), http.StatusRequestEntityTooLarge)
		return
	}
	blob, err := s.blobs.Stage(ctx)
	if err != nil {
		http.Error(w, "upload abandoned while waiting for its turn: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	defer blob.Abort()
	rc := http.NewResponseController(w)
	stall := s.uploadStall()
	body := &paceReader{r: http.MaxBytesReader(w, r.Body, l.maxFile()), rc: rc, stall: stall}
	body.extend()
	err = receiveShard(body, r.ContentLength, l, blob)
	// The body is read: a deadline left on the connection would fire in net/http's background
	// read and cancel the request's context while it is being recorded.
	rc.SetReadDeadline(time.Time{})
	rc.SetWriteDeadline(time.Now().Add(stall))
	if err == nil {
		s.uplinks.record(worker, body.n, body.took())
	}
	if err != nil {
		status := http.StatusBadRequest
		var ue *uploadError
		if errors.As(err, &ue) {
			status = ue.status
		}
		s.log.Warn("shard upload refused", "worker", worker, "checkpoint", id, "shard", name, "status", status, "err", err)
		http.Error(w, fmt.Sprintf("shard %s of checkpoint %d: %v", name, id, err), status)
		return
	}
	// From the blob's Commit to its record the collector must not remove it as one it freed
	// (Server.blobMu).
	s.blobMu.RLock()
	sha, size, err := blob.Commit()
	if err != nil {
		s.blobMu.RUnlock()
		http.Error(w, fmt.Sprintf("store shard %s of checkpoint %d: %v", name, id, err), http.StatusInternalServerError)
		return
	}
	completed, err := s.db.AddShard(ctx, id, name, sha, size)
	if err != nil {
		// Nothing records it — the checkpoint was deleted or discarded while the shard
		// streamed, say — so nothing would ever ask for it again: it goes at the next
		// collection unless another checkpoint references the same bytes.
		s.freeBlobs(sha)
	}
	s.blobMu.RUnlock()
	if err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, storage.ErrNotFound) || errors.Is(err, storage.ErrUnexpectedShard) || errors.Is(err, storage.ErrShardConflict) {
			status = http.StatusConflict
		}
		http.Error(w, fmt.Sprintf("record shard %s of checkpoint %d: %v", name, id, err), status)
		return
	}
	s.slots.landed(id, name)
	s.log.Debug("checkpoint shard stored", "checkpoint", id, "shard", name, "bytes", size, "complete", completed)
	if completed {
		select {
		case s.uploads <- id:
		default: // the loop also polls the store; a full channel loses nothing
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// bearerToken is the credential of "Authorization: Bearer <token>", or "".
func bearerToken(r *http.Request) string {
	h := r.Header.Get("Authorization")
	if len(h) < len("Bearer ") || !strings.EqualFold(h[:len("Bearer ")], "Bearer ") {
		return ""
	}
	return strings.TrimSpace(h[len("Bearer "):])
}

// noSlot says why no upload of a checkpoint's shard is expected.
func (s *Server) noSlot(ctx context.Context, id int64, name string) string {
	ck, err := s.db.Checkpoint(ctx, id)
	if err != nil {
		return fmt.Sprintf("no checkpoint %d is being taken", id)
	}
	for _, sh := range ck.Shards {
		if sh.Name == name && sh.Landed() {
			return fmt.Sprintf("shard %s of checkpoint %d already landed", name, id)
		}
	}
	return fmt.Sprintf("checkpoint %d expects no shard %s now: it was never asked for, or the checkpoint was abandoned (a replan, a coordinator restart)", id, name)
}

// uploadLayout is what the shard of slot must hold, from the job's model config and the plan.
func (s *Server) uploadLayout(ctx context.Context, id int64, slot uploadSlot) (*ckptLayout, error) {
	cfg := slot.Spec.Model
	var hosted map[expertKey]bool
	// Outer mode's replicas hold their experts (a plan of replicas has no expert hosts).
	if slot.Shard.Stage != nil && cfg.NumMoE() > 0 && slot.Prefixes == nil {
		var err error
		if hosted, err = s.hostedExperts(ctx, id, cfg); err != nil {
			return nil, err
		}
	}
	specs, err := shardSpecs(cfg, slot.Shard, func(blk, e int) bool { return hosted[expertKey{blk, e}] })
	if err != nil {
		return nil, err
	}
	if slot.Prefixes != nil {
		return newLayoutPrefixed(cfg, slot.Step, specs, slot.Prefixes), nil
	}
	return newLayout(cfg, slot.Step, specs), nil
}

// uploadError is a refused upload with the status that says why.
type uploadError struct {
	status int
	err    error
}

func (e *uploadError) Error() string { return e.err.Error() }
func (e *uploadError) Unwrap() error { return e.err }

// storeError marks a failure to write the blob store, as opposed to reading the peer.
type storeError struct{ err error }

func (e storeError) Error() string { return e.err.Error() }
func (e storeError) Unwrap() error { return e.err }

type storeWriter struct{ w io.Writer }

func (sw storeWriter) Write(p []byte) (int, error) {
	n, err := sw.w.Write(p)
	if err != nil {
		err = storeError{err}
	}
	return n, err
}

// receiveShard reads a shard of layout l from body (whose Content-Length is declared, or -1),
// copying every byte it reads to dst, and checks it as it streams: a header of bounded length
// that names exactly the layout's tensors and metadata, a body exactly as long as the header
// says, finite values. It reads no more than that header says the file holds (and, when no
// length was declared, one byte to see that the body ends there).
func receiveShard(body io.Reader, declared int64, l *ckptLayout, dst io.Writer) error {
	r := io.TeeReader(body, storeWriter{dst})
	h, err := safetensors.ReadHeader(r, l.header)
	if err != nil {
		return readFailure(err)
	}
	// Exactly the layout's tensors with its shapes, tiling the data: h.DataBytes() == l.data.
	if err := l.checkHeader(h, true); err != nil {
		return err
	}
	switch want := h.FileBytes(); {
	case declared > want:
		return &uploadError{http.StatusRequestEntityTooLarge, fmt.Errorf("body of %d bytes, its header describes %d", declared, want)}
	case declared >= 0 && declared < want:
		return fmt.Errorf("body of %d bytes, its header describes %d", declared, want)
	}
	if err := readTensors(r, h, nil); err != nil {
		return readFailure(err)
	}
	if declared < 0 {
		var one [1]byte
		if n, _ := io.ReadFull(r, one[:]); n > 0 {
			return &uploadError{http.StatusRequestEntityTooLarge, fmt.Errorf("body longer than the %d bytes its header describes", h.FileBytes())}
		}
	}
	return nil
}

// readFailure gives an error from reading an upload its status.
func readFailure(err error) error {
	var tooLarge *http.MaxBytesError
	var stored storeError
	switch {
	case errors.As(err, &stored):
		return &uploadError{http.StatusInternalServerError, fmt.Errorf("store: %w", err)}
	case errors.As(err, &tooLarge):
		return &uploadError{http.StatusRequestEntityTooLarge, err}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &uploadError{http.StatusRequestTimeout, fmt.Errorf("upload stalled: %w", err)}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return &uploadError{http.StatusBadRequest, fmt.Errorf("body ends early: %w", err)}
	}
	return err
}

// paceReader holds an upload to a minimum pace: the connection's read deadline is stall after
// the last time paceBytes more arrived, so a peer that stops, or trickles, is cut within stall,
// and one that keeps sending goes on however long its shard takes — until until, when set. It
// times the bytes it reads (the worker's uplink, uplinkMeter).
type paceReader struct {
	r     io.Reader
	rc    *http.ResponseController
	stall time.Duration
	until time.Time // zero: no limit but the pace
	since int       // bytes since the deadline last moved

	n           int64 // bytes read
	first, last time.Time
}

func (p *paceReader) extend() {
	// http.ErrNotSupported comes from writers without a connection (recorders in tests):
	// nothing to bound there.
	d := time.Now().Add(p.stall)
	if !p.until.IsZero() && p.until.Before(d) {
		d = p.until
	}
	p.rc.SetReadDeadline(d)
}

func (p *paceReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		now := time.Now()
		if p.n == 0 {
			p.first = now
		}
		p.n += int64(n)
		p.last = now
	}
	if p.since += n; p.since >= paceBytes {
		p.since = 0
		p.extend()
	}
	return n, err
}

// took is how long the bytes read took to arrive, from the first to the last.
func (p *paceReader) took() time.Duration { return p.last.Sub(p.first) }

// handleBlob serves a blob by its hash (workers restore from assembled checkpoints here). A blob
// holds whatever a peer managed to store, so it is served as an opaque download that no browser
// renders or runs, even if it is HTML.
func (s *Server) handleBlob(w http.ResponseWriter, r *http.Request) {
	sha := r.PathValue("sha")
	if !storage.ValidSHA256(sha) {
		http.Error(w, "malformed blob name: want 64 hex digits", http.StatusBadRequest)
		return
	}
	// Blobs are the job's checkpoints: a private job's model is not for outsiders, and a public
	// one's is had through the admin's export. A connected worker restores from them (its session
	// credential), the admin may fetch any.
	if !s.auth.authorized(r) {
		if _, ok := s.hub.SessionWorker(bearerToken(r)); !ok {
			http.Error(w, "a worker's session credential (or the admin token) is required", http.StatusUnauthorized)
			return
		}
	}
	f, err := s.blobs.Open(sha)
	if err != nil {
		http.Error(w, "no such blob", http.StatusNotFound)
		return
	}
	defer f.Close()
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Security-Policy", "sandbox; default-src 'none'")
	h.Set("Content-Disposition", `attachment; filename="`+sha+`.safetensors"`)
	h.Set("ETag", `"`+sha+`"`)
	http.ServeContent(countingWriter{w, &s.metrics.blobBytes}, r, sha, time.Time{}, f)
}

// countingWriter adds the body bytes written through it to n.
type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c countingWriter) Write(b []byte) (int, error) {
	k, err := c.ResponseWriter.Write(b)
	c.n.Add(int64(k))
	return k, err
}

// readBlob reads a whole blob the coordinator wrote itself (an assembled checkpoint) into memory.
func (s *Server) readBlob(sha string) ([]byte, error) {
	f, err := s.blobs.Open(sha)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}
