package audit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Check binds a bundle to what its worker committed to before it knew the step would be audited:
// the step's commitment (its report's) and next, the digest of the state it reported next (the
// next step's Commit.State, or its checkpoint after the job's last step). lean says the audit
// asked for lean evidence (proto.Audit.Lean), which b may then be; sample is the seed of the
// thin evidence it asked for (proto.Audit.Sample; 0: none), which b must then be. An error means
// the worker's own evidence contradicts its commitments: proof enough that it is broken or lying.
func Check(b *Bundle, step uint64, plan uint32, c *proto.Commit, next string, lean bool, sample uint64) error {
	if b.Step != step || b.PlanVersion != plan {
		return fmt.Errorf("evidence of step %d plan %d, asked for step %d plan %d", b.Step, b.PlanVersion, step, plan)
	}
	if b.Lean && !lean {
		return errors.New("lean evidence for an audit that asked for all of it (its recomputation is not bit for bit)")
	}
	if b.Sample != sample {
		return fmt.Errorf("evidence sampled with seed %d, the audit asked for %d", b.Sample, sample)
	}
	d, err := thinStateDigest(b.StateIn, b.InCVs, b.Sample)
	if err != nil {
		return fmt.Errorf("the start state uploaded: %w", err)
	}
	if d != c.State {
		return fmt.Errorf("the start state uploaded (%s) is not the one committed to (%s)", short(d), short(c.State))
	}
	// next is "" for a step that was not applied (a disputed one): there is no end state to bind.
	// A lean bundle has none: the recomputation's is compared with next (CompareLean). A thin
	// one's large end tensors are bound by their chaining values, which its sampled groups give.
	if next != "" && !b.Lean {
		d, err := thinStateDigest(b.StateOut, b.OutCVs, b.Sample)
		if err != nil {
			return fmt.Errorf("the end state uploaded: %w", err)
		}
		if d != next {
			return fmt.Errorf("the end state uploaded (%s) is not the one committed to next (%s)", short(d), short(next))
		}
	}
	recv := map[string]string{}
	for _, r := range c.Recv {
		recv[r.Key] = r.Digest
	}
	for _, t := range b.Recv {
		k := proto.KeyID(t.Key)
		d, ok := recv[k]
		if !ok {
			return fmt.Errorf("received tensor %v was not committed to (or twice)", t.Key)
		}
		if got := TensorDigest(t); got != d {
			return fmt.Errorf("received tensor %v is not the one committed to", t.Key)
		}
		delete(recv, k)
	}
	if len(recv) > 0 {
		return fmt.Errorf("%d received tensors committed to are missing from the evidence", len(recv))
	}
	if b.Lean {
		return nil // what it sent is compared with the recomputation's (CompareLean)
	}
	// A tensor sent to several workers (a gradient node to every other replica) is one entry
	// per recipient.
	sent := map[[2]string]proto.SentDigest{}
	for _, s := range c.Sent {
		sent[[2]string{s.To, s.Key}] = s
	}
	for _, s := range b.Sent {
		k := [2]string{s.To, proto.KeyID(s.T.Key)}
		d, ok := sent[k]
		if !ok {
			return fmt.Errorf("sent tensor %v to %s was not committed to (or twice)", s.T.Key, s.To)
		}
		if got := TensorDigest(s.T); got != d.Digest {
			return fmt.Errorf("sent tensor %v is not the one committed to", s.T.Key)
		}
		delete(sent, k)
	}
	if len(sent) > 0 {
		return fmt.Errorf("%d sent tensors committed to are missing from the evidence", len(sent))
	}
	return nil
}

