//go:build (linux || darwin || windows) && (amd64 || arm64)

package vulkan

import "github.com/ebitengine/purego"

// call calls the C function at fn. Vulkan's arguments are all integers, handles and pointers,
// which purego passes in integer registers (and on the stack past the sixth) by the platform's C
// ABI; the result is the VkResult or nothing.
//
// uintptrescapes makes the compiler keep alive, and on the heap, everything whose address a
// caller converts to uintptr in its call of call, as it does for purego.SyscallN itself; the
// structs such a pointer leads to are reachable from it, so they stay too.
//
//go:uintptrescapes
func call(fn uintptr, args ...uintptr) uintptr {
	r, _, _ := purego.SyscallN(fn, args...)
	return r
}
