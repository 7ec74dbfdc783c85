package coordinator

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// Checkpoint files come from untrusted peers, so everything about reading one is decided by the
// job — its model config — and never by the file: which tensors it may hold, their shapes, how
// long its header and its data may be. A file is checked against that layout before anything is
// allocated for it (issue 14: a shard whose metadata asked for 16,384 channels made the
// coordinator allocate ~100 GB while assembling).

// Adam's moments travel beside each parameter under these prefixes (docs/design.md, "Checkpoints and storage"; what
// model.CheckpointTensors writes).
var momentPrefixes = []string{"optim.m.", "optim.v."}

const (
	// headerPerTensor bounds one tensor's entry in a JSON header beyond its name:
	// {"dtype":"F32","shape":[…],"data_offsets":[…,…]} with every number at its longest.
	headerPerTensor = 160
	// headerSlack bounds the rest of a header: braces, __metadata__ (the config, the step, the
	// format) and the padding to 8 bytes.
	headerSlack = 4096
)

// ckptLayout is what a checkpoint file of a job may hold after a given step.
type ckptLayout struct {
	cfg    model.Config
	step   int64
	names  []string         // parameters, then optim.m.*, then optim.v.*: the order of model.CheckpointTensors
	shapes map[string][]int // by name
	data   int64            // bytes of every tensor's values
	header int64            // the longest JSON header a writer of these tensors produces
}

// newLayout is the layout of a file holding the parameters specs of cfg and their moments.
func newLayout(cfg model.Config, step int64, specs []model.Spec) *ckptLayout {
	return newLayoutPrefixed(cfg, step, specs, append([]string{""}, momentPrefixes...))
}

// newLayoutPrefixed is the layout of a file holding specs under each of prefixes, in that order.
func newLayoutPrefixed(cfg model.Config, step int64, specs []model.Spec, prefixes []string) *ckptLayout {
	l := &ckptLayout{cfg: cfg, step: step, shapes: make(map[string][]int, len(prefixes)*len(specs)), header: headerSlack}
	for _, prefix := range prefixes {
		for _, sp := range specs {
			name := prefix + sp.Name
			l.names = append(l.names, name)
			l.shapes[name] = sp.Shape
			l.data += 4 * int64(sp.Size())
			l.header += int64(len(name)) + headerPerTensor
		}
	}
	return l
}

// maxFile is the longest file of the layout.
func (l *ckptLayout) maxFile() int64 { return 8 + l.header + l.data }

// checkMeta checks a file's __metadata__: the keys model.CheckpointMeta writes and no others,
// a config equal to the job's in every key, and the step.
func (l *ckptLayout) checkMeta(meta map[string]string) error {
	want := model.CheckpointMeta(l.cfg, int(l.step))
	for k, v := range meta {
		w, ok := want[k]
		switch {
		case !ok:
			return fmt.Errorf("metadata key %q: a checkpoint's metadata holds only config, step and format", k)
		case k == "config":
			cfg, err := model.ParseConfig([]byte(v))
			if err != nil {
				return fmt.Errorf("metadata config: %w", err)
			}
			if cfg != l.cfg {
				return fmt.Errorf("metadata config %s is not the job's model %s", v, w)
			}
		case k == "step":
			if v != w {
				return fmt.Errorf("metadata step %q, the checkpoint is after step %s", v, w)
			}
		case v != w:
			return fmt.Errorf("metadata %s %q, want %q", k, v, w)
		}
	}
	for _, k := range []string{"config", "step"} {
		if _, ok := meta[k]; !ok {
			return fmt.Errorf("metadata lacks %q", k)
		}
	}
	return nil
}

// checkHeader checks that every tensor of h belongs to the layout with its shape (safetensors
// already checked F32 and that the offsets tile the data), and, when exact, that h holds every
// tensor of the layout.
func (l *ckptLayout) checkHeader(h safetensors.Header, exact bool) error {
	if err := l.checkMeta(h.Meta); err != nil {
		return err
	}
	for _, e := range h.Tensors {
		shape, ok := l.shapes[e.Name]
		if !ok {
			return fmt.Errorf("tensor %q is not one this file may hold", e.Name)
		}
		if !slices.Equal(shape, e.Shape) {
			return fmt.Errorf("tensor %s has shape %v, want %v", e.Name, e.Shape, shape)
		}
	}
	if exact && len(h.Tensors) != len(l.names) {
		// Names in a header are unique (the keys of a JSON object) and all known, so a count
		// short of the layout's means a tensor is missing.
		have := make(map[string]bool, len(h.Tensors))
		for _, e := range h.Tensors {
			have[e.Name] = true
		}
		for _, n := range l.names {
			if !have[n] {
				return fmt.Errorf("lacks tensor %s (%d of %d tensors present)", n, len(h.Tensors), len(l.names))
			}
		}
	}
	return nil
}

