package vulkan

import (
	"embed"
	"fmt"
	"time"
	"unsafe"
)

// Batching: ops record into one command buffer, which is submitted only when the host needs a
// value (Read, CrossEntropyForward, SquaredNorms) or the staging buffer is full, and then waited
// for with a fence. Between commands the device puts a global memory barrier only where a
// command touches bytes that one since the last barrier wrote (or writes bytes one read), so
// independent dispatches (AdamW over many tensors, the per-tensor sums of SquaredNorms) overlap
// on the GPU, and dependent ones see each other's results.

//go:embed spv/*.spv
var spirv embed.FS

// kernelBindings is the number of storage buffers each kernel binds.
var kernelBindings = map[string]int{
	"matmul_nn": 3, "matmul_nt": 3, "matmul_tn": 3,
	"add_inplace": 2, "bias_add": 2, "encoder_forward": 4,
	"encoder_backward_wpe": 2, "encoder_backward_wte": 3,
	"layernorm_forward": 6, "layernorm_backward_input": 6, "layernorm_params_partial": 7,
	"colsum_partial": 3, "colsum_combine": 2,
	"gelu_forward": 3, "gelu_backward": 4, "adamw": 4, "adamw_slab": 5,
	"softmax_rows": 1, "attention_softmax": 1, "attention_softmax_backward": 2,
	"crossentropy_forward": 3, "crossentropy_backward": 2, "sumsq": 2,
	"topk_gate": 3, "gate_rows": 3, "gate_grad": 4, "moe_stats": 3, "aux_grad": 2, "softmax_backward_rows": 3,
}

// setKey names a descriptor set: the blocks bound at bindings 0…n-1.
type setKey struct {
	n    int
	bufs [maxBindings]handle
}

// descSet is a cached descriptor set and the pool it came from.
type descSet struct {
	set, pool handle
}

func (d *Device) createLayouts() error {
	for n := 1; n <= maxBindings; n++ {
		binds := make([]descriptorSetLayoutBinding, n)
		for i := range binds {
			binds[i] = descriptorSetLayoutBinding{binding: uint32(i), descriptorType: descriptorStorageBuffer, descriptorCount: 1, stageFlags: shaderStageCompute}
		}
		lci := &descriptorSetLayoutCreateInfo{sType: stDescriptorSetLayoutCreate, bindingCount: uint32(n), pBindings: &binds[0]}
		if err := check(call(d.fn.CreateDescriptorSetLayout, uintptr(d.dev), uintptr(unsafe.Pointer(lci)), 0, uintptr(unsafe.Pointer(&d.layouts[n]))), "create descriptor set layout"); err != nil {
			return err
		}
		pc := &pushConstantRange{stageFlags: shaderStageCompute, size: pushBytes}
		plci := &pipelineLayoutCreateInfo{sType: stPipelineLayoutCreateInfo, setLayoutCount: 1, pSetLayouts: &d.layouts[n], pushConstantRangeCount: 1, pPushConstantRanges: pc}
		if err := check(call(d.fn.CreatePipelineLayout, uintptr(d.dev), uintptr(unsafe.Pointer(plci)), 0, uintptr(unsafe.Pointer(&d.pipeLayouts[n]))), "create pipeline layout"); err != nil {
			return err
		}
	}
	return nil
}

// pipeline returns the compute pipeline of a kernel, building it on first use: drivers compile
// SPIR-V to machine code here (tens of milliseconds each on lavapipe), so a device pays only for
// the kernels it runs.
func (d *Device) pipeline(name string) (handle, error) {
	if p, ok := d.pipelines[name]; ok {
		return p, nil
	}
	code, err := spirv.ReadFile("spv/" + name + ".spv")
	if err != nil || len(code)%4 != 0 {
		return 0, fmt.Errorf("vulkan: kernel %s: no SPIR-V (run go generate ./vulkan/)", name)
	}
	words := make([]uint32, len(code)/4)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), len(code)), code)
	smci := &shaderModuleCreateInfo{sType: stShaderModuleCreateInfo, codeSize: uintptr(len(code)), pCode: &words[0]}
	var mod handle
	if err := check(call(d.fn.CreateShaderModule, uintptr(d.dev), uintptr(unsafe.Pointer(smci)), 0, uintptr(unsafe.Pointer(&mod))), "create shader module "+name); err != nil {
		return 0, err
	}
	defer call(d.fn.DestroyShaderModule, uintptr(d.dev), uintptr(mod), 0)
	cpci := &computePipelineCreateInfo{
		sType:  stComputePipelineCreateInfo,
		stage:  pipelineShaderStageCreateInfo{sType: stPipelineShaderStageCreate, stage: shaderStageCompute, module: mod, pName: cstr("main")},
		layout: d.pipeLayouts[kernelBindings[name]], basePipelineIndex: -1,
	}
	var p handle
	if err := check(call(d.fn.CreateComputePipelines, uintptr(d.dev), 0, 1, uintptr(unsafe.Pointer(cpci)), 0, uintptr(unsafe.Pointer(&p))), "create pipeline "+name); err != nil {
		return 0, err
	}
	d.pipelines[name] = p
	return p, nil
}

