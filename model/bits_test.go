package model

import (
	"encoding/binary"
	"hash/fnv"
	"math"
	"runtime"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
)

// pinnedBits are the hashes of what stepBits computes, by model and instruction set, recorded on
// amd64 (AVX-512 and FMA) with the kernels as they were before issue 16's speed work: the bits
// are the contract, so whatever makes a step faster must leave these alone. A hash depends on the
// instruction set (the pure-Go kernel rounds each product, the assembly fuses them) and on
// math.Exp's amd64 algorithm, hence amd64 only.
var pinnedBits = map[string]map[string]uint64{
	"tiny": {"purego": 0x5215df7c99e41542, "avx2": 0x4752fc7a45711728, "avx512": 0x4752fc7a45711728},
	"wide": {"purego": 0x6edfc525dca320ec, "avx2": 0x145f6887d0f3c24c, "avx512": 0x145f6887d0f3c24c},
}

// stepBits trains cfg from seed 3 for 3 steps of B 8 in 4 micro-batches, with clipping, on bytes of
// the repository's source, and hashes every step's losses and norm and the final parameters and
// Adam moments.
func stepBits(t *testing.T, cfg Config, serial bool) uint64 {
	t.Helper()
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.Init(3)
	m.Serial = serial
	text := testText(t, 1<<15)
	h := fnv.New64a()
	put := func(u uint64) {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], u)
		h.Write(b[:])
	}
	for s := 0; s < 3; s++ {
		x, y := windows(text[s*1000:], 8, cfg.BlockSize)
		r, err := m.TrainStep(x, y, 8, Hyper{MicroBatches: 4, LR: 3e-3, WeightDecay: 0.1, Clip: 1})
		if err != nil {
			t.Fatal(err)
		}
		put(math.Float64bits(r.CE))
		put(math.Float64bits(r.Aux))
		put(math.Float64bits(r.GradNorm))
	}
	for _, p := range []*Params{m.P, m.Opt.M, m.Opt.V} {
		for _, v := range p.Slab {
			put(uint64(math.Float32bits(v)))
		}
	}
	return h.Sum64()
}

// bitsConfigs are the pinned models: the tiny one, and two blocks of the default's width, whose
// shapes take the multiplies' full 32-column panels and several chunks of the exponentials.
var bitsConfigs = map[string]Config{
	"tiny": TinyConfig(),
	"wide": {VocabSize: 256, BlockSize: 128, NLayer: 2, NHead: 4, NEmbd: 256, MLPRatio: 4,
		MoEEvery: 2, NExpert: 4, TopK: 2, AuxLossCoef: 0.01},
}

// TestStepBitsPinned: a training step's bits are those recorded before the kernels were made
// faster, for every instruction set this CPU has, at one thread and at two (in lanes and not).
func TestStepBitsPinned(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the pinned hashes are amd64's")
	}
	if testing.Short() {
		t.Skip("eighteen short trainings; the race run's lanes are TestLanesEqualSerial's")
	}
	old, oldThreads := kernels.ISA(), kernels.Threads()
	defer func() {
		kernels.SetISA(old)
		kernels.SetThreads(oldThreads)
	}()
	for _, isa := range kernels.ISAs() {
		if err := kernels.SetISA(isa); err != nil {
			t.Fatal(err)
		}
		for name, cfg := range bitsConfigs {
			want, ok := pinnedBits[name][isa]
			for _, run := range []struct {
				threads int
				serial  bool
			}{{1, true}, {2, true}, {2, false}} {
				kernels.SetThreads(run.threads)
				got := stepBits(t, cfg, run.serial)
				switch {
				case !ok:
					t.Logf("%s on %s: %#x (nothing pinned)", name, isa, got)
				case got != want:
					t.Errorf("%s on %s, %d threads (serial %v): the step's bits hash to %#x, pinned %#x", name, isa, run.threads, run.serial, got, want)
				}
			}
		}
	}
}
