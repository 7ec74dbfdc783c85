package model

import (
	"fmt"
	"maps"
	"math"
	"reflect"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/safetensors"
)

// farDevice is a Device whose memory is its own, as a GPU's is: every allocation is a separate
// arena with NaN guards around it, views are offsets into it, and the host sees its contents
// only through Read. Its ops are the kernels functions, so it must agree with Host bit for bit;
// any model code that touches host memory instead of going through the device — a host mirror
// taken for the device tensor, a result used without its Read — computes on stale or poisoned
// values and breaks that agreement. It also refuses another device's buffers and counts what
// crosses to the host.
type farDevice struct {
	name      string
	arenas    []*farArena
	reads     int // Read calls and CrossEntropyForward: the points where a GPU would wait
	readElems int // floats read
	frees     int // Free calls
}

const farGuard = 16

type farArena struct {
	f     []float32
	i     []int32
	freed bool
}

type farBuf struct {
	dev    *farDevice
	arena  *farArena
	off, n int
}

func (b *farBuf) Len() int { return b.n }

func newFarDevice(name string) *farDevice { return &farDevice{name: name} }

func (d *farDevice) buf(b Buf) *farBuf {
	fb, ok := b.(*farBuf)
	if !ok || fb.dev != d {
		panic(fmt.Sprintf("%s: buffer %T from another device", d.name, b))
	}
	return fb
}

func (d *farDevice) f(b Buf) []float32 {
	if b == nil {
		return nil
	}
	fb := d.buf(b)
	if fb.arena.f == nil {
		panic(d.name + ": int32 buffer used as float32")
	}
	return fb.arena.f[farGuard+fb.off : farGuard+fb.off+fb.n : farGuard+fb.off+fb.n]
}

func (d *farDevice) i(b Buf) []int32 {
	fb := d.buf(b)
	if fb.arena.i == nil {
		panic(d.name + ": float32 buffer used as int32")
	}
	return fb.arena.i[farGuard+fb.off : farGuard+fb.off+fb.n : farGuard+fb.off+fb.n]
}

func (d *farDevice) Alloc(n int) Buf {
	a := &farArena{f: make([]float32, n+2*farGuard)}
	for j := 0; j < farGuard; j++ {
		a.f[j], a.f[n+farGuard+j] = float32(math.NaN()), float32(math.NaN())
	}
	d.arenas = append(d.arenas, a)
	return &farBuf{dev: d, arena: a, n: n}
}

func (d *farDevice) AllocInt32(n int) Buf {
	a := &farArena{i: make([]int32, n+2*farGuard)}
	for j := 0; j < farGuard; j++ {
		a.i[j], a.i[n+farGuard+j] = -1, -1
	}
	d.arenas = append(d.arenas, a)
	return &farBuf{dev: d, arena: a, n: n}
}

// Free poisons the buffer — NaN floats, -1 ints — so that a freed buffer the model still used would
// break its agreement with Host; a view or a second Free panics, as on a GPU.
func (d *farDevice) Free(b Buf) {
	fb := d.buf(b)
	if fb.off != 0 || fb.n != max(len(fb.arena.f), len(fb.arena.i))-2*farGuard {
		panic(d.name + ": Free of a view")
	}
	if fb.arena.freed {
		panic(d.name + ": buffer freed twice")
	}
	fb.arena.freed = true
	for j := range fb.arena.f {
		fb.arena.f[j] = float32(math.NaN())
	}
	for j := range fb.arena.i {
		fb.arena.i[j] = -1
	}
	d.frees++
}

func (d *farDevice) Err() error { return nil }

// SquaredNorms sums squares as the host's SquaredNorms does (kernels.SquaredNorms): one read.
func (d *farDevice) SquaredNorms(bufs []Buf) []float64 { return d.SquaredNormsWith(bufs, nil, nil) }

func (d *farDevice) SquaredNormsWith(bufs []Buf, also Buf, alsoDst []float32) []float64 {
	d.reads++
	xs := make([][]float32, len(bufs))
	for i, b := range bufs {
		xs[i] = d.f(b)
	}
	sums := make([]float64, len(xs))
	kernels.SquaredNorms(sums, xs)
	if also != nil {
		copy(alsoDst, sameLen(d.f(also), len(alsoDst), "squared norms' also"))
		d.readElems += len(alsoDst)
	}
	return sums
}

