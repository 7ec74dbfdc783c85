package client

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// tinyBlob is an honest restore blob of the tiny model after step step, with moments that differ
// from the parameters, and its sha256.
func tinyBlob(t *testing.T, step int) (*model.Model, []byte, string) {
	t.Helper()
	m, err := model.NewModel(model.TinyConfig())
	if err != nil {
		t.Fatal(err)
	}
	m.Init(3)
	for i, p := range m.P.Tensors {
		for j := range p.Data {
			m.Opt.M.Tensors[i].Data[j] = float32(j%7) * 0.25
			m.Opt.V.Tensors[i].Data[j] = float32(j%5) * 0.5
		}
	}
	var b bytes.Buffer
	if err := safetensors.Write(&b, model.CheckpointTensors(m.P, m.Opt), model.CheckpointMeta(m.Cfg, step)); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b.Bytes())
	return m, b.Bytes(), hex.EncodeToString(sum[:])
}

// restoreSession is a session of a worker of coordinator url, as far as a restore needs one.
func restoreSession(t *testing.T, url string, stall time.Duration) *session {
	t.Helper()
	hc, err := coordinatorHTTP(url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &session{cfg: WorkerConfig{Coordinator: url, StallTimeout: stall}, welcome: &proto.Welcome{Session: "s"},
		log: slog.New(slog.DiscardHandler), http: hc, spills: &spillSlots{}}
}

// TestRestoreReadsOnlyItsShard: a stage of blocks [1, 2) of the tiny model restores its
// parameters and moments from the whole model's blob, bit for bit.
func TestRestoreReadsOnlyItsShard(t *testing.T) {
	m, blob, sha := tinyBlob(t, 6)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(blob) }))
	defer srv.Close()
	spec := job.Default()
	spec.Model = m.Cfg
	sh, err := model.NewStageShard(m.Cfg, 1, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := restoreSession(t, srv.URL, time.Minute)
	if err := s.restore(context.Background(), spec, sh, &proto.CheckpointRef{Step: 6, Blobs: []string{sha}}, nil); err != nil {
		t.Fatal(err)
	}
	sameRestored(t, m, sh, nil)
}

