#!/usr/bin/env bash
# The pipeline's benchmarks (the pipeline issue, item 8), side by side and alternating so that both
# sides see the same noise; ratios of medians at the end.
#   1. pipeline efficiency: tokens/s of `shoal train --workers 2` (two stages, every worker at
#      GOMAXPROCS=1) over tokens/s of one process at GOMAXPROCS=2, beside the 1F1B bound
#      M/(M+S-1), on the default model with M = 8;
#   2. how long each stage waits on the network per step;
#   3. the data plane's throughput between two workers (RTCTransport) against a bare pion data
#      channel on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-16}
M=8
BIN=bin/shoal
go build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

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
tps = statistics.median(r["tokens_per_s"] for r in rows)
waits = [r.get("wait_ms", []) for r in rows]
w = [round(statistics.mean(x[i] for x in waits), 1) for i in range(len(waits[0]))] if waits and waits[0] else []
print(tps, " ".join(map(str, w)))' "$1"
}

locals=() pipes=() waits=""
for r in $(seq "$ROUNDS"); do
	GOMAXPROCS=2 $BIN train --job "$tmp/local.json" --json --threads 2 >"$tmp/l.jsonl" 2>/dev/null
	read -r l _ <<<"$(summarise "$tmp/l.jsonl")"
	$BIN train --job "$tmp/pipe.json" --json --workers 2 --threads 1 >"$tmp/p.jsonl" 2>/dev/null
	read -r p w <<<"$(summarise "$tmp/p.jsonl")"
	locals+=("$l") pipes+=("$p") waits="$w"
	echo "round $r: one process $l tokens/s, 2-stage pipeline $p tokens/s (stage waits ms/step: $w)"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ml=$(median "${locals[@]}") mp=$(median "${pipes[@]}")

echo
echo "data plane, 64 KiB messages one way on loopback (MB/s, $ROUNDS runs each, alternating):"
shoal_mb=() bare_mb=()
for r in $(seq "$ROUNDS"); do
	out=$(go test ./client -run '^$' -bench 'RTC(Throughput|BareDataChannel)$' -benchtime 2000x -count 1)
	s=$(awk '/^BenchmarkRTCThroughput/ {for (i=1;i<=NF;i++) if ($(i+1)=="MB/s") print $i}' <<<"$out")
	b=$(awk '/^BenchmarkRTCBareDataChannel/ {for (i=1;i<=NF;i++) if ($(i+1)=="MB/s") print $i}' <<<"$out")
	shoal_mb+=("$s") bare_mb+=("$b")
	echo "  round $r: RTCTransport $s, bare pion $b"
done
ms=$(median "${shoal_mb[@]}") mb=$(median "${bare_mb[@]}")

echo
echo "pipeline summary (medians of $ROUNDS):"
awk -v l="$ml" -v p="$mp" -v m=$M -v w="$waits" -v s="$ms" -v b="$mb" 'BEGIN {
	bound = m / (m + 2 - 1)
	printf "  one process (GOMAXPROCS=2)           %8.0f tokens/s\n", l
	printf "  2 stages, GOMAXPROCS=1 per worker     %8.0f tokens/s\n", p
	printf "  pipeline efficiency                   %8.2f   (1F1B bound M/(M+S-1) = %.3f; ratio to bound %.2f, target >= 0.8)\n", p / l, bound, p / l / bound
	printf "  network wait per step, per stage      %s ms\n", w
	printf "  data plane                            %8.1f MB/s vs bare pion %.1f MB/s: %.2fx (target >= 0.9)\n", s, b, s / b
}'
