#!/usr/bin/env bash
# make bench: Shoal beside PyTorch on this machine (issues 3 and 16). Three comparisons:
#   1. GEMM GFLOP/s per layout (NN, NT, TN) and shape, Shoal's best ISA vs torch.matmul: the
#      kernel alone on preallocated operands, an idealised bound, not training speed;
#   2. training tokens/s of the default job, BenchmarkTrainStepFresh vs the anchor's `bench`, the
#      same job shape on both sides: B 16, 4 micro-batches, global-norm clipping at 1, one AdamW
#      step, a fresh batch of the job's corpus (the Go standard library) every step; and `shoal
#      train`'s own figure for the job beside them; with LARGE=1 also the large model's (LargeConfig,
#      about 284M parameters) training step, one timed step per side and round;
#   3. the pure-Go GEMM built for wasm under node vs the same kernel native, one thread.
# Sections 1 and 2 run at every thread count in THREADS, both sides at the same count (GOMAXPROCS
# and the kernels' pool for Shoal, OMP_NUM_THREADS and torch.set_num_threads for torch).
# Other work may share the machine, so each comparison alternates its two sides ROUNDS times
# (swapping which goes first every round, so neither always runs in the other's wake) and the
# tables report ratios of medians. The targets in the summary are informative: this script fails
# only when a command does.
#
#   ROUNDS=5 make bench        (ROUNDS default 3; THREADS default "1 2"; SAMPLES=file keeps the raw
#                               numbers; GEMM_SECONDS default 0.5, per GEMM row and side)
#   LARGE=1 make bench         (adds the large model at LARGE_THREADS, default 2: several minutes
#                               a round on two cores, since the anchor always runs 3 warm-up steps)
#   SECTIONS=train scripts/bench.sh   (only some of the sections: any of gemm, train, wasm)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1 2}
LARGE=${LARGE:-0}
LARGE_THREADS=${LARGE_THREADS:-2}
GEMM_SECONDS=${GEMM_SECONDS:-0.5}
GO=${GO:-go}
SECTIONS=${SECTIONS:-gemm train wasm}
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
# OMP_NUM_THREADS. th is the thread count of the comparison running (set by the round loop).
th=1
# OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are unset for the anchor alone: this machine's
# environment pins OpenBLAS to its Haswell (AVX2) kernels, and the anchor runs with the best ones
# the CPU has (the header prints which: openblas_get_corename).
torch_py() {
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp \
		OMP_NUM_THREADS=$th /usr/bin/python3 "$@"
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

echo "make bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, threads $THREADS$([ "$LARGE" = 1 ] && echo ", large model at $LARGE_THREADS")"
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
	echo "torch: $(torch_py -c 'import torch; print(torch.__version__)') (OpenBLAS $(torch_py -c "import sys; sys.path.insert(0, 'model/testdata'); import torch, torch_gpt_moe as a; torch.ones(64, 64) @ torch.ones(64, 64); print(a.blas_core() or 'core unknown')") kernels, OpenMP; threads as each row says)"
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
$GO build -o "$tmp/shoal" ./cmd/shoal
# `shoal train`'s own figure for the same job (issue 34: the benchmark and the command must
# agree): the default job without validation or checkpoints, the median step after the third.
"$tmp/shoal" train --print-job --steps 20 |
	/usr/bin/python3 -c 'import json, sys; s = json.load(sys.stdin); s["val_every"] = 0; s["checkpoint_every"] = 0; json.dump(s, sys.stdout)' >"$tmp/job.json"
goroot_src=$($GO env GOROOT)/src
if [ $have_node = 1 ]; then
	GOOS=js GOARCH=wasm $GO test -c -o "$tmp/kernels.wasm" ./kernels
fi
# The anchor's --config for the large model, from the shoal binary's own job (one source of truth).
large_cfg=""
if [ "$LARGE" = 1 ]; then
	large_cfg=$("$tmp/shoal" train --print-job --model large |
		/usr/bin/python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["model"]))')
fi

# gobench DIR COMMAND... runs a test binary's benchmarks (COMMAND is the binary and its flags, or
# the wasm runner, the binary and its flags) from its package directory, as go test would, with
# no tests.
gobench() {
	local dir=$1
	shift
	(cd "$dir" && "$@" -test.run '^$')
}

# gemm_samples SECTION IMPL ROWSUFFIX reads benchmark output of BenchmarkGEMM or
# BenchmarkGEMMSmall (names <bench>/<layout>/<isa>/<MxKxN>/threads=<n>) and writes one sample per
# line: SECTION, "<layout> <MxKxN>[ ROWSUFFIX]", IMPL (the ISA from the name when IMPL is empty),
# GFLOP/s.
gemm_samples() {
	awk -v sec="$1" -v impl="$2" -v suf="${3:-}" -v OFS='\t' '/^Benchmark.*GFLOP\/s/ {
		split($1, p, "/")
		for (i = 2; i <= NF; i++) if ($i == "GFLOP/s") v = $(i-1)
		print sec, p[2] " " p[4] (suf == "" ? "" : " " suf), (impl == "" ? p[3] : impl), v
	}'
}

