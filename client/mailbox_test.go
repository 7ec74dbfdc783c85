package client

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/proto"
)

// TestMailboxKeepsWhatArrivesAsAWaitEnds: a Recv whose context ends just as its tensor is
// delivered returns the context's error, and the tensor stays for the next Recv of its key. A
// reduction whose wait a reroute interrupts asks for the same gradient node again, which is never
// sent twice: before, a node delivered in that window was dropped, and the step waited for it
// until its deadline. The window is a few instructions wide, so each round races a Deliver
// against a cancel; whichever wins, the tensor must be there for the second Recv.
func TestMailboxKeepsWhatArrivesAsAWaitEnds(t *testing.T) {
	m := NewMailbox(0)
	key := proto.TensorKey{Kind: proto.KindGradReduce, PlanVersion: 1, Expert: proto.NoExpert}
	lost := 0
	for i := range 3000 {
		key.Step = uint64(i)
		ctx, cancel := context.WithCancel(context.Background())
		first := make(chan error, 1)
		go func() {
			_, err := m.Recv(ctx, key)
			first <- err
		}()
		// Let the Recv post its wait (or not: either order must keep the tensor).
		for range i % 3 {
			time.Sleep(0)
		}
		go cancel()
		if err := m.Deliver(proto.Tensor{Key: key, DType: proto.F32, Data: make([]byte, 4)}); err != nil {
			t.Fatalf("round %d: deliver: %v", i, err)
		}
		if err := <-first; err == nil {
			continue // the first Recv got it
		}
		again, stop := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := m.Recv(again, key)
		stop()
		if err != nil {
			lost++
		}
	}
	if lost > 0 {
		t.Fatalf("%d of 3000 tensors delivered as a wait ended were lost", lost)
	}
	if m.bytes != 0 || len(m.arrived) != 0 || len(m.waiting) != 0 {
		t.Fatalf("the mailbox holds %d bytes, %d tensors, %d waits after every tensor was taken", m.bytes, len(m.arrived), len(m.waiting))
	}
}

// TestMailboxDeliverOnce: a copy of a boundary tensor the stage took already, or holds, is
// dropped without an error (a stage takeover's taker sends the lost stage's neighbours what they
// may have had from it), where Deliver refuses a duplicate held tensor; a copy of an earlier
// step's counts for nothing, and a new tensor is filed.
func TestMailboxDeliverOnce(t *testing.T) {
	m := NewMailbox(1 << 20)
	ctx := context.Background()
	key := func(step uint64, mb int) proto.TensorKey {
		return actKey(proto.StepSpec{Step: step, PlanVersion: 1}, mb, 2)
	}
	tn := func(k proto.TensorKey) proto.Tensor {
		return proto.Tensor{Key: k, DType: proto.F32, Data: make([]byte, 16)}
	}
	if err := m.Deliver(tn(key(4, 0))); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Recv(ctx, key(4, 0)); err != nil {
		t.Fatal(err)
	}
	if err := m.DeliverOnce(tn(key(4, 0))); err != nil {
		t.Fatalf("a copy of a tensor taken: %v", err)
	}
	if err := m.Deliver(tn(key(4, 1))); err != nil {
		t.Fatal(err)
	}
	if err := m.DeliverOnce(tn(key(4, 1))); err != nil {
		t.Fatalf("a copy of a tensor held: %v", err)
	}
	if err := m.Deliver(tn(key(4, 1))); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("Deliver of a duplicate held tensor: %v, want ErrDuplicate", err)
	}
	if m.bytes != 16 {
		t.Fatalf("%d bytes held, want the one tensor's 16: the copies were kept", m.bytes)
	}
	if err := m.DeliverOnce(tn(key(4, 2))); err != nil || m.bytes != 32 {
		t.Fatalf("a new tensor: %v, %d bytes held", err, m.bytes)
	}
	// The next step's taken tensors replace the last's.
	if err := m.Deliver(tn(key(5, 0))); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Recv(ctx, key(5, 0)); err != nil {
		t.Fatal(err)
	}
	if err := m.DeliverOnce(tn(key(4, 0))); err != nil || m.bytes != 48 {
		t.Fatalf("a copy of a tensor taken in an earlier step: %v, %d bytes held (want it filed)", err, m.bytes)
	}
}