// CompareLean decides, bit for bit, whether a step whose evidence was lean is the recomputed one:
// every tensor the recomputation sends must have the digest the worker committed to sending, to
// the same recipient and no other; the report must be the recomputation's; and the state the
// update reached must have the digest next, which the worker committed to after the step (none
// for an unapplied step). Its evidence was bound by Check before the recomputation.
//
// A thin bundle's (Sample) end state is compared on its sampled groups and small tensors
// (checkThinEnd): the rest of the recomputation's start moments were zeros.
func CompareLean(o *Outcome, b *Bundle, rep *proto.StepReport, next string) string {
	if rep == nil || rep.Commit == nil {
		return "no commitment to compare the recomputation with"
	}
	sent, msg := withoutMoved(o, rep.Commit.Sent, func(s proto.SentDigest) (string, string, string) { return s.To, s.Key, s.Digest })
	if msg != "" {
		return msg
	}
	committed := map[[2]string]string{}
	for _, s := range sent {
		committed[[2]string{s.To, s.Key}] = s.Digest
	}
	if len(committed) != len(sent) || len(o.Sent) != len(sent) {
		return fmt.Sprintf("committed to sending %d tensors, the recomputation sends %d", len(sent), len(o.Sent))
	}
	for _, s := range o.Sent {
		k := [2]string{s.To, proto.KeyID(s.T.Key)}
		d, ok := committed[k]
		if !ok {
			return fmt.Sprintf("the recomputation sends %v to %s, the worker did not (or twice)", s.T.Key, s.To)
		}
		if TensorDigest(s.T) != d {
			return fmt.Sprintf("sent %v differs from the recomputation", s.T.Key)
		}
		delete(committed, k)
	}
	if msg := compareReport(o.Report, rep, true); msg != "" {
		return msg
	}
	if o.StateOut == nil || next == "" {
		return "" // an unapplied step: no update to compare
	}
	if b.Sample != 0 {
		return checkThinEnd(o.StateOut, b, next)
	}
	if StateDigest(o.StateOut) != next {
		return "the state after the update differs from the recomputation (the digest committed to next)"
	}
	return ""
}

func short(d string) string {
	if len(d) > 12 {
		return d[:12] + "…"
	}
	return d
}

// Replay is what a recomputation needs: the audited worker's assignment, the checked evidence,
// the step as the coordinator opened it, and the update's learning rate and clip factor.
type Replay struct {
	Assign *proto.Assign
	Worker string
	Spec   proto.StepSpec
	Bundle *Bundle
	LR     float64
	Clip   float32
	// Unapplied: the step was disputed before any update (proto.Audit.Unapplied); the
	// recomputation stops at the report and what was sent, and the Outcome has no end state.
	Unapplied bool
}

// Outcome is what a recomputation found: what the shard should have sent, reported and reached,
// and the update it applied.
type Outcome struct {
	Sent     []Sent
	Report   *proto.StepReport
	StateOut []safetensors.Tensor
	Update   Update
	// Moved maps, for a step with a stage takeover (proto.StepSpec.Takeover), the lost stage to
	// its taker. A neighbour of the lost stage sent it some tensors before it left and all of them
	// to the taker; the recomputation sends them to the taker only. What the worker committed
	// to sending the lost stage must each be what it committed to sending the taker under the
	// same key, bit for bit (withoutMoved), and is then compared no further.
	Moved map[string]string
}

// withoutMoved returns sent without its entries to a stage o.Moved names, each of which must
// have a twin to that stage's taker with the same key and digest (key and digest give an entry's);
// else what differs.
func withoutMoved[T any](o *Outcome, sent []T, entry func(T) (to, key, digest string)) ([]T, string) {
	if len(o.Moved) == 0 {
		return sent, ""
	}
	to := map[[2]string]string{}
	for _, s := range sent {
		t, k, d := entry(s)
		to[[2]string{t, k}] = d
	}
	var out []T
	for _, s := range sent {
		t, k, d := entry(s)
		taker, moved := o.Moved[t]
		if !moved {
			out = append(out, s)
			continue
		}
		if twin, ok := to[[2]string{taker, k}]; !ok || twin != d {
			return nil, fmt.Sprintf("sent %s to %s, whose stage %s took over, and not the same to %s", k, t, taker, taker)
		}
	}
	return out, ""
}

// Update is the AdamW step a recomputation applied: step count t (1-based), learning rate and
// weight decay.
type Update struct {
	T               int
	LR, WeightDecay float64
}

// Recomputer recomputes one shard's step from its evidence (client.Recompute).
type Recomputer func(ctx context.Context, r *Replay) (*Outcome, error)

