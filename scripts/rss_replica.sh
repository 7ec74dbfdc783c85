#!/bin/bash
# rss_replica.sh — peak RSS of a worker holding a whole replica, against the planner's estimate
# (issue 31, item 6): `shoal train --workers 1` on MODEL (default 1b) with B = 2, M = 2, 2 steps,
# validation, audits and checkpoints off, in step mode and in outer mode (one replica, every 1).
# The worker's and the coordinator's VmHWM are polled every 0.5 s, and the worker's peak RssAnon:
# in outer mode the outer state is a file mapping (client/outerstore.go), whose pages VmHWM counts
# and the planner does not (they are the page cache's to drop). The worker logs its estimate's
# inputs, and `go run ./scripts/estimate` prints the estimate for each job file.
#
#   scripts/rss_replica.sh [--bin SHOAL] [--model 1b|large|default] [--data FILE] [--out DIR]
#                          [--modes "step outer"]
#
# WORKER_MEMORY (default 30GiB) is the worker's --memory, and so its GOMEMLIMIT. The 1b model in
# step mode needs ~27 GB for the worker; in outer mode ~18 GB (WORKER_MEMORY=21GiB fits this
# 23 GiB machine); large fits anywhere with 10 GB.
set -euo pipefail
BIN=shoal MODEL=1b DATA="" OUT=rss-out MODES="step outer"
while [ $# -gt 0 ]; do
  case $1 in
    --bin) BIN=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    *) echo "rss_replica.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for mode in $MODES; do
  job="$OUT/job_$mode.json"
  # The printed job has one field a line: set the few this run changes.
  "$BIN" train --model "$MODEL" --print-job | sed -E \
    -e 's/"steps": [0-9]+/"steps": 2/' -e 's/"batch_size": [0-9]+/"batch_size": 2/' \
    -e 's/"micro_batches": [0-9]+/"micro_batches": 2/' -e 's/"warmup": [0-9]+/"warmup": 0/' \
    -e 's/"checkpoint_every": [0-9]+/"checkpoint_every": 0/' -e 's/"val_every": [0-9]+/"val_every": 0/' \
    -e 's/"audit_rate": [0-9.]+/"audit_rate": 0/' -e 's/"step_deadline_min_s": [0-9]+/"step_deadline_min_s": 120/' \
    > "$job"
  if [ -n "$DATA" ]; then
    sed -i -E "s#\"data\": \"[^\"]*\"#\"data\": \"$DATA\"#" "$job"
  fi
  if [ $mode = outer ]; then
    # The last line is the closing brace: add the sync field before it.
    sed -i '$ d' "$job"
    sed -i '$ s/$/,/' "$job"
    printf '  "sync": {"mode": "outer", "every": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none", "warmup": 0}\n}\n' >> "$job"
  fi
  dd=$(mktemp -d)
  t0=$(date +%s)
  timeout "${RSS_TIMEOUT:-600}" "$BIN" train --job "$job" --workers 1 --worker-memory "${WORKER_MEMORY:-30GiB}" --data-dir "$dd" > "$OUT/$mode.out" 2>&1 &
  tp=$!
  whwm=0 chwm=0 wanon=0
  while kill -0 $tp 2>/dev/null; do
    for p in $(pgrep -f "$BIN worker" || true); do
      v=$(awk '/VmHWM/{print $2}' /proc/$p/status 2>/dev/null || true); [ -n "$v" ] && [ "$v" -gt $whwm ] && whwm=$v
      v=$(awk '/RssAnon/{print $2}' /proc/$p/status 2>/dev/null || true); [ -n "$v" ] && [ "$v" -gt $wanon ] && wanon=$v
    done
    for p in $(pgrep -f "$BIN train" || true); do
      v=$(awk '/VmHWM/{print $2}' /proc/$p/status 2>/dev/null || true); [ -n "$v" ] && [ "$v" -gt $chwm ] && chwm=$v
    done
    sleep 0.5
  done
  rc=0; wait $tp || rc=$?
  cp "$dd/worker-0.log" "$OUT/$mode.worker.log" 2>/dev/null || true
  rm -rf "$dd"
  echo "$MODEL $mode: rc $rc in $(( $(date +%s) - t0 )) s; worker peak RSS $(( whwm * 1024 )) B (anonymous $(( wanon * 1024 )) B), coordinator $(( chwm * 1024 )) B" | tee -a "$OUT/summary.txt"
done
