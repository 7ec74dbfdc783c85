#!/usr/bin/env bash
# Expert parallelism's cost (the experts issue, item 6): the default model trained by a 2-stage
# pipeline with the experts at their stages, against the same 2 stages with each MoE block's
# experts on an expert host of their own; tokens/s (medians, alternating) and the tensor bytes the
# workers send each other per step.
#
# Both sides get the same cores: every process (the coordinator in `shoal train`, its workers)
# runs under `taskset` on CPUs 0..CORES-1, and every worker at --threads 1 (GOMAXPROCS=1). The
# local side is 2 workers × 1 thread; the remote side is 4 workers × 1 thread on the same CORES
# CPUs, so it has more threads than cores when CORES < 4 — its stages and expert hosts mostly wait
# on each other, but where they overlap they share the CPUs, which is the cost being measured.
#
#   ROUNDS=2 STEPS=12 CORES=2 scripts/bench_experts.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-12}
CORES=${CORES:-2}
GO=${GO:-go}
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. scripts/benchlib.sh
pin_cpus "$CORES"
echo "experts bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, $STEPS steps (first 3 not counted), CPUs 0-$((CORES - 1)) of $(nproc)"

$BIN train --print-job --steps "$STEPS" >"$tmp/base.json"
/usr/bin/env python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
spec["plan"] = {"stages": [[0, 2], [2, 4]]}
json.dump(spec, open(f"{d}/local.json", "w"))
spec["plan"]["experts"] = [{"block": 1, "experts": [0, 1, 2, 3], "host": 0},
                           {"block": 3, "experts": [0, 1, 2, 3], "host": 1}]
json.dump(spec, open(f"{d}/remote.json", "w"))
PY

# median tokens/s and bytes sent per step of the steps after the first three (warm-up).
summarise() {
	/usr/bin/env python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][3:]
if not rows:
    sys.exit(f"{sys.argv[1]}: no steps after the first three")
print(statistics.median(r["tokens_per_s"] for r in rows), statistics.median(r.get("bytes_sent", 0) for r in rows))' "$1"
}
local_side() {
	run "$tmp/l.jsonl" "${pin[@]}" $BIN train --job "$tmp/local.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/l.jsonl")
	loc+=("${s%% *}") lb=${s#* }
}
remote_side() {
	run "$tmp/r.jsonl" "${pin[@]}" $BIN train --job "$tmp/remote.json" --json --workers 4 --threads 1
	s=$(summarise "$tmp/r.jsonl")
	rem+=("${s%% *}") rb=${s#* }
}
loc=() rem=() lb=0 rb=0 s=""
for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then
		local_side
		remote_side
	else
		remote_side
		local_side
	fi
	echo "round $r (load $(cut -d' ' -f1 /proc/loadavg)): experts at their stages ${loc[-1]} tokens/s; on expert hosts ${rem[-1]} tokens/s"
done
awk -v l="$(median "${loc[@]}")" -v r="$(median "${rem[@]}")" -v lb="$lb" -v rb="$rb" -v c="$CORES" 'BEGIN {
	printf "\nboth sides on CPUs 0-%d, every worker 1 thread\n", c - 1
	printf "experts local to their stage (2 workers x 1 thread)   %6.0f tokens/s, %6.1f MB sent per step\n", l, lb / 1e6
	printf "experts on 2 expert hosts (4 workers x 1 thread)      %6.0f tokens/s, %6.1f MB sent per step\n", r, rb / 1e6
	if (l > 0)
		printf "remote / local                                         %6.2f\n", r / l
	else
		printf "remote / local                                            n/a\n"
}'