// Tolerances of a comparison across backends (the audited worker's kernels are not the
// recomputer's: FMA against rounded products, WebGPU against the CPU). They are the whole-stage
// bounds of docs/design.md's "Equivalence, defined" as measured for one step (wasm/kernels_browser_test.go
// states them with their measurements), for one step from the same start state; the smallest
// cheat SHOAL_FAULT plays (gradients ×(1+1e-3), which moves ‖g‖² by 2e-3) lies above them.
const (
	TolCE     = 1e-4 // |ΔCE|/CE and |Δaux|/aux per micro-batch
	TolAct    = 1e-3 // ‖Δ‖/‖ref‖ of each tensor sent
	TolNorm   = 1e-3 // |Δ‖g‖²| / ‖g‖² over the shard
	TolMoment = 1e-3 // ‖Δ‖/‖ref‖ of each Adam moment of the end state
	TolApply  = 1e-4 // ‖θ − AdamW(θ_in; the worker's moments)‖ / ‖that update‖, each tensor
)

// Across backends the end state is not compared with the recomputation's parameters directly:
// AdamW divides each gradient entry by its own running magnitude, so where that is tiny (a bias
// late in training) the last bits of the gradient decide a visible share of the update, and an
// honest tab on the pure-Go kernels drifted past a 5e-3 bound after 539 audited steps of the soak.
// Instead the moments, which are linear in the gradient, are compared with the recomputation's
// (TolMoment), and the parameters are checked to follow from the worker's own moments by the
// update's last line (TolApply: bit for bit on a CPU, float rounding on a GPU). A worker that
// skips or scales its update, or keeps stale moments, fails one or the other.

// Compare decides whether the worker's step (its report and evidence) is the recomputed one: bit
// for bit when exact, within the tolerances above otherwise. It returns "" when it is, else what
// differs first. next is the end state's digest the worker committed to, as for Check; a lean
// bundle is compared by CompareLean.
func Compare(o *Outcome, b *Bundle, rep *proto.StepReport, next string, exact bool) string {
	if b.Lean {
		if !exact {
			return "lean evidence cannot be judged across kernel families"
		}
		return CompareLean(o, b, rep, next)
	}
	msg := compare(o, b, rep, exact)
	if msg != "" && !exact && compressed(b) {
		return Inconclusive + msg
	}
	return msg
}

// Inconclusive opens Compare's verdict on a difference it cannot judge: across kernel families,
// a job whose boundaries are compressed (bf16, int8, int4) turns last-bit differences into whole
// quantisation steps, which AdamW and the next stages carry on (a ‖g‖² 2.6e-3 apart after one
// step was measured between AVX-512 and the pure-Go kernels with int8 boundaries). The
// coordinator neither bans nor credits on such a verdict.
const Inconclusive = "inconclusive: "

// compressed reports whether the step moved bf16, int8 or int4 tensors.
func compressed(b *Bundle) bool {
	for _, t := range b.Recv {
		if t.DType != proto.F32 && t.DType != proto.I32 {
			return true
		}
	}
	for _, s := range b.Sent {
		if s.T.DType != proto.F32 && s.T.DType != proto.I32 {
			return true
		}
	}
	return false
}

