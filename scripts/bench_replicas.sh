#!/usr/bin/env bash
# Pipeline replicas (issue 13): tokens/s of 2 replicas x 1 stage (`shoal train --workers 2
# --threads 1`, a pinned plan of two replicas of the whole model, 2 micro-batches each) in step
# mode (gradients reduced every step) and in outer mode (DiLoCo, H = 20), over one worker with
# --threads 1 (`--workers 1`), on the default job, side by side and alternating; ratios of medians
# at the end. Throughput is the steps' tokens over their summed times, the first three and the
# last left out: a replica takes the outer step before it answers the next step's opening, so the
# exchange after step 19 is charged to step 20 — one outer step in the 20 steps counted with
# STEPS=24, as in a long job with H = 20. Outer mode runs with and without int8 compression, and
# with own batches (int8; each replica trains all M micro-batches of a batch of its own, so a step
# is two batches and tokens/s counts both), and the same with the outer step overlapping the next
# 10 inner steps (sync.delay 10: the exchange after step 19 runs beside steps 20-23). All
# sides run under `taskset` on the same CORES CPUs. Also:
# each replica's wait per step (the exchange not hidden by compute), the bytes the replicas send
# each other per step, and what that costs the data plane in CPU at the measured cpu-µs per
# 64 KiB frame (BenchmarkRTCThroughput).
#
#   ROUNDS=3 STEPS=24 CORES=2 scripts/bench_replicas.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-24}
CORES=${CORES:-2}
GO=${GO:-go}
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. scripts/benchlib.sh
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
spec["sync"] = {"mode": "outer", "every": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none",
                "warmup": 0}  # outer mode's own speed: no step-mode warm-up
json.dump(spec, open(f"{d}/outer.json", "w"))
spec["sync"]["compress"] = "int8"
json.dump(spec, open(f"{d}/outer8.json", "w"))
# Own batches: each replica trains all M micro-batches of a batch of its own (a step is two
# batches), int8 pseudo-gradients.
spec["sync"]["batches"] = "own"
for r in spec["plan"]["replicas"]:
    r["micro_batches"] = M
json.dump(spec, open(f"{d}/outerown.json", "w"))
spec["sync"]["delay"] = 10  # the outer step overlaps the next 10 inner steps
json.dump(spec, open(f"{d}/outerdelay.json", "w"))
PY

# tokens/s (the steps' tokens over their summed times), mean per-worker wait (ms) and mean bytes
# sent of the steps but the first three and the last.
summarise() {
	/usr/bin/env python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][3:-1]
if not rows:
    sys.exit(f"{sys.argv[1]}: no steps but the first three and the last")
tps = len(rows) / sum(1 / r["tokens_per_s"] for r in rows)
waits = [r.get("wait_ms", []) for r in rows]
w = [round(statistics.mean(x[i] for x in waits), 1) for i in range(len(waits[0]))] if waits and waits[0] else []
b = statistics.mean(r.get("bytes_sent", 0) for r in rows)
print(tps, int(b), ",".join(map(str, w)) or "-")' "$1"
}

ones=() reps=() outers=() outers8=() owns=() delays=() waits="" sent=0 osent=0 osent8=0 osentown=0
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
outer_side() {
	run "$tmp/u.jsonl" "${pin[@]}" $BIN train --job "$tmp/outer.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/u.jsonl")
	read -r t b w <<<"$s"
	outers+=("$t") osent=$b
	run "$tmp/u8.jsonl" "${pin[@]}" $BIN train --job "$tmp/outer8.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/u8.jsonl")
	read -r t b w <<<"$s"
	outers8+=("$t") osent8=$b
	run "$tmp/uo.jsonl" "${pin[@]}" $BIN train --job "$tmp/outerown.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/uo.jsonl")
	read -r t b w <<<"$s"
	owns+=("$t") osentown=$b
	run "$tmp/ud.jsonl" "${pin[@]}" $BIN train --job "$tmp/outerdelay.json" --json --workers 2 --threads 1
	s=$(summarise "$tmp/ud.jsonl")
	read -r t b w <<<"$s"
	delays+=("$t")
}
for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then
		one_side
		rep_side
		outer_side
	else
		outer_side
		rep_side
		one_side
	fi
	echo "round $r (load $(cut -d' ' -f1 /proc/loadavg)): one worker ${ones[-1]} tokens/s; 2 replicas: step mode ${reps[-1]} tokens/s (each replica's wait ms/step: $waits; $sent bytes sent/step), outer mode ${outers[-1]} tokens/s ($osent bytes sent/step on average), with int8 ${outers8[-1]} tokens/s ($osent8 bytes), own batches with int8 ${owns[-1]} tokens/s ($osentown bytes), and with the outer step overlapping 10 steps ${delays[-1]} tokens/s"
done
mo=$(median "${ones[@]}") mr=$(median "${reps[@]}") mu=$(median "${outers[@]}") mu8=$(median "${outers8[@]}") mow=$(median "${owns[@]}") mod=$(median "${delays[@]}")

$GO test -c -o "$tmp/client.test" ./client
cpu=$(cd client && "${pin[@]}" "$tmp/client.test" -test.run '^$' -test.bench 'RTCThroughput$' -test.benchtime 1000x |
	awk '/^BenchmarkRTCThroughput/ {for (i=1;i<=NF;i++) if ($(i+1)=="cpu-µs/frame") print $i}')

echo
echo "replicas summary (medians of $ROUNDS; both sides on CPUs 0-$((CORES - 1)))"
awk -v o="$mo" -v r="$mr" -v u="$mu" -v u8="$mu8" -v uo="$mow" -v ud="$mod" -v w="$waits" -v b="$sent" -v ob="$osent" -v ob8="$osent8" -v c="${cpu:-0}" 'BEGIN {
	printf "  one worker, --threads 1                        %8.0f tokens/s\n", o
	printf "  2 replicas x 1 stage, --threads 1 each (step)  %8.0f tokens/s\n", r
	printf "  2 replicas x 1 stage, --threads 1 each (outer) %8.0f tokens/s\n", u
	printf "  the same, int8 pseudo-gradients                %8.0f tokens/s\n", u8
	printf "  own batches (a batch each a step), int8        %8.0f tokens/s\n", uo
	printf "  the same, outer step overlapping 10 steps      %8.0f tokens/s\n", ud
	if (o > 0) printf "  step mode / one worker                         %8.2f   (target >= 1.4)\n", r / o
	if (o > 0) printf "  outer mode (H 20) / one worker                 %8.2f   (target >= 1.9)\n", u / o
	if (o > 0) printf "  outer mode, int8 / one worker                  %8.2f   (target >= 1.9)\n", u8 / o
	if (o > 0) printf "  outer mode, own batches, int8 / one worker     %8.2f   (target >= 1.9)\n", uo / o
	if (o > 0) printf "  the same, overlapped (delay 10) / one worker   %8.2f   (target >= 1.9)\n", ud / o
	if (ob > 0 && ob8 > 0) printf "  bytes between replicas, step / outer mode     %8.1f x (int8 %.1f x)\n", b / ob, b / ob8
	printf "  exposed exchange: each replica waits          %s ms/step (last round)\n", w
	frames = b / 65536
	printf "  sent between replicas                        %8.1f MB/step (%.0f frames of 64 KiB)\n", b / 1e6, frames
	if (c > 0) printf "  data plane CPU at %.0f cpu-µs/frame (both ends) %8.2f s/step for all of them\n", c, frames * c / 1e6
}'
