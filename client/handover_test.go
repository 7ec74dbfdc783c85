//go:build !js

package client

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// TestTakeState: a taker fills its shard with exactly the giver's state, tensor by tensor, from
// receipts posted before anything arrives (so none waits in the bounded mailbox); a tensor of
// the wrong size is refused; a failed link to the giver ends the wait for what has not arrived,
// but not for what has.
func TestTakeState(t *testing.T) {
	spec := testJobSpec(7)
	mk := func(seed uint64) *model.Shard {
		sh, err := model.NewStageShardWithOn(model.Host{}, spec.Model, 0, spec.Model.NLayer, func(int, int) bool { return true }, nil)
		if err != nil {
			t.Fatal(err)
		}
		sh.Init(seed)
		for i, m := range sh.Opt.M.Tensors {
			for k := range m.Data {
				m.Data[k], sh.Opt.V.Tensors[i].Data[k] = float32(k%7)*1e-3, float32(k%5)*1e-4
			}
		}
		return sh
	}
	giver, taker := mk(1), mk(2)
	nums := stateNumbers(t, job.Spec{}, giver)
	send := func(box *Mailbox, sh *model.Shard, n int, tamper func(i int, tn *proto.Tensor)) {
		for i, st := range handoverTensors(sh, nil)[:n] {
			tn, err := rowsTensor(stateKey(3, 9, nums[i]), model.F32, st.Data, 1)
			if err != nil {
				t.Fatal(err)
			}
			if tamper != nil {
				tamper(i, &tn)
			}
			if err := box.Deliver(tn); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The mailbox's bound is one tensor: receipts take the state all the same.
	box := NewMailbox(1)
	w, err := expectState(box, job.Spec{}, taker, 3, 9)
	if err != nil {
		t.Fatal(err)
	}
	n := len(handoverTensors(giver, nil))
	send(box, giver, n, nil)
	if err := takeState(context.Background(), w, job.Spec{}, taker, nil, fromG(taker), goneOf(nil)); err != nil {
		t.Fatal(err)
	}
	got, want := handoverTensors(taker, nil), handoverTensors(giver, nil)
	for i := range want {
		for k := range want[i].Data {
			if got[i].Data[k] != want[i].Data[k] {
				t.Fatalf("%s[%d] = %v, the giver's %v", want[i].Name, k, got[i].Data[k], want[i].Data[k])
			}
		}
	}

	// A tensor a value short is refused.
	box = NewMailbox(0)
	taker = mk(3)
	w, _ = expectState(box, job.Spec{}, taker, 3, 9)
	send(box, giver, 1, func(i int, tn *proto.Tensor) { tn.Data = tn.Data[:len(tn.Data)-4] })
	if err := takeState(context.Background(), w, job.Spec{}, taker, nil, fromG(taker), goneOf(nil)); err == nil || !strings.Contains(err.Error(), "want") {
		t.Errorf("a short tensor: %v", err)
	}

	// The link fails after everything arrived: taken. After half: refused, naming the giver.
	gone := make(chan struct{})
	close(gone)
	box = NewMailbox(0)
	sh := mk(4)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	send(box, giver, n, nil)
	if err := takeState(context.Background(), w, job.Spec{}, sh, nil, fromG(sh), goneOf(gone)); err != nil {
		t.Errorf("the whole state arrived before the link failed: %v", err)
	}
	box = NewMailbox(0)
	sh = mk(5)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	send(box, giver, n/2, nil)
	if err := takeState(context.Background(), w, job.Spec{}, sh, nil, fromG(sh), goneOf(gone)); err == nil || !strings.Contains(err.Error(), "from g") {
		t.Errorf("half the state, then the link failed: %v", err)
	}
	// A closed mailbox (a newer plan) ends the wait too.
	box = NewMailbox(0)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	box.Close(nil)
	if err := takeState(context.Background(), w, job.Spec{}, sh, nil, fromG(sh), goneOf(nil)); !errors.Is(err, ErrClosed) {
		t.Errorf("a closed mailbox: %v", err)
	}
	// Two receipts for one tensor, or one for a tensor already held, are refused.
	box = NewMailbox(0)
	if _, err := box.Expect(stateKey(3, 9, 0)); err != nil {
		t.Fatal(err)
	}
	if _, err := box.Expect(stateKey(3, 9, 0)); err == nil {
		t.Error("two receipts for one tensor")
	}
}

// stateNumbers are the wire numbers of the tensors a handover of sh carries (handoverNumbers).
func stateNumbers(t *testing.T, spec job.Spec, sh *model.Shard) []int {
	t.Helper()
	nums, _, err := handoverNumbers(spec, sh)
	if err != nil {
		t.Fatal(err)
	}
	return nums
}

// fromG is a handover of all of sh's blocks from one giver, g.
func fromG(sh *model.Shard) []proto.Handover {
	return []proto.Handover{{Worker: "g", FromPlan: 2, Step: 9, Begin: sh.Stage.Lo, End: sh.Stage.Hi}}
}

// goneOf is a giver's link failure for takeState: ch, whoever the giver.
func goneOf(ch chan struct{}) func(string) <-chan struct{} {
	return func(string) <-chan struct{} { return ch }
}

// TestTakeStateMomentumBehind: in outer mode the taker is ready once it holds the global θ; the
// outer momentum follows (giveState sends it behind), and whatever reads it waits for all of it
// (momentumArrival) — or, when the link to the giver fails first, is told why, naming the giver.
func TestTakeStateMomentumBehind(t *testing.T) {
	spec := testJobSpec(7)
	spec.Sync = &job.Sync{Mode: "outer", Every: 2, OuterLR: 0.7, OuterMomentum: 0.9}
	mk := func(seed uint64) (*model.Shard, *outerState) {
		sh, err := model.NewStageShardWithOn(model.Host{}, spec.Model, 0, spec.Model.NLayer, func(int, int) bool { return true }, nil)
		if err != nil {
			t.Fatal(err)
		}
		sh.Init(seed)
		o := testOuterState(t, sh.P.Specs(), spec)
		o.global.CopyFrom(sh.P)
		for _, v := range o.outer.V.Tensors {
			for k := range v.Data {
				v.Data[k] = float32(seed) + float32(k%11)*1e-3
			}
		}
		return sh, o
	}
	gsh, g := mk(1)
	state := handoverTensors(gsh, g)
	theta := len(g.global.Tensors)
	nums := stateNumbers(t, spec, gsh)
	deliver := func(box *Mailbox, lo, hi int) {
		for i := lo; i < hi; i++ {
			tn, err := rowsTensor(stateKey(3, 9, nums[i]), model.F32, state[i].Data, 1)
			if err != nil {
				t.Fatal(err)
			}
			if err := box.Deliver(tn); err != nil {
				t.Fatal(err)
			}
		}
	}
	box := NewMailbox(0)
	sh, o := mk(2)
	w, err := expectState(box, spec, sh, 3, 9)
	if err != nil {
		t.Fatal(err)
	}
	deliver(box, 0, theta)
	if err := takeState(context.Background(), w, spec, sh, o, fromG(sh), goneOf(nil)); err != nil {
		t.Fatalf("the global θ arrived: %v", err)
	}
	a := o.arriving
	select {
	case <-a.done:
		t.Fatal("the momentum counted as arrived before any of it came")
	default:
	}
	deliver(box, theta, len(state))
	if err := a.wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i, v := range o.outer.V.Tensors {
		for k := range v.Data {
			if v.Data[k] != g.outer.V.Tensors[i].Data[k] {
				t.Fatalf("momentum %s[%d] = %v, the giver's %v", v.Name, k, v.Data[k], g.outer.V.Tensors[i].Data[k])
			}
		}
	}
	for i, p := range sh.P.Tensors {
		for k := range p.Data {
			if p.Data[k] != g.global.Tensors[i].Data[k] {
				t.Fatalf("θ_r %s[%d] is not the global θ", p.Name, k)
			}
		}
	}

	// The link to the giver fails with half the momentum in: the wait says so, naming it.
	gone := make(chan struct{})
	box = NewMailbox(0)
	sh, o = mk(3)
	w, _ = expectState(box, spec, sh, 3, 9)
	deliver(box, 0, theta+1)
	if err := takeState(context.Background(), w, spec, sh, o, fromG(sh), goneOf(gone)); err != nil {
		t.Fatal(err)
	}
	close(gone)
	if err := o.arriving.wait(context.Background()); err == nil || !strings.Contains(err.Error(), "from g") {
		t.Errorf("the giver's link failed with the momentum half in: %v", err)
	}

	// A relayed giver that left ends no link: the wait has a deadline (here already past).
	box = NewMailbox(0)
	sh, o = mk(4)
	w, _ = expectState(box, spec, sh, 3, 9)
	deliver(box, 0, theta)
	if err := takeState(context.Background(), w, spec, sh, o, fromG(sh), goneOf(nil)); err != nil {
		t.Fatal(err)
	}
	if d := time.Until(o.arriving.deadline); d < momentumWait-time.Second {
		t.Errorf("the momentum's deadline is %v away, want at least %v", d, momentumWait)
	}
	o.arriving.deadline = time.Now()
	if err := o.arriving.wait(context.Background()); err == nil || !strings.Contains(err.Error(), "deadline") {
		t.Errorf("no momentum, no link to end the wait: %v", err)
	}
	box.Close(nil) // the plan's mailbox closing ends the receiver
	<-o.arriving.done
}

// TestMomentumGate: while an outer-mode taker's momentum is on its way, its training steps go on;
// an outer step (anything else the executor is asked) waits for the momentum; a new plan that
// comes first ends the session rather than keep a shard that is not whole.
func TestMomentumGate(t *testing.T) {
	spec := testJobSpec(7)
	spec.Sync = &job.Sync{Mode: "outer", Every: 2}
	sh, err := model.NewStageShardWithOn(model.Host{}, spec.Model, 0, spec.Model.NLayer, func(int, int) bool { return true }, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := &momentumArrival{done: make(chan struct{}), deadline: time.Now().Add(time.Hour)}
	o := testOuterState(t, sh.P.Specs(), spec)
	o.arriving = a
	s := &session{runner: &StageRunner{Shard: sh, Replica: &proto.ReplicaAssign{}, Outer: o}}
	ctx := context.Background()
	for _, m := range []proto.Message{&proto.StepOpen{}, &proto.StepReroute{}, &proto.Clip{}} {
		if err := s.momentumGate(ctx, work{m: m}); err != nil {
			t.Errorf("%T waited for the momentum: %v", m, err)
		}
	}
	if err := s.momentumGate(ctx, work{m: &proto.Assign{}}); err == nil {
		t.Error("a new plan before the momentum: taken up")
	}
	// An outer step waits: with its context ended, the wait says so instead of letting it by.
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if err := s.momentumGate(ended, work{m: &proto.OuterSync{}}); !errors.Is(err, context.Canceled) {
		t.Errorf("an outer step before the momentum: %v, want it held", err)
	}
	close(a.done)
	if err := s.momentumGate(ctx, work{m: &proto.OuterSync{}}); err != nil || o.arriving != nil {
		t.Errorf("the momentum in: %v, still arriving %v", err, o.arriving != nil)
	}
	if err := s.momentumGate(ctx, work{m: &proto.Assign{}}); err != nil {
		t.Errorf("a new plan after the momentum: %v", err)
	}
}

// TestStateFromTwoGivers: a stage whose blocks no one holder has whole takes each block's state
// from a holder of it (proto.Assign.From in block order, each giver's proto.Gift), over the
// network as giveState sends it: block 0 (with the embeddings) from a giver of stage [0,2), which
// gives that block only, the rest (with the head) from a giver of stage [1,L). The taker ends with
// each tensor exactly its giver's, in step mode (parameters and both moments) and in outer mode
// (the global θ, then the momentum behind it).
func TestStateFromTwoGivers(t *testing.T) {
	for _, outer := range []bool{false, true} {
		spec := testJobSpec(7)
		if outer {
			spec.Sync = &job.Sync{Mode: "outer", Every: 2, OuterLR: 0.7, OuterMomentum: 0.9}
		}
		L := spec.Model.NLayer
		mk := func(lo, hi int, seed uint64) (*model.Shard, *outerState) {
			sh, err := model.NewStageShardWithOn(model.Host{}, spec.Model, lo, hi, func(int, int) bool { return true }, nil)
			if err != nil {
				t.Fatal(err)
			}
			sh.Init(seed)
			for i, m := range sh.Opt.M.Tensors {
				for k := range m.Data {
					m.Data[k], sh.Opt.V.Tensors[i].Data[k] = float32(seed)+float32(k%7)*1e-3, float32(seed)+float32(k%5)*1e-4
				}
			}
			if !outer {
				return sh, nil
			}
			o := testOuterState(t, sh.P.Specs(), spec)
			for i, g := range o.global.Tensors {
				for k := range g.Data {
					g.Data[k], o.outer.V.Tensors[i].Data[k] = float32(seed)*10+float32(k%3), float32(seed)*100+float32(k%13)
				}
			}
			return sh, o
		}
		a, ao := mk(0, 2, 1)
		b, bo := mk(1, L, 2)
		taker, to := mk(0, L, 3)
		net := NewMemNetwork()
		defer net.Close()
		w, err := expectState(net.box("t"), spec, taker, 3, 9)
		if err != nil {
			t.Fatal(err)
		}
		from := []proto.Handover{{Worker: "a", FromPlan: 2, Step: 9, Begin: 0, End: 1}, {Worker: "b", FromPlan: 2, Step: 9, Begin: 1, End: L}}
		ctx := context.Background()
		if missed, err := giveState(ctx, net.Peer("a"), spec, a, ao, 3, 9, []proto.Gift{{Worker: "t", Begin: 0, End: 1}}); err != nil || len(missed) > 0 {
			t.Fatalf("giver a: %v %v", missed, err)
		}
		if missed, err := giveState(ctx, net.Peer("b"), spec, b, bo, 3, 9, []proto.Gift{{Worker: "t", Begin: 1, End: L}}); err != nil || len(missed) > 0 {
			t.Fatalf("giver b: %v %v", missed, err)
		}
		if err := takeState(ctx, w, spec, taker, to, from, goneOf(nil)); err != nil {
			t.Fatal(err)
		}
		if outer {
			if err := to.arriving.wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// What each giver holds, by name: the taker's tensor of that name must be it.
		want := map[string][]float32{}
		for _, g := range []struct {
			sh     *model.Shard
			o      *outerState
			lo, hi int
		}{{a, ao, 0, 1}, {b, bo, 1, L}} {
			_, blocks, err := handoverNumbers(spec, g.sh)
			if err != nil {
				t.Fatal(err)
			}
			for i, st := range handoverTensors(g.sh, g.o) {
				if blocks[i] < g.lo || blocks[i] >= g.hi {
					continue
				}
				key := st.Name
				if g.o != nil && isMomentum(g.o, st) {
					key = "momentum." + key
				}
				want[key] = st.Data
			}
		}
		got := handoverTensors(taker, to)
		if len(got) != len(want) {
			t.Fatalf("outer %v: the taker holds %d state tensors, the givers %d between them", outer, len(got), len(want))
		}
		for _, st := range got {
			key := st.Name
			if to != nil && isMomentum(to, st) {
				key = "momentum." + key
			}
			src, ok := want[key]
			if !ok {
				t.Fatalf("outer %v: %s has no giver", outer, key)
			}
			for k := range src {
				if st.Data[k] != src[k] {
					t.Fatalf("outer %v: %s[%d] = %v, its giver's %v", outer, key, k, st.Data[k], src[k])
				}
			}
		}
		if outer {
			// An outer-mode taker starts from the global θ it took: θ_r is it.
			for i, p := range taker.P.Tensors {
				if p.Data[0] != to.global.Tensors[i].Data[0] {
					t.Fatalf("θ_r %s is not the global θ taken", p.Name)
				}
			}
		}
	}
}

// isMomentum reports whether st, a tensor of handoverTensors(_, o), is o's outer momentum.
func isMomentum(o *outerState, st safetensors.Tensor) bool {
	for _, v := range o.outer.V.Tensors {
		if len(v.Data) > 0 && len(st.Data) > 0 && &v.Data[0] == &st.Data[0] {
			return true
		}
	}
	return false
}
