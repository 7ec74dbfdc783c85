package coordinator

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// The upload tests (issue 14) run a real coordinator (New, a SQLite file in t.TempDir()) on an
// httptest server, with real workers connected over WebSockets for their session credentials.
// The job loop does not run: each test begins a checkpoint and asks its shards of the workers
// itself, as the loop's checkpoint() does, so that it controls who uploads what and when.

// uploadStep is the step the rig's checkpoint is taken after.
const uploadStep = 4

// uploadRig is a coordinator with a job of the tiny model and a pending checkpoint of two shards:
// stage-0 (every block, and the experts that no expert host holds) asked of worker a, and
// experts-0 (experts 0 and 1 of block 1) asked of worker b.
type uploadRig struct {
	srv      *Server
	url      string
	spec     job.Spec
	jobID    uuid.UUID
	ck       storage.Checkpoint
	a, b     *proto.Welcome // their WorkerID and Session
	stage    []byte         // what worker a uploads, as client/worker.go writes it
	experts  []byte         // what worker b uploads
	stageSh  *model.Shard
	expertSh *model.Shard
}

// hostedBlock and hostedExpertIDs are the experts of the rig's expert host, worker b.
const hostedBlock = 1

var hostedExpertIDs = []int{0, 1}

func newUploadRig(t *testing.T, cfg Config) *uploadRig {
	t.Helper()
	ctx := context.Background()
	cfg.DataDir = t.TempDir()
	if cfg.Logger == nil {
		cfg.Logger = testLogger()
	}
	if cfg.AdminToken == "" {
		cfg.AdminToken = "upload-test-admin-token"
	}
	srv, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	r := &uploadRig{srv: srv, url: hs.URL, spec: tinyJob(t, 8)}
	b, _ := json.Marshal(r.spec)
	jb, err := srv.db.CreateJob(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	r.jobID = jb.ID
	ws := "ws" + strings.TrimPrefix(hs.URL, "http") + "/ws"
	_, r.a = dialWorker(t, ws, testHello("a"), nil)
	_, r.b = dialWorker(t, ws, testHello("b"), nil)
	if r.a.Session == "" || r.b.Session == "" {
		t.Fatalf("welcomes without a session: %+v %+v", r.a, r.b)
	}
	r.ck, err = srv.db.BeginCheckpoint(ctx, jb.ID, uploadStep, []string{"stage-0", "experts-0"})
	if err != nil {
		t.Fatal(err)
	}
	mc := r.spec.Model
	stage := proto.Shard{Stage: &proto.StageShard{Index: 0, Count: 1, Begin: 0, End: mc.NLayer, First: true, Last: true}}
	experts := proto.Shard{Experts: &proto.ExpertShard{Block: hostedBlock, Experts: hostedExpertIDs, StageIndex: 0, StageCount: 1}}
	srv.slots.expect(r.ck.ID, "stage-0", uploadSlot{Worker: r.a.WorkerID, Job: jb.ID, Spec: r.spec, Step: uploadStep, Shard: stage})
	srv.slots.expect(r.ck.ID, "experts-0", uploadSlot{Worker: r.b.WorkerID, Job: jb.ID, Spec: r.spec, Step: uploadStep, Shard: experts})

	// The shards as the workers hold them (client/worker.go: the stage keeps the experts that no
	// host holds) and write them (session.checkpoint).
	hosted := func(blk, e int) bool {
		return blk == hostedBlock && (e == hostedExpertIDs[0] || e == hostedExpertIDs[1])
	}
	if r.stageSh, err = model.NewStageShardWith(mc, 0, mc.NLayer, func(blk, e int) bool { return !hosted(blk, e) }, nil); err != nil {
		t.Fatal(err)
	}
	if r.expertSh, err = model.NewExpertShard(mc, hostedBlock, hostedExpertIDs); err != nil {
		t.Fatal(err)
	}
	r.stage = shardFile(t, r.stageSh, uploadStep, 1)
	r.experts = shardFile(t, r.expertSh, uploadStep, 2)
	return r
}

// shardFile is the checkpoint file of sh after step, initialised from seed with some Adam state.
func shardFile(t *testing.T, sh *model.Shard, step int, seed uint64) []byte {
	t.Helper()
	sh.Init(seed)
	for i := range sh.Opt.M.Slab {
		sh.Opt.M.Slab[i] = float32(i%7) * 1e-3
		sh.Opt.V.Slab[i] = float32(i%5) * 1e-6
	}
	var buf bytes.Buffer
	if err := safetensors.Write(&buf, model.CheckpointTensors(sh.P, sh.Opt), model.CheckpointMeta(sh.Cfg, step)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func (r *uploadRig) path(name string) string {
	return fmt.Sprintf("/api/checkpoints/%d/shards/%s", r.ck.ID, name)
}

// post uploads body as shard name with credential (none when ""), and returns the status and
// the message.
func (r *uploadRig) post(t *testing.T, name, credential string, body []byte) (int, string) {
	t.Helper()
	return r.postTo(t, r.path(name), credential, body)
}

// postTo POSTs body to path with credential (none when ""), and returns the status and the
// message.
func (r *uploadRig) postTo(t *testing.T, path, credential string, body []byte) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, r.url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if credential != "" {
		req.Header.Set("Authorization", "Bearer "+credential)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, strings.TrimSpace(string(msg))
}

// landed reports whether shard name of the rig's checkpoint is recorded, and its blob.
func (r *uploadRig) landed(t *testing.T, name string) (bool, string) {
	t.Helper()
	ck, err := r.srv.db.Checkpoint(context.Background(), r.ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	for _, sh := range ck.Shards {
		if sh.Name == name {
			return sh.Landed(), sh.SHA256
		}
	}
	t.Fatalf("no shard %s", name)
	return false, ""
}

// blobFiles lists every file in the blob store, temporary files included.
func (r *uploadRig) blobFiles(t *testing.T) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(r.srv.blobs.Dir(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			out = append(out, strings.TrimPrefix(p, r.srv.blobs.Dir()))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (r *uploadRig) expectNothingStored(t *testing.T, what string) {
	t.Helper()
	if files := r.blobFiles(t); len(files) != 0 {
		t.Errorf("%s left %v in the blob store", what, files)
	}
	for _, name := range []string{"stage-0", "experts-0"} {
		if ok, _ := r.landed(t, name); ok {
			t.Errorf("%s: shard %s is recorded", what, name)
		}
	}
}

// An anonymous client used to win the race for a stage's slot: its "shard" completed the
// checkpoint and every worker restored from it after the next replan. Now an upload without
// the credential of the worker asked for the shard is refused before its body is read, and the
// honest upload lands.
func TestUploadWithoutCredentialRefused(t *testing.T) {
	r := newUploadRig(t, Config{})
	for _, tc := range []struct{ name, credential string }{
		{"none", ""},
		{"not a session", "let-me-in"},
		{"admin token", "upload-test-admin-token"},
	} {
		code, msg := r.post(t, "stage-0", tc.credential, r.stage)
		if code != http.StatusUnauthorized {
			t.Errorf("%s: upload got %d %q, want 401", tc.name, code, msg)
		}
	}
	r.expectNothingStored(t, "anonymous uploads")
	if code, msg := r.post(t, "stage-0", r.a.Session, r.stage); code != http.StatusNoContent {
		t.Fatalf("honest upload got %d %q, want 204", code, msg)
	}
	ok, sha := r.landed(t, "stage-0")
	if !ok {
		t.Fatal("honest shard not recorded")
	}
	want := sha256Hex(r.stage)
	if sha != want {
		t.Errorf("recorded blob %s, want the honest shard's %s", sha, want)
	}
	// A second upload of the landed shard, even by its worker, is refused.
	if code, msg := r.post(t, "stage-0", r.a.Session, r.stage); code != http.StatusConflict || !strings.Contains(msg, "already landed") {
		t.Errorf("upload of a landed shard got %d %q, want 409 already landed", code, msg)
	}
}

// A participant could fill another worker's slot. Now it is refused (403), and a shard nobody was
// asked for is a conflict (409).
func TestUploadOtherWorkersSlotRefused(t *testing.T) {
	r := newUploadRig(t, Config{})
	if code, msg := r.post(t, "stage-0", r.b.Session, r.stage); code != http.StatusForbidden {
		t.Errorf("b uploading a's stage got %d %q, want 403", code, msg)
	}
	if code, msg := r.post(t, "experts-0", r.a.Session, r.experts); code != http.StatusForbidden {
		t.Errorf("a uploading b's experts got %d %q, want 403", code, msg)
	}
	if code, msg := r.post(t, "stage-1", r.a.Session, r.stage); code != http.StatusConflict {
		t.Errorf("upload of a shard never asked for got %d %q, want 409", code, msg)
	}
	r.expectNothingStored(t, "uploads into other slots")
}

// Both shards land, in either order (a landed expert shard's slot is gone, and the stage's layout
// must still leave its experts out), the checkpoint completes, and assembling it gives back every
// tensor the workers uploaded.
func TestUploadHonestCheckpointAssembles(t *testing.T) {
	for _, expertsFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("experts first %v", expertsFirst), func(t *testing.T) {
			r := newUploadRig(t, Config{})
			order := []struct {
				name, credential string
				body             []byte
			}{{"stage-0", r.a.Session, r.stage}, {"experts-0", r.b.Session, r.experts}}
			if expertsFirst {
				order[0], order[1] = order[1], order[0]
			}
			for _, u := range order {
				if code, msg := r.post(t, u.name, u.credential, u.body); code != http.StatusNoContent {
					t.Fatalf("upload %s got %d %q", u.name, code, msg)
				}
			}
			ck, err := r.srv.db.Checkpoint(context.Background(), r.ck.ID)
			if err != nil || ck.State != storage.CheckpointComplete {
				t.Fatalf("checkpoint %+v, %v: want complete", ck, err)
			}
			select {
			case id := <-r.srv.uploads:
				if id != ck.ID {
					t.Errorf("job loop told of checkpoint %d, want %d", id, ck.ID)
				}
			default:
				t.Error("job loop not told of the completed checkpoint")
			}
			sha, err := r.srv.assemble(context.Background(), ck)
			if err != nil {
				t.Fatal(err)
			}
			b, err := r.srv.readBlob(sha)
			if err != nil {
				t.Fatal(err)
			}
			ts, meta, err := safetensors.Read(b)
			if err != nil {
				t.Fatal(err)
			}
			if meta["step"] != fmt.Sprint(uploadStep) {
				t.Errorf("assembled step %q", meta["step"])
			}
			got := map[string][]float32{}
			for _, tn := range ts {
				got[tn.Name] = tn.Data
			}
			if want := 3 * len(r.spec.Model.Specs()); len(got) != want {
				t.Errorf("assembled %d tensors, want %d", len(got), want)
			}
			for _, sh := range []*model.Shard{r.stageSh, r.expertSh} {
				for _, tn := range model.CheckpointTensors(sh.P, sh.Opt) {
					if !equalFloats(got[tn.Name], tn.Data) {
						t.Errorf("assembled %s differs from the uploaded one", tn.Name)
					}
				}
			}
		})
	}
}

func equalFloats(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// withMeta re-encodes a shard file with its metadata changed by edit and its tensors by editT.
func withMeta(t *testing.T, file []byte, edit func(map[string]string), editT func([]safetensors.Tensor) []safetensors.Tensor) []byte {
	t.Helper()
	ts, meta, err := safetensors.Read(file)
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(meta)
	}
	if editT != nil {
		ts = editT(ts)
	}
	var buf bytes.Buffer
	if err := safetensors.Write(&buf, ts, meta); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Shards that are not what was asked for are refused as they stream in, and leave nothing on
// disk: an HTML page (it used to be refused but kept, and served as text/html), metadata that
// asks for 16,384 channels (it used to be accepted, and assembling it allocated ~100 GB), and
// every other way a file can differ from the shard.
func TestUploadRefusesWrongShards(t *testing.T) {
	r := newUploadRig(t, Config{})
	big := r.spec.Model
	big.NEmbd = 16384
	bigJSON, _ := json.Marshal(big)
	drop := func(name string) func([]safetensors.Tensor) []safetensors.Tensor {
		return func(ts []safetensors.Tensor) []safetensors.Tensor {
			var out []safetensors.Tensor
			for _, tn := range ts {
				if tn.Name != name {
					out = append(out, tn)
				}
			}
			return out
		}
	}
	for _, tc := range []struct {
		name string
		body []byte
		want int
	}{
		{"html", []byte("<!doctype html><html><script>alert(document.cookie)</script></html>"), http.StatusBadRequest},
		{"16384 channels", withMeta(t, r.stage, func(m map[string]string) { m["config"] = string(bigJSON) }, nil), http.StatusBadRequest},
		{"other step", withMeta(t, r.stage, func(m map[string]string) { m["step"] = "3" }, nil), http.StatusBadRequest},
		{"no config", withMeta(t, r.stage, func(m map[string]string) { delete(m, "config") }, nil), http.StatusBadRequest},
		{"unknown metadata", withMeta(t, r.stage, func(m map[string]string) { m["note"] = "<script>" }, nil), http.StatusBadRequest},
		{"missing tensor", withMeta(t, r.stage, nil, drop("optim.v.lm_head.weight")), http.StatusBadRequest},
		{"hosted expert's tensor", withMeta(t, r.stage, nil, func(ts []safetensors.Tensor) []safetensors.Tensor {
			return append(ts, safetensors.Tensor{Name: model.ExpertPrefix(hostedBlock, 0) + "c_proj.bias", Shape: []int{r.spec.Model.NEmbd}, Data: make([]float32, r.spec.Model.NEmbd)})
		}), http.StatusBadRequest},
		{"wrong shape", withMeta(t, r.stage, nil, func(ts []safetensors.Tensor) []safetensors.Tensor {
			for i, tn := range ts {
				if tn.Name == "transformer.ln_f.bias" {
					ts[i] = safetensors.Tensor{Name: tn.Name, Shape: []int{2, len(tn.Data) / 2}, Data: tn.Data}
				}
			}
			return ts
		}), http.StatusBadRequest},
		{"nan", withMeta(t, r.stage, nil, func(ts []safetensors.Tensor) []safetensors.Tensor {
			ts[len(ts)-1].Data[3] = float32(math.NaN())
			return ts
		}), http.StatusBadRequest},
		{"inf", withMeta(t, r.stage, nil, func(ts []safetensors.Tensor) []safetensors.Tensor {
			ts[0].Data[0] = float32(math.Inf(-1))
			return ts
		}), http.StatusBadRequest},
		{"truncated", r.stage[:len(r.stage)-8], http.StatusBadRequest},
		{"huge header length", append(binary.LittleEndian.AppendUint64(nil, 1<<40), r.stage[8:]...), http.StatusBadRequest},
		{"experts as the stage", r.experts, http.StatusBadRequest},
	} {
		code, msg := r.post(t, "stage-0", r.a.Session, tc.body)
		if code != tc.want {
			t.Errorf("%s: got %d %q, want %d", tc.name, code, msg, tc.want)
		}
		r.expectNothingStored(t, tc.name)
	}
	// The slot is still open to the honest shard.
	if code, msg := r.post(t, "stage-0", r.a.Session, r.stage); code != http.StatusNoContent {
		t.Errorf("honest upload after the refusals got %d %q", code, msg)
	}
}

// rawPost opens a connection and sends a POST's request line and headers (and body, if any),
// leaving the connection open; the caller reads the response with readResponse.
func rawPost(t *testing.T, base, path, credential string, contentLength int64, body []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: shoal\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n", path, credential, contentLength)
	// A server that refuses the upload early may close the connection under this write: the
	// response is what the caller checks.
	c.Write(body)
	return c
}

// readResponse reads an HTTP response from c within d.
func readResponse(t *testing.T, c net.Conn, d time.Duration) (int, string, error) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(d))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, strings.TrimSpace(string(msg)), nil
}

// Each upload used to be read whole (up to 8 GiB) before any check. Now a Content-Length larger
// than the shard can be is refused at once, and a body without one is cut where the shard ends.
func TestUploadTooLargeRefused(t *testing.T) {
	r := newUploadRig(t, Config{})
	c := rawPost(t, r.url, r.path("stage-0"), r.a.Session, 1<<40, nil)
	code, msg, err := readResponse(t, c, 5*time.Second)
	if err != nil || code != http.StatusRequestEntityTooLarge {
		t.Errorf("a 1 TiB upload got %d %q, %v; want 413 before the body", code, msg, err)
	}
	// One byte more than the shard, declared.
	c = rawPost(t, r.url, r.path("stage-0"), r.a.Session, int64(len(r.stage)+1), append(r.stage, 0))
	if code, msg, err := readResponse(t, c, 5*time.Second); err != nil || code != http.StatusRequestEntityTooLarge {
		t.Errorf("a shard with a byte more got %d %q, %v; want 413", code, msg, err)
	}
	// A body of unknown length (chunked) that goes on past the shard.
	pr, pw := io.Pipe()
	go func() {
		pw.Write(r.stage)
		pw.Write(bytes.Repeat([]byte{0}, 1<<20))
		pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, r.url+r.path("stage-0"), pr)
	req.Header.Set("Authorization", "Bearer "+r.a.Session)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("a chunked upload longer than the shard got %d, want 413", resp.StatusCode)
	}
	r.expectNothingStored(t, "oversized uploads")
}

// 300 slow uploads used to hold 600 files open for as long as they liked. Now an upload that
// stops sending is cut after its stall period, leaves nothing on disk and frees its place.
func TestUploadStallCut(t *testing.T) {
	// The stall period is stallHeartbeats heartbeat timeouts: 3 s here.
	r := newUploadRig(t, Config{HeartbeatInterval: 100 * time.Millisecond})
	stall := r.srv.uploadStall()
	var conns []net.Conn
	for range storage.StagingLimit {
		conns = append(conns, rawPost(t, r.url, r.path("stage-0"), r.a.Session, int64(len(r.stage)), r.stage[:100]))
	}
	start := time.Now()
	// One upload of a slot at a time: the stalled one holds it, its copies are refused at once
	// instead of taking the staging places everyone shares.
	codes := map[int]int{}
	for i, c := range conns {
		code, msg, err := readResponse(t, c, stall+10*time.Second)
		if err != nil || code != http.StatusRequestTimeout && code != http.StatusConflict {
			t.Errorf("stalled upload %d got %d %q, %v; want 408 or 409", i, code, msg, err)
		}
		codes[code]++
	}
	if codes[http.StatusRequestTimeout] != 1 || codes[http.StatusConflict] != len(conns)-1 {
		t.Errorf("stalled uploads of one slot got %v, want one 408 and the rest 409", codes)
	}
	if took := time.Since(start); took < stall-stall/4 {
		t.Errorf("stalled uploads cut after %v, before the %v stall period", took, stall)
	}
	r.expectNothingStored(t, "stalled uploads")
	// Every staging place is free again.
	if code, msg := r.post(t, "stage-0", r.a.Session, r.stage); code != http.StatusNoContent {
		t.Errorf("honest upload after the stalls got %d %q", code, msg)
	}
}

// Blobs are what peers uploaded: they are served as opaque downloads, never as pages.
func TestBlobResponseHeaders(t *testing.T) {
	r := newUploadRig(t, Config{})
	sha, _, err := r.srv.blobs.Put(context.Background(), strings.NewReader("<!doctype html><script>alert(1)</script>"))
	if err != nil {
		t.Fatal(err)
	}
	// Without a worker's credential or the admin token, nothing: blobs are the job's checkpoints.
	resp, err := http.Get(r.url + "/blobs/" + sha)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("GET blob anonymously: %d, want 401", resp.StatusCode)
	}
	req, _ := http.NewRequest("GET", r.url+"/blobs/"+sha, nil)
	req.Header.Set("Authorization", "Bearer "+r.a.Session)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET blob: %d", resp.StatusCode)
	}
	for k, want := range map[string]string{
		"Content-Type":            "application/octet-stream",
		"X-Content-Type-Options":  "nosniff",
		"Content-Security-Policy": "sandbox; default-src 'none'",
	} {
		if got := resp.Header.Get(k); got != want {
			t.Errorf("%s: %q, want %q", k, got, want)
		}
	}
	if got := resp.Header.Get("Content-Disposition"); !strings.HasPrefix(got, "attachment") {
		t.Errorf("Content-Disposition: %q, want an attachment", got)
	}
}