// checkGuards reports an op that wrote outside its buffer.
func (d *farDevice) checkGuards(t *testing.T) {
	t.Helper()
	for k, a := range d.arenas {
		for j := 0; j < farGuard; j++ {
			if a.f != nil && (!math.IsNaN(float64(a.f[j])) || !math.IsNaN(float64(a.f[len(a.f)-1-j]))) ||
				a.i != nil && (a.i[j] != -1 || a.i[len(a.i)-1-j] != -1) {
				t.Fatalf("%s: arena %d written outside its bounds", d.name, k)
			}
		}
	}
}

// disjoint panics when two of an op's buffers share memory: a GPU cannot bind one buffer both as
// an input and as an output of a dispatch.
func (d *farDevice) disjoint(bufs ...Buf) {
	for i, a := range bufs {
		for _, b := range bufs[i+1:] {
			if a == nil || b == nil {
				continue
			}
			x, y := d.buf(a), d.buf(b)
			if x.arena == y.arena && x.off < y.off+y.n && y.off < x.off+x.n {
				panic(d.name + ": an op's buffers overlap")
			}
		}
	}
}

func (d *farDevice) Slice(b Buf, off, n int) Buf {
	fb := d.buf(b)
	if off < 0 || n < 0 || off+n > fb.n {
		panic(fmt.Sprintf("%s: slice [%d,%d) of a buffer of %d", d.name, off, off+n, fb.n))
	}
	return &farBuf{dev: d, arena: fb.arena, off: fb.off + off, n: n}
}

func (d *farDevice) Write(dst Buf, src []float32) {
	if len(src) != dst.Len() {
		panic(fmt.Sprintf("%s: write of %d into %d", d.name, len(src), dst.Len()))
	}
	copy(d.f(dst), src)
}

func (d *farDevice) WriteInt32(dst Buf, src []int32) {
	if len(src) != dst.Len() {
		panic(fmt.Sprintf("%s: write of %d into %d", d.name, len(src), dst.Len()))
	}
	copy(d.i(dst), src)
}

func (d *farDevice) Read(dst []float32, src Buf) {
	if len(dst) != src.Len() {
		panic(fmt.Sprintf("%s: read of %d into %d", d.name, src.Len(), len(dst)))
	}
	d.reads++
	d.readElems += len(dst)
	copy(dst, d.f(src))
}

func (d *farDevice) Zero(b Buf) { clear(d.f(b)) }

func (d *farDevice) Copy(dst, src Buf) {
	if dst.Len() != src.Len() {
		panic(d.name + ": copy between sizes")
	}
	d.disjoint(dst, src)
	copy(d.f(dst), d.f(src))
}

func (d *farDevice) Add(dst, src Buf) {
	if dst.Len() != src.Len() {
		panic(d.name + ": add between sizes")
	}
	d.disjoint(dst, src)
	x, y := d.f(dst), d.f(src)
	for j := range x {
		x[j] += y[j]
	}
}

func (d *farDevice) EncoderForward(out, inp, wte, wpe Buf, B, T, C int) {
	d.disjoint(out, inp, wte, wpe)
	kernels.EncoderForward(d.f(out), d.i(inp), d.f(wte), d.f(wpe), B, T, C)
}

func (d *farDevice) EncoderBackward(dwte, dwpe, dout, inp Buf, B, T, C int) {
	d.disjoint(dwte, dwpe, dout, inp)
	kernels.EncoderBackward(d.f(dwte), d.f(dwpe), d.f(dout), d.i(inp), B, T, C)
}

func (d *farDevice) LayerNormForward(out, mean, rstd, inp, w, b Buf, N, C int) {
	d.disjoint(out, mean, rstd, inp, w, b)
	kernels.LayerNormForward(d.f(out), d.f(mean), d.f(rstd), d.f(inp), d.f(w), d.f(b), N, C)
}

func (d *farDevice) LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd Buf, N, C int) {
	d.disjoint(dinp, dw, db, dout, inp, w, mean, rstd)
	kernels.LayerNormBackward(d.f(dinp), d.f(dw), d.f(db), d.f(dout), d.f(inp), d.f(w), d.f(mean), d.f(rstd), N, C)
}

