#!/usr/bin/env bash
# make bench: Shoal beside PyTorch on this machine (issue 3, item 4). Three comparisons:
#   1. GEMM GFLOP/s per layout (NN, NT, TN) and shape, Shoal's best ISA vs torch.matmul;
#   2. training tokens/s of the default job, BenchmarkTrainStep vs the anchor's `bench`;
#   3. the pure-Go GEMM built for wasm under node vs the same kernel native, one thread.
# Other work may share the machine, so each comparison alternates its two sides ROUNDS times
# (swapping which goes first every round, so neither always runs in the other's wake) and the
# tables report ratios of medians. The targets in the summary are informative: this script fails
# only when a command does.
#
#   ROUNDS=5 make bench        (ROUNDS default 3, THREADS default 2; SAMPLES=file keeps the raw numbers)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
GO=${GO:-go}
ANCHOR=model/testdata/torch_gpt_moe.py
GEMM_SHAPES=(1024x1024x1024 2048x256x1024 512x256x1024)
# Pure Go runs at ~5 GFLOP/s: shapes where one call takes milliseconds keep part 3 under a minute.
WASM_SHAPES=(256x256x256 512x256x512)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# SAMPLES=file keeps every round's numbers (section, row, implementation, value; tab-separated).
samples=${SAMPLES:-$tmp/samples.tsv}
: >"$samples"

# Debian's python with OpenBLAS's OpenMP build, as the anchor's docstring asks: the python first
# on PATH may be another one without torch, and the default pthreads OpenBLAS ignores
# OMP_NUM_THREADS.
torch_py() {
	LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp OMP_NUM_THREADS=$THREADS /usr/bin/python3 "$@"
}
have_torch=0
if torch_py -c 'import torch' >/dev/null 2>&1; then
	have_torch=1
fi
wasm_exec=$($GO env GOROOT)/lib/wasm/go_js_wasm_exec
have_node=0
if command -v node >/dev/null && [ -x "$wasm_exec" ]; then
	have_node=1
fi

echo "make bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, threads $THREADS"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) CPUs), $($GO version | cut -d' ' -f3)"
# load1 prints the one-minute load average. Each round's header shows it, because a busy
# neighbour slows torch's OpenMP (its threads wait for each other at every barrier) more than
# Shoal's pool (whose workers take row blocks as they come free): under load the ratios lean
# towards Shoal, and the spread columns below grow.
load1() { cut -d' ' -f1 /proc/loadavg; }
echo "load before: $(uptime | sed 's/.*load average/load average/')"
if awk -v l="$(load1)" 'BEGIN { exit !(l >= 1) }'; then
	echo "warning: load average $(load1) before starting: other work is running and the ratios will be noisy"
fi
if [ $have_torch = 1 ]; then
	echo "torch: $(torch_py -c 'import torch; print(torch.__version__)') (OpenBLAS, OpenMP, $THREADS threads)"
else
	echo "torch: not importable by /usr/bin/python3; skipping the torch columns" \
		"(apt-get install -y python3-torch libopenblas0-openmp)"
fi
if [ $have_node = 0 ]; then
	echo "node or $wasm_exec missing: skipping the wasm comparison (apt-get install -y nodejs)"
fi

# Test binaries are built once, so that every round times the same code and no round pays for
# (or is slowed by) a compile.
echo "building test binaries..."
$GO test -c -o "$tmp/kernels.test" ./kernels
$GO test -c -o "$tmp/model.test" ./model
if [ $have_node = 1 ]; then
	GOOS=js GOARCH=wasm $GO test -c -o "$tmp/kernels.wasm" ./kernels
fi

# gobench DIR COMMAND... runs a test binary's benchmarks (COMMAND is the binary and its flags, or
# the wasm runner, the binary and its flags) from its package directory, as go test would, with
# no tests.
gobench() {
	local dir=$1
	shift
	(cd "$dir" && "$@" -test.run '^$')
}

# gemm_samples SECTION IMPL reads benchmark output of BenchmarkGEMM or BenchmarkGEMMSmall
# (names <bench>/<layout>/<isa>/<MxKxN>/threads=<n>) and writes one sample per line:
# SECTION, "<layout> <MxKxN>", IMPL (the ISA from the name when IMPL is empty), GFLOP/s.
gemm_samples() {
	awk -v sec="$1" -v impl="$2" -v OFS='\t' '/^Benchmark.*GFLOP\/s/ {
		split($1, p, "/")
		for (i = 2; i <= NF; i++) if ($i == "GFLOP/s") v = $(i-1)
		print sec, p[2] " " p[4], (impl == "" ? p[3] : impl), v
	}'
}

