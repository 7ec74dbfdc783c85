package model

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/shoal-ml/shoal/safetensors"

	"github.com/shoal-ml/shoal/kernels"
)

// Low-communication training: DiLoCo's outer step (Douillard et al., "DiLoCo: Distributed
// Low-Communication Training of Language Models", 2023; docs/design.md, "Replicas
// and synchronisation"). This file is the definition the distributed run follows bit for bit.
//
// R pipeline replicas each hold their own parameters θ_r and their own AdamW state, and take
// inner steps apart (each on its own micro-batches of the step's batch; package local). Every H
// steps the replicas that are still there — the participants, in replica order — take an outer
// step together (Outer.Step):
//
//  1. Each participant's pseudo-gradient Δ_r = θ − θ_r, θ the global parameters of the last outer
//     step, elementwise in float64 (exact: the difference of two float32 is a float64 unless one is
//     over 2^28 times the other). Without compression what crosses is θ_r itself (4 bytes a
//     value, as many as a float32 Δ_r), from which whoever averages forms this exact Δ_r.
//  2. With Int8 the participant sends Δ_r as int8 with error feedback (Int8EF): it rounds
//     u = float32(Δ_r) + e_r (float32 arithmetic) chunk by chunk (OuterChunk values of a tensor
//     share one float32 scale), keeps e_r = u − round(u) for the next round, and the average uses
//     round(u).
//  3. The average Δ = float32((Σ_r Δ_r)/n), summed in float64 in replica order over the n
//     participants and rounded once to float32 (the gradient torch's SGD sees is float32 too; a
//     lone participant's Δ is left in float64, so that one replica is plain training). With Int8
//     the average travels back as int8 too, with its own error feedback e (DoubleSqueeze, Tang et
//     al. 2019, compensates both legs the same way): Δ ← round(Δ + e). The error feedback e of
//     each chunk lives with the chunk's owner in the reduce-scatter (OuterSegment), so it
//     restarts from zero whenever the participants are not the previous outer step's
//     (Participate): no holder has the whole of it. A checkpoint gathers it whole.
//  4. Nesterov momentum as torch.optim.SGD(nesterov=True) computes it with the pseudo-gradient as
//     the gradient: v = float32(μ·v + Δ); θ = float32(θ − lr·(Δ + μ·v)), each right side
//     evaluated in float64 and rounded once. v starts at zero.
//  5. Every participant continues from the new θ: θ_r = θ. Its AdamW state is not touched (inner
//     optimizer states are never averaged, as in DiLoCo). A replica that joins later starts from
//     the latest θ (and, with Int8, a zero error).
//
// With one participant, lr 1 and μ 0 (and no compression) the outer step sets θ to θ_r exactly, so
// such a run is plain training bit for bit.
//
// The sums run element by element in a fixed order and nothing depends on goroutine timing: two
// runs with the same participants agree bit for bit, in one process or split over peers (a peer
// that owns a slice of the tensors computes the same elements the same way; chunks never cross a
// tensor, so slices cut at chunk boundaries quantise alike). Across peers the step is a
// reduce-scatter and an all-gather: participant q owns segment q of every tensor (OuterSegment),
// averages it from what the others send (ReduceSegment) and sends the float32 (or int8) average
// back; every holder then takes the Nesterov step itself (ApplyAverage), so θ and the momentum
// stay alike everywhere.

// Checkpoint names of outer mode, in one process (local) and across a plan's replicas alike: the
// global θ under the tensors' own names, its outer momentum and (int8) the average's error
// feedback under OuterMomentumPrefix and OuterErrPrefix, and replica r's θ_r, AdamW moments and
// (int8) error feedback under ReplicaPrefix(r) — ReplicaPrefix(r)+name, +"optim.m."+name,
// +"optim.v."+name, +ReplicaErrPrefix+name.
const (
	OuterMomentumPrefix = "optim.outer."
	OuterErrPrefix      = "optim.outer.err."
	ReplicaErrPrefix    = "optim.err."
	// ReplicaSnapPrefix, under ReplicaPrefix(r), is θ_r as it was at an outer step not yet taken
	// up (job.Sync.Delay; Rebase): present only in a checkpoint taken while one is pending.
	ReplicaSnapPrefix = "outer.snap."
)

// ReplicaPrefix is what replica r's tensors are named under in an outer-mode checkpoint.
func ReplicaPrefix(r int) string { return "replica." + strconv.Itoa(r) + "." }

// OuterCheckpointGlobal is the global part of an outer-mode checkpoint: θ, the outer momentum and,
// with int8, the average's error feedback.
func OuterCheckpointGlobal(global *Params, o *Outer) []safetensors.Tensor {
	ts := CheckpointTensors(global, nil)
	ts = append(ts, prefixedTensors(OuterMomentumPrefix, o.V)...)
	if o.Err != nil {
		ts = append(ts, prefixedTensors(OuterErrPrefix, o.Err)...)
	}
	return ts
}

