#!/usr/bin/env bash
# The pipeline's benchmarks (the pipeline issue, item 8; issue 16, item 3), side by side and
# alternating so that both sides see the same noise; ratios of medians at the end.
#   1. pipeline efficiency: tokens/s of `shoal train --workers 2` (two stages, each worker at
#      --threads CORES/2 and GOMAXPROCS=CORES/2, the coordinator in the parent process) over
#      tokens/s of one process at --threads CORES and GOMAXPROCS=CORES, beside the 1F1B bound
#      M/(M+S-1), on the default model with M = 8. Both sides run under `taskset` on the same
#      CORES CPUs (0..CORES-1), so neither gets more of the machine than the other: on two cores,
#      2 workers × 1 thread against 1 process × 2 threads;
#   2. how long each stage waits on the network per step;
#   3. the data plane's throughput between two workers (RTCTransport) against a bare pion data
#      channel on loopback.
#
#   ROUNDS=3 STEPS=16 CORES=2 scripts/bench_pipeline.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-16}
CORES=${CORES:-2}
GO=${GO:-go}
M=8
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

. scripts/benchlib.sh
pin_two_workers "$CORES"
echo "pipeline bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, $STEPS steps (first 3 not counted), CPUs 0-$((CORES - 1)) of $(nproc)"
echo "load before: $(uptime | sed 's/.*load average/load average/')"

# The default job with M = 8 and a pinned two-stage plan; validation only at the ends.
$BIN train --print-job --steps "$STEPS" --micro-batches $M >"$tmp/base.json"
/usr/bin/env python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
json.dump(spec, open(f"{d}/local.json", "w"))
spec["plan"] = {"stages": [[0, 2], [2, 4]]}
json.dump(spec, open(f"{d}/pipe.json", "w"))
PY


# median tokens/s and mean per-stage wait of the steps after the first three (warm-up).
summarise() {
	/usr/bin/env python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][3:]
if not rows:
    sys.exit(f"{sys.argv[1]}: no steps after the first three")
tps = statistics.median(r["tokens_per_s"] for r in rows)
waits = [r.get("wait_ms", []) for r in rows]
w = [round(statistics.mean(x[i] for x in waits), 1) for i in range(len(waits[0]))] if waits and waits[0] else []
print(tps, " ".join(map(str, w)) or "-")' "$1"
}

local_side() {
	run "$tmp/l.jsonl" env GOMAXPROCS="$CORES" "${pin[@]}" $BIN train --job "$tmp/local.json" --json --threads "$CORES"
	s=$(summarise "$tmp/l.jsonl")
	locals+=("${s%% *}")
}
pipe_side() {
	run "$tmp/p.jsonl" "${pin[@]}" $BIN train --job "$tmp/pipe.json" --json --workers 2 --threads "$wt"
	s=$(summarise "$tmp/p.jsonl")
	pipes+=("${s%% *}") waits="${s#* }"
}
locals=() pipes=() waits="" s=""
for r in $(seq "$ROUNDS"); do
	# Alternate which side goes first, so that neither always runs in the other's wake.
	if [ $((r % 2)) = 1 ]; then
		local_side
		pipe_side
	else
		pipe_side
		local_side
	fi
	echo "round $r (load $(cut -d' ' -f1 /proc/loadavg)): one process ${locals[-1]} tokens/s, 2-stage pipeline ${pipes[-1]} tokens/s (stage waits ms/step: $waits)"
done
ml=$(median "${locals[@]}") mp=$(median "${pipes[@]}")

echo
echo "data plane, 64 KiB messages one way on loopback (MB/s, $ROUNDS runs each):"
$GO test -c -o "$tmp/client.test" ./client
shoal_mb=() bare_mb=()
for r in $(seq "$ROUNDS"); do
	out=$(cd client && "${pin[@]}" "$tmp/client.test" -test.run '^$' -test.bench 'RTC(Throughput|BareDataChannel)$' -test.benchtime 2000x)
	s=$(awk '/^BenchmarkRTCThroughput/ {for (i=1;i<=NF;i++) if ($(i+1)=="MB/s") print $i}' <<<"$out")
	b=$(awk '/^BenchmarkRTCBareDataChannel/ {for (i=1;i<=NF;i++) if ($(i+1)=="MB/s") print $i}' <<<"$out")
	shoal_mb+=("${s:-0}") bare_mb+=("${b:-0}")
	echo "  round $r: RTCTransport ${s:-n/a}, bare pion ${b:-n/a}"
done
ms=$(median "${shoal_mb[@]}") mb=$(median "${bare_mb[@]}")

echo
echo "pipeline summary (medians of $ROUNDS; both sides on CPUs 0-$((CORES - 1)))"
awk -v l="$ml" -v p="$mp" -v m=$M -v w="$waits" -v s="$ms" -v b="$mb" -v c="$CORES" -v wt="$wt" 'BEGIN {
	bound = m / (m + 2 - 1)
	printf "  one process, %d threads (GOMAXPROCS=%d)        %8.0f tokens/s\n", c, c, l
	printf "  2 stages, 2 workers x %d thread(s) each         %8.0f tokens/s\n", wt, p
	if (l > 0)
		printf "  pipeline / one process                        %8.2f   (target >= 1.0; 1F1B bound M/(M+S-1) = %.3f; ratio to bound %.2f)\n", p / l, bound, p / l / bound
	else
		printf "  pipeline / one process                             n/a\n"
	printf "  network wait per step, per stage (last round)  %s ms\n", w
	if (b > 0)
		printf "  data plane                                    %8.1f MB/s vs bare pion %.1f MB/s: %.2fx (target >= 0.9)\n", s, b, s / b
	else
		printf "  data plane                                    %8.1f MB/s vs bare pion n/a\n", s
}'