// TestRestoreFromShards: a stage restores from the checkpoint's shards that hold its tensors — here
// blocks [1, 3) of the tiny model from two shards cut otherwise ([0, 2) and [2, 4)), bit for bit —
// and a coordinator that lists more than the stage reads is refused before or as it asks: a blob
// that adds no tensor the blobs before it did not, blobs that together hold more than a checkpoint
// of the job, or more blobs than the stage reads tensors.
func TestRestoreFromShards(t *testing.T) {
	m, _, _ := tinyBlob(t, 6)
	if m.Cfg.NLayer < 4 {
		t.Skipf("the tiny model has %d blocks, this test cuts it in four", m.Cfg.NLayer)
	}
	blobs := map[string][]byte{}
	// shard is a blob of blocks [lo, hi)'s parameters and moments, as a stage uploads it.
	shard := func(lo, hi int) string {
		sh, err := model.NewStageShard(m.Cfg, lo, hi, nil)
		if err != nil {
			t.Fatal(err)
		}
		index := map[string]int{}
		for i, p := range m.P.Tensors {
			index[p.Name] = i
		}
		for i, p := range sh.P.Tensors {
			j := index[p.Name]
			copy(p.Data, m.P.Tensors[j].Data)
			copy(sh.Opt.M.Tensors[i].Data, m.Opt.M.Tensors[j].Data)
			copy(sh.Opt.V.Tensors[i].Data, m.Opt.V.Tensors[j].Data)
		}
		var b bytes.Buffer
		if err := safetensors.Write(&b, model.CheckpointTensors(sh.P, sh.Opt), model.CheckpointMeta(m.Cfg, 6)); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b.Bytes())
		sha := hex.EncodeToString(sum[:])
		blobs[sha] = b.Bytes()
		return sha
	}
	a, b, again := shard(0, 2), shard(2, 4), shard(1, 2)
	var served []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sha := strings.TrimPrefix(r.URL.Path, "/blobs/")
		served = append(served, sha)
		w.Write(blobs[sha])
	}))
	defer srv.Close()
	spec := job.Default()
	spec.Model = m.Cfg
	s := restoreSession(t, srv.URL, time.Minute)
	stage := func() *model.Shard {
		sh, err := model.NewStageShard(m.Cfg, 1, 3, nil)
		if err != nil {
			t.Fatal(err)
		}
		return sh
	}
	sh := stage()
	if err := s.restore(context.Background(), spec, sh, &proto.CheckpointRef{Step: 6, Blobs: []string{a, b}}, nil); err != nil {
		t.Fatal(err)
	}
	sameRestored(t, m, sh, nil)
	if len(served) != 2 {
		t.Fatalf("blobs fetched %d, want 2", len(served))
	}
	// Blocks [1, 2) come from a; the same blocks from another shard add nothing.
	served = nil
	err := s.restore(context.Background(), spec, stage(), &proto.CheckpointRef{Step: 6, Blobs: []string{a, again, b}}, nil)
	if err == nil || !strings.Contains(err.Error(), "holds no tensor of this shard that the blobs before it did not") {
		t.Fatalf("a blob adding nothing: %v", err)
	}
	if len(served) != 2 {
		t.Fatalf("blobs fetched %d, want 2: none after the one that added nothing", len(served))
	}
	// A shard lacking some of the stage's blocks fails as a restore, naming what it lacks.
	if err := s.restore(context.Background(), spec, stage(), &proto.CheckpointRef{Step: 6, Blobs: []string{a}}, nil); err == nil || !strings.Contains(err.Error(), "lacks") {
		t.Fatalf("a restore short of blocks: %v", err)
	}
	// Blobs that each add a tensor but together hold more than a checkpoint of the job: the
	// whole model less one of the stage's tensors, then the whole model. Cut off in the second.
	whole := model.CheckpointTensors(m.P, m.Opt)
	var most []safetensors.Tensor
	for _, tt := range whole {
		if tt.Name != stage().P.Tensors[0].Name {
			most = append(most, tt)
		}
	}
	blobOf := func(ts []safetensors.Tensor) string {
		var b bytes.Buffer
		if err := safetensors.Write(&b, ts, model.CheckpointMeta(m.Cfg, 6)); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b.Bytes())
		sha := hex.EncodeToString(sum[:])
		blobs[sha] = b.Bytes()
		return sha
	}
	if err := s.restore(context.Background(), spec, stage(), &proto.CheckpointRef{Step: 6, Blobs: []string{blobOf(most), blobOf(whole)}}, nil); err == nil || !strings.Contains(err.Error(), "cut off past the bound") {
		t.Fatalf("blobs holding twice the model: %v", err)
	}
	// More blobs than the stage reads tensors: refused before any is fetched.
	served = nil
	many := make([]string, 3*len(stage().P.Tensors)+1)
	for i := range many {
		many[i] = fmt.Sprintf("%064x", i)
	}
	if err := s.restore(context.Background(), spec, stage(), &proto.CheckpointRef{Step: 6, Blobs: many}, nil); err == nil || !strings.Contains(err.Error(), "checkpoint blobs for a shard that reads") {
		t.Fatalf("too many blobs: %v", err)
	}
	if len(served) != 0 {
		t.Fatalf("blobs fetched %d, want none", len(served))
	}
}

