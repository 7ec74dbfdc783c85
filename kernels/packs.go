package kernels

import (
	"sync"
	"sync/atomic"
)

// Packs keeps the packed form of multiplies' B operands that do not change for a while: a
// layer's weights during a training step, which every micro-batch multiplies by forward (W as the
// B of an NT product) and backward (W as the B of an NN product). Each is then packed once a step
// instead of once a micro-batch. Packing only moves floats, so a kept pack changes no result.
//
// A Packs is consulted only inside a span (Begin … End), by a caller that promises that no B
// given to it changes during the span; outside one, and past Limit floats, multiplies pack as
// usual. End drops what was kept (its memory is reused by the next span). Safe for concurrent use:
// lanes of one step share one.
type Packs struct {
	// Limit is the most floats kept at once; 0 means DefaultPacksLimit.
	Limit int

	mu      sync.Mutex
	on      bool
	used    int
	entries map[packKey]*packEntry
	free    [][]float32
}

// DefaultPacksLimit bounds a Packs' memory when its Limit is 0: 128 MiB, the default model's
// weights in both layouts (52 MB) with room to spare; a larger model keeps the first of its
// weights it meets.
const DefaultPacksLimit = 32 << 20

type packKey struct {
	b       *float32
	n       int // len(b)
	im      *gemmImpl
	transB  bool
	k, cols int
}

// packEntry is one kept pack. Whoever asks for it while it is being packed packs chunks of it
// too (gemmCall.packChunk), claimed in turn, and then waits for the rest: the lanes of a step
// reach each weight at about the same time, and rather than one packing it while the other
// waits, both do half.
type packEntry struct {
	buf    []float32
	g      gemmCall      // the packing: B, its shape and bp = buf
	chunks int           // g.packChunks()
	next   atomic.Int64  // chunks claimed
	left   atomic.Int64  // chunks not packed yet
	done   chan struct{} // closed when left reaches 0
}

// pack claims and packs chunks of e until none is left to claim, then waits until every chunk
// is packed.
func (e *packEntry) pack() {
	for {
		c := int(e.next.Add(1)) - 1
		if c >= e.chunks {
			break
		}
		e.g.packChunk(c)
		if e.left.Add(-1) == 0 {
			close(e.done)
		}
	}
	<-e.done
}

// Begin starts a span in which the Bs given to p do not change.
func (p *Packs) Begin() {
	p.mu.Lock()
	p.on = true
	p.mu.Unlock()
}

// End ends the span and drops every kept pack.
func (p *Packs) End() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.on = false
	for k, e := range p.entries {
		if e.buf != nil {
			p.free = append(p.free, e.buf)
		}
		delete(p.entries, k)
	}
	p.used = 0
}

// get returns b packed as a shared multiply reads it (packPanel's layout for k×n, or n×k when
// transB), packing it first if this is the span's first multiply by it; nil outside a span or
// past the limit.
func (p *Packs) get(im *gemmImpl, transB bool, b []float32, k, n, threads int) []float32 {
	if len(b) == 0 {
		return nil
	}
	key := packKey{b: &b[0], n: len(b), im: im, transB: transB, k: k, cols: n}
	nr := im.nr
	npad := (n + nr - 1) / nr * nr
	size := k * npad
	p.mu.Lock()
	if !p.on {
		p.mu.Unlock()
		return nil
	}
	e := p.entries[key]
	if e == nil {
		limit := p.Limit
		if limit == 0 {
			limit = DefaultPacksLimit
		}
		if p.used+size > limit {
			p.mu.Unlock()
			return nil
		}
		p.used += size
		e = &packEntry{}
		if p.entries == nil {
			p.entries = map[packKey]*packEntry{}
		}
		p.entries[key] = e
		// The buffer: the smallest free one that holds size (so that a span of the same
		// multiplies as the last one allocates nothing), else a new one.
		best := -1
		for i, f := range p.free {
			if cap(f) >= size && (best < 0 || cap(f) < cap(p.free[best])) {
				best = i
			}
		}
		if best >= 0 {
			e.buf = p.free[best][:size]
			p.free[best] = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		} else {
			e.buf = make([]float32, size)
		}
		nkb := (k + kcMax - 1) / kcMax
		e.g = gemmCall{im: im, transB: transB, b: b, k: k, n: n, kcb: (k + nkb - 1) / nkb, npad: npad, bp: e.buf}
		e.chunks = e.g.packChunks()
		e.left.Store(int64(e.chunks))
		e.done = make(chan struct{})
		if e.chunks == 0 {
			close(e.done)
		}
	}
	p.mu.Unlock()
	if threads > 1 && e.next.Load() < int64(e.chunks) {
		// The pool's helpers claim chunks too; each then waits for the rest, as the caller does.
		// (Once every chunk is claimed, as for every multiply after a span's first by this B,
		// there is nothing to wake them for.)
		parallelFor(threads, threads, func(*scratch, int) { e.pack() })
	} else {
		e.pack()
	}
	return e.buf
}

// LinearForwardPacked is LinearForward with w's packed form kept in pk (nil: LinearForward).
func LinearForwardPacked(pk *Packs, out, inp, w, bias []float32, N, IN, OUT int) {
	gemmPacked(pk, false, true, out, inp, w, N, IN, OUT, false)
	linearBias(out, bias, N, OUT)
}

// LinearBackwardPacked is LinearBackward with w's packed form kept in pk (nil: LinearBackward).
func LinearBackwardPacked(pk *Packs, dinp, dw, db, dout, inp, w []float32, N, IN, OUT int, accIn bool) {
	gemmPacked(pk, false, false, dinp, dout, w, N, OUT, IN, accIn)
	MatMulTN(dw, dout, inp, OUT, N, IN, true)
	linearBiasGrad(db, dout, N, OUT)
}
