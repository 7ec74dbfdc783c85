package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// The hostile-coordinator tests run an honest `shoal worker` — a real process, this test binary
// as main — against a coordinator that attacks it: a test server on 127.0.0.1 that speaks the
// protocol (join, welcome, assign, heartbeats) and serves, at the endpoints under attack, what a
// hostile or broken coordinator could. The worker must stay under the memory it offers (its
// peak resident memory, VmHWM, read from /proc), hold at most two spill files, and say why it
// refuses.

// hostileMemory is what the worker offers (--memory): ample for the tiny model's shard.
const hostileMemory = 256 << 20

// hostileCoord is the attacking coordinator: it welcomes one worker and assigns it the whole
// tiny model as one stage, restoring from blobRef when set.
type hostileCoord struct {
	t       *testing.T
	srv     *httptest.Server
	ctx     context.Context
	spec    job.Spec
	msgs    chan proto.Message // the worker's Ready and Error messages
	ws      atomic.Pointer[websocket.Conn]
	restore *proto.CheckpointRef
	// serve answers every request but /ws.
	serve http.HandlerFunc
}

func newHostileCoord(t *testing.T, restore *proto.CheckpointRef, serve http.HandlerFunc) *hostileCoord {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h := &hostileCoord{t: t, ctx: ctx, msgs: make(chan proto.Message, 1024), restore: restore, serve: serve}
	h.spec = job.Default()
	h.spec.Model = model.TinyConfig()
	h.spec.BatchSize, h.spec.MicroBatches, h.spec.AuditRate = 4, 2, 0
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ws" {
			h.serveWorker(w, r)
			return
		}
		h.serve(w, r)
	}))
	t.Cleanup(func() {
		cancel()
		h.srv.CloseClientConnections()
		h.srv.Close()
	})
	return h
}

func (h *hostileCoord) write(m proto.Message) {
	b, err := proto.EncodeMessage(m)
	if err != nil {
		h.t.Errorf("encode %s: %v", m.Type(), err)
		return
	}
	if ws := h.ws.Load(); ws != nil {
		ws.Write(h.ctx, websocket.MessageText, b) // fails only once the test is over
	}
}

// assign assigns the worker the whole tiny model under plan version, from restore (nil: the seed).
func (h *hostileCoord) assign(version uint32, restore *proto.CheckpointRef) {
	raw, err := json.Marshal(h.spec)
	if err != nil {
		h.t.Fatal(err)
	}
	n := h.spec.Model.NLayer
	h.write(&proto.Assign{Job: "job-1", Spec: raw, PlanVersion: version, Relay: true, ExpertHosts: []proto.ExpertHost{}, Restore: restore,
		Shard: proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: n, First: true, Last: true}}})
}

func (h *hostileCoord) serveWorker(w http.ResponseWriter, r *http.Request) {
	ws, err := websocket.Accept(w, r, nil)
	if err != nil {
		return
	}
	defer ws.CloseNow()
	ws.SetReadLimit(proto.MaxBinarySize)
	if _, _, err := ws.Read(h.ctx); err != nil {
		return
	}
	h.ws.Store(ws)
	h.write(&proto.Welcome{WorkerID: "w-1", HeartbeatMS: 1000, Loopback: true, ICEServers: []proto.ICEServer{}, Session: fmt.Sprintf("session-%035d", 1)})
	h.assign(1, h.restore)
	for {
		_, b, err := ws.Read(h.ctx)
		if err != nil {
			return
		}
		m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
		if err != nil {
			h.t.Errorf("the worker sent %v", err)
			return
		}
		switch m := m.(type) {
		case *proto.Heartbeat:
			if !m.Ack {
				h.write(&proto.Heartbeat{Seq: m.Seq, Ack: true})
			}
		case *proto.Ready, *proto.Error:
			h.msgs <- m
		}
	}
}

// next is the worker's next Ready or Error.
func (h *hostileCoord) next() proto.Message {
	h.t.Helper()
	select {
	case m := <-h.msgs:
		return m
	case <-time.After(2 * time.Minute):
		h.t.Fatal("the worker said nothing for 2 minutes")
		return nil
	}
}

// hostileWorker is a `shoal worker` process joined to h, logging to dir/worker.log, with its
// temporary files in dir/tmp.
type hostileWorker struct {
	*proc
	dir string
}

