//go:build js && wasm

package webgpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"syscall/js"

	"github.com/shoal-ml/shoal/kernels/wgsl"
)

// ensureEncoder starts a command encoder for the next batch of work.
func (d *Device) ensureEncoder() {
	if d.encoder.IsUndefined() {
		d.encoder = d.device.Call("createCommandEncoder")
	}
}

// endPass closes the open compute pass (copies cannot be recorded inside one), leaving the
// encoder open.
func (d *Device) endPass() {
	d.ensureEncoder()
	if d.passOpen {
		d.pass.Call("end")
		d.pass = js.Undefined()
		d.passOpen = false
	}
}

// submit sends the recorded work to the queue: the parameter arena first (a queue write, so it
// lands before the commands that read it and after the previous batch that read its old
// contents), then the command buffer.
func (d *Device) submit() {
	if d.encoder.IsUndefined() {
		return
	}
	d.endPass()
	if d.arenaUsed > 0 {
		n := d.arenaUsed * paramSlot
		js.CopyBytesToJS(d.arenaJS, d.arenaBytes[:n])
		d.queue.Call("writeBuffer", d.arena, 0, d.arenaJS, 0, n)
		d.arenaUsed = 0
	}
	cb := d.encoder.Call("finish")
	d.encoder = js.Undefined()
	d.queue.Call("submit", []any{cb})
}

// dispatch records one dispatch of pipeline name over the tensors (in the kernel's binding order)
// with the kernel's own parameters (after the per-binding offsets, which dispatch fills in), on
// a grid of gx×gy×gz workgroups.
func (d *Device) dispatch(name string, tensors []*Tensor, params []uint32, gx, gy, gz int) {
	p := d.pipelineFor(name)
	if p == nil {
		panic("webgpu: no pipeline " + name)
	}
	k := p.kernel
	if len(tensors) != len(k.Bindings) || len(tensors)+len(params) != k.ParamWords() {
		panic(fmt.Sprintf("webgpu: %s takes %d tensors and %d parameters, got %d and %d",
			name, len(k.Bindings), len(k.Params), len(tensors), len(params)))
	}
	for i, t := range tensors {
		if t.buf.released {
			panic(fmt.Errorf("%w (%s)", ErrReleased, name))
		}
		if t.buf.elem != k.Bindings[i].Elem {
			panic(fmt.Sprintf("webgpu: %s: %s is a %s tensor, the kernel reads %s", name, k.Bindings[i].Name, t.buf.elem, k.Bindings[i].Elem))
		}
	}
	if gx == 0 || gy == 0 || gz == 0 {
		return
	}
	if gx > d.maxGroups || gy > d.maxGroups || gz > d.maxGroups {
		panic(fmt.Sprintf("webgpu: %s: %d×%d×%d workgroups, the adapter allows %d per dimension", name, gx, gy, gz, d.maxGroups))
	}
	var bound [wgsl.MaxStorageBuffers]*Tensor
	copy(bound[:], tensors)
	copyBack := d.unalias(k, bound[:len(tensors)])

	if d.arenaUsed == arenaSlots {
		d.submit()
	}
	key := bgKey{layout: p.layout}
	w := d.words[:0]
	for i, t := range bound[:len(tensors)] {
		off, bytes, elemOff := d.bindRange(t, k.Bindings[i].Write)
		key.entries[i] = bgEntry{t.buf.id, off, bytes}
		w = append(w, uint32(elemOff))
	}
	w = append(w, params...)
	slot := d.arenaUsed
	d.arenaUsed++
	b := d.arenaBytes[slot*paramSlot : (slot+1)*paramSlot]
	for i, v := range w {
		binary.LittleEndian.PutUint32(b[4*i:], v)
	}
	bg, ok := d.bindGroups[key]
	if !ok {
		if len(d.bindGroups) >= maxBindGroups {
			clear(d.bindGroups) // a caller making ever new views; start over rather than grow
		}
		bg = d.bindGroup(key, bound[:len(tensors)])
		d.bindGroups[key] = bg
	}
	d.ensureEncoder()
	if !d.passOpen {
		d.pass = d.encoder.Call("beginComputePass")
		d.passOpen = true
	}
	d.pass.Call("setPipeline", p.gpu)
	d.pass.Call("setBindGroup", 0, bg, d.dynOffsets, slot, 1)
	d.pass.Call("dispatchWorkgroups", gx, gy, gz)
	d.dispatches++
	for i, orig := range tensors {
		if copyBack&(1<<i) != 0 {
			d.Copy(orig, bound[i])
		}
	}
}

// maxBindGroups bounds the bind-group cache.
const maxBindGroups = 4096