func (d *farDevice) LinearForward(out, inp, w, bias Buf, N, IN, OUT int) {
	d.disjoint(out, inp, w, bias)
	kernels.LinearForward(d.f(out), d.f(inp), d.f(w), d.f(bias), N, IN, OUT)
}

func (d *farDevice) LinearBackward(dinp, dw, db, dout, inp, w Buf, N, IN, OUT int, accIn bool) {
	d.disjoint(dinp, dw, db, dout, inp, w)
	kernels.LinearBackward(d.f(dinp), d.f(dw), d.f(db), d.f(dout), d.f(inp), d.f(w), N, IN, OUT, accIn)
}

func (d *farDevice) AttentionForward(out, att, qkv Buf, B, T, C, H int) {
	d.disjoint(out, att, qkv)
	kernels.AttentionForward(d.f(out), d.f(att), d.f(qkv), B, T, C, H)
}

func (d *farDevice) AttentionBackward(dqkv, dout, qkv, att Buf, B, T, C, H int) {
	d.disjoint(dqkv, dout, qkv, att)
	kernels.AttentionBackward(d.f(dqkv), d.f(dout), d.f(qkv), d.f(att), B, T, C, H)
}

func (d *farDevice) GELUForward(out, th, inp Buf) {
	d.disjoint(out, th, inp)
	kernels.GELUForward(d.f(out), d.f(th), d.f(inp))
}

func (d *farDevice) GELUBackward(dinp, inp, th, dout Buf) {
	d.disjoint(dinp, inp, th, dout)
	kernels.GELUBackward(d.f(dinp), d.f(inp), d.f(th), d.f(dout))
}

func (d *farDevice) CrossEntropyForward(logits, targets Buf, N, V int) float64 {
	d.reads++
	d.disjoint(logits, targets)
	return kernels.CrossEntropyForward(d.f(logits), d.i(targets), N, V)
}

func (d *farDevice) CrossEntropyBackward(logits, targets Buf, N, V int, scale float32) {
	d.disjoint(logits, targets)
	kernels.CrossEntropyBackward(d.f(logits), d.i(targets), N, V, scale)
}

func (d *farDevice) SoftmaxRows(x Buf, N, E int) { kernels.SoftmaxRows(d.f(x), N, E) }

func (d *farDevice) CrossEntropyRows(losses, logits, targets Buf, N, V int) {
	d.disjoint(losses, logits, targets)
	kernels.CrossEntropyRows(d.f(losses), d.f(logits), d.i(targets), N, V)
}

func (d *farDevice) TopKGate(gate, mask, probs Buf, N, E, K int) {
	d.disjoint(gate, mask, probs)
	kernels.TopKGate(d.f(gate), d.f(mask), d.f(probs), N, E, K)
}

func (d *farDevice) GateRows(dst, src, gate Buf, e, N, C, E int, acc bool) {
	d.disjoint(dst, src, gate)
	kernels.GateRows(d.f(dst), d.f(src), d.f(gate), e, N, C, E, acc)
}

func (d *farDevice) GateGrad(dgate, dout, y, mask Buf, e, N, C, E int) {
	d.disjoint(dgate, dout, y, mask)
	kernels.GateGrad(d.f(dgate), d.f(dout), d.f(y), d.f(mask), e, N, C, E)
}

func (d *farDevice) MoEStats(stats, mask, probs Buf, N, E, K int) {
	d.disjoint(stats, mask, probs)
	kernels.MoEStats(d.f(stats), d.f(mask), d.f(probs), N, E, K)
}

func (d *farDevice) AuxGrad(dgate, stats Buf, N, E, K int, scale float32) {
	d.disjoint(dgate, stats)
	kernels.AuxGrad(d.f(dgate), d.f(stats), N, E, K, scale)
}

func (d *farDevice) SoftmaxBackwardRows(dx, p, dp Buf, N, E int) {
	d.disjoint(dx, p, dp)
	kernels.SoftmaxBackwardRows(d.f(dx), d.f(p), d.f(dp), N, E)
}

