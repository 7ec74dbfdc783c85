package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// The chain of custody (issue 32). An audit checks a step from the state its worker says it
// started from to the state it says it reached; what binds those states together is that each
// report's Commit.State is both the end of the step before and the start of the step after, so
// within a plan a worker's states form one chain of committed steps. The chain has ends the
// coordinator must tie down itself:
//
//   - Its first link: every shard of a plan starts from a state the coordinator hands out — the
//     newest complete checkpoint's tensors for the shard (from the assembled file the Assign
//     names: the new plan may cut differently from the checkpoint's shards) or the job seed's
//     initial weights (model.Params.Init, with zero moments) — so the coordinator knows its
//     digest. A worker's first commitment under a plan that differs is its own word against a
//     state the coordinator knows: it is banned at once, no recomputation needed (checkCustody).
//     The digests are computed off the job loop, while the workers download and restore (the
//     default model's first stage of two, 3.3M parameters and 39 MB of state: 0.06–0.11 s from a
//     checkpoint, 0.1–0.4 s from the seed, on a loaded 2-core machine; BenchmarkShardDigest),
//     and cached per restore point and shard.
//   - Its last link before a replan: the last step of a plan has no next report to commit to its
//     end state; when the job replans from a checkpoint taken after that step, the checkpoint's
//     shard is that commitment (as the final checkpoint is at the job's end), and the step is
//     drawn for audit against it like any other, before the new Assigns make the workers drop
//     its evidence (drawBeforeReplan). A checkpoint taken under the plan and followed by a report
//     is compared with that report's commitment (checkCheckpoint).
//   - Replicated state: in step mode, the stages of different replicas that hold the same blocks
//     apply the same summed gradient to the same state (model/gradtree.go), so on one kernel
//     family their states are equal bit for bit at every step. A difference between their
//     commitments is a dispute: every holder's previous step is audited, and the recomputation
//     that differs is banned (twinDisputes).
//
// Outer mode's stages start a plan as step mode's do — from their replica's own part of the
// checkpoint, or for a replica new to it the global θ with zero moments (shardDigestOf) — and its
// outer steps, which change a shard between training steps, are crossed by a commitment to the
// change (outeraudit.go).
//
// What the chain does not do: it does not make a later audit see an earlier step's cheat. A step
// computed falsely leads to a committed state that every later step honestly starts from, so an
// audit of a later step recomputes from the false state and passes; only an audit of the cheated
// step itself, or a twin holding the same state, sees it. The chain closes the jumps — a state
// no committed step produced.

// custody is what the coordinator knows of the states the active plan's shards started from.
type custody struct {
	plan    uint32
	want    map[string]*expected // worker → the state its first commitment under plan must carry
	checked map[string]bool      // workers whose first commitment under plan was compared
	// point is the restore point the cache is of; a new one replaces it.
	point string
	cache map[string]*expected // by shard
}

// expected is the digest of a state the coordinator handed out, computed in the background.
type expected struct {
	done   chan struct{} // closed once digest or err is set
	digest string
	err    error
	from   string // what the state is, for a ban's reason
}

// expectState records the state worker's shard under assignment asg starts from, and starts
// computing its digest.
func (j *jobRun) expectState(worker string, asg *proto.Assign) {
	a := j.audits
	if a == nil {
		return
	}
	c := a.custodyOf(asg.PlanVersion)
	if len(asg.From) > 0 {
		return // its state is its giver's, which the giver's Ready names: checkKept
	}
	ref := asg.Restore
	if asg.Keep != nil {
		// A shard kept at a checkpointed boundary by a worker that uploaded its part of the
		// checkpoint holds that checkpoint's state; any other kept shard holds a state only the
		// worker's word (its Ready) names: expectKept.
		if ref = j.keepRef; ref == nil || !j.keepUploaded[worker] {
			return
		}
	}
	point, from := fmt.Sprintf("seed %d", j.spec.Seed), "the seed's initial weights"
	var open func() ([]*os.File, error) // nil: the seed
	var shas []string
	if r := ref; r != nil {
		if asg.Keep != nil {
			r = j.restoreFor(r, asg) // the checkpoint's shards that hold this shard's tensors
		}
		point = fmt.Sprintf("the checkpoint after step %d", r.Step)
		from = point
		blobs := j.s.blobs
		shas = r.Blobs
		open = func() ([]*os.File, error) { return openBlobs(blobs, shas) }
	}
	if c.point != point {
		c.point, c.cache = point, map[string]*expected{}
	}
	key, err := shardKey(asg)
	if err != nil {
		return
	}
	if len(shas) > 0 {
		key += " from " + strings.Join(shas, ",") // a checkpoint of the same step may hold other bits
	}
	replica := -1 // outer mode: a replica restores its own part of a checkpoint
	if j.spec.Outer() && asg.Replica != nil {
		replica = asg.Replica.Index
		key += fmt.Sprintf(" replica %d", replica)
	}
	e := c.cache[key]
	if e == nil {
		e = &expected{done: make(chan struct{}), from: from}
		c.cache[key] = e
		cfg, seed, shard, hosts := j.spec.Model, j.spec.Seed, asg.Shard, asg.ExpertHosts
		go func() {
			defer close(e.done)
			e.digest, e.err = shardDigestOf(cfg, seed, open, shard, hosts, replica)
		}()
	}
	c.want[worker] = e
}

