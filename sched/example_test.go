package sched_test

import (
	"fmt"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

// Each stage of a 3-stage pipeline runs its own list; backwards are in micro-batch order
// everywhere.
func ExampleOneFOneB() {
	for stage := 0; stage < 3; stage++ {
		fmt.Println(stage, sched.OneFOneB(stage, 3, 4))
	}
	// Output:
	// 0 [Forward(0) SendAct(0) Forward(1) SendAct(1) Forward(2) SendAct(2) RecvGrad(0) Backward(0) Forward(3) SendAct(3) RecvGrad(1) Backward(1) RecvGrad(2) Backward(2) RecvGrad(3) Backward(3)]
	// 1 [RecvAct(0) Forward(0) SendAct(0) RecvAct(1) Forward(1) SendAct(1) RecvGrad(0) Backward(0) SendGrad(0) RecvAct(2) Forward(2) SendAct(2) RecvGrad(1) Backward(1) SendGrad(1) RecvAct(3) Forward(3) SendAct(3) RecvGrad(2) Backward(2) SendGrad(2) RecvGrad(3) Backward(3) SendGrad(3)]
	// 2 [RecvAct(0) Forward(0) Backward(0) SendGrad(0) RecvAct(1) Forward(1) Backward(1) SendGrad(1) RecvAct(2) Forward(2) Backward(2) SendGrad(2) RecvAct(3) Forward(3) Backward(3) SendGrad(3)]
}

// The default job's model over two native workers and two browser tabs: the tabs are not worth
// a pipeline stage, and the faster worker takes the second half, which also holds the head.
func ExamplePartition() {
	prof, err := sched.NewProfile(model.DefaultConfig(), 4) // batch 16 in 4 micro-batches
	if err != nil {
		panic(err)
	}
	peers := []sched.Peer{
		{ID: "native-1", GFLOPS: 50, MemoryBytes: 8 << 30, LinkBytesPerS: 1e8},
		{ID: "native-2", GFLOPS: 40, MemoryBytes: 8 << 30, LinkBytesPerS: 1e8},
		{ID: "tab-1", GFLOPS: 1, MemoryBytes: 1 << 30, LinkBytesPerS: 1e6},
		{ID: "tab-2", GFLOPS: 0.5, MemoryBytes: 1 << 30, LinkBytesPerS: 1e6},
	}
	plan, err := sched.Partition(prof, peers, sched.Options{MicroBatches: 4, Version: 1})
	if err != nil {
		panic(err)
	}
	for _, s := range plan.Stages {
		fmt.Printf("blocks [%d, %d) on %s\n", s.Begin, s.End, s.Peer)
	}
	fmt.Println("standby:", plan.Standby)
	fmt.Printf("step ≈ %.2f s\n", plan.StepSeconds)
	// Output:
	// blocks [0, 2) on native-2
	// blocks [2, 4) on native-1
	// standby: [tab-1 tab-2]
	// step ≈ 0.88 s
}