func (d *farDevice) AdamW(w, g, m, v Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	d.disjoint(w, g, m, v)
	kernels.AdamW(d.f(w), d.f(g), d.f(m), d.f(v), decay, stepSize, sqrtBC2, gradScale)
}

// poison fills host mirrors with NaN: after it, only what is pulled from the device is valid.
func poison(ps ...*Params) {
	for _, p := range ps {
		for _, t := range p.Tensors {
			for j := range t.Data {
				t.Data[j] = float32(math.NaN())
			}
		}
	}
}

// routedExperts is a stage's Experts over other shards, as the client's dispatcher does it over
// the network: host rows in, host rows out, block 1's expert 0 split over two replicas by token
// group, every other expert whole on the shard that holds it.
type routedExperts struct {
	local   *LocalExperts // the stage's own experts, if any
	shards  []*Shard      // expert shards
	replica [2]*Expert    // replicas of block 1's expert 0
	C       int
	// wire is the job's boundary formats: every expert's rows are rounded to them on the way
	// in and out, as sending them to another peer and back would.
	wire Wire
}

func (r *routedExperts) expert(blk, e int) *Expert {
	if r.local != nil {
		if x := r.local.Get(blk, e); x != nil {
			return x
		}
	}
	for _, sh := range r.shards {
		if x := sh.Experts.Get(blk, e); x != nil {
			return x
		}
	}
	return nil
}

func (r *routedExperts) run(blk, mb int, xs [][]float32, splits []int, backward bool) ([][]float32, error) {
	f := r.wire.Activations
	if backward {
		f = r.wire.Gradients
	}
	call := func(x *Expert, in []float32, split int) ([]float32, error) {
		in = append([]float32(nil), in...)
		f.Round(in, r.C)
		var out []float32
		var err error
		if backward {
			out, err = x.Backward(mb, in, split)
		} else {
			out, err = x.Forward(mb, in)
		}
		f.Round(out, r.C)
		return out, err
	}
	out := make([][]float32, len(xs))
	for e := range xs {
		if blk == 1 && e == 0 {
			s := splits[e] * r.C
			var y []float32
			for g, part := range [2][]float32{xs[e][:s], xs[e][s:]} {
				o, err := call(r.replica[g], part, 0)
				if err != nil {
					return nil, err
				}
				y = append(y, o...)
			}
			out[e] = y
			continue
		}
		x := r.expert(blk, e)
		if x == nil {
			return nil, fmt.Errorf("block %d expert %d: nowhere", blk, e)
		}
		y, err := call(x, xs[e], splits[e])
		if err != nil {
			return nil, err
		}
		out[e] = y
	}
	return out, nil
}

func (r *routedExperts) Forward(blk, mb int, xs [][]float32, splits []int) ([][]float32, error) {
	return r.run(blk, mb, xs, splits, false)
}

func (r *routedExperts) Backward(blk, mb int, dys [][]float32, splits []int) ([][]float32, error) {
	return r.run(blk, mb, dys, splits, true)
}

// devicePipeline is the tiny model as peers hold it, every shard on a device of its own: stage
// [0,2) with block 1's experts remote (expert 0 replicated over two shards, 1–3 on one shard),
// stage [2,3) in the middle, and the last stage [3,4) holding block 3's experts 1–3 itself, with
// expert 0 on a shard of its own.
type devicePipeline struct {
	stages  []*Shard
	experts []*Shard // block 1's replicas 0 and 1, block 1's experts 1–3, block 3's expert 0
	devs    []*farDevice
}

func (pl *devicePipeline) all() []*Shard {
	return append(append([]*Shard(nil), pl.stages...), pl.experts...)
}

func newDevicePipeline(t *testing.T, cfg Config, seed uint64, onDevice bool) *devicePipeline {
	t.Helper()
	return newWirePipeline(t, cfg, seed, onDevice, Wire{})
}

