package vulkan

// The part of the Vulkan 1.1 C API that the device uses, written out by hand: the structs with
// their C layouts (on the 64-bit targets the loader supports, Go lays out uint32, uint64 and
// pointer fields exactly as C does, padding included), the enum values, and a table of function
// pointers resolved through vkGetInstanceProcAddr / vkGetDeviceProcAddr. Nothing here is
// generated; it is kept to what the device calls.

import (
	"fmt"
	"reflect"
	"unsafe"
)

type (
	vkResult int32
	handle   = uint64 // every Vulkan handle, dispatchable or not, on a 64-bit target
)

const (
	vkSuccess    vkResult = 0
	vkNotReady   vkResult = 1
	vkTimeout    vkResult = 2
	vkIncomplete vkResult = 5
)

func (r vkResult) Error() string {
	names := map[vkResult]string{
		-1: "VK_ERROR_OUT_OF_HOST_MEMORY", -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
		-3: "VK_ERROR_INITIALIZATION_FAILED", -4: "VK_ERROR_DEVICE_LOST", -5: "VK_ERROR_MEMORY_MAP_FAILED",
		-6: "VK_ERROR_LAYER_NOT_PRESENT", -7: "VK_ERROR_EXTENSION_NOT_PRESENT", -8: "VK_ERROR_FEATURE_NOT_PRESENT",
		-9: "VK_ERROR_INCOMPATIBLE_DRIVER", -10: "VK_ERROR_TOO_MANY_OBJECTS", 2: "VK_TIMEOUT",
	}
	if n, ok := names[r]; ok {
		return n
	}
	return fmt.Sprintf("VkResult %d", int32(r))
}

// Structure types.
const (
	stApplicationInfo           = 0
	stInstanceCreateInfo        = 1
	stDeviceQueueCreateInfo     = 2
	stDeviceCreateInfo          = 3
	stSubmitInfo                = 4
	stMemoryAllocateInfo        = 5
	stFenceCreateInfo           = 8
	stBufferCreateInfo          = 12
	stShaderModuleCreateInfo    = 16
	stPipelineShaderStageCreate = 18
	stComputePipelineCreateInfo = 29
	stPipelineLayoutCreateInfo  = 30
	stDescriptorSetLayoutCreate = 32
	stDescriptorPoolCreateInfo  = 33
	stDescriptorSetAllocateInfo = 34
	stWriteDescriptorSet        = 35
	stCommandPoolCreateInfo     = 39
	stCommandBufferAllocateInfo = 40
	stCommandBufferBeginInfo    = 42
	stMemoryBarrier             = 46
)

// Flags and enums.
const (
	bufferUsageTransferSrc = 0x1
	bufferUsageTransferDst = 0x2
	bufferUsageStorage     = 0x20

	memDeviceLocal  = 0x1
	memHostVisible  = 0x2
	memHostCoherent = 0x4
	memHostCached   = 0x8

	descriptorStorageBuffer = 7
	shaderStageCompute      = 0x20
	bindPointCompute        = 1
	queueCompute            = 0x2

	stageTransfer = 0x1000
	stageCompute  = 0x800
	stageHost     = 0x4000

	accessShaderRead    = 0x20
	accessShaderWrite   = 0x40
	accessTransferRead  = 0x800
	accessTransferWrite = 0x1000
	accessHostRead      = 0x2000

	commandPoolResetBuffer = 0x2
	commandBufferOneTime   = 0x1
	descriptorPoolFreeSet  = 0x1

	instanceEnumeratePortability = 0x1 // VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR

	wholeSize = ^uint64(0)
)

type applicationInfo struct {
	sType              uint32
	pNext              unsafe.Pointer
	pApplicationName   *byte
	applicationVersion uint32
	pEngineName        *byte
	engineVersion      uint32
	apiVersion         uint32
}

type instanceCreateInfo struct {
	sType                   uint32
	pNext                   unsafe.Pointer
	flags                   uint32
	pApplicationInfo        *applicationInfo
	enabledLayerCount       uint32
	ppEnabledLayerNames     unsafe.Pointer
	enabledExtensionCount   uint32
	ppEnabledExtensionNames unsafe.Pointer
}

type deviceQueueCreateInfo struct {
	sType            uint32
	pNext            unsafe.Pointer
	flags            uint32
	queueFamilyIndex uint32
	queueCount       uint32
	pQueuePriorities *float32
}

