#!/usr/bin/env bash
# Training throughput of Shoal's default-job model beside the PyTorch anchor on the same machine,
# alternating the two so that both see the same noise; ratios of medians at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
ANCHOR=model/testdata/torch_gpt_moe.py
have_torch=0
/usr/bin/python3 -c 'import torch' >/dev/null 2>&1 && have_torch=1

shoal=() torch=()
for r in $(seq "$ROUNDS"); do
	s=$(GOMAXPROCS=$THREADS go test ./model -run '^$' -bench '^BenchmarkTrainStep$' -benchtime 5x -count 1 |
		awk '/tokens\/s/ { for (i = 1; i <= NF; i++) if ($(i+1) == "tokens/s") print $i }')
	shoal+=("$s")
	echo "round $r: shoal $s tokens/s"
	if [ $have_torch = 1 ]; then
		t=$(LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp OMP_NUM_THREADS=$THREADS \
			/usr/bin/python3 $ANCHOR bench --threads "$THREADS" --steps 5 --reps 3 |
			/usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s_median"])')
		torch+=("$t")
		echo "round $r: torch $t tokens/s"
	fi
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ms=$(median "${shoal[@]}")
echo
echo "training tokens/s, default job model (B 16, M 4), $THREADS threads, median of $ROUNDS:"
echo "  shoal  $ms"
if [ $have_torch = 1 ]; then
	mt=$(median "${torch[@]}")
	echo "  torch  $mt"
	awk -v s="$ms" -v t="$mt" 'BEGIN { printf "  ratio shoal/torch  %.2f\n", s / t }'
else
	echo "  (torch not installed: apt-get install -y python3-torch libopenblas0-openmp for the side-by-side)"
fi
