//go:build windows && (amd64 || arm64)

package vulkan

import (
	"fmt"
	"syscall"
)

// openLoader opens vulkan-1.dll, which every Windows GPU driver with Vulkan support installs,
// and returns vkGetInstanceProcAddr (purego has no Dlopen on Windows; the syscall package has
// the equivalent).
func openLoader() (uintptr, error) {
	h, err := syscall.LoadLibrary("vulkan-1.dll")
	if err != nil {
		return 0, fmt.Errorf("vulkan: no Vulkan loader (vulkan-1.dll; install the GPU driver): %w", err)
	}
	p, err := syscall.GetProcAddress(h, "vkGetInstanceProcAddr")
	if err != nil {
		return 0, fmt.Errorf("vulkan: vulkan-1.dll: %w", err)
	}
	return p, nil
}
