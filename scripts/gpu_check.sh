#!/usr/bin/env bash
# gpu_check.sh: the Vulkan backend on a machine with a real GPU, in one run of under 8 minutes.
# Runs package vulkan's tests with SHOAL_VULKAN_REQUIRED=1 (a missing driver fails instead of
# skipping) — the device validation suite among them, whose worst error per kernel it prints —
# then BenchmarkVulkanMatMul and BenchmarkVulkanStageStep (host vs vulkan), and
# prints a table. It runs as well on lavapipe (a CPU), only slower: set VK_SIZE=256 there.
#
#   scripts/gpu_check.sh                  # device 0, 1024³ matmul, default model
#   VK_MODEL=large VK_ROWS=8 scripts/gpu_check.sh
#
# A GPU machine without Go (the device machines lent to sessions have none): build the test
# binaries here, carry the folder, and run them there. They are stripped and gzipped so that the
# folder (about 26 MB) travels beside the working tree.
#
#   scripts/gpu_check.sh --build .gpu     # here
#   SHOAL_GPU_BIN=.gpu scripts/gpu_check.sh   # there
#
# SHOAL_GPU_TRAIN=1 adds `shoal train` on the default model for 10 steps: one Vulkan worker against
# one CPU worker (all the machine's cores), tokens/s of each.
# VK_TRAIN_DATA=FILE is its corpus where the Go tree it reads by default is missing.
set -uo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
SIZE=${VK_SIZE:-1024}    # m = k = n of the matmul benchmark
MODEL=${VK_MODEL:-default} # model config of the stage-step benchmark (tiny, default, large)
ROWS=${VK_ROWS:-4}       # sequences per micro-batch
export SHOAL_VULKAN_REQUIRED=1
PKGS="vulkan coordinator cmd/shoal"

if [ "${1:-}" = "--build" ]; then
	dir=${2:?usage: scripts/gpu_check.sh --build DIR}
	mkdir -p "$dir" || exit 1
	for p in $PKGS; do
		n=$(basename "$p")
		"$GO" test -c -ldflags='-s -w' -o "$dir/$n.test" "./$p/" && gzip -f -6 "$dir/$n.test" || exit 1
	done
	ls -l "$dir"
	exit 0
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
BIN=${SHOAL_GPU_BIN:-}
if [ -n "$BIN" ]; then
	for p in $PKGS; do
		n=$(basename "$p")
		gunzip -c "$BIN/$n.test.gz" >"$out/$n.test" && chmod +x "$out/$n.test" || { echo "no $BIN/$n.test.gz: run scripts/gpu_check.sh --build $BIN where Go is"; exit 1; }
	done
fi

