# Sourced by the benchmarks that set several processes against one (bench_pipeline.sh,
# bench_experts.sh), so that both sides get the same CPUs.
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
