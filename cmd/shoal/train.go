package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

func (m *Main) runTrain(ctx context.Context, args []string) error {
	fs := m.newFlagSet("train", "[--job FILE] [flags]")
	jobFile := fs.String("job", "", "job spec `FILE` (JSON, every field written out); flags below override its fields")
	steps := fs.Int("steps", 0, "number of training steps")
	seed := fs.Uint64("seed", 0, "job seed: initialisation and batches")
	dataPath := fs.String("data", "", "corpus: a text `FILE`, a directory (its *.go files) or a nanoGPT .bin (default: the Go standard library's *.go files)")
	batch := fs.Int("batch-size", 0, "sequences per step (B)")
	micro := fs.Int("micro-batches", 0, "micro-batches per step (M); must divide --batch-size")
	lr := fs.Float64("lr", 0, "peak learning rate")
	modelName := fs.String("model", "", "a named model config: default, tiny, large (about 284M parameters, for pipelines of memory-capped peers) or 1b (about 1B parameters, 16 GB of training state)")
	out := fs.String("out", "", "`DIR` for checkpoints (every checkpoint_every steps and at the end)")
	resume := fs.String("resume", "", "continue from a checkpoint `PATH` (a file, or a directory: its newest)")
	asJSON := fs.Bool("json", false, "print one JSON object per step instead of the progress line")
	threads := fs.Int("threads", 0, "CPU threads for the kernels (default: all)")
	printJob := fs.Bool("print-job", false, "print the job spec that would run, and exit")
	workers := fs.Int("workers", 0, "train on a coordinator and `N` worker processes on loopback instead of in this process")
	dataDir := fs.String("data-dir", "", "with --workers: the coordinator's data `DIR` (default: a temporary directory)")
	relay := fs.Bool("relay", false, "with --workers: move tensors through the coordinator instead of WebRTC")
	replay := fs.String("replay", "", "outer mode in one process: the replicas a `FILE` recorded (plans.json of shoal train --workers --out), from the steps they ran, instead of the pinned ones")
	workerDevice := fs.String("worker-device", "cpu", "with --workers: each worker's --device (cpu keeps the losses bitwise those of one process; vulkan, vulkan:N or auto computes on a GPU, within the cross-backend tolerances)")
	workerMemory := bytesFlag(fs, "worker-memory", 0, "with --workers: the `BYTES` each worker offers, as shoal worker --memory takes them (default its default)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this process to `FILE` (go tool pprof), and with --workers each worker's to FILE.local-N, for developers")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *cpuProfile != "" {
		stop, err := startCPUProfile(*cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	spec, err := jobOrDefault(*jobFile)
	if err != nil {
		return err
	}
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "steps":
			spec.Steps = *steps
		case "seed":
			spec.Seed = *seed
		case "data":
			spec.Data = *dataPath
		case "batch-size":
			spec.BatchSize = *batch
		case "micro-batches":
			spec.MicroBatches = *micro
		case "lr":
			spec.LR = *lr
		case "model":
			if cfg, ok := model.Configs[*modelName]; ok {
				spec.Model = cfg()
			}
		}
	})
	if _, ok := model.Configs[*modelName]; *modelName != "" && !ok {
		return fmt.Errorf("--model %q: want default, tiny, large or 1b", *modelName)
	}
	if err := spec.Validate(); err != nil {
		return err
	}
	if *printJob {
		enc := json.NewEncoder(m.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(spec)
	}
	if err := data.Check(spec.Data, spec.DataExtensions); err != nil {
		return fmt.Errorf("%w (pass --data FILE|DIR)", err)
	}
	if *threads > 0 && *workers == 0 {
		runtime.GOMAXPROCS(*threads)
		kernels.SetThreads(*threads)
	}
	p := &progress{w: m.Stderr, json: *asJSON, enc: json.NewEncoder(m.Stdout), tty: isTerminal(m.Stderr)}
	if *workers > 0 {
		if *resume != "" || *replay != "" {
			return errors.New("--resume and --replay work in one process; a cluster resumes from its --data-dir")
		}
		if *asJSON {
			p.cpu = newWorkerCPU(*workers)
		}
		err := m.runCluster(ctx, spec, clusterOptions{cpu: p.cpu, workers: *workers, dataDir: *dataDir, out: *out, relay: *relay, threads: *threads, memory: int64(*workerMemory), device: *workerDevice, cpuProfile: *cpuProfile, onStep: p.step, beforePrint: p.finish})
		p.finish()
		if errors.Is(err, context.Canceled) {
			fmt.Fprintln(m.Stderr, "interrupted")
			return nil
		}
		if err == nil && *out != "" {
			fmt.Fprintf(m.Stderr, "checkpoints: %s\n", *out)
		}
		return err
	}
	var periods []local.Period
	if *replay != "" {
		b, err := os.ReadFile(*replay)
		if err != nil {
			return err
		}
		if err := json.Unmarshal(b, &periods); err != nil {
			return fmt.Errorf("--replay %s: %w", *replay, err)
		}
	}
	opts := local.Options{Out: *out, Resume: *resume, OnStep: p.step, Replay: periods,
		OnLoad: func(c *data.Corpus, md *model.Model) {
			fmt.Fprintf(m.Stderr, "corpus %s: %d files, %d tokens (%d held out)\n", c.Source, c.Files, c.Len(), c.ValLen())
			fmt.Fprintf(m.Stderr, "model: %d parameters, %d layers (%d MoE × %d experts, top-%d); kernels %s × %d threads\n",
				md.P.NumElements(), md.Cfg.NLayer, md.Cfg.NumMoE(), md.Cfg.NExpert, md.Cfg.TopK, kernels.ISA(), kernels.Threads())
			if md.Step > 0 {
				fmt.Fprintf(m.Stderr, "resuming after step %d of %d\n", md.Step, spec.Steps)
			}
		}}
	res, err := local.Run(ctx, spec, opts)
	p.finish()
	if res != nil && res.Checkpoint != "" {
		fmt.Fprintf(m.Stderr, "checkpoint: %s\n", res.Checkpoint)
	}
	if errors.Is(err, context.Canceled) {
		fmt.Fprintf(m.Stderr, "interrupted after step %d\n", res.Model.Step)
		return nil
	}
	return err
}

