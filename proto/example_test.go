package proto_test

import (
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/proto"
)

// A stage sends its activation for micro-batch 0 to the next stage: split into frames of at most
// 64 KiB, sent in any order, joined again on the other side.
func ExampleSplitTensor() {
	const B, T, C = 4, 32, 64
	x := make([]float32, B*T*C)
	shape, _ := proto.ShapeOf(B, T, C)
	t := proto.Tensor{
		Key:   proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 0, MicroBatch: 0, Block: 2, Expert: proto.NoExpert},
		DType: proto.F32,
		Shape: shape,
		Data:  proto.AppendFloat32s(nil, x),
	}
	frames, err := proto.SplitTensor(t, proto.Limits{})
	if err != nil {
		panic(err)
	}
	r := proto.NewReassembler(proto.Limits{})
	for i := len(frames) - 1; i >= 0; i-- { // the order does not matter
		got, done, err := r.Add(frames[i])
		if err != nil {
			panic(err)
		}
		if done {
			fmt.Println(len(frames), "frames;", got.Key, got.Shape, len(got.Data), "bytes")
		}
	}
	// Output: 1 frames; activation plan 1 step 0 mb 0 block 2 [4 32 64 1] 32768 bytes
}

// A worker that is older than its coordinator learns what to do about it.
func ExampleDecodeMessage() {
	b, _ := proto.EncodeMessage(&proto.Heartbeat{Seq: 1})
	m, err := proto.DecodeMessage(b, proto.RoleCoordinator)
	fmt.Printf("%T %v\n", m, err)

	_, err = proto.DecodeMessage([]byte(`{"v":19,"type":"welcome","body":{}}`), proto.RoleWorker)
	fmt.Println(errors.Is(err, proto.ErrProtocolVersion), err)
	// Output:
	// *proto.Heartbeat <nil>
	// true coordinator speaks protocol 19, this worker speaks 18: upgrade the worker (a browser worker: reload the page)
}