# Shoal's instruction sets on this CPU, slowest first as kernels.ISAs() lists them: the headline
# is the best; AVX2 is also shown when AVX-512 is the best. Pure Go is measured only when it is
# all there is.
isas=$(gobench kernels "$tmp/kernels.test" -test.bench '^BenchmarkGEMMSmall$/^NN$//^256x256x256$/^threads=1$' \
	-test.benchtime 1x | awk '/^Benchmark/ { split($1, p, "/"); print p[3] }')
best=$(tail -n1 <<<"$isas")
gemm_isas=$best
if [ "$best" = avx512 ] && grep -qx avx2 <<<"$isas"; then
	gemm_isas=avx512,avx2
fi
echo "shoal ISAs: $(echo $isas) (best: $best)"

# Stopwatch for the progress lines: the whole run should stay within about ten minutes.
start=$SECONDS
say() { printf '  [%4ds] %s\n' $((SECONDS - start)) "$*"; }

# 1. GEMM. One BenchmarkGEMM run per round covers every row; the torch script times the same
# rows for about as long each (-test.benchtime's default, 1s).
shapes_re=$(
	IFS='|'
	echo "${GEMM_SHAPES[*]}"
)
shoal_gemm() {
	GOMAXPROCS=$THREADS gobench kernels "$tmp/kernels.test" \
		-test.bench "^BenchmarkGEMM\$/^(NN|NT|TN)\$/^(${gemm_isas//,/|})\$/^($shapes_re)\$/^threads=$THREADS\$" |
		gemm_samples gemm "" >>"$samples"
	say "gemm: shoal done"
}
torch_gemm() {
	torch_py scripts/bench_matmul.py --threads "$THREADS" "${GEMM_SHAPES[@]}" |
		awk -v OFS='\t' '{ print "gemm", $1 " " $2, "torch", $3 }' >>"$samples"
	say "gemm: torch done"
}

# 2. Training. -benchtime 5x times five steps after the benchmark's own warm-up step; the anchor
# takes the median of three timed runs of five steps after three warm-up steps.
train_row="default job"
shoal_train() {
	local v
	v=$(GOMAXPROCS=$THREADS gobench model "$tmp/model.test" -test.bench '^BenchmarkTrainStep$' -test.benchtime 5x |
		awk '/tokens\/s/ { for (i = 2; i <= NF; i++) if ($i == "tokens/s") print $(i-1) }')
	printf 'train\t%s\tshoal\t%s\n' "$train_row" "$v" >>"$samples"
	say "train: shoal $v tokens/s"
}
torch_train() {
	local v
	v=$(torch_py $ANCHOR bench --threads "$THREADS" --steps 5 --reps 3 |
		/usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s_median"])')
	printf 'train\t%s\ttorch\t%s\n' "$train_row" "$v" >>"$samples"
	say "train: torch $v tokens/s"
}

# 3. Pure-Go GEMM, one thread on both sides: wasm has one thread, so the native side runs at
# GOMAXPROCS=1 and the threads=1 benchmarks. Half a second a row keeps the part short.
wasm_re="^BenchmarkGEMMSmall\$/^(NN|NT|TN)\$/^purego\$/^($(
	IFS='|'
	echo "${WASM_SHAPES[*]}"
))\$/^threads=1\$"
native_purego() {
	GOMAXPROCS=1 gobench kernels "$tmp/kernels.test" -test.bench "$wasm_re" -test.benchtime 0.5s |
		gemm_samples wasm native >>"$samples"
	say "wasm: native done"
}
wasm_purego() {
	gobench kernels "$wasm_exec" "$tmp/kernels.wasm" -test.bench "$wasm_re" -test.benchtime 0.5s |
		gemm_samples wasm wasm >>"$samples"
	say "wasm: node done"
}

# pair A B ROUND runs A then B on odd rounds, B then A on even ones; a side whose tool is missing
# is passed as "skip". (Plain statements, not `A && B`: set -e does not apply inside a function
# called on the left of &&, and a failed benchmark must stop the script.)
skip() { :; }
pair() {
	if [ $(($3 % 2)) = 1 ]; then
		"$1"
		"$2"
	else
		"$2"
		"$1"
	fi
}
torch_gemm_or_skip=skip torch_train_or_skip=skip
if [ $have_torch = 1 ]; then torch_gemm_or_skip=torch_gemm torch_train_or_skip=torch_train; fi

for r in $(seq "$ROUNDS"); do
	echo "round $r/$ROUNDS (load $(load1))"
	pair shoal_gemm $torch_gemm_or_skip "$r"
	pair shoal_train $torch_train_or_skip "$r"
	if [ $have_node = 1 ]; then
		pair native_purego wasm_purego "$r"
	fi
done

$GO run scripts/benchtable.go -threads "$THREADS" -isas "$gemm_isas" "$samples"
echo
echo "load after: $(uptime | sed 's/.*load average/load average/'); took $((SECONDS - start))s after the build"