type deviceCreateInfo struct {
	sType                   uint32
	pNext                   unsafe.Pointer
	flags                   uint32
	queueCreateInfoCount    uint32
	pQueueCreateInfos       *deviceQueueCreateInfo
	enabledLayerCount       uint32
	ppEnabledLayerNames     unsafe.Pointer
	enabledExtensionCount   uint32
	ppEnabledExtensionNames unsafe.Pointer
	pEnabledFeatures        unsafe.Pointer
}

type bufferCreateInfo struct {
	sType                 uint32
	pNext                 unsafe.Pointer
	flags                 uint32
	size                  uint64
	usage                 uint32
	sharingMode           uint32
	queueFamilyIndexCount uint32
	pQueueFamilyIndices   unsafe.Pointer
}

type memoryRequirements struct {
	size           uint64
	alignment      uint64
	memoryTypeBits uint32
}

type memoryAllocateInfo struct {
	sType           uint32
	pNext           unsafe.Pointer
	allocationSize  uint64
	memoryTypeIndex uint32
}

type shaderModuleCreateInfo struct {
	sType    uint32
	pNext    unsafe.Pointer
	flags    uint32
	codeSize uintptr
	pCode    *uint32
}

type descriptorSetLayoutBinding struct {
	binding            uint32
	descriptorType     uint32
	descriptorCount    uint32
	stageFlags         uint32
	pImmutableSamplers unsafe.Pointer
}

type descriptorSetLayoutCreateInfo struct {
	sType        uint32
	pNext        unsafe.Pointer
	flags        uint32
	bindingCount uint32
	pBindings    *descriptorSetLayoutBinding
}

type pushConstantRange struct {
	stageFlags uint32
	offset     uint32
	size       uint32
}

type pipelineLayoutCreateInfo struct {
	sType                  uint32
	pNext                  unsafe.Pointer
	flags                  uint32
	setLayoutCount         uint32
	pSetLayouts            *handle
	pushConstantRangeCount uint32
	pPushConstantRanges    *pushConstantRange
}

type pipelineShaderStageCreateInfo struct {
	sType               uint32
	pNext               unsafe.Pointer
	flags               uint32
	stage               uint32
	module              handle
	pName               *byte
	pSpecializationInfo unsafe.Pointer
}

type computePipelineCreateInfo struct {
	sType              uint32
	pNext              unsafe.Pointer
	flags              uint32
	stage              pipelineShaderStageCreateInfo
	layout             handle
	basePipelineHandle handle
	basePipelineIndex  int32
}

type descriptorPoolSize struct {
	typ   uint32
	count uint32
}

type descriptorPoolCreateInfo struct {
	sType         uint32
	pNext         unsafe.Pointer
	flags         uint32
	maxSets       uint32
	poolSizeCount uint32
	pPoolSizes    *descriptorPoolSize
}

type descriptorSetAllocateInfo struct {
	sType              uint32
	pNext              unsafe.Pointer
	descriptorPool     handle
	descriptorSetCount uint32
	pSetLayouts        *handle
}

type descriptorBufferInfo struct {
	buffer handle
	offset uint64
	rng    uint64
}

type writeDescriptorSet struct {
	sType            uint32
	pNext            unsafe.Pointer
	dstSet           handle
	dstBinding       uint32
	dstArrayElement  uint32
	descriptorCount  uint32
	descriptorType   uint32
	pImageInfo       unsafe.Pointer
	pBufferInfo      *descriptorBufferInfo
	pTexelBufferView unsafe.Pointer
}

type commandPoolCreateInfo struct {
	sType            uint32
	pNext            unsafe.Pointer
	flags            uint32
	queueFamilyIndex uint32
}

type commandBufferAllocateInfo struct {
	sType              uint32
	pNext              unsafe.Pointer
	commandPool        handle
	level              uint32
	commandBufferCount uint32
}

type commandBufferBeginInfo struct {
	sType            uint32
	pNext            unsafe.Pointer
	flags            uint32
	pInheritanceInfo unsafe.Pointer
}

type memoryBarrier struct {
	sType         uint32
	pNext         unsafe.Pointer
	srcAccessMask uint32
	dstAccessMask uint32
}

type bufferCopy struct {
	srcOffset uint64
	dstOffset uint64
	size      uint64
}