// outerPrefixes are the prefixes of an outer-mode checkpoint (model.OuterCheckpointGlobal and
// OuterCheckpointReplica): the global part when global, and replica r's part for r in replicas —
// with its snapshot (model.OuterCheckpointSnap) when a delayed outer step is pending.
func outerPrefixes(global bool, replicas []int, int8, pending bool) []string {
	var out []string
	if global {
		out = append(out, "", model.OuterMomentumPrefix)
		if int8 {
			out = append(out, model.OuterErrPrefix)
		}
	}
	for _, r := range replicas {
		pre := model.ReplicaPrefix(r)
		out = append(out, pre, pre+momentPrefixes[0], pre+momentPrefixes[1])
		if int8 {
			out = append(out, pre+model.ReplicaErrPrefix)
		}
		if pending {
			out = append(out, pre+model.ReplicaSnapPrefix)
		}
	}
	return out
}

// pendingAt reports whether a checkpoint after done steps of spec holds the replicas' snapshots
// of a delayed outer step not yet taken up (job.Spec.OuterPending).
func pendingAt(spec job.Spec, done int64) bool {
	_, pending := spec.OuterPending(int(done))
	return pending
}

// outerShardName is the checkpoint shard of replica r's stage i in outer mode: the first
// replica's keep a plan of one pipeline's names.
func outerShardName(r, i int) string {
	if r == 0 {
		return fmt.Sprintf("stage-%d", i)
	}
	return fmt.Sprintf("r%d-stage-%d", r, i)
}

// outerReplicas are the replicas the shards of an outer-mode checkpoint come from, ascending:
// every replica of the plan but those dropped from it (sched.DropReplica), whose state is gone.
func outerReplicas(shards []storage.Shard) []int {
	var out []int
	for _, sh := range shards {
		r, i := 0, 0
		if k, _ := fmt.Sscanf(sh.Name, "r%d-stage-%d", &r, &i); k != 2 || r < 1 || r >= proto.MaxReplicas {
			r = 0
		}
		if !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	slices.Sort(out)
	return out
}

// shardSpecs lists the parameters of a checkpoint shard as a worker holds them — the specs
// model.NewStageShardWith and NewExpertShard allocate: a stage's own tensors plus the experts of
// its MoE blocks that no expert shard holds (hosted reports those that one does), or an expert
// shard's experts.
// hostedBy reports, for shardSpecs, whether expert e of block blk lives on one of hosts (a stage's
// Assign.ExpertHosts) rather than with its stage.
func hostedBy(hosts []proto.ExpertHost) func(blk, e int) bool {
	hosted := make(map[[2]int]bool, len(hosts))
	for _, h := range hosts {
		hosted[[2]int{h.Block, h.Expert}] = true
	}
	return func(blk, e int) bool { return hosted[[2]int{blk, e}] }
}

func shardSpecs(cfg model.Config, sh proto.Shard, hosted func(blk, e int) bool) ([]model.Spec, error) {
	switch {
	case sh.Stage != nil:
		lo, hi := sh.Stage.Begin, sh.Stage.End
		if lo < 0 || hi > cfg.NLayer || lo >= hi {
			return nil, fmt.Errorf("stage blocks [%d,%d) outside [0,%d)", lo, hi, cfg.NLayer)
		}
		return cfg.StageShardSpecs(lo, hi, func(blk, e int) bool { return !hosted(blk, e) }), nil
	case sh.Experts != nil:
		blk := sh.Experts.Block
		if blk < 0 || blk >= cfg.NLayer || !cfg.IsMoE(blk) {
			return nil, fmt.Errorf("block %d is not an MoE block", blk)
		}
		var specs []model.Spec
		seen := map[int]bool{}
		for _, e := range sh.Experts.Experts {
			if e < 0 || e >= cfg.NExpert || seen[e] {
				return nil, fmt.Errorf("block %d: expert %d out of range or repeated", blk, e)
			}
			seen[e] = true
			specs = append(specs, cfg.ExpertSpecs(blk, e)...)
		}
		return specs, nil
	}
	return nil, errors.New("shard is neither a stage nor experts")
}

// expertKey is one expert of one MoE block.
type expertKey struct{ block, expert int }

// hostedExperts returns the experts that expert shards of checkpoint ck hold, which the plan's
// stages therefore do not. The slots still pending say it for the shards not landed yet; a landed
// shard's slot is gone, so its (already checked) file says it: an expert shard holds nothing but
// expert tensors. The slots are read before the store, and a shard is recorded before its slot is
// removed, so a shard landing meanwhile is seen on one side or the other.
func (s *Server) hostedExperts(ctx context.Context, ck int64, cfg model.Config) (map[expertKey]bool, error) {
	hosted := map[expertKey]bool{}
	pending := s.slots.of(ck)
	for _, sl := range pending {
		if ex := sl.Shard.Experts; ex != nil {
			for _, e := range ex.Experts {
				hosted[expertKey{ex.Block, e}] = true
			}
		}
	}
	rec, err := s.db.Checkpoint(ctx, ck)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %d: %w", ck, err)
	}
	whole := newLayout(cfg, rec.Step, cfg.Specs())
	for _, sh := range rec.Shards {
		if _, ok := pending[sh.Name]; ok || !sh.Landed() {
			continue
		}
		f, err := s.blobs.Open(sh.SHA256)
		if err != nil {
			return nil, fmt.Errorf("shard %s of checkpoint %d: %w", sh.Name, ck, err)
		}
		h, err := safetensors.ReadHeader(bufio.NewReader(f), whole.header)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("shard %s of checkpoint %d: %w", sh.Name, ck, err)
		}
		experts := map[expertKey]bool{}
		for _, e := range h.Tensors {
			k, ok := expertOf(e.Name)
			if !ok {
				experts = nil // a stage: its experts are its own, not hosted
				break
			}
			experts[k] = true
		}
		for k := range experts {
			hosted[k] = true
		}
	}
	return hosted, nil
}

