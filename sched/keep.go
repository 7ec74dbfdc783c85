package sched

import "slices"

// Keeping holders where they are. The replica planner chooses which peers run and how the model
// is cut; which of several like peers takes which stage it decides by speed alone, blind to what
// each holds. At a join that can cost a checkpoint and a replan of everyone: in step mode a stage
// can be taken up without a checkpoint only from a twin that keeps the same blocks (the
// coordinator's growable, the simulator's handover), and a plan that moves a holder to other
// blocks while a newcomer takes its old ones leaves no such twin. make churn showed it: a
// replica dropped, a worker joins, and the planner's plan of two replicas of two stages — the
// same cuts as before — put the surviving holder of blocks [0,2) on [2,4) and the one of [2,4) on
// [0,2), and every such join restored from a checkpoint.
//
// KeepHolders moves the planner's chosen peers among its own stages so that as many as can stay
// on the blocks they hold — a holder it left out taking a stage of its blocks in place of a
// chosen peer, which then stands by — and takes the result when the planner's objective loses at most
// KeepHoldersLoss by it: same replicas, same cuts, same peers, another assignment, the shares
// divided anew for it.

// KeepHoldersLoss is the share of the planner's objective a plan that keeps holders on their
// blocks may lose against the planner's own assignment. The planner's estimates carry more noise
// than this (step times measured on shared machines move by a fifth: RebalanceMinGain), and a
// checkpoint and a replan of everyone costs far more.
const KeepHoldersLoss = 0.05

// KeepHolders is plan p — the replica planner's plan over peers — with p's peers moved among p's
// stages so that each peer holding a stage's blocks now (held: peer → its blocks [begin, end))
// (among p's peers, or a holder p left out) stays on such a stage where one is left, the
// replicas' shares divided anew (PlanReplicas'
// shares, within each replica's memory). It reports false, with p, when no holder moves back,
// when the replica planner cannot price p (a plan with expert hosts, an unknown peer), or when the
// moved plan's objective falls short of (1 − KeepHoldersLoss) of p's.
func KeepHolders(prof Profile, p Plan, held map[string][2]int, peers []Peer, opt ReplicaOptions) (Plan, bool) {
	if len(p.Experts) > 0 || opt.validate(prof.NumBlocks()) != nil {
		return p, false
	}
	sorted, err := checkPeers(peers)
	if err != nil {
		return p, false
	}
	byID := make(map[string]Peer, len(sorted))
	for _, q := range sorted {
		byID[q.ID] = q
	}
	pl := newReplicaPlanner(prof, opt)
	cs, err := pl.fromPlan(p, byID)
	if err != nil {
		return p, false
	}
	moved, ok := pl.keepHolders(cs, held, sorted)
	if !ok {
		return p, false
	}
	out := pl.plan(moved, sorted)
	out.Version = p.Version
	return out, true
}

// keepHolders is KeepHolders over candidates: reps with their peers moved, and whether the move
// keeps a holder the planner moved within KeepHoldersLoss of its objective. A peer of peers that
// holds blocks (held) and that reps leave out may take a stage of its blocks in place of a
// chosen peer, which then stands by.
func (pl *replicaPlanner) keepHolders(reps []*candidate, held map[string][2]int, peers []Peer) ([]*candidate, bool) {
	type slot struct{ r, i int }
	var slots []slot
	var pool []Peer // the chosen peers in the planner's order
	chosenID := map[string]bool{}
	for r, c := range reps {
		for i, q := range c.peers {
			slots = append(slots, slot{r, i})
			pool = append(pool, q)
			chosenID[q.ID] = true
		}
	}
	var spare []Peer // the holders the planner left out, in the order of peers
	for _, q := range peers {
		if _, ok := held[q.ID]; ok && !chosenID[q.ID] {
			spare = append(spare, q)
		}
	}
	blocks := func(s slot) [2]int { return [2]int{reps[s.r].cuts[s.i], reps[s.r].cuts[s.i+1]} }
	holds := func(q Peer, s slot) bool {
		b, ok := held[q.ID]
		return ok && b == blocks(s)
	}
	chosen := len(pool)
	pool = append(pool, spare...) // the planner's peers first, then the holders it left out
	got := make([]Peer, len(slots))
	taken := make([]bool, len(pool))
	// A holder the planner left on its blocks stays; a stage the planner gave a non-holder goes
	// to an unplaced holder of its blocks, the first in the planner's order; the rest keep their
	// order over the stages left.
	for k, s := range slots {
		if holds(pool[k], s) {
			got[k], taken[k] = pool[k], true
		}
	}
	kept := 0
	for k, s := range slots {
		if got[k].ID != "" {
			continue
		}
		for n, q := range pool {
			if !taken[n] && holds(q, s) {
				got[k], taken[n] = q, true
				kept++
				break
			}
		}
	}
	if kept == 0 {
		return reps, false
	}
	for k := range slots {
		if got[k].ID != "" {
			continue
		}
		n := slices.Index(taken[:chosen], false) // a chosen peer: as many as slots, less those a spare holder took
		got[k], taken[n] = pool[n], true
	}
	out := make([]*candidate, len(reps))
	k := 0
	for r, c := range reps {
		m := &candidate{cuts: slices.Clone(c.cuts)}
		for range c.peers {
			m.peers = append(m.peers, got[k])
			k++
		}
		if !pl.finish(m, 1, pl.most) {
			return reps, false // a peer moved to a stage its memory cannot hold
		}
		out[r] = m
	}
	if want, have := pl.objective(reps), pl.objective(out); !(have > 0 && have >= (1-KeepHoldersLoss)*want) {
		return reps, false
	}
	return out, true
}