// plantPoison records a complete checkpoint of the rig's job whose one shard is file, planted in
// the store directly (as an old coordinator, or an attacker with the disk, would have left it).
func (r *uploadRig) plantPoison(t *testing.T, file []byte) storage.Checkpoint {
	t.Helper()
	ctx := context.Background()
	ck, err := r.srv.db.BeginCheckpoint(ctx, r.jobID, 8, []string{"stage-0"})
	if err != nil {
		t.Fatal(err)
	}
	sha, size, err := r.srv.blobs.Put(ctx, bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.srv.db.AddShard(ctx, ck.ID, "stage-0", sha, size); err != nil {
		t.Fatal(err)
	}
	if ck, err = r.srv.db.Checkpoint(ctx, ck.ID); err != nil || ck.State != storage.CheckpointComplete {
		t.Fatalf("planted checkpoint %+v, %v", ck, err)
	}
	return ck
}

// A shard whose metadata asked for a bigger model made every assembly (GET /api/sample alone)
// allocate that model — ~100 GB for 16,384 channels — and the coordinator died again after each
// restart. Now the job's config decides what is allocated, every blob is checked against it
// first, and a planted blob gives a clear error with the heap left alone. 512 channels keep the
// unfixed coordinator's allocation (~1 GB) survivable for the test that shows it.
func TestAssemblePoisonedBlob(t *testing.T) {
	r := newUploadRig(t, Config{})
	big := r.spec.Model
	big.NEmbd = 512
	bigJSON, _ := json.Marshal(big)
	var poison bytes.Buffer
	lnf := safetensors.Tensor{Name: "transformer.ln_f.weight", Shape: []int{big.NEmbd}, Data: make([]float32, big.NEmbd)}
	meta := model.CheckpointMeta(big, 8)
	meta["config"] = string(bigJSON)
	if err := safetensors.Write(&poison, []safetensors.Tensor{lnf}, meta); err != nil {
		t.Fatal(err)
	}
	ck := r.plantPoison(t, poison.Bytes())
	// The job loop reads the newest complete checkpoint for /api/sample from the published
	// status.
	r.srv.status.Store(&Status{Job: &JobStatus{ID: r.jobID.String()}, Peers: []PeerStatus{}})

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := r.srv.assemble(context.Background(), ck)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "not the job's model") {
		t.Errorf("assemble = %v, want an error about the config", err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 32<<20 {
		t.Errorf("assembling the poisoned checkpoint allocated %d MiB", alloc>>20)
	}
	for _, path := range []string{"/api/sample", fmt.Sprintf("/api/checkpoints/%d/model", ck.ID)} {
		req, _ := http.NewRequest(http.MethodGet, r.url+path, nil)
		req.Header.Set("Authorization", "Bearer upload-test-admin-token")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct{ Error string }
		json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(body.Error, fmt.Sprintf("assemble checkpoint %d", ck.ID)) {
			t.Errorf("GET %s: %d %q, want 500 naming the checkpoint", path, resp.StatusCode, body.Error)
		}
	}
}

// Other planted blobs: the job's config, but not a file the model could come from.
func TestAssembleRefusesBadBlobs(t *testing.T) {
	r := newUploadRig(t, Config{})
	cfg := r.spec.Model
	whole, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	file := func(ts []safetensors.Tensor, meta map[string]string) []byte {
		var b bytes.Buffer
		if err := safetensors.Write(&b, ts, meta); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	all := model.CheckpointTensors(whole.P, whole.Opt)
	meta := model.CheckpointMeta(cfg, 8)
	big := 3 * 4 * int64(whole.P.NumElements())
	for _, tc := range []struct {
		name, want string
		file       []byte
	}{
		{"larger than the model", "more than the whole model", append(file(all, meta), make([]byte, big)...)},
		{"foreign tensor", "is not one this file may hold", file([]safetensors.Tensor{{Name: "evil", Shape: []int{4}, Data: make([]float32, 4)}}, meta)},
		{"wrong shape", "has shape", file([]safetensors.Tensor{{Name: "transformer.ln_f.bias", Shape: []int{1, cfg.NEmbd}, Data: make([]float32, cfg.NEmbd)}}, meta)},
		{"a tensor short", "no shard holds", file(all[1:], meta)},
		{"other step", "metadata step", file(all, model.CheckpointMeta(cfg, 7))},
		{"not safetensors", "header", []byte("<html>")},
	} {
		ck := r.plantPoison(t, tc.file)
		if _, err := r.srv.assemble(context.Background(), ck); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: assemble = %v, want an error with %q", tc.name, err, tc.want)
		}
	}
	// The whole model as one shard assembles.
	ck := r.plantPoison(t, file(all, meta))
	if _, err := r.srv.assemble(context.Background(), ck); err != nil {
		t.Errorf("whole model: %v", err)
	}
}

// Refused uploads used to stay, and blobs were collected only with retention configured. Now
// nothing refused is stored, and collectBlobs (after every checkpoint) removes what no
// checkpoint references, keeping the assembled files the job loop hands out and anything young.
func TestCollectBlobs(t *testing.T) {
	r := newUploadRig(t, Config{})
	ctx := context.Background()
	if code, msg := r.post(t, "stage-0", r.a.Session, r.stage); code != http.StatusNoContent {
		t.Fatalf("upload: %d %q", code, msg)
	}
	_, shard := r.landed(t, "stage-0")
	put := func(s string) string {
		sha, _, err := r.srv.blobs.Put(ctx, strings.NewReader(s))
		if err != nil {
			t.Fatal(err)
		}
		return sha
	}
	orphan, assembled, young := put("orphan"), put("assembled"), put("young orphan")
	old := time.Now().Add(-2 * time.Hour)
	for _, sha := range []string{shard, orphan, assembled} {
		if err := os.Chtimes(filepath.Join(r.srv.blobs.Dir(), sha[:2], sha), old, old); err != nil {
			t.Fatal(err)
		}
	}
	r.srv.collectBlobs(ctx, map[string]bool{assembled: true})
	for sha, want := range map[string]bool{shard: true, assembled: true, young: true, orphan: false} {
		if has, _ := r.srv.blobs.Has(sha); has != want {
			t.Errorf("blob %s… kept %v, want %v", sha[:8], has, want)
		}
	}
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
