package coordinator

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/internal/browsertest"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// TestDashboardWaitingAndCancel: a pinned job with no worker shows a banner saying which stage
// waits for a worker of what memory; Cancel asks first — declined, nothing is sent — and, once
// confirmed, cancels the job even while it waits.
func TestDashboardWaitingAndCancel(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the browser test starts Chromium")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := tinyJob(t, 2)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, KeepServing: true, AdminToken: servingAdmin, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	hs := newTestHTTP(srv.Handler())
	t.Cleanup(hs.Close)
	runCtx, stopRun := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(runCtx) }()
	defer func() { stopRun(); <-runDone }()
	st := awaitStatus(t, srv, "a reason to wait", func(st *Status) bool { return st.Job != nil && st.Job.Waiting != "" })
	id := uuid.MustParse(st.Job.ID)

	b := browsertest.Start(t, ctx, browsertest.Options{})
	bctx := b.Ctx
	signIn(t, bctx, hs.URL)
	pageWait(t, bctx, "the waiting banner", `!document.getElementById('waiting').hidden &&
		document.getElementById('waiting').textContent.includes('stage 1 of 2 (blocks [0,2)) has no worker: waiting for one with ≥ ')`, 20*time.Second)
	pageWait(t, bctx, "the job's Cancel button", `document.querySelector('#jobs button[data-job]') !== null &&
		!document.querySelector('#jobs button[data-job]').disabled`, 20*time.Second)

	// Declined: the click asks, and sends nothing (the handler returns before any request).
	asked, err := chromedp.Run(bctx, chromedp.Evaluate[string](`(() => {
		let asked = '';
		window.confirm = (msg) => { asked = msg; return false; };
		document.querySelector('#jobs button[data-job]').click();
		return asked;
	})()`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(asked, "Cancel job") {
		t.Errorf("Cancel asked %q, want a confirmation", asked)
	}
	if jb, _ := srv.db.Job(ctx, id); jb.State != storage.JobRunning {
		t.Fatalf("declined, the job is %s", jb.State)
	}
	// Confirmed: the job, waiting for workers, is cancelled.
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`window.confirm = () => true;
		document.querySelector('#jobs button[data-job]').click(); true`)); err != nil {
		t.Fatal(err)
	}
	pageWait(t, bctx, "the job cancelled", `[...document.querySelectorAll('#jobs tbody td')].some((td) => td.textContent === 'cancelled')`, 30*time.Second)
	if jb, _ := srv.db.Job(ctx, id); jb.State != storage.JobCancelled {
		t.Errorf("confirmed, the job is %s", jb.State)
	}
	if err := chromedp.Cancel(bctx); err != nil {
		t.Errorf("close Chromium: %v", err)
	}
}