// custodyOf is the custody of plan ver, made afresh (keeping the digest cache) when it is a new one.
func (a *auditor) custodyOf(ver uint32) *custody {
	c := a.custody
	if c == nil || c.plan != ver {
		c = &custody{plan: ver, want: map[string]*expected{}, checked: map[string]bool{}}
		if old := a.custody; old != nil {
			c.point, c.cache = old.point, old.cache
		}
		a.custody = c
	}
	return c
}

// expectKept records the state worker kept into plan ver (proto.Keep) at step: the digest its
// Ready committed to, which its first report under the plan must commit to again. The coordinator
// does not know that state itself; what vouches for it is the audit of the previous plan's last
// step against it (drawKept) and, where replicas hold the same blocks, their agreement.
func (j *jobRun) expectKept(worker string, ver uint32, step int, digest string) {
	// Outer mode's kept states are each replica's own, except at the warm-up's end (warmOut),
	// where every replica keeps step mode's one state.
	if j.audits == nil || j.spec.Outer() && !j.warmOut {
		return
	}
	c := j.audits.custodyOf(ver)
	if c.want[worker] != nil {
		return // kept at a checkpoint: the coordinator knows the state (expectState)
	}
	e := &expected{done: make(chan struct{}), digest: digest, from: fmt.Sprintf("the state it kept at step %d, as its Ready said", step)}
	close(e.done)
	c.want[worker] = e
}

// shardKey names a shard by what decides its tensors: the shard and, for a stage, which of its
// experts live on hosts.
func shardKey(asg *proto.Assign) (string, error) {
	var hosted [][2]int
	for _, h := range asg.ExpertHosts {
		hosted = append(hosted, [2]int{h.Block, h.Expert})
	}
	sort.Slice(hosted, func(a, b int) bool {
		return hosted[a][0] < hosted[b][0] || hosted[a][0] == hosted[b][0] && hosted[a][1] < hosted[b][1]
	})
	b, err := json.Marshal(struct {
		Shard  proto.Shard
		Hosted [][2]int
	}{asg.Shard, hosted})
	return string(b), err
}

// shardDigest is the digest of the state a worker's shard holds once restored from the
// checkpoint files open opens — the checkpoint's shards that hold its tensors (restoreFor), or a
// whole-model file — or, open nil, initialised from the seed: the shard's tensors as the
// worker builds them, filled with what model.Checkpoint.Into or model.Params.Init fills them with,
// digested as the worker's first commitment is. Only the shard's own tensors are read from the
// files, a chunk at a time, and hashed one tensor at a time: the coordinator holds one
// tensor's values (or a 4 MiB chunk), not a shard's state.
func shardDigest(cfg model.Config, seed uint64, open func() ([]*os.File, error), sh proto.Shard, hosts []proto.ExpertHost) (string, error) {
	return shardDigestOf(cfg, seed, open, sh, hosts, -1)
}

// openBlobs opens the blobs shas of store, all or none.
func openBlobs(store *storage.BlobStore, shas []string) ([]*os.File, error) {
	fs := make([]*os.File, 0, len(shas))
	for _, sha := range shas {
		f, err := store.Open(sha)
		if err != nil {
			for _, f := range fs {
				f.Close()
			}
			return nil, err
		}
		fs = append(fs, f)
	}
	return fs, nil
}