// OuterCheckpointReplica is replica r's part of an outer-mode checkpoint: θ_r, its AdamW moments
// and, when e is not nil, its int8 error feedback.
func OuterCheckpointReplica(r int, p *Params, opt *AdamW, e *Params) []safetensors.Tensor {
	var ts []safetensors.Tensor
	for _, t := range CheckpointTensors(p, opt) {
		t.Name = ReplicaPrefix(r) + t.Name
		ts = append(ts, t)
	}
	if e != nil {
		ts = append(ts, prefixedTensors(ReplicaPrefix(r)+ReplicaErrPrefix, e)...)
	}
	return ts
}

// OuterCheckpointSnap is replica r's snapshot of a delayed outer step not yet taken up (Rebase),
// for a checkpoint taken meanwhile.
func OuterCheckpointSnap(r int, snap *Params) []safetensors.Tensor {
	return prefixedTensors(ReplicaPrefix(r)+ReplicaSnapPrefix, snap)
}

func prefixedTensors(prefix string, p *Params) []safetensors.Tensor {
	if p == nil {
		return nil
	}
	out := make([]safetensors.Tensor, 0, len(p.Tensors))
	for _, t := range p.Tensors {
		out = append(out, safetensors.Tensor{Name: prefix + t.Name, Shape: t.Shape, Data: t.Data})
	}
	return out
}

// OuterChunk is how many consecutive values of a tensor share one int8 scale when pseudo-gradients
// are compressed: each tensor is cut into chunks of OuterChunk values from its first, the last
// chunk shorter. 4 bytes of scale per 256 values cost 1.6% on top of the int8 payload.
const OuterChunk = 256

// OuterLayout is how a tensor of N values crosses at an outer step, in two parts (the parts of
// proto.OuterDeltaKey). Without Int8, part 0 is θ_r, N float32s, and part 1 is empty. With Int8
// the tensor is cut into chunks of OuterChunk values from its first, the last shorter when
// OuterChunk does not divide N, each crossing as a float32 scale and its int8 codes
// (Int8EFCodes): part 0 holds the full chunks as an int8 matrix of a row each, part 1 the last,
// shorter chunk as a matrix of one row. A part the tensor has no values for is empty, and is not
// sent. An int8 part's payload is a proto.I8 tensor's: its rows' scales (float32, little-endian),
// then their codes row by row.
//
// A chunk is also what a signature's Merkle tree hashes a leaf of (package audit, "Outer
// commitments"), and what a receiver's bound judges at a time: AppendChunk gives its bytes as
// they crossed.
type OuterLayout struct {
	N    int
	Int8 bool
}

// Part is part p's matrix, rows × cols (no rows when the tensor has no such part), and the
// tensor's value its first row starts at.
func (l OuterLayout) Part(p int) (rows, cols, first int) {
	full, rest := l.N/OuterChunk, l.N%OuterChunk
	switch {
	case !l.Int8 && p == 0:
		return l.N, 1, 0
	case !l.Int8:
		return 0, 0, l.N
	case p == 0:
		return full, OuterChunk, 0
	}
	return min(rest, 1), rest, full * OuterChunk
}

// Bytes is the size of part p's payload.
func (l OuterLayout) Bytes(p int) int {
	rows, cols, _ := l.Part(p)
	if !l.Int8 {
		return 4 * rows * cols
	}
	return rows * (4 + cols)
}

// Chunks is the tensor's number of chunks of OuterChunk values.
func (l OuterLayout) Chunks() int { return (l.N + OuterChunk - 1) / OuterChunk }

// CheckParts fails when parts are not the payloads of a tensor so laid out.
func (l OuterLayout) CheckParts(parts [2][]byte) error {
	if len(parts[0]) != l.Bytes(0) || len(parts[1]) != l.Bytes(1) {
		format := "float32"
		if l.Int8 {
			format = "int8 rows"
		}
		return fmt.Errorf("parts of %d and %d bytes, want %d and %d (%s for %d values)", len(parts[0]), len(parts[1]), l.Bytes(0), l.Bytes(1), format, l.N)
	}
	return nil
}

// AppendChunk appends chunk c as it crossed in parts (checked by CheckParts) to buf: its
// float32s, or its row's scale and codes.
func (l OuterLayout) AppendChunk(buf []byte, parts [2][]byte, c int) []byte {
	if !l.Int8 {
		return append(buf, parts[0][4*OuterChunk*c:min(4*OuterChunk*(c+1), 4*l.N)]...)
	}
	p, row := 0, c
	if full := l.N / OuterChunk; c >= full {
		p, row = 1, c-full
	}
	scale, codes := l.row(p, parts[p], row)
	return append(append(buf, scale...), codes...)
}

