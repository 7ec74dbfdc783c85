package vulkan

//go:generate sh ../scripts/gen_spirv.sh