// shardDigestOf is shardDigest of the stage of outer-mode replica replica (-1: step mode), which
// restores as the worker's outerRestore does: its replica's part of the checkpoint (θ_r and its
// moments, model.ReplicaPrefix) when the checkpoint has one, else the global θ with zero moments.
// From the seed every replica starts from θ_0 with zero moments, as in step mode.
//
// It hashes one tensor at a time (audit.ComposeState of each tensor's value hash): the coordinator
// holds one tensor's values, not a shard's state — which for a whole-model shard of the 1B model
// was 12 GB, in a goroutine per shard of the plan at once.
func shardDigestOf(cfg model.Config, seed uint64, open func() ([]*os.File, error), sh proto.Shard, hosts []proto.ExpertHost, replica int) (string, error) {
	specs, err := shardSpecs(cfg, sh, hostedBy(hosts))
	if err != nil {
		return "", err
	}
	layout := model.CheckpointLayout(specs) // the parameters, then Adam's two moments
	params := map[string]bool{}
	for _, sp := range specs {
		params[sp.Name] = true
	}
	sums := make(map[string]string, len(layout))
	var vals []float32 // one tensor's values at a time
	if open == nil {
		for _, t := range layout {
			n := safetensors.Elements(t.Shape)
			if !params[t.Name] {
				sums[t.Name] = zeroSum(n) // a fresh optimizer's moments
				continue
			}
			vals = slices.Grow(vals[:0], n)[:n]
			model.InitTensor(cfg, seed, model.Tensor{Spec: model.Spec{Name: t.Name, Shape: t.Shape}, Data: vals})
			sums[t.Name] = audit.TensorSums([]safetensors.Tensor{{Name: t.Name, Shape: t.Shape, Data: vals}})[0].Digest
		}
		return audit.ComposeState(layout, sums)
	}
	fs, err := open()
	if err != nil {
		return "", err
	}
	defer func() {
		for _, f := range fs {
			f.Close()
		}
	}()
	// Each tensor from the first of the files that holds it (the checkpoint's shards that hold
	// this shard's tensors: a tensor two of them hold is the same in both, the global θ of two
	// replicas' stages).
	type held struct {
		f     *os.File
		entry safetensors.Entry
		base  int64 // where the file's data begins
	}
	entries := map[string]held{}
	var all []safetensors.Entry
	for _, f := range fs {
		hd, err := safetensors.ReadHeader(f, 0)
		if err != nil {
			return "", err
		}
		for _, e := range hd.Tensors {
			if _, ok := entries[e.Name]; !ok {
				entries[e.Name] = held{f: f, entry: e, base: 8 + hd.Len}
			}
		}
		all = append(all, hd.Tensors...)
	}
	// name is the checkpoint's name of state tensor t, "" for one left zero.
	name := func(t safetensors.Tensor) string { return t.Name }
	if replica >= 0 && len(specs) > 0 {
		// A blob with no replica's part is step mode's: the warm-up's, which outer mode starts from.
		stepBlob := !slices.ContainsFunc(all, func(e safetensors.Entry) bool { return strings.HasPrefix(e.Name, "replica.") })
		pre := model.ReplicaPrefix(replica)
		if _, has := entries[pre+specs[0].Name]; has {
			name = func(t safetensors.Tensor) string { return pre + t.Name }
		} else {
			name = func(t safetensors.Tensor) string {
				if params[t.Name] {
					return t.Name // the global θ
				}
				if _, ok := entries[t.Name]; ok && stepBlob {
					// The synchronous warm-up's checkpoint (job.Sync.Warmup), a step-mode one:
					// every replica starts from its moments.
					return t.Name
				}
				return "" // a new replica's moments start at zero
			}
		}
	}
	buf := make([]byte, 4<<20)
	for _, t := range layout {
		n := name(t)
		if n == "" {
			sums[t.Name] = zeroSum(safetensors.Elements(t.Shape))
			continue
		}
		at, ok := entries[n]
		e := at.entry
		switch {
		case !ok:
			return "", fmt.Errorf("checkpoint lacks %s", t.Name)
		case !slices.Equal(e.Shape, t.Shape):
			return "", fmt.Errorf("checkpoint %s: shape %v, want %v", t.Name, e.Shape, t.Shape)
		case e.End-e.Begin != 4*int64(safetensors.Elements(t.Shape)):
			return "", fmt.Errorf("checkpoint %s: %d bytes, want %d", t.Name, e.End-e.Begin, 4*safetensors.Elements(t.Shape))
		}
		h := audit.NewValueHash()
		for off := int64(0); off < e.End-e.Begin; off += int64(len(buf)) {
			b := buf[:min(int64(len(buf)), e.End-e.Begin-off)]
			if _, err := at.f.ReadAt(b, at.base+e.Begin+off); err != nil {
				return "", fmt.Errorf("checkpoint %s: %w", t.Name, err)
			}
			// The file's little-endian float32s are the very bytes StateDigest hashes of the
			// values they decode to (safetensors.DecodeF32 only reinterprets them).
			h.Write(b)
		}
		sums[t.Name] = proto.EncodeDigest(h.Sum(nil))
	}
	return audit.ComposeState(layout, sums)
}

// checkCustody compares the first commitment of every participant under the active plan (step
// s's reports, in participant order) with the state it was handed, and bans one that differs.
func (j *jobRun) checkCustody(ctx context.Context, s int, reports []*proto.StepReport) error {
	return j.checkCustodyOf(ctx, s, j.participants(), reports)
}

