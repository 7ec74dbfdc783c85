package client

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// A restore reads the blobs CheckpointRef.Blobs names: the shards of the checkpoint (each a
// safetensors file as a worker uploaded it, named by its sha256) that hold the tensors this shard
// reads — its own stage's shard where the checkpoint was cut as the plan is, the shards its
// blocks are in where it was not. A blob may hold more than the shard needs. Each comes from the coordinator,
// which a volunteer does not trust with its machine (coordhttp.go), so it is read as a stream and
// never held: everything about reading it is decided by the job's model config, as the
// coordinator decides about a worker's upload (coordinator/checkpoint.go). The header is read
// entry by entry, each checked against the tensors a checkpoint of the job may hold, with their
// shapes; the shard's tensors are decoded straight into the shard (or, in outer mode, into the
// few tensors its restore reads), the rest is skipped; the whole stream is hashed and must be the
// blob it was named by; and it may be no longer than its header says, nor than the job's bound.
// What a restore costs is the shard, whatever the coordinator sends: no disk, no copy of the
// blob, and a blob that never ends, or claims to be huge, is cut off at the bound.

const (
	// headerPerTensor and headerSlack bound a checkpoint's JSON header: an entry beyond its name
	// with every number at its longest, and the braces, metadata and padding (as
	// coordinator/checkpoint.go bounds them for uploads).
	headerPerTensor = 160
	headerSlack     = 4096
	// headerValueMax bounds one key or value of a restore blob's header as it is decoded: an honest
	// entry is under a kilobyte.
	headerValueMax = 64 << 10
)

// blobLayout is what a restore blob of a job may hold — the whole model's parameters, under the
// prefixes a checkpoint of the job's sync mode uses — and the bounds that follow from it.
type blobLayout struct {
	specs map[string][]int // the model's parameters, by name
	// global are the prefixes of the whole-model part; replica those under model.ReplicaPrefix(r)
	// for r < proto.MaxReplicas (outer mode only).
	global, replica []string
	header, data    int64 // the longest header, the most data
}

func newBlobLayout(spec job.Spec) *blobLayout {
	l := &blobLayout{specs: map[string][]int{}, global: []string{"", optimM, optimV}}
	int8 := spec.Sync != nil && spec.Sync.Compress == "int8"
	if spec.Outer() {
		l.global = []string{"", model.OuterMomentumPrefix}
		if int8 {
			l.global = append(l.global, model.OuterErrPrefix)
		}
		l.replica = []string{"", optimM, optimV, model.ReplicaSnapPrefix}
		if int8 {
			l.replica = append(l.replica, model.ReplicaErrPrefix)
		}
	}
	var names, data, n int64
	for _, sp := range spec.Model.Specs() {
		l.specs[sp.Name] = sp.Shape
		names += int64(len(sp.Name))
		data += 4 * int64(sp.Size())
		n++
	}
	// The replicas of an outer-mode blob are those of the plan it was taken under, which may
	// have had more than this one: any a plan may have.
	for _, p := range l.global {
		l.header += n*(int64(len(p))+headerPerTensor) + names
		l.data += data
	}
	pre := int64(len(model.ReplicaPrefix(proto.MaxReplicas - 1)))
	for _, p := range l.replica {
		l.header += proto.MaxReplicas * (n*(pre+int64(len(p))+headerPerTensor) + names)
		l.data += proto.MaxReplicas * data
	}
	l.header = min(l.header+headerSlack, safetensors.MaxHeader)
	return l
}

// optimM and optimV are the prefixes of Adam's moments in a checkpoint (model.CheckpointTensors).
const (
	optimM = "optim.m."
	optimV = "optim.v."
)

// bound is the longest blob of the layout.
func (l *blobLayout) bound() int64 { return 8 + l.header + l.data }

// shape is the shape of the tensor a checkpoint of the layout holds under name; false when it
// holds none.
func (l *blobLayout) shape(name string) ([]int, bool) {
	prefixes := l.global
	if rest, ok := strings.CutPrefix(name, "replica."); ok && len(l.replica) > 0 {
		i := strings.IndexByte(rest, '.')
		r, err := strconv.Atoi(rest[:max(i, 0)])
		if i < 0 || err != nil || r < 0 || r >= proto.MaxReplicas || strconv.Itoa(r) != rest[:i] {
			return nil, false
		}
		name, prefixes = rest[i+1:], l.replica
	}
	for _, p := range prefixes {
		if s, ok := strings.CutPrefix(name, p); ok {
			if shape, ok := l.specs[s]; ok {
				return shape, true
			}
		}
	}
	return nil, false
}

