// Package leaktest checks that a test leaves no goroutine behind, with go.uber.org/goleak doing
// the finding and filtering. goleak alone gives up after about half a second of retries, which
// a loaded CI machine (load average ~19) can exceed while connections close on their own
// schedule; Check keeps asking for as long as the caller allows.
package leaktest

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Check fails t if goroutines started after the call are still running patience after t's
// cleanups. Call it first in a test, so that its cleanup runs last.
func Check(t testing.TB, patience time.Duration) {
	t.Helper()
	opts := []goleak.Option{goleak.IgnoreCurrent()}
	t.Cleanup(func() {
		if err := Wait(patience, opts...); err != nil {
			t.Error(err)
		}
	})
}

// Wait returns nil once goleak finds no goroutine outside opts, or its last finding after
// patience.
func Wait(patience time.Duration, opts ...goleak.Option) error {
	deadline := time.Now().Add(patience)
	for {
		err := goleak.Find(opts...) // retries, with back-off, for about half a second
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}
