package vulkan

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"github.com/shoal-ml/shoal/model"
)

// Device is a model.Device (and model.NormDevice) on one Vulkan device. Its ops record commands
// and return; Read, CrossEntropyForward and SquaredNorms submit what is recorded and wait. It is
// safe for use by several goroutines, which it serialises. A Vulkan error during an op is kept
// (Err) and makes the ops that follow do nothing, since the Device interface has no error
// returns: a caller checks Err after a step.
type Device struct {
	mu   sync.Mutex
	info Info
	in   *instance
	fn   deviceFuncs
	pd   handle
	dev  handle
	q    handle

	deviceMem, stagingMem uint32 // memory type indices
	blockSize             int64  // bytes of an ordinary memory block
	maxRange              int64  // maxStorageBufferRange: the largest block a shader can bind

	cmdPool, cmd, fence handle
	recording           bool

	layouts     [maxBindings + 1]handle // descriptor set layout by number of storage buffers
	pipeLayouts [maxBindings + 1]handle
	pipelines   map[string]handle
	pools       []handle // descriptor pools, the last one allocated from
	sets        map[setKey]descSet

	blocks []*block
	dying  []*block // freed blocks, destroyed after the commands that may use them have run
	// tensorBytes is the device-local memory of the tensor blocks, the dying ones included;
	// limit, when > 0, caps it (SetMemoryLimit).
	tensorBytes, limit int64

	staging       *block // host-visible, mapped: every Write and Read passes through it
	stagingPtr    unsafe.Pointer
	stagingUsed   int64
	reads, writes []span3 // ranges accessed since the last barrier (hazard tracking)
	scratch       map[string]*buffer
	waits         int
	barriers      int     // for tests of the hazard tracking
	adam          adamRun // AdamW calls over consecutive tensors, not dispatched yet (flushAdam)
	adamDispatch  int     // AdamW dispatches recorded, for tests
	err           error
}

var (
	_ model.Device     = (*Device)(nil)
	_ model.NormDevice = (*Device)(nil)
)

// ErrClosed is returned by Err after Close.
var ErrClosed = errors.New("vulkan: device closed")

// maxBindings is the most storage buffers a kernel binds (layernorm_params_partial's 7; the
// guaranteed minimum of maxPerStageDescriptorStorageBuffers is 4, but every desktop and mobile
// GPU driver offers far more).
const maxBindings = 8

// pushBytes is the push-constant block every pipeline layout declares: the guaranteed minimum
// of maxPushConstantsSize.
const pushBytes = 128

// Open opens the device Devices lists at index.
func Open(index int) (*Device, error) {
	in, err := newInstance()
	if err != nil {
		return nil, err
	}
	d := &Device{in: in, pipelines: map[string]handle{}, sets: map[setKey]descSet{}, scratch: map[string]*buffer{}}
	if err := d.open(index); err != nil {
		d.destroy()
		return nil, err
	}
	return d, nil
}

func (d *Device) open(index int) error {
	in := d.in
	pds, err := in.physicalDevices()
	if err != nil {
		return err
	}
	if index < 0 || index >= len(pds) {
		return fmt.Errorf("vulkan: no device %d (%d devices)", index, len(pds))
	}
	d.pd = pds[index]
	d.info = in.info(index, d.pd)
	props := in.properties(d.pd)
	if props.limit(limitMaxPushConstantsSize) < pushBytes {
		return fmt.Errorf("vulkan: %s: push constants of %d bytes, want %d", d.info.Name, props.limit(limitMaxPushConstantsSize), pushBytes)
	}
	if n := props.limit(limitMaxComputeInvocations); n < wg {
		return fmt.Errorf("vulkan: %s: workgroups of at most %d invocations, the kernels use %d", d.info.Name, n, wg)
	}
	d.maxRange = int64(props.limit(limitMaxStorageBufferRange)) &^ 255
	d.blockSize = min(64<<20, d.maxRange)

	// A queue family that computes.
	var nf uint32
	call(in.fn.GetPhysicalDeviceQueueFamilyProperties, uintptr(d.pd), uintptr(unsafe.Pointer(&nf)), 0)
	fams := make([]queueFamilyProperties, max(nf, 1))
	call(in.fn.GetPhysicalDeviceQueueFamilyProperties, uintptr(d.pd), uintptr(unsafe.Pointer(&nf)), uintptr(unsafe.Pointer(&fams[0])))
	family := -1
	for i, f := range fams[:nf] {
		if f.queueFlags&queueCompute != 0 && f.queueCount > 0 {
			family = i
			break
		}
	}
	if family < 0 {
		return fmt.Errorf("vulkan: %s has no compute queue", d.info.Name)
	}

	prio := new(float32)
	*prio = 1
	qci := &deviceQueueCreateInfo{sType: stDeviceQueueCreateInfo, queueFamilyIndex: uint32(family), queueCount: 1, pQueuePriorities: prio}
	dci := &deviceCreateInfo{sType: stDeviceCreateInfo, queueCreateInfoCount: 1, pQueueCreateInfos: qci}
	if slices.Contains(in.deviceExtensions(d.pd), "VK_KHR_portability_subset") {
		// A portability implementation (MoltenVK) must be told that its limits are understood.
		exts := &[1]*byte{cstr("VK_KHR_portability_subset")}
		dci.enabledExtensionCount = 1
		dci.ppEnabledExtensionNames = unsafe.Pointer(exts)
	}
	if err := check(call(in.fn.CreateDevice, uintptr(d.pd), uintptr(unsafe.Pointer(dci)), 0, uintptr(unsafe.Pointer(&d.dev))), "create device"); err != nil {
		return err
	}
	gdpa := in.fn.GetDeviceProcAddr
	if err := resolve(&d.fn, func(name string) uintptr {
		return call(gdpa, uintptr(d.dev), uintptr(unsafe.Pointer(cstr(name))))
	}); err != nil {
		return err
	}
	call(d.fn.GetDeviceQueue, uintptr(d.dev), uintptr(family), 0, uintptr(unsafe.Pointer(&d.q)))

	if err := d.chooseMemory(in.memoryProperties(d.pd)); err != nil {
		return err
	}
	pci := &commandPoolCreateInfo{sType: stCommandPoolCreateInfo, flags: commandPoolResetBuffer, queueFamilyIndex: uint32(family)}
	if err := check(call(d.fn.CreateCommandPool, uintptr(d.dev), uintptr(unsafe.Pointer(pci)), 0, uintptr(unsafe.Pointer(&d.cmdPool))), "create command pool"); err != nil {
		return err
	}
	cai := &commandBufferAllocateInfo{sType: stCommandBufferAllocateInfo, commandPool: d.cmdPool, commandBufferCount: 1}
	if err := check(call(d.fn.AllocateCommandBuffers, uintptr(d.dev), uintptr(unsafe.Pointer(cai)), uintptr(unsafe.Pointer(&d.cmd))), "allocate command buffer"); err != nil {
		return err
	}
	fci := &fenceCreateInfo{sType: stFenceCreateInfo}
	if err := check(call(d.fn.CreateFence, uintptr(d.dev), uintptr(unsafe.Pointer(fci)), 0, uintptr(unsafe.Pointer(&d.fence))), "create fence"); err != nil {
		return err
	}
	if err := d.createLayouts(); err != nil {
		return err
	}
	return d.growStaging(16 << 20)
}

