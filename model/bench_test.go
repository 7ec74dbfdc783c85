package model

import (
	"flag"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"

	"github.com/shoal-ml/shoal/data"
)

// BenchmarkTrainStep measures one training step of the default job's model (B 16, M 4) and reports
// tokens/s. It trains on the same batch every step; BenchmarkTrainStepFresh is the job shape
// `make bench` compares with the PyTorch anchor.
func BenchmarkTrainStep(b *testing.B) {
	cfg := DefaultConfig()
	m, err := NewModel(cfg)
	if err != nil {
		b.Fatal(err)
	}
	m.Init(1)
	const B = 16
	T := cfg.BlockSize
	r := rand.New(rand.NewPCG(1, 2))
	x, y := make([]int32, B*T), make([]int32, B*T)
	for i := range x {
		x[i], y[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
	}
	h := Hyper{MicroBatches: 4, LR: 3e-4, WeightDecay: 0.1, Clip: 1}
	if _, err := m.TrainStep(x, y, B, h); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := m.TrainStep(x, y, B, h); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(B*T*b.N)/b.Elapsed().Seconds(), "tokens/s")
}

// BenchmarkTrainStepFresh is the default job's training step as `shoal train` runs it, and as the
// PyTorch anchor's `bench --micro-batches 4 --clip 1 --data` times it: B 16 sequences of T bytes
// drawn from the job's corpus (the Go standard library's *.go files, data.Corpus.Batch at the
// job's seed, a new step's batch each iteration, drawn inside the timed loop as `shoal train`
// draws its own), 4 micro-batches, global-norm clipping at 1, one AdamW step. `make bench`
// compares its tokens/s with the anchor's and with `shoal train`'s.
//
// Real text, not random bytes: the router's choices depend on the data, and text routes
// unevenly (random bytes spread the tokens evenly over the experts). With random bytes this
// benchmark ran about 10% faster at two threads than `shoal train` did on the same job (issue 34).
func BenchmarkTrainStepFresh(b *testing.B) { benchTrainFresh(b, DefaultConfig()) }

// BenchmarkTrainStepFreshLarge is BenchmarkTrainStepFresh on LargeConfig (about 284M parameters,
// 4.5 GB of training state; one step takes tens of seconds on two cores). It runs only with
// SHOAL_BENCH_LARGE=1, so that `go test -bench .` does not spend minutes and gigabytes on it;
// `LARGE=1 make bench` sets it.
func BenchmarkTrainStepFreshLarge(b *testing.B) {
	if os.Getenv("SHOAL_BENCH_LARGE") != "1" {
		b.Skip("set SHOAL_BENCH_LARGE=1 to time the large model's training step")
	}
	benchTrainFresh(b, LargeConfig())
}

// benchCorpus is the default job's corpus, read once: the benchmark function runs several times
// (b.N rising), and reading the standard library each time would also leave the timed loop the
// garbage collector's work on a 100 MB buffer.
var benchCorpus = sync.OnceValues(func() (*data.Corpus, error) { return data.Load(data.GoRootSource, []string{".go"}) })

// TestMain reads the corpus before the tests and benchmarks start when benchmarks are asked for:
// a CPU profile (-test.cpuprofile, scripts/profile_step.sh) starts inside m.Run, so neither the
// reading nor the collection of its garbage is in the step's profile.
func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.bench"); f != nil && f.Value.String() != "" {
		benchCorpus()
		runtime.GC()
	}
	os.Exit(m.Run())
}

// benchTrainFresh times TrainStep on cfg with the default job's hyperparameters (B 16, M 4, clip
// 1), its seed and its corpus's batches, after one untimed warm-up step; it reports tokens/s.
func benchTrainFresh(b *testing.B, cfg Config) {
	corpus, err := benchCorpus()
	if err != nil {
		b.Skipf("the default corpus: %v", err)
	}
	m, err := NewModel(cfg)
	if err != nil {
		b.Fatal(err)
	}
	const B, seed = 16, 0
	m.Init(seed)
	T := cfg.BlockSize
	h := Hyper{MicroBatches: 4, LR: 3e-4, WeightDecay: 0.1, Clip: 1}
	step := func(s int) {
		x, y, err := corpus.Batch(seed, s, B, T)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := m.TrainStep(x, y, B, h); err != nil {
			b.Fatal(err)
		}
	}
	step(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		step(i + 1)
	}
	b.ReportMetric(float64(B*T*b.N)/b.Elapsed().Seconds(), "tokens/s")
}
