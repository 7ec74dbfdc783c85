#!/usr/bin/env bash
# What verification costs (the verification issue's measurements), side by side and alternating so
# that both sides see the same noise; ratios of medians at the end. audit_rate 0 against the
# default 0.1 (plus the audit window), the coordinator (which recomputes the audited steps) in the
# parent process, everything on the same CORES CPUs. MODE picks the job:
#   step  (default) the default job with M = 8 on a pinned two-stage pipeline — `shoal train
#         --workers 2`, each worker at --threads CORES/2;
#   outer the default job in outer mode (H 10, int8, no warm-up) on four whole-model replicas —
#         `shoal train --workers 4 --threads 1`.
# It reports:
#   1. tokens/s, audited ÷ audit-free (target >= 0.85);
#   2. the workers' CPU time per step, audited ÷ audit-free (target <= 1.10): what committing,
#      keeping evidence and uploading it cost a volunteer; the coordinator's recomputation is
#      not in it. Two figures: "steady", from the CPU time each worker had used at step WARM and
#      at the last step (`shoal train --json`'s workers_cpu_s), the cost of a step of a long job;
#      and "whole run", the CPU time each worker used from start to exit, which also holds the
#      start (the first touch of each buffer) and the end (the last checkpoint), once a run —
#      a short run's few steps do not amortise them as a job's hundreds of steps do; in outer
#      mode a third, the inner steps alone, since the exchange at each outer step costs 2-3x
#      more CPU in one run than in another of the same build and drowns what audits add;
#   3. the evidence an audit uploaded, from the workers' logs.
#
# SPLIT=1 puts the workers on the first half of the CPUs and the coordinator on the other half
# (the one way to keep the coordinator's recomputations off the workers' cores here, as they are
# on a fleet): its workers' CPU ratio is then the workers' alone; its tokens/s ratio is not the
# target's (that is with the coordinator on the workers' cores).
#
#   MODE=step SPLIT=0 ROUNDS=3 STEPS=40 WARM=5 CORES=2 scripts/bench_audit.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-40}
WARM=${WARM:-5}
CORES=${CORES:-2}
MODE=${MODE:-step}
SPLIT=${SPLIT:-0}
GO=${GO:-go}
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

. scripts/benchlib.sh
pin_two_workers "$CORES"
case $MODE in
step) M=8 workers=2 every=0 ;;
outer) M=4 workers=4 wt=1 every=10 ;;
*)
	echo "MODE=$MODE: want step or outer" >&2
	exit 2
	;;
esac
if [ "$SPLIT" = 1 ]; then
	# Half the CPUs for the workers: each worker's threads share them.
	wt=$(((CORES / 2 + workers - 1) / workers))
	command -v taskset >/dev/null || {
		echo "SPLIT=1 needs taskset" >&2
		exit 2
	}
fi
if [ "$WARM" -ge "$((STEPS - 1))" ]; then
	echo "WARM=$WARM leaves no steps of STEPS=$STEPS to measure" >&2
	exit 2
fi
echo "audit bench ($MODE mode$([ "$SPLIT" = 1 ] && echo ", workers on CPUs 0-$((CORES / 2 - 1)), the coordinator on $((CORES / 2))-$((CORES - 1))")): $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, $STEPS steps (first 3 not counted for tokens/s, first $WARM not for the steady CPU), CPUs 0-$((CORES - 1)) of $(nproc)"
echo "load before: $(uptime | sed 's/.*load average/load average/')"

$BIN train --print-job --steps "$STEPS" --micro-batches $M >"$tmp/base.json"
/usr/bin/env python3 - "$tmp" "$MODE" <<'PY'
import json, sys
d, mode = sys.argv[1], sys.argv[2]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
if mode == "step":
    spec["plan"] = {"stages": [[0, 2], [2, 4]]}
else:
    spec["sync"] = {"mode": "outer", "every": 10, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "int8", "warmup": 0}
for name, rate in (("off", 0), ("on", 0.1)):
    spec["audit_rate"] = rate
    json.dump(spec, open(f"{d}/{name}.json", "w"))
PY

