package client

import (
	"context"
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
