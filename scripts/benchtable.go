//go:build ignore

// Benchtable turns the samples scripts/bench.sh collected into the side-by-side tables of
// `make bench`: medians per row and implementation, ratios of medians, and a summary against the
// targets of issues 3 and 16. It is a script (go run scripts/benchtable.go), not part of any
// package.
//
//	go run scripts/benchtable.go -isas avx512,avx2 SAMPLES
//
// SAMPLES has one sample per line, tab-separated: section, row, implementation, value. Sections:
// gemm (GFLOP/s; rows "<layout> <MxKxN> <threads>"; implementations are the -isas, headline
// first, and torch), train (tokens/s; rows "<job> <threads>", job default or large; shoal (the
// benchmark), shoal-train (the command) and torch) and wasm (GFLOP/s; rows "<layout> <MxKxN>"; native and wasm). A round that did not run
// an implementation (torch not importable, node missing) just leaves no samples, and its columns
// read n/a.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

// Targets: GEMM and wasm from issue 3, "Fast CPU kernels and the training benchmark against
// PyTorch"; training from issue 16, "Twice PyTorch on the same cores".
const (
	targetGEMM  = 0.75 // Shoal's best ISA over torch.matmul on 1024³ and M2048·K256·N1024
	targetTrain = 1.80 // Shoal over the PyTorch anchor, tokens/s of the default job, same job shape
	targetWasm  = 0.50 // wasm pure-Go over native pure-Go, one thread
	// targetShare is issue 34's, "Near the machine's limits": the default job's training step at
	// two threads, as a share of two threads each multiplying at one thread's GEMM rate.
	targetShare = 0.80
)

// headlineShapes are the GEMM shapes the target is set on; the other rows are informative.
var headlineShapes = []string{"1024x1024x1024", "2048x256x1024"}

// limitShape is the GEMM row whose Shoal GFLOP/s (best ISA, same threads) sets a training row's
// GEMM-bound limit: tokens/s if every FLOP of the step ran at that rate.
const limitShape = "NN 1024x1024x1024"

// jobs are the training rows' models, by the job name in the samples.
var jobs = map[string]func() model.Config{"default": model.DefaultConfig, "large": model.LargeConfig}

// samples holds one section's values by row and implementation, rows in first-seen order.
type samples struct {
	rows []string
	vals map[[2]string][]float64
}

func (s *samples) add(row, impl string, v float64) {
	if !slices.Contains(s.rows, row) {
		s.rows = append(s.rows, row)
	}
	k := [2]string{row, impl}
	s.vals[k] = append(s.vals[k], v)
}

// median of row's samples for impl; ok is false when there are none.
func (s *samples) median(row, impl string) (m float64, ok bool) {
	v := slices.Clone(s.vals[[2]string{row, impl}])
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2], true
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2, true
}

// cell prints the median with half the min–max range as a share of it: how far apart the
// rounds were, which says how much to trust the ratio next to it.
func (s *samples) cell(row, impl string) string {
	m, ok := s.median(row, impl)
	if !ok {
		return "n/a"
	}
	v := s.vals[[2]string{row, impl}]
	spread := (slices.Max(v) - slices.Min(v)) / 2 / m * 100
	if m >= 1000 { // tokens/s: a tenth of a token is noise
		return fmt.Sprintf("%.0f ±%.0f%%", m, spread)
	}
	return fmt.Sprintf("%.1f ±%.0f%%", m, spread)
}

// ratio of the medians of impl a over impl b on row.
func (s *samples) ratio(row, a, b string) (float64, bool) {
	x, okx := s.median(row, a)
	y, oky := s.median(row, b)
	if !okx || !oky || y == 0 {
		return math.NaN(), false
	}
	return x / y, true
}

func fmtRatio(r float64, ok bool) string {
	if !ok {
		return "n/a"
	}
	return fmt.Sprintf("%.2f", r)
}