// row is the scale and codes of row r of int8 part p's payload b.
func (l OuterLayout) row(p int, b []byte, r int) (scale, codes []byte) {
	rows, cols, _ := l.Part(p)
	return b[4*r : 4*r+4], b[4*rows+r*cols : 4*rows+(r+1)*cols]
}

// EncodeInt8 is what crosses with Int8 from a replica whose θ_r is r, given the global θ g and
// its error feedback e: every chunk's pseudo-gradient through int8 (PseudoGradient), e updated
// and x left holding the values as they cross.
func (l OuterLayout) EncodeInt8(g, r, x, e []float32) [2][]byte {
	var out [2][]byte
	codes := make([]int8, OuterChunk)
	for p := range out {
		rows, cols, first := l.Part(p)
		if rows == 0 {
			continue
		}
		out[p] = make([]byte, l.Bytes(p))
		for row := range rows {
			lo, hi := first+row*cols, first+(row+1)*cols
			s := PseudoGradient(g[lo:hi], r[lo:hi], x[lo:hi], e[lo:hi], codes[:cols])
			scale, dst := l.row(p, out[p], row)
			binary.LittleEndian.PutUint32(scale, math.Float32bits(s))
			for i, c := range codes[:cols] {
				dst[i] = byte(c)
			}
		}
	}
	return out
}

// DecodeInt8 writes the values that int8 part p's payload b (of Bytes(p)) holds into x, the
// tensor's N values.
func (l OuterLayout) DecodeInt8(x []float32, p int, b []byte) {
	rows, cols, first := l.Part(p)
	codes := make([]int8, cols)
	for row := range rows {
		scale, src := l.row(p, b, row)
		for i, c := range src {
			codes[i] = int8(c)
		}
		lo := first + row*cols
		Int8Decode(x[lo:lo+cols], codes, math.Float32frombits(binary.LittleEndian.Uint32(scale)))
	}
}

// ErrNoParticipants means an outer step was asked of an empty set of replicas.
var ErrNoParticipants = errors.New("outer step without participants")

// Outer is the outer optimizer of low-communication training and its state, laid out like the
// model's parameters.
type Outer struct {
	LR, Momentum float64 // the Nesterov step's learning rate and momentum μ, μ in [0, 1)
	Int8         bool    // pseudo-gradients cross as int8 with error feedback, both ways

	V   *Params // momentum buffer, zero before the first outer step
	Err *Params // with Int8: error feedback of the averaged pseudo-gradient; nil otherwise

	u, d []float64 // one chunk's scratch
	q    []float32
	// owners are the participants of the last outer step (Participate), nil while the average's
	// error feedback is whole.
	owners []int
}

// NewOuter allocates an outer optimizer with zero state for tensors specs.
func NewOuter(specs []Spec, lr, momentum float64, int8 bool) *Outer {
	var e *Params
	if int8 {
		e = NewParams(specs)
	}
	return NewOuterIn(NewParams(specs), e, lr, momentum)
}

// NewOuterIn is an outer optimizer whose state lives in v (the momentum) and, for int8, e (the
// average's error feedback; nil for float32 exchanges), which the caller allocated alike — in a
// file mapping, say (client/outerstore.go). Their values are taken as they are.
func NewOuterIn(v, e *Params, lr, momentum float64) *Outer {
	return &Outer{LR: lr, Momentum: momentum, Int8: e != nil, V: v, Err: e}
}

// Step takes the outer step (see the top of this file): global is θ, replicas are the
// participants' θ_r in replica order, and errs, with Int8, their error-feedback states (laid out
// like θ; zero for a replica's first round), in the same order; errs is ignored without Int8.
// global, the participants' parameters and errs are updated in place: afterwards every
// participant holds the new θ. Replicas not passed are left alone; the caller sets θ_r = θ for a
// replica that (re)joins.
func (o *Outer) Step(global *Params, replicas, errs []*Params) error {
	if err := o.StepDelayed(global, replicas, errs); err != nil {
		return err
	}
	for _, r := range replicas {
		for ti, gt := range global.Tensors {
			copy(r.Tensors[ti].Data, gt.Data)
		}
	}
	return nil
}