// descriptorSet returns the set binding the given blocks, from the cache or newly written.
func (d *Device) descriptorSet(bufs []handle) (handle, error) {
	k := setKey{n: len(bufs)}
	copy(k.bufs[:], bufs)
	if s, ok := d.sets[k]; ok {
		return s.set, nil
	}
	var set handle
	for attempt := 0; ; attempt++ {
		if len(d.pools) > 0 {
			dsai := &descriptorSetAllocateInfo{sType: stDescriptorSetAllocateInfo, descriptorPool: d.pools[len(d.pools)-1], descriptorSetCount: 1, pSetLayouts: &d.layouts[k.n]}
			if r := call(d.fn.AllocateDescriptorSets, uintptr(d.dev), uintptr(unsafe.Pointer(dsai)), uintptr(unsafe.Pointer(&set))); check(r, "") == nil {
				break
			} else if attempt > 0 {
				return 0, check(r, "allocate descriptor set")
			}
		}
		// The pool is full (or there is none yet): another.
		size := &descriptorPoolSize{typ: descriptorStorageBuffer, count: 256 * maxBindings}
		dpci := &descriptorPoolCreateInfo{sType: stDescriptorPoolCreateInfo, flags: descriptorPoolFreeSet, maxSets: 256, poolSizeCount: 1, pPoolSizes: size}
		var pool handle
		if err := check(call(d.fn.CreateDescriptorPool, uintptr(d.dev), uintptr(unsafe.Pointer(dpci)), 0, uintptr(unsafe.Pointer(&pool))), "create descriptor pool"); err != nil {
			return 0, err
		}
		d.pools = append(d.pools, pool)
	}
	infos := make([]descriptorBufferInfo, k.n)
	writes := make([]writeDescriptorSet, k.n)
	for i := range infos {
		infos[i] = descriptorBufferInfo{buffer: bufs[i], rng: wholeSize}
		writes[i] = writeDescriptorSet{sType: stWriteDescriptorSet, dstSet: set, dstBinding: uint32(i), descriptorCount: 1, descriptorType: descriptorStorageBuffer, pBufferInfo: &infos[i]}
	}
	call(d.fn.UpdateDescriptorSets, uintptr(d.dev), uintptr(k.n), uintptr(unsafe.Pointer(&writes[0])), 0, 0)
	d.sets[k] = descSet{set, d.pools[len(d.pools)-1]}
	return set, nil
}

// cmdBuf returns the command buffer, begun.
func (d *Device) cmdBuf() handle {
	if !d.recording {
		bi := &commandBufferBeginInfo{sType: stCommandBufferBeginInfo, flags: commandBufferOneTime}
		if err := check(call(d.fn.BeginCommandBuffer, uintptr(d.cmd), uintptr(unsafe.Pointer(bi))), "begin command buffer"); err != nil {
			d.fail(err)
		}
		d.recording = true
	}
	return d.cmd
}

// access records that the next command reads and writes the given ranges, putting a barrier
// before it when it depends on (or overwrites what is read by) a command since the last one.
func (d *Device) access(reads, writes []span3) {
	hazard := false
	for _, w := range writes {
		hazard = hazard || overlaps(w, d.writes) || overlaps(w, d.reads)
	}
	for _, r := range reads {
		hazard = hazard || overlaps(r, d.writes)
	}
	if hazard {
		d.barrier(stageCompute|stageTransfer, accessShaderWrite|accessTransferWrite,
			stageCompute|stageTransfer, accessShaderRead|accessShaderWrite|accessTransferRead|accessTransferWrite)
		d.reads, d.writes = d.reads[:0], d.writes[:0]
	}
	d.reads = append(d.reads, reads...)
	d.writes = append(d.writes, writes...)
}

func overlaps(s span3, list []span3) bool {
	for _, x := range list {
		if x.buf == s.buf && x.lo < s.hi && s.lo < x.hi {
			return true
		}
	}
	return false
}

func (d *Device) barrier(srcStage, srcAccess, dstStage, dstAccess uint32) {
	mb := &memoryBarrier{sType: stMemoryBarrier, srcAccessMask: srcAccess, dstAccessMask: dstAccess}
	call(d.fn.CmdPipelineBarrier, uintptr(d.cmdBuf()), uintptr(srcStage), uintptr(dstStage), 0, 1, uintptr(unsafe.Pointer(mb)), 0, 0, 0, 0)
	d.barriers++
}