func main() {
	isas := flag.String("isas", "avx512", "Shoal's GEMM instruction sets measured, headline first")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: go run scripts/benchtable.go [-isas a,b] SAMPLES")
		os.Exit(2)
	}
	sections, err := read(flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		os.Exit(1)
	}
	isaList := strings.Split(*isas, ",")
	gemm, train, wasm := sections["gemm"], sections["train"], sections["wasm"]
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)

	fmt.Fprintln(w, "\nGEMM kernel only (idealised: warm operands, no training step around it), GFLOP/s:")
	fmt.Fprintln(w, "median of the rounds ±half their range; ratio = shoal/torch medians")
	fmt.Fprint(w, "layout\tM×K×N\tthreads\t")
	for i, name := range isaList {
		if i > 0 {
			name += " (info)"
		}
		fmt.Fprintf(w, "shoal %s\tratio\t", name)
	}
	fmt.Fprintln(w, "torch.matmul\t")
	for _, row := range gemm.rows {
		f := strings.Fields(row)
		fmt.Fprintf(w, "%s\t", strings.Join(f, "\t"))
		for _, name := range isaList {
			fmt.Fprintf(w, "%s\t%s\t", gemm.cell(row, name), fmtRatio(gemm.ratio(row, name, "torch")))
		}
		fmt.Fprintf(w, "%s\t\n", gemm.cell(row, "torch"))
	}
	w.Flush()

	fmt.Fprintln(w, "\nTraining tokens/s, the same job shape on both sides: B 16 sequences, 4 micro-batches,")
	fmt.Fprintln(w, "clipping at 1, AdamW, a fresh batch of the job's corpus every step; ratio = shoal/torch medians;")
	fmt.Fprintln(w, "shoal train = the command's own figure for the job (median step after the third), ÷ bench its ratio to shoal.")
	fmt.Fprintf(w, "GEMM-bound = tokens/s if the step's FLOPs (sched.NewProfile) all ran at shoal %s %s: at the row's threads\n", isaList[0], limitShape)
	fmt.Fprintln(w, "(one multiply cut across them), and at the row's threads × one thread's rate (what the step's lanes,")
	fmt.Fprintln(w, "each multiplying on one thread, could reach: issue 34's limit)")
	fmt.Fprintln(w, "model\tthreads\tshoal\tshoal train\t÷ bench\ttorch anchor\tratio\tMFLOP/token\tGEMM-bound\tshare\tthreads × 1\tshare\t")
	perCoreShares := map[string]float64{} // by train row: the share of threads × one thread's rate
	for _, row := range train.rows {
		job, th, _ := strings.Cut(row, " ")
		label, flops := job, flopsPerToken(job)
		if job == "large" {
			label = "large (1 timed step a side)"
		}
		bound, share, perCore, perCoreShare := "n/a", "n/a", "n/a", "n/a"
		s, haveS := train.median(row, "shoal")
		if g, ok := gemm.median(limitShape+" "+th, isaList[0]); ok && !math.IsNaN(flops) {
			limit := g * 1e9 / flops
			bound = fmt.Sprintf("%.0f", limit)
			if haveS {
				share = fmt.Sprintf("%.0f%%", s/limit*100)
			}
		}
		if g, ok := gemm.median(limitShape+" 1", isaList[0]); ok && !math.IsNaN(flops) {
			n, _ := strconv.Atoi(th)
			limit := float64(n) * g * 1e9 / flops
			perCore = fmt.Sprintf("%.0f", limit)
			if haveS {
				perCoreShares[row] = s / limit
				perCoreShare = fmt.Sprintf("%.0f%%", s/limit*100)
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.1f\t%s\t%s\t%s\t%s\t\n", label, th, train.cell(row, "shoal"),
			train.cell(row, "shoal-train"), fmtRatio(train.ratio(row, "shoal-train", "shoal")), train.cell(row, "torch"),
			fmtRatio(train.ratio(row, "shoal", "torch")), flops/1e6, bound, share, perCore, perCoreShare)
	}
	w.Flush()

	fmt.Fprintln(w, "\nPure-Go GEMM, GFLOP/s at one thread (GOMAXPROCS=1): wasm under node vs native")
	fmt.Fprintln(w, "layout\tM×K×N\tnative\twasm\tratio\t")
	for _, row := range wasm.rows {
		layout, shape, _ := strings.Cut(row, " ")
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t\n", layout, shape, wasm.cell(row, "native"), wasm.cell(row, "wasm"),
			fmtRatio(wasm.ratio(row, "wasm", "native")))
	}
	w.Flush()

	// The summary takes the worst row under each target: a target met only on the best layout
	// or thread count is not met.
	fmt.Fprintln(w, "\nSummary against the targets (informative: nothing fails on them)")
	fmt.Fprintln(w, "\tratio\ttarget\t\tworst row\t")
	var headline, defaultJob []string
	for _, row := range gemm.rows {
		if f := strings.Fields(row); len(f) > 1 && slices.Contains(headlineShapes, f[1]) {
			headline = append(headline, row)
		}
	}
	for _, row := range train.rows {
		if strings.HasPrefix(row, "default ") {
			defaultJob = append(defaultJob, row)
		}
	}
	summary(w, "GEMM kernel only, "+isaList[0]+" / torch.matmul (issue 3)", gemm, headline, isaList[0], "torch", targetGEMM)
	summary(w, "training, default job, shoal / torch anchor (issue 16)", train, defaultJob, "shoal", "torch", targetTrain)
	summary(w, "pure-Go GEMM wasm / native (issue 3)", wasm, wasm.rows, "wasm", "native", targetWasm)
	// Issue 34: at two threads, the benchmark's share of threads × one thread's GEMM rate.
	const what = "training, default job, 2 threads, share of 2 × one thread's GEMM bound (issue 34)"
	if share, ok := perCoreShares["default 2"]; !ok {
		fmt.Fprintf(w, "%s\tn/a\t≥ %.2f\tSKIPPED\t(not measured)\t\n", what, targetShare)
	} else {
		verdict := "PASS"
		if share < targetShare {
			verdict = "BELOW"
		}
		fmt.Fprintf(w, "%s\t%.2f\t≥ %.2f\t%s\tdefault 2\t\n", what, share, targetShare, verdict)
	}
	w.Flush()
}