// StepDelayed is Step for a run that overlaps the outer step with training (job.Sync.Delay):
// global, V, Err and errs end as Step leaves them, but the participants keep their θ_r — each
// takes up the new θ later, keeping the progress it made meanwhile (Rebase).
func (o *Outer) StepDelayed(global *Params, replicas, errs []*Params) error {
	n := len(replicas)
	if n == 0 {
		return ErrNoParticipants
	}
	if o.Int8 && len(errs) != n {
		return fmt.Errorf("outer step: %d error-feedback states for %d participants", len(errs), n)
	}
	all := append([]*Params{o.V}, replicas...)
	if o.Int8 {
		all = append(append(all, o.Err), errs...)
	}
	for i, p := range all {
		if err := sameLayout(global, p); err != nil {
			return fmt.Errorf("outer step: operand %d: %w", i, err)
		}
	}
	var e *Params
	o.apply(global, n, func(k, ti, a, b int, sum []float64) {
		if o.Int8 {
			e = errs[k]
		}
		for i, v := range o.pseudoGradient(global.Tensors[ti].Data[a:b], replicas[k].Tensors[ti].Data[a:b], e, ti, a) {
			sum[i] += v
		}
	})
	return nil
}

// Rebase takes up a delayed outer step (job.Sync.Delay) on a replica's parameters p: snap is p
// as it was when the replica sent its pseudo-gradient, global the new θ of that outer step, and
// p becomes the new θ plus the progress p made since, θ + (p − snap), elementwise in float64 and
// rounded once to float32. The difference of two float32 values is exact in float64 (unless one
// is over 2^28 times the other), so a replica that made no progress (p = snap) takes up θ
// exactly, as Step's copy would.
func Rebase(p, global, snap *Params) error {
	if err := sameLayout(global, p); err != nil {
		return fmt.Errorf("rebase: %w", err)
	}
	if err := sameLayout(global, snap); err != nil {
		return fmt.Errorf("rebase: snapshot: %w", err)
	}
	for ti, gt := range global.Tensors {
		x, s := p.Tensors[ti].Data, snap.Tensors[ti].Data
		for i, g := range gt.Data {
			x[i] = float32(float64(g) + (float64(x[i]) - float64(s[i])))
		}
	}
	return nil
}

// OuterGiven is one participant's part in an outer step taken where its parameters are not:
// what crossed from it. Without Int8 it is its θ_r (Theta), from which the exact Δ_r is formed;
// with Int8 the dequantised values of its pseudo-gradient, Δ after its own error feedback
// (Delta: what Int8EFCodes left in x, or what a receiver decodes from its codes and scales).
type OuterGiven struct {
	Theta, Delta *Params
}

// StepGiven is Step for a holder of some tensors that has the participants' contributions rather
// than their parameters: a pipeline replica's stage, which holds its own θ_r and receives the
// others' (or their int8 pseudo-gradients) over the network. It computes exactly what Step does
// for these tensors — the same Δ_r, the same sums in replica order, the same momentum, error
// feedback of the average and Nesterov step — and updates global, V and Err; the caller copies
// global into its own θ_r.
func (o *Outer) StepGiven(global *Params, given []OuterGiven) error {
	n := len(given)
	if n == 0 {
		return ErrNoParticipants
	}
	ops := []*Params{o.V}
	if o.Int8 {
		ops = append(ops, o.Err)
	}
	for k, g := range given {
		p := g.Theta
		if o.Int8 {
			p = g.Delta
		}
		if p == nil {
			return fmt.Errorf("outer step: participant %d gave nothing", k)
		}
		ops = append(ops, p)
	}
	for i, p := range ops {
		if err := sameLayout(global, p); err != nil {
			return fmt.Errorf("outer step: operand %d: %w", i, err)
		}
	}
	o.apply(global, n, func(k, ti, a, b int, sum []float64) {
		if o.Int8 {
			for i, v := range given[k].Delta.Tensors[ti].Data[a:b] {
				sum[i] += float64(v)
			}
			return
		}
		g, r := global.Tensors[ti].Data[a:b], given[k].Theta.Tensors[ti].Data[a:b]
		for i := range sum {
			sum[i] += float64(g[i]) - float64(r[i])
		}
	})
	return nil
}

// apply is the outer step's arithmetic on global, chunk by chunk: add(k, ti, a, b, sum) adds
// participant k's pseudo-gradient over elements [a, b) of tensor ti, as it crossed, to sum
// (float64, from zero), participants in order.
func (o *Outer) apply(global *Params, n int, add func(k, ti, a, b int, sum []float64)) {
	for ti, gt := range global.Tensors {
		for a := 0; a < len(gt.Data); a += OuterChunk {
			b := min(a+OuterChunk, len(gt.Data))
			o.u = outerBuf64(o.u, b-a)
			sum := o.u
			clear(sum)
			for k := range n {
				add(k, ti, a, b, sum)
			}
			if n > 1 || o.Int8 {
				o.q = outerBuf32(o.q, b-a)
				o.average(o.q, sum, n, ti, a, nil)
				for i, v := range o.q {
					sum[i] = float64(v)
				}
			}
			kernels.OuterNesterov(gt.Data[a:b], o.V.Tensors[ti].Data[a:b], sum, o.LR, o.Momentum)
		}
	}
}

