# Sourced by the benchmarks that set several processes against one (bench_pipeline.sh,
# bench_experts.sh, bench_replicas.sh, bench_wan_tc.sh): what they share.
#
# pin_cpus N sets the array pin to the command prefix that confines a process to CPUs 0..N-1
# (taskset), or to nothing, with a warning, where taskset is missing; it exits when the machine
# has fewer than N CPUs.
pin_cpus() {
	local n=$1
	if [ "$(nproc)" -lt "$n" ]; then
		echo "CORES=$n but only $(nproc) CPUs: both sides would share fewer cores than asked" >&2
		exit 2
	fi
	pin=()
	if command -v taskset >/dev/null; then
		pin=(taskset -c "0-$((n - 1))")
	else
		echo "warning: no taskset; both sides run on all $(nproc) CPUs"
	fi
}

# pin_two_workers N is pin_cpus N for two workers against one process on the same N CPUs
# (bench_pipeline.sh, bench_audit.sh): N must be even, and wt is each worker's share, N/2 threads.
pin_two_workers() {
	if [ "$1" -lt 2 ] || [ $(($1 % 2)) != 0 ]; then
		echo "CORES=$1: want an even number >= 2 (two workers get CORES/2 threads each)" >&2
		exit 2
	fi
	pin_cpus "$1"
	wt=$(($1 / 2))
}

# run OUT CMD... runs a training command with its stdout in OUT and its stderr in OUT.log, shown
# if it fails.
run() {
	local out=$1
	shift
	if ! "$@" >"$out" 2>"$out.log"; then
		echo "failed: $*" >&2
		tail -n 20 "$out.log" >&2
		return 1
	fi
}

# median X... prints the median of its numbers.
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
