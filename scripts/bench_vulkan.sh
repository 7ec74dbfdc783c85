#!/usr/bin/env bash
# make bench: the Vulkan backend beside the CPU kernels on whatever Vulkan device this machine
# opens (issue 15). A whole-model stage's training step (every micro-batch forward and backward,
# norms, AdamW) on the device and on the host side by side, alternating ROUNDS times, ratio of the
# medians; and the device's matmul GFLOP/s. On a software device (Mesa's lavapipe: a CPU) the
# numbers say how far the GPU kernels are from the CPU's, not what a GPU does: the real-GPU rows
# (matmul at 4096³ as a share of the fp32 peak, a ≥100M-parameter model's step) need a GPU and
# are printed as "no GPU here" (scripts/gpu_check.sh runs them where there is one; PEAK_GFLOPS
# gives the device's fp32 peak for the share). Skips, saying so, without a Vulkan device.
#
#   ROUNDS=3 scripts/bench_vulkan.sh      (VK_MODEL: tiny on a software device, default otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/benchlib.sh
GO=${GO:-go}
ROUNDS=${ROUNDS:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

info=$(vulkaninfo --summary 2>/dev/null | grep -E 'deviceName|deviceType' | head -2 | sed 's/^[[:space:]]*//' | tr '\n' ' ' || true)
if [ -z "$info" ]; then
	echo "vulkan: no Vulkan device on this machine (vulkaninfo --summary found none): skipped"
	exit 0
fi
software=0
case "$info" in *PHYSICAL_DEVICE_TYPE_CPU*) software=1 ;; esac
MODEL=${VK_MODEL:-$([ $software = 1 ] && echo tiny || echo default)}
SIZE=${VK_SIZE:-$([ $software = 1 ] && echo 512 || echo 4096)}
echo "vulkan: $info"
"$GO" test -c -o "$tmp/vulkan.test" ./vulkan/

host=() dev=() mm=()
for r in $(seq 1 "$ROUNDS"); do
	"$tmp/vulkan.test" -test.run XXX -test.bench 'BenchmarkVulkanStageStep' -test.benchtime 3x \
		-vulkan.benchmodel="$MODEL" >"$tmp/step.txt" 2>&1 || { cat "$tmp/step.txt"; exit 1; }
	host+=("$(awk '/StageStep.*\/host/ {for (i=2;i<=NF;i++) if ($(i+1)=="ms/step") print $i}' "$tmp/step.txt")")
	dev+=("$(awk '/StageStep.*\/vulkan/ {for (i=2;i<=NF;i++) if ($(i+1)=="ms/step") print $i}' "$tmp/step.txt")")
	"$tmp/vulkan.test" -test.run XXX -test.bench 'BenchmarkVulkanMatMul' -test.benchtime 3x \
		-vulkan.benchsize="$SIZE" >"$tmp/mm.txt" 2>&1 || { cat "$tmp/mm.txt"; exit 1; }
	mm+=("$(awk '/MatMul/ {for (i=2;i<=NF;i++) if ($(i+1)=="GFLOP/s") print $i}' "$tmp/mm.txt")")
done
h=$(median "${host[@]}") d=$(median "${dev[@]}") g=$(median "${mm[@]}")
printf '\n%-52s %12s\n' "vulkan ($MODEL model, $ROUNDS rounds, medians)" "value"
printf '%-52s %12s\n' "stage step on the CPU kernels, ms" "$h"
printf '%-52s %12s\n' "stage step on Vulkan, ms" "$d"
printf '%-52s %12s\n' "Vulkan step speed ÷ CPU step speed" "$(awk -v h="$h" -v d="$d" 'BEGIN {printf "%.3f", h/d}')"
printf '%-52s %12s\n' "matmul ${SIZE}³ on Vulkan, GFLOP/s" "$g"
if [ $software = 1 ]; then
	printf '%-52s %12s\n' "matmul 4096³ share of fp32 peak" "no GPU here"
	printf '%-52s %12s\n' "≥100M-parameter model: Vulkan vs 2-thread CPU" "no GPU here"
elif [ -n "${PEAK_GFLOPS:-}" ]; then
	printf '%-52s %12s\n' "matmul ${SIZE}³ share of fp32 peak (${PEAK_GFLOPS} GFLOP/s)" "$(awk -v g="$g" -v p="$PEAK_GFLOPS" 'BEGIN {printf "%.1f%%", 100*g/p}')"
fi