// newWirePipeline is newDevicePipeline with every boundary in wire's formats: between the blocks
// of a stage, between stages (gpipe) and around every expert.
func newWirePipeline(t *testing.T, cfg Config, seed uint64, onDevice bool, wire Wire) *devicePipeline {
	t.Helper()
	pl := &devicePipeline{}
	dev := func(name string) Device {
		if !onDevice {
			return Host{}
		}
		d := newFarDevice(name)
		pl.devs = append(pl.devs, d)
		return d
	}
	must := func(sh *Shard, err error) *Shard {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return sh
	}
	rep0 := must(NewExpertShardOn(dev("replica 0"), cfg, 1, []int{0}))
	rep1 := must(NewExpertShardOn(dev("replica 1"), cfg, 1, []int{0}))
	rep0.Experts.Get(1, 0).SetReplica(0)
	rep1.Experts.Get(1, 0).SetReplica(1)
	ex1 := must(NewExpertShardOn(dev("block 1 experts"), cfg, 1, []int{1, 2, 3}))
	ex3 := must(NewExpertShardOn(dev("block 3 expert 0"), cfg, 3, []int{0}))
	pl.experts = []*Shard{rep0, rep1, ex1, ex3}
	C := cfg.NEmbd
	replicas := [2]*Expert{rep0.Experts.Get(1, 0), rep1.Experts.Get(1, 0)}
	first := must(NewStageShardOn(dev("stage 0"), cfg, 0, 2, &routedExperts{shards: []*Shard{ex1}, replica: replicas, C: C, wire: wire}))
	middle := must(NewStageShardOn(dev("stage 1"), cfg, 2, 3, nil))
	last := must(NewStageShardWithOn(dev("stage 2"), cfg, 3, 4, func(blk, e int) bool { return e != 0 },
		func(l *LocalExperts) Experts {
			return &routedExperts{local: l, shards: []*Shard{ex3}, replica: replicas, C: C, wire: wire}
		}))
	pl.stages = []*Shard{first, middle, last}
	for _, sh := range pl.all() {
		sh.Init(seed)
		sh.SetWire(wire)
	}
	return pl
}

func (pl *devicePipeline) reads() (calls, elems int) {
	for _, d := range pl.devs {
		calls += d.reads
		elems += d.readElems
	}
	return calls, elems
}

// step trains one step in GPipe order and returns the loss terms and the gradient norm, following
// the synchronisation rules of Shard: the gradient tree (BeginGradients, MicroBatchDone,
// GradientsComplete), PullGrads before the norms, ZeroGrads after Apply, replicas exchanging
// their halves' nodes (GradNodes, ReduceGradients).
func (pl *devicePipeline) step(t *testing.T, x, y []int32, B, M, stepNo int, lr float64) (ce, aux, norm float64, readElems int) {
	t.Helper()
	_, before := pl.reads()
	stages := make([]*Stage, len(pl.stages))
	for i, sh := range pl.stages {
		stages[i] = sh.Stage
	}
	for _, sh := range pl.all() {
		if err := sh.BeginGradients(M, 0, M); err != nil {
			t.Fatal(err)
		}
	}
	ce, aux = gpipe(t, stages, x, y, B, M, func(j int) {
		for _, sh := range pl.all() {
			if err := sh.MicroBatchDone(j); err != nil {
				t.Fatal(err)
			}
		}
	})
	_, after := pl.reads()
	for i, sh := range pl.all() {
		if complete := sh.GradientsComplete(); complete != (i != len(pl.stages) && i != len(pl.stages)+1) {
			t.Fatalf("shard %d: gradients complete %v", i, complete)
		}
	}
	// The replicas swap their halves' nodes as the client does: each sends a copy of its own.
	r0, r1 := pl.experts[0], pl.experts[1]
	for _, tt := range r0.G.Tensors {
		n0, err := r0.GradNodes(tt.Name)
		if err != nil {
			t.Fatal(err)
		}
		n1, err := r1.GradNodes(tt.Name)
		if err != nil {
			t.Fatal(err)
		}
		sent0, sent1 := copyNodes(n0), copyNodes(n1)
		if err := r0.ReduceGradients(tt.Name, sent1); err != nil {
			t.Fatal(err)
		}
		if err := r1.ReduceGradients(tt.Name, sent0); err != nil {
			t.Fatal(err)
		}
	}
	parts := map[string]float64{}
	for i, sh := range pl.all() {
		sh.PullGrads()
		if i == len(pl.stages)+1 {
			continue // replica 1: the coordinator counts a replicated expert once
		}
		maps.Copy(parts, SquaredNorms(sh.G))
	}
	norm = GlobalNorm(parts)
	for _, sh := range pl.all() {
		sh.Apply(stepNo+1, lr, 0.1, ClipFactor(norm, 1))
		sh.ZeroGrads()
	}
	return ce, aux, norm, after - before
}