type submitInfo struct {
	sType                uint32
	pNext                unsafe.Pointer
	waitSemaphoreCount   uint32
	pWaitSemaphores      unsafe.Pointer
	pWaitDstStageMask    unsafe.Pointer
	commandBufferCount   uint32
	pCommandBuffers      *handle
	signalSemaphoreCount uint32
	pSignalSemaphores    unsafe.Pointer
}

type fenceCreateInfo struct {
	sType uint32
	pNext unsafe.Pointer
	flags uint32
}

// queueFamilyProperties is VkQueueFamilyProperties.
type queueFamilyProperties struct {
	queueFlags                  uint32
	queueCount                  uint32
	timestampValidBits          uint32
	minImageTransferGranularity [3]uint32
}

// memoryProperties is VkPhysicalDeviceMemoryProperties.
type memoryProperties struct {
	memoryTypeCount uint32
	memoryTypes     [32]struct{ propertyFlags, heapIndex uint32 }
	memoryHeapCount uint32
	memoryHeaps     [16]struct {
		size  uint64
		flags uint32
	}
}

// physicalDeviceProperties is VkPhysicalDeviceProperties, of which the device reads the header
// and two limits; the rest (VkPhysicalDeviceLimits and sparse properties, 824 bytes in all) is
// kept as bytes at the offsets the C layout gives them.
type physicalDeviceProperties struct {
	apiVersion        uint32
	driverVersion     uint32
	vendorID          uint32
	deviceID          uint32
	deviceType        uint32
	deviceName        [256]byte
	pipelineCacheUUID [16]uint8
	_                 [4]byte   // VkPhysicalDeviceLimits is 8-aligned
	limits            [504]byte // VkPhysicalDeviceLimits, at offset 296
	sparse            [5]uint32
	_                 [4]byte
}

// Offsets into VkPhysicalDeviceLimits.
const (
	limitMaxStorageBufferRange = 28
	limitMaxPushConstantsSize  = 32
	limitMaxComputeInvocations = 232
)

func (p *physicalDeviceProperties) limit(off int) uint32 {
	return *(*uint32)(unsafe.Pointer(&p.limits[off]))
}

// extensionProperties is VkExtensionProperties.
type extensionProperties struct {
	name        [256]byte
	specVersion uint32
}

// Sizes the C headers give, checked at init against the Go layouts.
var layoutChecks = []struct {
	name      string
	got, want uintptr
}{
	{"VkApplicationInfo", unsafe.Sizeof(applicationInfo{}), 48},
	{"VkInstanceCreateInfo", unsafe.Sizeof(instanceCreateInfo{}), 64},
	{"VkDeviceQueueCreateInfo", unsafe.Sizeof(deviceQueueCreateInfo{}), 40},
	{"VkDeviceCreateInfo", unsafe.Sizeof(deviceCreateInfo{}), 72},
	{"VkBufferCreateInfo", unsafe.Sizeof(bufferCreateInfo{}), 56},
	{"VkMemoryRequirements", unsafe.Sizeof(memoryRequirements{}), 24},
	{"VkMemoryAllocateInfo", unsafe.Sizeof(memoryAllocateInfo{}), 32},
	{"VkShaderModuleCreateInfo", unsafe.Sizeof(shaderModuleCreateInfo{}), 40},
	{"VkDescriptorSetLayoutBinding", unsafe.Sizeof(descriptorSetLayoutBinding{}), 24},
	{"VkDescriptorSetLayoutCreateInfo", unsafe.Sizeof(descriptorSetLayoutCreateInfo{}), 32},
	{"VkPipelineLayoutCreateInfo", unsafe.Sizeof(pipelineLayoutCreateInfo{}), 48},
	{"VkPipelineShaderStageCreateInfo", unsafe.Sizeof(pipelineShaderStageCreateInfo{}), 48},
	{"VkComputePipelineCreateInfo", unsafe.Sizeof(computePipelineCreateInfo{}), 96},
	{"VkDescriptorPoolCreateInfo", unsafe.Sizeof(descriptorPoolCreateInfo{}), 40},
	{"VkDescriptorSetAllocateInfo", unsafe.Sizeof(descriptorSetAllocateInfo{}), 40},
	{"VkWriteDescriptorSet", unsafe.Sizeof(writeDescriptorSet{}), 64},
	{"VkCommandBufferAllocateInfo", unsafe.Sizeof(commandBufferAllocateInfo{}), 32},
	{"VkCommandBufferBeginInfo", unsafe.Sizeof(commandBufferBeginInfo{}), 32},
	{"VkMemoryBarrier", unsafe.Sizeof(memoryBarrier{}), 24},
	{"VkSubmitInfo", unsafe.Sizeof(submitInfo{}), 72},
	{"VkPhysicalDeviceMemoryProperties", unsafe.Sizeof(memoryProperties{}), 520},
	{"VkPhysicalDeviceProperties", unsafe.Sizeof(physicalDeviceProperties{}), 824},
	{"VkQueueFamilyProperties", unsafe.Sizeof(queueFamilyProperties{}), 24},
	{"VkExtensionProperties", unsafe.Sizeof(extensionProperties{}), 260},
}