func startHostileWorker(t *testing.T, h *hostileCoord) *hostileWorker {
	t.Helper()
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("measures the worker's memory in /proc")
	}
	dir := t.TempDir()
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", tmp)
	p := startProc(t, dir, "worker", "worker", "--coordinator", h.srv.URL, "--device", "cpu", "--threads", "1",
		"--memory", strconv.Itoa(hostileMemory), "--name", "honest")
	t.Cleanup(func() {
		p.kill()
		<-p.done
	})
	return &hostileWorker{proc: p, dir: dir}
}

// peakRSS is the worker's peak resident memory so far (VmHWM).
func (w *hostileWorker) peakRSS(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", w.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

// spills counts the worker's open upload spills (unlinked at once, so seen only as descriptors).
func (w *hostileWorker) spills(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", w.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", w.cmd.Process.Pid, fd.Name())); err == nil && strings.Contains(l, "shoal-upload-") {
			n++
		}
	}
	return n
}

func (w *hostileWorker) log(t *testing.T) string {
	t.Helper()
	b, _ := os.ReadFile(filepath.Join(w.dir, "worker.log"))
	return string(b)
}

// checkMemory fails the test if the worker's peak went past what it offers.
func (w *hostileWorker) checkMemory(t *testing.T) {
	t.Helper()
	peak := w.peakRSS(t)
	t.Logf("worker peak RSS %.1f MiB (offers %d MiB)", float64(peak)/(1<<20), hostileMemory>>20)
	if peak > hostileMemory {
		t.Errorf("the worker's peak RSS %d bytes is past the %d it offers (--memory)", peak, hostileMemory)
	}
}

// refusal waits for the worker's answer to its assignment and returns the error it reports.
func refusal(t *testing.T, h *hostileCoord, w *hostileWorker) string {
	t.Helper()
	switch m := h.next().(type) {
	case *proto.Error:
		t.Logf("the worker refuses: %s", m.Message)
		return m.Message
	default:
		t.Fatalf("the worker took the assignment (%T)\n%s", m, w.log(t))
		return ""
	}
}

// tinyRestoreBlob is an honest restore blob of the hostile job's model after step 3, and its ref.
func tinyRestoreBlob(t *testing.T, cfg model.Config) ([]byte, *proto.CheckpointRef) {
	t.Helper()
	m, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(1)
	var b bytes.Buffer
	if err := safetensors.Write(&b, model.CheckpointTensors(m.P, m.Opt), model.CheckpointMeta(cfg, 3)); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b.Bytes())
	return b.Bytes(), &proto.CheckpointRef{Step: 3, Blobs: []string{hex.EncodeToString(sum[:])}}
}

// flood writes head, then zeros until the worker stops reading or attack bytes went out: what
// a worker without a bound would hold is past its memory several times over.
func flood(w http.ResponseWriter, head []byte, attack int64) int64 {
	w.Write(head)
	zeros := make([]byte, 1<<20)
	n := int64(len(head))
	for n < attack {
		k, err := w.Write(zeros)
		n += int64(k)
		if err != nil {
			break
		}
	}
	return n
}

// TestHostileEndlessRestoreBlob: the restore blob has the honest header, then never ends. The
// worker refuses it past what its header describes, within its memory.
func TestHostileEndlessRestoreBlob(t *testing.T) {
	blob, ref := tinyRestoreBlob(t, model.TinyConfig())
	hn := binary.LittleEndian.Uint64(blob[:8])
	var sent atomic.Int64
	h := newHostileCoord(t, ref, func(w http.ResponseWriter, r *http.Request) {
		sent.Store(flood(w, blob[:8+hn], 3*hostileMemory))
	})
	w := startHostileWorker(t, h)
	msg := refusal(t, h, w)
	w.checkMemory(t)
	t.Logf("the coordinator sent %.1f MiB", float64(sent.Load())/(1<<20))
	if !strings.Contains(msg, "goes on past the") {
		t.Errorf("the refusal does not say the blob is longer than its header: %s", msg)
	}
}

// TestHostileHugeAdvertisedShard: the restore blob's header advertises a tensor of the job's
// model a million times its size, and the response a body as large (or no length at all). The
// worker refuses it before reading the body, naming the bound or the tensor.
func TestHostileHugeAdvertisedShard(t *testing.T) {
	_, ref := tinyRestoreBlob(t, model.TinyConfig())
	header := `{"transformer.wte.weight":{"dtype":"F32","shape":[256000000,64],"data_offsets":[0,65536000000]}}`
	head := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	head = append(head, header...)
	for _, c := range []struct {
		name   string
		length bool
		want   string
	}{
		{"with its length", true, "past the bound of"},
		{"chunked", false, "shape [256000000 64], the job's model has [256 64]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHostileCoord(t, ref, func(w http.ResponseWriter, r *http.Request) {
				if c.length {
					w.Header().Set("Content-Length", strconv.FormatInt(int64(len(head))+65536000000, 10))
				}
				flood(w, head, 3*hostileMemory)
			})
			w := startHostileWorker(t, h)
			msg := refusal(t, h, w)
			w.checkMemory(t)
			if !strings.Contains(msg, c.want) {
				t.Errorf("the refusal does not say %q: %s", c.want, msg)
			}
		})
	}
}

