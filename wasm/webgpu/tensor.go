//go:build js && wasm

package webgpu

import (
	"context"
	"fmt"
	"syscall/js"
	"unsafe"

	"github.com/shoal-ml/shoal/kernels/wgsl"
)

// Tensor is a view of n elements of a GPU storage buffer, starting at element off. Tensors made
// by Zeros, FromFloat32 and FromInt32 own their buffer; Slice makes views that share it.
type Tensor struct {
	buf    *buffer
	off, n int
}

type buffer struct {
	id       uint32
	gpu      js.Value
	elems    int
	elem     wgsl.Elem
	released bool
}

// Len is the number of elements of the view.
func (t *Tensor) Len() int { return t.n }

// Elem is the element type, float32 (wgsl.F32) or int32 (wgsl.I32).
func (t *Tensor) Elem() wgsl.Elem { return t.buf.elem }

// Slice returns the view of n elements starting off elements into t. It shares t's buffer:
// writes through one are seen through the other, and releasing either releases both.
func (t *Tensor) Slice(off, n int) *Tensor {
	if off < 0 || n < 0 || off+n > t.n {
		panic(fmt.Sprintf("webgpu: Slice(%d, %d) of a tensor of %d elements", off, n, t.n))
	}
	return &Tensor{buf: t.buf, off: t.off + off, n: n}
}

// grow returns the view of n elements of t's buffer that starts where t starts: a run of
// adjacent views as one (ModelDevice's AdamW runs). It panics past the buffer's end.
func (t *Tensor) grow(n int) *Tensor {
	if n < 0 || t.off+n > t.buf.elems {
		panic(fmt.Sprintf("webgpu: a view of %d elements at %d of a buffer of %d", n, t.off, t.buf.elems))
	}
	return &Tensor{buf: t.buf, off: t.off, n: n}
}

// Zeros allocates a float32 tensor of n zeros (WebGPU zero-initialises every buffer).
func (d *Device) Zeros(n int) *Tensor { return d.alloc(n, wgsl.F32) }

// ZerosInt32 allocates an int32 tensor of n zeros.
func (d *Device) ZerosInt32(n int) *Tensor { return d.alloc(n, wgsl.I32) }

// FromFloat32 allocates a float32 tensor holding x.
func (d *Device) FromFloat32(x []float32) *Tensor {
	t := d.alloc(len(x), wgsl.F32)
	d.upload4(t, unsafe.Pointer(unsafe.SliceData(x)), len(x))
	return t
}

// FromInt32 allocates an int32 tensor holding x (token ids, targets).
func (d *Device) FromInt32(x []int32) *Tensor {
	t := d.alloc(len(x), wgsl.I32)
	d.upload4(t, unsafe.Pointer(unsafe.SliceData(x)), len(x))
	return t
}

func (d *Device) alloc(n int, e wgsl.Elem) *Tensor {
	if n < 0 {
		panic(fmt.Sprintf("webgpu: tensor of %d elements", n))
	}
	bytes := max(4*n, 4) // a binding may not be empty
	if int64(bytes) > d.maxBuffer {
		panic(fmt.Sprintf("webgpu: a tensor of %d elements (%d bytes) exceeds the adapter's maxBufferSize %d", n, bytes, d.maxBuffer))
	}
	d.nextBufferID++
	b := &buffer{
		id:    d.nextBufferID,
		gpu:   d.newBuffer(bytes, gpuBufferUsage("STORAGE", "COPY_SRC", "COPY_DST")),
		elems: n,
		elem:  e,
	}
	return &Tensor{buf: b, n: n}
}

// Release frees t's buffer — and so every view of it — once the work already recorded is done.
func (d *Device) Release(t *Tensor) {
	if t == nil || t.buf.released {
		return
	}
	// A buffer destroyed before the commands that use it are submitted would fail the submit.
	d.submit()
	t.buf.released = true
	t.buf.gpu.Call("destroy")
	for k := range d.bindGroups {
		for _, e := range k.entries[:k.layout.nbind] {
			if e.id == t.buf.id {
				delete(d.bindGroups, k)
				break
			}
		}
	}
}

// Write copies x into the float32 tensor t (len(x) ≤ t.Len()). Work recorded before Write sees
// the old contents: Write submits it first, because queue writes overtake unsubmitted commands.
func (d *Device) Write(t *Tensor, x []float32) {
	d.check(t, len(x), wgsl.F32, "Write")
	d.submit()
	d.upload4(t, unsafe.Pointer(unsafe.SliceData(x)), len(x))
}

// WriteInt32 is Write for int32 tensors.
func (d *Device) WriteInt32(t *Tensor, x []int32) {
	d.check(t, len(x), wgsl.I32, "WriteInt32")
	d.submit()
	d.upload4(t, unsafe.Pointer(unsafe.SliceData(x)), len(x))
}

