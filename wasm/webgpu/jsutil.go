//go:build js && wasm

package webgpu

import (
	"context"
	"errors"
	"syscall/js"
)

// Await is await for other packages (the kernel check's page, the browser worker).
func Await(ctx context.Context, p js.Value) (js.Value, error) { return await(ctx, p) }

// await waits for the promise p on the calling goroutine, which must not be a js.Func callback
// (see the package doc). If ctx ends first, await returns ctx's error; the callbacks are
// released once the promise settles, since calling a released js.Func throws in JavaScript.
func await(ctx context.Context, p js.Value) (js.Value, error) {
	type settled struct {
		v   js.Value
		err error
	}
	ch := make(chan settled, 1)
	ok := js.FuncOf(func(_ js.Value, args []js.Value) any {
		v := js.Undefined()
		if len(args) > 0 {
			v = args[0]
		}
		ch <- settled{v: v}
		return nil
	})
	fail := js.FuncOf(func(_ js.Value, args []js.Value) any {
		ch <- settled{err: jsError(args)}
		return nil
	})
	release := func() { ok.Release(); fail.Release() }
	p.Call("then", ok, fail)
	select {
	case s := <-ch:
		release()
		return s.v, s.err
	case <-ctx.Done():
		go func() { <-ch; release() }()
		return js.Undefined(), ctx.Err()
	}
}

// jsError turns a rejection reason (an Error, a GPUError, or anything else) into a Go error.
func jsError(args []js.Value) error {
	if len(args) == 0 {
		return errors.New("promise rejected")
	}
	v := args[0]
	if v.Type() == js.TypeObject {
		if m := v.Get("message"); m.Type() == js.TypeString {
			if n := v.Get("name"); n.Type() == js.TypeString && n.String() != "" && n.String() != "Error" {
				return errors.New(n.String() + ": " + m.String())
			}
			return errors.New(m.String())
		}
	}
	return errors.New(v.String())
}

// object builds a JavaScript object from a Go map (js.ValueOf does the conversion).
func object(m map[string]any) js.Value { return js.ValueOf(m) }
