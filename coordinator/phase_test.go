package coordinator

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/sched"
)

// TestJobPhase: every phase has a name of its own; only planning and recovering run no plan; the
// rule book sees loading and restoring as loading, training and exchange as themselves, and every
// other phase as a boundary (a rejoining plan's survivors still hold their state); and a span
// entered with enterFor puts back the phase it left — unless the plan was left meanwhile, which
// stays left.
func TestJobPhase(t *testing.T) {
	seen := map[string]bool{}
	for p := phasePlanning; p <= phaseEvaluating; p++ {
		name := p.String()
		if name == "unknown" || seen[name] {
			t.Errorf("phase %d is named %q", p, name)
		}
		seen[name] = true
		if want := p != phasePlanning && p != phaseRecovering; p.planned() != want {
			t.Errorf("%s: planned %v, want %v", name, p.planned(), want)
		}
		want := sched.PhaseBoundary
		switch p {
		case phaseLoading, phaseRestoring:
			want = sched.PhaseLoading
		case phaseTraining, phaseEvaluating:
			want = sched.PhaseTraining
		case phaseExchange:
			want = sched.PhaseExchange
		}
		if p.rule() != want {
			t.Errorf("%s: the rule book sees %v, want %v", name, p.rule(), want)
		}
	}
	if got := jobPhase(99).String(); got != "unknown" {
		t.Errorf("phase 99 is %q", got)
	}

	j := &jobRun{phase: phaseBoundary, version: 3}
	restore := j.enterFor(phaseTraining)
	if j.phase != phaseTraining {
		t.Fatalf("entered %s, want training", j.phase)
	}
	inner := j.enterFor(phaseExchange)
	inner()
	if j.phase != phaseTraining {
		t.Errorf("after the exchange: %s, want training", j.phase)
	}
	restore()
	if j.phase != phaseBoundary {
		t.Errorf("after the step: %s, want boundary", j.phase)
	}
	restore = j.enterFor(phaseTraining)
	j.leave(true)
	restore()
	if j.phase != phaseRecovering || j.version != 0 {
		t.Errorf("a plan left during a step: %s, version %d; want recovering, 0", j.phase, j.version)
	}
}

// TestPausedJobEndsWithItsContext: a paused job waits in commands for the admin; when the job
// loop's context ends it returns that, at once. (await's zero wake once read as an event there,
// and the loop spun on the cancelled context for ever.)
func TestPausedJobEndsWithItsContext(t *testing.T) {
	spec := tinyJob(t, 2)
	srv := jobServer(t, spec)
	j := &jobRun{s: srv, spec: spec, sync: newSyncRule(spec), hold: holdPaused, phase: phaseBoundary, version: 1}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan error, 1)
	go func() { done <- j.commands(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("commands returned %v, want the context's error", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("a paused job did not end with its context")
	}
}