# side NAME: one run; prints its median tokens/s, the workers' CPU-s per step (all of them
# together) over the whole run and in the steady state, and its evidence.
side() {
	local name=$1 data="$tmp/data-$1"
	rm -rf "$data"
	if [ "$SPLIT" = 1 ]; then
		# The workers on the first half of the CPUs, the coordinator moved to the second half
		# once they have started (they keep the affinity they were started with).
		taskset -c "0-$((CORES / 2 - 1))" $BIN train --job "$tmp/$name.json" --json --workers "$workers" --threads "$wt" --data-dir "$data" >"$tmp/$name.jsonl" 2>"$tmp/$name.jsonl.log" &
		local pid=$! i
		for i in $(seq 600); do
			[ "$(pgrep -P "$pid" | wc -l)" -ge "$workers" ] && break
			sleep 0.05
		done
		taskset -a -p -c "$((CORES / 2))-$((CORES - 1))" "$pid" >/dev/null
		if ! wait "$pid"; then
			echo "failed: $BIN train --job $tmp/$name.json" >&2
			tail -n 20 "$tmp/$name.jsonl.log" >&2
			return 1
		fi
	else
		run "$tmp/$name.jsonl" "${pin[@]}" $BIN train --job "$tmp/$name.json" --json --workers "$workers" --threads "$wt" --data-dir "$data"
	fi
	/usr/bin/env python3 - "$tmp/$name.jsonl" "$STEPS" "$data" "$WARM" "$every" <<'PY'
import glob, json, re, statistics, sys
out, steps, data, warm, every = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rows = [json.loads(l) for l in open(out) if l.startswith("{")]
tps = statistics.median(r["tokens_per_s"] for r in rows[3:])
cpu = [float(m.group(1)) for m in re.finditer(r"worker local-\d+: ([0-9.]+) CPU-s", open(out + ".log").read())]
a, b = rows[warm], rows[-1]
steady = (sum(b["workers_cpu_s"]) - sum(a["workers_cpu_s"])) / (b["step"] - a["step"])
# Outer mode: the rows of inner steps alone, leaving out each outer step's row and the next (the
# exchange, whose CPU time moves 2-3x between runs of either side).
inner = [sum(y["workers_cpu_s"]) - sum(x["workers_cpu_s"]) for x, y in zip(rows[warm:], rows[warm + 1:])
         if y["step"] == x["step"] + 1 and (every == 0 or y["step"] % every not in (every - 1, 0))]
ev = [int(m.group(1)) for f in glob.glob(f"{data}/worker-*.log") for m in re.finditer(r"uploading the evidence.* bytes=(\d+)", open(f).read())]
print(tps, f"{sum(cpu) / steps:.4f}", f"{steady:.4f}", f"{statistics.mean(inner):.4f}", len(ev), f"{sum(ev) / len(ev) / 1e6:.1f}" if ev else 0)
PY
}
offs=() ons=() offcpu=() oncpu=() offst=() onst=() offin=() onin=() evidence=""
for r in $(seq "$ROUNDS"); do
	order="off on"
	[ $((r % 2)) = 0 ] && order="on off"
	for name in $order; do
		s=$(side "$name")
		read -r tps whole steady inner n mb <<<"$s"
		if [ "$name" = off ]; then
			offs+=("$tps") offcpu+=("$whole") offst+=("$steady") offin+=("$inner")
		else
			ons+=("$tps") oncpu+=("$whole") onst+=("$steady") onin+=("$inner") evidence="$n audits, $mb MB each"
		fi
		echo "round $r $name (load $(cut -d' ' -f1 /proc/loadavg)): $tps tokens/s, the workers' CPU-s per step: $steady steady ($inner an inner step), $whole over the whole run"
	done
done
echo
echo "audit summary, $MODE mode (medians of $ROUNDS; $([ "$SPLIT" = 1 ] && echo "workers on CPUs 0-$((CORES / 2 - 1)), the coordinator on $((CORES / 2))-$((CORES - 1))" || echo "both sides on CPUs 0-$((CORES - 1))"))"
awk -v a="$(median "${offs[@]}")" -v b="$(median "${ons[@]}")" -v ca="$(median "${offcpu[@]}")" -v cb="$(median "${oncpu[@]}")" \
	-v sa="$(median "${offst[@]}")" -v sb="$(median "${onst[@]}")" -v ia="$(median "${offin[@]}")" -v ib="$(median "${onin[@]}")" \
	-v mode="$MODE" -v ev="$evidence" 'BEGIN {
	printf "  audit_rate 0      %8.0f tokens/s, workers %.3f CPU-s per step steady, %.3f over the whole run\n", a, sa, ca
	printf "  audit_rate 0.1    %8.0f tokens/s, workers %.3f CPU-s per step steady, %.3f over the whole run\n", b, sb, cb
	printf "  tokens/s ratio    %8.2f   (target >= 0.85)\n", b / a
	printf "  worker CPU ratio  %8.2f   steady (target <= 1.10; the coordinator recomputation not counted)\n", sb / sa
	if (mode == "outer")
		printf "                    %8.2f   inner steps alone (%.3f against %.3f CPU-s; without the outer steps and the steps after them)\n", ib / ia, ib, ia
	printf "                    %8.2f   over the whole run, start and end included\n", cb / ca
	printf "  evidence (last audited run): %s\n", ev
}'
# Each round's two runs are minutes apart, while the machine's pace drifts over a run of rounds
# (the audit-free side alone moved 6,083–7,080 tokens/s in one hour): the ratio within each round
# is the steadier figure.
pt=() pc=() ps=() pi=()
for i in "${!offs[@]}"; do
	pt+=("$(awk -v a="${offs[$i]}" -v b="${ons[$i]}" 'BEGIN {printf "%.3f", b / a}')")
	pc+=("$(awk -v a="${offcpu[$i]}" -v b="${oncpu[$i]}" 'BEGIN {printf "%.3f", b / a}')")
	ps+=("$(awk -v a="${offst[$i]}" -v b="${onst[$i]}" 'BEGIN {printf "%.3f", b / a}')")
	pi+=("$(awk -v a="${offin[$i]}" -v b="${onin[$i]}" 'BEGIN {printf "%.3f", b / a}')")
done
echo "  per round, tokens/s ratio: ${pt[*]} (median $(median "${pt[@]}"))"
echo "  per round, worker CPU ratio, steady: ${ps[*]} (median $(median "${ps[@]}"))"
[ "$MODE" = outer ] && echo "  per round, worker CPU ratio, inner steps: ${pi[*]} (median $(median "${pi[@]}"))"
echo "  per round, worker CPU ratio, whole run: ${pc[*]} (median $(median "${pc[@]}"))"