// average is the averaged pseudo-gradient of one chunk (elements [a, a+len(q)) of tensor ti)
// as it enters the Nesterov step, into q: sum/n rounded to float32, and with Int8 through int8
// with the average's error feedback (Err updated), its codes into codes when not nil and its
// scale returned. This float32 is all a holder needs of the average to take the step: what the
// reduce-scatter's owner sends the others (ReduceSegment, ApplyAverage).
func (o *Outer) average(q []float32, sum []float64, n, ti, a int, codes []int8) float32 {
	for i, v := range sum {
		q[i] = float32(v / float64(n))
	}
	if !o.Int8 {
		return 0
	}
	return Int8EFCodes(q, o.Err.Tensors[ti].Data[a:a+len(q)], codes)
}

// OuterSegment is the values [lo, hi) of a tensor of n values that participant q of r owns in
// the outer step's reduce-scatter: the tensor's chunks (OuterChunk) cut into r contiguous runs,
// the q-th of them. A run may be empty when the tensor has fewer chunks than participants.
// Segments never split a chunk, so an owner quantises and checks exactly the chunks the whole
// tensor has.
func OuterSegment(n, r, q int) (lo, hi int) {
	c := (n + OuterChunk - 1) / OuterChunk
	return min(q*c/r*OuterChunk, n), min((q+1)*c/r*OuterChunk, n)
}

// ReduceSegment is the owner's part of an outer step taken as a reduce-scatter and an
// all-gather (its average is float32 even of one contribution, unlike Step's of a lone
// participant: a segment left with one after the others were lost, StepSegments): given holds the participants' contributions (in participant order) over values
// [lo, lo+len(avg)) of tensor ti of global — each a θ_q, or with Int8 a decoded pseudo-gradient,
// as OuterGiven has them — and avg receives the average as ApplyAverage takes it, exactly what
// Step's arithmetic gives those values (the same sums in the same order, chunk by chunk). With
// Int8 the average's error feedback of those values is updated, and the parts returned are avg's
// codes and scales laid out by OuterLayout{N: len(avg), Int8: true}; lo must start a chunk.
// Nothing else is touched: every holder, the owner too, then takes the step with ApplyAverage.
func (o *Outer) ReduceSegment(global *Params, ti, lo int, given [][]float32, avg []float32) ([2][]byte, error) {
	var out [2][]byte
	n := len(given)
	switch {
	case n == 0:
		return out, ErrNoParticipants
	case lo%OuterChunk != 0 || lo+len(avg) > len(global.Tensors[ti].Data):
		return out, fmt.Errorf("outer step: segment [%d,%d) of a tensor of %d values", lo, lo+len(avg), len(global.Tensors[ti].Data))
	}
	for k, x := range given {
		if len(x) != len(avg) {
			return out, fmt.Errorf("outer step: participant %d gave %d values of a segment of %d", k, len(x), len(avg))
		}
	}
	g := global.Tensors[ti].Data[lo : lo+len(avg)]
	l := OuterLayout{N: len(avg), Int8: o.Int8}
	if o.Int8 {
		for p := range out {
			out[p] = make([]byte, l.Bytes(p))
		}
	}
	codes := make([]int8, OuterChunk)
	for a := 0; a < len(avg); a += OuterChunk {
		b := min(a+OuterChunk, len(avg))
		o.u = outerBuf64(o.u, b-a)
		sum := o.u
		clear(sum)
		for _, x := range given {
			if o.Int8 {
				for i, v := range x[a:b] {
					sum[i] += float64(v)
				}
				continue
			}
			for i, v := range x[a:b] {
				sum[i] += float64(g[a+i]) - float64(v)
			}
		}
		s := o.average(avg[a:b], sum, n, ti, lo+a, codes[:b-a])
		if o.Int8 {
			l.putRow(out, a/OuterChunk, s, codes[:b-a])
		}
	}
	return out, nil
}

// OuterSegmentsPerReplica is how many segments of every tensor each participant of an outer
// step owns in the reduce-scatter (OuterOwners), at most: a replica lost during the exchange
// leaves that many segments, which go to as many survivors (OuterReassign), so that each sends
// the others one more segment's average, not all of the lost replica's.
const OuterSegmentsPerReplica = 16

// maxOuterSegments bounds the segments of an outer step (proto.MaxReplicas).
const maxOuterSegments = 1 << 12

// OuterOwners are the owners of the segments of an outer step of participants ps (replica
// indices, ascending) at its first attempt: the participants in turn, each owning
// OuterSegmentsPerReplica segments (fewer when that would pass maxOuterSegments), segment k the
// (k mod n)-th's. A lone participant owns one: it takes the step alone.
func OuterOwners(ps []int) []int {
	n := len(ps)
	if n <= 1 {
		return slices.Clone(ps)
	}
	c := max(1, min(OuterSegmentsPerReplica, maxOuterSegments/n))
	out := make([]int, c*n)
	for k := range out {
		out[k] = ps[k%n]
	}
	return out
}

