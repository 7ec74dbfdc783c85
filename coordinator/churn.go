package coordinator

import (
	"slices"
	"time"

	"github.com/shoal-ml/shoal/sched"
)

// churnLog is what a job has seen of departures, for the planner's expected goodput
// (sched.Churn; docs/design.md, "Churn-aware planning"): how often a worker leaves unannounced
// per second of the workers' sessions, and what a restore has cost the job — from the failure
// until the job is back at the step it had reached. A job that has seen no departure plans for
// speed alone.
type churnLog struct {
	departures int                  // unannounced departures (a drain or a policy pause announces)
	closed     time.Duration        // the sessions of workers that left, in this job
	joined     map[string]time.Time // the live workers' joins
	// Restores: the time the job spent getting back to where it was, over the failures that sent
	// it back. Under churn restores chain — a departure while the job replays — and the time
	// counts once, shared by every failure in it.
	recovering time.Duration // closed recoveries, summed
	recoveries int           // closed recoveries
	failures   int
	held       int // the plans' workers at those failures, summed: the rate they ran at
	// A recovery under way: the job is back once it reaches step target again.
	since  time.Time
	target int
}

func (c *churnLog) join(id string, now time.Time) {
	if c.joined == nil {
		c.joined = map[string]time.Time{}
	}
	c.joined[id] = now
}

// leave ends id's session; announced is a departure the worker asked for at a step boundary
// (Leaving), which costs no restore and is no churn.
func (c *churnLog) leave(id string, now time.Time, announced bool) {
	t, ok := c.joined[id]
	if !ok {
		return // never counted: its departure says nothing of the sessions measured
	}
	c.closed += now.Sub(t)
	delete(c.joined, id)
	if !announced {
		c.departures++
	}
}

// minDepartures is how many unannounced departures a job must have seen before it plans for
// churn: one crash says little of a rate, and a job that lost one worker in an hour should not
// trade its speed for redundancy.
const minDepartures = 2

// churning reports whether the job has seen departures enough to plan for them.
func (c *churnLog) churning() bool { return c.departures >= minDepartures }

// failed marks a restore: the job had reached step, under a plan of held workers.
func (c *churnLog) failed(step int, now time.Time, held int) {
	c.failures++
	c.held += held
	if c.since.IsZero() {
		c.since, c.target = now, step
	}
	c.target = max(c.target, step)
}

// reached is the job completing step: a recovery under way ends when it is back.
func (c *churnLog) reached(step int, now time.Time) {
	if !c.since.IsZero() && step >= c.target {
		c.recovering += now.Sub(c.since)
		c.recoveries++
		c.since = time.Time{}
	}
}

// churn is the planner's view at now. Before any restore was measured a restore is taken to cost
// prior (the job's estimate of one: a reload and half a checkpoint interval replayed).
func (c *churnLog) churn(now time.Time, prior time.Duration) sched.Churn {
	if !c.churning() {
		return sched.Churn{}
	}
	exposure := c.closed
	for _, t := range c.joined {
		exposure += now.Sub(t)
	}
	if exposure <= 0 {
		return sched.Churn{}
	}
	rate := float64(c.departures) / exposure.Seconds()
	// A recovery under way counts for what it has cost so far. Departures interrupt recoveries,
	// so the time per failure understates what one restore costs (sched.RestoreFromRecoveries);
	// until a recovery has ended, the prior is the least a restore is taken to cost.
	restore := prior.Seconds()
	spent := c.recovering
	if !c.since.IsZero() {
		spent += now.Sub(c.since)
	}
	if c.failures > 0 {
		restore = sched.RestoreFromRecoveries(spent.Seconds()/float64(c.failures), rate*float64(c.held)/float64(c.failures))
		if c.recoveries == 0 {
			restore = max(restore, prior.Seconds())
		}
	}
	return sched.Churn{PerPeerRate: rate, RestoreSeconds: restore}
}

// restorePrior is what the job takes a restore to cost before it has measured one: loading the
// checkpoint and replaying half a checkpoint interval, at the recent steps' median (10 s at
// least: a replan waits for the workers to load and report ready).
func (j *jobRun) restorePrior() time.Duration {
	d := 10 * time.Second
	if len(j.stepTimes) > 0 && j.spec.CheckpointEvery > 0 {
		ts := slices.Clone(j.stepTimes)
		slices.Sort(ts)
		d = max(d, time.Duration(j.spec.CheckpointEvery/2)*ts[len(ts)/2])
	}
	return d
}
