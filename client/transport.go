package client

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/shoal-ml/shoal/proto"
)

// Transport carries tensors between the peers of a step. Tensors are named by their
// proto.TensorKey (kind, plan version, step, micro-batch, block, expert), which is unique within a
// step, so the receiver asks for what it needs and does not care about arrival order.
type Transport interface {
	// Send hands t to the network for peer to. It must not wait for the receiver to ask for t:
	// 1F1B deadlocks with rendezvous sends (sched.OneFOneB). ctx bounds the wait for buffer
	// space when the link is congested.
	Send(ctx context.Context, to string, t proto.Tensor) error
	// Recv returns the tensor named key once it has arrived; ctx bounds the wait.
	Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error)
}

// ErrClosed is returned by a Mailbox (and the transports built on it) after Close.
var ErrClosed = errors.New("transport closed")

// ErrDuplicate means a tensor arrived twice: a confused or hostile peer.
var ErrDuplicate = errors.New("duplicate tensor")

// Mailbox holds the tensors that arrived for one peer until it asks for them. Every transport
// feeds one: the in-memory network directly, a data channel after reassembling frames.
type Mailbox struct {
	mu       sync.Mutex
	arrived  map[proto.TensorKey]proto.Tensor
	waiting  map[proto.TensorKey]chan proto.Tensor
	bytes    int
	maxBytes int
	err      error
	// taken are the stage-boundary tensors (activations and their gradients) of step takenStep
	// that a receiver took: DeliverOnce drops another copy of one. Only the latest step's are
	// kept — a stage takeover resends within the step in flight (reroute.go).
	taken     map[proto.TensorKey]bool
	takenStep uint64
}

// NewMailbox makes a mailbox that holds at most maxBytes of undelivered payload (0: no bound).
func NewMailbox(maxBytes int) *Mailbox {
	return &Mailbox{arrived: map[proto.TensorKey]proto.Tensor{}, waiting: map[proto.TensorKey]chan proto.Tensor{}, maxBytes: maxBytes}
}

// Deliver files t. It fails when the mailbox is closed, t is already held, or holding it would
// exceed the bound: all of which mean the sender misbehaves.
func (m *Mailbox) Deliver(t proto.Tensor) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.deliver(t)
}

func (m *Mailbox) deliver(t proto.Tensor) error {
	if m.err != nil {
		return m.err
	}
	if ch, ok := m.waiting[t.Key]; ok {
		delete(m.waiting, t.Key)
		m.took(t.Key)
		ch <- t // buffered: never blocks
		return nil
	}
	if _, dup := m.arrived[t.Key]; dup {
		return fmt.Errorf("%w: %v", ErrDuplicate, t.Key)
	}
	if m.maxBytes > 0 && m.bytes+len(t.Data) > m.maxBytes {
		return fmt.Errorf("mailbox full: %d bytes held, %v brings %d more (limit %d)", m.bytes, t.Key, len(t.Data), m.maxBytes)
	}
	m.arrived[t.Key] = t
	m.bytes += len(t.Data)
	return nil
}

// DeliverOnce files t as Deliver does, except that a copy of a tensor held already, or taken
// already in the same step, is dropped without an error: what a stage takeover's taker sends the
// lost stage's neighbours (proto.StageTakeover), some of which they had from the lost stage. The
// copy is the same bits — the same micro-batch through the same parameters — and the audits hold
// each sender to what it committed to sending.
func (m *Mailbox) DeliverOnce(t proto.Tensor) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, held := m.arrived[t.Key]; held || m.taken[t.Key] && t.Key.Step == m.takenStep {
		return nil
	}
	return m.deliver(t)
}

// took records that a receiver took the tensor of key (DeliverOnce). Called with m.mu held.
func (m *Mailbox) took(key proto.TensorKey) {
	if key.Kind != proto.KindActivation && key.Kind != proto.KindActivationGrad {
		return
	}
	if m.taken == nil || key.Step != m.takenStep {
		m.taken, m.takenStep = map[proto.TensorKey]bool{}, key.Step
	}
	m.taken[key] = true
}