// OuterReassign is the owners of an outer step's segments once the replicas live does not hold
// have left during its exchange (proto.OuterSync.Owners): a segment keeps its owner while it is
// live, and a lost owner's segment k goes to the (k mod m)-th of the m live owners, ascending —
// so that a segment moves only when its owner is lost, and a lost replica's segments, which
// OuterOwners interleaves, spread over several survivors. It returns nil when no owner is live.
func OuterReassign(owners []int, live func(replica int) bool) []int {
	var alive []int
	for _, q := range owners {
		if live(q) {
			alive = append(alive, q)
		}
	}
	slices.Sort(alive)
	alive = slices.Compact(alive)
	if len(alive) == 0 {
		return nil
	}
	out := slices.Clone(owners)
	for k, q := range owners {
		if !live(q) {
			out[k] = alive[k%len(alive)]
		}
	}
	return out
}

// SegmentSet is the participants whose contributions segment k of tensor ti was averaged over
// in an outer step whose exchange lost replicas (StepSegments): indices into the step's
// replicas, ascending.
type SegmentSet func(ti, k int) []int

// StepSegments is Step for an outer step whose exchange lost replicas and went on without a
// restart (proto.OuterSync.Owners): replicas are the first attempt's participants, in order, and
// segment k (of len(owners), OuterSegment) of each tensor is averaged over the contributions
// set(ti, k) names — exactly what its last owner computed (ReduceSegment) and every holder then
// applied (ApplyAverage). owners are the first attempt's owners; lost are the owners gone before
// the end, in the order they were lost, each with the owners after it (OuterReassign): the
// average's error feedback of a segment whose owner was lost restarts from zero (Forget), and
// the state ends with the last owners, as every holder's does. θ_r is not touched: the caller
// sets the survivors' to the new θ (or, with a delay, rebases them).
func (o *Outer) StepSegments(global *Params, replicas, errs []*Params, owners []int, lost [][]int, set SegmentSet) error {
	n := len(replicas)
	if n == 0 {
		return ErrNoParticipants
	}
	if o.Int8 && len(errs) != n {
		return fmt.Errorf("outer step: %d error-feedback states for %d participants", len(errs), n)
	}
	o.Participate(owners)
	for _, next := range lost {
		if len(next) != len(owners) {
			return fmt.Errorf("outer step: %d owners after a loss, of %d segments", len(next), len(owners))
		}
		o.Forget(func(r int) bool { return slices.Contains(next, r) })
		o.owners = slices.Clone(next)
	}
	given := make([]OuterGiven, n)
	for r, p := range replicas {
		if err := sameLayout(global, p); err != nil {
			return fmt.Errorf("outer step: replica %d: %w", r, err)
		}
		given[r].Theta = p
		if o.Int8 {
			d := NewParams(global.Specs())
			for ti, t := range p.Tensors {
				g := global.Tensors[ti].Data
				OuterLayout{N: len(g), Int8: true}.EncodeInt8(g, t.Data, d.Tensors[ti].Data, errs[r].Tensors[ti].Data)
			}
			given[r].Delta = d
		}
	}
	var avg []float32
	for ti, t := range global.Tensors {
		for k := range owners {
			lo, hi := OuterSegment(len(t.Data), len(owners), k)
			if lo == hi {
				continue
			}
			in := set(ti, k)
			xs := make([][]float32, len(in))
			for i, r := range in {
				if r < 0 || r >= n || (i > 0 && r <= in[i-1]) {
					return fmt.Errorf("outer step: segment %d of tensor %d averaged over %v of %d participants", k, ti, in, n)
				}
				p := given[r].Theta
				if o.Int8 {
					p = given[r].Delta
				}
				xs[i] = p.Tensors[ti].Data[lo:hi]
			}
			avg = append(avg[:0], make([]float32, hi-lo)...)
			if _, err := o.ReduceSegment(global, ti, lo, xs, avg); err != nil {
				return err
			}
			if err := o.ApplyAverage(global, ti, lo, avg); err != nil {
				return err
			}
		}
	}
	return nil
}

