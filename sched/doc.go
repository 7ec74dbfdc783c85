// Package sched is Shoal's planning, as pure functions: the 1F1B pipeline schedule each stage
// runs, a cost model of a model.Config, and the planner that cuts the model's blocks into
// pipeline stages over heterogeneous peers and keeps the rest as standbys (docs/design.md,
// "Scheduling"), and the placement of MoE experts on spare peers by expected load (LPT with
// replicas for hot experts, revised when the load drifts), the replicated planner for fleets of
// thousands of peers (PlanReplicas, AddReplicas, DropReplicas: fleet.go; replicas share the step's
// micro-batches, or in outer mode with ReplicaOptions.OwnBatches each trains a whole batch of its
// own, so that their number is bounded by the peers rather than the micro-batches), and a fleet simulator
// (Simulate: simulate.go) that drives that planner with synthetic volunteers joining and leaving and
// reports goodput, stalls per churn event, and replicas and standbys over time, and the rule book
// (Decide: rules.go) that says what a running job does when a worker leaves or workers join —
// keep going, drop an outer-mode replica, reshare a step-mode replica's micro-batches, restore
// from a checkpoint, stand the newcomers by, grow (take newcomers in with their state from pool
// mates) or checkpoint and replan — which the coordinator and the simulator both follow, with when
// a grow is worth the stall of its handovers (GrowDeferral: growwait.go), who hands a step-mode
// stage its state at a grow (Givers: givers.go; KeepHolders: keep.go moves the planner's workers
// so that holders keep their blocks), and how step-mode replicas share a step's micro-batches by
// their measured pace (WeighRebalance: rebalance.go).
//
// Everything here is a function from (model profile, peers, options) to a value: no network,
// no database, no files, no clocks, no goroutines. That is what lets the planner be tested
// against exhaustive search and run thousands of times in a simulator, and lets the coordinator
// call it while holding its job's state. sched imports the standard library and
// github.com/shoal-ml/shoal/model (for model.Config) only; deps_test.go enforces it.
package sched