// TestDeviceEqualsHost trains the pipeline with every shard on a farDevice and on Host and
// requires the same bits: losses, gradient norms, and after Pull every parameter and moment.
// Between Push and Pull the host mirrors hold NaN, so nothing may compute from them.
func TestDeviceEqualsHost(t *testing.T) {
	cfg := TinyConfig()
	const B, M, steps, lr = 8, 2, 3, 1e-2
	host := newDevicePipeline(t, cfg, 7, false)
	far := newDevicePipeline(t, cfg, 7, true)
	for _, sh := range far.all() {
		poison(sh.P, sh.G, sh.Opt.M, sh.Opt.V)
	}
	text := testText(t, 8192)
	T, C, E, K := cfg.BlockSize, cfg.NEmbd, cfg.NExpert, cfg.TopK
	N := B / M * T
	// What crosses to the host in a step's forwards and backwards: per micro-batch, each MoE block
	// reads ln_2 and the router's probabilities forward and the output gradient backward, the
	// experts' outputs and input gradients (k rows per token, both ways), and each stage but the
	// last its output, each but the first its input gradient. Nothing else.
	moe := 2 * (N*C + N*E + N*C + 2*N*K*C)
	wantReads := M * (moe + 2*(N*C) + 2*(N*C))
	for s := 0; s < steps; s++ {
		x, y := windows(text[s*300:], B, T)
		hce, haux, hnorm, _ := host.step(t, x, y, B, M, s, lr)
		fce, faux, fnorm, reads := far.step(t, x, y, B, M, s, lr)
		if fce != hce || faux != haux || fnorm != hnorm {
			t.Fatalf("step %d: device ce %v aux %v norm %v, host ce %v aux %v norm %v", s, fce, faux, fnorm, hce, haux, hnorm)
		}
		if reads != wantReads {
			t.Errorf("step %d: %d floats read from the devices during forward and backward, want %d", s, reads, wantReads)
		}
		if math.IsNaN(hce) || hce == 0 {
			t.Fatalf("step %d: loss %v", s, hce)
		}
		for _, sh := range far.all() {
			poison(sh.G)
		}
	}
	// An evaluation forward without targets, as sampling does: the logits come from the device.
	x, _ := windows(text[5000:], 1, 11)
	var hx, fx []float32
	for i := range host.stages {
		hs, fs := host.stages[i].Stage, far.stages[i].Stage
		in := StageInput{B: 1, T: 11, Tokens: x}
		if i > 0 {
			in = StageInput{B: 1, T: 11, X: hx}
		}
		ho, err := hs.Forward(0, in)
		if err != nil {
			t.Fatal(err)
		}
		if i > 0 {
			in.X = fx
		}
		fo, err := fs.Forward(0, in)
		if err != nil {
			t.Fatal(err)
		}
		hx, fx = ho.X, fo.X
		if hs.Last() {
			hx, fx = hs.Logits(0), fs.Logits(0)
		}
		requireSameFloats(t, fmt.Sprintf("stage %d output", i), fx, hx)
		hs.Release(0)
		fs.Release(0)
	}
	for i, sh := range far.all() {
		sh.Pull()
		want := host.all()[i]
		for _, pair := range [][2]*Params{{sh.P, want.P}, {sh.Opt.M, want.Opt.M}, {sh.Opt.V, want.Opt.V}} {
			for k, tt := range pair[1].Tensors {
				requireSameFloats(t, tt.Name, pair[0].Tensors[k].Data, tt.Data)
			}
		}
	}
	for _, d := range far.devs {
		d.checkGuards(t)
	}
	calls, elems := far.reads()
	frees := 0
	for _, d := range far.devs {
		frees += d.frees
	}
	// The experts' rows vary with the routing, so their scratch grows and frees what it
	// replaced: poisoned, a freed buffer still in use would have broken the agreement above.
	t.Logf("device reads over %d steps and an evaluation: %d calls, %d floats; %d buffers freed", steps, calls, elems, frees)
	if frees == 0 {
		t.Error("no scratch buffer grew and freed the one it replaced: Free went untested")
	}
}