// expertOf parses the block and expert of an expert tensor's checkpoint name.
func expertOf(name string) (expertKey, bool) {
	for _, p := range momentPrefixes {
		name = strings.TrimPrefix(name, p)
	}
	var k expertKey
	var rest string
	if n, _ := fmt.Sscanf(name, "transformer.h.%d.mlp.experts.%d.%s", &k.block, &k.expert, &rest); n != 3 {
		return expertKey{}, false
	}
	return k, strings.HasPrefix(name, model.ExpertPrefix(k.block, k.expert))
}

// jobModel is the model config of job id, as its spec in the store says.
func (s *Server) jobModel(ctx context.Context, id uuid.UUID) (model.Config, error) {
	spec, err := s.jobSpec(ctx, id)
	return spec.Model, err
}

// jobSpec is job id's spec in the store.
func (s *Server) jobSpec(ctx context.Context, id uuid.UUID) (job.Spec, error) {
	jb, err := s.db.Job(ctx, id)
	if err != nil {
		return job.Spec{}, fmt.Errorf("job %s: %w", id, err)
	}
	spec, err := job.Parse(jb.Spec)
	if err != nil {
		return job.Spec{}, fmt.Errorf("job %s: %w", id, err)
	}
	return spec, nil
}

// assembleOuter is assemble for an outer-mode job: the file holds the global θ under the
// tensors' own names (what `shoal eval` and `shoal sample` read), the outer optimizer's state and
// every replica's own (model.OuterCheckpointGlobal, OuterCheckpointReplica), each checked against
// the job's model as assemble checks a plan of one pipeline's.
func (s *Server) assembleOuter(ctx context.Context, ck storage.Checkpoint, spec job.Spec, store *storage.BlobStore) (string, error) {
	cfg := spec.Model
	reps := outerReplicas(ck.Shards)
	l := newLayoutPrefixed(cfg, ck.Step, cfg.Specs(), outerPrefixes(true, reps, spec.Sync.Compress == "int8", pendingAt(spec, ck.Step)))
	if err := s.checkShards(ck.Shards, l); err != nil {
		return "", err
	}
	return s.writeAssembled(ctx, ck, l, store)
}

