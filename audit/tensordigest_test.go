package audit

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/zeebo/blake3"

	"github.com/shoal-ml/shoal/proto"
)

// TestTensorDigest: a tensor's digest is BLAKE3 of the domain, its key, dtype and shape, and the
// BLAKE3 of its payload (a reference written here with zeebo/blake3's streaming hasher); it
// changes with every field of the key, the dtype, the shape and any byte of the payload, on
// payloads below and above internal/blake3's wide-path threshold.
func TestTensorDigest(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, n := range []int{0, 1, 1000, 16 << 10, 256<<10 + 3} {
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(r.Uint32())
		}
		base := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 3, Step: 1 << 40, MicroBatch: 5, Block: 2, Expert: proto.NoExpert},
			DType: proto.F32, Shape: proto.Shape{uint32(n / 4), 1, 1, 1}, Data: data}
		ref := func(t proto.Tensor) string {
			payload := blake3.Sum256(t.Data)
			h := blake3.New()
			h.Write([]byte("shoal-tensor/2\x00"))
			var b [42]byte
			b[0] = byte(t.Key.Kind)
			putU32(b[1:], t.Key.PlanVersion)
			for i := range 8 {
				b[5+i] = byte(t.Key.Step >> (8 * i))
			}
			putU32(b[13:], t.Key.MicroBatch)
			putU32(b[17:], t.Key.Block)
			putU32(b[21:], t.Key.Expert)
			b[25] = byte(t.DType)
			for i, d := range t.Shape {
				putU32(b[26+4*i:], d)
			}
			h.Write(b[:])
			h.Write(payload[:])
			return proto.EncodeDigest(h.Sum(nil))
		}
		want := TensorDigest(base)
		if got := ref(base); got != want || len(want) != proto.DigestLen {
			t.Fatalf("%d bytes: digest %s, the reference %s", n, want, got)
		}
		variants := map[string]func(*proto.Tensor){
			"kind":          func(t *proto.Tensor) { t.Key.Kind = proto.KindActivationGrad },
			"plan version":  func(t *proto.Tensor) { t.Key.PlanVersion++ },
			"step":          func(t *proto.Tensor) { t.Key.Step++ },
			"micro-batch":   func(t *proto.Tensor) { t.Key.MicroBatch++ },
			"block":         func(t *proto.Tensor) { t.Key.Block++ },
			"expert":        func(t *proto.Tensor) { t.Key.Expert = 0 },
			"dtype":         func(t *proto.Tensor) { t.DType = proto.BF16 },
			"shape":         func(t *proto.Tensor) { t.Shape[1]++ },
			"payload first": func(t *proto.Tensor) { flip(t, 0) },
			"payload last":  func(t *proto.Tensor) { flip(t, len(t.Data)-1) },
		}
		for name, edit := range variants {
			v := base
			v.Data = append([]byte(nil), base.Data...)
			if len(v.Data) == 0 && (name == "payload first" || name == "payload last") {
				continue
			}
			edit(&v)
			if TensorDigest(v) == want {
				t.Errorf("%d bytes: another %s, the same digest", n, name)
			}
		}
	}
}

func flip(t *proto.Tensor, i int) { t.Data[i] ^= 1 }

// BenchmarkTensorDigest: the digest of the default job's activation of one micro-batch at M 8
// (256 rows of 256 float32s) and at M 4.
func BenchmarkTensorDigest(b *testing.B) {
	for _, n := range []int{256 << 10, 512 << 10} {
		b.Run(fmt.Sprintf("%dKiB", n>>10), func(b *testing.B) {
			t := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 9, Block: 2, Expert: proto.NoExpert},
				DType: proto.F32, Shape: proto.Shape{uint32(n / 4), 1, 1, 1}, Data: make([]byte, n)}
			b.SetBytes(int64(n))
			for b.Loop() {
				TensorDigest(t)
			}
		})
	}
}
