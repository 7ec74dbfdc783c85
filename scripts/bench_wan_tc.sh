#!/usr/bin/env bash
# A WAN on one machine for real worker processes (issue 17, item 4), the rate-only variant:
# `shoal train --workers 2` (a coordinator and two worker processes, a pinned two-stage plan) in a
# network namespace that holds only lo, whose egress tc's token-bucket filter limits to RATE. It
# runs the default job with float32 and with int8 boundaries, alternating rounds, and prints each
# format's median step time (B·T tokens over the step's tokens/s, the first 2 steps of each run
# skipped as warm-up).
#
# What is shaped, and what is not: tbf sits on lo's egress, which every packet in the namespace
# crosses once — so RATE is shared by both directions of the WebRTC link (activations one way,
# gradients the other) and by the coordinator's WebSocket; and there is no delay (the kernel here
# has no netem). The in-process bench (TestWANBench, internal/wan) models the delay and a rate per
# receiver. Nothing leaves the namespace: it has no other interface.
#
#   RATE=200mbit STEPS=8 ROUNDS=2 ./scripts/bench_wan_tc.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/benchlib.sh
RATE=${RATE:-200mbit}
STEPS=${STEPS:-8}
ROUNDS=${ROUNDS:-2}
# A run that outlives this (a worker killed from outside leaves the coordinator waiting for
# another) is failed rather than waited for.
RUN_TIMEOUT=${RUN_TIMEOUT:-1200}
BIN=bin/shoal
GO=${GO:-go}

# The namespace needs unprivileged user namespaces, and tc with tbf inside it; without them there
# is nothing to measure, which is not a failure of Shoal.
if ! command -v unshare >/dev/null || ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
	echo "bench_wan_tc: skipped: needs unshare, tc and ip (iproute2) on PATH"
	exit 0
fi
if ! why=$(unshare -rn sh -c "ip link set lo up && tc qdisc add dev lo root tbf rate $RATE burst 256kb latency 50ms" 2>&1); then
	echo "bench_wan_tc: skipped: cannot shape lo in a new network namespace (unshare -rn, tc tbf): $why"
	exit 0
fi
[ -x "$BIN" ] || $GO build -o "$BIN" ./cmd/shoal

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$BIN train --print-job --steps "$STEPS" >"$tmp/base.json"
# Validation and checkpoints off (the steps measured are training steps), the default model's
# four blocks pinned as two stages of two, and one job file per wire format.
/usr/bin/env python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
spec = json.load(open(f"{d}/base.json"))
spec["val_every"] = 0
spec["checkpoint_every"] = 0
L = spec["model"]["n_layer"]
spec["plan"] = {"stages": [[0, L // 2], [L // 2, L]]}
for name in ("f32", "int8"):
    spec["wire"] = {"activations": name, "gradients": name}
    json.dump(spec, open(f"{d}/{name}.json", "w"))
print(spec["batch_size"] * spec["model"]["block_size"], file=open(f"{d}/tokens", "w"))
PY
tokens=$(cat "$tmp/tokens")

# The step times (ms) of one run's JSON lines, warm-up skipped.
steptimes() {
	/usr/bin/env python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][2:]
print(" ".join(str(round(int(sys.argv[2]) / r["tokens_per_s"] * 1000, 1)) for r in rows))' "$1" "$tokens"
}

f32=() int8=()
for r in $(seq "$ROUNDS"); do
	for w in f32 int8; do
		# One namespace per run: lo shaped, then the coordinator and its workers inside it.
		timeout "$RUN_TIMEOUT" unshare -rn sh -c "ip link set lo up && tc qdisc add dev lo root tbf rate $RATE burst 256kb latency 50ms && \
			exec $BIN train --job $tmp/$w.json --workers 2 --threads 1 --json" >"$tmp/$w.jsonl" 2>"$tmp/$w.log" || {
			echo "run failed ($w, round $r):"
			tail -20 "$tmp/$w.log"
			exit 1
		}
		# A coordinator stopped by a signal exits 0 with the steps it made: count them.
		if [ "$(grep -c '^{' "$tmp/$w.jsonl")" -ne "$STEPS" ]; then
			echo "run incomplete ($w, round $r): $(grep -c '^{' "$tmp/$w.jsonl") of $STEPS steps"
			tail -20 "$tmp/$w.log"
			exit 1
		fi
		read -r -a t <<<"$(steptimes "$tmp/$w.jsonl")"
		echo "round $r, $w: step times ms ${t[*]}"
		if [ "$w" = f32 ]; then f32+=("${t[@]}"); else int8+=("${t[@]}"); fi
	done
done
mf=$(median "${f32[@]}") mi=$(median "${int8[@]}")
echo
echo "shoal train --workers 2, lo limited to $RATE (tc tbf, both directions and the WebSocket share it; no delay), $tokens tokens a step:"
printf '%-6s %8s %16s\n' wire steps "median step ms"
printf '%-6s %8d %16s\n' f32 "${#f32[@]}" "$mf" int8 "${#int8[@]}" "$mi"
echo "median step int8 / f32: $(awk -v a="$mi" -v b="$mf" 'BEGIN {printf "%.3f", a / b}')"