// writeAssembled writes the whole-model file of layout l from the checkpoint's shards into store
// (and, when OutDir is set, copies it there as ckpt-NNNNNN.safetensors), one tensor at a time.
// Every shard's blob is read once through its hash and its values checked finite before anything
// is written (as checkShards checked their headers); then each tensor of l, in l's order, is
// copied from the shard that holds it (the last to, where two do) straight from the blob's
// bytes. The coordinator holds a few buffers, not the model: a whole-model assembly of the 1B
// model's checkpoint used to take 12 GB (20 in outer mode) of its memory.
func (s *Server) writeAssembled(ctx context.Context, ck storage.Checkpoint, l *ckptLayout, store *storage.BlobStore) (string, error) {
	type at struct {
		shard      int   // index in ck.Shards
		off, bytes int64 // in the shard's blob
	}
	where := make(map[string]at, len(l.names))
	for i, sh := range ck.Shards {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		h, err := s.verifyShard(sh, l)
		if err != nil {
			return "", fmt.Errorf("shard %s: %w", sh.Name, err)
		}
		for _, e := range h.Tensors {
			where[e.Name] = at{shard: i, off: 8 + h.Len + e.Begin, bytes: e.End - e.Begin}
		}
	}
	layout := make([]safetensors.Tensor, len(l.names))
	for i, n := range l.names {
		w, ok := where[n]
		if !ok {
			return "", fmt.Errorf("no shard holds %s", n)
		}
		if size := 4 * int64(safetensors.Elements(l.shapes[n])); w.bytes != size {
			return "", fmt.Errorf("shard %s: %s is %d bytes, want %d", ck.Shards[w.shard].Name, n, w.bytes, size)
		}
		layout[i] = safetensors.Tensor{Name: n, Shape: l.shapes[n]}
	}
	// One shard's blob open at a time: l's order takes a shard's tensors one after another (its
	// blocks' parameters, then their moments), so a job of a thousand shards does not hold a
	// thousand files open.
	var open *os.File
	openShard := -1
	defer func() {
		if open != nil {
			open.Close()
		}
	}()
	w, err := store.Create()
	if err != nil {
		return "", err
	}
	defer w.Abort()
	bw := bufio.NewWriterSize(w, 1<<20)
	if err := safetensors.WriteHeader(bw, layout, model.CheckpointMeta(l.cfg, int(l.step))); err != nil {
		return "", err
	}
	for _, n := range l.names {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		at := where[n]
		if at.shard != openShard {
			if open != nil {
				open.Close()
			}
			if open, err = s.blobs.Open(ck.Shards[at.shard].SHA256); err != nil {
				return "", err
			}
			openShard = at.shard
		}
		if _, err := io.Copy(bw, io.NewSectionReader(open, at.off, at.bytes)); err != nil {
			return "", fmt.Errorf("shard %s, %s: %w", ck.Shards[at.shard].Name, n, err)
		}
	}
	if err := bw.Flush(); err != nil {
		return "", err
	}
	sha, _, err := w.Commit()
	if err != nil {
		return "", err
	}
	if s.cfg.OutDir != "" {
		if err := copyBlob(store, sha, filepath.Join(s.cfg.OutDir, local.CheckpointName(int(l.step)))); err != nil {
			return "", err
		}
	}
	return sha, nil
}