// TestHostileRedirect: the coordinator redirects the restore to another origin (another port on
// the same host), which serves the right blob. The worker refuses to follow, and the other
// server hears nothing.
func TestHostileRedirect(t *testing.T) {
	blob, ref := tinyRestoreBlob(t, model.TinyConfig())
	var reached atomic.Bool
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Store(true)
		w.Write(blob)
	}))
	defer other.Close()
	h := newHostileCoord(t, ref, func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, other.URL+r.URL.Path, http.StatusFound)
	})
	w := startHostileWorker(t, h)
	msg := refusal(t, h, w)
	if !strings.Contains(msg, "redirect to "+other.URL) || !strings.Contains(msg, "refused") {
		t.Errorf("the refusal does not say which redirect it refused: %s", msg)
	}
	if reached.Load() {
		t.Error("the worker reached the other origin")
	}
}

// TestHostileCheckpointFlood: the coordinator asks for 200 checkpoints of one step at once, each
// older than the last, and never answers an upload. The worker holds one spill (two at most),
// refuses the others and says why. (A newer checkpoint of the same step, or one of a later step,
// supersedes the upload in flight instead — the spill is still one: TestCheckpointSupersedes.)
func TestHostileCheckpointFlood(t *testing.T) {
	var uploads atomic.Int64
	var h *hostileCoord
	h = newHostileCoord(t, nil, func(w http.ResponseWriter, r *http.Request) {
		uploads.Add(1)
		<-h.ctx.Done() // never read, never answered
	})
	w := startHostileWorker(t, h)
	if m, ok := h.next().(*proto.Ready); !ok {
		t.Fatalf("the worker answered its assignment with %v\n%s", m, w.log(t))
	}
	const n = 200
	for i := n; i >= 1; i-- {
		h.write(&proto.Checkpoint{ID: int64(i), Step: 0, Shard: "stage-0", UploadPath: fmt.Sprintf("/api/checkpoints/%d/shards/stage-0", i)})
	}
	// The worker takes its messages in order: once it is ready for the next plan, it has
	// handled every checkpoint request before it.
	h.assign(2, nil)
	if m, ok := h.next().(*proto.Ready); !ok {
		t.Fatalf("the worker answered its second assignment with %v\n%s", m, w.log(t))
	}
	spills := w.spills(t)
	t.Logf("%d checkpoint requests: %d spills open, %d uploads begun", n, spills, uploads.Load())
	if spills > 2 {
		t.Errorf("the worker holds %d spill files (at most 2)", spills)
	}
	if ents, _ := os.ReadDir(filepath.Join(w.dir, "tmp")); len(ents) > 2 {
		t.Errorf("%d temporary files in the worker's TMPDIR", len(ents))
	}
	w.checkMemory(t)
	if lg := w.log(t); !strings.Contains(lg, "checkpoint refused") || !strings.Contains(lg, "one checkpoint at a time") {
		t.Errorf("the worker does not say why it refuses checkpoints:\n%s", lg)
	}
	// Each newer than the last: each supersedes the upload before it, which is cancelled, so
	// the worker still holds one spill at a time.
	for i := n + 1; i <= 2*n; i++ {
		h.write(&proto.Checkpoint{ID: int64(i), Step: 0, Shard: "stage-0", UploadPath: fmt.Sprintf("/api/checkpoints/%d/shards/stage-0", i)})
	}
	h.assign(3, nil)
	if m, ok := h.next().(*proto.Ready); !ok {
		t.Fatalf("the worker answered its third assignment with %v\n%s", m, w.log(t))
	}
	if spills := w.spills(t); spills > 2 {
		t.Errorf("after %d superseding requests the worker holds %d spill files (at most 2)", n, spills)
	}
	if ents, _ := os.ReadDir(filepath.Join(w.dir, "tmp")); len(ents) > 2 {
		t.Errorf("%d temporary files in the worker's TMPDIR after superseding requests", len(ents))
	}
	w.checkMemory(t)
}
