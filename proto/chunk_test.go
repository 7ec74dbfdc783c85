package proto

import (
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
)

// testTensor is an f32 tensor of n elements with deterministic, finite values.
func testTensor(key TensorKey, n int, seed uint64) Tensor {
	r := rand.New(rand.NewPCG(seed, 0))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	s, _ := ShapeOf(n)
	return Tensor{Key: key, DType: F32, Shape: s, Data: AppendFloat32s(nil, x)}
}

func TestSplitReassemble(t *testing.T) {
	perChunk := MaxChunkPayload / 4
	tests := []struct {
		name   string
		n      int // elements
		chunks int
	}{
		{"empty", 0, 1},
		{"one-element", 1, 1},
		{"exactly-one-chunk", perChunk, 1},
		{"one-chunk-and-one-element", perChunk + 1, 2},
		{"exactly-three-chunks", 3 * perChunk, 3},
		{"default-activation", 16 * 128 * 256, 33},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := testTensor(actKey(), tt.n, uint64(tt.n))
			frames, err := SplitTensor(want, Limits{})
			if err != nil {
				t.Fatal(err)
			}
			if len(frames) != tt.chunks || want.NumChunks() != tt.chunks {
				t.Fatalf("%d frames, NumChunks %d; want %d", len(frames), want.NumChunks(), tt.chunks)
			}
			for i, f := range frames {
				if len(f) > MaxFrameSize {
					t.Fatalf("frame %d is %d bytes", i, len(f))
				}
			}
			// Any arrival order must give the same tensor.
			for _, order := range []string{"forward", "reverse", "shuffled"} {
				idx := make([]int, len(frames))
				for i := range idx {
					idx[i] = i
				}
				switch order {
				case "reverse":
					for i, j := 0, len(idx)-1; i < j; i, j = i+1, j-1 {
						idx[i], idx[j] = idx[j], idx[i]
					}
				case "shuffled":
					rand.New(rand.NewPCG(7, 7)).Shuffle(len(idx), func(i, j int) { idx[i], idx[j] = idx[j], idx[i] })
				}
				r := NewReassembler(Limits{})
				for k, i := range idx {
					got, done, err := r.Add(frames[i])
					if err != nil {
						t.Fatalf("%s: Add(chunk %d): %v", order, i, err)
					}
					if done != (k == len(idx)-1) {
						t.Fatalf("%s: chunk %d (%d-th): done = %v", order, i, k, done)
					}
					if done && !reflect.DeepEqual(got, want) && !(len(got.Data) == 0 && len(want.Data) == 0) {
						t.Fatalf("%s: reassembled tensor differs", order)
					}
				}
				if r.InFlight() != 0 || r.Pending() != 0 {
					t.Errorf("%s: %d bytes of %d tensors left in flight", order, r.InFlight(), r.Pending())
				}
			}
		})
	}
}

// TestReassembleInterleaved feeds the chunks of several tensors interleaved, as a stage receives
// activations of one micro-batch while the previous one's expert outputs still arrive.
func TestReassembleInterleaved(t *testing.T) {
	keys := []TensorKey{actKey(), {Kind: KindExpertOut, PlanVersion: 3, Step: 1, MicroBatch: 2, Block: 1, Expert: 0},
		{Kind: KindExpertOut, PlanVersion: 3, Step: 1, MicroBatch: 2, Block: 1, Expert: 1}}
	var all [][]byte
	want := map[TensorKey]Tensor{}
	for i, k := range keys {
		tn := testTensor(k, 40000+i, uint64(i))
		want[k] = tn
		frames, err := SplitTensor(tn, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, frames...)
	}
	rand.New(rand.NewPCG(3, 4)).Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	r := NewReassembler(Limits{})
	got := map[TensorKey]Tensor{}
	for _, f := range all {
		tn, done, err := r.Add(f)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			got[tn.Key] = tn
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %d tensors, want %d, or contents differ", len(got), len(want))
	}
}