func checkLayouts() error {
	if unsafe.Sizeof(uintptr(0)) != 8 {
		return fmt.Errorf("vulkan: only 64-bit targets are supported")
	}
	for _, c := range layoutChecks {
		if c.got != c.want {
			return fmt.Errorf("vulkan: %s is %d bytes in Go, %d in C", c.name, c.got, c.want)
		}
	}
	if off := unsafe.Offsetof(physicalDeviceProperties{}.limits); off != 296 {
		return fmt.Errorf("vulkan: VkPhysicalDeviceLimits at offset %d, want 296", off)
	}
	return nil
}

// instanceFuncs are resolved with vkGetInstanceProcAddr (a nil instance for CreateInstance),
// deviceFuncs with vkGetDeviceProcAddr; each field is named after its function without "vk".
type instanceFuncs struct {
	CreateInstance                         uintptr
	DestroyInstance                        uintptr
	EnumeratePhysicalDevices               uintptr
	GetPhysicalDeviceProperties            uintptr
	GetPhysicalDeviceMemoryProperties      uintptr
	GetPhysicalDeviceQueueFamilyProperties uintptr
	EnumerateDeviceExtensionProperties     uintptr
	CreateDevice                           uintptr
	GetDeviceProcAddr                      uintptr
}

type deviceFuncs struct {
	DestroyDevice               uintptr
	GetDeviceQueue              uintptr
	DeviceWaitIdle              uintptr
	CreateBuffer                uintptr
	DestroyBuffer               uintptr
	GetBufferMemoryRequirements uintptr
	AllocateMemory              uintptr
	FreeMemory                  uintptr
	BindBufferMemory            uintptr
	MapMemory                   uintptr
	CreateShaderModule          uintptr
	DestroyShaderModule         uintptr
	CreateDescriptorSetLayout   uintptr
	DestroyDescriptorSetLayout  uintptr
	CreatePipelineLayout        uintptr
	DestroyPipelineLayout       uintptr
	CreateComputePipelines      uintptr
	DestroyPipeline             uintptr
	CreateDescriptorPool        uintptr
	DestroyDescriptorPool       uintptr
	AllocateDescriptorSets      uintptr
	FreeDescriptorSets          uintptr
	UpdateDescriptorSets        uintptr
	CreateCommandPool           uintptr
	DestroyCommandPool          uintptr
	AllocateCommandBuffers      uintptr
	BeginCommandBuffer          uintptr
	EndCommandBuffer            uintptr
	ResetCommandBuffer          uintptr
	CmdBindPipeline             uintptr
	CmdBindDescriptorSets       uintptr
	CmdPushConstants            uintptr
	CmdDispatch                 uintptr
	CmdPipelineBarrier          uintptr
	CmdCopyBuffer               uintptr
	CmdFillBuffer               uintptr
	QueueSubmit                 uintptr
	CreateFence                 uintptr
	DestroyFence                uintptr
	WaitForFences               uintptr
	ResetFences                 uintptr
}

// resolve fills every field of table (a pointer to a struct of uintptr) with get("vk"+name),
// failing on the first missing function.
func resolve(table any, get func(name string) uintptr) error {
	v := reflect.ValueOf(table).Elem()
	for i := range v.NumField() {
		name := "vk" + v.Type().Field(i).Name
		p := get(name)
		if p == 0 {
			return fmt.Errorf("vulkan: the loader has no %s", name)
		}
		v.Field(i).SetUint(uint64(p))
	}
	return nil
}

// cstr returns s as a NUL-terminated C string in Go memory.
func cstr(s string) *byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return &b[0]
}

// gostr returns the NUL-terminated string in b.
func gostr(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// check turns a VkResult into an error naming what was being done.
func check(r uintptr, what string) error {
	if res := vkResult(int32(r)); res < 0 {
		return fmt.Errorf("vulkan: %s: %w", what, res)
	}
	return nil
}