// submit ends the batch, submits it and waits for it: the device's one wait.
func (d *Device) submit() {
	cmd := d.cmdBuf()
	// What the batch wrote becomes visible to the host (Read's copy into staging).
	d.barrier(stageCompute|stageTransfer, accessShaderWrite|accessTransferWrite, stageHost, accessHostRead)
	d.recording = false
	d.reads, d.writes = d.reads[:0], d.writes[:0]
	d.stagingUsed = 0
	d.waits++
	if err := check(call(d.fn.EndCommandBuffer, uintptr(cmd)), "end command buffer"); err != nil {
		d.fail(err)
		return
	}
	cmds := &[1]handle{cmd}
	si := &submitInfo{sType: stSubmitInfo, commandBufferCount: 1, pCommandBuffers: &cmds[0]}
	if err := check(call(d.fn.QueueSubmit, uintptr(d.q), 1, uintptr(unsafe.Pointer(si)), uintptr(d.fence)), "submit"); err != nil {
		d.fail(err)
		return
	}
	fences := &[1]handle{d.fence}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		r := vkResult(int32(call(d.fn.WaitForFences, uintptr(d.dev), 1, uintptr(unsafe.Pointer(&fences[0])), 1, uintptr(time.Second))))
		if r == vkSuccess {
			break
		}
		if r != vkTimeout || time.Now().After(deadline) {
			d.fail(fmt.Errorf("vulkan: wait for the device: %w", r))
			return
		}
	}
	call(d.fn.ResetFences, uintptr(d.dev), 1, uintptr(unsafe.Pointer(&fences[0])))
	call(d.fn.ResetCommandBuffer, uintptr(cmd), 0)
	d.reap()
}

// arg is one storage buffer of a dispatch: a tensor view and whether the kernel writes it.
type arg struct {
	b *buffer
	w bool
}

func in(b *buffer) arg  { return arg{b: b} }
func out(b *buffer) arg { return arg{b: b, w: true} }

// dispatch records one kernel launch over a grid of workgroups, with push constants pc.
func (d *Device) dispatch(kernel string, args []arg, pc []uint32, gx, gy, gz int) {
	if d.err != nil || gx == 0 || gy == 0 || gz == 0 {
		return
	}
	if len(args) != kernelBindings[kernel] || len(pc)*4 > pushBytes {
		panic(fmt.Sprintf("vulkan: %s: %d buffers and %d push constants", kernel, len(args), len(pc)))
	}
	p, err := d.pipeline(kernel)
	if err != nil {
		d.fail(err)
		return
	}
	var bufs [maxBindings]handle
	var reads, writes []span3
	for i, a := range args {
		if a.b.a.freed {
			panic("vulkan: " + kernel + ": a buffer used after Free")
		}
		bufs[i] = a.b.a.blk.buf
		if a.w {
			writes = append(writes, a.b.byteRange())
		} else {
			reads = append(reads, a.b.byteRange())
		}
	}
	set, err := d.descriptorSet(bufs[:len(args)])
	if err != nil {
		d.fail(err)
		return
	}
	d.access(reads, writes)
	cmd := uintptr(d.cmdBuf())
	layout := d.pipeLayouts[len(args)]
	call(d.fn.CmdBindPipeline, cmd, bindPointCompute, uintptr(p))
	sets := &[1]handle{set}
	call(d.fn.CmdBindDescriptorSets, cmd, bindPointCompute, uintptr(layout), 0, 1, uintptr(unsafe.Pointer(&sets[0])), 0, 0)
	if len(pc) > 0 {
		call(d.fn.CmdPushConstants, cmd, uintptr(layout), shaderStageCompute, 0, uintptr(len(pc)*4), uintptr(unsafe.Pointer(&pc[0])))
	}
	call(d.fn.CmdDispatch, cmd, uintptr(gx), uintptr(gy), uintptr(gz))
}

// maxGroups is the guaranteed minimum of maxComputeWorkGroupCount in each dimension.
const maxGroups = 65535

// grid spreads groups workgroups over a 2-D grid (kernels recover the index with group_index).
func grid(groups int) (gx, gy int) {
	if groups <= maxGroups {
		return groups, 1
	}
	return maxGroups, (groups + maxGroups - 1) / maxGroups
}

// flat launches kernel with one invocation per element of n (256 per workgroup).
func (d *Device) flat(kernel string, n int, args []arg, pc ...uint32) {
	gx, gy := grid((n + wg - 1) / wg)
	d.dispatch(kernel, args, pc, gx, gy, 1)
}

// rows launches kernel with one workgroup per row.
func (d *Device) rows(kernel string, rows int, args []arg, pc ...uint32) {
	gx, gy := grid(rows)
	d.dispatch(kernel, args, pc, gx, gy, 1)
}

// wg is common.glsl's WG.
const wg = 256