// ApplyAverage takes the outer step over values [lo, lo+len(avg)) of tensor ti of global, given
// their average as ReduceSegment made it: the Nesterov step on θ and the momentum V, which every
// holder of the tensor keeps alike. lo must start a chunk.
func (o *Outer) ApplyAverage(global *Params, ti, lo int, avg []float32) error {
	g, v := global.Tensors[ti].Data, o.V.Tensors[ti].Data
	if lo%OuterChunk != 0 || lo+len(avg) > len(g) {
		return fmt.Errorf("outer step: segment [%d,%d) of a tensor of %d values", lo, lo+len(avg), len(g))
	}
	for a := 0; a < len(avg); a += OuterChunk {
		b := min(a+OuterChunk, len(avg))
		o.d = outerBuf64(o.d, b-a)
		for i, x := range avg[a:b] {
			o.d[i] = float64(x)
		}
		kernels.OuterNesterov(g[lo+a:lo+b], v[lo+a:lo+b], o.d, o.LR, o.Momentum)
	}
	return nil
}

// Participate starts an outer step of participants ps (replica indices, in order). With Int8
// the average's error feedback lives with the reduce-scatter's owners, each keeping that of its
// segment (OuterSegment), so it lasts only while they do: when the participants are not the
// previous outer step's, it restarts from zero — no holder has the whole of it. A restored
// state (Restored) holds all of it and keeps it.
func (o *Outer) Participate(ps []int) {
	if o.Err != nil && o.owners != nil && !slices.Equal(o.owners, ps) {
		o.Err.Zero()
	}
	o.owners = slices.Clone(ps)
}

// Forget zeroes the average's error feedback of the segments whose owners (Participate) are
// gone (live reports false): a checkpoint taken after a replica was dropped, and before the next
// outer step restarts it, has nobody to gather those segments from (a restore from it finds them
// zero, in one process as across peers).
func (o *Outer) Forget(live func(replica int) bool) {
	if o.Err == nil {
		return
	}
	for k, q := range o.owners {
		if live(q) {
			continue
		}
		for _, t := range o.Err.Tensors {
			lo, hi := OuterSegment(len(t.Data), len(o.owners), k)
			clear(t.Data[lo:hi])
		}
	}
}

// Reset is the state before the first outer step: no momentum, no error feedback, whole. Outer
// mode starts so after a synchronous warm-up (job.Sync.Warmup), from wherever the warm-up got to.
func (o *Outer) Reset() {
	o.V.Zero()
	if o.Err != nil {
		o.Err.Zero()
	}
	o.owners = nil
}

// Restored marks the state as whole, as a checkpoint holds it: the next outer step keeps the
// average's error feedback whoever takes part.
func (o *Outer) Restored() { o.owners = nil }

// Grown restarts the average's error feedback from zero, whole: what every holder does when a
// replica joins a running outer-mode job without a restore (a handover of the global θ and the
// momentum, peer to peer). Between two outer steps each owner holds only its own segment, so a
// newcomer cannot be given the rest; zeroing it everywhere is what Participate would do at the
// next outer step anyway whenever the participants change, and it keeps every holder — and the
// single process replaying the run — alike when they do not.
func (o *Outer) Grown() {
	if o.Err != nil {
		o.Err.Zero()
	}
	o.owners = nil
}

// Owners are the participants of the last outer step since the state was whole (Participate),
// nil when it is.
func (o *Outer) Owners() []int { return o.owners }

// SetOwners puts back owners as Owners returned them (nil: the state is whole, as Restored
// leaves it), for a worker that takes an outer step again from the state before its first attempt.
func (o *Outer) SetOwners(owners []int) { o.owners = slices.Clone(owners) }

// Segment is values [lo, hi) of parts (a tensor laid out by l) as OuterLayout{N: hi-lo} lays
// them out: what of a replica's contribution crosses to the owner of that segment
// (OuterSegment). lo must start a chunk, and hi end one or the tensor.
func (l OuterLayout) Segment(parts [2][]byte, lo, hi int) [2][]byte {
	var out [2][]byte
	if !l.Int8 {
		out[0] = parts[0][4*lo : 4*hi]
		return out
	}
	s := OuterLayout{N: hi - lo, Int8: true}
	for p := range out {
		if n := s.Bytes(p); n > 0 {
			out[p] = make([]byte, n)
		}
	}
	for c := range s.Chunks() {
		ps, rs := l.chunkRow(lo/OuterChunk + c)
		scale, codes := l.row(ps, parts[ps], rs)
		pd, rd := s.chunkRow(c)
		dscale, dcodes := s.row(pd, out[pd], rd)
		copy(dscale, scale)
		copy(dcodes, codes)
	}
	return out
}

// chunkRow is the int8 part and row chunk c crosses in.
func (l OuterLayout) chunkRow(c int) (p, row int) {
	if full := l.N / OuterChunk; c >= full {
		return 1, c - full
	}
	return 0, c
}

// putRow writes chunk c's scale s and codes into int8 parts out.
func (l OuterLayout) putRow(out [2][]byte, c int, s float32, codes []int8) {
	p, row := l.chunkRow(c)
	scale, dst := l.row(p, out[p], row)
	binary.LittleEndian.PutUint32(scale, math.Float32bits(s))
	for i, x := range codes {
		dst[i] = byte(x)
	}
}

