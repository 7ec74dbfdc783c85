#!/usr/bin/env bash
# Where a training step's time goes, by layer (issue 16): BenchmarkTrainStepFresh (the default
# job's step as `make bench` times it) under the CPU profiler, its samples attributed to the
# layers of the model by the functions on their stacks, printed as milliseconds per step and
# shares of the step. With BEFORE=<commit> the same table for that commit's code (built from `git
# archive`, so the working tree is untouched) is printed beside it, the two profiled in
# alternating rounds.
#
#   scripts/profile_step.sh                       (THREADS=1 STEPS=20 ROUNDS=1)
#   BEFORE=c76d604 ROUNDS=2 scripts/profile_step.sh
#
# At one thread every sample is on the step's own goroutine, so the attribution is complete; with
# THREADS=2 the pool's helpers compute parts of kernels without their callers on the stack, and
# what they did counts as "other (pool helpers, runtime)". Rows are cumulative over the listed
# functions, so a row's multiplies are in it (the GEMMs are most of every linear row).
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
THREADS=${THREADS:-1}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-1}
BEFORE=${BEFORE:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

$GO test -c -o "$tmp/after.test" ./model
sides=(after)
if [ -n "$BEFORE" ]; then
	mkdir "$tmp/before"
	git archive "$BEFORE" | tar -x -C "$tmp/before"
	(cd "$tmp/before" && $GO test -c -o "$tmp/before.test" ./model)
	sides=(before after)
fi

# Rows: label; the functions whose samples it counts (pprof -focus); those it leaves to other
# rows (-ignore; "-" for none).
rows=(
	"embedding;kernels\.Encoder(Forward|Backward)$;-"
	"LayerNorm forward;kernels\.LayerNormForward$;-"
	"LayerNorm backward;kernels\.LayerNormBackward$;-"
	"attention forward (heads: QKᵀ, softmax, PV);kernels\.AttentionForward$;-"
	"attention backward;kernels\.AttentionBackward$;-"
	"linear forward (qkv, proj, dense MLP, head);model\.Host\.LinearForward$;\(\*Expert\)"
	"linear backward (qkv, proj, dense MLP, head);model\.Host\.LinearBackward$;\(\*Expert\)"
	"GELU (dense MLP);kernels\.GELU(Forward|Backward)$;\(\*Expert\)"
	"experts forward (their MLPs, GELU);model\.\(\*LocalExperts\)\.Forward$;-"
	"experts backward;model\.\(\*LocalExperts\)\.Backward$;-"
	"router, gate, dispatch;model\.moe(Forward|Backward)$;\(\*LocalExperts\)"
	"cross-entropy;kernels\.CrossEntropy;-"
	"gradient tree (folds, lanes' join);model\.\(\*Shard\)\.(fold|joinLane|GradientsComplete|ZeroGrads)$;-"
	"gradient norm;model\.SquaredNorms$;-"
	"AdamW;model\.\(\*AdamW\)\.Update$;-"
)

# seconds FILE: pprof's "Showing nodes accounting for X" of a -top run, in seconds.
seconds() {
	awk '/^Showing nodes accounting for/ {
		v = $5; sub(",", "", v)
		if (v ~ /ms$/) { sub("ms", "", v); v /= 1000 } else if (v ~ /us$/) { sub("us", "", v); v /= 1e6 } else if (v ~ /min$/) { sub("min", "", v); v *= 60 } else sub("s", "", v)
		print v; exit
	}' "$1"
}

declare -A total steps_done nsop
for side in "${sides[@]}"; do
	total[$side]=0
	steps_done[$side]=0
done
for ((r = 1; r <= ROUNDS; r++)); do
	for side in "${sides[@]}"; do
		out=$(cd model && GOMAXPROCS=$THREADS "$tmp/$side.test" -test.run '^$' -test.bench '^BenchmarkTrainStepFresh$' \
			-test.benchtime "${STEPS}x" -test.cpuprofile "$tmp/$side.$r.prof")
		echo "$side, round $r: $(grep tokens <<<"$out" | awk '{print $3, $4, $5, $6}')"
		nsop[$side.$r]=$(grep tokens <<<"$out" | awk '{print $3}')
	done
done

printf '\n%-46s' "layer ($THREADS thread(s), ms per step)"
for side in "${sides[@]}"; do printf '%18s' "$side"; done
echo
for side in "${sides[@]}"; do
	profs=()
	for ((r = 1; r <= ROUNDS; r++)); do profs+=("$tmp/$side.$r.prof"); done
	# The step's time: every sample of the profile, the pool helpers' included.
	$GO tool pprof -top "$tmp/$side.test" "${profs[@]}" >"$tmp/$side.all" 2>/dev/null
	tot=$(awk '/Total samples/ { v = $6; sub("s$", "", v); print v; exit }' "$tmp/$side.all")
	# ms per step: seconds of samples ÷ (STEPS × ROUNDS) steps. The benchmark's warm-up step is in
	# the profile too, so the denominator is one step more a round.
	echo "$tot $((STEPS * ROUNDS + ROUNDS))" >"$tmp/$side.total"
	for row in "${rows[@]}"; do
		IFS=';' read -r label focus ignore <<<"$row"
		args=(-top -focus="$focus")
		[ "$ignore" != - ] && args+=(-ignore="$ignore")
		$GO tool pprof "${args[@]}" "$tmp/$side.test" "${profs[@]}" >"$tmp/$side.row" 2>/dev/null || true
		echo "$(seconds "$tmp/$side.row")" >>"$tmp/$side.rows"
	done
done
i=0
declare -A sum
for side in "${sides[@]}"; do sum[$side]=0; done
for row in "${rows[@]}"; do
	IFS=';' read -r label focus ignore <<<"$row"
	i=$((i + 1))
	printf '%-46s' "$label"
	for side in "${sides[@]}"; do
		read -r tot n <"$tmp/$side.total"
		v=$(sed -n "${i}p" "$tmp/$side.rows")
		v=${v:-0}
		sum[$side]=$(awk -v a="${sum[$side]}" -v b="$v" 'BEGIN { print a + b }')
		awk -v v="$v" -v n="$n" -v t="$tot" 'BEGIN { printf "%9.1f (%4.1f%%)", 1000 * v / n, 100 * v / t }'
	done
	echo
done
printf '%-46s' "other (pool helpers, runtime)"
for side in "${sides[@]}"; do
	read -r tot n <"$tmp/$side.total"
	awk -v v="${sum[$side]}" -v n="$n" -v t="$tot" 'BEGIN { printf "%9.1f (%4.1f%%)", 1000 * (t - v) / n, 100 * (t - v) / t }'
done
echo
printf '%-46s' "step (CPU time of all threads)"
for side in "${sides[@]}"; do
	read -r tot n <"$tmp/$side.total"
	awk -v n="$n" -v t="$tot" 'BEGIN { printf "%9.1f (100%%) ", 1000 * t / n }'
done
echo