func compare(o *Outcome, b *Bundle, rep *proto.StepReport, exact bool) string {
	sent, msg := withoutMoved(o, b.Sent, func(s Sent) (string, string, string) { return s.To, proto.KeyID(s.T.Key), TensorDigest(s.T) })
	if msg != "" {
		return msg
	}
	mine := map[[2]string]Sent{}
	for _, s := range sent {
		mine[[2]string{s.To, proto.KeyID(s.T.Key)}] = s
	}
	if len(o.Sent) != len(sent) {
		return fmt.Sprintf("sent %d tensors, the recomputation %d", len(sent), len(o.Sent))
	}
	for _, s := range o.Sent {
		w, ok := mine[[2]string{s.To, proto.KeyID(s.T.Key)}]
		if !ok {
			return fmt.Sprintf("the recomputation sends %v to %s, the worker did not", s.T.Key, s.To)
		}
		if exact {
			if TensorDigest(w.T) != TensorDigest(s.T) {
				return fmt.Sprintf("sent %v differs from the recomputation", s.T.Key)
			}
			continue
		}
		if w.T.DType != s.T.DType || w.T.Shape != s.T.Shape {
			return fmt.Sprintf("sent %v as %v %v, the recomputation %v %v", s.T.Key, w.T.DType, w.T.Shape, s.T.DType, s.T.Shape)
		}
		if s.T.DType == proto.F32 {
			x, _ := proto.Float32s(w.T.Data)
			y, _ := proto.Float32s(s.T.Data)
			if d := relDiff(x, y, nil); d > TolAct {
				return fmt.Sprintf("sent %v differs from the recomputation by %.3g (tolerance %g)", s.T.Key, d, TolAct)
			}
		} else if string(w.T.Data) != string(s.T.Data) {
			return fmt.Sprintf("sent %v differs from the recomputation", s.T.Key)
		}
	}
	if msg := compareReport(o.Report, rep, exact); msg != "" {
		return msg
	}
	if o.StateOut == nil {
		return "" // an unapplied step: no update to compare
	}
	if exact && b.Sample == 0 {
		if StateDigest(o.StateOut) != StateDigest(b.StateOut) {
			return "the state after the update differs from the recomputation" + whichTensor(o.StateOut, b.StateOut)
		}
		return ""
	}
	// Thin evidence (Sample) is compared on the large tensors' sampled groups (Bundle.view): the
	// recomputation started from zeros elsewhere in the moments.
	in := map[string][]float32{}
	for _, t := range b.StateIn {
		in[t.Name] = b.view(t.Name, t.Data)
	}
	got := map[string][]float32{}
	for _, t := range b.StateOut {
		got[t.Name] = b.view(t.Name, t.Data)
	}
	if len(got) != len(o.StateOut) {
		return fmt.Sprintf("end state of %d tensors, the recomputation's %d", len(got), len(o.StateOut))
	}
	for _, t := range o.StateOut {
		g, ok := got[t.Name]
		want := b.view(t.Name, t.Data)
		if !ok || len(g) != len(want) || len(in[t.Name]) != len(want) {
			return fmt.Sprintf("end state tensor %s is missing or of another size", t.Name)
		}
		if exact {
			if !slices.EqualFunc(g, want, func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) }) {
				return fmt.Sprintf("the state after the update differs from the recomputation (%s first)", t.Name)
			}
			continue
		}
		if strings.HasPrefix(t.Name, optimM) || strings.HasPrefix(t.Name, optimV) {
			if d := relDiff(g, want, nil); d > TolMoment {
				return fmt.Sprintf("end state %s differs from the recomputation by %.3g (tolerance %g)", t.Name, d, TolMoment)
			}
			continue
		}
		m, v := got[optimM+t.Name], got[optimV+t.Name]
		if len(m) != len(g) || len(v) != len(g) {
			return fmt.Sprintf("end state %s comes without its Adam moments", t.Name)
		}
		step := applyAdamW(in[t.Name], m, v, t.Shape, o.Update)
		if d, ok := applyOff(g, step, in[t.Name]); !ok {
			return fmt.Sprintf("end state %s does not follow from its own moments: off by %.3g of the update (tolerance %g and %d ulps of the parameters)", t.Name, d, TolApply, ApplyUlps)
		}
	}
	return ""
}

// The checkpoint names of Adam's moments (model.CheckpointTensors).
const (
	optimM = "optim.m."
	optimV = "optim.v."
)

// applyAdamW is the parameters AdamW step u reaches from w given the moments after the step, m and
// v: the last line of kernels.AdamW, in its order of operations.
func applyAdamW(w, m, v []float32, shape []int, u Update) []float32 {
	decay, stepSize, sqrtBC2 := model.AdamWFactors(shape, u.T, u.LR, u.WeightDecay)
	out := make([]float32, len(w))
	for j := range w {
		denom := float32(math.Sqrt(float64(v[j]))/sqrtBC2) + kernels.AdamEps
		out[j] = w[j]*decay - stepSize*m[j]/denom
	}
	return out
}