func TestReassembleErrors(t *testing.T) {
	three := testTensor(actKey(), 3*MaxChunkPayload/4, 1)
	frames, err := SplitTensor(three, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	// other is a tensor with the same key and a different shape.
	other := testTensor(actKey(), 3*MaxChunkPayload/4-1, 2)
	otherFrames, err := SplitTensor(other, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		lim      Limits
		plan     uint32 // SetPlanVersion before feeding, if not 0
		in       [][]byte
		want     error // from the last Add
		inFlight int   // bytes held afterwards
	}{
		{"duplicate", Limits{}, 0, [][]byte{frames[0], frames[0]}, ErrDuplicateChunk, 0},
		{"duplicate-last", Limits{}, 0, [][]byte{frames[2], frames[0], frames[2]}, ErrDuplicateChunk, 0},
		{"shape-mismatch", Limits{}, 0, [][]byte{frames[0], otherFrames[1]}, ErrChunkMismatch, 0},
		{"over-in-flight", Limits{MaxInFlightBytes: len(three.Data) - 1}, 0, [][]byte{frames[0]}, ErrInFlight, 0},
		{"in-flight-fits", Limits{MaxInFlightBytes: len(three.Data)}, 0, [][]byte{frames[0]}, nil, len(three.Data)},
		{"second-tensor-over-in-flight", Limits{MaxInFlightBytes: 2*len(three.Data) - 1}, 0,
			[][]byte{frames[0], f32FrameOf(t, TensorKey{Kind: KindActivation, Block: 9, Expert: NoExpert}, three)}, ErrInFlight, len(three.Data)},
		{"stale-plan", Limits{}, 4, [][]byte{frames[0]}, ErrStalePlan, 0},
		{"current-plan", Limits{}, 3, [][]byte{frames[0]}, nil, len(three.Data)},
		{"tensor-over-limit", Limits{MaxTensorBytes: len(three.Data) - 1}, 0, [][]byte{frames[0]}, ErrTensorTooLarge, 0},
		{"garbage", Limits{}, 0, [][]byte{[]byte("not a frame at all, but long enough to hold a header, surely, yes...............")}, ErrFrameVersion, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewReassembler(tt.lim)
			if tt.plan != 0 {
				r.SetPlanVersion(tt.plan)
			}
			var err error
			for i, f := range tt.in {
				_, _, err = r.Add(f)
				if i < len(tt.in)-1 && err != nil {
					t.Fatalf("Add(frame %d): %v", i, err)
				}
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("last Add = %v, want %v", err, tt.want)
			}
			if r.InFlight() != tt.inFlight {
				t.Errorf("InFlight = %d, want %d", r.InFlight(), tt.inFlight)
			}
		})
	}
}