// blobError is a restore blob refused: the bound it broke, or what was wrong with it.
type blobError struct{ msg string }

func (e *blobError) Error() string { return e.msg }

func blobErr(f string, a ...any) error { return &blobError{fmt.Sprintf(f, a...)} }

// boundReader fails a read past a blob's bound instead of returning the bytes.
type boundReader struct {
	r     io.Reader
	bound int64
	n     int64
}

func (b *boundReader) Read(p []byte) (int, error) {
	// Up to one byte past the bound is read, to tell a blob of the bound's length from a longer one.
	if rest := b.bound + 1 - b.n; int64(len(p)) > rest {
		p = p[:max(rest, 0)]
	}
	n, err := b.r.Read(p)
	if b.n += int64(n); b.n > b.bound {
		return 0, blobErr("cut off past the bound of %d bytes a checkpoint of this job can hold (the model's parameters and Adam moments, and a header)", b.bound)
	}
	return n, err
}

// windowReader fails once more than its window has been read since the last reset: it bounds what
// a JSON decoder buffers for one token.
type windowReader struct {
	r    io.Reader
	left int
}

func (w *windowReader) reset() { w.left = headerValueMax }

func (w *windowReader) Read(p []byte) (int, error) {
	if w.left <= 0 {
		return 0, blobErr("header entry longer than %d bytes", headerValueMax)
	}
	if len(p) > w.left {
		p = p[:w.left]
	}
	n, err := w.r.Read(p)
	w.left -= n
	return n, err
}

// wanted is a tensor of the blob that the restore reads: where in the data section, and into what.
type wanted struct {
	name       string
	begin, end int64
	dst        []float32
}