// Expect posts a receipt for key before it arrives: the tensor goes to the channel returned, never
// held against the bound. The channel is closed when the mailbox is.
func (m *Mailbox) Expect(key proto.TensorKey) (<-chan proto.Tensor, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return nil, m.err
	}
	if _, dup := m.waiting[key]; dup {
		return nil, fmt.Errorf("two receivers wait for %v", key)
	}
	if _, held := m.arrived[key]; held {
		return nil, fmt.Errorf("%v arrived before it was expected", key)
	}
	ch := make(chan proto.Tensor, 1)
	m.waiting[key] = ch
	return ch, nil
}

// Recv implements Transport's receiving half.
func (m *Mailbox) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	m.mu.Lock()
	if m.err != nil {
		m.mu.Unlock()
		return proto.Tensor{}, m.err
	}
	if t, ok := m.arrived[key]; ok {
		delete(m.arrived, key)
		m.bytes -= len(t.Data)
		m.took(key)
		m.mu.Unlock()
		return t, nil
	}
	if _, dup := m.waiting[key]; dup {
		m.mu.Unlock()
		return proto.Tensor{}, fmt.Errorf("two receivers wait for %v", key)
	}
	ch := make(chan proto.Tensor, 1)
	m.waiting[key] = ch
	m.mu.Unlock()
	select {
	case t, ok := <-ch:
		if !ok {
			return proto.Tensor{}, m.closedErr()
		}
		return t, nil
	case <-ctx.Done():
		m.mu.Lock()
		if m.waiting[key] == ch {
			delete(m.waiting, key)
		} else if t, ok := <-ch; ok && m.err == nil {
			// Delivered between ctx ending and the lock (Deliver fills ch under the lock, so it
			// is there): held again for the next Recv of key. A wait ended by a reroute asks for
			// the same node again (reducer.recvNode), and a node dropped here was never sent
			// twice: the reduction waited for it until the step's deadline
			// (TestRerouteEqualsModel/while_it_waits, 3 runs in 10 under -race). An abandoned
			// step's tensors go with Discard, as any held one's do. (Only Deliver, which fills
			// ch, and Close, which closes it, take a wait off the map: ch never blocks here.)
			if other, waits := m.waiting[key]; waits {
				delete(m.waiting, key) // a receiver that came since takes it
				other <- t
			} else {
				m.arrived[key] = t
				m.bytes += len(t.Data)
			}
		}
		m.mu.Unlock()
		return proto.Tensor{}, fmt.Errorf("waiting for %v: %w", key, ctx.Err())
	}
}

func (m *Mailbox) closedErr() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// Discard drops held tensors whose keys match: those of an abandoned step or an old plan.
func (m *Mailbox) Discard(match func(proto.TensorKey) bool) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for k, t := range m.arrived {
		if match(k) {
			delete(m.arrived, k)
			m.bytes -= len(t.Data)
			n++
		}
	}
	return n
}

// Close fails every pending and future Recv and Deliver with err (ErrClosed when nil).
func (m *Mailbox) Close(err error) {
	if err == nil {
		err = ErrClosed
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return
	}
	m.err = err
	for k, ch := range m.waiting {
		close(ch)
		delete(m.waiting, k)
	}
}

// MemNetwork connects peers in one process: Send files a copy of the tensor in the receiver's
// mailbox. It is the transport of the in-process equivalence tests.
type MemNetwork struct {
	mu    sync.Mutex
	boxes map[string]*Mailbox
}

// NewMemNetwork makes an empty network.
func NewMemNetwork() *MemNetwork { return &MemNetwork{boxes: map[string]*Mailbox{}} }

// Peer returns the transport of peer id, creating its mailbox on first use.
func (n *MemNetwork) Peer(id string) Transport {
	return memPeer{n: n, box: n.box(id)}
}

func (n *MemNetwork) box(id string) *Mailbox {
	n.mu.Lock()
	defer n.mu.Unlock()
	b, ok := n.boxes[id]
	if !ok {
		b = NewMailbox(0)
		n.boxes[id] = b
	}
	return b
}

// Close closes every mailbox.
func (n *MemNetwork) Close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, b := range n.boxes {
		b.Close(nil)
	}
}

type memPeer struct {
	n   *MemNetwork
	box *Mailbox
}

func (p memPeer) Send(ctx context.Context, to string, t proto.Tensor) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.Data = append([]byte(nil), t.Data...) // the receiver owns its copy, as over a wire
	return p.n.box(to).Deliver(t)
}

func (p memPeer) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	return p.box.Recv(ctx, key)
}