# gotest PKG SECONDS [test flags] [-- the test binary's own flags]: go test, or the prebuilt
# binary run in the package's folder (as go test runs it). Test flags are written -test.NAME,
# which both accept.
gotest() {
	local pkg=$1 secs=$2 flags=() args=()
	shift 2
	while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
	[ $# -gt 0 ] && shift && args=("$@")
	if [ -n "$BIN" ]; then
		(cd "$pkg" && timeout "$secs" "$out/$(basename "$pkg").test" -test.count=1 "${flags[@]}" "${args[@]}")
	else
		timeout "$secs" "$GO" test -count=1 "${flags[@]}" "./$pkg/" ${args[@]+-args "${args[@]}"}
	fi
}

command -v vulkaninfo >/dev/null 2>&1 && vulkaninfo --summary 2>/dev/null | grep -E 'deviceName|deviceType|apiVersion' | head -6
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

start=$(date +%s)
# Tests: 4 minutes at most (lavapipe on 2 cores needs about 30 s).
gotest vulkan 240 -test.v -test.run . >"$out/test.txt" 2>&1
test_rc=$?
# Training on the GPU against the single process: a CPU stage and a GPU stage, a CPU replica and a
# GPU replica (coordinator), two `shoal worker --device vulkan` processes (cmd/shoal).
gotest coordinator 180 -test.v -test.run 'TestClusterVulkan' >>"$out/test.txt" 2>&1 || test_rc=1
gotest cmd/shoal 120 -test.v -test.run 'TestTrainVulkanWorkers' >>"$out/test.txt" 2>&1 || test_rc=1
grep -E '^(--- |ok|FAIL|PASS)|device [0-9]+:|stage_test.go|vulkan_test.go|waits' "$out/test.txt" | head -50
# The validation suite (internal/devcheck, the one WebGPU runs too): per kernel, its cases and
# the output that came closest to its tolerance (TestOps).
echo
grep -E '^ +validate_test\.go:[0-9]+: ' "$out/test.txt" | sed -E 's/^ +validate_test\.go:[0-9]+: //'
# Benchmarks: 3 minutes at most.
gotest vulkan 180 -test.run XXX -test.bench 'BenchmarkVulkan' -test.benchtime 5x \
	-- -vulkan.benchsize="$SIZE" -vulkan.benchmodel="$MODEL" -vulkan.benchrows="$ROWS" >"$out/bench.txt" 2>&1
bench_rc=$?

echo
printf '%-44s %14s %14s\n' "benchmark" "ms/op" "GFLOP/s"
awk '/^Benchmark/ {
	name=$1; ms=""; gf="";
	for (i = 2; i <= NF; i++) {
		if ($(i+1) == "ns/op") ms = sprintf("%.2f", $i / 1e6);
		if ($(i+1) == "ms/step") ms = $i;
		if ($(i+1) == "GFLOP/s") gf = $i;
	}
	printf "%-44s %14s %14s\n", name, ms, gf
}' "$out/bench.txt"
train_rc=0
if [ "${SHOAL_GPU_TRAIN:-0}" = 1 ]; then
	# The default model, 10 steps, the coordinator and one worker process on loopback: a Vulkan
	# worker, then a CPU worker on all the machine's cores. tokens/s is the mean of steps 3..10
	# (the first steps pay for pipeline creation and the first plan).
	# The test binary doubles as shoal (cmd/shoal's TestMain): the workers it starts are itself.
	if [ -n "$BIN" ]; then shoal=("$out/shoal.test"); export SHOAL_TEST_AS_MAIN=1
	else "$GO" build -o "$out/shoal" ./cmd/shoal || exit 1; shoal=("$out/shoal"); fi
	echo
	printf '%-44s %14s %14s\n' "shoal train, ${VK_TRAIN_MODEL:-default} model, 1 worker" "tokens/s" "final loss"
	for dev in vulkan cpu; do
		XDG_CONFIG_HOME=$out/cfg timeout 240 "${shoal[@]}" train --model "${VK_TRAIN_MODEL:-default}" --steps 10 --json --workers 1 --worker-device "$dev" \
			--data-dir "$out/data-$dev" ${VK_TRAIN_DATA:+--data "$VK_TRAIN_DATA"} >"$out/train-$dev.txt" 2>"$out/train-$dev.err" || { train_rc=1; tail -5 "$out/train-$dev.err"; }
		awk -v dev="$dev" -F'[,:}]' '/"step"/ {
			for (i = 1; i < NF; i++) {
				if ($i ~ /"step"/) st = $(i+1)
				if ($i ~ /"loss"/) l = $(i+1)
				if ($i ~ /"tokens_per_s"/ && st >= 3) { tps += $(i+1); n++ }
			}
		} END { printf "%-44s %14.0f %14s\n", "  --worker-device " dev, (n ? tps / n : 0), l }' "$out/train-$dev.txt"
	done
fi

echo
echo "tests: $([ $test_rc -eq 0 ] && echo PASS || echo "FAIL (rc $test_rc)")  benchmarks: $([ $bench_rc -eq 0 ] && echo ok || echo "FAIL (rc $bench_rc)")  in $(($(date +%s) - start)) s"
[ $train_rc -eq 0 ] || echo "train: FAIL"
if [ $test_rc -ne 0 ] || [ $bench_rc -ne 0 ] || [ $train_rc -ne 0 ]; then
	echo "--- test output (tail)"; tail -40 "$out/test.txt"
	echo "--- benchmark output (tail)"; tail -20 "$out/bench.txt"
	exit 1
fi
