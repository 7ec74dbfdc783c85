#!/usr/bin/env bash
# gpu_check.sh: the Vulkan backend on a machine with a real GPU, in one run of under 8 minutes.
# Runs package vulkan's tests with SHOAL_VULKAN_REQUIRED=1 (a missing driver fails instead of
# skipping) — the device validation suite among them, whose worst error per kernel it prints —
# then BenchmarkVulkanMatMul and BenchmarkVulkanStageStep (host vs vulkan), and
# prints a table. It runs as well on lavapipe (a CPU), only slower: set VK_SIZE=256 there.
#
#   scripts/gpu_check.sh                  # device 0, 1024³ matmul, default model
#   VK_MODEL=large VK_ROWS=8 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
SIZE=${VK_SIZE:-1024}    # m = k = n of the matmul benchmark
MODEL=${VK_MODEL:-default} # model config of the stage-step benchmark (tiny, default, large)
ROWS=${VK_ROWS:-4}       # sequences per micro-batch
export SHOAL_VULKAN_REQUIRED=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

command -v vulkaninfo >/dev/null 2>&1 && vulkaninfo --summary 2>/dev/null | grep -E 'deviceName|deviceType|apiVersion' | head -6
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

start=$(date +%s)
# Tests: 4 minutes at most (lavapipe on 2 cores needs about 30 s).
timeout 240 "$GO" test -count=1 -v -run . ./vulkan/ >"$out/test.txt" 2>&1
test_rc=$?
# Training on the GPU against the single process: a CPU stage and a GPU stage, a CPU replica and a
# GPU replica (coordinator), two `shoal worker --device vulkan` processes (cmd/shoal).
timeout 180 "$GO" test -count=1 -v -run 'TestClusterVulkan' ./coordinator/ >>"$out/test.txt" 2>&1 || test_rc=1
timeout 120 "$GO" test -count=1 -v -run 'TestTrainVulkanWorkers' ./cmd/shoal/ >>"$out/test.txt" 2>&1 || test_rc=1
grep -E '^(--- |ok|FAIL|PASS)|device [0-9]+:|stage_test.go|vulkan_test.go|waits' "$out/test.txt" | head -50
# The validation suite (internal/devcheck, the one WebGPU runs too): per kernel, its cases and
# the output that came closest to its tolerance (TestOps).
echo
grep -E '^ +validate_test\.go:[0-9]+: ' "$out/test.txt" | sed -E 's/^ +validate_test\.go:[0-9]+: //'
# Benchmarks: 3 minutes at most.
timeout 180 "$GO" test -count=1 -run XXX -bench 'BenchmarkVulkan' -benchtime 5x ./vulkan/ \
	-args -vulkan.benchsize="$SIZE" -vulkan.benchmodel="$MODEL" -vulkan.benchrows="$ROWS" >"$out/bench.txt" 2>&1
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
echo
echo "tests: $([ $test_rc -eq 0 ] && echo PASS || echo "FAIL (rc $test_rc)")  benchmarks: $([ $bench_rc -eq 0 ] && echo ok || echo "FAIL (rc $bench_rc)")  in $(($(date +%s) - start)) s"
if [ $test_rc -ne 0 ] || [ $bench_rc -ne 0 ]; then
	echo "--- test output (tail)"; tail -40 "$out/test.txt"
	echo "--- benchmark output (tail)"; tail -20 "$out/bench.txt"
	exit 1
fi