// progress prints one updating line on a terminal, a line per validation step otherwise, or JSON.
type progress struct {
	w    io.Writer
	json bool
	enc  *json.Encoder
	tty  bool
	line bool
	cpu  *workerCPU // --workers: each worker's CPU time so far, in every JSON row
}

type stepJSON struct {
	Step       int      `json:"step"`
	Loss       float64  `json:"loss"`
	Aux        float64  `json:"aux"`
	ValLoss    *float64 `json:"val_loss,omitempty"`
	TokensPerS float64  `json:"tokens_per_s"`
	// WaitMS is each pipeline stage's time waiting on the network (--workers only).
	WaitMS []float64 `json:"wait_ms,omitempty"`
	// BytesSent is the tensor payload the workers sent each other (--workers only).
	BytesSent int64 `json:"bytes_sent,omitempty"`
	// WorkersCPUS is each worker process's CPU time so far, in seconds (--workers on Linux): the
	// difference between two rows is what the steps between them cost the workers.
	WorkersCPUS []float64 `json:"workers_cpu_s,omitempty"`
}

func (p *progress) step(r local.Report) {
	if p.json {
		o := stepJSON{Step: r.Step, Loss: r.CE, Aux: r.Aux, TokensPerS: math.Round(r.TokensPerS), BytesSent: r.BytesSent}
		for _, w := range r.StageWait {
			o.WaitMS = append(o.WaitMS, math.Round(float64(w.Microseconds()))/1000)
		}
		if !math.IsNaN(r.ValLoss) {
			v := r.ValLoss
			o.ValLoss = &v
		}
		for _, c := range p.cpu.read() {
			o.WorkersCPUS = append(o.WorkersCPUS, c.Seconds())
		}
		p.enc.Encode(o)
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "step %*d/%d  loss %.4f  aux %.4f", len(fmt.Sprint(r.Steps)), r.Step+1, r.Steps, r.CE, r.Aux)
	if !math.IsNaN(r.ValLoss) {
		fmt.Fprintf(&b, "  val %.4f", r.ValLoss)
	}
	fmt.Fprintf(&b, "  lr %.2e  %5.0f tok/s  ETA %s", r.LR, r.TokensPerS, r.ETA.Round(time.Second))
	switch {
	case p.tty:
		fmt.Fprintf(p.w, "\r\033[K%s", b.String())
		p.line = true
		if !math.IsNaN(r.ValLoss) {
			fmt.Fprintln(p.w)
			p.line = false
		}
	case !math.IsNaN(r.ValLoss) || r.Step == 0 || r.Step+1 == r.Steps || (r.Step+1)%10 == 0:
		fmt.Fprintln(p.w, b.String())
	}
}

func (p *progress) finish() {
	if p.line {
		fmt.Fprintln(p.w)
		p.line = false
	}
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// jobOrDefault is the job spec in path, or the default job when path is "".
func jobOrDefault(path string) (job.Spec, error) {
	if path == "" {
		return job.Default(), nil
	}
	return job.ReadFile(path)
}
