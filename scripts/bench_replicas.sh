#!/usr/bin/env bash
# Pipeline replicas in step mode (issue 13): tokens/s of 2 replicas x 1 stage (`shoal train
# --workers 2 --threads 1`, a pinned plan of two replicas of the whole model, 2 micro-batches
# each, gradients reduced between them every step) over one worker with --threads 1 (`--workers
# 1`), on the default job, side by side and alternating; ratios of medians at the end. Both sides
# run under `taskset` on the same CORES CPUs. Also: each replica's wait per step (the exchange not
# hidden by compute), the bytes the replicas send each other per step, and what that costs the
# data plane in CPU at the measured cpu-µs per 64 KiB frame (BenchmarkRTCThroughput).
#
#   ROUNDS=3 STEPS=10 CORES=2 scripts/bench_replicas.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
CORES=${CORES:-2}
GO=${GO:-go}
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. scripts/cpus.sh
pin_cpus "$CORES"
echo "replicas bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, $STEPS steps (first 3 not counted), CPUs 0-$((CORES - 1)) of $(nproc)"
echo "load before: $(uptime | sed 's/.*load average/load average/')"

$BIN train --print-job --steps "$STEPS" >"$tmp/base.json"
/usr/bin/env python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
spec["audit_rate"] = 0  # replicated plans are not audited yet: the same work on both sides
json.dump(spec, open(f"{d}/one.json", "w"))
M = spec["micro_batches"]
spec["plan"] = {"replicas": [{"stages": [[0, spec["model"]["n_layer"]]], "micro_batches": M // 2},
                             {"stages": [[0, spec["model"]["n_layer"]]], "micro_batches": M - M // 2}]}
spec["sync"] = {"mode": "step"}
json.dump(spec, open(f"{d}/rep.json", "w"))
PY

run() {
	local out=$1
	shift
	if ! "$@" >"$out" 2>"$out.log"; then
		echo "failed: $*" >&2
		tail -n 20 "$out.log" >&2
		return 1
	fi
}

# median tokens/s, mean per-worker wait (ms) and mean bytes sent of the steps after the first three.
summarise() {
	/usr/bin/env python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][3:]
if not rows:
    sys.exit(f"{sys.argv[1]}: no steps after the first three")
tps = statistics.median(r["tokens_per_s"] for r in rows)
waits = [r.get("wait_ms", []) for r in rows]
w = [round(statistics.mean(x[i] for x in waits), 1) for i in range(len(waits[0]))] if waits and waits[0] else []
b = statistics.mean(r.get("bytes_sent", 0) for r in rows)
print(tps, int(b), ",".join(map(str, w)) or "-")' "$1"
}

ones=() reps=() waits="" sent=0
one_side() {
	run "$tmp/o.jsonl" "${pin[@]}" $BIN train --job "$tmp/one.json" --json --workers 1 --threads 1
	s=$(summarise "$tmp/o.jsonl")
	ones+=("${s%% *}")
}
rep_side() {
	run "$tmp/r.jsonl" "${pin[@]}" $BIN train --job "$tmp/rep.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/r.jsonl")
	read -r t b w <<<"$s"
	reps+=("$t") sent=$b waits=$w
}
for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then
		one_side
		rep_side
	else
		rep_side
		one_side
	fi
	echo "round $r (load $(cut -d' ' -f1 /proc/loadavg)): one worker ${ones[-1]} tokens/s, 2 replicas ${reps[-1]} tokens/s (each replica's wait ms/step: $waits; $sent bytes sent/step)"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
mo=$(median "${ones[@]}") mr=$(median "${reps[@]}")

$GO test -c -o "$tmp/client.test" ./client
cpu=$(cd client && "${pin[@]}" "$tmp/client.test" -test.run '^$' -test.bench 'RTCThroughput$' -test.benchtime 1000x |
	awk '/^BenchmarkRTCThroughput/ {for (i=1;i<=NF;i++) if ($(i+1)=="cpu-µs/frame") print $i}')

echo
echo "replicas summary (medians of $ROUNDS; both sides on CPUs 0-$((CORES - 1)))"
awk -v o="$mo" -v r="$mr" -v w="$waits" -v b="$sent" -v c="${cpu:-0}" 'BEGIN {
	printf "  one worker, --threads 1                        %8.0f tokens/s\n", o
	printf "  2 replicas x 1 stage, --threads 1 each (step)  %8.0f tokens/s\n", r
	if (o > 0) printf "  replicas / one worker                          %8.2f   (target >= 1.4 in step mode)\n", r / o
	printf "  exposed exchange: each replica waits          %s ms/step (last round)\n", w
	frames = b / 65536
	printf "  sent between replicas                        %8.1f MB/step (%.0f frames of 64 KiB)\n", b / 1e6, frames
	if (c > 0) printf "  data plane CPU at %.0f cpu-µs/frame (both ends) %8.2f s/step for all of them\n", c, frames * c / 1e6
}'
