package client

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestPackRows: in every format, what a receiver unpacks is what the sender's model rounds the
// tensor to (model.Format.Round), bit for bit, through frames and a Reassembler as on a link; a
// compressed tensor travels as a (rows, C) matrix whatever its shape in float32. And a receiver
// refuses a tensor in another format than the job's, of another width, or one that breaks its
// format's rules.
func TestPackRows(t *testing.T) {
	const B, T, C = 2, 5, 70 // rows of three int4 groups, the last short
	r := rand.New(rand.NewPCG(1, 2))
	x := make([]float32, B*T*C)
	for i := range x {
		x[i] = float32(r.NormFloat64() * math.Pow(10, float64(r.IntN(8)-4)))
	}
	clear(x[C : 2*C]) // a zero row
	key := proto.StageKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 2, MicroBatch: 0, Block: 1}.Key()
	for _, f := range []model.Format{model.F32, model.BF16, model.Int8, model.Int4} {
		t.Run(f.String(), func(t *testing.T) {
			tn, err := packRows(key, f, x, C, B, T, C)
			if err != nil {
				t.Fatal(err)
			}
			if len(tn.Data) != f.Bytes(B*T, C) {
				t.Errorf("%d bytes on the wire, Format.Bytes says %d", len(tn.Data), f.Bytes(B*T, C))
			}
			frames, err := proto.SplitTensor(tn, proto.Limits{})
			if err != nil {
				t.Fatal(err)
			}
			ra := proto.NewReassembler(proto.Limits{})
			var got proto.Tensor
			for _, fr := range frames {
				if _, err := proto.DecodeFrame(fr, proto.Limits{}); err != nil {
					t.Fatal(err)
				}
				if g, done, err := ra.Add(fr); err != nil {
					t.Fatal(err)
				} else if done {
					got = g
				}
			}
			y, err := unpackRows(got, f, B*T, C)
			if err != nil {
				t.Fatal(err)
			}
			want := append([]float32(nil), x...)
			f.Round(want, C)
			for i := range want {
				if math.Float32bits(y[i]) != math.Float32bits(want[i]) {
					t.Fatalf("value %d: received %v, the model rounds it to %v", i, y[i], want[i])
				}
			}
			if f == model.F32 {
				return
			}
			for _, other := range []model.Format{model.F32, model.BF16, model.Int8, model.Int4} {
				if other != f {
					if _, err := unpackRows(got, other, B*T, C); err == nil {
						t.Errorf("a %v tensor taken as %v", f, other)
					}
				}
			}
			if _, err := unpackRows(got, f, B*T, C+1); err == nil {
				t.Errorf("rows of %d taken as rows of %d", C, C+1)
			}
			if _, err := unpackRows(got, f, B*T+1, C); err == nil {
				t.Errorf("%d rows taken as %d", B*T, B*T+1)
			}
		})
	}
	// An int4 tensor whose codes break the format (-8 in row 0) is refused, naming its key.
	tn, err := packRows(key, model.Int4, x, C, B, T, C)
	if err != nil {
		t.Fatal(err)
	}
	groups := (C + 31) / 32
	tn.Data[2*B*T*groups] |= 0x8
	tn.Data[2*B*T*groups] &^= 0x7
	if _, err := unpackRows(tn, model.Int4, B*T, C); !errors.Is(err, proto.ErrBadQuantization) {
		t.Errorf("an int4 code of -8: %v", err)
	}
}
