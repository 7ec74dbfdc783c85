package vulkan

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Info describes one Vulkan physical device.
type Info struct {
	Index int    // the index Open takes
	Name  string // the driver's device name, e.g. "NVIDIA H200" or "llvmpipe (LLVM 15.0.6, 256 bits)"
	// Type is "discrete", "integrated", "virtual", "cpu" (a software rasterizer such as lavapipe
	// or SwiftShader) or "other".
	Type        string
	MemoryBytes uint64 // total size of the device-local memory heaps
	APIVersion  string // the Vulkan version the driver supports, "major.minor.patch"
}

// instance is a VkInstance with its functions.
type instance struct {
	gipa uintptr // vkGetInstanceProcAddr
	fn   instanceFuncs
	h    handle
}

const apiVersion11 = 1<<22 | 1<<12 // VK_MAKE_API_VERSION(0, 1, 1, 0)

func newInstance() (*instance, error) {
	if err := checkLayouts(); err != nil {
		return nil, err
	}
	gipa, err := openLoader()
	if err != nil {
		return nil, err
	}
	in := &instance{gipa: gipa}
	create := in.proc(0, "vkCreateInstance")
	if create == 0 {
		return nil, fmt.Errorf("vulkan: the loader has no vkCreateInstance")
	}
	app := &applicationInfo{sType: stApplicationInfo, pApplicationName: cstr("shoal"), pEngineName: cstr("shoal"), apiVersion: apiVersion11}
	ci := &instanceCreateInfo{sType: stInstanceCreateInfo, pApplicationInfo: app}
	if runtime.GOOS == "darwin" {
		// MoltenVK is a portability implementation: the loader lists it only to an instance
		// that asks for portability enumeration. Tried first; plain instances after.
		exts := &[1]*byte{cstr("VK_KHR_portability_enumeration")}
		pci := *ci
		pci.flags = instanceEnumeratePortability
		pci.enabledExtensionCount = 1
		pci.ppEnabledExtensionNames = unsafe.Pointer(exts)
		if r := call(create, uintptr(unsafe.Pointer(&pci)), 0, uintptr(unsafe.Pointer(&in.h))); check(r, "") != nil {
			in.h = 0
		}
	}
	if in.h == 0 {
		if err := check(call(create, uintptr(unsafe.Pointer(ci)), 0, uintptr(unsafe.Pointer(&in.h))), "create instance"); err != nil {
			return nil, err
		}
	}
	if err := resolve(&in.fn, func(name string) uintptr { return in.proc(in.h, name) }); err != nil {
		in.destroy()
		return nil, err
	}
	return in, nil
}

func (in *instance) proc(inst handle, name string) uintptr {
	return call(in.gipa, uintptr(inst), uintptr(unsafe.Pointer(cstr(name))))
}

func (in *instance) destroy() {
	if in.h != 0 && in.fn.DestroyInstance != 0 {
		call(in.fn.DestroyInstance, uintptr(in.h), 0)
	}
	in.h = 0
}

func (in *instance) physicalDevices() ([]handle, error) {
	var n uint32
	if err := check(call(in.fn.EnumeratePhysicalDevices, uintptr(in.h), uintptr(unsafe.Pointer(&n)), 0), "enumerate devices"); err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, nil
	}
	pds := make([]handle, n)
	if err := check(call(in.fn.EnumeratePhysicalDevices, uintptr(in.h), uintptr(unsafe.Pointer(&n)), uintptr(unsafe.Pointer(&pds[0]))), "enumerate devices"); err != nil {
		return nil, err
	}
	return pds[:n], nil
}

func (in *instance) properties(pd handle) *physicalDeviceProperties {
	p := new(physicalDeviceProperties)
	call(in.fn.GetPhysicalDeviceProperties, uintptr(pd), uintptr(unsafe.Pointer(p)))
	return p
}

func (in *instance) memoryProperties(pd handle) *memoryProperties {
	p := new(memoryProperties)
	call(in.fn.GetPhysicalDeviceMemoryProperties, uintptr(pd), uintptr(unsafe.Pointer(p)))
	return p
}

func (in *instance) info(i int, pd handle) Info {
	p := in.properties(pd)
	mp := in.memoryProperties(pd)
	var mem uint64
	for h := range min(int(mp.memoryHeapCount), len(mp.memoryHeaps)) {
		if mp.memoryHeaps[h].flags&memDeviceLocal != 0 {
			mem += mp.memoryHeaps[h].size
		}
	}
	types := map[uint32]string{1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
	typ, ok := types[p.deviceType]
	if !ok {
		typ = "other"
	}
	v := p.apiVersion
	return Info{
		Index: i, Name: gostr(p.deviceName[:]), Type: typ, MemoryBytes: mem,
		APIVersion: fmt.Sprintf("%d.%d.%d", v>>22&0x7f, v>>12&0x3ff, v&0xfff),
	}
}

func (in *instance) deviceExtensions(pd handle) []string {
	var n uint32
	if check(call(in.fn.EnumerateDeviceExtensionProperties, uintptr(pd), 0, uintptr(unsafe.Pointer(&n)), 0), "") != nil || n == 0 {
		return nil
	}
	props := make([]extensionProperties, n)
	if check(call(in.fn.EnumerateDeviceExtensionProperties, uintptr(pd), 0, uintptr(unsafe.Pointer(&n)), uintptr(unsafe.Pointer(&props[0]))), "") != nil {
		return nil
	}
	out := make([]string, 0, n)
	for _, e := range props[:n] {
		out = append(out, gostr(e.name[:]))
	}
	return out
}

// Devices lists the Vulkan devices of this machine in the loader's order; an error says why
// there are none to list (no loader, no driver).
func Devices() ([]Info, error) {
	in, err := newInstance()
	if err != nil {
		return nil, err
	}
	defer in.destroy()
	pds, err := in.physicalDevices()
	if err != nil {
		return nil, err
	}
	out := make([]Info, len(pds))
	for i, pd := range pds {
		out[i] = in.info(i, pd)
	}
	return out, nil
}