// chooseMemory picks the memory type of the tensors (device-local) and of the staging buffer
// (host-visible and coherent, cached when there is such a type, since Read copies out of it).
func (d *Device) chooseMemory(mp *memoryProperties) error {
	n := min(int(mp.memoryTypeCount), len(mp.memoryTypes))
	pick := func(want, prefer uint32) int {
		best := -1
		for i := range n {
			f := mp.memoryTypes[i].propertyFlags
			if f&want != want {
				continue
			}
			if best < 0 || f&prefer == prefer && mp.memoryTypes[best].propertyFlags&prefer != prefer {
				best = i
			}
		}
		return best
	}
	dm := pick(memDeviceLocal, 0)
	if dm < 0 {
		dm = pick(0, 0)
	}
	sm := pick(memHostVisible|memHostCoherent, memHostCached)
	if dm < 0 || sm < 0 {
		return fmt.Errorf("vulkan: %s: no usable memory type", d.info.Name)
	}
	d.deviceMem, d.stagingMem = uint32(dm), uint32(sm)
	return nil
}

// Info describes the device.
func (d *Device) Info() Info { return d.info }

// Err returns the first error the device met (an op that failed to record or a submission that
// failed), or nil.
func (d *Device) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

// Waits returns how many times the device has waited for the GPU: one per Read,
// CrossEntropyForward or SquaredNorms, and one more whenever a Write did not fit the staging
// buffer beside what was already queued.
func (d *Device) Waits() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.waits
}

func (d *Device) fail(err error) {
	if d.err == nil && err != nil {
		d.err = err
	}
}

// Close waits for the device and releases everything it holds; the Device and its buffers must
// not be used afterwards.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flushAdam()
	if d.dev != 0 && d.recording {
		d.submit()
	}
	err := d.err
	d.destroy()
	if d.err == nil {
		d.err = ErrClosed
	}
	return err
}

func (d *Device) destroy() {
	if d.dev != 0 {
		call(d.fn.DeviceWaitIdle, uintptr(d.dev))
		for _, p := range d.pipelines {
			call(d.fn.DestroyPipeline, uintptr(d.dev), uintptr(p), 0)
		}
		for _, p := range d.pools {
			call(d.fn.DestroyDescriptorPool, uintptr(d.dev), uintptr(p), 0)
		}
		for i := range d.layouts {
			if d.pipeLayouts[i] != 0 {
				call(d.fn.DestroyPipelineLayout, uintptr(d.dev), uintptr(d.pipeLayouts[i]), 0)
			}
			if d.layouts[i] != 0 {
				call(d.fn.DestroyDescriptorSetLayout, uintptr(d.dev), uintptr(d.layouts[i]), 0)
			}
		}
		for _, b := range append(append(d.blocks, d.dying...), d.staging) {
			if b != nil {
				d.destroyBlock(b)
			}
		}
		if d.fence != 0 {
			call(d.fn.DestroyFence, uintptr(d.dev), uintptr(d.fence), 0)
		}
		if d.cmdPool != 0 {
			call(d.fn.DestroyCommandPool, uintptr(d.dev), uintptr(d.cmdPool), 0)
		}
		call(d.fn.DestroyDevice, uintptr(d.dev), 0)
	}
	d.dev, d.blocks, d.dying, d.staging, d.pipelines, d.pools, d.sets = 0, nil, nil, nil, nil, nil, nil
	if d.in != nil {
		d.in.destroy()
	}
}