// TestDeviceRestore: a shard restored from another's checkpoint on a device (Pull, checkpoint,
// Into, Push) continues training exactly as the original does.
func TestDeviceRestore(t *testing.T) {
	cfg := TinyConfig()
	const B, M, lr = 4, 2, 1e-2
	text := testText(t, 8192)
	T := cfg.BlockSize
	train := func(sh *Shard, s int) float64 {
		x, y := windows(text[s*300:], B, T)
		n := B / M * T
		var ce float64
		if err := sh.BeginGradients(M, 0, M); err != nil {
			t.Fatal(err)
		}
		for j := 0; j < M; j++ {
			out, err := sh.Stage.Forward(j, StageInput{B: B / M, T: T, Micro: M, Tokens: x[j*n : (j+1)*n], Targets: y[j*n : (j+1)*n]})
			if err != nil {
				t.Fatal(err)
			}
			ce += out.CE
			if _, err := sh.Stage.Backward(j, nil, 1/float32(M)); err != nil {
				t.Fatal(err)
			}
			if err := sh.MicroBatchDone(j); err != nil {
				t.Fatal(err)
			}
		}
		if !sh.GradientsComplete() {
			t.Fatal("gradient tree incomplete")
		}
		sh.PullGrads()
		sh.Apply(s+1, lr, 0.1, ClipFactor(GlobalNorm(SquaredNorms(sh.G)), 1))
		sh.ZeroGrads()
		return ce
	}
	a, err := NewStageShardOn(newFarDevice("a"), cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	a.Init(3)
	train(a, 0)
	a.Pull()
	ck := &Checkpoint{Cfg: cfg, Step: 1, Tensors: map[string]safetensors.Tensor{}}
	for _, tt := range CheckpointTensors(a.P, a.Opt) {
		tt.Data = append([]float32(nil), tt.Data...)
		ck.Tensors[tt.Name] = tt
	}
	b, err := NewStageShardOn(newFarDevice("b"), cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ck.Into(b.P, b.Opt); err != nil {
		t.Fatal(err)
	}
	b.Push()
	poison(a.P, a.Opt.M, a.Opt.V, b.P, b.Opt.M, b.Opt.V)
	for s := 1; s < 3; s++ {
		if ca, cb := train(a, s), train(b, s); ca != cb {
			t.Fatalf("step %d: restored shard's loss %v, original's %v", s, cb, ca)
		}
	}
	a.Pull()
	b.Pull()
	for k, tt := range a.P.Tensors {
		requireSameFloats(t, tt.Name, b.P.Tensors[k].Data, tt.Data)
	}
}

func requireSameFloats(t *testing.T, name string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(want))
	}
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d]: device %v, host %v", name, i, got[i], want[i])
		}
	}
}

func copyNodes(ns []GradNode) []GradNode {
	out := make([]GradNode, len(ns))
	for i, n := range ns {
		out[i] = GradNode{Lo: n.Lo, Hi: n.Hi, Data: append([]float32(nil), n.Data...)}
	}
	return out
}

