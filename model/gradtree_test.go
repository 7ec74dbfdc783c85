package model

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestTreeNodes(t *testing.T) {
	for _, tc := range []struct {
		M, a, b int
		want    [][2]int
	}{
		{1, 0, 1, [][2]int{{0, 1}}},
		{4, 0, 4, [][2]int{{0, 4}}},
		{4, 0, 3, [][2]int{{0, 2}, {2, 3}}},
		{4, 1, 4, [][2]int{{1, 2}, {2, 4}}},
		{4, 1, 3, [][2]int{{1, 2}, {2, 3}}},
		{5, 0, 3, [][2]int{{0, 3}}}, // the left child takes the larger half
		{5, 3, 5, [][2]int{{3, 5}}},
		{5, 2, 4, [][2]int{{2, 3}, {3, 4}}},
		{8, 1, 7, [][2]int{{1, 2}, {2, 4}, {4, 6}, {6, 7}}},
		{4, 2, 2, nil},
	} {
		if got := TreeNodes(tc.M, tc.a, tc.b); !slices.Equal(got, tc.want) {
			t.Errorf("TreeNodes(%d, %d, %d) = %v, want %v", tc.M, tc.a, tc.b, got, tc.want)
		}
	}
	// Every contiguous run's nodes tile it, and there are at most 2·⌈log2 M⌉ of them.
	for M := 1; M <= 33; M++ {
		for a := 0; a < M; a++ {
			for b := a + 1; b <= M; b++ {
				ns := TreeNodes(M, a, b)
				next := a
				for _, n := range ns {
					if n[0] != next || !IsTreeNode(M, n[0], n[1]) {
						t.Fatalf("M %d [%d,%d): nodes %v", M, a, b, ns)
					}
					next = n[1]
				}
				if next != b || len(ns) > 2*int(math.Ceil(math.Log2(float64(M))))+1 {
					t.Fatalf("M %d [%d,%d): nodes %v", M, a, b, ns)
				}
			}
		}
	}
}