// sameRestored fails the test unless shard sh holds m's parameters and moments of its tensors, bit
// for bit — and global, when not nil, m's parameters too.
func sameRestored(t *testing.T, m *model.Model, sh *model.Shard, global *model.Params) {
	t.Helper()
	whole := map[string]int{}
	for i, p := range m.P.Tensors {
		whole[p.Name] = i
	}
	for i, p := range sh.P.Tensors {
		j := whole[p.Name]
		pairs := [][2][]float32{{p.Data, m.P.Tensors[j].Data}, {sh.Opt.M.Tensors[i].Data, m.Opt.M.Tensors[j].Data}, {sh.Opt.V.Tensors[i].Data, m.Opt.V.Tensors[j].Data}}
		if global != nil {
			pairs = append(pairs, [2][]float32{global.Tensors[i].Data, m.P.Tensors[j].Data})
		}
		for _, pair := range pairs {
			for k := range pair[0] {
				if pair[0][k] != pair[1][k] {
					t.Fatalf("%s[%d] restored as %v, the blob has %v", p.Name, k, pair[0][k], pair[1][k])
				}
			}
		}
	}
}

// TestRestoreRefusesBadBlobs: what a hostile coordinator can serve as a restore blob is refused,
// each with an error that says why, and nothing of it is held.
func TestRestoreRefusesBadBlobs(t *testing.T) {
	m, blob, sha := tinyBlob(t, 6)
	spec := job.Default()
	spec.Model = m.Cfg
	l := newBlobLayout(spec)
	// An outer-mode blob may hold the replicas of any plan: its header may be long, and is read
	// entry by entry.
	outer := spec
	outer.Sync = &job.Sync{Mode: job.SyncOuter}
	lo := newBlobLayout(outer)
	hn := int(binary.LittleEndian.Uint64(blob[:8]))
	header := func(h string) []byte {
		b := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
		return append(b, h...)
	}
	sum := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	tampered := bytes.Clone(blob)
	tampered[len(tampered)-1] ^= 1
	for _, c := range []struct {
		name string
		l    *blobLayout
		body io.Reader
		sha  string
		want string
	}{
		{"another blob", l, bytes.NewReader(tampered), sha, "not the " + sha},
		{"longer than its header", l, io.MultiReader(bytes.NewReader(blob), strings.NewReader("more")), sha, "goes on past the"},
		{"endless", l, io.MultiReader(bytes.NewReader(blob), zeros{}), sha, "goes on past the"},
		{"endless header", l, zeros{}, sha, "header is not a JSON object"},
		{"huge header", l, bytes.NewReader(binary.LittleEndian.AppendUint64(nil, 1<<40)), sha, "past the bound of"},
		{"a tensor of another model", l, bytes.NewReader(header(`{"lm_head.bias":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`)), sha, `"lm_head.bias" is not one`},
		{"a huge tensor", l, bytes.NewReader(header(`{"transformer.wte.weight":{"dtype":"F32","shape":[1000000000,1000],"data_offsets":[0,4000000000000]}}`)), sha, "shape [1000000000 1000]"},
		{"a long header entry", lo, bytes.NewReader(header(`{"transformer.wte.weight":{"dtype":"F32","shape":[` + strings.Repeat("1,", 1<<16) + `1]}}`)), sha, "header entry longer than"},
		{"a short blob", l, bytes.NewReader(blob[:8+hn+100]), sha, "unexpected EOF"},
		{"the right header, the wrong blob", l, bytes.NewReader(blob), sum([]byte("x")), "its sha256 is " + sha},
	} {
		t.Run(c.name, func(t *testing.T) {
			sh, err := model.NewStageShard(m.Cfg, 0, m.Cfg.NLayer, nil)
			if err != nil {
				t.Fatal(err)
			}
			into := map[string][]float32{}
			for i, p := range sh.P.Tensors {
				into[p.Name], into[optimM+p.Name], into[optimV+p.Name] = p.Data, sh.Opt.M.Tensors[i].Data, sh.Opt.V.Tensors[i].Data
			}
			_, err = readBlob(c.body, c.l, c.sha, func(name string, _ []int) []float32 { return into[name] })
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("readBlob: %v, want an error saying %q", err, c.want)
			}
		})
	}
	// The whole blob is no longer than the layout's bound, and the bound is the whole model's
	// parameters and moments and a header.
	var params int64
	for _, sp := range m.Cfg.Specs() {
		params += int64(sp.Size())
	}
	if b := l.bound(); int64(len(blob)) > b || b > 12*params+l.header+8 {
		t.Fatalf("bound %d for a blob of %d bytes (%d parameters)", b, len(blob), params)
	}
}

