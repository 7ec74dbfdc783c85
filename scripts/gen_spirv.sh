#!/bin/sh
# gen_spirv.sh [outdir]: compiles the Vulkan kernels (vulkan/shaders/*.comp, GLSL 4.50) to the
# SPIR-V that package vulkan embeds (vulkan/spv/*.spv, or outdir). Run through
# `go generate ./vulkan/`; vulkan's TestSPIRVCurrent runs it into a temporary directory and fails
# when a checked-in .spv differs, so an edited shader cannot ship with stale SPIR-V.
#
# matmul.comp is compiled three times, one per operand layout (kernels.MatMulNN/NT/TN).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
src=$root/vulkan/shaders
out=${1:-$root/vulkan/spv}
command -v glslangValidator >/dev/null 2>&1 || {
	echo "gen_spirv.sh: glslangValidator not found: install glslang-tools" >&2
	exit 1
}
mkdir -p "$out"
compile() { # compile <name> <source> [defines…]
	name=$1
	file=$2
	shift 2
	glslangValidator -V --target-env vulkan1.1 -I"$src" "$@" -o "$out/$name.spv" "$src/$file" >/dev/null
}
for f in "$src"/*.comp; do
	name=$(basename "$f" .comp)
	case $name in
	matmul)
		compile matmul_nn matmul.comp
		compile matmul_nt matmul.comp -DTRANS_B=1
		compile matmul_tn matmul.comp -DTRANS_A=1
		;;
	*) compile "$name" "$name.comp" ;;
	esac
done