// readBlob reads a restore blob of layout l from r, which must hash to sha: the tensors for which
// want returns a slice are decoded into it (called once per name, with the layout's shape, after
// the header checked it; nil skips the tensor), and the blob's metadata is returned. Nothing but
// those slices and one copy buffer is allocated for the blob, whatever r holds.
func readBlob(r io.Reader, l *blobLayout, sha string, want func(name string, shape []int) []float32) (map[string]string, error) {
	h := sha256.New()
	br := &boundReader{r: r, bound: l.bound()}
	tr := io.TeeReader(br, h)
	var n [8]byte
	if _, err := io.ReadFull(tr, n[:]); err != nil {
		return nil, fmt.Errorf("read the header's length: %w", err)
	}
	hn := binary.LittleEndian.Uint64(n[:])
	if hn > uint64(l.header) {
		return nil, blobErr("header of %d bytes, past the bound of %d a checkpoint of this job can have", hn, l.header)
	}
	win := &windowReader{r: io.LimitReader(tr, int64(hn))}
	win.reset()
	dec := json.NewDecoder(win)
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, blobErr("header is not a JSON object (%v)", err)
	}
	var meta map[string]string
	var reads []wanted
	seen := map[string]bool{} // the wanted names only: the others are never held
	var total, end int64
	for dec.More() {
		win.reset()
		t, err := dec.Token()
		if err != nil {
			return nil, blobErr("header: %v", err)
		}
		name, _ := t.(string)
		win.reset()
		if name == "__metadata__" {
			if meta != nil {
				return nil, blobErr("header: __metadata__ twice")
			}
			if err := dec.Decode(&meta); err != nil {
				return nil, blobErr("header: __metadata__ must map strings to strings: %v", err)
			}
			continue
		}
		var e struct {
			DType   string   `json:"dtype"`
			Shape   []int    `json:"shape"`
			Offsets [2]int64 `json:"data_offsets"`
		}
		if err := dec.Decode(&e); err != nil {
			return nil, blobErr("header: %s: %v", name, err)
		}
		shape, ok := l.shape(name)
		switch {
		case !ok:
			return nil, blobErr("tensor %q is not one a checkpoint of this job holds", name)
		case e.DType != "F32":
			return nil, blobErr("tensor %s: dtype %s, want F32", name, e.DType)
		case !slices.Equal(e.Shape, shape):
			return nil, blobErr("tensor %s: shape %v, the job's model has %v", name, e.Shape, shape)
		}
		size := int64(4)
		for _, d := range shape {
			size *= int64(d)
		}
		lo, hi := e.Offsets[0], e.Offsets[1]
		if lo < 0 || hi-lo != size {
			return nil, blobErr("tensor %s: data_offsets [%d,%d) for %d bytes", name, lo, hi, size)
		}
		if total += size; total > l.data {
			return nil, blobErr("header describes more than the %d bytes of data a checkpoint of this job can hold", l.data)
		}
		end = max(end, hi)
		if seen[name] {
			return nil, blobErr("tensor %s twice in the header", name)
		}
		if dst := want(name, shape); dst != nil {
			if int64(len(dst))*4 != size {
				return nil, fmt.Errorf("tensor %s: %d values to restore into, the blob has %d", name, len(dst), size/4)
			}
			seen[name] = true
			reads = append(reads, wanted{name, lo, hi, dst})
		}
	}
	win.reset()
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return nil, blobErr("header: unterminated object (%v)", err)
	}
	win.reset()
	if _, err := dec.Token(); err != io.EOF {
		return nil, blobErr("header: more after its object (%v)", err)
	}
	// The entries tile the data section when they add up to its end and none overlaps: an
	// overlap among the tensors read would decode one tensor's bytes as another's, and among the
	// others it only makes the blob shorter.
	if total != end {
		return nil, blobErr("header's tensors cover %d bytes of a data section of %d", total, end)
	}
	sort.Slice(reads, func(i, j int) bool { return reads[i].begin < reads[j].begin })
	var pos int64
	buf := make([]byte, 64<<10)
	for _, w := range reads {
		if w.begin < pos {
			return nil, blobErr("tensor %s overlaps another", w.name)
		}
		if _, err := io.CopyN(io.Discard, tr, w.begin-pos); err != nil {
			return nil, fmt.Errorf("read the data section: %w", err)
		}
		for off := w.begin; off < w.end; {
			k := min(int64(len(buf)), w.end-off)
			if _, err := io.ReadFull(tr, buf[:k]); err != nil {
				return nil, fmt.Errorf("read tensor %s: %w", w.name, err)
			}
			safetensors.DecodeF32(w.dst[(off-w.begin)/4:], buf[:k])
			off += k
		}
		pos = w.end
	}
	if _, err := io.CopyN(io.Discard, tr, end-pos); err != nil {
		return nil, fmt.Errorf("read the data section: %w", err)
	}
	// The stream must end where the header says the blob does.
	var one [1]byte
	if k, err := io.ReadFull(tr, one[:]); k > 0 {
		return nil, blobErr("the blob goes on past the %d bytes its header describes", 8+int64(hn)+end)
	} else if err != io.EOF {
		return nil, fmt.Errorf("read the end of the blob: %w", err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sha {
		return nil, blobErr("its sha256 is %s, not the %s it was named by", got, sha)
	}
	return meta, nil
}

// restore loads the shard's tensors and optimizer state from the coordinator's assembled
// checkpoint blob — in outer mode (outer set) the replica's own and the global state.
//
// An outer-mode job with a synchronous warm-up (job.Sync.Warmup W) starts outer mode from the
// warm-up's checkpoint after step W, a step-mode one (job.Spec.StatePhase): the replica takes its
// parameters and AdamW's moments from it, and the outer state starts from them (warmStart).
func (s *session) restore(ctx context.Context, spec job.Spec, sh *model.Shard, ref *proto.CheckpointRef, outer *StageRunner) error {
	w := spec.SyncWarmup()
	warm := outer != nil && w > 0 && int(ref.Step) <= w
	if warm && int(ref.Step) != w {
		return fmt.Errorf("a checkpoint after step %d is the synchronous warm-up's, which outer mode starts from only at its end, step %d", ref.Step, w)
	}
	l := newBlobLayout(spec.StatePhase(int(ref.Step)))
	var read func(string, []int) []float32
	into := map[string][]float32{}
	got := map[string]bool{}
	ck := &model.Checkpoint{Cfg: sh.Cfg, Step: int(ref.Step), Tensors: map[string]safetensors.Tensor{}}
	if outer == nil || warm {
		// Straight into the shard: a blob that fails a check later leaves it half written, and
		// the assignment fails with it.
		for i, t := range sh.P.Tensors {
			into[t.Name] = t.Data
			if sh.Opt != nil {
				into[optimM+t.Name], into[optimV+t.Name] = sh.Opt.M.Tensors[i].Data, sh.Opt.V.Tensors[i].Data
			}
		}
		read = func(name string, _ []int) []float32 {
			v := into[name]
			if v != nil {
				got[name] = true
			}
			return v
		}
	} else {
		// What outerRestore reads: the global part and this replica's, for this stage's tensors.
		pre := model.ReplicaPrefix(outer.Replica.Index)
		for _, t := range sh.P.Tensors {
			for _, p := range l.global {
				into[p+t.Name] = nil
			}
			for _, p := range l.replica {
				into[pre+p+t.Name] = nil
			}
		}
		read = func(name string, shape []int) []float32 {
			if _, ok := into[name]; !ok {
				return nil
			}
			got[name] = true
			n := 1
			for _, d := range shape {
				n *= d
			}
			v := make([]float32, n)
			ck.Tensors[name] = safetensors.Tensor{Name: name, Shape: shape, Data: v}
			return v
		}
	}
	// Each blob must add a tensor the restore reads that none before it did (an honest
	// coordinator picks each shard for the tensors it adds): so no more blobs than such tensors
	// are read, whatever the coordinator lists.
	if len(ref.Blobs) > len(into) {
		return fmt.Errorf("restore: the coordinator lists %d checkpoint blobs for a shard that reads %d tensors", len(ref.Blobs), len(into))
	}
	// And all of them together no more than one checkpoint of the job (the shards of an honest
	// list are distinct parts of one), each with a header of its own.
	left := l.bound() + int64(len(ref.Blobs))*(8+headerSlack)
	for _, blob := range ref.Blobs {
		before := len(got)
		var meta map[string]string
		err := s.download(ctx, "/blobs/"+blob, min(l.bound(), left), func(r io.Reader) error {
			all := &boundReader{r: r, bound: left}
			var err error
			meta, err = readBlob(all, l, blob, read)
			left -= all.n
			return err
		})
		if err != nil {
			return fmt.Errorf("restore from checkpoint blob %s: %w", blob, err)
		}
		if meta["step"] != fmt.Sprint(ref.Step) {
			return fmt.Errorf("checkpoint blob %s says step %q, the coordinator said %d", blob, meta["step"], ref.Step)
		}
		if len(got) == before {
			return fmt.Errorf("checkpoint blob %s holds no tensor of this shard that the blobs before it did not", blob)
		}
	}
	if outer != nil && !warm {
		if err := outer.outerRestore(ck); err != nil {
			return err
		}
	} else {
		for _, t := range sh.P.Tensors {
			for _, name := range []string{t.Name, optimM + t.Name, optimV + t.Name} {
				if into[name] != nil && !got[name] {
					return fmt.Errorf("the checkpoint after step %d lacks %s", ref.Step, name)
				}
			}
		}
	}
	if warm {
		if err := outer.Outer.warmStart(sh.P); err != nil {
			return err
		}
	}
	sh.Push() // the host mirror → the device the shard computes on
	return nil
}

// download GETs path from the coordinator and hands its body to read: refused up front when the
// coordinator advertises more than bound bytes, and cut when no byte arrives for the stall
// timeout (read bounds what it reads itself).
func (s *session) download(ctx context.Context, path string, bound int64, read func(io.Reader) error) error {
	ctx, touch, stop := watch(ctx, s.stall())
	defer stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(s.cfg.Coordinator, "/")+path, nil)
	if err != nil {
		return err
	}
	s.authorize(req)
	resp, err := s.http.Do(req)
	if err != nil {
		return stallErr(ctx, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, strings.TrimSpace(string(msg)))
	}
	if resp.ContentLength > bound {
		return blobErr("the coordinator advertises %d bytes, past the bound of %d a checkpoint of this job can hold (the model's parameters and Adam moments, and a header)", resp.ContentLength, bound)
	}
	return stallErr(ctx, read(&progressReader{r: resp.Body, touch: touch}))
}