// checkCustodyOf is checkCustody of the participants parts (an outer-mode replica's stages) and
// their reports, in the same order.
func (j *jobRun) checkCustodyOf(ctx context.Context, s int, parts []string, reports []*proto.StepReport) error {
	a := j.audits
	c := a.custody
	if c == nil || c.plan != j.version {
		return nil
	}
	for i, w := range parts {
		e := c.want[w]
		if e == nil || c.checked[w] {
			continue
		}
		select {
		case <-e.done:
		case <-ctx.Done():
			return ctx.Err()
		}
		c.checked[w] = true
		if e.err != nil {
			// The coordinator's own failure (a blob it cannot read): no verdict on the worker.
			j.s.log.Error("the state a shard was handed could not be digested", "worker", w, "err", e.err)
			j.s.event(j.rec.ID, "custody.error", w, map[string]any{"step": s, "error": e.err.Error()})
			continue
		}
		if got := reports[i].Commit.State; got != e.digest {
			if _, ok := a.first[w]; !ok {
				// Its start state went into no applied step: the job goes back only to where this
				// plan began, not past work done without it.
				a.first[w] = s
			}
			return j.ban(ctx, w, s, fmt.Sprintf("its first commitment under plan %d (step %d) is state %s, not %s, the state it was handed (%s)",
				c.plan, s, short(got), short(e.digest), e.from))
		}
	}
	return nil
}

func short(d string) string {
	if len(d) > 12 {
		return d[:12]
	}
	return d
}

// twinDisputes compares the state commitments of step s's reports among step-mode replicas'
// stages that hold the same blocks and compute with the same CPU kernel family — equal bit for
// bit when all are honest — and returns the holders of every group that disagrees: their
// previous step (whose update the commitments are of) is audited, each, and whoever's
// recomputation differs is banned. Holders on other families or on GPUs are not compared: their
// arithmetic need not agree to the bit.
func (j *jobRun) twinDisputes(s int, reports []*proto.StepReport) map[string]bool {
	if len(j.reps) < 2 || j.spec.Outer() {
		return nil
	}
	var out map[string]bool
	for _, ks := range j.twins() {
		agree := true
		for _, k := range ks[1:] {
			agree = agree && reports[k].Commit.State == reports[ks[0]].Commit.State
		}
		if agree {
			continue
		}
		var ws []string
		for _, k := range ks {
			ws = append(ws, j.stages[k].peer)
		}
		if out == nil {
			out = map[string]bool{}
		}
		for _, w := range ws {
			out[w] = true
		}
		j.s.event(j.rec.ID, "state.disputed", "", map[string]any{"step": s - 1, "blocks": [2]int{j.stages[ks[0]].begin, j.stages[ks[0]].end}, "workers": ws})
	}
	return out
}

// twins groups the active plan's stages (their indices) that hold the same blocks and compute
// with the same CPU kernel family — whose states are equal bit for bit when all are honest — in
// groups of two or more, in stage order.
func (j *jobRun) twins() [][]int {
	type group struct {
		begin, end int
		kernels    string
	}
	holders := map[group][]int{}
	var order []group
	for k, st := range j.stages {
		p := j.peers[st.peer]
		if p == nil || p.hello == nil || (p.hello.Kernels != proto.KernelsFMA && p.hello.Kernels != proto.KernelsPortable) {
			continue
		}
		g := group{st.begin, st.end, p.hello.Kernels}
		if holders[g] == nil {
			order = append(order, g)
		}
		holders[g] = append(holders[g], k)
	}
	var out [][]int
	for _, g := range order {
		if len(holders[g]) > 1 {
			out = append(out, holders[g])
		}
	}
	return out
}

// drawBeforeReplan draws the audits of the last step of the plan being left (a.prev) against the
// checkpoint the next plan restores from (ref), which commits to that step's end state when no
// later report under the plan did; the Audit messages go out before the new Assigns, so that the
// workers still hold the evidence when they read them.
func (j *jobRun) drawBeforeReplan(ctx context.Context, ref *proto.CheckpointRef) error {
	a := j.audits
	if a == nil || j.spec.Outer() || a.prev == nil || ref == nil {
		return nil
	}
	prev := a.prev
	a.prev = nil
	if uint64(prev.spec.Step)+1 != ref.Step || j.ckVersion != prev.plan || uint64(j.ckRequested) != ref.Step {
		return nil
	}
	ck, err := j.s.db.LatestCheckpoint(ctx, j.rec.ID)
	if err != nil || uint64(ck.Step) != ref.Step {
		return err
	}
	digests, err := shardStatesOf(j.s.blobs, ck, prev.workers, prev.stages, nil)
	if err != nil {
		// The coordinator's own failure: the step goes undrawn, the job on.
		j.s.log.Error("the checkpoint's shards could not be digested", "checkpoint", ck.ID, "err", err)
		return nil
	}
	for _, w := range prev.workers {
		if d, ok := digests[w]; ok {
			j.askAudit(ctx, w, int(prev.spec.Step), prev, d, false)
		}
	}
	return nil
}