func compareReport(want, got *proto.StepReport, exact bool) string {
	close := func(a, b, tol float64) bool {
		if exact {
			return a == b
		}
		return math.Abs(a-b) <= tol*math.Max(math.Abs(b), 1e-12)
	}
	if len(want.CE) != len(got.CE) {
		return fmt.Sprintf("reported %d losses, the recomputation %d", len(got.CE), len(want.CE))
	}
	for i := range want.CE {
		if !close(got.CE[i], want.CE[i], TolCE) {
			return fmt.Sprintf("reported loss %v for micro-batch %d, the recomputation %v", got.CE[i], i, want.CE[i])
		}
	}
	if len(want.Aux) != len(got.Aux) {
		return fmt.Sprintf("reported balancing losses of %d blocks, the recomputation %d", len(got.Aux), len(want.Aux))
	}
	for i, a := range want.Aux {
		g := got.Aux[i]
		if g.Block != a.Block || len(g.Aux) != len(a.Aux) {
			return fmt.Sprintf("balancing losses of block %d differ in shape from the recomputation", a.Block)
		}
		for j := range a.Aux {
			if !close(g.Aux[j], a.Aux[j], TolCE) {
				return fmt.Sprintf("reported balancing loss %v for block %d micro-batch %d, the recomputation %v", g.Aux[j], a.Block, j, a.Aux[j])
			}
		}
	}
	if len(want.GradSq) != len(got.GradSq) {
		return fmt.Sprintf("reported ‖g‖² of %d tensors, the recomputation %d", len(got.GradSq), len(want.GradSq))
	}
	names := make([]string, 0, len(want.GradSq))
	for n := range want.GradSq {
		names = append(names, n)
	}
	sort.Strings(names)
	var sw, sg float64
	for _, n := range names {
		g, ok := got.GradSq[n]
		if !ok {
			return fmt.Sprintf("reported no ‖g‖² for %s", n)
		}
		if exact && g != want.GradSq[n] {
			return fmt.Sprintf("reported ‖g‖² %v for %s, the recomputation %v", g, n, want.GradSq[n])
		}
		sw += want.GradSq[n]
		sg += g
	}
	if !exact && !close(sg, sw, TolNorm) {
		return fmt.Sprintf("reported ‖g‖² %v for the shard, the recomputation %v (tolerance %g)", sg, sw, TolNorm)
	}
	return ""
}

// relDiff is ‖x − y‖ / ‖y − base‖ (‖y‖ when base is nil), 0 when both are 0.
func relDiff(x, y, base []float32) float64 {
	var num, den float64
	for i := range y {
		d := float64(x[i]) - float64(y[i])
		num += d * d
		r := float64(y[i])
		if base != nil {
			r -= float64(base[i])
		}
		den += r * r
	}
	if num == 0 {
		return 0
	}
	if den == 0 {
		return math.Inf(1)
	}
	return math.Sqrt(num / den)
}

// ApplyUlps are the float32 ulps of the parameters the end state may differ by from AdamW's last
// line on top of TolApply of the update: that line rounds w·decay − u to float32 once or twice,
// and a GPU that fuses it, or rounds the product otherwise, lands a few ulps of w away. Beside a
// real update that is nothing, but early in warm-up the update of a large parameter is tiny: an
// honest Vulkan worker was 1.03e-4 of ln_2.weight's update off at learning rate 1e-5, and was
// banned for it. A cheat that matters moves the parameters by far more than a few ulps — and the
// moments, which carry the gradient, are compared on their own (TolMoment).
const ApplyUlps = 4

// applyOff returns ‖got − want‖ / ‖want − in‖ and whether got passes: ‖got − want‖ within
// TolApply of the update plus ApplyUlps float32 ulps of the parameters (ε·‖in‖ per ulp).
func applyOff(got, want, in []float32) (float64, bool) {
	var num, upd, w float64
	for i := range want {
		d := float64(got[i]) - float64(want[i])
		num += d * d
		u := float64(want[i]) - float64(in[i])
		upd += u * u
		w += float64(in[i]) * float64(in[i])
	}
	num, upd, w = math.Sqrt(num), math.Sqrt(upd), math.Sqrt(w)
	ok := num <= TolApply*upd+ApplyUlps*0x1p-24*w
	if num == 0 {
		return 0, true
	}
	if upd == 0 {
		return math.Inf(1), ok
	}
	return num / upd, ok
}

// whichTensor names the first tensor (by name) whose values differ between two states.
func whichTensor(a, b []safetensors.Tensor) string {
	bm := map[string][]float32{}
	for _, t := range b {
		bm[t.Name] = t.Data
	}
	var diff []string
	for _, t := range a {
		o := bm[t.Name]
		if len(o) != len(t.Data) {
			diff = append(diff, t.Name)
			continue
		}
		for i := range o {
			if math.Float32bits(o[i]) != math.Float32bits(t.Data[i]) {
				diff = append(diff, t.Name)
				break
			}
		}
	}
	if len(diff) == 0 {
		return ""
	}
	sort.Strings(diff)
	return fmt.Sprintf(" (%s first, %d tensors in all)", diff[0], len(diff))
}
