#!/bin/sh
# under_load.sh N CMD...: runs CMD while N busy loops (sh -c 'while :; do :; done') hold the
# cores, and stops them when CMD ends — the busy machine that `make test` must pass on
# (docs/design.md, "Testing"). Example: scripts/under_load.sh 4 make test
set -u
n=$1
shift
pids=""
for _ in $(seq "$n"); do
	sh -c 'while :; do :; done' &
	pids="$pids $!"
done
trap 'kill $pids 2>/dev/null' EXIT INT TERM
start=$(date +%s)
"$@"
rc=$?
echo "under_load: $* exited $rc after $(( $(date +%s) - start )) s beside $n busy loops" >&2
exit $rc
