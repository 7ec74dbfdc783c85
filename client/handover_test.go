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
	send := func(box *Mailbox, sh *model.Shard, n int, tamper func(i int, tn *proto.Tensor)) {
		for i, st := range handoverTensors(sh, nil)[:n] {
			tn, err := rowsTensor(stateKey(3, 9, i), model.F32, st.Data, 1)
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
	if err := takeState(context.Background(), w, taker, nil, "g", nil); err != nil {
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
	w, _ = expectState(box, job.Spec{}, mk(3), 3, 9)
	send(box, giver, 1, func(i int, tn *proto.Tensor) { tn.Data = tn.Data[:len(tn.Data)-4] })
	if err := takeState(context.Background(), w, mk(3), nil, "g", nil); err == nil || !strings.Contains(err.Error(), "want") {
		t.Errorf("a short tensor: %v", err)
	}

	// The link fails after everything arrived: taken. After half: refused, naming the giver.
	gone := make(chan struct{})
	close(gone)
	box = NewMailbox(0)
	sh := mk(4)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	send(box, giver, n, nil)
	if err := takeState(context.Background(), w, sh, nil, "g", gone); err != nil {
		t.Errorf("the whole state arrived before the link failed: %v", err)
	}
	box = NewMailbox(0)
	sh = mk(5)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	send(box, giver, n/2, nil)
	if err := takeState(context.Background(), w, sh, nil, "g", gone); err == nil || !strings.Contains(err.Error(), "from g") {
		t.Errorf("half the state, then the link failed: %v", err)
	}
	// A closed mailbox (a newer plan) ends the wait too.
	box = NewMailbox(0)
	w, _ = expectState(box, job.Spec{}, sh, 3, 9)
	box.Close(nil)
	if err := takeState(context.Background(), w, sh, nil, "g", nil); !errors.Is(err, ErrClosed) {
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
	deliver := func(box *Mailbox, lo, hi int) {
		for i := lo; i < hi; i++ {
			tn, err := rowsTensor(stateKey(3, 9, i), model.F32, state[i].Data, 1)
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
	if err := takeState(context.Background(), w, sh, o, "g", nil); err != nil {
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
	if err := takeState(context.Background(), w, sh, o, "g", gone); err != nil {
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
	if err := takeState(context.Background(), w, sh, o, "g", nil); err != nil {
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