// f32FrameOf is the first frame of t under another key.
func f32FrameOf(t *testing.T, key TensorKey, tn Tensor) []byte {
	t.Helper()
	tn.Key = key
	b, err := AppendChunk(nil, tn, 0, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestReassemblerDiscard(t *testing.T) {
	r := NewReassembler(Limits{})
	for step := uint64(0); step < 3; step++ {
		k := actKey()
		k.Step = step
		k.PlanVersion = uint32(step)
		if _, _, err := r.Add(f32FrameOf(t, k, testTensor(k, 2*MaxChunkPayload/4, step))); err != nil {
			t.Fatal(err)
		}
	}
	if r.Pending() != 3 || r.InFlight() != 3*2*MaxChunkPayload {
		t.Fatalf("Pending %d InFlight %d", r.Pending(), r.InFlight())
	}
	if n := r.Discard(func(k TensorKey) bool { return k.Step == 0 }); n != 1 {
		t.Errorf("Discard(step 0) = %d, want 1", n)
	}
	r.SetPlanVersion(2) // drops plan 1's tensor
	r.SetPlanVersion(1) // never goes back
	if r.Pending() != 1 || r.InFlight() != 2*MaxChunkPayload {
		t.Errorf("Pending %d InFlight %d, want 1 tensor", r.Pending(), r.InFlight())
	}
	k := actKey()
	k.PlanVersion = 1
	if _, _, err := r.Add(f32FrameOf(t, k, testTensor(k, 1, 0))); !errors.Is(err, ErrStalePlan) {
		t.Errorf("Add(plan 1) after SetPlanVersion(2) = %v, want ErrStalePlan", err)
	}
}

func TestSplitTensorErrors(t *testing.T) {
	good := testTensor(actKey(), 10, 1)
	tests := []struct {
		name string
		t    Tensor
		lim  Limits
		want error
	}{
		{"short-data", Tensor{Key: good.Key, DType: F32, Shape: good.Shape, Data: good.Data[:36]}, Limits{}, ErrPayloadLength},
		{"wrong-dtype", Tensor{Key: good.Key, DType: I32, Shape: good.Shape, Data: good.Data}, Limits{}, ErrBadHeader},
		{"nan", Tensor{Key: good.Key, DType: F32, Shape: Shape{1, 1, 1, 1}, Data: AppendFloat32s(nil, []float32{float32(math.NaN())})}, Limits{}, ErrNonFinite},
		{"over-limit", good, Limits{MaxTensorBytes: 39}, ErrTensorTooLarge},
		{"bad-key", Tensor{Key: TensorKey{Kind: KindTokens}, DType: I32, Shape: good.Shape, Data: good.Data}, Limits{}, ErrBadHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := SplitTensor(tt.t, tt.lim); !errors.Is(err, tt.want) {
				t.Fatalf("SplitTensor = %v, want %v", err, tt.want)
			}
		})
	}
	if _, err := AppendChunk(nil, good, 1, Limits{}); !errors.Is(err, ErrBadHeader) {
		t.Errorf("AppendChunk(index 1 of 1) = %v, want ErrBadHeader", err)
	}
}

// TestAppendChunkChecksWholeTensorFirst: a NaN in the last chunk is refused at chunk 0.
func TestAppendChunkChecksWholeTensorFirst(t *testing.T) {
	x := make([]float32, 2*MaxChunkPayload/4)
	x[len(x)-1] = float32(math.Inf(-1))
	s, _ := ShapeOf(len(x))
	tn := Tensor{Key: actKey(), DType: F32, Shape: s, Data: AppendFloat32s(nil, x)}
	if _, err := AppendChunk(nil, tn, 0, Limits{}); !errors.Is(err, ErrNonFinite) {
		t.Errorf("AppendChunk(0) = %v, want ErrNonFinite", err)
	}
}

// TestReassemblerSharedBudget: Reassemblers sharing a Budget (one per sender, as a worker has)
// hold at most the budget together, whatever each one's own limit; a tensor that does not fit is
// refused before a buffer is made for it; completing, discarding and contradicting tensors give
// their bytes back.
func TestReassemblerSharedBudget(t *testing.T) {
	const tensorBytes = 2 * MaxChunkPayload // two chunks: the first leaves the tensor pending
	budget := NewBudget(5 * tensorBytes)
	lim := Limits{MaxInFlightBytes: 3 * tensorBytes, Budget: budget}
	senders := make([]*Reassembler, 4)
	for i := range senders {
		senders[i] = NewReassembler(lim)
	}
	firstChunk := func(step uint64) ([]byte, []byte) {
		k := actKey()
		k.Step = step
		fs, err := SplitTensor(testTensor(k, tensorBytes/4, step), Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return fs[0], fs[1]
	}
	// Every sender starts tensors until refused: each alone could hold 3, together they hold 5.
	accepted, refused := 0, 0
	for i, r := range senders {
		for step := uint64(0); step < 3; step++ {
			f, _ := firstChunk(uint64(i)*10 + step)
			_, _, err := r.Add(f)
			switch {
			case err == nil:
				accepted++
			case errors.Is(err, ErrInFlight):
				refused++
			default:
				t.Fatalf("sender %d: %v", i, err)
			}
			if budget.InUse() > budget.Max() {
				t.Fatalf("%d bytes held, over the shared budget of %d", budget.InUse(), budget.Max())
			}
		}
	}
	if accepted != 5 || refused != 7 || budget.InUse() != 5*tensorBytes {
		t.Fatalf("accepted %d, refused %d, %d bytes in use; want 5, 7 and %d", accepted, refused, budget.InUse(), 5*tensorBytes)
	}
	held := 0
	for _, r := range senders {
		held += r.InFlight()
	}
	if held != budget.InUse() {
		t.Errorf("the reassemblers hold %d bytes, the budget counts %d", held, budget.InUse())
	}
	if p := senders[3].Pending(); p != 0 {
		t.Errorf("a refused sender holds %d tensors: refused tensors must get no buffer", p)
	}

	// The last chunk completes sender 0's first tensor: its bytes go back, and sender 3 fits.
	_, second := firstChunk(0)
	if _, whole, err := senders[0].Add(second); err != nil || !whole {
		t.Fatalf("completing a tensor: whole %v, %v", whole, err)
	}
	if budget.InUse() != 4*tensorBytes {
		t.Errorf("after a tensor completed, %d bytes in use, want %d", budget.InUse(), 4*tensorBytes)
	}
	f, _ := firstChunk(30)
	if _, _, err := senders[3].Add(f); err != nil {
		t.Fatalf("sender 3 once there is room: %v", err)
	}
	// A duplicate chunk discards its tensor; Discard drops the rest.
	if _, _, err := senders[3].Add(f); !errors.Is(err, ErrDuplicateChunk) {
		t.Fatalf("duplicate chunk: %v", err)
	}
	for _, r := range senders {
		r.Discard(func(TensorKey) bool { return true })
	}
	if budget.InUse() != 0 {
		t.Errorf("%d bytes still counted after every tensor was dropped", budget.InUse())
	}
}

// TestAddFrameChecksItsOwnLimits: a frame decoded under looser limits is checked again against
// the Reassembler's, before anything is allocated.
func TestAddFrameChecksItsOwnLimits(t *testing.T) {
	tn := testTensor(actKey(), 3*MaxChunkPayload/4, 1)
	b, err := AppendChunk(nil, tn, 0, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	f, err := DecodeFrame(b, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Header.TensorBytes(); got != len(tn.Data) {
		t.Errorf("TensorBytes = %d, want %d", got, len(tn.Data))
	}
	r := NewReassembler(Limits{MaxTensorBytes: len(tn.Data) - 1})
	if _, _, err := r.AddFrame(f); !errors.Is(err, ErrTensorTooLarge) {
		t.Errorf("AddFrame of a tensor over the limit: %v, want ErrTensorTooLarge", err)
	}
	if r.Pending() != 0 || r.InFlight() != 0 {
		t.Errorf("%d tensors, %d bytes held after a refusal", r.Pending(), r.InFlight())
	}
}
