//go:build (linux || darwin) && (amd64 || arm64)

package vulkan

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/ebitengine/purego"
)

// openLoader opens the Vulkan loader (or, on macOS, MoltenVK, which is a Vulkan ICD and loader
// in one) and returns vkGetInstanceProcAddr, through which every other function is found.
func openLoader() (uintptr, error) {
	names := []string{"libvulkan.so.1", "libvulkan.so"}
	if runtime.GOOS == "darwin" {
		names = []string{"libvulkan.1.dylib", "libvulkan.dylib", "libMoltenVK.dylib",
			"/usr/local/lib/libvulkan.1.dylib", "/opt/homebrew/lib/libvulkan.1.dylib"}
	}
	var errs []error
	for _, n := range names {
		h, err := purego.Dlopen(n, purego.RTLD_NOW|purego.RTLD_LOCAL)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		p, err := purego.Dlsym(h, "vkGetInstanceProcAddr")
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n, err))
			continue
		}
		return p, nil
	}
	return 0, fmt.Errorf("vulkan: no Vulkan loader (install the GPU driver's Vulkan support, or mesa-vulkan-drivers for a CPU device): %w", errors.Join(errs...))
}
