#!/usr/bin/env bash
# What verification costs (the verification issue's measurements), side by side and alternating so
# that both sides see the same noise; ratios of medians at the end. The default job with M = 8 on
# a pinned two-stage pipeline — `shoal train --workers 2`, each worker at --threads CORES/2, the
# coordinator (which recomputes the audited steps) in the parent process, all on the same CORES
# CPUs — with audit_rate 0 against the default 0.1 (plus the audit window):
#   1. tokens/s, audited ÷ audit-free (target >= 0.85);
#   2. each worker's CPU time per step, audited ÷ audit-free (target <= 1.10): what committing,
#      keeping evidence and uploading it cost a volunteer; the coordinator's recomputation is
#      not in it;
#   3. the evidence an audit uploaded, from the workers' logs.
#
#   ROUNDS=3 STEPS=40 CORES=2 scripts/bench_audit.sh
# Fails only when a command fails, never on a ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-40}
CORES=${CORES:-2}
GO=${GO:-go}
M=8
BIN=bin/shoal
$GO build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

. scripts/benchlib.sh
pin_two_workers "$CORES"
echo "audit bench: $(date -u '+%Y-%m-%d %H:%M UTC'), rounds $ROUNDS, $STEPS steps (first 3 not counted for tokens/s), CPUs 0-$((CORES - 1)) of $(nproc)"
echo "load before: $(uptime | sed 's/.*load average/load average/')"

$BIN train --print-job --steps "$STEPS" --micro-batches $M >"$tmp/base.json"
/usr/bin/env python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
spec["plan"] = {"stages": [[0, 2], [2, 4]]}
for name, rate in (("off", 0), ("on", 0.1)):
    spec["audit_rate"] = rate
    json.dump(spec, open(f"{d}/{name}.json", "w"))
PY

# side NAME: one run; appends its median tokens/s, its workers' CPU-s per step and its evidence.
side() {
	local name=$1 data="$tmp/data-$1"
	rm -rf "$data"
	run "$tmp/$name.jsonl" "${pin[@]}" $BIN train --job "$tmp/$name.json" --json --workers 2 --threads "$wt" --data-dir "$data"
	/usr/bin/env python3 - "$tmp/$name.jsonl" "$STEPS" "$data" <<'PY'
import glob, json, re, statistics, sys
out, steps, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(out) if l.startswith("{")][3:]
tps = statistics.median(r["tokens_per_s"] for r in rows)
cpu = [float(m.group(1)) for m in re.finditer(r"worker local-\d+: ([0-9.]+) CPU-s", open(out + ".log").read())]
ev = [int(m.group(1)) for f in glob.glob(f"{data}/worker-*.log") for m in re.finditer(r"uploading the evidence.* bytes=(\d+)", open(f).read())]
print(tps, " ".join(f"{c / steps:.3f}" for c in cpu), len(ev), (sum(ev) / len(ev) / 1e6) if ev else 0)
PY
}
offs=() ons=() offcpu=() oncpu=() evidence=""
for r in $(seq "$ROUNDS"); do
	order="off on"
	[ $((r % 2)) = 0 ] && order="on off"
	for name in $order; do
		s=$(side "$name")
		read -r tps c0 c1 n mb <<<"$s"
		if [ "$name" = off ]; then
			offs+=("$tps") offcpu+=("$(awk -v a="$c0" -v b="$c1" 'BEGIN {print a + b}')")
		else
			ons+=("$tps") oncpu+=("$(awk -v a="$c0" -v b="$c1" 'BEGIN {print a + b}')") evidence="$n audits, $mb MB each"
		fi
		echo "round $r $name (load $(cut -d' ' -f1 /proc/loadavg)): $tps tokens/s, workers' CPU-s per step $c0 + $c1"
	done
done
echo
echo "audit summary (medians of $ROUNDS; both sides on CPUs 0-$((CORES - 1)))"
awk -v a="$(median "${offs[@]}")" -v b="$(median "${ons[@]}")" -v ca="$(median "${offcpu[@]}")" -v cb="$(median "${oncpu[@]}")" -v ev="$evidence" 'BEGIN {
	printf "  audit_rate 0      %8.0f tokens/s, workers %.3f CPU-s per step\n", a, ca
	printf "  audit_rate 0.1    %8.0f tokens/s, workers %.3f CPU-s per step\n", b, cb
	printf "  tokens/s ratio    %8.2f   (target >= 0.85)\n", b / a
	printf "  worker CPU ratio  %8.2f   (target <= 1.10; the coordinator recomputation not counted)\n", cb / ca
	printf "  evidence (last audited run): %s\n", ev
}'
# Each round's two runs are minutes apart, while the machine's pace drifts over a run of rounds
# (the audit-free side alone moved 6,083–7,080 tokens/s in one hour): the ratio within each round
# is the steadier figure.
pt=() pc=()
for i in "${!offs[@]}"; do
	pt+=("$(awk -v a="${offs[$i]}" -v b="${ons[$i]}" 'BEGIN {printf "%.3f", b / a}')")
	pc+=("$(awk -v a="${offcpu[$i]}" -v b="${oncpu[$i]}" 'BEGIN {printf "%.3f", b / a}')")
done
echo "  per round, tokens/s ratio: ${pt[*]} (median $(median "${pt[@]}"))"
echo "  per round, worker CPU ratio: ${pc[*]} (median $(median "${pc[@]}"))"