# median reads numbers, one a line, and prints their median (nothing when there are none).
median() {
	sort -g | awk '{ a[NR] = $1 } END { if (NR) print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'
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

# Stopwatch for the progress lines: without LARGE=1 the whole run should stay within about ten
# minutes at ROUNDS=3 on two cores.
start=$SECONDS
say() { printf '  [%4ds] %s\n' $((SECONDS - start)) "$*"; }

# 1. GEMM, the kernel alone (idealised: warm caches, preallocated operands, nothing around it).
# One BenchmarkGEMM run per round and thread count covers every row; the torch script times the
# same rows for about as long each.
shapes_re=$(
	IFS='|'
	echo "${GEMM_SHAPES[*]}"
)
shoal_gemm() {
	GOMAXPROCS=$th gobench kernels "$tmp/kernels.test" \
		-test.bench "^BenchmarkGEMM\$/^(NN|NT|TN)\$/^(${gemm_isas//,/|})\$/^($shapes_re)\$/^threads=$th\$" \
		-test.benchtime "${GEMM_SECONDS}s" |
		gemm_samples gemm "" "$th" >>"$samples"
	say "gemm, $th threads: shoal done"
}
torch_gemm() {
	torch_py scripts/bench_matmul.py --threads "$th" --seconds "$GEMM_SECONDS" "${GEMM_SHAPES[@]}" |
		awk -v th="$th" -v OFS='\t' '{ print "gemm", $1 " " $2 " " th, "torch", $3 }' >>"$samples"
	say "gemm, $th threads: torch done"
}

# 2. Training, the same job shape on both sides (B 16, M 4, clip 1, a fresh batch of the Go
# standard library's text each step, one AdamW step), and `shoal train` on the job. Shoal: BenchmarkTrainStepFresh with -test.benchtime 5x -test.count 3 is three
# timed runs of five steps, each after its own untimed warm-up step; its median of the three is
# the sample. The anchor: three timed runs of five steps after three warm-up steps, and their
# median. The large model: one timed step a side (Shoal after one warm-up step, the anchor after
# its three).
# train_sample JOB IMPL VALUE appends one training sample; the row is "<job> <threads>".
train_sample() {
	if [ -z "$3" ]; then
		echo "no tokens/s from $2 ($1, $th threads)" >&2
		return 1
	fi
	printf 'train\t%s %s\t%s\t%s\n' "$1" "$th" "$2" "$3" >>"$samples"
	say "train $1, $th threads: $2 $3 tokens/s"
}
shoal_tokens() {
	awk '/tokens\/s/ { for (i = 2; i <= NF; i++) if ($i == "tokens/s") print $(i-1) }' | median
}
torch_tokens() {
	/usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s_median"])'
}
shoal_train() {
	local out
	out=$(GOMAXPROCS=$th gobench model "$tmp/model.test" -test.bench '^BenchmarkTrainStepFresh$' \
		-test.benchtime 5x -test.count 3 -test.benchmem)
	train_sample default shoal "$(shoal_tokens <<<"$out")"
}
shoal_train_cmd() {
	local out
	if ! out=$(GOMAXPROCS=$th "$tmp/shoal" train --job "$tmp/job.json" --json --threads "$th" 2>"$tmp/train.err"); then
		cat "$tmp/train.err" >&2
		return 1
	fi
	train_sample default shoal-train "$(/usr/bin/python3 -c '
import json, statistics, sys
print(round(statistics.median([json.loads(l)["tokens_per_s"] for l in sys.stdin if l.startswith("{")][3:])))' <<<"$out")"
}
torch_train() {
	local out
	out=$(torch_py $ANCHOR bench --threads "$th" --steps 5 --reps 3 --micro-batches 4 --clip 1 --data "$goroot_src")
	train_sample default torch "$(torch_tokens <<<"$out")"
}
shoal_train_large() {
	local out
	out=$(GOMAXPROCS=$th SHOAL_BENCH_LARGE=1 gobench model "$tmp/model.test" \
		-test.bench '^BenchmarkTrainStepFreshLarge$' -test.benchtime 1x -test.benchmem)
	train_sample large shoal "$(shoal_tokens <<<"$out")"
}
torch_train_large() {
	local out
	out=$(torch_py $ANCHOR bench --threads "$th" --steps 1 --reps 1 --micro-batches 4 --clip 1 --config "$large_cfg" --data "$goroot_src")
	train_sample large torch "$(torch_tokens <<<"$out")"
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
torch_gemm_or_skip=skip torch_train_or_skip=skip torch_train_large_or_skip=skip
if [ $have_torch = 1 ]; then
	torch_gemm_or_skip=torch_gemm torch_train_or_skip=torch_train torch_train_large_or_skip=torch_train_large
fi

for r in $(seq "$ROUNDS"); do
	echo "round $r/$ROUNDS (load $(load1))"
	for th in $THREADS; do
		if [[ " $SECTIONS " == *" gemm "* ]]; then
			pair shoal_gemm $torch_gemm_or_skip "$r"
		fi
		if [[ " $SECTIONS " == *" train "* ]]; then
			# The command beside the benchmark, first on even rounds and last on odd ones.
			if [ $((r % 2)) = 0 ]; then shoal_train_cmd; fi
			pair shoal_train $torch_train_or_skip "$r"
			if [ $((r % 2)) = 1 ]; then shoal_train_cmd; fi
		fi
	done
	if [ "$LARGE" = 1 ]; then
		for th in $LARGE_THREADS; do
			pair shoal_train_large $torch_train_large_or_skip "$r"
		done
	fi
	if [ $have_node = 1 ] && [[ " $SECTIONS " == *" wasm "* ]]; then
		pair native_purego wasm_purego "$r"
	fi
done

$GO run scripts/benchtable.go -isas "$gemm_isas" "$samples"
echo
echo "load after: $(uptime | sed 's/.*load average/load average/'); took $((SECONDS - start))s after the build"
