package client

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// Outer mode across pipeline replicas (job.SyncOuter; model/outer.go is the definition, local's
// outer loop the single-process reference). A replica's stages train their replica's
// micro-batches as steps of their own — clipped by the replica's own norm — and at each outer step
// every stage sends the stages of the other participating replicas that hold its tensors what
// crosses: its θ_r as float32, or with int8 compression its pseudo-gradient's codes and scales.
// Every holder then takes the same outer step (model.Outer.StepGiven) and continues from the new
// global θ. Sending everything to every holder, rather than a reduce-scatter, keeps one holder's
// arithmetic the whole tensor's: with two replicas it moves the same bytes.

// outerState is a replica's stage's share of the outer optimizer: the global θ of its tensors at
// the last outer step, their outer momentum (and the average's error feedback), and this
// replica's own error feedback.
type outerState struct {
	outer  *model.Outer
	global *model.Params
	err    *model.Params // int8 only: this replica's error feedback e_r
}

func newOuterState(specs []model.Spec, lr, momentum float64, compressed bool) *outerState {
	o := &outerState{outer: model.NewOuter(specs, lr, momentum, compressed), global: model.NewParams(specs)}
	if compressed {
		o.err = model.NewParams(specs)
	}
	return o
}

// OuterStep takes the outer step m asks for (see the top of this file). The shard's parameters
// end as the new global θ; its AdamW state is its own.
func (r *StageRunner) OuterStep(ctx context.Context, m *proto.OuterSync) error {
	o, rep := r.Outer, r.Replica
	if o == nil || rep == nil {
		return fmt.Errorf("outer step after step %d: this stage is not in a plan of replicas in outer mode", m.Step)
	}
	if !slices.Contains(m.Participants, rep.Index) {
		return fmt.Errorf("outer step after step %d: replica %d is not among the participants %v", m.Step, rep.Index, m.Participants)
	}
	sh := r.Shard
	sh.Pull() // θ_r, from the device
	compressed := o.outer.Int8
	// What this replica gives: θ_r, or its pseudo-gradient through int8 and back, with the codes
	// and scales to send.
	mine := model.OuterGiven{Theta: sh.P}
	payload := make(map[string][2][]byte, len(sh.P.Tensors)) // int8: the tensor's parts
	if compressed {
		mine.Delta = model.NewParams(sh.P.Specs())
		for ti, t := range sh.P.Tensors {
			g, e, x := o.global.Tensors[ti].Data, o.err.Tensors[ti].Data, mine.Delta.Tensors[ti].Data
			payload[t.Name] = int8Parts(g, t.Data, x, e)
		}
	}
	sent := make(chan error, 1)
	go func() {
		for _, l := range r.links {
			if !slices.Contains(m.Participants, l.peer.Replica) {
				continue
			}
			for _, t := range l.tensors {
				for _, pt := range outerTensors(m, t, rep.Index, sh.P.Get(t.name), payload[t.name], compressed) {
					if err := r.Net.Send(ctx, l.peer.Worker, pt); err != nil {
						sent <- fmt.Errorf("outer step: %s to replica %d: %w", t.name, l.peer.Replica, err)
						return
					}
				}
			}
		}
		sent <- nil
	}()
	given := make([]model.OuterGiven, len(m.Participants))
	for k, q := range m.Participants {
		if q == rep.Index {
			given[k] = mine
			continue
		}
		theirs := model.NewParams(sh.P.Specs())
		for _, t := range theirs.Tensors {
			l := r.linkOf(q, t.Name)
			if l == nil {
				<-sent
				return fmt.Errorf("outer step: no stage of replica %d holds %s", q, t.Name)
			}
			rt := l.tensor(t.Name)
			if err := recvOuter(ctx, r.Net, m, rt, q, t.Data, compressed); err != nil {
				<-sent
				return fmt.Errorf("outer step: %s from replica %d: %w", t.Name, q, err)
			}
		}
		if compressed {
			given[k].Delta = theirs
		} else {
			given[k].Theta = theirs
		}
	}
	if err := <-sent; err != nil {
		return err
	}
	if err := o.outer.StepGiven(o.global, given); err != nil {
		return err
	}
	if err := sh.P.CopyFrom(o.global); err != nil {
		return err
	}
	sh.Push()
	return nil
}

// linkOf is the link to replica q's stage holding tensor name, or nil.
func (r *StageRunner) linkOf(q int, name string) *reduceLink {
	for i := range r.links {
		l := &r.links[i]
		if l.peer.Replica == q && l.tensor(name).name == name {
			return l
		}
	}
	return nil
}

// int8Parts computes, chunk by chunk (model.OuterChunk), the pseudo-gradient θ − θ_r through
// int8 with error feedback e (model.PseudoGradient), leaving its values in x and returning what
// crosses: the full chunks as an I8 matrix payload (their scales, then their codes) and the last,
// shorter chunk as a one-row one, either empty when the tensor has none.
func int8Parts(g, r, x, e []float32) [2][]byte {
	n := len(g)
	full := n / model.OuterChunk
	rest := n - full*model.OuterChunk
	var out [2][]byte
	codes := make([]int8, model.OuterChunk)
	part := func(a, b, rows int) []byte {
		buf := make([]byte, 4*rows+(b-a))
		for row := 0; row < rows; row++ {
			lo := a + row*model.OuterChunk
			hi := min(lo+model.OuterChunk, b)
			s := model.PseudoGradient(g[lo:hi], r[lo:hi], x[lo:hi], e[lo:hi], codes[:hi-lo])
			binary.LittleEndian.PutUint32(buf[4*row:], math.Float32bits(s))
			out := buf[4*rows+lo-a : 4*rows+hi-a]
			for i, c := range codes[:hi-lo] {
				out[i] = byte(c)
			}
		}
		return buf
	}
	if full > 0 {
		out[0] = part(0, full*model.OuterChunk, full)
	}
	if rest > 0 {
		out[1] = part(full*model.OuterChunk, n, 1)
	}
	return out
}