// copyBlob writes blob sha of store to path, through a temporary file renamed into place.
func copyBlob(store *storage.BlobStore, sha, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	src, err := store.Open(sha)
	if err != nil {
		return err
	}
	defer src.Close()
	tmp, err := os.CreateTemp(filepath.Dir(path), ".ckpt-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, src); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// chunkBytes is how much of a tensor's data is read at a time: a multiple of 4.
const chunkBytes = 64 << 10

// errNonFinite is wrapped by the error about a NaN or an infinity in a checkpoint.
var errNonFinite = errors.New("value not finite")

// readTensors reads the data section that follows header h in r, tensor by tensor in file order,
// refusing a value that is not finite. put, when not nil, receives each tensor's values chunk by
// chunk at their element offset; it is called only with the tensors of h.
func readTensors(r io.Reader, h safetensors.Header, put func(e safetensors.Entry, at int64, v []float32)) error {
	buf := make([]byte, chunkBytes)
	var vals []float32
	if put != nil {
		vals = make([]float32, chunkBytes/4)
	}
	for _, e := range h.Tensors {
		for at := e.Begin; at < e.End; {
			n := min(int64(len(buf)), e.End-at)
			b := buf[:n]
			if _, err := io.ReadFull(r, b); err != nil {
				return fmt.Errorf("tensor %s: %w", e.Name, err)
			}
			for i := 0; i < len(b); i += 4 {
				// An exponent of all ones is an infinity or a NaN.
				if binary.LittleEndian.Uint32(b[i:])&0x7f800000 == 0x7f800000 {
					return fmt.Errorf("tensor %s, value %d: %w", e.Name, (at-e.Begin+int64(i))/4, errNonFinite)
				}
			}
			if put != nil {
				safetensors.DecodeF32(vals, b)
				put(e, (at-e.Begin)/4, vals[:n/4])
			}
			at += n
		}
	}
	return nil
}

// assemble builds the whole-model checkpoint file of a complete checkpoint — the union of its
// shards' tensors and optimizer state — stores it as a blob (the file workers restore from) and,
// when OutDir is set, writes it there as ckpt-NNNNNN.safetensors.
//
// The model is the job's (its spec in the store), not what a shard's metadata says. Every shard's
// blob is checked against it — size, header, metadata, each tensor's name and shape — before the
// model is allocated, and every tensor of the model must come from some shard: a file planted in
// the store gives an error, never a huge allocation or a half-restored model.
func (s *Server) assemble(ctx context.Context, ck storage.Checkpoint) (sha string, err error) {
	return s.assembleInto(ctx, ck, s.blobs)
}

// assembleInto is assemble storing the whole-model file in store rather than the coordinator's own
// store (Export's scratch store: an export must not leave a model-sized blob behind in the data
// directory, which nothing references and only a coordinator's hourly sweep would remove).
func (s *Server) assembleInto(ctx context.Context, ck storage.Checkpoint, store *storage.BlobStore) (sha string, err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("assemble checkpoint %d: %w", ck.ID, err)
		}
	}()
	if len(ck.Shards) == 0 {
		return "", errors.New("no shards")
	}
	spec, err := s.jobSpec(ctx, ck.JobID)
	if err != nil {
		return "", err
	}
	// The warm-up's checkpoints, up to the one outer mode starts from, are step mode's.
	spec = spec.StatePhase(int(ck.Step))
	cfg := spec.Model
	if spec.Outer() {
		return s.assembleOuter(ctx, ck, spec, store)
	}
	l := newLayout(cfg, ck.Step, cfg.Specs())
	if err := s.checkShards(ck.Shards, l); err != nil {
		return "", err
	}
	return s.writeAssembled(ctx, ck, l, store)
}

// checkShards checks every shard's header against the layout l of the whole checkpoint, and that
// together they hold every tensor of it: before anything is allocated for the assembly.
func (s *Server) checkShards(shards []storage.Shard, l *ckptLayout) error {
	covered := map[string]bool{}
	for _, sh := range shards {
		h, err := s.shardHeader(sh, l)
		if err != nil {
			return fmt.Errorf("shard %s: %w", sh.Name, err)
		}
		for _, e := range h.Tensors {
			covered[e.Name] = true
		}
	}
	for _, n := range l.names {
		if !covered[n] {
			return fmt.Errorf("no shard holds %s", n)
		}
	}
	return nil
}

// shardHeader checks a landed shard's blob against the whole model's layout l without reading
// its data: its size, then its header.
func (s *Server) shardHeader(sh storage.Shard, l *ckptLayout) (safetensors.Header, error) {
	if !sh.Landed() {
		return safetensors.Header{}, errors.New("not landed")
	}
	size, err := s.blobs.Size(sh.SHA256)
	if err != nil {
		return safetensors.Header{}, err
	}
	if size > l.maxFile() {
		return safetensors.Header{}, fmt.Errorf("blob %s is %d bytes, more than the whole model's checkpoint (%d)", sh.SHA256, size, l.maxFile())
	}
	f, err := s.blobs.Open(sh.SHA256)
	if err != nil {
		return safetensors.Header{}, err
	}
	defer f.Close()
	h, err := safetensors.ReadHeader(bufio.NewReader(f), l.header)
	if err != nil {
		return safetensors.Header{}, err
	}
	if err := l.checkHeader(h, false); err != nil {
		return safetensors.Header{}, err
	}
	if h.FileBytes() != size {
		return safetensors.Header{}, fmt.Errorf("header describes %d bytes, the blob has %d", h.FileBytes(), size)
	}
	return h, nil
}