// flopsPerToken is a training step's FLOPs per token for job (sched.NewProfile: forward and
// backward of every layer, at M 4), NaN for a job it does not know.
func flopsPerToken(job string) float64 {
	cfg, ok := jobs[job]
	if !ok {
		return math.NaN()
	}
	c := cfg()
	p, err := sched.NewProfile(c, 4)
	if err != nil {
		return math.NaN()
	}
	return p.StageFLOPs(0, c.NLayer) / float64(4*c.BlockSize)
}

// summary prints the lowest ratio a/b over rows against target.
func summary(w *tabwriter.Writer, what string, s samples, rows []string, a, b string, target float64) {
	worst, worstRow := math.Inf(1), ""
	for _, row := range rows {
		if r, ok := s.ratio(row, a, b); ok && r < worst {
			worst, worstRow = r, row
		}
	}
	if worstRow == "" {
		fmt.Fprintf(w, "%s\tn/a\t≥ %.2f\tSKIPPED\t(not measured, see above)\t\n", what, target)
		return
	}
	verdict := "PASS"
	if worst < target {
		verdict = "BELOW"
	}
	fmt.Fprintf(w, "%s\t%.2f\t≥ %.2f\t%s\t%s\t\n", what, worst, target, verdict, worstRow)
}

// read parses SAMPLES into sections; every section the tables use exists, empty or not.
func read(path string) (map[string]samples, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open samples: %w", err)
	}
	defer f.Close()
	sections := map[string]samples{}
	for _, name := range []string{"gemm", "train", "wasm"} {
		sections[name] = samples{vals: map[[2]string][]float64{}}
	}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		fields := strings.Split(sc.Text(), "\t")
		if len(fields) != 4 {
			return nil, fmt.Errorf("%s:%d: want section, row, implementation, value separated by tabs, got %q", path, n, sc.Text())
		}
		v, err := strconv.ParseFloat(fields[3], 64)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: value: %w", path, n, err)
		}
		s, ok := sections[fields[0]]
		if !ok {
			return nil, fmt.Errorf("%s:%d: unknown section %q", path, n, fields[0])
		}
		s.add(fields[1], fields[2], v)
		sections[fields[0]] = s
	}
	return sections, sc.Err()
}
