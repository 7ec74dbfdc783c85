package audit

import (
	"crypto/sha256"
	"encoding/binary"
	"math"
	"sort"

	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// stateDomain separates state digests from tensor digests.
const stateDomain = "shoal-state/1\x00"

// StateDigest is the digest of a shard's state: its tensors (model.CheckpointTensors: parameters
// and Adam's moments, under their checkpoint names) in name order, each as its name, shape and
// float32 values. The order of ts does not matter.
func StateDigest(ts []safetensors.Tensor) string {
	idx := make([]int, len(ts))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return ts[idx[a]].Name < ts[idx[b]].Name })
	h := sha256.New()
	h.Write([]byte(stateDomain))
	var buf []byte
	for _, i := range idx {
		t := ts[i]
		buf = binary.LittleEndian.AppendUint32(buf[:0], uint32(len(t.Name)))
		buf = append(buf, t.Name...)
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(t.Shape)))
		for _, d := range t.Shape {
			buf = binary.LittleEndian.AppendUint64(buf, uint64(d))
		}
		h.Write(buf)
		// The values in blocks: a tensor of the default model is megabytes.
		const block = 16 << 10
		for off := 0; off < len(t.Data); off += block {
			end := min(off+block, len(t.Data))
			buf = buf[:0]
			for _, v := range t.Data[off:end] {
				buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
			}
			h.Write(buf)
		}
	}
	return proto.EncodeDigest(h.Sum(nil))
}

// Sent is a tensor a shard sent, and to whom.
type Sent struct {
	To string
	T  proto.Tensor
}

// NewCommit builds a step's commitment from the state digest and the tensors received and sent,
// sorted by key so that two workers that did the same thing commit the same bytes.
func NewCommit(state string, recv []proto.Tensor, sent []Sent) *proto.Commit {
	c := &proto.Commit{State: state, Recv: make([]proto.KeyDigest, 0, len(recv)), Sent: make([]proto.SentDigest, 0, len(sent))}
	for _, t := range recv {
		c.Recv = append(c.Recv, proto.KeyDigest{Key: proto.KeyID(t.Key), Digest: proto.TensorDigest(t)})
	}
	for _, s := range sent {
		c.Sent = append(c.Sent, proto.SentDigest{To: s.To, Key: proto.KeyID(s.T.Key), Digest: proto.TensorDigest(s.T)})
	}
	sort.Slice(c.Recv, func(i, j int) bool { return c.Recv[i].Key < c.Recv[j].Key })
	sort.Slice(c.Sent, func(i, j int) bool { return c.Sent[i].Key < c.Sent[j].Key })
	return c
}