// zeros is an endless stream of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestDownloadStallAndAdvertisedSize: a download whose body stops moving is cut at the stall
// timeout, and one that advertises more than the bound is refused before its body is read.
func TestDownloadStallAndAdvertisedSize(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/huge" {
			w.Header().Set("Content-Length", "1099511627776")
			w.WriteHeader(http.StatusOK)
			return
		}
		w.Write([]byte("a start"))
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release) // before the server closes: it waits for its handlers
	s := restoreSession(t, srv.URL, 200*time.Millisecond)
	err := s.download(context.Background(), "/stall", 1<<20, func(r io.Reader) error { _, err := io.Copy(io.Discard, r); return err })
	if !errors.Is(err, errStalled) {
		t.Fatalf("a stalled body: %v, want the stall named", err)
	}
	called := false
	err = s.download(context.Background(), "/huge", 1<<20, func(io.Reader) error { called = true; return nil })
	if err == nil || called || !strings.Contains(err.Error(), "past the bound of 1048576") {
		t.Fatalf("an advertised 1 TiB: %v (body read: %v)", err, called)
	}
}

// TestRedirectsStayWithTheCoordinator: a redirect within the coordinator's origin is followed, one
// to another origin — another port of the same host — is refused, and nothing reaches it.
func TestRedirectsStayWithTheCoordinator(t *testing.T) {
	var reached bool
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { reached = true }))
	defer other.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/here":
			http.Redirect(w, r, "/there", http.StatusFound)
		case "/there":
			w.Write([]byte("ok"))
		default:
			http.Redirect(w, r, other.URL+"/blob", http.StatusFound)
		}
	}))
	defer srv.Close()
	s := restoreSession(t, srv.URL, time.Minute)
	read := func(r io.Reader) error { _, err := io.Copy(io.Discard, r); return err }
	if err := s.download(context.Background(), "/here", 1<<20, read); err != nil {
		t.Fatalf("a redirect within the origin: %v", err)
	}
	err := s.download(context.Background(), "/away", 1<<20, read)
	if err == nil || !strings.Contains(err.Error(), "redirect to "+strings.Replace(other.URL, "127.0.0.1", "127.0.0.1", 1)) || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a redirect to %s: %v", other.URL, err)
	}
	if reached {
		t.Fatal("the other origin was reached")
	}
}

// TestUploadStallIsCut: an upload the coordinator never reads, and one it reads but never
// answers, are cut at the stall timeout, naming the stall.
func TestUploadStallIsCut(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/read" {
			io.Copy(io.Discard, r.Body)
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release) // before the server closes: it waits for its handlers
	s := restoreSession(t, srv.URL, 200*time.Millisecond)
	for _, path := range []string{"/read", "/unread"} {
		// Larger than the socket buffers, so that an unread body stops moving.
		body, err := newSpill(32<<20, 32<<20, func(w io.Writer) error { _, err := w.Write(make([]byte, 32<<20)); return err })
		if err != nil {
			t.Fatal(err)
		}
		err = s.post(context.Background(), path, body)
		body.Close()
		if !errors.Is(err, errStalled) {
			t.Errorf("POST %s: %v, want the stall named", path, err)
		}
	}
}

// TestJoinRedirectRefused: a coordinator that redirects the control WebSocket to another origin is
// not followed there.
func TestJoinRedirectRefused(t *testing.T) {
	var reached bool
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { reached = true }))
	defer other.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, other.URL+"/ws", http.StatusFound)
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, _, err := Dial(ctx, ConnConfig{URL: "ws" + strings.TrimPrefix(srv.URL, "http") + "/ws", Hello: proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1, MemoryBytes: 1 << 30, Threads: 1}})
	if err == nil || !strings.Contains(err.Error(), "redirect to "+other.URL+" refused") {
		t.Fatalf("a redirected join: %v", err)
	}
	if reached {
		t.Fatal("the other origin was reached")
	}
}

