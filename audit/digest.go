package audit

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/zeebo/blake3"

	b3 "github.com/shoal-ml/shoal/internal/blake3"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// stateDomain separates state digests from tensor digests. Version 3: the values are hashed with
// BLAKE3 (version 2 took their SHA-256).
const stateDomain = "shoal-state/3\x00"

// ValueSize is the length of a tensor's value hash (ValueHash).
const ValueSize = 32

// NewValueHash is the hash of a state tensor's float32 values (little-endian) that StateDigest
// and TensorSums take: BLAKE3 with a 32-byte output. It is the one hash a worker runs over its
// whole state after every update when its job audits — 12 bytes a parameter, the largest part of
// what an audit costs an honest worker (docs/benchmarks.md, "Audits") — and BLAKE3 runs at about
// 3.3 GB/s a core here (zeebo/blake3's AVX2) against SHA-256's 1.7 (with SHA-NI), with the same
// 128-bit collision resistance a commitment needs. A whole tensor's values, in memory, are hashed
// by internal/blake3, the same function with AVX-512's 16 lanes (5.5–6 GB/s). Whoever hashes
// values outside this package (the coordinator streaming a checkpoint's tensors from disk) must
// use this, or its digests would not compose.
func NewValueHash() hash.Hash { return blake3.New() }

// StateDigest is the digest of a shard's state: its tensors (model.CheckpointTensors: parameters
// and Adam's moments, under their checkpoint names) in name order, each as its name, shape and
// the hash of its float32 values (NewValueHash). The order of ts does not matter. The values' hashes are taken
// in parallel (one tensor per goroutine, GOMAXPROCS at once): a worker takes this digest after
// every update, before its next step can start.
func StateDigest(ts []safetensors.Tensor) string {
	return composeState(ts, valueSums(ts))
}

// TensorSums is the value hash (NewValueHash) of each tensor's float32 values, as StateDigest takes them, by name:
// what an outer-mode boundary commits to (proto.OuterBoundary), from which ComposeState gives the
// digest of a state again without its values.
func TensorSums(ts []safetensors.Tensor) []proto.KeyDigest {
	sums := valueSums(ts)
	out := make([]proto.KeyDigest, len(ts))
	for i, t := range ts {
		out[i] = proto.KeyDigest{Key: t.Name, Digest: proto.EncodeDigest(sums[i][:])}
	}
	return out
}

// TensorSumsGroups is TensorSums, and with it the chaining values of the groups of each large
// tensor (more than one ThinGroup), as a thin bundle carries them (ThinKnown): the same walk of
// BLAKE3's tree gives both (internal/blake3.Groups), so a worker that keeps them hashes its
// state once a step, not once more when it is audited.
func TensorSumsGroups(ts []safetensors.Tensor) ([]proto.KeyDigest, map[string][][32]byte) {
	sums := make([][ValueSize]byte, len(ts))
	cvs := make([][][32]byte, len(ts))
	eachParallel(len(ts), func(i int, buf *[]byte) {
		b := proto.Float32Bytes(ts[i].Data, buf)
		if thinGroups(len(ts[i].Data)) > 0 {
			sums[i], cvs[i] = b3.Groups(b, thinGroupChunks)
			return
		}
		sums[i] = b3.Sum256(b)
	})
	out := make([]proto.KeyDigest, len(ts))
	groups := make(map[string][][32]byte)
	for i, t := range ts {
		out[i] = proto.KeyDigest{Key: t.Name, Digest: proto.EncodeDigest(sums[i][:])}
		if cvs[i] != nil {
			groups[t.Name] = cvs[i]
		}
	}
	return out, groups
}

