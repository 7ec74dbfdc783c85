#!/usr/bin/env bash
# Expert parallelism's cost (the experts issue, item 6): the default model trained by a 2-stage
# pipeline with the experts at their stages, against the same 2 stages with each MoE block's
# experts on an expert host of their own; tokens/s (medians, alternating) and the tensor bytes the
# workers send each other per step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-12}
BIN=bin/shoal
go build -o $BIN ./cmd/shoal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
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
summarise() {
	/usr/bin/env python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][3:]
print(statistics.median(r["tokens_per_s"] for r in rows), statistics.median(r.get("bytes_sent", 0) for r in rows))' "$1"
}
loc=() rem=() lb="" rb=""
for r in $(seq "$ROUNDS"); do
	$BIN train --job "$tmp/local.json" --json --workers 2 --threads 1 >"$tmp/l.jsonl" 2>/dev/null
	read -r l lb <<<"$(summarise "$tmp/l.jsonl")"
	$BIN train --job "$tmp/remote.json" --json --workers 4 --threads 1 >"$tmp/r.jsonl" 2>/dev/null
	read -r x rb <<<"$(summarise "$tmp/r.jsonl")"
	loc+=("$l") rem+=("$x")
	echo "round $r: experts at their stages $l tokens/s; on expert hosts $x tokens/s"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
awk -v l="$(median "${loc[@]}")" -v r="$(median "${rem[@]}")" -v lb="$lb" -v rb="$rb" 'BEGIN {
	printf "\nexperts local to their stage (2 workers)   %6.0f tokens/s, %6.1f MB sent per step\n", l, lb / 1e6
	printf "experts on 2 expert hosts (4 workers)      %6.0f tokens/s, %6.1f MB sent per step\n", r, rb / 1e6
	printf "remote / local                              %6.2f\n", r / l
}'
