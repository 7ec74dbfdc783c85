package sched

import "errors"

var (
	// ErrBadInput is wrapped by errors about invalid arguments: a config that does not validate,
	// a peer without an id or with a non-positive speed, duplicate peer ids, M < 1.
	ErrBadInput = errors.New("invalid planner input")
	// ErrNoPlan is wrapped when no assignment of the model's blocks to the peers fits their
	// memory; the error says how much the model needs and what the peers offer.
	ErrNoPlan = errors.New("no plan fits the peers")
	// ErrDeadlock is wrapped by SimulatePipeline when the stages' instruction lists block each
	// other forever.
	ErrDeadlock = errors.New("pipeline deadlock")
	// ErrSchedule is wrapped by SimulatePipeline when an instruction list is inconsistent: a
	// receive that gets another micro-batch than it names, a backward before its forward.
	ErrSchedule = errors.New("inconsistent pipeline schedule")
)