// unalias replaces the tensors of one dispatch that WebGPU would refuse to bind together by
// device-owned copies, recording the copies before the dispatch, and returns which writable
// bindings (bit i for tensors[i]) must be copied back after it. WebGPU (its usage-scope rules,
// checked by Dawn) refuses a buffer bound read-only and writable in one dispatch, whatever the
// ranges, and two writable bindings of one buffer whose ranges overlap. The ops allow both —
// GELUBackward's dinp may be its dout; a stage may keep several tensors in one buffer — so:
//   - a read-only input in a buffer the dispatch also writes is read from a copy;
//   - a writable output whose bound range overlaps another writable binding's is computed in a
//     copy (copied in first, since many kernels accumulate) and copied back after.
//
// Each costs a copy; tensors in buffers of their own never pay it.
func (d *Device) unalias(k wgsl.Kernel, ts []*Tensor) (copyBack uint8) {
	n := 0 // alias scratches used
	for i, t := range ts {
		if k.Bindings[i].Write {
			continue
		}
		for j, u := range ts {
			if k.Bindings[j].Write && u.buf == t.buf {
				ts[i] = d.aliasCopy(&n, t)
				break
			}
		}
	}
	for i, t := range ts {
		if !k.Bindings[i].Write {
			continue
		}
		lo, bytes, _ := d.bindRange(t, true)
		for j := 0; j < i; j++ {
			u := ts[j]
			if !k.Bindings[j].Write || u.buf != t.buf {
				continue
			}
			ulo, ubytes, _ := d.bindRange(u, true)
			if lo < ulo+ubytes && ulo < lo+bytes {
				ts[i] = d.aliasCopy(&n, t)
				copyBack |= 1 << i
				break
			}
		}
	}
	return copyBack
}

// aliasCopy records a copy of t into the next alias scratch and returns the copy.
func (d *Device) aliasCopy(n *int, t *Tensor) *Tensor {
	s := d.scratchTensor(&d.aliasScratch[*n], t.n)
	*n++
	d.Copy(s, t)
	return s
}

// bindRange returns the byte range of t's buffer to bind and t's element offset within it.
// A read-only tensor whose buffer fits the adapter's maxStorageBufferBindingSize is bound whole,
// so that every view of the buffer shares one bind group. A writable one (or a larger buffer)
// is bound from t's offset rounded down to minStorageBufferOffsetAlignment to t's end, so that
// outputs in disjoint parts of one buffer do not count as aliased.
func (d *Device) bindRange(t *Tensor, write bool) (off, bytes, elemOff int) {
	total := 4 * max(t.buf.elems, 1)
	if !write && total <= d.maxBinding {
		return 0, total, t.off
	}
	off = (4 * t.off) / d.storageAlign * d.storageAlign
	end := min(4*(t.off+max(t.n, 1)), total)
	if end-off > d.maxBinding {
		panic(fmt.Sprintf("webgpu: a view of %d elements is larger than the adapter's maxStorageBufferBindingSize (%d bytes)", t.n, d.maxBinding))
	}
	return off, end - off, t.off - off/4
}

func (d *Device) bindGroup(key bgKey, tensors []*Tensor) js.Value {
	entries := make([]any, 0, 1+len(tensors))
	entries = append(entries, map[string]any{"binding": 0, "resource": map[string]any{"buffer": d.arena, "offset": 0, "size": paramSlot}})
	for i, t := range tensors {
		e := key.entries[i]
		entries = append(entries, map[string]any{"binding": 1 + i, "resource": map[string]any{"buffer": t.buf.gpu, "offset": e.off, "size": e.bytes}})
	}
	return d.device.Call("createBindGroup", object(map[string]any{
		"layout":  d.layout(key.layout).group,
		"entries": entries,
	}))
}

// grid spreads groups workgroups over x and y (wgsl.Flat, wgsl.Chunked and wgsl.Rows kernels).
func (d *Device) grid(groups int) (gx, gy int) {
	if groups == 0 {
		return 0, 0
	}
	gx = min(groups, d.maxGroups)
	return gx, (groups + gx - 1) / gx
}

// flat records a wgsl.Flat kernel over count invocations.
func (d *Device) flat(name string, count int, tensors []*Tensor, params ...uint32) {
	gx, gy := d.grid((count + wgsl.MaxInvocations - 1) / wgsl.MaxInvocations)
	d.dispatch(name, tensors, params, gx, gy, 1)
}

// rows records a wgsl.Rows kernel over rows rows: a workgroup per row with the GPU variants,
// an invocation per row (128 rows per workgroup) with the fallback ones.
func (d *Device) rows(name string, rows int, tensors []*Tensor, params ...uint32) {
	lanes := 1
	if d.gpuKernels {
		lanes = wgsl.MaxInvocations
	}
	perGroup := wgsl.MaxInvocations / lanes
	gx, gy := d.grid((rows + perGroup - 1) / perGroup)
	d.dispatch(rowPipeline(name, lanes), tensors, params, gx, gy, 1)
}

// rowPipeline names the pipeline of row kernel name with LANES lanes per row.
func rowPipeline(name string, lanes int) string {
	if lanes == wgsl.MaxInvocations {
		return name
	}
	return fmt.Sprintf("%s_lanes%d", name, lanes)
}

func f32bits(f float32) uint32 { return math.Float32bits(f) }

func u32(n int) uint32 {
	if n < 0 || n > math.MaxUint32 {
		panic(fmt.Sprintf("webgpu: size %d does not fit a u32 parameter", n))
	}
	return uint32(n)
}