// outerTensors are the frames of tensor t at outer step m from replica: θ_r as float32 (part 0),
// or int8's full chunks (part 0) and last chunk (part 1).
func outerTensors(m *proto.OuterSync, t reduceTensor, replica int, theta []float32, parts [2][]byte, compressed bool) []proto.Tensor {
	key := func(part int) proto.TensorKey {
		return proto.OuterDeltaKey(m.Step, m.PlanVersion, t.global, replica, part)
	}
	if !compressed {
		return []proto.Tensor{{Key: key(0), DType: proto.F32, Shape: proto.Shape{uint32(len(theta)), 1, 1, 1}, Data: proto.AppendFloat32s(nil, theta)}}
	}
	var out []proto.Tensor
	full, rest := t.size/model.OuterChunk, t.size%model.OuterChunk
	if full > 0 {
		out = append(out, proto.Tensor{Key: key(0), DType: proto.I8, Shape: proto.Shape{uint32(full), model.OuterChunk, 1, 1}, Data: parts[0]})
	}
	if rest > 0 {
		out = append(out, proto.Tensor{Key: key(1), DType: proto.I8, Shape: proto.Shape{1, uint32(rest), 1, 1}, Data: parts[1]})
	}
	return out
}

// recvOuter receives replica q's part of tensor t at outer step m into dst: θ_q (float32), or its
// pseudo-gradient decoded from int8 codes and scales.
func recvOuter(ctx context.Context, net Transport, m *proto.OuterSync, t reduceTensor, q int, dst []float32, compressed bool) error {
	if !compressed {
		pt, err := net.Recv(ctx, proto.OuterDeltaKey(m.Step, m.PlanVersion, t.global, q, 0))
		if err != nil {
			return err
		}
		if pt.DType != proto.F32 || len(pt.Data) != 4*len(dst) {
			return fmt.Errorf("%v of %d bytes, want float32 of %d", pt.DType, len(pt.Data), 4*len(dst))
		}
		v, err := proto.Float32s(pt.Data)
		if err != nil {
			return err
		}
		copy(dst, v)
		return nil
	}
	full, rest := len(dst)/model.OuterChunk, len(dst)%model.OuterChunk
	for part, rows := range [2]int{full, min(rest, 1)} {
		if rows == 0 {
			continue
		}
		cols := model.OuterChunk
		off := 0
		if part == 1 {
			cols, off = rest, full*model.OuterChunk
		}
		pt, err := net.Recv(ctx, proto.OuterDeltaKey(m.Step, m.PlanVersion, t.global, q, part))
		if err != nil {
			return err
		}
		if pt.DType != proto.I8 || pt.Shape != (proto.Shape{uint32(rows), uint32(cols), 1, 1}) || len(pt.Data) != rows*(4+cols) {
			return fmt.Errorf("part %d: %v %v of %d bytes, want int8 (%d, %d)", part, pt.DType, pt.Shape, len(pt.Data), rows, cols)
		}
		codes := make([]int8, cols)
		for row := 0; row < rows; row++ {
			s := math.Float32frombits(binary.LittleEndian.Uint32(pt.Data[4*row:]))
			for i, b := range pt.Data[4*rows+row*cols : 4*rows+(row+1)*cols] {
				codes[i] = int8(b)
			}
			lo := off + row*cols
			model.Int8Decode(dst[lo:lo+cols], codes, s)
		}
	}
	return nil
}

// outerCheckpoint is what a replica's stage uploads in outer mode: its replica's part (θ_r, AdamW
// moments, error feedback) and, on the first replica, the global part of its tensors.
func (r *StageRunner) outerCheckpoint() []safetensors.Tensor {
	o, sh := r.Outer, r.Shard
	ts := model.OuterCheckpointReplica(r.Replica.Index, sh.P, sh.Opt, o.err)
	if r.Replica.Index == 0 {
		ts = append(model.OuterCheckpointGlobal(o.global, o.outer), ts...)
	}
	return ts
}

// outerRestore loads an outer-mode stage from a checkpoint: the global part, and this replica's
// own when the checkpoint has it — a replica new to the job starts from the global θ with AdamW
// moments and error feedback at zero.
func (r *StageRunner) outerRestore(ck *model.Checkpoint) error {
	o, sh := r.Outer, r.Shard
	if err := ck.IntoOuterGlobal(o.global, o.outer); err != nil {
		return err
	}
	has, err := ck.IntoOuterReplica(r.Replica.Index, sh.P, sh.Opt, o.err)
	if err != nil || has {
		return err
	}
	sh.Opt.M.Zero()
	sh.Opt.V.Zero()
	return sh.P.CopyFrom(o.global)
}