// ComposeState is StateDigest of a state of the tensors named and shaped as ts (their values are
// not read) whose values hash to sums (TensorSums), which must hold every tensor of ts.
func ComposeState(ts []safetensors.Tensor, sums map[string]string) (string, error) {
	out := make([][ValueSize]byte, len(ts))
	for i, t := range ts {
		d, ok := sums[t.Name]
		if !ok {
			return "", fmt.Errorf("no digest of %s", t.Name)
		}
		b, err := base64.RawURLEncoding.DecodeString(d)
		if err != nil || len(b) != ValueSize {
			return "", fmt.Errorf("digest of %s is not a %d-byte value hash", t.Name, ValueSize)
		}
		copy(out[i][:], b)
	}
	return composeState(ts, out), nil
}

// valueSums hashes each tensor's values, in parallel.
func valueSums(ts []safetensors.Tensor) [][ValueSize]byte {
	sums := make([][ValueSize]byte, len(ts))
	eachParallel(len(ts), func(i int, buf *[]byte) { sums[i] = b3.Sum256(proto.Float32Bytes(ts[i].Data, buf)) })
	return sums
}

// eachParallel runs f(i) for every i below n, GOMAXPROCS goroutines at once (one tensor each at a
// time), each with a scratch buffer of its own.
func eachParallel(n int, f func(i int, buf *[]byte)) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), n) {
		wg.Go(func() {
			var buf []byte
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				f(i, &buf)
			}
		})
	}
	wg.Wait()
}

// composeState is the state digest of ts from its values' hashes sums (by index).
func composeState(ts []safetensors.Tensor, sums [][ValueSize]byte) string {
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
		buf = append(buf, sums[i][:]...)
		h.Write(buf)
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
		c.Recv = append(c.Recv, proto.KeyDigest{Key: proto.KeyID(t.Key), Digest: TensorDigest(t)})
	}
	for _, s := range sent {
		c.Sent = append(c.Sent, proto.SentDigest{To: s.To, Key: proto.KeyID(s.T.Key), Digest: TensorDigest(s.T)})
	}
	sort.Slice(c.Recv, func(i, j int) bool { return c.Recv[i].Key < c.Recv[j].Key })
	sort.Slice(c.Sent, func(i, j int) bool { return c.Sent[i].Key < c.Sent[j].Key })
	return c
}

// tensorDomain separates tensor digests from every other use of BLAKE3 in Shoal. Version 2: the
// payload hashed on its own, its digest in the header's place at the end (protocol 15); version 1
// was SHA-256 over the header and payload.
const tensorDomain = "shoal-tensor/2\x00"

// TensorDigest is the digest of a tensor as it travels: its whole key (kind, plan version, step,
// micro-batch, block, expert), dtype, shape and payload. Including the key means a result replayed
// from another step, or moved to another micro-batch, never matches.
//
// It is BLAKE3 of the domain, the key, dtype and shape, and the BLAKE3 of the payload. Hashing the
// payload alone, in one call over its own memory, lets a tensor of 16 KiB or more take
// internal/blake3's widest path (16 chunks at once with AVX-512): every tensor a worker sends or
// receives is hashed once a step when the job audits, on both ends, and SHA-256 over the same
// bytes cost about a percent of an audited worker's CPU (docs/benchmarks.md, "Audits").
func TensorDigest(t proto.Tensor) string {
	var b [96]byte
	n := copy(b[:], tensorDomain)
	b[n] = byte(t.Key.Kind)
	n++
	n += putU32(b[n:], t.Key.PlanVersion)
	binary.LittleEndian.PutUint64(b[n:], t.Key.Step)
	n += 8
	n += putU32(b[n:], t.Key.MicroBatch)
	n += putU32(b[n:], t.Key.Block)
	n += putU32(b[n:], t.Key.Expert)
	b[n] = byte(t.DType)
	n++
	for _, d := range t.Shape {
		n += putU32(b[n:], d)
	}
	payload := b3.Sum256(t.Data)
	n += copy(b[n:], payload[:])
	sum := b3.Sum256(b[:n])
	return proto.EncodeDigest(sum[:])
}

func putU32(b []byte, v uint32) int { binary.LittleEndian.PutUint32(b, v); return 4 }