// TestSumTreeRefusesBadNodes: what other holders send is checked before it is added.
func TestSumTreeRefusesBadNodes(t *testing.T) {
	dst := make([]float32, 2)
	v := []float32{1, 2}
	for name, ns := range map[string][]GradNode{
		"gap":          {{0, 2, v}, {3, 4, v}},
		"overlap":      {{0, 2, v}, {1, 4, v}},
		"short":        {{0, 2, v}},
		"not a node":   {{0, 1, v}, {1, 3, v}, {3, 4, v}},
		"wrong length": {{0, 2, v}, {2, 4, v[:1]}},
		"empty":        {{0, 0, v}, {0, 4, v}},
	} {
		if err := SumTree(dst, 4, ns); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// refGradients is the single process's gradient of the batch (x, y: B rows) in M micro-batches,
// from the parameters of seed 5.
func refGradients(t *testing.T, cfg Config, x, y []int32, B, M int) *Model {
	t.Helper()
	ref, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(5)
	if _, err := ref.Gradients(x, y, B, M); err != nil {
		t.Fatal(err)
	}
	return ref
}

// trainMicroBatch runs micro-batch j of the batch (x, y: B rows of T tokens in M micro-batches)
// forward and backward through the whole-model stage shard sh and folds its gradient leaf.
func trainMicroBatch(t *testing.T, sh *Shard, x, y []int32, j, B, M, T int) {
	t.Helper()
	n := B / M * T
	in := StageInput{B: B / M, T: T, Micro: M, Tokens: x[j*n : (j+1)*n], Targets: y[j*n : (j+1)*n]}
	if _, err := sh.Stage.Forward(j, in); err != nil {
		t.Fatal(err)
	}
	if _, err := sh.Stage.Backward(j, nil, 1/float32(M)); err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(j); err != nil {
		t.Fatal(err)
	}
}

// TestReplicasEqualWhole: replicas of the whole model, each computing its own contiguous share of
// the micro-batches and exchanging its gradient nodes with the others, end with the single
// process's gradient bit for bit — for every share tried — and a replicated expert's two halves
// too.
func TestReplicasEqualWhole(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	const B = 8
	x, y := windows(text, B, cfg.BlockSize)
	T := cfg.BlockSize
	for _, shares := range [][]int{{4}, {2, 2}, {3, 1}, {1, 3}, {1, 1, 2}, {1, 1, 1, 1}, {8}, {5, 3}, {1, 6, 1}, {2, 2, 2, 1, 1}} {
		M := 0
		for _, n := range shares {
			M += n
		}
		t.Run(fmt.Sprint(shares), func(t *testing.T) {
			ref := refGradients(t, cfg, x, y, B, M)
			var reps []*Shard
			first := 0
			for _, share := range shares {
				sh, err := NewStageShard(cfg, 0, cfg.NLayer, nil)
				if err != nil {
					t.Fatal(err)
				}
				sh.Init(5)
				if err := sh.BeginGradients(M, first, first+share); err != nil {
					t.Fatal(err)
				}
				for j := first; j < first+share; j++ {
					trainMicroBatch(t, sh, x, y, j, B, M, T)
				}
				if complete := sh.GradientsComplete(); complete != (len(shares) == 1) {
					t.Fatalf("complete %v with %d replicas", complete, len(shares))
				}
				reps = append(reps, sh)
				first += share
			}
			if len(reps) > 1 {
				for _, tt := range ref.G.Tensors {
					sent := make([][]GradNode, len(reps))
					for r, sh := range reps {
						ns, err := sh.GradNodes(tt.Name)
						if err != nil {
							t.Fatal(err)
						}
						sent[r] = copyNodes(ns)
					}
					for r, sh := range reps {
						var theirs []GradNode
						for q := range reps {
							if q != r {
								theirs = append(theirs, sent[q]...)
							}
						}
						if err := sh.ReduceGradients(tt.Name, theirs); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			for r, sh := range reps {
				for i, tt := range ref.G.Tensors {
					got := sh.G.Tensors[i].Data
					for k := range got {
						if math.Float32bits(got[k]) != math.Float32bits(tt.Data[k]) && !(got[k] == 0 && tt.Data[k] == 0) {
							t.Fatalf("replica %d: %s[%d] = %v, single process %v", r, tt.Name, k, got[k], tt.Data[k])
						}
					}
				}
			}
		})
	}
}

// TestMicroBatchDoneOutOfOrder: a shard's micro-batches finish in order; anything else is an
// error, not a silently different sum.
func TestMicroBatchDoneOutOfOrder(t *testing.T) {
	sh, err := NewStageShard(TinyConfig(), 0, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(0); err == nil {
		t.Fatal("a micro-batch finished before BeginGradients")
	}
	if err := sh.BeginGradients(4, 0, 4); err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(1); err == nil {
		t.Fatal("micro-batch 1 accepted before 0")
	}
	for _, bad := range [][3]int{{0, 0, 1}, {4, 2, 2}, {4, 3, 5}, {4, -1, 2}} {
		if err := sh.BeginGradients(bad[0], bad[1], bad[2]); err == nil {
			t.Errorf("BeginGradients%v accepted", bad)
		}
	}
}

// TestTreeBuffers: the fold holds what TreeBuffers says, and a run of 1, 2, 4, 8 micro-batches
// from 0 holds 0, 1, 2, 3 node buffers.
func TestTreeBuffers(t *testing.T) {
	for _, tc := range [][4]int{{1, 0, 1, 0}, {2, 0, 2, 1}, {4, 0, 4, 2}, {8, 0, 8, 3}, {3, 0, 3, 1}, {4, 2, 4, 1}, {4, 1, 4, 2}} {
		if got := TreeBuffers(tc[0], tc[1], tc[2]); got != tc[3] {
			t.Errorf("TreeBuffers(%d, %d, %d) = %d, want %d", tc[0], tc[1], tc[2], got, tc[3])
		}
	}
	// The shard's own fold agrees.
	cfg := TinyConfig()
	for _, r := range [][3]int{{4, 0, 4}, {8, 1, 7}, {5, 0, 5}} {
		sh, err := NewStageShard(cfg, 1, 2, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := sh.BeginGradients(r[0], r[1], r[2]); err != nil {
			t.Fatal(err)
		}
		most := 0
		for mb := r[1]; mb < r[2]; mb++ {
			if err := sh.MicroBatchDone(mb); err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, p := range sh.tree.parts {
				for _, nd := range p.stack {
					if nd.buf != nil {
						n++
					}
				}
			}
			most = max(most, n)
		}
		if want := TreeBuffers(r[0], r[1], r[2]); most != want {
			t.Errorf("%v: the fold held %d buffers, TreeBuffers says %d", r, most, want)
		}
	}
}

// TestFoldGroupFinalNodes: folding group by group (as a stage's backward finishes them) gives the
// same tree as folding the whole shard, and a node is reported final as soon as no later
// micro-batch can change it.
func TestFoldGroupFinalNodes(t *testing.T) {
	cfg := TinyConfig()
	sh, err := NewStageShard(cfg, 0, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	const M = 4
	if err := sh.BeginGradients(M, 0, 3); err != nil { // final nodes: [0,2), [2,3)
		t.Fatal(err)
	}
	name := "transformer.h.1.ln_1.weight"
	g := TensorGroup(name, cfg.NLayer)
	if g != 1 || TensorGroup("transformer.wte.weight", cfg.NLayer) != -1 || TensorGroup("lm_head.weight", cfg.NLayer) != cfg.NLayer {
		t.Fatalf("groups %d", g)
	}
	final := func() [][2]int {
		ns, err := sh.FinalGradNodes(name)
		if err != nil {
			t.Fatal(err)
		}
		var out [][2]int
		for _, n := range ns {
			out = append(out, [2]int{n.Lo, n.Hi})
		}
		return out
	}
	for mb, want := range [][][2]int{nil, {{0, 2}}, {{0, 2}, {2, 3}}} {
		for k := range sh.G.Get(name) {
			sh.G.Get(name)[k] = float32(mb + 1)
		}
		if err := sh.FoldGroup(mb, g); err != nil {
			t.Fatal(err)
		}
		if got := final(); !slices.Equal(got, want) {
			t.Fatalf("after micro-batch %d: final nodes %v, want %v", mb, got, want)
		}
		if err := sh.MicroBatchDone(mb); err != nil { // the other groups; block 1 is not folded twice
			t.Fatal(err)
		}
	}
	ns, _ := sh.FinalGradNodes(name)
	if ns[0].Data[0] != 3 || ns[1].Data[0] != 3 {
		t.Fatalf("node values %v, %v: want 1+2 and 3", ns[0].Data[0], ns[1].Data[0])
	}
}

// TestInterleavedRunsEqualWhole: a shard folding several runs of micro-batches whose completions
// interleave — an expert host serving the stages of several pipeline replicas — ends with the
// single process's gradient bit for bit, whatever the interleaving; each run must still finish in
// order, and the runs must tile their range.
func TestInterleavedRunsEqualWhole(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	const B = 8
	x, y := windows(text, B, cfg.BlockSize)
	T := cfg.BlockSize
	rng := rand.New(rand.NewPCG(3, 4))
	for _, shares := range [][]int{{2, 2}, {3, 1}, {1, 3}, {4, 4}, {5, 3}, {1, 6, 1}, {2, 2, 2, 1, 1}} {
		M := 0
		var runs [][2]int
		for _, n := range shares {
			runs = append(runs, [2]int{M, M + n})
			M += n
		}
		ref := refGradients(t, cfg, x, y, B, M)
		for trial := range 3 {
			sh, err := NewStageShard(cfg, 0, cfg.NLayer, nil)
			if err != nil {
				t.Fatal(err)
			}
			sh.Init(5)
			if err := sh.BeginGradientsRuns(M, runs); err != nil {
				t.Fatal(err)
			}
			// A random interleaving that keeps each run's order.
			next := make([]int, len(runs))
			for r := range runs {
				next[r] = runs[r][0]
			}
			var order []int
			for len(order) < M {
				r := rng.IntN(len(runs))
				if next[r] < runs[r][1] {
					order = append(order, next[r])
					next[r]++
				}
			}
			for _, j := range order {
				trainMicroBatch(t, sh, x, y, j, B, M, T)
				held := 0
				for _, nd := range sh.tree.parts[0].stack {
					if nd.buf != nil {
						held++
					}
				}
				bound := 0
				for _, r := range runs {
					bound += TreeBuffers(M, r[0], r[1])
				}
				if held > bound {
					t.Fatalf("%v order %v: %d node buffers held, more than the runs' %d (sched.ExpertShardMemoryRuns)", shares, order, held, bound)
				}
			}
			if !sh.GradientsComplete() {
				t.Fatalf("%v order %v: not complete", shares, order)
			}
			for i, tt := range ref.G.Tensors {
				got := sh.G.Tensors[i].Data
				for k := range got {
					if math.Float32bits(got[k]) != math.Float32bits(tt.Data[k]) && !(got[k] == 0 && tt.Data[k] == 0) {
						t.Fatalf("%v trial %d order %v: %s[%d] = %v, single process %v", shares, trial, order, tt.Name, k, got[k], tt.Data[k])
					}
				}
			}
		}
	}

	sh, err := NewStageShard(cfg, 0, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][][2]int{nil, {{0, 2}, {3, 4}}, {{0, 2}, {1, 4}}, {{2, 4}, {0, 2}}, {{0, 2}, {2, 5}}} {
		if err := sh.BeginGradientsRuns(4, bad); err == nil {
			t.Errorf("BeginGradientsRuns(4, %v) accepted", bad)
		}
	}
	if err := sh.BeginGradientsRuns(4, [][2]int{{0, 2}, {2, 4}}); err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(2); err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(1); err == nil {
		t.Fatal("micro-batch 1 accepted before 0, in one run")
	}
}

// TestChain: a shard summing its micro-batches in one chain (BeginChain, outer mode's inner
// steps) ends with Model.Chain's gradient bit for bit, within rounding of the tree's but not its
// bits (so a reference that kept the tree would be caught by the outer-mode equivalence tests),
// with no node buffer; anything but the micro-batches in order is refused.
func TestChain(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	const B, M = 8, 8
	x, y := windows(text, B, cfg.BlockSize)
	ref, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(5)
	ref.Chain = true
	if _, err := ref.Gradients(x, y, B, M); err != nil {
		t.Fatal(err)
	}
	tree := refGradients(t, cfg, x, y, B, M)

	sh, err := NewStageShard(cfg, 0, cfg.NLayer, nil)
	if err != nil {
		t.Fatal(err)
	}
	sh.Init(5)
	if err := sh.BeginChain(M); err != nil {
		t.Fatal(err)
	}
	for j := range M {
		if sh.GradientsComplete() {
			t.Fatalf("complete before micro-batch %d", j)
		}
		trainMicroBatch(t, sh, x, y, j, B, M, cfg.BlockSize)
	}
	if !sh.GradientsComplete() {
		t.Fatal("incomplete after every micro-batch")
	}
	if n := len(sh.tree.parts); n != 0 {
		t.Errorf("the chain made %d tree parts", n)
	}
	differ := 0
	for i, tt := range ref.G.Tensors {
		got, treeG := sh.G.Tensors[i].Data, tree.G.Tensors[i].Data
		var d2, r2 float64
		for k := range got {
			if math.Float32bits(got[k]) != math.Float32bits(tt.Data[k]) && !(got[k] == 0 && tt.Data[k] == 0) {
				t.Fatalf("%s[%d] = %v, single process %v", tt.Name, k, got[k], tt.Data[k])
			}
			if got[k] != treeG[k] {
				differ++
			}
			d := float64(got[k] - treeG[k])
			d2, r2 = d2+d*d, r2+float64(treeG[k])*float64(treeG[k])
		}
		if r2 > 0 && math.Sqrt(d2/r2) > 1e-5 {
			t.Errorf("%s: ‖chain − tree‖/‖tree‖ = %.2g", tt.Name, math.Sqrt(d2/r2))
		}
	}
	if differ == 0 {
		t.Error("the chain's gradient is the tree's bit for bit: the test cannot tell them apart")
	}

	if err := sh.BeginChain(4); err != nil {
		t.Fatal(err)
	}
	if err := sh.MicroBatchDone(1); err == nil {
		t.Error("micro-batch 1 accepted before 0")
	}
	if err := sh.FoldGroup(0, 0); err == nil {
		t.Error("a group folded in a chain")
	}
	if _, err := sh.GradNodes(ref.G.Tensors[0].Name); err == nil {
		t.Error("a chain gave gradient nodes")
	}
	if err := sh.BeginChain(0); err == nil {
		t.Error("a chain of no micro-batches")
	}
}

// TestExtendedRunsEqualWhole: two replicas whose neighbour between them is lost mid-step each
// take part of its micro-batches (ExtendGradients) after computing their own — the left one a run
// after its own, the right one a run before — and the nodes they end with tile the step and sum to
// the single process's gradient bit for bit, whatever G held when they took them up.
func TestExtendedRunsEqualWhole(t *testing.T) {
	cfg := TinyConfig()
	text := testText(t, 8192)
	const B, M = 8, 8
	x, y := windows(text, B, cfg.BlockSize)
	T := cfg.BlockSize
	ref := refGradients(t, cfg, x, y, B, M)
	// own runs of the left and right survivors, and what each holds after taking up its part.
	for _, tc := range []struct{ left, right, leftTo, rightFrom int }{
		{3, 5, 4, 4}, {2, 6, 6, 6}, {2, 6, 2, 2}, {1, 7, 3, 3}, {4, 4, 4, 4},
	} {
		shards := make([]*Shard, 2)
		for i := range shards {
			sh, err := NewStageShard(cfg, 0, cfg.NLayer, nil)
			if err != nil {
				t.Fatal(err)
			}
			sh.Init(5)
			shards[i] = sh
		}
		a, b := shards[0], shards[1]
		if err := a.BeginGradients(M, 0, tc.left); err != nil {
			t.Fatal(err)
		}
		if err := b.BeginGradients(M, tc.right, M); err != nil {
			t.Fatal(err)
		}
		for j := 0; j < tc.left; j++ {
			trainMicroBatch(t, a, x, y, j, B, M, T)
		}
		for j := tc.right; j < M; j++ {
			trainMicroBatch(t, b, x, y, j, B, M, T)
		}
		// G as a reduction would leave it: anything but zero.
		for _, sh := range shards {
			sh.GradientsComplete()
			for _, tt := range sh.G.Tensors {
				for k := range tt.Data {
					tt.Data[k] = 1
				}
			}
		}
		if err := a.ExtendGradients(0, tc.leftTo); err != nil {
			t.Fatal(err)
		}
		if err := b.ExtendGradients(tc.rightFrom, M); err != nil {
			t.Fatal(err)
		}
		for j := tc.left; j < tc.leftTo; j++ {
			trainMicroBatch(t, a, x, y, j, B, M, T)
		}
		for j := tc.rightFrom; j < tc.right; j++ {
			trainMicroBatch(t, b, x, y, j, B, M, T)
		}
		for i, tt := range ref.G.Tensors {
			var nodes [2][]GradNode
			for s, sh := range shards {
				ns, err := sh.FinalGradNodes(tt.Name)
				if err != nil {
					t.Fatal(err)
				}
				var want [][2]int
				if s == 0 {
					want = TreeNodes(M, 0, tc.leftTo)
				} else {
					want = TreeNodes(M, tc.rightFrom, M)
				}
				var got [][2]int
				for _, n := range ns {
					got = append(got, [2]int{n.Lo, n.Hi})
				}
				if !slices.Equal(got, want) {
					t.Fatalf("%+v: shard %d's final nodes %v, want %v", tc, s, got, want)
				}
				nodes[s] = ns
			}
			for s, sh := range shards {
				if err := sh.ReduceGradients(tt.Name, nodes[1-s]); err != nil {
					t.Fatal(err)
				}
				got := sh.G.Tensors[i].Data
				for k := range got {
					if math.Float32bits(got[k]) != math.Float32bits(tt.Data[k]) && !(got[k] == 0 && tt.Data[k] == 0) {
						t.Fatalf("%+v: shard %d %s[%d] = %v, single process %v", tc, s, tt.Name, k, got[k], tt.Data[k])
					}
				}
			}
		}
	}

	sh, err := NewStageShard(cfg, 0, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.ExtendGradients(0, 4); err == nil {
		t.Error("micro-batches added with no tree")
	}
	if err := sh.BeginGradients(8, 2, 4); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]int{{3, 4}, {2, 3}, {0, 9}, {-1, 4}} {
		if err := sh.ExtendGradients(bad[0], bad[1]); err == nil {
			t.Errorf("ExtendGradients(%d, %d) of [2,4) accepted", bad[0], bad[1])
		}
	}
}