// PseudoGradient is what this replica's θ_r sends at an outer step with Int8, over one chunk
// (elements [a, b) of tensor ti): Δ_r = θ − θ_r in float32 plus its error feedback e_r, rounded
// to int8 codes with one scale (Int8EFCodes) — e_r updated, codes filled, the scale returned, and
// x left holding the dequantised values, exactly what Step's pseudo-gradient would be.
func PseudoGradient(g, r, x, e []float32, codes []int8) float32 {
	for i := range g {
		x[i] = float32(float64(g[i]) - float64(r[i]))
	}
	return Int8EFCodes(x, e, codes)
}

// pseudoGradient returns θ − θ_r over one chunk (g, r: that chunk of tensor ti from element a) in
// float64, and with e (an error-feedback state) what of it crosses as int8.
func (o *Outer) pseudoGradient(g, r []float32, e *Params, ti, a int) []float64 {
	o.d = outerBuf64(o.d, len(g))
	d := o.d
	for i := range g {
		d[i] = float64(g[i]) - float64(r[i])
	}
	if e == nil {
		return d
	}
	ec := e.Tensors[ti].Data[a : a+len(g)]
	o.q = outerBuf32(o.q, len(g))
	for i, v := range d {
		o.q[i] = float32(v)
	}
	Int8EF(o.q, ec)
	for i, v := range o.q {
		d[i] = float64(v)
	}
	return d
}

// Int8EF replaces x, one chunk of a tensor (at most OuterChunk values), by what it is after
// crossing as int8 with error feedback e (len(x)): u = x + e (float32) is quantised with one
// float32 scale, max|u|/127 (kernels.Int8Scale, Int8Quant, Int8Value: the boundary tensors'
// rounding); x becomes round(u) and e the part left behind, float32(u − round(u)), which the next
// round adds back. Over rounds, the sum of what crossed tracks the sum of the true values to
// within the last e.
func Int8EF(x, e []float32) { Int8EFCodes(x, e, nil) }

// Int8EFCodes is Int8EF that also writes the int8 codes to codes (when not nil, len(x)) and
// returns the scale: what crosses the network, from which Int8Decode gives x back exactly. It is
// kernels.Int8ErrorFeedback, whose vector loops keep the scalar functions' bits.
func Int8EFCodes(x, e []float32, codes []int8) float32 { return kernels.Int8ErrorFeedback(x, e, codes) }

// Int8Decode writes the values of codes at scale s to x: what Int8EFCodes left in its x.
func Int8Decode(x []float32, codes []int8, s float32) {
	for i, c := range codes {
		x[i] = kernels.Int8Value(c, s)
	}
}

// OuterPayload is the bytes of one pseudo-gradient laid out like specs on the wire: 4 per value in
// float32, or with int8 1 per value and a float32 scale per chunk (OuterChunk).
func OuterPayload(specs []Spec, int8 bool) int64 {
	var n int64
	for _, s := range specs {
		l := OuterLayout{N: s.Size(), Int8: int8}
		n += int64(l.Bytes(0) + l.Bytes(1))
	}
	return n
}

// AllReduceBytes is what each of r replicas sends — and receives as much — to average a vector of
// size bytes among them with a reduce-scatter then an all-gather (over a ring or directly, the
// same volume): 2·(r−1)/r·size, each replica owning 1/r of the vector. The same accounting serves
// step mode (the gradient, float32, every step) and outer mode (the pseudo-gradient every H steps,
// whose averaged shards travel back in the same format). 0 for one replica.
func AllReduceBytes(size int64, r int) int64 {
	if r < 2 {
		return 0
	}
	return 2 * int64(r-1) * size / int64(r)
}

// sameLayout checks that q has p's tensors with the same sizes, in order.
func sameLayout(p, q *Params) error {
	if len(p.Tensors) != len(q.Tensors) {
		return fmt.Errorf("%d tensors, want %d", len(q.Tensors), len(p.Tensors))
	}
	for i, t := range p.Tensors {
		if q.Tensors[i].Name != t.Name || len(q.Tensors[i].Data) != len(t.Data) {
			return fmt.Errorf("tensor %d is %s of %d values, want %s of %d", i, q.Tensors[i].Name, len(q.Tensors[i].Data), t.Name, len(t.Data))
		}
	}
	return nil
}

func outerBuf64(b []float64, n int) []float64 {
	if cap(b) < n {
		return make([]float64, n)
	}
	return b[:n]
}

func outerBuf32(b []float32, n int) []float32 {
	if cap(b) < n {
		return make([]float32, n)
	}
	return b[:n]
}