// upload4 writes n 4-byte elements at p to the start of t through the reused upload array
// (writeBuffer copies its source before returning, so reuse is safe).
func (d *Device) upload4(t *Tensor, p unsafe.Pointer, n int) {
	if n == 0 {
		return
	}
	bytes := 4 * n
	if d.uploadLen < bytes {
		d.upload = js.Global().Get("Uint8Array").New(bytes)
		d.uploadLen = bytes
	}
	js.CopyBytesToJS(d.upload, unsafe.Slice((*byte)(p), bytes))
	d.queue.Call("writeBuffer", t.buf.gpu, 4*t.off, d.upload, 0, bytes)
}

// Read returns the contents of the float32 tensor t. It submits the recorded work and waits for
// it: see the package doc for where it may be called. A GPU error in the work since the previous
// Read is returned here.
func (d *Device) Read(t *Tensor) ([]float32, error) {
	x := make([]float32, t.n)
	return x, d.ReadInto(x, t)
}

// ReadInto is Read into dst, which must hold t.Len() elements.
func (d *Device) ReadInto(dst []float32, t *Tensor) error {
	if len(dst) != t.n {
		return fmt.Errorf("webgpu: ReadInto %d elements from a tensor of %d", len(dst), t.n)
	}
	d.check(t, t.n, wgsl.F32, "Read")
	return d.read(t, unsafe.Pointer(unsafe.SliceData(dst)))
}

// ReadInt32 returns the contents of the int32 tensor t.
func (d *Device) ReadInt32(t *Tensor) ([]int32, error) {
	d.check(t, t.n, wgsl.I32, "ReadInt32")
	x := make([]int32, t.n)
	return x, d.read(t, unsafe.Pointer(unsafe.SliceData(x)))
}

func (d *Device) read(t *Tensor, dst unsafe.Pointer) error {
	if err := d.Err(); err != nil {
		return err
	}
	bytes := 4 * t.n
	if bytes == 0 {
		d.submit()
		return d.popErrorScopes(context.Background())
	}
	if d.stageLen < bytes {
		if d.stageLen > 0 {
			d.staging.Call("destroy")
		}
		d.staging = d.newBuffer(bytes, gpuBufferUsage("MAP_READ", "COPY_DST"))
		d.stageLen = bytes
	}
	d.endPass()
	d.encoder.Call("copyBufferToBuffer", t.buf.gpu, 4*t.off, d.staging, 0, bytes)
	d.submit()
	// A device loss rejects the map, so this wait cannot outlive the device: no ctx needed.
	ctx := context.Background()
	scopeErr := d.popErrorScopes(ctx)
	read := js.Global().Get("GPUMapMode").Get("READ")
	if _, err := await(ctx, d.staging.Call("mapAsync", read, 0, bytes)); err != nil {
		if scopeErr != nil {
			return scopeErr
		}
		if derr := d.Err(); derr != nil {
			return derr
		}
		return fmt.Errorf("webgpu: map the read-back buffer: %w", err)
	}
	view := js.Global().Get("Uint8Array").New(d.staging.Call("getMappedRange", 0, bytes))
	js.CopyBytesToGo(unsafe.Slice((*byte)(dst), bytes), view)
	d.staging.Call("unmap")
	if scopeErr != nil {
		return scopeErr
	}
	return d.Err()
}

// Flush submits the work recorded so far without waiting for it.
func (d *Device) Flush() error {
	d.submit()
	return d.Err()
}

// Finish submits the work recorded so far and waits until the GPU has done it (for timing).
func (d *Device) Finish() error {
	d.submit()
	if _, err := await(context.Background(), d.queue.Call("onSubmittedWorkDone")); err != nil {
		return fmt.Errorf("webgpu: wait for submitted work: %w", err)
	}
	return d.popErrorScopes(context.Background())
}

// check panics when t cannot serve as an operand of n elements of type e: like an index out of
// range in the Go kernels, a wrong shape is a bug in the caller, not a condition to handle.
func (d *Device) check(t *Tensor, n int, e wgsl.Elem, what string) {
	if t == nil {
		panic("webgpu: " + what + ": nil tensor")
	}
	if t.buf.released {
		panic(fmt.Errorf("%w (%s)", ErrReleased, what))
	}
	if t.n < n {
		panic(fmt.Sprintf("webgpu: %s: tensor of %d elements, needs %d", what, t.n, n))
	}
	if t.buf.elem != e {
		panic(fmt.Sprintf("webgpu: %s: %s tensor, needs %s", what, t.buf.elem, e))
	}
}
