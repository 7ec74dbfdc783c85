//go:build !((linux || darwin || windows) && (amd64 || arm64))

package vulkan

import "errors"

// call is never reached where no loader exists: openLoader fails first.
func call(fn uintptr, args ...uintptr) uintptr { panic("vulkan: no loader on this platform") }

func openLoader() (getInstanceProcAddr uintptr, err error) {
	return 0, errors.New("vulkan: not supported on this platform (64-bit linux, darwin and windows only)")
}