// verifyShard reads a landed shard's blob through its hash, checking its header against l and
// its values finite, and returns its header: a blob damaged on disk is an error, not a model.
func (s *Server) verifyShard(sh storage.Shard, l *ckptLayout) (safetensors.Header, error) {
	f, err := s.blobs.OpenVerified(sh.SHA256)
	if err != nil {
		return safetensors.Header{}, err
	}
	defer f.Close()
	r := bufio.NewReaderSize(f, chunkBytes)
	h, err := safetensors.ReadHeader(r, l.header)
	if err != nil {
		return safetensors.Header{}, err
	}
	// shardHeader checked this header already; what is used is checked again all the same.
	if err := l.checkHeader(h, false); err != nil {
		return safetensors.Header{}, err
	}
	if err := readTensors(r, h, nil); err != nil {
		return safetensors.Header{}, err
	}
	// Reading to the end is what checks the hash.
	n, err := io.Copy(io.Discard, r)
	if err != nil {
		return safetensors.Header{}, err
	}
	if n > 0 {
		return safetensors.Header{}, fmt.Errorf("%d bytes after the last tensor", n)
	}
	return h, nil
}

// freeBlobs marks blobs this coordinator no longer needs — the shards of a checkpoint it deleted,
// an assembled file it dropped, an upload nothing records — for removal at the next collection,
// unless by then a checkpoint references them or the job loop holds them again.
func (s *Server) freeBlobs(shas ...string) {
	s.freedMu.Lock()
	defer s.freedMu.Unlock()
	for _, sha := range shas {
		if sha == "" {
			continue
		}
		if s.freed == nil {
			s.freed = map[string]bool{}
		}
		s.freed[sha] = true
	}
}

// collectBlobs removes the blobs that no checkpoint references and that the job loop does not
// hold (keep: the assembled whole-model files it hands to restoring workers). Those it freed
// (freeBlobs) go at once: retention has to bound the disk by the checkpoints it keeps, and a job
// that checkpoints often (a join replan takes one, and under churn joins come every few seconds)
// would otherwise hold an hour of them whatever the retention — half a gigabyte each for the
// default model in outer mode, with as much again for each assembled file a restore used. Every
// other unreferenced blob is spared while written in the last hour: a shard's blob is committed
// before the row that references it, an assembled file served for a download or the sample is
// referenced by nothing at all, and a blob of unknown origin (another process, a crash) gets the
// same grace.
func (s *Server) collectBlobs(ctx context.Context, keep map[string]bool) {
	s.removeFreed(ctx, keep)
	refs, err := s.db.ReferencedBlobs(ctx)
	if err != nil {
		s.log.Warn("collect blobs", "err", err)
		return
	}
	st, err := s.blobs.GC(ctx, func(sha string) bool { return refs[sha] || keep[sha] }, time.Now().Add(-time.Hour))
	if err != nil {
		s.log.Warn("collect blobs", "err", err)
		return
	}
	if st.Removed > 0 || st.Temps > 0 {
		s.log.Info("blobs collected", "removed", st.Removed, "bytes", st.RemovedBytes, "temps", st.Temps, "kept", st.Kept)
	}
}

// removeFreed removes the freed blobs that no checkpoint references and keep does not hold, under
// blobMu: an upload between its Commit and its AddShard may have just renamed the same bytes
// into place. A freed blob still wanted is forgotten; it is freed again when what wants it goes.
func (s *Server) removeFreed(ctx context.Context, keep map[string]bool) {
	s.freedMu.Lock()
	freed := s.freed
	s.freed = nil
	s.freedMu.Unlock()
	if len(freed) == 0 {
		return
	}
	s.blobMu.Lock()
	defer s.blobMu.Unlock()
	refs, err := s.db.ReferencedBlobs(ctx)
	if err != nil {
		s.log.Warn("collect freed blobs", "err", err)
		for sha := range freed {
			s.freeBlobs(sha) // the next collection tries again
		}
		return
	}
	n, bytes := 0, int64(0)
	for sha := range freed {
		if refs[sha] || keep[sha] {
			continue
		}
		size, err := s.blobs.Size(sha)
		if err != nil {
			continue // removed already (ErrNotFound), or not a blob name
		}
		if err := s.blobs.Remove(sha); err != nil {
			// A file open elsewhere on Windows, say: the hourly sweep takes it later.
			s.log.Warn("remove freed blob", "blob", sha, "err", err)
			continue
		}
		n, bytes = n+1, bytes+size
	}
	if n > 0 {
		s.log.Info("freed blobs removed", "removed", n, "bytes", bytes)
	}
}