// TestRestoreWarmStart: an outer-mode replica's stage restored from the synchronous warm-up's
// checkpoint (job.Sync.Warmup, a step-mode blob) takes its parameters and AdamW's moments, and
// starts the outer state from them: the global θ its parameters, no momentum, no error feedback.
// A coordinator that names a warm-up checkpoint of another step — before the warm-up's end, where
// outer mode does not start — is refused.
func TestRestoreWarmStart(t *testing.T) {
	m, blob, sha := tinyBlob(t, 6)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(blob) }))
	defer srv.Close()
	spec := job.Default()
	spec.Model, spec.Steps = m.Cfg, 20
	w := 6
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Warmup: &w}
	stage := func() (*model.Shard, *StageRunner) {
		sh, err := model.NewStageShard(m.Cfg, 1, 2, nil)
		if err != nil {
			t.Fatal(err)
		}
		r := &StageRunner{Shard: sh, Replica: &proto.ReplicaAssign{Index: 1}, Outer: testOuterState(t, sh.P.Specs(), spec)}
		for _, p := range []*model.Params{r.Outer.outer.V, r.Outer.outer.Err, r.Outer.err} {
			for _, t := range p.Tensors {
				t.Data[0] = 9 // what a warm start must clear
			}
		}
		return sh, r
	}
	sh, r := stage()
	s := restoreSession(t, srv.URL, time.Minute)
	if err := s.restore(context.Background(), spec, sh, &proto.CheckpointRef{Step: 6, Blobs: []string{sha}}, r); err != nil {
		t.Fatal(err)
	}
	sameRestored(t, m, sh, r.Outer.global)
	for i, p := range sh.P.Tensors {
		for _, z := range []*model.Params{r.Outer.outer.V, r.Outer.outer.Err, r.Outer.err} {
			if v := z.Tensors[i].Data[0]; v != 0 {
				t.Fatalf("%s: outer state %v after a warm start, want 0", p.Name, v)
			}
		}
	}
	spec.Sync.Warmup = new(int)
	*spec.Sync.Warmup = 8
	sh, r = stage()
	if err := s.restore(context.Background(), spec, sh, &proto.CheckpointRef{Step: 6, Blobs: []string{sha}}, r); err == nil || !strings.Contains(err.Error(), "warm-up") {
		t.Fatalf("a warm-up checkpoint before the warm-up's end: %v, want refused", err)
	}
}

// TestRestoreOuterAtStepZero: without a warm-up, an outer-mode checkpoint after 0 steps (a join
// replan or a stop before the first step takes one) is an outer one, read as such — not taken
// for a warm-up's step-mode checkpoint, whose moments it does not hold.
func TestRestoreOuterAtStepZero(t *testing.T) {
	cfg := model.TinyConfig()
	spec := job.Default()
	spec.Model, spec.Steps = cfg, 20
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 4, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "none"}
	src, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	src.Init(3)
	outer := model.NewOuter(src.P.Specs(), 0.7, 0.9, false)
	ts := append(model.OuterCheckpointGlobal(src.P, outer), model.OuterCheckpointReplica(0, src.P, src.Opt, nil)...)
	var b bytes.Buffer
	if err := safetensors.Write(&b, ts, model.CheckpointMeta(cfg, 0)); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b.Bytes())
	blob := b.Bytes()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(blob) }))
	defer srv.Close()
	sh, err := model.NewStageShard(cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := &StageRunner{Shard: sh, Replica: &proto.ReplicaAssign{Index: 0}, Outer: testOuterState(t, sh.P.Specs(), spec)}
	s := restoreSession(t, srv.URL, time.Minute)
	if err := s.restore(context.Background(), spec, sh, &proto.CheckpointRef{Step: 0, Blobs: []string{hex.EncodeToString(sum[:])}}, r); err != nil {
		t.Fatalf("an outer checkpoint after 0 steps: %v", err)
	}
	sameRestored(t, src, sh, r.Outer.global)
}