// TestDenseMoEEqualsHost: a whole-model stage on a device that is not host memory takes the dense
// MoE path (every local expert on every row, gated; no routing read back) and trains to the host
// path's routing counts, parameters and Adam moments bit for bit; the losses it reports — the
// balancing loss, the cross-entropy's rows — come back through float32. They stay on the device
// until the step's one read, with the norms (Stage.TakeStats): a micro-batch costs the device no
// wait, where the host path reads the router's probabilities, the rows and every expert's output
// of every MoE block, and the loss.
func TestDenseMoEEqualsHost(t *testing.T) {
	cfg := TinyConfig()
	const B, M, lr, steps = 4, 2, 1e-2, 3
	text := testText(t, 8192)
	T := cfg.BlockSize
	type result struct {
		ce, aux  []float64
		routed   [][]int
		deferred bool
	}
	// reads counts the device's waits, nil on Host: a step waits once, for its norms, with which
	// the micro-batches' losses and statistics come back.
	train := func(sh *Shard, reads func() int) result {
		var r result
		for s := 0; s < steps; s++ {
			r0 := 0
			if reads != nil {
				r0 = reads()
			}
			x, y := windows(text[s*300:], B, T)
			n := B / M * T
			if err := sh.BeginGradients(M, 0, M); err != nil {
				t.Fatal(err)
			}
			base, ceBase := len(r.aux), len(r.ce)
			for j := 0; j < M; j++ {
				out, err := sh.Stage.Forward(j, StageInput{B: B / M, T: T, Micro: M, Tokens: x[j*n : (j+1)*n], Targets: y[j*n : (j+1)*n]})
				if err != nil {
					t.Fatal(err)
				}
				r.ce, r.aux, r.routed = append(r.ce, out.CE), append(r.aux, out.Aux...), append(r.routed, out.Routed...)
				r.deferred = r.deferred || out.Deferred
				if _, err := sh.Stage.Backward(j, nil, 1/float32(M)); err != nil {
					t.Fatal(err)
				}
				if err := sh.MicroBatchDone(j); err != nil {
					t.Fatal(err)
				}
			}
			// The step's norms, and with them its deferred statistics, in one read; then the
			// statistics into the micro-batches' slots.
			norms := sh.GradSquaredNorms()
			moe := cfg.NumMoE()
			for _, d := range sh.Stage.TakeStats() {
				if d.Block == -1 { // the loss
					if !math.IsNaN(r.ce[ceBase+d.MB]) {
						t.Fatalf("micro-batch %d: a deferred loss for one that reported it", d.MB)
					}
					r.ce[ceBase+d.MB] = d.CE
					continue
				}
				k := base + d.MB*moe + d.Block
				if !math.IsNaN(r.aux[k]) || r.routed[k] != nil {
					t.Fatalf("micro-batch %d block %d: deferred statistics for a block that reported them", d.MB, d.Block)
				}
				r.aux[k], r.routed[k] = d.Aux, d.Routed
			}
			if reads != nil {
				if n := reads() - r0; n > 1 {
					t.Errorf("step %d: %d device reads, want 1: the norms, with the losses and statistics", s, n)
				}
			}
			sh.Apply(s+1, lr, 0.1, ClipFactor(GlobalNorm(norms), 1))
			sh.ZeroGrads()
		}
		sh.Pull()
		return r
	}
	host, err := NewStageShardOn(Host{}, cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	far := newFarDevice("dense")
	dense, err := NewStageShardOn(far, cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	dense.Stage.Defer = true
	host.Init(3)
	dense.Init(3)
	want, got := train(host, nil), train(dense, func() int { return far.reads })
	if want.deferred || !got.deferred {
		t.Fatalf("deferred statistics: host %v, device %v; want only the device's", want.deferred, got.deferred)
	}
	if !reflect.DeepEqual(got.routed, want.routed) {
		t.Fatalf("dense path: routed %v; host path %v", got.routed, want.routed)
	}
	// The loss comes back as float32 rows summed in float64: within a float32 rounding of each row.
	for i := range want.ce {
		if d := math.Abs(got.ce[i]-want.ce[i]) / want.ce[i]; !(d <= 0x1p-23) {
			t.Fatalf("loss %d: %v on the device, %v on the host", i, got.ce[i], want.ce[i])
		}
	}
	for i := range want.aux {
		if got.aux[i] != float64(float32(want.aux[i])) {
			t.Fatalf("balancing loss %d: %v, want the host's %v through float32", i, got.aux[i], want.aux[i])
		}
	}
	for _, pair := range [][2]*Params{{dense.P, host.P}, {dense.Opt.M, host.Opt.M}, {dense.Opt.V, host.Opt.V}} {
		for k, tt := range pair[1].Tensors {
			requireSameFloats(t, tt.Name, pair[0].Tensors[k].Data, tt.Data)
		}
	}
	far.checkGuards(t)
	t.Logf("device reads: %d over %d steps of %d micro-batches (%d MoE blocks), the test's pulls included", far.reads, steps, M, cfg.NumMoE())
}
